"""KvxferOffloadWorker against the interface tpu-inference's offload connector calls.

The contract is what the engine sees: work orders (``TPUReqMeta`` with ``SaveSpec`` /
``LoadSpec``, written here as the engine publishes them) in, and out: finished chunks in
``get_kv_connector_stats().data``, finished requests from ``get_finished()``, the
blocks to recompute from ``get_block_ids_with_load_errors()``, and ``runner.kv_caches``
holding the loaded bytes. Caches are the engine's
``[num_blocks, block_size, heads * 2 / packing, packing, head_dim]``. Neither vLLM nor
tpu-inference is needed.
"""

import dataclasses
import enum
import os
import subprocess
import sys
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvxfer import testing
from kvxfer.integrations import tpu_inference as tpi
from kvxfer.integrations.tpu_inference import KvxferOffloadWorker, OffloadStats

BLOCK = 4  # tokens per block


# -- the engine's work orders, as tpu_offload_connector publishes them ---------------


@dataclasses.dataclass
class SaveSpec:
    num_skip_leading_tokens: int
    num_total_tokens: int
    src_blocks: list
    dst_chunks: list
    is_final_save: bool = False
    skip_save: bool = False


@dataclasses.dataclass
class LoadSpec:
    num_matched_tokens: int
    src_chunks: list
    dst_blocks: list
    can_load: bool = False
    num_skip_leading_tokens: int = 0


@dataclasses.dataclass
class TPUReqMeta:
    req_id: str
    token_ids: list
    local_block_ids: list
    save_spec: SaveSpec | None = None
    load_spec: LoadSpec | None = None


@dataclasses.dataclass
class Metadata:
    requests_meta: list


class Connector:
    """The part of TPUOffloadConnector the worker reads: the step's bound metadata."""

    def __init__(self):
        self.meta = None

    def bind_connector_metadata(self, meta):
        self.meta = meta

    def _get_connector_metadata(self):
        return self.meta


def save_meta(req_id, blocks, chunks, *, final=False, skip=False):
    n = len(blocks) * BLOCK
    return TPUReqMeta(req_id, list(range(n)), list(blocks),
                      save_spec=SaveSpec(0, n, list(blocks), list(chunks), final, skip))


def load_meta(req_id, chunks, blocks, *, local=None):
    n = len(blocks) * BLOCK
    return TPUReqMeta(req_id, list(range(n)), list(local if local is not None else blocks),
                      load_spec=LoadSpec(n, list(chunks), list(blocks), can_load=True))


def cache_shape(dtype, heads=2, blocks=16, head_dim=128):
    packing = 4 // np.dtype(dtype).itemsize  # 32-bit words, as tpu-inference packs them
    return (blocks, BLOCK, heads * 2 // packing, packing, head_dim)


def make_caches(dtype=jnp.bfloat16, layers=3, sharding=None, seed=0, **kw):
    shape = cache_shape(dtype, **kw)
    return testing.random_caches(layers, shape[0], shape[1:], dtype, sharding=sharding,
                                 seed=seed)


def make_worker(caches, chunks=8, **kw):
    conn = Connector()
    cfg = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=BLOCK))
    w = KvxferOffloadWorker(cfg, conn, num_cpu_chunks=chunks, precompile=False, **kw)
    w.register_runner(types.SimpleNamespace(kv_caches=list(caches), mesh=None))
    return w, conn


def step_save(w, conn, *metas):
    """One engine step: start_load_kv when the forward pass starts, saves at its end."""
    conn.bind_connector_metadata(Metadata(list(metas)))
    w.start_load_kv(None)
    w.start_save_kv()
    w.wait_for_saves()


def step_load(w, conn, *metas):
    conn.bind_connector_metadata(Metadata(list(metas)))
    w.start_load_kv(None)
    return w.get_block_ids_with_load_errors()


def blocks_of(caches, block):
    return [testing.bits(c)[block].copy() for c in caches]


def assert_blocks(caches, block, expected, what=""):
    for layer, want in enumerate(expected):
        got = testing.bits(caches[layer])[block]
        assert np.array_equal(got, want), f"layer {layer} of block {block} {what}"


@pytest.fixture
def worker():
    caches = make_caches()
    w, conn = make_worker(caches)
    yield w, conn, caches
    w.close()


# -- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_save_then_load_is_bit_exact_and_reported(dtype):
    caches = make_caches(dtype)
    want = {b: blocks_of(caches, b) for b in (2, 7, 9)}
    w, conn = make_worker(caches)
    try:
        step_save(w, conn, save_meta("s0", [2, 7], [5, 1]), save_meta("s1", [9], [0]))
        stats = w.get_kv_connector_stats()
        assert stats.data["finished_save_chunks"] == {"s0": [[5, 0], [1, 0]], "s1": [[0, 0]]}
        assert w.get_kv_connector_stats() is None  # reset after each read
        before = blocks_of(w.runner.kv_caches, 3)
        assert step_load(w, conn, load_meta("l0", [5, 1, 0], [11, 12, 13])) == set()
        for src, dst in ((2, 11), (7, 12), (9, 13)):
            assert_blocks(w.runner.kv_caches, dst, want[src], f"(from block {src})")
        assert_blocks(w.runner.kv_caches, 3, before, "(not loaded)")
        assert w.get_kv_connector_stats().data["finished_load_chunks"] == \
            {"l0": [[5, 0], [1, 0], [0, 0]]}
        assert w.runner.kv_caches[0].dtype == dtype
    finally:
        w.close()


@pytest.mark.parametrize("unpinned", ["1", "0", None])
def test_unpinned_host_setting_keeps_the_chunks_out_of_pinned_memory(monkeypatch, unpinned):
    """``TPU_OFFLOAD_USE_UNPINNED_HOST=1`` (the engine's switch to unpinned host
    memory) keeps kvxfer's pools out of pinned memory; chunks still round-trip."""
    if unpinned is None:
        monkeypatch.delenv("TPU_OFFLOAD_USE_UNPINNED_HOST", raising=False)
    else:
        monkeypatch.setenv("TPU_OFFLOAD_USE_UNPINNED_HOST", unpinned)
    caches = make_caches()
    want = blocks_of(caches, 2)
    w, conn = make_worker(caches)
    try:
        pinned = [p.pinned for p in w.manager.host_pool.pools]
        if unpinned == "1":
            assert not any(pinned) and w.host_memory_kind == "unpinned_host"
        else:  # kvxfer's choice: on XLA:CPU the auto path keeps its pools pinned
            assert all(pinned) and w.host_memory_kind == "pinned_host"
        step_save(w, conn, save_meta("s0", [2], [5]))
        assert step_load(w, conn, load_meta("l0", [5], [11])) == set()
        assert_blocks(w.runner.kv_caches, 11, want)
    finally:
        w.close()


def test_a_save_stores_the_bytes_of_the_call(worker):
    w, conn, caches = worker
    want = blocks_of(caches, 4)
    conn.bind_connector_metadata(Metadata([save_meta("s", [4], [2])]))
    w.start_load_kv(None)
    w.start_save_kv()
    # The next step overwrites the block (and donates the caches) before the save lands.
    w.runner.kv_caches = [jax.jit(lambda c: c.at[4].set(0), donate_argnums=0)(c)
                          for c in w.runner.kv_caches]
    w.wait_for_saves()
    assert step_load(w, conn, load_meta("l", [2], [10])) == set()
    assert_blocks(w.runner.kv_caches, 10, want)


def test_a_chunk_saved_again_is_overwritten(worker):
    w, conn, caches = worker
    want = blocks_of(caches, 6)
    step_save(w, conn, save_meta("a", [5], [3]))
    old = w.page_of(3)
    step_save(w, conn, save_meta("b", [6], [3]))
    assert not w.manager.is_valid(old) and w.manager.is_valid(w.page_of(3))
    assert step_load(w, conn, load_meta("l", [3], [12])) == set()
    assert_blocks(w.runner.kv_caches, 12, want)


def test_save_steps_are_idempotent_and_final_saves_finish(worker):
    w, conn, _ = worker
    conn.bind_connector_metadata(Metadata([save_meta("f", [1], [1], final=True),
                                           save_meta("k", [], [], final=True, skip=True),
                                           save_meta("n", [2], [2])]))
    w.start_save_kv()
    w.start_save_kv()  # the engine calls it again from get_finished: a no-op
    w.wait_for_saves()
    assert w.get_finished() == ({"f", "k"}, set())
    assert w.get_finished() == (set(), set())
    assert w.get_kv_connector_stats().data["finished_save_chunks"] == \
        {"f": [[1, 0]], "n": [[2, 0]]}
    conn.bind_connector_metadata(Metadata([save_meta("f2", [3], [4], final=True)]))
    w.start_load_kv(None)  # a new step whose forward pass was skipped:
    first, _ = w.get_finished()  # get_finished starts the step's saves itself
    w.wait_for_saves()
    assert first | w.get_finished()[0] == {"f2"}  # reported once, when it has landed


def test_precompile_moves_nothing_and_takes_no_chunk(worker):
    w, _, caches = worker
    before = [testing.bits(c).copy() for c in w.runner.kv_caches]
    assert w.precompile(5) == [1, 2, 4, 8]
    w._precompile_kv_swap_operations()  # the engine's name
    assert all(np.array_equal(testing.bits(c), b) for c, b in zip(w.runner.kv_caches, before))
    assert w.cpu_backend.num_saved_cpu_chunks == 0
    assert w.manager.num_free_pages == 8


@pytest.mark.parametrize("mesh_shape,axes", [((4,), ("tensor",)),
                                             ((2, 2), ("data", "tensor"))])
def test_sharded_caches_round_trip(mesh_shape, axes):
    mesh = jax.make_mesh(mesh_shape, axes)
    sharding = NamedSharding(mesh, P(None, None, "tensor"))  # KV heads over tensor
    caches = make_caches(jnp.bfloat16, heads=4, sharding=sharding)
    want = {b: blocks_of(caches, b) for b in (1, 14)}
    w, conn = make_worker(caches)
    try:
        step_save(w, conn, save_meta("s", [1, 14], [7, 6]))
        assert step_load(w, conn, load_meta("l", [7, 6], [3, 4])) == set()
        assert_blocks(w.runner.kv_caches, 3, want[1])
        assert_blocks(w.runner.kv_caches, 4, want[14])
        assert all(c.sharding == sharding for c in w.runner.kv_caches)
    finally:
        w.close()


@pytest.mark.parametrize("mesh_shape,axes,spec", [
    ((2, 2), ("attn_dp", "model"), P("attn_dp", None, "model")),
    # tpu-inference's BATCH axis names: blocks over ("data", "attn_dp") together.
    ((1, 2, 2), ("data", "attn_dp", "model"), P(("data", "attn_dp"), None, "model"))])
def test_blocks_sharded_over_attention_data_parallelism_round_trip(mesh_shape, axes, spec):
    # vLLM's attn_dp: the block axis split over data-parallel attention (each half of
    # the blocks on its own pair of devices), the heads over model.
    mesh = jax.make_mesh(mesh_shape, axes)
    sharding = NamedSharding(mesh, spec)
    caches = make_caches(jnp.bfloat16, heads=4, sharding=sharding)
    assert {s.data.shape for s in caches[0].addressable_shards} == {(8, BLOCK, 2, 2, 128)}
    want = {b: blocks_of(caches, b) for b in (1, 6, 9, 14)}
    w, conn = make_worker(caches)
    try:
        # Blocks of both halves saved in one request, loaded across the halves.
        step_save(w, conn, save_meta("s", [1, 6, 9, 14], [0, 1, 2, 3]))
        assert step_load(w, conn, load_meta("l", [0, 1, 2, 3], [12, 13, 4, 5])) == set()
        for src, dst in ((1, 12), (6, 13), (9, 4), (14, 5)):
            assert_blocks(w.runner.kv_caches, dst, want[src], f"(from block {src})")
        assert all(c.sharding == sharding for c in w.runner.kv_caches)
        # A flipped host bit in a chunk is a load error from that block on.
        testing.flip_bit(w.manager, w.page_of(2), layer=2)
        assert step_load(w, conn, load_meta("bad", [1, 2, 3], [8, 9, 10])) == {9, 10}
        assert_blocks(w.runner.kv_caches, 8, want[6])
    finally:
        w.close()


def test_hybrid_layers_round_trip():
    caches = make_caches(layers=2) + make_caches(layers=2, heads=4, seed=1)
    want = blocks_of(caches, 8)
    w, conn = make_worker(caches)
    try:
        assert w.grouped_layer_indices == [[0, 1], [2, 3]]
        step_save(w, conn, save_meta("s", [8], [0]))
        chunk = w.cpu_backend.get(0)  # the engine's per-group stacking
        assert [g.shape[0] for g in chunk] == [2, 2]
        assert step_load(w, conn, load_meta("l", [0], [9])) == set()
        assert_blocks(w.runner.kv_caches, 9, want)
    finally:
        w.close()


# -- every save is published once, whoever polls ------------------------------------


class _LandsBetweenReads:
    """An offload handle that lands between the first ``done()`` read and the next:
    the first read waits for the real save and still says False, later ones True."""

    def __init__(self, handle):
        self._handle, self._reads = handle, 0

    def done(self):
        self._reads += 1
        if self._reads == 1:
            self._handle.exception()
            return False
        return self._handle.done()

    def __getattr__(self, name):
        return getattr(self._handle, name)


def test_a_save_landing_between_two_done_reads_is_still_published(worker):
    w, conn, caches = worker
    want = blocks_of(caches, 3)
    offload = w.manager.offload
    w.manager.offload = lambda *a, **kw: _LandsBetweenReads(offload(*a, **kw))
    step_save(w, conn, save_meta("s", [3], [6], final=True))  # polls: not done yet
    assert w.get_finished() == ({"s"}, set())  # the next poll sees it landed
    assert w.get_kv_connector_stats().data["finished_save_chunks"] == {"s": [[6, 0]]}
    assert step_load(w, conn, load_meta("l", [6], [12])) == set()
    assert_blocks(w.runner.kv_caches, 12, want)


WAIT = 30  # seconds: a bound for waits that end at once when the code is right


class _HeldLanding:
    """An offload handle that says it landed only once ``landed`` is set, and whose
    ``result()`` (read while publishing) waits for ``release``."""

    def __init__(self, handle, landed, publishing, release):
        self._handle, self._landed = handle, landed
        self._publishing, self._release = publishing, release

    def done(self):
        return self._landed.is_set() and self._handle.done()

    def result(self, timeout=None):
        self._publishing.set()
        assert self._release.wait(WAIT)
        return self._handle.result(timeout)

    def __getattr__(self, name):
        return getattr(self._handle, name)


def test_wait_for_saves_waits_for_a_save_another_thread_is_publishing(worker):
    w, conn, caches = worker
    landed, publishing, release = threading.Event(), threading.Event(), threading.Event()
    offload = w.manager.offload
    w.manager.offload = lambda *a, **kw: _HeldLanding(offload(*a, **kw), landed,
                                                      publishing, release)
    step_save(w, conn, save_meta("s", [3], [6], final=True))  # not landed: pending
    landed.set()
    first = threading.Thread(target=w.wait_for_saves)  # takes the save, publishes it
    first.start()
    assert publishing.wait(WAIT)  # ... and is held while publishing
    seen = []
    second = threading.Thread(target=lambda: (w.wait_for_saves(),
                                              seen.append("s" in w.finished_save_reqs)))
    second.start()
    second.join(0.5)  # with nothing pending it must still wait for the first's publish
    release.set()
    first.join(WAIT)
    second.join(WAIT)
    assert seen == [True]  # it returned only once the save was published


def test_saves_polled_from_a_second_thread_are_each_published_once(worker):
    w, conn, _ = worker
    seen, stop = [], threading.Event()

    def collect():
        stats = w.get_kv_connector_stats()
        if stats is not None:
            seen.extend((req, c) for req, chunks in
                        stats.data["finished_save_chunks"].items() for c, _ in chunks)

    def poll():
        while not stop.is_set():
            collect()

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        steps = 40
        for step in range(steps):  # four one-chunk saves a step, half the chunks each
            half = 4 * (step % 2)
            conn.bind_connector_metadata(Metadata([
                save_meta(f"r{step}-{i}", [i], [half + i], final=True) for i in range(4)]))
            w.start_load_kv(None)
            w.start_save_kv()
    finally:
        w.wait_for_saves()
        stop.set()
        poller.join()
    collect()
    want = [(f"r{step}-{i}", 4 * (step % 2) + i) for step in range(steps) for i in range(4)]
    assert sorted(seen) == sorted(want)
    assert w.get_finished()[0] == {req for req, _ in want}


# -- faults reach the engine as load errors -------------------------------------------


def test_a_host_bit_flip_is_a_load_error_from_that_block_and_drops_the_chunk(worker):
    w, conn, caches = worker
    want = blocks_of(caches, 1)
    step_save(w, conn, save_meta("s", [1, 2, 3], [4, 5, 6]))
    testing.flip_bit(w.manager, w.page_of(5), layer=1)
    errors = step_load(w, conn, load_meta("l", [4, 5, 6], [10, 11, 12]))
    assert errors == {11, 12}  # the bad block and every block after it
    assert_blocks(w.runner.kv_caches, 10, want)
    assert w.get_block_ids_with_load_errors() == set()  # reported once
    assert w.get_kv_connector_stats().data["finished_load_chunks"]["l"] == \
        [[4, 0], [5, 0], [6, 0]]  # the load is over: the scheduler unpins them
    assert w.page_of(5) is None and w.page_of(6) is not None
    # Every later load of the dropped chunk is a load error too, never its bytes.
    assert step_load(w, conn, load_meta("again", [5], [13])) == {13}
    assert step_load(w, conn, load_meta("rest", [6], [14])) == set()
    assert w.stats()["chunks_dropped"] == 1


def test_a_zero_dma_over_an_intact_copy_is_a_load_error_that_keeps_the_chunk(worker):
    w, conn, caches = worker
    want = blocks_of(caches, 7)
    step_save(w, conn, save_meta("s", [6, 7], [0, 1]))
    testing.zero_dma(w.manager, layer=2, block=9)
    assert step_load(w, conn, load_meta("l", [0, 1], [8, 9])) == {9}
    page = w.page_of(1)
    assert page is not None and w.manager.is_valid(page)
    assert w.manager.stats()["transfer_faults"] >= 1
    assert step_load(w, conn, load_meta("retry", [1], [9])) == set()
    assert_blocks(w.runner.kv_caches, 9, want)


def test_a_transfer_error_is_a_load_error_not_an_exception(worker):
    w, conn, _ = worker
    step_save(w, conn, save_meta("s", [1, 2], [0, 1]))
    with testing.failing_transfer(w.manager, after_layers=1):
        errors = step_load(w, conn, load_meta("l", [0, 1], [5, 6]))
    assert errors == {5, 6}
    assert step_load(w, conn, load_meta("l2", [0, 1], [5, 6])) == set()


def test_bad_work_orders_are_reported_never_raised(worker, caplog):
    w, conn, _ = worker
    # A chunk never saved, a chunk id out of range, a load outside its request's blocks.
    assert step_load(w, conn, load_meta("never", [3], [2])) == {2}
    step_save(w, conn, save_meta("bad", [1], [99]))
    assert step_load(w, conn, load_meta("l", [0], [4], local=[7, 8])) == {4}
    assert "not in host memory" in caplog.text and "99" in caplog.text
    assert w.get_kv_connector_stats().data["finished_load_chunks"]["never"] == [[3, 0]]


# -- loads staged before the first one of the step ------------------------------------


def _spy(w):
    """Records the worker's prefetch and load calls on its (real) manager, in order."""
    calls = []
    mgr = w.manager
    prefetch, load = mgr.prefetch, mgr.load

    def spy_prefetch(pages):
        handle = prefetch(pages)
        calls.append(("prefetch", len(pages), handle))
        return handle

    def spy_load(caches, pages, blocks, **kw):
        calls.append(("load", len(pages), kw.get("prefetched")))
        return load(caches, pages, blocks, **kw)

    mgr.prefetch, mgr.load = spy_prefetch, spy_load
    return calls


def test_every_load_of_a_step_is_staged_before_the_first_load(worker):
    w, conn, caches = worker
    want = {b: blocks_of(caches, b) for b in (2, 3, 8)}
    step_save(w, conn, save_meta("s", [2, 3, 8], [0, 1, 2]))
    calls = _spy(w)
    assert step_load(w, conn, load_meta("a", [0, 1], [10, 11]),
                     load_meta("b", [2], [12])) == set()
    assert [c[:2] for c in calls] == [("prefetch", 2), ("prefetch", 1), ("load", 2),
                                      ("load", 1)]
    assert calls[2][2] is calls[0][2] and calls[3][2] is calls[1][2]  # each its own
    for src, dst in ((2, 10), (3, 11), (8, 12)):
        assert_blocks(w.runner.kv_caches, dst, want[src])


def test_a_chunk_two_requests_load_in_one_step_is_bad_for_both(worker):
    w, conn, caches = worker
    want, want5 = blocks_of(caches, 4), blocks_of(caches, 5)
    step_save(w, conn, save_meta("s", [4, 5], [0, 1]))
    testing.flip_bit(w.manager, w.page_of(1), layer=0)
    # Both requests were staged before the first found the chunk bad: the second's load
    # of it is a load error too, never its bytes.
    errors = step_load(w, conn, load_meta("a", [0, 1], [9, 10]),
                       load_meta("b", [1], [12]))
    assert errors == {10, 12}
    assert_blocks(w.runner.kv_caches, 9, want)
    assert w.page_of(1) is None and w.stats()["chunks_dropped"] == 1
    # No pin is left behind: the chunk is saved again and loads clean.
    step_save(w, conn, save_meta("s2", [5], [1]))
    assert step_load(w, conn, load_meta("c", [1], [13])) == set()
    assert_blocks(w.runner.kv_caches, 13, want5)


def test_a_load_refused_after_staging_leaves_its_chunks_free_to_save(worker):
    w, conn, caches = worker
    want7 = blocks_of(caches, 7)
    step_save(w, conn, save_meta("s", [3], [2]))
    calls = _spy(w)
    # Block 99 is outside the 16-block cache: staged, then refused by the load.
    assert step_load(w, conn, load_meta("l", [2], [99])) == {99}
    assert [c[0] for c in calls] == ["prefetch", "load"]
    assert w.stats()["loads_failed"] == 1
    step_save(w, conn, save_meta("s2", [7], [2]))  # a pinned chunk could not be saved
    assert w.stats()["saves_failed"] == 0
    assert step_load(w, conn, load_meta("l2", [2], [9])) == set()
    assert_blocks(w.runner.kv_caches, 9, want7)


# -- the engine boundary --------------------------------------------------------------


def test_stats_are_the_engines_class_when_it_is_loaded(monkeypatch):
    class EngineStats(OffloadStats):
        pass

    monkeypatch.setitem(sys.modules, tpi._ENGINE_MODULE,
                        types.SimpleNamespace(KVOffloadConnectorStats=EngineStats))
    w, conn = make_worker(make_caches(layers=1))
    try:
        step_save(w, conn, save_meta("s", [1], [0]))
        assert type(w.get_kv_connector_stats()) is EngineStats
    finally:
        w.close()


def test_the_connector_class_is_built_from_the_engine_on_first_access(monkeypatch):
    class Role(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class Base:
        def __init__(self, vllm_config, role, kv_cache_config=None):
            self.role = role

    class EngineConnector(Base):
        def __init__(self, *a, **kw):
            raise AssertionError("the engine's __init__ builds the engine's worker")

    engine = types.ModuleType(tpi._ENGINE_MODULE)
    engine.__dict__.update(KVConnectorBase_V1=Base, KVConnectorRole=Role,
                           TPUOffloadConnector=EngineConnector,
                           TPUOffloadConnectorScheduler=lambda cfg: ("sched", cfg))
    monkeypatch.setitem(sys.modules, tpi._ENGINE_MODULE, engine)
    import importlib

    cls = getattr(importlib.import_module("kvxfer.integrations.tpu_inference"),
                  "KvxferOffloadConnector")
    assert issubclass(cls, EngineConnector)
    cfg = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(block_size=BLOCK),
        parallel_config=types.SimpleNamespace(pipeline_parallel_size=1,
                                              data_parallel_size=1))
    sched = cls(cfg, Role.SCHEDULER)
    assert sched.connector_worker is None and sched.get_block_ids_with_load_errors() == set()
    conn = cls(cfg, Role.WORKER)
    assert isinstance(conn.connector_worker, KvxferOffloadWorker)
    conn.connector_worker._load_errors = {3}
    assert conn.get_block_ids_with_load_errors() == {3}
    cfg.parallel_config.data_parallel_size = 2
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        cls(cfg, Role.WORKER)


def test_importing_kvxfer_or_the_integration_imports_no_engine():
    code = ("import sys, kvxfer; assert 'kvxfer.integrations' not in sys.modules; "
            "import kvxfer.integrations.tpu_inference as t; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'tpu_inference')]; "
            "assert not bad, bad; assert t.ENGINE_COMMIT in t.__doc__")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@jax.jit
def _spin(x, n):
    # A step still running on one device: n rounds of arithmetic, then bf16 x as it
    # was (a select of its raw bits).
    def body(c):
        i, acc = c
        return i + 1, acc * 1.0000001 + 1e-7
    _, acc = jax.lax.while_loop(lambda c: c[0] < n, body, (0, jnp.zeros(4096, jnp.float32)))
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16)  # (XLA:CPU computes bf16 in f32)
    return jax.lax.bitcast_convert_type(jnp.where(acc[0] < -1.0, 0, bits), x.dtype)


def test_a_save_is_reported_only_once_every_rank_landed():
    # tpu-inference #3152: a save counted finished after the first worker. Here the
    # tensor-parallel rank on device 3 is still computing the step whose blocks the
    # save copies: the save is not reported (chunks or request) until that rank's
    # share has landed too, and then every rank's bytes are there.
    mesh = jax.make_mesh((4,), ("tensor",))
    sharding = NamedSharding(mesh, P(None, None, "tensor"))
    caches = make_caches(jnp.bfloat16, heads=4, sharding=sharding)
    want = blocks_of(caches, 2)
    # (The staged route: the raw route copies on the caller's thread, once the step
    # producing the blocks is done, so there the save cannot even start early.)
    w, conn = make_worker(caches, path="staged")
    try:
        step_save(w, conn, save_meta("warm", [1], [4]))  # compiles the save's programs
        slow = []  # the step's output: layer 0's share on device 3 still computing
        for i, c in enumerate(caches):
            shards = [s.data for s in sorted(c.addressable_shards,
                                             key=lambda s: s.device.id)]
            if i == 0:
                shards[3] = _spin(shards[3], 40_000)  # about a second, device 3 only
                slow.append(shards[3])
            w.runner.kv_caches[i] = jax.make_array_from_single_device_arrays(
                c.shape, sharding, shards)
        conn.bind_connector_metadata(Metadata([save_meta("s", [2], [5], final=True)]))
        w.start_load_kv(None)
        w.start_save_kv()
        polls = 0
        while not slow[0].is_ready():  # rank 3 has not even produced its blocks yet
            finished, _ = w.get_finished()
            assert "s" not in finished and w.cpu_backend.num_saved_cpu_chunks == 1
            stats = w.get_kv_connector_stats()  # (None: nothing to report)
            assert stats is None or "s" not in stats.data.get("finished_save_chunks", {})
            polls += 1
        assert polls  # the check above ran while the rank was behind
        w.wait_for_saves()
        assert w.get_finished()[0] == {"s"}
        assert step_load(w, conn, load_meta("l", [5], [9])) == set()
        assert_blocks(w.runner.kv_caches, 9, want)  # every rank's share of the block
    finally:
        w.close()


@pytest.mark.parametrize("timeout", [1e300, 10**400])
def test_wait_for_saves_takes_any_finite_timeout(worker, timeout):
    w, conn, caches = worker
    conn.bind_connector_metadata(Metadata([save_meta("s", [3], [6], final=True)]))
    w.start_load_kv(None)
    w.start_save_kv()
    w.wait_for_saves(timeout)  # an OverflowError out of a condition's wait before
    assert w.get_finished()[0] == {"s"}
    with pytest.raises(ValueError, match="timeout=-1 must be None or a finite number"):
        w.wait_for_saves(-1)
