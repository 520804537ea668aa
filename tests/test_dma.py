"""The accelerator routes on XLA:CPU: the DMA mover's programs, callback and copy
descriptors a GPU runs, executed by the host copy engine (and by the CUDA engine over a
stand-in driver); the faults on it and on the pinned mover's pages route. On a GPU the
same tests run on its own engine, but for those marked ``cpu``."""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import kvxfer
from kvxfer import testing
from kvxfer._hostmem import HostMemory
from kvxfer.engine import COPY_ENGINES, TransferError, dma_refusal
from kvxfer.engine.dma._engines import Copies, HostCopyEngine
from kvxfer.engine.dma._jobs import TICKETS
from kvxfer.engine.dma._engines import CudaCopyEngine, DriverError

from cuda_rig import CUDA_ERROR_OUT_OF_MEMORY, NO_CHECK, FakeDriver, HostStreamEngine, dma_mover

bits = testing.bits
held = kvxfer.engine.staging_bytes_held
PLATFORM = jax.devices()[0].platform
HOST_ENGINE = pytest.mark.cpu("counts the host copy engine's copies (XLA:CPU's)")


def caches_of(dtype: str, layers: int = 3, blocks: int = 16, shape=(8, 64), seed: int = 0):
    return testing.random_caches(layers, blocks, shape, dtype, seed=seed)


def round_trip(mgr, caches, src, dst):
    """Offloads ``src``, loads the pages into ``dst``; returns the caches and the bits
    the blocks held before."""
    before = [bits(c) for c in caches]
    pages = mgr.offload(caches, src, keys=list(range(1, len(src) + 1))).wait()
    new, load = mgr.load(caches, pages, dst)
    assert load.result().verified_prefix == len(src)
    for c, b in zip(new, before):
        assert np.array_equal(bits(c)[dst], b[src])
    return new, before, pages


@pytest.fixture
def relayout(request):
    return request.param


@pytest.mark.parametrize("relayout", ["never", "always"], indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "int8", "float32"])
def test_round_trip_is_bit_exact_and_in_place(dtype, relayout):
    """Every bit comes back (bf16 and fp8 NaN payloads included), in any block order, and
    a load writes the caches' own buffers."""
    caches = caches_of(dtype)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma",
                                dma=kvxfer.DmaOptions(relayout=relayout))
    assert mgr.paths == ["dma"] * 3
    assert dma_mover(mgr, kvxfer.DmaOptions(relayout=relayout)).relayout == (
        relayout == "always")
    before_ptr = [c.unsafe_buffer_pointer() for c in caches]
    new, before, _ = round_trip(mgr, caches, [9, 2, 3, 15], [0, 7, 1, 14])
    assert [c.unsafe_buffer_pointer() for c in new] == before_ptr
    untouched = [b for b in range(16) if b not in (0, 7, 1, 14)]
    for c, b in zip(new, before):
        assert np.array_equal(bits(c)[untouched], b[untouched])
    assert TICKETS.pending() == 0
    mgr.close()


def test_the_pool_lives_outside_xla_and_holds_the_plan():
    caches = caches_of("bfloat16")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma")
    pool = mgr.host_pool.pools[0]
    assert isinstance(pool.memory, HostMemory) and pool.array is None
    assert pool.memory.nbytes == pool.nbytes == mgr.plan.classes[0].host_bytes
    assert pool.data.ctypes.data == pool.memory.address
    mgr.close()


@HOST_ENGINE
def test_adjacent_blocks_merge_into_one_copy(monkeypatch):
    """One layer, consecutive blocks into consecutive slots: one copy each way."""
    engine = HostCopyEngine()
    monkeypatch.setitem(COPY_ENGINES, "cpu", lambda device, copy="batch": engine)
    caches = caches_of("float32", layers=1)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma")
    block = caches[0][0].nbytes
    round_trip(mgr, caches, [4, 5, 6, 7], [10, 11, 12, 13])
    assert engine.copies == 2 and engine.bytes == 2 * 4 * block
    mgr.close()


@pytest.mark.cpu("the staged and raw movers' host copies are XLA:CPU's")
@pytest.mark.parametrize("path, copied", [("dma", 0), ("staged", 0.5), ("raw", 1)])
def test_host_copy_counter(path, copied):
    """The DMA mover copies no payload on the host besides its copy engine's work; the
    staged mover copies its offloads' pages (its loads read the pool in place on
    XLA:CPU), the raw mover both ways."""
    caches = caches_of("float32")
    moved = 2 * 2 * 3 * caches[0][0].nbytes  # 2 pages x 3 layers, each way
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path=path)
    round_trip(mgr, caches, [1, 2], [3, 4])
    assert mgr.stats()["host_copy_bytes"] == moved * copied
    mgr.close()


@pytest.mark.cpu("4 devices (conftest.py's CPU devices)")
def test_sharded_and_replicated_layers_move_on_their_devices():
    mesh = jax.make_mesh((4,), ("tensor",))
    heads = NamedSharding(mesh, P(None, None, "tensor"))
    caches = [jax.device_put(c.reshape(16, 2, 4, 32), heads)
              for c in caches_of("bfloat16", layers=2, shape=(2, 128))]
    replicated = jax.device_put(caches_of("float32", layers=1)[0], NamedSharding(mesh, P()))
    caches.append(replicated)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma")
    assert mgr.paths == ["dma"] * 3
    new, before, _ = round_trip(mgr, caches, [5, 6, 1], [9, 2, 0])
    assert new[0].sharding == heads and new[2].sharding == replicated.sharding
    for shard in new[2].addressable_shards:  # every replica got the pages
        assert np.array_equal(bits(shard.data)[[9, 2, 0]], before[2][[5, 6, 1]])
    mgr.close()


@pytest.mark.parametrize("route", ["dma", "pages"])
@pytest.mark.parametrize("fault", testing.FAULTS)
def test_every_fault_is_caught(fault, route, monkeypatch):
    """On both accelerator routes: the DMA mover, and the pinned mover's pages route
    (what a GPU without ``cuda-bindings`` takes)."""
    path = "dma" if route == "dma" else "pinned"
    sharded = fault == "one-shard"
    if sharded and len(jax.devices()) < 2:
        pytest.skip("one-shard needs 2 devices")
    caches = caches_of("bfloat16", layers=3, blocks=16, shape=(4, 128))
    if sharded:
        mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices()[:2])
        caches = [jax.device_put(c, NamedSharding(mesh, P(None, None, "tensor")))
                  for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path=path, pinned_route="pages")
    assert set(mgr.paths) == {path}
    pages = mgr.offload(caches, [1, 2, 3, 4], keys=[11, 12, 13, 14]).wait()
    out = testing.inject(fault, mgr, caches, pages, index=2, layer=1,
                         device_blocks=[8, 9, 10, 11])
    pages, keys = out if isinstance(out, tuple) else (pages, None)
    if fault == "transfer":
        new, load = mgr.load(caches, pages, [8, 9, 10, 11], keys=keys)
        with pytest.raises(TransferError):
            load.result()
        assert not any(a.is_deleted() for a in new)
    else:
        new, load = mgr.load(caches, pages, [8, 9, 10, 11], keys=keys)
        assert load.result().verified_prefix == 2, (fault, load.result())
    mgr.close()


class _Failing(HostCopyEngine):
    def copy(self, sets, stream, direction="offload", out=None):
        raise OSError("the copy engine is gone")


def test_a_failing_copy_engine_is_a_transfer_error_and_the_caches_stay_usable(monkeypatch):
    caches = caches_of("float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma")
    pages = mgr.offload(caches, [1, 2], keys=[1, 2]).wait()
    monkeypatch.setitem(COPY_ENGINES, PLATFORM, lambda device, copy="batch": _Failing())
    with pytest.raises(TransferError, match="the copy engine is gone"):
        mgr.offload(caches, [3], keys=[3]).wait()
    new, load = mgr.load(caches, pages, [5, 6])
    with pytest.raises(TransferError, match="the copy engine is gone"):
        load.result()
    assert not any(a.is_deleted() for a in new)
    assert np.asarray(new[0]).shape == caches_of("float32")[0].shape
    assert TICKETS.pending() == 0 and mgr.num_free_pages == 6
    mgr.close()


def test_sub_byte_elements_are_refused():
    a = jnp.zeros((8, 64), jnp.int4)
    assert "not whole bytes" in dma_refusal(a)
    with pytest.raises(kvxfer.LayoutError, match="DMA path refused for .* not whole bytes"):
        kvxfer.KVCacheManager([a], num_host_blocks=2, path="dma")


def test_a_permuted_layout_is_refused():
    from jax.experimental.layout import Format, Layout as JaxLayout

    x = jnp.zeros((8, 4, 64), jnp.float32)
    fmt = Format(JaxLayout(major_to_minor=(1, 0, 2)), jax.sharding.SingleDeviceSharding(
        jax.devices()[0]))
    y = jax.device_put(x, fmt)
    assert "not row-major" in dma_refusal(y)
    with pytest.raises(kvxfer.LayoutError, match="not row-major"):
        kvxfer.KVCacheManager([y], num_host_blocks=2, path="dma")


def test_emulated_layouts_are_refused():
    x = jnp.zeros((16, 8, 256), jnp.float32)
    with pytest.raises(ValueError, match="emulated TPU layouts"):
        kvxfer.KVCacheManager([x], num_host_blocks=2, path="dma",
                              layouts=["{2,1,0:T(8,128)}"])


# -- the CUDA engine, over a stand-in driver -------------------------------------------

def _buffers(n: int, size: int):
    src = np.random.default_rng(0).integers(0, 255, n * size, dtype=np.uint8)
    return src, np.zeros_like(src)


@pytest.mark.parametrize("version, batch", [(13000, True), (12080, True), (12040, False)])
def test_cuda_engine_enqueues_one_batch_on_the_stream(version, batch):
    fake = FakeDriver(version=version)
    driver = fake.driver()
    assert driver.batch_abi == ({13000: 13000, 12080: 12080}.get(version))
    engine = CudaCopyEngine(driver, ordinal=3)
    src, dst = _buffers(8, 64)
    order = np.random.default_rng(1).permutation(8)
    copies = Copies.of(dst.ctypes.data + np.arange(8) * 64, src.ctypes.data + order * 64, 64)
    engine.copy([copies], 0xABC, "load")
    assert np.array_equal(dst.reshape(8, 64), src.reshape(8, 64)[order])
    if batch:
        (kind, call), = fake.calls
        assert kind == "batch" and call["count"] == 8 and call["stream"] == 0xABC
        assert call["order"] == 1 and call["num"] == 1 and call["idx0"] == 0
        assert call["src"][0] == 2 and call["dst"] == (1, 3)  # host to device 3
        assert call["failidx"] == (version == 12080)
    else:
        assert [k for k, _ in fake.calls] == ["copy"] * 8
        assert all(call["stream"] == 0xABC for _, call in fake.calls)
    assert engine.copies == 8 and engine.bytes == 8 * 64


def test_cuda_engine_loop_mode_and_errors():
    fake = FakeDriver(fail={"cuMemcpyBatchAsync": CUDA_ERROR_OUT_OF_MEMORY})
    engine = CudaCopyEngine(fake.driver(), ordinal=0)
    src, dst = _buffers(2, 16)
    copies = Copies.of([dst.ctypes.data, dst.ctypes.data + 16], [src.ctypes.data,
                                                                 src.ctypes.data + 16], 16)
    with pytest.raises(DriverError, match=r"cuMemcpyBatchAsync of 2 copies .*out of memory"):
        engine.copy([copies], 1)
    with pytest.raises(DriverError, match="XLA's stream"):
        engine.copy([copies], None)
    looped = CudaCopyEngine(fake.driver(), ordinal=0, mode="loop")
    looped.copy([copies], 7)
    assert np.array_equal(dst, src) and fake.calls[-1][0] == "copy"
    with pytest.raises(ValueError, match="mode="):
        CudaCopyEngine(fake.driver(), ordinal=0, mode="fast")


def test_cuda_engine_pins_host_memory_in_the_primary_context():
    fake = FakeDriver(numa=1)
    engine = CudaCopyEngine(fake.driver(), ordinal=2)
    assert engine.numa_node() == 1
    mem = HostMemory(1 << 20, numa_node=engine.numa_node(), pin=engine.pin)
    assert mem.pinned
    assert fake.registered[mem.address] == (1 << 20, 1, 0x1002)  # portable, device 2's
    assert fake.context == [] and fake.retained == {2: 0}  # retained for the call only
    assert "dc" in vm_flags(mem.address)  # not inherited by a forked child
    mem.close()
    assert mem.address not in fake.registered and fake.context == []
    assert fake.retained == {2: 0}
    plain = HostMemory(1 << 20)
    assert "dc" not in vm_flags(plain.address)  # memory no copy engine locked forks as usual
    assert CudaCopyEngine(FakeDriver(numa=-1).driver(), 0).numa_node() is None  # no NUMA


def vm_flags(address: int) -> list[str]:
    """The kernel's ``VmFlags`` of the mapping holding ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_failed_pin_releases_nothing_twice():
    fake = FakeDriver(fail={"cuMemHostRegister": CUDA_ERROR_OUT_OF_MEMORY})
    engine = CudaCopyEngine(fake.driver(), ordinal=0)
    with pytest.raises(DriverError, match="cuMemHostRegister failed"):
        HostMemory(1 << 16, pin=engine.pin)
    assert fake.context == [] and fake.retained == {0: 0}


@HOST_ENGINE
def test_the_dma_mover_runs_over_the_cuda_engine(monkeypatch):
    """The mover's descriptors through the CUDA engine's batch call: every copy of a
    transfer in one call, bytes exact (on XLA's stream: see the next test for copies
    beside it)."""
    fake = FakeDriver()
    engine = HostStreamEngine(fake.driver(), ordinal=0)
    monkeypatch.setitem(COPY_ENGINES, "cpu", lambda device, copy="batch": engine)
    caches = caches_of("bfloat16", layers=4)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma",
                                dma=kvxfer.DmaOptions(stream="xla", self_check=False))
    round_trip(mgr, caches, [3, 1, 12], [0, 5, 6])
    batches = [call for kind, call in fake.calls if kind == "batch"]
    assert [b["count"] for b in batches] == [12, 12]  # 3 pages x 4 layers, each way
    assert all(b["stream"] == HostStreamEngine.STREAM for b in batches)
    assert [b["src"][0] for b in batches] == [1, 2]  # offload from device, load from host
    mgr.close()


@HOST_ENGINE
def test_a_looping_engine_relayouts_whatever_the_block_size(monkeypatch):
    """A driver without the batch call: ``cuMemcpyAsync`` per page (or run of pages),
    not per layer."""
    fake = FakeDriver(version=12040)
    engine = HostStreamEngine(fake.driver(), ordinal=0)
    assert engine.mode == "loop"
    monkeypatch.setitem(COPY_ENGINES, "cpu", lambda device, copy="batch": engine)
    caches = caches_of("float32", layers=4, shape=(64, 256))  # 64 KiB blocks
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma", dma=NO_CHECK)
    assert dma_mover(mgr).relayout
    caches, _, _ = round_trip(mgr, caches, [3, 1, 12], [0, 5, 6])
    # Pages in consecutive slots and staging rows: one copy each way (without the
    # relayout, one per layer and page: 12 each way).
    assert [kind for kind, _ in fake.calls if kind == "copy"] == ["copy"] * 2
    assert not dma_mover(mgr, kvxfer.DmaOptions(self_check=False, relayout="never")).relayout
    mgr.close()


def test_host_memory_is_zeroed_aligned_and_bound():
    mem = HostMemory(3 << 20, numa_node=0)
    view = mem.view()
    assert view.nbytes == 3 << 20 and not view.any() and mem.address % 4096 == 0
    view[:] = 7
    ctypes.memset(mem.address, 1, 4)
    assert view[:5].tolist() == [1, 1, 1, 1, 7]
    assert mem.numa_node in (0, None)
    assert HostMemory(0).view().nbytes == 0
    with pytest.raises(ValueError, match="nbytes"):
        HostMemory(-1)


def test_prefetch_then_cancel_releases_the_pins():
    """Nothing to stage (the load's program reads the pool); a cancelled load still
    waits for its program, then unpins."""
    import concurrent.futures

    caches = caches_of("float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma")
    pages = mgr.offload(caches, [1, 2], keys=[1, 2]).wait()
    staged = mgr.prefetch(pages)
    new, load = mgr.load(caches, pages, [5, 6], prefetched=staged)
    load.cancel()
    concurrent.futures.wait([load])
    mgr.free(pages)
    assert mgr.num_free_pages == 8 and TICKETS.pending() == 0
    assert not any(a.is_deleted() for a in new)
    mgr.close()


# -- copies beside XLA's stream (the stand-in driver's streams run them late) -------

@HOST_ENGINE
@pytest.mark.parametrize("missing_wait", [False, True])
def test_offload_copies_run_beside_xlas_stream(missing_wait, monkeypatch):
    """An offload's copies run on the engine's own stream, late: the caller's next step
    (a donating write of the offloaded blocks) runs while they are still pending, the
    pages hold the blocks as they were at the call (the copies read the gathered rows
    the offload holds), and only the wait for their event makes the pages complete."""
    
    fake = FakeDriver(delay=0.5)
    engine = HostStreamEngine(fake.driver(), ordinal=0)
    monkeypatch.setitem(COPY_ENGINES, "cpu", lambda device, copy="batch": engine)
    late = []
    if missing_wait:
        # What a mover that forgot the wait would commit; the wait (and the staging's
        # release) comes only at the end, so no copy reads memory already given back.
        from kvxfer.engine.dma import _staging

        finish = _staging.Transfer.finish

        def deferred(state):
            if not state.buffers:  # not the offload's rows
                return finish(state)
            late.append(lambda: finish(state))
        monkeypatch.setattr(_staging.Transfer, "finish", deferred)
    caches = caches_of("float32", layers=4)
    before = [bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma", dma=NO_CHECK)
    pool = mgr.host_pool.pools[0].data
    step = jax.jit(lambda cs: [c.at[jnp.array([3, 1, 12])].set(0) for c in cs],
                   donate_argnums=0)
    jax.block_until_ready(step(testing.random_caches(4, 16, (8, 64), "float32", seed=9)))

    handle = mgr.offload(caches, [3, 1, 12], keys=[1, 2, 3])
    caches = step(caches)  # the engine's next step, dispatched at once
    jax.block_until_ready(caches)
    assert not pool.any()  # the copies are still to come
    if not missing_wait:
        assert not handle.done()  # it ends once the copies are done
    pages = handle.wait()
    side = {call["stream"] for kind, call in fake.calls if kind == "batch"}
    assert side == set(fake.streams) and HostStreamEngine.STREAM not in side
    if missing_wait:
        # Committed before its copies landed: the host pages do not hold the blocks.
        # (A load would not show it: its copies run on the same stream, after them.)
        assert not pool.any()
        for wait in late:
            wait()
        mgr.close()
        return

    new, load = mgr.load(caches, pages, [0, 5, 6])
    assert load.result().verified_prefix == 3
    for c, b in zip(new, before):
        assert np.array_equal(bits(c)[[0, 5, 6]], b[[3, 1, 12]])
    mgr.close()


@HOST_ENGINE
def test_offloads_beside_xlas_stream_hold_bounded_staging(monkeypatch):
    """Past ``DmaOptions.staging_bytes`` of staging in flight on a device, an offload
    runs its copies on XLA's stream (counted in ``stats()``); every byte of the budget
    comes back."""
    
    fake = FakeDriver(delay=0.3)
    engine = HostStreamEngine(fake.driver(), ordinal=0)
    monkeypatch.setitem(COPY_ENGINES, "cpu", lambda device, copy="batch": engine)
    caches = caches_of("float32", layers=2)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma",  # one at a time beside
                                dma=kvxfer.DmaOptions(staging_bytes=1, self_check=False))
    first = mgr.offload(caches, [1, 2], keys=[1, 2])
    second = mgr.offload(caches, [3, 4], keys=[3, 4])
    pages = first.wait() + second.wait()
    streams = [call["stream"] for kind, call in fake.calls if kind == "batch"]
    assert streams[0] in fake.streams and streams[1] == HostStreamEngine.STREAM
    assert mgr.stats()["dma_fallbacks"] == {"budget": 1, "out_of_memory": 0}
    assert held() == 0
    caches, load = mgr.load(caches, pages, [8, 9, 10, 11])
    assert load.result().verified_prefix == 4
    mgr.close()


@pytest.mark.parametrize("field, value, says", [
    ("stream", "aside", "expected one of ('side', 'xla')"),
    ("relayout", "sometimes", "expected one of ('auto', 'always', 'never')"),
    ("copy", "fast", "expected one of ('batch', 'loop')"),
    ("self_check", 1, "expected one of (True, False)"),
    ("staging_bytes", "lots", "'lots' is not a size"),
    ("staging_bytes", -1, "a size is not negative"),
    ("staging_bytes", True, "expected bytes"),
    ("staging_bytes", 1.5, "expected bytes")])
def test_dma_options_refuse_a_bad_value_naming_field_and_value(field, value, says):
    with pytest.raises(ValueError) as err:
        kvxfer.DmaOptions(**{field: value})
    assert str(err.value).startswith(f"DmaOptions({field}={value!r}): ") and says in str(err.value)
    with pytest.raises(TypeError, match="expected a kvxfer.DmaOptions"):
        kvxfer.KVCacheManager(caches_of("float32"), num_host_blocks=2, path="dma",
                              dma={field: value})
    assert kvxfer.DmaOptions(staging_bytes="2GiB").staging_bytes == 2 << 30
