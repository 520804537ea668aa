"""KVCacheManager: round trips over every config, mixed slice classes, bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import kvxfer
from kvxfer import config, testing
from kvxfer.probe import run_probe

CONFIGS = ["tiny", "llama3-8b", "gemma-mixed", "deepseek-mla", "llama3-8b-fp8", "int8-kv",
           "seed-good", "seed-interleaved"]


bits = testing.bits


def check_loaded(caches, before, src, dst):
    """Blocks ``dst`` hold the bits that blocks ``src`` held before; nothing else moved."""
    for i, (a, b) in enumerate(zip(caches, before)):
        got = bits(a)
        assert np.array_equal(got[dst], b[src]), f"layer {i}: moved blocks differ"
        rest = np.setdiff1d(np.arange(b.shape[0]), dst)
        assert np.array_equal(got[rest], b[rest]), f"layer {i}: other blocks changed"


@pytest.mark.parametrize("devices", [1, 4])
@pytest.mark.parametrize("name", CONFIGS)
def test_probe_round_trip_every_config(name, devices):
    report = run_probe(name, num_pages=8, num_blocks=16, devices=devices, integrity="off",
                       seed=devices)
    assert report["ok"], report["layers"]
    assert report["summary"]["verified_prefix"] == 8
    assert len(report["layers"]) == config.load_builtin(name).num_layers


@pytest.mark.parametrize("path", ["staged", "raw", "pinned"])
def test_probe_paths(path):
    report = run_probe("tiny", num_pages=8, num_blocks=16, path=path, integrity="off")
    assert report["ok"]
    assert set(r["path"] for r in report["layers"]) == {{"raw": "emulated"}.get(path, path)}


def test_raw_path_refuses_seed_layout_and_staged_still_round_trips():
    report = run_probe("seed-interleaved", num_pages=4, num_blocks=16, path="raw")
    assert report["ok"]
    assert "rule 'block dim outermost' failed" in report["raw_refused"]
    assert "{2,0,1:T(8,128)(2,1)}" in report["raw_refused"]


@pytest.fixture
def tiny_caches():
    spec = config.load_builtin("tiny")
    return spec, spec.build_caches(16, seed=3)


def test_sharded_layers_move_per_shard(tiny_caches):
    spec, _ = tiny_caches
    caches = spec.build_caches(16, devices=jax.devices()[:4], seed=5)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, integrity="off")
    before = [bits(c) for c in caches]
    pages = mgr.offload(caches, [9, 2, 5], keys=[1, 2, 3]).wait()
    assert [c.num_shards for c in mgr.plan.classes] == [1, 4]  # replicated, sharded
    assert [c.replicas for c in mgr.plan.classes] == [4, 1]
    caches, handle = mgr.load(caches, pages, [0, 15, 7])
    assert handle.result().verified_prefix == 3
    check_loaded(caches, before, [9, 2, 5], [0, 15, 7])
    for i, c in enumerate(caches):  # every shard and replica holds its part of block 0
        for s in c.addressable_shards:
            part = before[i][9][s.index[1:]]
            assert np.array_equal(bits(s.data)[0], part), (i, s.device)
    assert caches[2].sharding.spec == P(None, None, None, "kv")


def test_replicas_all_receive_the_page():
    mesh = Mesh(np.array(jax.devices()[:4]), ("kv",))
    x = jax.device_put(np.arange(8 * 16, dtype=np.float32).reshape(8, 16),
                       NamedSharding(mesh, P()))
    mgr = kvxfer.KVCacheManager([x], num_host_blocks=2, integrity="page")
    pages = mgr.offload([x], [3], keys=[7]).wait()
    (y,), handle = mgr.load([x], pages, [6])
    assert handle.result().verified_prefix == 1
    for s in y.addressable_shards:
        assert np.array_equal(np.asarray(s.data)[6], np.arange(48, 64, dtype=np.float32))


def test_mixed_classes_address_each_layer_with_its_own_slice(tiny_caches):
    spec, caches = tiny_caches
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8)
    sizes = [mgr.plan.class_of_layer(i)[0].bytes_per_block for i in range(4)]
    assert sizes[0] != sizes[2]  # two slice classes of different sizes
    before = [bits(c) for c in caches]
    src, dst = [4, 11, 6], [13, 1, 8]
    pages = mgr.offload(caches, src, keys=[b"p0", b"p1", b"p2"]).wait()
    for layer, kind in [(1, bytes), (2, bytearray), (3, memoryview)]:
        pattern = (np.arange(sizes[layer]) * (layer + 3) % 251).astype(np.uint8)
        mgr.write_block_bytes(pages[1], layer, kind(pattern.tobytes()))
        assert mgr.read_block_bytes(pages[1], layer) == pattern.tobytes()
    caches, handle = mgr.load(caches, pages, dst)
    assert handle.result().verified_prefix == 3
    for i, (a, b) in enumerate(zip(caches, before)):
        got = bits(a)
        expected = b.copy()
        expected[dst] = b[src]
        if i in (1, 2, 3):
            pattern = (np.arange(sizes[i]) * (i + 3) % 251).astype(np.uint8)
            expected[dst[1]] = pattern.view(expected.dtype).reshape(expected.shape[1:])
        assert np.array_equal(got, expected), f"layer {i}"


def test_write_block_bytes_rejects_bad_data(tiny_caches):
    _, caches = tiny_caches
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    (page,) = mgr.offload(caches, [0], keys=[1]).wait()
    with pytest.raises(ValueError, match="layer 0: 3 bytes given, a block is 8192"):
        mgr.write_block_bytes(page, 0, b"abc")
    with pytest.raises(TypeError, match="bytes, bytearray or memoryview"):
        mgr.write_block_bytes(page, 0, "text")


# -- bad input: each error names what is wrong and leaves earlier pages loadable ----


@pytest.fixture
def mgr_with_pages(tiny_caches):
    _, caches = tiny_caches
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=6)
    before = [bits(c) for c in caches]
    pages = mgr.offload(caches, [3, 7], keys=[10, 11]).wait()
    return mgr, caches, before, pages


def assert_pages_intact(mgr, caches, before, pages):
    caches, handle = mgr.load(caches, pages, [14, 12])
    assert handle.result().verified_prefix == 2
    check_loaded(caches, before, [3, 7], [14, 12])


def test_duplicate_ids(mgr_with_pages):
    mgr, caches, before, pages = mgr_with_pages
    with pytest.raises(ValueError, match=r"device_blocks\[2\] = 5 duplicates device_blocks\[0\]"):
        mgr.offload(caches, [5, 6, 5], keys=[1, 2, 3])
    with pytest.raises(ValueError, match=r"device_blocks\[1\] = 4 duplicates"):
        mgr.load(caches, pages, [4, 4])
    assert mgr.num_free_pages == 4  # nothing allocated by the refused offload
    assert_pages_intact(mgr, caches, before, pages)


@pytest.mark.parametrize("small", [256, -1], ids=["python", "numpy"])
def test_block_ids_are_checked_alike_on_the_short_and_the_general_path(mgr_with_pages,
                                                                      monkeypatch, small):
    """Short id lists are checked in Python, others with numpy: the same ids pass, as
    ``int32``, and the same faults are named either way."""
    from kvxfer.manager import _checks
    mgr, caches, before, pages = mgr_with_pages
    monkeypatch.setattr(_checks, "_SMALL", small)
    for ids in ([14, 12], (0, 15), [np.int64(3), 7], np.array([9, 1])):
        got = mgr._checks.blocks(ids, 2, "pages")
        assert [a.dtype for a in got.values()] == [np.int32] * len(got)
        assert all(a.tolist() == [int(b) for b in ids] for a in got.values())
    assert mgr._checks.blocks([], 0, "pages")[0].shape == (0,)
    for ids, match in (([4, 4], r"device_blocks\[1\] = 4 duplicates device_blocks\[0\]"),
                       ([0, 16], r"device_blocks\[1\] = 16 is out of range for layer 0"),
                       ([-1, 2], r"device_blocks\[0\] = -1 is out of range"),
                       ([True, 2], r"device_blocks\[0\] = True is a bool"),
                       ([1.0, 2], r"must be a 1-D sequence of ints"),
                       ([1], r"1 device_blocks for 2 pages")):
        with pytest.raises(ValueError, match=match):
            mgr._checks.blocks(ids, 2, "pages")
    assert_pages_intact(mgr, caches, before, pages)


def test_out_of_range_ids(mgr_with_pages):
    mgr, caches, before, pages = mgr_with_pages
    with pytest.raises(ValueError, match=r"device_blocks\[1\] = 16 is out of range for layer 0"):
        mgr.offload(caches, [0, 16], keys=[1, 2])
    with pytest.raises(ValueError, match=r"device_blocks\[0\] = -1 is out of range"):
        mgr.load(caches, pages, [-1, 2])
    assert_pages_intact(mgr, caches, before, pages)


def test_wrong_dtype_or_shape_on_load(mgr_with_pages):
    mgr, caches, before, pages = mgr_with_pages
    bad = list(caches)
    bad[2] = caches[2].astype(jnp.float32)
    with pytest.raises(ValueError, match=r"layer 2: got f32\[16,16,2,4,64\], the manager was "
                                         r"built for bf16\[16,16,2,4,64\]"):
        mgr.load(bad, pages, [0, 1])
    bad[2] = caches[2][:8]
    with pytest.raises(ValueError, match=r"layer 2: got bf16\[8,16,2,4,64\]"):
        mgr.load(bad, pages, [0, 1])
    with pytest.raises(ValueError, match="kv_caches has 3 layers; the manager has 4"):
        mgr.load(caches[:3], pages, [0, 1])
    assert_pages_intact(mgr, caches, before, pages)


def test_deleted_array(mgr_with_pages):
    mgr, caches, before, pages = mgr_with_pages
    donated = list(caches)
    donated[1] = jnp.array(caches[1])
    jax.jit(lambda x: x + 0, donate_argnums=0)(donated[1])
    with pytest.raises(ValueError, match="layer 1 is a deleted array"):
        mgr.offload(donated, [0], keys=[1])
    with pytest.raises(ValueError, match="layer 1 is a deleted array"):
        kvxfer.KVCacheManager(donated, num_host_blocks=2)
    assert_pages_intact(mgr, caches, before, pages)


def test_a_returned_cache_donated_since_is_refused_by_the_next_load(mgr_with_pages):
    # The caches a load returned pass the next call's checks at once, save one a step
    # has donated since: that one is still named.
    mgr, caches, before, pages = mgr_with_pages
    caches, handle = mgr.load(caches, pages[:1], [14])
    handle.result()
    jax.jit(lambda x: x + 0, donate_argnums=0)(caches[2])
    with pytest.raises(ValueError, match="layer 2 is a deleted array"):
        mgr.load(caches, pages[1:], [12])
    with pytest.raises(ValueError, match="layer 2 is a deleted array"):
        mgr.offload(caches, [0], keys=[1])


def test_caches_a_load_consumed_are_refused_naming_that_load(mgr_with_pages):
    mgr, caches, before, pages = mgr_with_pages
    new, handle = mgr.load(caches, pages[:1], [14])
    handle.result()
    assert caches[0].is_deleted()  # load() donates what it is given
    for call in (lambda: mgr.load(caches, pages[1:], [12]),
                 lambda: mgr.offload(caches, [0], keys=[1])):
        with pytest.raises(ValueError, match=r"layer 0 was consumed by this manager's "
                           r"load\(\) \(its load number 1\).* pass the arrays that load "
                           "returned"):
            call()
    mgr.free(mgr.offload(new, [0], keys=[1]).wait())  # what it returned is usable


def test_unmaterialized_cache_times_out_naming_the_layer(tiny_caches):
    _, caches = tiny_caches

    @jax.jit
    def slow(x):
        m = jnp.ones((384, 384), jnp.float32)
        m = jax.lax.fori_loop(0, 400, lambda i, m: jnp.tanh(m @ m), m)
        return x + m[0, 0] * 0

    pending = list(caches)
    pending[3] = slow(caches[3])
    if pending[3].is_ready():
        pytest.skip("the computation finished before it could be observed")
    with pytest.raises(TimeoutError, match="layer 3 is still being computed after 0.01 s"):
        kvxfer.KVCacheManager(pending, num_host_blocks=2, ready_timeout=0.01)
    mgr = kvxfer.KVCacheManager(pending, num_host_blocks=2)  # waits, then works
    assert mgr.plan.num_layers == 4


def test_budget_refused_before_allocation_and_staged_accepted():
    spec = config.load_builtin("seed-interleaved")
    layers = spec.layer_specs()
    with pytest.raises(kvxfer.BudgetError,
                       match=r"host plan needs 221.02 GiB .* hold device bytes"):
        kvxfer.make_plan(layers, 1886, path="raw", host_memory_budget=16 << 30)
    with pytest.raises(ValueError, match="path='direct' is now called path='raw'"):
        kvxfer.make_plan(layers, 1886, path="direct")
    plan = kvxfer.make_plan(layers, 1886, path="staged", host_memory_budget=16 << 30)
    assert plan.classes[0].bytes_per_block == 3 * 2048 * 2
    assert plan.total_host_bytes == 1886 * 20 * 3 * 2048 * 2


def test_manager_budget_error_leaves_pages_of_other_managers(mgr_with_pages):
    mgr, caches, before, pages = mgr_with_pages
    with pytest.raises(kvxfer.BudgetError, match="over the budget of 1 MiB"):
        kvxfer.KVCacheManager(caches, num_host_blocks=1000, host_memory_budget=1 << 20)
    assert_pages_intact(mgr, caches, before, pages)


def test_pool_exhaustion_and_frees(mgr_with_pages):
    mgr, caches, before, pages = mgr_with_pages
    with pytest.raises(kvxfer.PoolExhaustedError, match="5 pages requested, 4 of 6 slots free"):
        mgr.offload(caches, [0, 1, 2, 4, 5], keys=[1, 2, 3, 4, 5])
    extra = mgr.offload(caches, [0], keys=[9]).wait()
    mgr.free(extra)
    with pytest.raises(kvxfer.PoolError, match="double free of host slot"):
        mgr.free(extra)
    with pytest.raises(kvxfer.PoolError, match="unknown host slot 99"):
        mgr.free([kvxfer.PageRef(1, 99, 1)])
    assert_pages_intact(mgr, caches, before, pages)


def test_stale_page_ref_is_a_miss_not_a_load(mgr_with_pages):
    mgr, caches, before, pages = mgr_with_pages
    mgr.free(pages[1:])
    reused = mgr.offload(caches, [0, 1, 2, 4], keys=[20, 21, 22, 23]).wait()
    assert pages[1].slot in [p.slot for p in reused]
    caches, handle = mgr.load(caches, pages, [14, 12])
    result = handle.result()
    assert result.verified_prefix == 1 and result.invalid_pages == (1,)
    assert result.reasons[1].startswith("stale generation")
    check_loaded(caches, before, [3], [14])


def test_freed_page_ref_is_a_miss_naming_why(mgr_with_pages):
    mgr, caches, before, pages = mgr_with_pages
    mgr.free(pages[1:])
    caches, handle = mgr.load(caches, pages, [14, 12])
    result = handle.result()
    assert result.verified_prefix == 1 and result.reasons == {1: f"freed ({pages[1]})"}
    check_loaded(caches, before, [3], [14])


def never_valid_refs(mgr, pages):
    """Refs no offload of ``mgr`` returned, each with what the error must name."""
    p = pages[0]
    other = kvxfer.KVCacheManager([jnp.zeros((8, 128))], num_host_blocks=8)
    for j in range(3):  # another manager's pool, ahead of this one's generations
        other.offload([jnp.zeros((8, 128))], [0], keys=[j], slots=[p.slot]).wait()
    (foreign,) = other.offload([jnp.zeros((8, 128))], [1], keys=[5], slots=[p.slot]).wait()
    other.close()
    return [(kvxfer.PageRef(p.key, 6, 1), "unknown host slot; slots are 0..5"),
            (kvxfer.PageRef(p.key, p.slot, 0), "generation 0 was never issued"),
            (kvxfer.PageRef(p.key, p.slot, p.generation + 1),
             f"generation {p.generation + 1} was never issued for this slot (it is at "
             f"generation {p.generation})"),
            (foreign, "was never a page of this manager")]


@pytest.mark.parametrize("case", range(4))
def test_a_ref_that_was_never_valid_raises_rather_than_missing(mgr_with_pages, case):
    mgr, caches, before, pages = mgr_with_pages
    ref, match = never_valid_refs(mgr, pages)[case]
    with pytest.raises(kvxfer.PoolError, match=re.escape(match)) as e:
        mgr.load(caches, [pages[0], ref], [14, 12])
    assert isinstance(e.value, ValueError) and "pages[1]" in str(e.value)
    with pytest.raises(kvxfer.PoolError, match=re.escape(match)):
        mgr.prefetch([ref])
    with pytest.raises(kvxfer.PoolError, match="was never issued|unknown host slot"):
        mgr.free([ref])  # not taken for a stale ref ("the slot reused")
    assert mgr.num_free_pages == 4  # nothing pinned or freed
    assert_pages_intact(mgr, caches, before, pages)


def test_wrong_key_is_a_miss(mgr_with_pages):
    mgr, caches, before, pages = mgr_with_pages
    caches, handle = mgr.load(caches, pages, [14, 12], keys=[10, 99])
    result = handle.result()
    assert result.verified_prefix == 1 and "wrong key" in result.reasons[1]


def test_bad_arguments_name_the_value(tiny_caches):
    _, caches = tiny_caches
    with pytest.raises(ValueError, match="integrity='fast'"):
        kvxfer.KVCacheManager(caches, num_host_blocks=2, integrity="fast")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    with pytest.raises(ValueError, match=r"keys\[0\]: key -1 of type int"):
        mgr.offload(caches, [0], keys=[-1])
    with pytest.raises(ValueError, match="gate='some'"):
        mgr.load(caches, [], [], gate="some")
    with pytest.raises(TypeError, match=r"pages\[0\]: expected a PageRef"):
        mgr.load(caches, [(0, 1)], [0])


def test_plan_prints_a_table(tiny_caches):
    _, caches = tiny_caches
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8)
    text = str(mgr.plan)
    assert "bytes/block" in text and "host bytes" in text and "total:" in text
    assert mgr.host_pool.nbytes == mgr.plan.total_host_bytes
    mgr.close()


@pytest.mark.parametrize("path", ["auto", "raw", "staged", "pinned"])
def test_plan_table_names_the_mover_of_each_class(path):
    caches = (testing.random_caches(2, 8, (4, 128), "float32", seed=1)
              + testing.random_caches(1, 8, (2, 128), "bfloat16", seed=2))
    with kvxfer.KVCacheManager(caches, num_host_blocks=2, path=path) as mgr:
        lines = str(mgr.plan).splitlines()
        assert lines[0].split()[-1] == "mover"
        total = next(i for i, line in enumerate(lines) if line.startswith("total:"))
        movers = [mgr.paths[c.layers[0]] for c in mgr.plan.classes]
        assert [line.split()[-1] for line in lines[2:total]] == movers
        assert mgr.plan.movers == tuple(movers)
        assert [c["mover"] for c in mgr.plan.as_dict()["classes"]] == movers
        # The plan sizes host blocks; it no longer claims a path for every mover.
        assert "path" not in lines[total] and "dense logical bytes" in lines[total]
        assert lines[-1].startswith("budget: ") and lines[-1].endswith(" bytes)")
    alone = kvxfer.make_plan([kvxfer.LayerSpec("L0", (8, 4, 128), "float32")], 2,
                             path="raw")
    assert "mover" not in str(alone) and "host blocks hold device bytes" in str(alone)


def test_caches_must_keep_the_layout_and_sharding_they_were_registered_with(tiny_caches):
    from jax.experimental.layout import Format

    _, caches = tiny_caches
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    pages = mgr.offload(caches, [1], keys=[1]).wait()
    moved = list(caches)
    moved[1] = jax.device_put(caches[1], jax.devices()[1])
    with pytest.raises(ValueError, match="layer 1: sharding .* differs"):
        mgr.load(moved, pages, [2])
    relaid = list(caches)
    layout = kvxfer.Layout((0, 4, 3, 2, 1))  # block dim most minor
    relaid[0] = jax.device_put(caches[0], Format(layout.to_jax(), caches[0].sharding))
    with pytest.raises(ValueError, match=r"layer 0: layout \{0,4,3,2,1\} differs"):
        mgr.load(relaid, pages, [2])


@pytest.mark.parametrize("path", ["staged", "pinned"])
def test_a_steps_outputs_are_checked_with_one_format_read_each(tiny_caches, monkeypatch, path):
    # An engine hands every call the fresh arrays its last step returned: each costs
    # one ``Array.format`` (compared with the registered one), not one per check and
    # another per program.
    from jax._src import array as jax_array

    _, caches = tiny_caches
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4, path=path)
    before = [bits(c) for c in caches]
    step = jax.jit(lambda cs: [c + 0 for c in cs], donate_argnums=0)
    caches = step(caches)
    # Once first: a program's first call reads its arguments' formats in JAX itself.
    caches, _ = mgr.load(caches, mgr.offload(caches, [3], keys=[8]).wait(), [3])
    caches = step(caches)
    reads = []
    prop = jax_array.ArrayImpl.format
    monkeypatch.setattr(jax_array.ArrayImpl, "format",
                        property(lambda a: reads.append(a) or prop.fget(a)))
    pages = mgr.offload(caches, [3], keys=[7]).wait()
    assert len(reads) == len(caches)
    caches = step(caches)
    reads.clear()
    caches, handle = mgr.load(caches, pages, [9])
    assert len(reads) == len(caches) and handle.result().verified_prefix == 1
    monkeypatch.undo()
    check_loaded(caches, before, [3], [9])
    mgr.close()


def test_closed_manager_refuses_work_without_leaking(tiny_caches):
    _, caches = tiny_caches
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    pages = mgr.offload(caches, [1], keys=[1]).wait()
    mgr.close()
    with pytest.raises(RuntimeError, match="closed"):
        mgr.offload(caches, [2], keys=[2])
    with pytest.raises(RuntimeError, match="closed"):
        mgr.load(caches, pages, [3])
    assert mgr.num_free_pages == 3
    assert not any(c.is_deleted() for c in caches)


def test_free_is_all_or_nothing(tiny_caches):
    _, caches = tiny_caches
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    pages = mgr.offload(caches, [1, 2, 3], keys=[1, 2, 3]).wait()
    mgr.free(pages[2:])
    with pytest.raises(kvxfer.PoolError, match="double free of host slot"):
        mgr.free(pages)
    assert mgr.num_free_pages == 2  # pages 0 and 1 were not freed by the failed call
    mgr.free(pages[:2])
    assert mgr.num_free_pages == 4


def test_layers_placed_on_different_devices_get_separate_classes():
    a = jax.device_put(np.zeros((8, 16), np.float32), jax.devices()[0])
    b = jax.device_put(np.zeros((8, 16), np.float32), jax.devices()[1])
    mgr = kvxfer.KVCacheManager([a, b], num_host_blocks=2, path="staged")
    assert len(mgr.plan.classes) == 2
    pages = mgr.offload([a, b], [3], keys=[1]).wait()
    _, handle = mgr.load([a, b], pages, [4])
    assert handle.result().verified_prefix == 1


def test_emulated_raw_path_sizes_sharded_layers_per_shard():
    mesh = Mesh(np.array(jax.devices()[:4]), ("kv",))
    x = jax.device_put(np.zeros((16, 8, 256), jnp.bfloat16),
                       NamedSharding(mesh, P(None, "kv")))
    mgr = kvxfer.KVCacheManager([x], num_host_blocks=2, path="raw",
                                layouts=["{2,1,0:T(8,128)(2,1)}"])
    cls = mgr.plan.classes[0]
    # Each shard's 2 heads pad to 8 rows: 8 x 256 x 2 bytes per shard-block.
    assert cls.device_bytes_per_block == 4096 and cls.bytes_per_block == 4 * 4096
    pages = mgr.offload([x], [1, 2], keys=[1, 2]).wait()
    _, handle = mgr.load([x], pages, [5, 6])
    assert handle.result().verified_prefix == 2


# -- arguments that must be refused up front, naming the value ------------------------


def test_a_bare_array_is_not_taken_as_one_layer_per_block():
    x = jnp.zeros((8, 4, 128), jnp.float32)
    with pytest.raises(TypeError, match=r"sequence of jax.Array, one per layer. Got one "
                       r"jax.Array of shape \[8, 4, 128\]"):
        kvxfer.KVCacheManager(x, num_host_blocks=2)


def test_k_and_v_stacked_on_dim_0_are_refused_not_taken_as_2_blocks():
    vllm_gpu = jnp.zeros((2, 64, 16, 2, 32), jnp.bfloat16)  # [2, blocks, tokens, heads, dim]
    with pytest.raises(ValueError, match=re.escape(
            "layer 1: shape [2, 64, 16, 2, 32] looks like K and V stacked on dim 0 "
            "([2, num_blocks, ...], vLLM's GPU layout), which kvxfer would take as 2 "
            "blocks of [64, 16, 2, 32]")) as e:
        kvxfer.KVCacheManager([jnp.zeros((64, 128)), vllm_gpu], num_host_blocks=2)
    assert "cache[0] and cache[1]" in str(e.value)
    assert "jnp.moveaxis(cache, 1, 0): [64, 2, 16, 2, 32]" in str(e.value)
    # Caches of two blocks stay welcome when nothing says the dims are swapped.
    for shape in [(2, 4, 128), (2, 15, 8), (2, 4096), (64, 2, 16, 2, 32)]:
        with kvxfer.KVCacheManager([jnp.zeros(shape)], num_host_blocks=2) as mgr:
            assert mgr.plan.classes[0].block_shape == shape[1:]


def test_complex_caches_are_refused_at_construction():
    with pytest.raises(TypeError, match="layer 1: dtype complex64 is not supported"):
        kvxfer.KVCacheManager([jnp.zeros((8, 128)), jnp.zeros((8, 128), jnp.complex64)],
                              num_host_blocks=2)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"num_host_blocks": True}, TypeError, "num_host_blocks=True must be an int, not a bool"),
    ({"num_host_blocks": 2.5}, TypeError, "num_host_blocks=2.5 must be an int"),
    ({"num_host_blocks": 0}, ValueError, "num_host_blocks=0 must be >= 1"),
    ({"num_host_blocks": 2, "host_memory_budget": 1.5}, TypeError,
     "host_memory_budget=1.5 must be an int"),
    ({"num_host_blocks": 2, "ready_timeout": float("nan")}, ValueError,
     "ready_timeout=nan must be None or a finite number"),
    ({"num_host_blocks": 2, "path": "fast"}, ValueError, "path='fast'; expected one of"),
    ({"num_host_blocks": 2, "path": "direct"}, ValueError,
     "path='direct' is now called path='raw' (the raw mover); pass path='raw'"),
])
def test_bad_construction_arguments_name_the_value(kwargs, error, match):
    with pytest.raises(error, match=re.escape(match)):
        kvxfer.KVCacheManager([jnp.zeros((8, 128))], **kwargs)


def test_raw_path_selects_the_raw_mover():
    caches = testing.random_caches(2, 8, (4, 128), "float32", seed=1)
    with kvxfer.KVCacheManager(caches, num_host_blocks=2, path="raw") as mgr:
        assert mgr.paths == ["raw", "raw"]
        before = bits(caches[1])
        pages = mgr.offload(caches, [1, 2], keys=[1, 2]).wait()
        new, load = mgr.load(caches, pages, [5, 6])  # consumes its inputs
        assert load.result().verified_prefix == 2
        assert np.array_equal(bits(new[1])[[5, 6]], before[[1, 2]])


def test_numpy_ints_are_counts():
    mgr = kvxfer.KVCacheManager([jnp.zeros((8, 128))], num_host_blocks=np.int64(4),
                                host_memory_budget=np.int64(1 << 30))
    assert mgr.plan.num_host_blocks == 4 and mgr.num_free_pages == 4
    mgr.close()


def test_nan_timeouts_are_refused():
    caches = [jnp.zeros((8, 128))]
    with kvxfer.KVCacheManager(caches, num_host_blocks=2) as mgr:
        handle = mgr.offload(caches, [1], keys=[1])
        with pytest.raises(ValueError, match="timeout=nan"):
            handle.wait(float("nan"))
        pages = handle.wait()
        _, load = mgr.load(caches, pages, [2])
        with pytest.raises(ValueError, match="timeout=-1"):
            load.result(-1)
        with pytest.raises(ValueError, match="timeout=inf"):
            load.layer_ready(0, float("inf"))
        assert load.result().verified_prefix == 1


@pytest.mark.parametrize("fields, error, match", [
    ({"slot": None}, TypeError, "PageRef.slot must be an int >= 0. Got None"),
    ({"key": -1}, ValueError, "PageRef.key must be in [0, 2**64). Got -1"),
    ({"generation": True}, TypeError, "PageRef.generation must be an int"),
])
def test_page_refs_check_their_fields(fields, error, match):
    with pytest.raises(error, match=re.escape(match)):
        kvxfer.PageRef(**{"key": 1, "slot": 0, "generation": 1, **fields})


def test_buckets_start_at_one():
    from kvxfer.engine._batch import bucket

    assert [bucket(k) for k in range(6)] == [1, 1, 2, 4, 4, 8]


def test_the_manager_does_not_keep_old_caches_alive():
    import gc
    import weakref

    caches = [jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128) + i for i in range(2)]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    pages = mgr.offload(caches, [1], keys=[1]).wait()
    new, load = mgr.load(caches, pages, [3])
    load.result()
    old = [weakref.ref(a) for a in caches] + [weakref.ref(a) for a in new]
    del caches, new, load
    mgr.close()  # the transfer thread's last frame is gone; the manager itself lives on
    gc.collect()
    assert all(r() is None for r in old)
    assert mgr.num_free_pages == 1


def test_layouts_are_applied_on_the_auto_path():
    """With emulated TPU layouts, auto moves proven classes through emulated memory and
    the rest staged: the raw path never moves bytes the plan describes differently."""
    good = jnp.asarray(np.arange(16 * 8 * 256, dtype=np.float32).reshape(16, 8, 256))
    bad = jnp.asarray(np.arange(16 * 3 * 256, dtype=np.float32).reshape(16, 3, 256))
    layouts = ["{2,1,0:T(8,128)}", "{2,0,1:T(8,128)}"]
    with kvxfer.KVCacheManager([good, bad], num_host_blocks=4, layouts=layouts) as mgr:
        assert mgr.paths == ["emulated", "staged"]
        assert [c.addressable for c in mgr.plan.classes] == [True, False]
        before = [np.array(good), np.array(bad)]
        pages = mgr.offload([good, bad], [2, 5], keys=[1, 2]).wait()
        new, load = mgr.load([good, bad], pages, [9, 10])  # consumes the inputs
        assert load.result().verified_prefix == 2
        for a, b in zip(new, before):
            assert np.array_equal(np.asarray(a)[[9, 10]], b[[2, 5]])
        good, bad = new
    with kvxfer.KVCacheManager([good, bad], num_host_blocks=4, layouts=layouts,
                               path="staged") as mgr:
        assert mgr.paths == ["staged", "staged"]
    with pytest.raises(kvxfer.LayoutError, match=r"layer 1: f32\[16,3,256\]\{2,0,1:T"):
        kvxfer.KVCacheManager([good, bad], num_host_blocks=4, layouts=layouts,
                              path="raw")


def test_raw_refusal_names_the_shard_geometry_it_decided_on():
    mesh = Mesh(np.array(jax.devices()[:2]), ("kv",))
    x = jax.device_put(np.zeros((16, 4, 256), np.float32), NamedSharding(mesh, P(None, "kv")))
    with pytest.raises(kvxfer.LayoutError, match=r"layer 0 \(one shard of 2\): "
                       r"f32\[16,2,256\]\{2,0,1:T\(8,128\)\}"):
        kvxfer.KVCacheManager([x], num_host_blocks=2, path="raw",
                              layouts=["{2,0,1:T(8,128)}"])


@pytest.mark.parametrize("path", ["staged", "auto", "pinned"])
def test_a_failure_in_the_second_class_leaves_usable_caches(path):
    """Two slice classes; the load fails as the second class starts, after the first
    class's (donating) programs ran: err.kv_caches are the caches to continue with."""
    a = [jnp.asarray(testing.random_bits((16, 4, 128), "bfloat16", seed=i)) for i in range(2)]
    b = [jnp.asarray(testing.random_bits((16, 8, 128), "bfloat16", seed=5 + i))
         for i in range(2)]
    caches = a + b
    before = [testing.bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4, path=path)
    assert len(mgr.plan.classes) == 2
    pages = mgr.offload(caches, [1, 2], keys=[1, 2]).wait()

    def fail_second_class(event, layer, array):
        if event == "start_load" and layer == 2:
            raise OSError("injected failure in the second class")

    mgr.set_transfer_hook(fail_second_class)
    with pytest.raises(kvxfer.TransferError,
                       match=r"failed in c1:bf16\[8,128\] \(layers \[2, 3\]\)") as err:
        mgr.load(caches, pages, [9, 10])
    mgr.set_transfer_hook(None)
    kept = err.value.kv_caches
    assert kept is not None and not any(x.is_deleted() for x in kept)
    for i, x in enumerate(kept):
        want = before[i].copy()
        if i < 2:  # the first class was loaded before the failure
            want[[9, 10]] = before[i][[1, 2]]
        assert np.array_equal(testing.bits(x), want), i
    assert mgr.num_free_pages == 2  # no read pin left behind
    new, load = mgr.load(kept, pages, [11, 12])  # the caches carry on
    assert load.result().verified_prefix == 2
    for i, x in enumerate(new):
        assert np.array_equal(testing.bits(x)[[11, 12]], before[i][[1, 2]])


@pytest.mark.parametrize("path", ["auto", "staged", "pinned"])
def test_hybrid_layers_take_block_ids_per_slice_class(path):
    """Full-attention layers with 32 blocks and sliding-window layers with 8: each class
    gets its own ids, checked against its own block count; a subset of classes moves."""
    full = [jnp.asarray(testing.random_bits((32, 4, 128), "float32", seed=i)) for i in range(2)]
    window = [jnp.asarray(testing.random_bits((8, 2, 128), "float32", seed=9 + i))
              for i in range(2)]
    caches = [full[0], window[0], full[1], window[1]]
    before = [testing.bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4, path=path)
    full_cls, window_cls = (mgr.plan.class_of_layer(i)[0].index for i in (0, 1))
    with pytest.raises(ValueError, match=rf"device_blocks\[{window_cls}\]\[1\] = 9 is out of "
                       r"range for layer 1 \(8 blocks\)"):
        mgr.offload(caches, {full_cls: [20, 21], window_cls: [3, 9]}, keys=[1, 2])
    with pytest.raises(ValueError, match=r"device_blocks\[1\] = 20 is out of range for layer 1"):
        mgr.offload(caches, [3, 20], keys=[1, 2])  # one list must fit every layer
    with pytest.raises(ValueError, match="key 7 is not a slice class"):
        mgr.offload(caches, {7: [1, 2]}, keys=[1, 2])
    assert mgr.num_free_pages == 4  # nothing allocated by the refused calls
    pages = mgr.offload(caches, {full_cls: [20, 21], window_cls: [3, 5]}, keys=[1, 2]).wait()
    caches, load = mgr.load(caches, pages, {full_cls: [30, 31], window_cls: [6, 7]},
                            gate="layer")
    assert load.result().verified_prefix == 2
    for i, (c, b) in enumerate(zip(caches, before)):
        src, dst = ([20, 21], [30, 31]) if i in (0, 2) else ([3, 5], [6, 7])
        assert np.array_equal(testing.bits(c)[dst], b[src]), i
    # Only the full-attention layers move; the window layers stay as they are.
    part = mgr.offload(caches, {full_cls: [0, 1]}, keys=[5, 6]).wait()
    now = [testing.bits(c) for c in caches]
    caches, load = mgr.load(caches, part, {full_cls: [10, 11]}, gate="layer")
    assert [load.layer_ready(i) for i in range(4)] == [2, 2, 2, 2]
    assert load.result().verified_prefix == 2
    for i, (c, b) in enumerate(zip(caches, now)):
        want = b.copy()
        if i in (0, 2):
            want[[10, 11]] = b[[0, 1]]
        assert np.array_equal(testing.bits(c), want), i
    # A page holding only the full-attention class cannot fill the window layers.
    caches, load = mgr.load(caches, part, [2, 3])
    result = load.result()
    assert result.verified_prefix == 0 and "holds slice classes" in result.reasons[0]
    assert result.freed_pages == () and mgr.is_valid(part[0])
    mgr.close()


# -- failure paths found in review --------------------------------------------------


@pytest.mark.parametrize("path", ["staged", "auto", "pinned"])
def test_a_failure_while_digests_start_hands_back_caches_and_pins(path):
    caches = [jnp.asarray(testing.random_bits((8, 4, 128), "float32", seed=i)) for i in range(2)]
    before = [testing.bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4, path=path)
    pages = mgr.offload(caches, [1, 2], keys=[1, 2]).wait()
    threads = []

    def fail_after_the_first_layer(event, layer, array):
        if event == "loaded_layer":
            threads.append(__import__("threading").current_thread().name)
            if layer == 1:
                raise OSError("injected failure as layer 1's digest starts")

    mgr.set_transfer_hook(fail_after_the_first_layer)
    with pytest.raises(kvxfer.TransferError, match="injected failure") as err:
        mgr.load(caches, pages, [5, 6])
    mgr.set_transfer_hook(None)
    assert set(threads) == {"MainThread"}  # the hook runs on the caller's thread only
    kept = err.value.kv_caches
    assert kept is not None and not any(a.is_deleted() for a in kept)
    for a, b in zip(kept, before):
        assert np.array_equal(testing.bits(a)[[5, 6]], b[[1, 2]])
    mgr.free(pages)
    assert mgr.num_free_pages == 4  # no read pin left behind


def test_loaded_layer_fires_once_per_layer():
    caches = [jnp.zeros((8, 128)) for _ in range(3)]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    pages = mgr.offload(caches, [1], keys=[1]).wait()
    seen = []
    mgr.set_transfer_hook(lambda event, layer, array: seen.append((event, layer)))
    caches, load = mgr.load(caches, pages, [2], gate="layer")
    load.result()
    assert sorted(e for e in seen if e[0] == "loaded_layer") == [("loaded_layer", i)
                                                                 for i in range(3)]
    mgr.close()


def test_a_load_that_moves_nothing_keeps_the_sharing_scan():
    """Arrays sharing one buffer stay known as shared after a load that wrote nothing."""
    x = jax.device_put(np.arange(8 * 1024, dtype=np.float32).reshape(8, 1024))
    x = jax.device_put(x, x.sharding, may_alias=False)
    twin = [x, x]
    mgr = kvxfer.KVCacheManager(twin, num_host_blocks=2)
    (page,) = mgr.offload(twin, [2], keys=[6]).wait()
    mgr.free([page])
    twin, load = mgr.load(twin, [page], [5])  # stale: nothing moves
    assert load.result().verified_prefix == 0
    (page,) = mgr.offload(twin, [3], keys=[7]).wait()
    new, load = mgr.load(twin, [page], [4])
    assert load.result().verified_prefix == 1
    assert all(np.array_equal(np.asarray(a)[4], np.arange(3 * 1024, 4 * 1024)) for a in new)
    mgr.close()


def test_block_bytes_of_a_class_the_page_does_not_hold_are_refused():
    caches = [jnp.zeros((8, 128)), jnp.zeros((8, 256))]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=1)
    (full,) = mgr.offload(caches, [1], keys=[7]).wait()
    mgr.free([full])
    (part,) = mgr.offload(caches, {1: [2]}, keys=[8]).wait()  # the same slot, class 1 only
    assert part.slot == full.slot
    with pytest.raises(kvxfer.PoolError, match="does not hold layer 0"):
        mgr.read_block_bytes(part, 0)
    assert len(mgr.read_block_bytes(part, 1)) == 256 * 4
    mgr.close()


def test_emulated_memory_is_not_trusted_after_a_donating_step():
    x = jnp.asarray(np.arange(16 * 8 * 256, dtype=np.float32).reshape(16, 8, 256))
    mgr = kvxfer.KVCacheManager([x], num_host_blocks=4, layouts=["{2,1,0:T(8,128)}"])
    assert mgr.paths == ["emulated"]
    pages = mgr.offload([x], [1], keys=[1]).wait()
    (y,), load = mgr.load([x], pages, [2])
    assert load.result().verified_prefix == 1
    held = y  # the loaded array stays referenced while a step donates it
    (z,) = jax.jit(lambda c: [c[0].at[3].set(7.0)], donate_argnums=0)([y])
    assert held.is_deleted()
    (page,) = mgr.offload([z], [3], keys=[9]).wait()
    (w,), load = mgr.load([z], [page], [4])
    assert load.result().verified_prefix == 1
    assert np.all(np.asarray(w)[4] == 7.0)
    mgr.close()
