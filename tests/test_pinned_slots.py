"""The pinned in-place route as TPU runs it, on XLA:CPU: a slot-major pool, pages
gathered per layer, one dynamic-update-slice (dynamic slice) a page.

``TILED_POOL_PLATFORMS`` names the backends that take it; here CPU is added, so the
very programs a TPU runs (``_pinned_programs`` with ``gathered``) move real bytes, and
every round trip must be bit-exact with nothing copied on the host.
"""

import jax
import numpy as np
import pytest
from jax.experimental.layout import Format
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import kvxfer
from kvxfer import testing
from kvxfer.engine import _pinned_programs, _slot_pool
from kvxfer.engine._slot_pool import SlotPool, aliasing_refusal, slot_geometry
from kvxfer.hostpool import PoolError

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "cpu",
                                reason="CPU runs the TPU route's programs here")

SRC, DST = [5, 1, 6, 2], [0, 7, 3, 4]
NUM_BLOCKS = 8


@pytest.fixture
def tiled(monkeypatch):
    monkeypatch.setattr(_slot_pool, "TILED_POOL_PLATFORMS", frozenset({"cpu", "tpu"}))


def _caches(seed):
    """Single-device caches in five classes: bf16, tiny f32 [2, 8] blocks (lane slices
    on TPU), fp8 with NaN payloads, int8 blocks of 15 bytes, and a layout whose block
    dim is minor-most (not addressable: the pages must be gathered)."""
    caches = (testing.random_caches(2, NUM_BLOCKS, (4, 128), "bfloat16", seed=seed)
              + testing.random_caches(1, NUM_BLOCKS, (2, 8), "float32", seed=seed + 1)
              + testing.random_caches(1, NUM_BLOCKS, (16, 8), "float8_e4m3fn", seed=seed + 2)
              + testing.random_caches(1, NUM_BLOCKS, (3, 5), "int8", seed=seed + 3))
    permuted = testing.random_caches(1, NUM_BLOCKS, (2, 64), "bfloat16", seed=seed + 4)[0]
    caches.append(jax.device_put(permuted, Format(kvxfer.Layout((0, 2, 1)).to_jax(),
                                                  permuted.sharding)))
    return caches


def _check_moved(new, before, src, dst):
    for i, (a, b) in enumerate(zip(new, before)):
        want = b.copy()
        want[dst] = b[src]
        assert np.array_equal(testing.bits(a), want), f"layer {i}"


def test_slot_geometry_pads_a_page_to_whole_tiles():
    # A page of 64 bytes (one f32 [2, 8] block) still fills 8 x 128 words: a slot is
    # whole tiles, so it is one range of the pool under T(8,128).
    from kvxfer.plan import LayerSpec, make_plan
    plan = make_plan([LayerSpec("L", (8, 2, 8), "float32")] * 3
                     + [LayerSpec("M", (8, 1024, 8), "float32")], num_host_blocks=4)
    small, big = (slot_geometry(c, 4) for c in plan.classes)
    assert (small.shape, small.slot_bytes) == ((4, 8, 128), 4096)
    assert small.page_bytes == 3 * 64
    assert big.page_bytes == 32768 and big.shape == (4, 64, 128)  # no padding at all
    assert str(small.layout) == "{2,1,0:T(8,128)}"


def test_the_tpu_route_round_trips_bit_exact_with_no_host_copy(tiled):
    caches = _caches(seed=11)
    before = [testing.bits(c) for c in caches]
    with kvxfer.KVCacheManager(caches, num_host_blocks=8, path="pinned") as mgr:
        assert mgr.paths == ["pinned"] * len(caches)
        assert all(c.reason.endswith("in place") for c in mgr.paths)
        pools = [p.pages for p in mgr.host_pool.pools]
        assert all(isinstance(p, SlotPool) for p in pools)
        addresses = [p.array.unsafe_buffer_pointer() for p in pools]
        for r, gate in enumerate(("layer", "all", "layer")):
            pages = mgr.offload(caches, SRC, keys=[r * 10 + j for j in range(4)]).wait()
            # The page format every other reader takes: a layer's block at its range.
            for j, b in enumerate(SRC):
                assert mgr.read_block_bytes(pages[j], 2) == before[2][b].tobytes()
            caches, load = mgr.load(caches, pages, DST, gate=gate)
            assert load.result().verified_prefix == 4
            _check_moved(caches, before, SRC, DST)
            before = [testing.bits(c) for c in caches]
            mgr.free(pages)
        # Donated every time, into the same buffer: the pool was never copied.
        assert [p.array.unsafe_buffer_pointer() for p in pools] == addresses
        assert mgr.stats()["host_copy_bytes"] == 0


def test_a_bucket_over_a_chunk_moves_a_chunk_at_a_time_bit_exact(tiled, monkeypatch):
    """Past ``CHUNK_SLICES`` (cut to 2 here) a program loops over chunks of the bucket's
    pages, the last one partial, the permuted cache carried through the loop in its own
    layout: still one program a direction, bit-exact, verified, no host copy."""
    monkeypatch.setattr(_pinned_programs, "CHUNK_SLICES", 2)
    caches = (testing.random_caches(2, 12, (4, 96), "bfloat16", seed=41)
              + testing.random_caches(1, 12, (16, 24), "float8_e4m3fn", seed=42))
    permuted = testing.random_caches(1, 12, (2, 48), "bfloat16", seed=43)[0]
    caches.append(jax.device_put(permuted, Format(kvxfer.Layout((0, 2, 1)).to_jax(),
                                                  permuted.sharding)))
    assert [_pinned_programs._chunk_pages(caches[:n], 8) for n in (1, 2)] == [2, 1]
    before = [testing.bits(c) for c in caches]
    src, dst = [9, 2, 11, 0, 5], [1, 3, 10, 7, 4]
    with kvxfer.KVCacheManager(caches, num_host_blocks=8, path="pinned") as mgr:
        pools = [p.pages for p in mgr.host_pool.pools]
        addresses = [p.array.unsafe_buffer_pointer() for p in pools]
        pages = mgr.offload(caches, src, keys=list(range(5))).wait()
        for j, b in enumerate(src):
            assert mgr.read_block_bytes(pages[j], 3) == before[3][b].tobytes()
        caches, load = mgr.load(caches, pages, dst)
        assert load.result().verified_prefix == 5
        _check_moved(caches, before, src, dst)
        assert [p.array.unsafe_buffer_pointer() for p in pools] == addresses
        assert mgr.stats()["host_copy_bytes"] == 0


def test_tpu_route_pages_export_and_import_as_every_route_does(tiled):
    caches = _caches(seed=21)
    before = [testing.bits(c) for c in caches]
    with kvxfer.KVCacheManager(caches, num_host_blocks=8, path="pinned") as mgr:
        pages = mgr.offload(caches, [3], keys=[7]).wait()
        blob = mgr.export_page(pages[0])
        mgr.free(pages)
    # Another route (staged, its own pool) reads the page a slot pool wrote.
    fresh = [jax.numpy.zeros_like(c) for c in caches]
    with kvxfer.KVCacheManager(fresh, num_host_blocks=4, path="staged") as other:
        page = other.import_page(blob)
        fresh, load = other.load(fresh, [page], [6])
        assert load.result().verified_prefix == 1
        for a, b in zip(fresh, before):
            assert np.array_equal(testing.bits(a)[6], b[3])


def test_a_write_to_a_slot_pool_page_is_verified_by_the_next_load(tiled):
    caches = _caches(seed=31)
    with kvxfer.KVCacheManager(caches, num_host_blocks=8, path="pinned") as mgr:
        pages = mgr.offload(caches, [1, 2], keys=[1, 2]).wait()
        # Bit rot in the host copy of page 1: a miss from there, nothing written.
        pool = mgr.host_pool.pools[0]
        view = pool.shard_view(pages[1].slot, 0, 0)
        view[5] ^= 0x10
        caches, load = mgr.load(caches, pages, [4, 5])
        assert load.result().verified_prefix == 1


def test_a_class_over_several_devices_takes_the_pages_route_and_says_why(tiled):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(jax.devices()[:2]), ("kv",))
    caches = testing.random_caches(1, NUM_BLOCKS, (2, 4, 64), "float32",
                                   sharding=NamedSharding(mesh, P(None, None, "kv")), seed=3)
    before = [testing.bits(c) for c in caches]
    with kvxfer.KVCacheManager(caches, num_host_blocks=4, path="pinned") as mgr:
        assert mgr.paths == ["pinned"]
        assert "pages route: not in place: its shards live on 2 devices" in mgr.paths[0].reason
        pages = mgr.offload(caches, SRC, keys=list(range(4))).wait()
        caches, load = mgr.load(caches, pages, DST)
        assert load.result().verified_prefix == 4
        _check_moved(caches, before, SRC, DST)
        assert mgr.stats()["host_copy_bytes"] == 0


def test_the_pool_aliases_here_and_a_copied_pool_is_refused(tiled):
    assert aliasing_refusal(jax.devices()[0]) is None
    from kvxfer.plan import LayerSpec, make_plan
    cls = make_plan([LayerSpec("L", (8, 4, 128), "bfloat16")], num_host_blocks=2).classes[0]
    pool = SlotPool(cls, 2, jax.devices()[0])
    copy = jax.numpy.array(pool.array, copy=True)
    with pytest.raises(PoolError, match=r"did not update the pinned pool of .* in place"):
        pool.swap(copy)
    with pytest.raises(ValueError, match="a slot pool holds one shard's pages"):
        two = make_plan([LayerSpec("L", (8, 4, 128), "bfloat16", num_shards=2,
                                   shard_shape=(8, 2, 128))],
                        num_host_blocks=2).classes[0]
        SlotPool(two, 2, jax.devices()[0])


def test_warmup_compiles_what_the_tpu_route_runs(tiled):
    from test_pinned import _COUNTER
    caches = testing.random_caches(2, 13, (3, 40), "bfloat16", seed=7)
    with kvxfer.KVCacheManager(caches, num_host_blocks=8, path="pinned") as mgr:
        assert mgr.warmup(4) == [1, 2, 4]
        before = [testing.bits(c) for c in caches]
        with _COUNTER as compiled:
            for k in (3, 4, 1, 2):
                src, dst = list(range(k)), list(range(12, 12 - k, -1))
                pages = mgr.offload(caches, src, keys=list(range(k))).wait()
                caches, load = mgr.load(caches, pages, dst)
                assert load.result().verified_prefix == k
                _check_moved(caches, before, src, dst)
                before = [testing.bits(c) for c in caches]
                mgr.free(pages)
        assert compiled.count == 0
