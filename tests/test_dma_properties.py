"""The DMA mover over generated shapes: layers, shard block sizes, shards, dtypes,
relayout, integrity, copy lateness, direction and a failure at each driver call, on
XLA:CPU over the stand-in CUDA driver, whose own streams run every copy late and
report any copy that lands in memory kvxfer let go of after it was enqueued (what a
freed buffer's next owner would see).

Every case is bit-exact, or a ``TransferError`` with the caches alive (and the same
load, without the failure, then exact); no memory is let go of under a copy; and every
compiled load of a staging has no copy of it.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import kvxfer
from kvxfer import testing
from kvxfer.engine import COPY_ENGINES, TransferError
from kvxfer.engine import _programs
from kvxfer.engine.dma._mover import layer_groups
from kvxfer.engine._mover import _args_abstract, _sds

from cuda_rig import FakeDriver, HostStreamEngine

pytestmark = pytest.mark.cpu("the stand-in driver's engine runs on XLA:CPU (2 devices)")

bits = testing.bits
DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "float32")
#: The driver calls of a transfer, each of which may fail (``fail_at``).
CALLS = ("cuMemcpyBatchAsync", "cuMemcpyAsync", "cuEventCreate", "cuEventRecord",
         "cuStreamWaitEvent", "cuMemsetD32Async")
KiB = 1 << 10


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    itemsize = np.dtype(getattr(__import__("ml_dtypes"), dtype, dtype)).itemsize \
        if dtype.startswith("float8") or dtype == "bfloat16" else np.dtype(dtype).itemsize
    shards = draw(st.sampled_from([1, 2, "replicated"]))
    block = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256])) * KiB  # of a shard
    # At most 2 MiB of a page: keeps a case to a second or so on two cores.
    layers = draw(st.integers(1, max(1, min(80, (2 << 20) // block))))
    return dict(
        dtype=dtype, itemsize=itemsize, shards=shards, block=block, layers=layers,
        relayout=draw(st.sampled_from(["auto", "always", "never"])),
        integrity=draw(st.sampled_from(["off", "page"])),
        delay=draw(st.sampled_from([0.0, 0.002, 0.02])),
        copy=draw(st.sampled_from(["batch", "loop"])),
        direction=draw(st.sampled_from(["offload", "load"])),
        fault=draw(st.none() | st.tuples(st.sampled_from(CALLS), st.integers(0, 3))),
        pages=draw(st.integers(1, 4)))


def _caches(case):
    rows = 128 * 4 // case["itemsize"]  # 128 lanes of 4-byte words a row
    per_shard = case["block"] // (rows * case["itemsize"])
    heads = per_shard * (2 if case["shards"] == 2 else 1)
    caches = testing.random_caches(case["layers"], 8, (heads, rows), case["dtype"], seed=3)
    if case["shards"] == 1:
        return caches
    mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices()[:2])
    spec = P(None, "tensor") if case["shards"] == 2 else P()
    return [jax.device_put(c, NamedSharding(mesh, spec)) for c in caches]


def _drain(fake: FakeDriver) -> None:
    """Waits until every copy the stand-in's own streams were given has run."""
    for handle in list(fake.streams):
        fake._cuStreamSynchronize(handle)


@settings(max_examples=24, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_every_case_is_exact_or_a_transfer_error_and_nothing_is_let_go_under_a_copy(case):
    if case["block"] < 4 * KiB and case["shards"] == 2:
        case["block"] = 4 * KiB  # a shard's rows of 128 words, two shards
    with testing.watch_releases() as watch, pytest.MonkeyPatch.context() as m:
        fake = FakeDriver(delay=case["delay"], version=13000 if case["copy"] == "batch"
                          else 12040, watch=watch)
        engine = HostStreamEngine(fake.driver(), ordinal=0)
        m.setitem(COPY_ENGINES, "cpu", lambda device, copy="batch": engine)
        caches = _caches(case)
        before = [bits(c) for c in caches]
        mgr = kvxfer.KVCacheManager(
            caches, num_host_blocks=8, path="dma", integrity=case["integrity"],
            dma=kvxfer.DmaOptions(relayout=case["relayout"], copy=case["copy"],
                                  self_check=False))
        k = case["pages"]
        src, dst = [7, 1, 4, 2][:k], [0, 5, 6, 3][:k]
        try:
            fake.fail_at = case["fault"] if case["direction"] == "offload" else None
            fake._counts.clear()
            try:
                pages = mgr.offload(caches, src, keys=list(range(k))).wait()
            except TransferError:
                assert case["fault"] is not None, "an offload failed with no failure injected"
                fake.fail_at = None
                pages = mgr.offload(caches, src, keys=list(range(k))).wait()
            fake.fail_at = case["fault"] if case["direction"] == "load" else None
            fake._counts.clear()
            new, load = mgr.load(caches, pages, dst)
            try:
                result = load.result()
            except TransferError as e:
                assert case["fault"] is not None, "a load failed with no failure injected"
                assert e.kv_caches is not None
                assert not any(c.is_deleted() for c in e.kv_caches)
                fake.fail_at = None
                new, load = mgr.load(e.kv_caches, pages, dst)
                result = load.result()
            assert result.verified_prefix == k
            for c, b in zip(new, before):
                x = bits(c)
                assert np.array_equal(x[dst], b[src]), "a loaded block differs"
                others = [i for i in range(8) if i not in dst]
                assert np.array_equal(x[others], b[others]), "a block not loaded changed"
        finally:
            mgr.close()
            _drain(fake)
        assert fake.late == [], "a copy ran into memory kvxfer had let go of"


@settings(max_examples=12, deadline=None, derandomize=True)
@given(layers=st.integers(1, 80), block=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256]),
       rows=st.integers(1, 8), unit=st.sampled_from([1, 2, 4]))
def test_no_compiled_load_copies_its_staging(layers, block, rows, unit):
    """Whatever the groups (one layer each from 64 KiB, up to 64 layers a group), the
    load's program reads the staging where it lies: no copy of it, each wait before
    its group's scatters."""
    device = jax.devices()[0]
    block *= KiB
    words = block // 4 * 4 // unit
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32}[unit]
    arrays = tuple(_sds((8, words), dtype, device) for _ in range(layers))
    ids, _, count = _args_abstract(rows, device)
    groups = tuple(layer_groups(layers, block))
    staging = (rows + 1, layers * words)
    text = _programs.compiled("dma_load_side", arrays, _sds((1,), np.uint32, device),
                              _sds(staging, dtype, device), ids, count,
                              options=(groups, True, unit, words)).as_text()
    entry = text[text.index("ENTRY"):]
    name = {1: "u8", 2: "u16", 4: "u32"}[unit]
    shape = f"{name}[{staging[0]},{staging[1]}]"
    assert not any(shape in line.split("=")[1].split("(")[0]
                   for line in entry.splitlines() if re.search(r"\bcopy\(", line)), \
        "the staging is copied"
    assert sum("custom-call(" in line for line in entry.splitlines()) == len(groups)
