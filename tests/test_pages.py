"""Pages out of and back into host memory: export_page / import_page, fingerprints, stats."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvxfer
from kvxfer import testing
from kvxfer.manager._pages import decode


def _mixed(seed=0):
    """Two slice classes: bf16 (NaN payloads included) and f32, one layer sharded."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tp"))
    a = testing.random_caches(2, 8, (4, 64), "bfloat16", seed=seed)
    b = testing.random_caches(1, 8, (4, 32), "float32", sharding=sharded, seed=seed + 1)
    return a + b


def _zeros_like(caches):
    out = [jnp.zeros_like(c) for c in caches]
    return [jax.device_put(o, c.sharding, may_alias=False) for o, c in zip(out, caches)]


def test_round_trip_between_managers_is_exact_and_verified_on_device():
    caches = _mixed()
    want = [testing.bits(c) for c in caches]
    src = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    pages = src.offload(caches, [1, 4, 6], keys=[10, 11, 12]).wait()
    blobs = [src.export_page(p) for p in pages]
    src.close()

    dst_caches = _zeros_like(caches)
    dst = kvxfer.KVCacheManager(dst_caches, num_host_blocks=8)
    assert dst.fingerprint == src.fingerprint
    # Other slots, other generations than where the digests were made.
    dst.free(dst.offload(dst_caches, [0, 1], keys=[1, 2]).wait())
    back = [dst.import_page(b, key=k) for b, k in zip(blobs, [10, 11, 12])]
    assert [p.key for p in back] == [10, 11, 12]
    new, load = dst.load(dst_caches, back, [7, 2, 3], gate="layer")
    assert load.result().verified_prefix == 3
    for layer in range(3):
        got = testing.bits(new[layer])
        for j, (s, d) in enumerate(zip([1, 4, 6], [7, 2, 3])):
            assert (got[d] == want[layer][s]).all(), (layer, j)
    st = dst.stats()
    assert st["pages_imported"] == 3 and st["pages_verified"] == 3
    dst.close()


def test_a_flipped_bit_in_a_blob_is_a_miss_at_that_page():
    caches = _mixed()
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=6)
    pages = mgr.offload(caches, [0, 1, 2], keys=[1, 2, 3]).wait()
    blobs = [bytearray(mgr.export_page(p)) for p in pages]
    mgr.free(pages)
    page = decode(mgr.plan, bytes.fromhex(mgr.fingerprint), bytes(blobs[1]))
    start = len(blobs[1]) - sum(d.nbytes + g.nbytes for d, g in
                                zip(page.data.values(), page.digests.values())) + 12
    blobs[1][start + 5] ^= 0x10  # a byte of the first class's page bytes
    back = [mgr.import_page(bytes(b)) for b in blobs]
    caches, load = mgr.load(caches, back, [5, 6, 7])
    result = load.result()
    assert result.verified_prefix == 1
    assert result.freed_pages == (1,)
    assert "digest mismatch" in result.reasons[1]
    assert mgr.stats()["mismatches"] == {"digest mismatch": 1}
    mgr.close()


@pytest.mark.parametrize("damage, kind, words", [
    (lambda b: b[:-7], "truncated", "truncated page blob"),
    (lambda b: b[:20], "truncated", "shorter than"),
    (lambda b: b + b"x", "truncated", "oversized"),
    (lambda b: b"NOTAPAGE" + b[8:], "not a page", "not a kvxfer page blob"),
])
def test_damaged_blobs_are_refused_naming_the_problem(damage, kind, words):
    caches = testing.random_caches(2, 4, (8, 32), "float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    (page,) = mgr.offload(caches, [3], keys=[5]).wait()
    blob = mgr.export_page(page)
    free = mgr.num_free_pages
    with pytest.raises(kvxfer.PageFormatError, match=words) as err:
        mgr.import_page(damage(blob))
    assert err.value.kind == kind
    assert mgr.num_free_pages == free  # nothing allocated
    assert mgr.stats()["imports_refused"] == {kind: 1}
    mgr.close()


def test_another_key_is_refused():
    caches = testing.random_caches(1, 4, (8, 32), "float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    (page,) = mgr.offload(caches, [3], keys=[5]).wait()
    with pytest.raises(kvxfer.PageFormatError, match="key 0x5 where key 0x6") as err:
        mgr.import_page(mgr.export_page(page), key=6)
    assert err.value.kind == "wrong key"
    mgr.close()


@pytest.mark.parametrize("other", [
    dict(dtype="bfloat16"), dict(block=(8, 16)), dict(layers=3),
])
def test_another_geometry_never_shares_a_page(other):
    base = dict(layers=2, block=(8, 32), dtype="float16")
    base_caches = testing.random_caches(base["layers"], 4, base["block"], base["dtype"])
    cfg = {**base, **other}
    other_caches = testing.random_caches(cfg["layers"], 4, cfg["block"], cfg["dtype"])
    a = kvxfer.KVCacheManager(base_caches, num_host_blocks=2)
    b = kvxfer.KVCacheManager(other_caches, num_host_blocks=2)
    assert a.fingerprint != b.fingerprint
    (page,) = a.offload(base_caches, [1], keys=[9]).wait()
    with pytest.raises(kvxfer.PageFormatError, match="another KV geometry") as err:
        b.import_page(a.export_page(page))
    assert err.value.kind == "other geometry"
    a.close(), b.close()


def test_block_count_does_not_change_the_fingerprint():
    a = kvxfer.KVCacheManager(testing.random_caches(2, 4, (8, 32), "float32"),
                              num_host_blocks=2)
    b = kvxfer.KVCacheManager(testing.random_caches(2, 16, (8, 32), "float32"),
                              num_host_blocks=3)
    assert a.fingerprint == b.fingerprint
    a.close(), b.close()


def test_a_blob_without_digests_is_refused_where_pages_are_verified():
    caches = testing.random_caches(1, 4, (8, 32), "float32")
    off = kvxfer.KVCacheManager(caches, num_host_blocks=2, integrity="off")
    (page,) = off.offload(caches, [2], keys=[4]).wait()
    blob = off.export_page(page)
    on = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    with pytest.raises(kvxfer.PageFormatError, match="no digests"):
        on.import_page(blob)
    off.close(), on.close()


def test_export_of_a_freed_page_and_import_into_a_full_pool():
    caches = testing.random_caches(1, 4, (8, 32), "float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=1)
    (page,) = mgr.offload(caches, [2], keys=[4]).wait()
    blob = mgr.export_page(page)
    with pytest.raises(kvxfer.PoolExhaustedError):
        mgr.import_page(blob)
    mgr.free([page])
    with pytest.raises(kvxfer.PoolError, match="cannot be exported: freed"):
        mgr.export_page(page)
    with pytest.raises(TypeError, match="bytes"):
        mgr.import_page("not bytes")
    mgr.close()


def test_write_block_bytes_is_a_deliberate_write_re_digested():
    caches = testing.random_caches(1, 4, (8, 32), "float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    (page,) = mgr.offload(caches, [2], keys=[4]).wait()
    new = np.full(8 * 32, 3.0, np.float32).tobytes()
    mgr.write_block_bytes(page, 0, new)
    back = mgr.import_page(mgr.export_page(page))  # the new digest travels too
    caches, load = mgr.load(caches, [back], [0])
    assert load.result().verified_prefix == 1
    assert (np.asarray(caches[0][0]) == 3.0).all()
    mgr.close()


def test_stats_count_what_moved():
    caches = testing.random_caches(2, 8, (4, 32), "float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    pages = mgr.offload(caches, [0, 1, 2], keys=[1, 2, 3]).wait()
    testing.flip_bit(mgr, pages[2], layer=1)
    caches, load = mgr.load(caches, pages, [4, 5, 6], keys=[1, 2, 3])
    load.result()
    st = mgr.stats()
    page_bytes = mgr.plan.classes[0].page_bytes
    assert (st["pages_offloaded"], st["bytes_offloaded"]) == (3, 3 * page_bytes)
    assert (st["pages_loaded"], st["bytes_loaded"]) == (3, 3 * page_bytes)
    assert st["pages_verified"] == 2 and st["pages_freed"] == 1
    assert st["mismatches"] == {"digest mismatch": 1}
    assert st["offload_seconds"]["count"] == 1 and st["load_seconds"]["count"] == 1
    assert 0 < st["load_seconds"]["p50"] <= st["load_seconds"]["p99"]
    assert st["host_free_pages"] == 2  # the bad page was freed
    mgr.close()


def test_layers_sharded_along_other_axes_never_share_a_page():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    P = jax.sharding.PartitionSpec
    heads = jax.sharding.NamedSharding(mesh, P(None, "tp", None))
    dims = jax.sharding.NamedSharding(mesh, P(None, None, "tp"))
    a = testing.random_caches(1, 4, (4, 8), "float32", sharding=heads)
    b = testing.random_caches(1, 4, (4, 8), "float32", sharding=dims)
    ma = kvxfer.KVCacheManager(a, num_host_blocks=1)
    mb = kvxfer.KVCacheManager(b, num_host_blocks=1)
    assert ma.fingerprint != mb.fingerprint  # same bytes per shard, other meaning
    (page,) = ma.offload(a, [3], keys=[7]).wait()
    with pytest.raises(kvxfer.PageFormatError, match="another KV geometry"):
        mb.import_page(ma.export_page(page))
    ma.close(), mb.close()


# Every mover, and the pinned mover's two routes: each fills the same pages.
PATHS = ["raw", "staged", "pinned", "pinned-pages", "dma", "pallas"]


@pytest.mark.cpu("2 devices (conftest.py's CPU devices); raw and pallas run on XLA:CPU")
@pytest.mark.parametrize("path", PATHS)
def test_a_sharded_page_holds_each_shards_layers_side_by_side(path, monkeypatch):
    """Pages are shard-major: shard s's blocks of every layer are one range of the page
    (what a mover copying shard by shard moves as one copy), whatever the mover, and a
    page written back in that order loads exactly."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    heads = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tp", None))
    caches = testing.random_caches(3, 8, (4, 128), "float32", sharding=heads, seed=5)
    before = [testing.bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4, path=path.split("-")[0],
                                pinned_route="pages" if path == "pinned-pages" else None)
    assert mgr.paths == [path.split("-")[0]] * 3
    cls, = mgr.plan.classes
    assert (cls.num_shards, cls.shard_block_bytes) == (2, 1024)
    pages = mgr.offload(caches, [5, 2], keys=[1, 2]).wait()
    fp = bytes.fromhex(mgr.fingerprint)
    for page, b in zip(pages, [5, 2]):
        shard = [np.split(before[i][b], 2, axis=0) for i in range(3)]  # [layer][shard]
        want = b"".join(shard[i][s].tobytes() for s in range(2) for i in range(3))
        assert decode(mgr.plan, fp, mgr.export_page(page)).data[0].tobytes() == want
        for s in range(2):  # the pool's own ranges say the same
            lo, hi = mgr.host_pool.pools[0].shard_span(s)
            assert (lo, hi) == (s * 3 * 1024, (s + 1) * 3 * 1024)
            assert want[lo:hi] == b"".join(shard[i][s].tobytes() for i in range(3))
        for i in range(3):  # a layer's bytes: its shards in order, shard 0 first
            assert mgr.read_block_bytes(page, i) == before[i][b].tobytes()
    # Written back in that order (import_page writes the page whole), loaded exactly.
    back = [mgr.import_page(mgr.export_page(p), key=p.key) for p in pages]
    mgr.free(pages)
    new, load = mgr.load(caches, back, [0, 7], gate="layer")
    assert load.result().verified_prefix == 2
    for i in range(3):
        got = testing.bits(new[i])
        assert np.array_equal(got[[0, 7]], before[i][[5, 2]]), i
        assert np.array_equal(got[1:7], before[i][1:7]), i
        for sh in new[i].addressable_shards:
            assert np.array_equal(testing.bits(sh.data), got[sh.index]), (i, sh.device)
    mgr.close()


def test_a_page_of_the_layer_major_format_is_refused(monkeypatch):
    """Version 1 pages held each layer's shards side by side: the same bytes in another
    order. Their blobs are refused, and their fingerprint (which store keys carry)
    differs, so a store never hands one to this kvxfer."""
    from kvxfer.manager import _pages

    caches = _mixed()
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    (page,) = mgr.offload(caches, [3], keys=[5]).wait()
    blob = bytearray(mgr.export_page(page))
    assert int.from_bytes(blob[8:12], "little") == _pages.PAGE_FORMAT_VERSION == 2
    blob[8:12] = (1).to_bytes(4, "little")
    with pytest.raises(kvxfer.PageFormatError, match="page format version 1") as err:
        mgr.import_page(bytes(blob))
    assert err.value.kind == "format version"
    monkeypatch.setattr(_pages, "PAGE_FORMAT_VERSION", 1)
    old = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    assert old.fingerprint != mgr.fingerprint
    old.close(), mgr.close()
