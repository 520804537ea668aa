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
