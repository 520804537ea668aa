"""HostCache over real store tiers (files, a redis-server), and the demo on them.

Integrity end to end: the digest made on the device at the first offload travels
with the page through the store and is checked on the device at load; a page
damaged at rest is a miss at that page, named in a warning with its tier.
"""

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest

import kvxfer
from kvxfer import store, testing
from kvxfer.store._disk import file_name


def _caches(seed=0):
    return testing.random_caches(2, 8, (4, 32), "bfloat16", seed=seed)


def _blank(caches):
    return [jnp.zeros_like(c) for c in caches]


def _spill(tmp_path, keys=(10, 11, 12, 13), capacity=None):
    """A first 'process': offloads pages, evicts them all into a disk store, closes."""
    caches = _caches()
    want = [testing.bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    disk = store.DiskStore(tmp_path / "pages", capacity_bytes=capacity)
    cache = kvxfer.HostCache(mgr, disk, namespace="test-model")
    for j, key in enumerate(keys):  # two slots: each put evicts (and spills) the oldest
        cache.put(caches, [j], [key], wait=True)
    assert cache.flush() == 2  # the last two were still only on host
    st = cache.stats()
    assert st["evictions"] == len(keys) - 2 and st["store_pages_written"] == len(keys)
    cache.close(), mgr.close(), disk.close()
    return want


def _reopen(tmp_path, num_host_blocks=4):
    caches = _blank(_caches())
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=num_host_blocks)
    disk = store.DiskStore(tmp_path / "pages")
    return caches, mgr, disk, kvxfer.HostCache(mgr, disk, namespace="test-model")


def test_pages_come_back_from_disk_after_a_restart_verified_and_exact(tmp_path):
    want = _spill(tmp_path)
    caches, mgr, disk, cache = _reopen(tmp_path)
    hit = cache.lookup([10, 11, 12, 13, 14])
    assert hit.tiers == ("store",) * 4
    caches, load = cache.load(caches, hit, [4, 5, 6, 7], gate="layer")
    assert load.result().verified_prefix == 4
    for layer in range(2):
        got = testing.bits(caches[layer])
        assert all((got[4 + j] == want[layer][j]).all() for j in range(4))
    st = cache.stats()
    assert st["store_hits"] == 4 and st["host_hits"] == 0 and st["misses"] == 1
    # Promoted pages stay in host memory: the next hit is a host hit.
    assert cache.lookup([10]).tiers == ("host",)
    assert mgr.stats()["pages_imported"] == 4
    cache.close(), mgr.close(), disk.close()


def test_a_bit_flipped_at_rest_is_a_miss_at_that_page_named_with_its_tier(tmp_path, caplog):
    _spill(tmp_path)
    caches, mgr, disk, cache = _reopen(tmp_path)
    testing.flip_stored_bit(disk, cache.store_key(12))
    hit = cache.lookup([10, 11, 12, 13])  # the blob's framing is intact: it imports
    assert hit.num_pages == 4
    caches, load = cache.load(caches, hit, [4, 5, 6, 7])
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        result = load.result()
    assert result.verified_prefix == 2 and result.freed_pages == (2,)
    assert f"page {12:#x} from the disk store failed verification on the device" in caplog.text
    assert not disk.contains(cache.store_key(12))  # gone from every tier
    assert 12 not in cache and 13 in cache
    assert cache.stats()["bad_pages_by_tier"] == {"disk": 1}
    cache.close(), mgr.close(), disk.close()


@pytest.mark.parametrize("damage, words", [
    ("truncate", "truncated page blob"),
    ("other-key", "page blob of key 0xa where key 0xb was expected"),
    ("other-model", "page of another KV geometry"),
])
def test_a_damaged_or_misfiled_blob_is_a_miss_and_leaves_the_store(tmp_path, caplog, damage,
                                                                   words):
    _spill(tmp_path)
    caches, mgr, disk, cache = _reopen(tmp_path)
    victim = cache.store_key(11)
    if damage == "truncate":  # a file cut short after it became visible
        disk.put(victim, disk.get(victim)[:-100], replace=True)
    elif damage == "other-key":
        disk.put(victim, disk.get(cache.store_key(10)), replace=True)
    else:  # another model's page (of a page's size: no larger blob is read at all)
        other = testing.random_caches(2, 8, (4, 32), "float16")
        omgr = kvxfer.KVCacheManager(other, num_host_blocks=1)
        (page,) = omgr.offload(other, [0], keys=[11]).wait()
        disk.put(victim, omgr.export_page(page), replace=True)
        omgr.close()
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        hit = cache.lookup([10, 11, 12])
    assert hit.keys == (10,)
    assert f"page {11:#x} in the disk store is bad" in caplog.text and words in caplog.text
    assert not disk.contains(victim)
    cache.release(hit)
    cache.close(), mgr.close(), disk.close()


def test_write_through_stores_every_page_once_it_is_on_host(tmp_path):
    caches = _caches()
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    disk = store.DiskStore(tmp_path / "pages")
    cache = kvxfer.HostCache(mgr, disk, write_through=True, namespace="test-model")
    cache.put(caches, [0, 1], [1, 2], wait=True)
    cache.lookup([])  # any call indexes finished offloads, which starts their writes
    cache.flush()
    assert all(disk.contains(cache.store_key(k)) for k in (1, 2))
    assert cache.stats()["store_pages_written"] == 2 and cache.flush() == 0
    cache.close(), mgr.close(), disk.close()


def test_a_restart_under_another_model_of_the_same_shapes_never_hits(tmp_path):
    # vLLM #56311: a cache built under one model reused after a restart under another.
    # A fine-tune has the same KV shapes, so the same fingerprint: only the namespace
    # tells the pages apart, and a store refuses to run without one.
    disk = store.DiskStore(tmp_path / "pages")
    base, tuned = _caches(seed=1), _caches(seed=2)  # two models' KV, one geometry
    with kvxfer.KVCacheManager(base, num_host_blocks=4) as mgr:
        for unnamed in ({}, {"namespace": ""}, {"namespace": "  "}, {"namespace": None}):
            with pytest.raises(ValueError, match=r"over a store: the store outlives this "
                                                 r"process.*allow_empty_namespace=True"):
                kvxfer.HostCache(mgr, disk, **unnamed)
        with pytest.raises(TypeError, match="allow_empty_namespace must be a bool"):
            kvxfer.HostCache(mgr, disk, allow_empty_namespace="yes")
        kvxfer.HostCache(mgr).close()  # no store: nothing outlives the process
        cache = kvxfer.HostCache(mgr, disk, namespace="llama-base@r1:bf16:tok-v3:",
                                 write_through=True)
        cache.put(base, [0, 1], [10, 11], wait=True)
        assert cache.flush() == 0 and cache.close() is None  # written through already
    with kvxfer.KVCacheManager(_blank(tuned), num_host_blocks=4) as mgr:  # the restart
        assert mgr.fingerprint == kvxfer.KVCacheManager(base, num_host_blocks=1).fingerprint
        cache = kvxfer.HostCache(mgr, disk, namespace="llama-tuned@r1:bf16:tok-v3:")
        assert cache.lookup([10, 11]).num_pages == 0  # the base model's pages: a miss
        cache.close()
        # Opting out says so: then every model of this geometry shares the pages.
        shared = kvxfer.HostCache(mgr, disk, allow_empty_namespace=True)
        assert shared.namespace == "" and shared.lookup([10]).num_pages == 0
        shared.close()
    disk.close()


def test_the_demo_namespace_names_everything_that_changes_its_kv():
    from kvxfer.demo import command, model

    cfg = model.tiny_llama()
    ns = command.demo_namespace("tiny", cfg, 0, "float32")
    assert ns == command.demo_namespace("tiny", model.tiny_llama(), 0, "float32")
    others = {command.demo_namespace("tiny", cfg, 1, "float32"),  # other weights
              command.demo_namespace("tiny", cfg, 0, "bfloat16"),  # other KV dtype
              command.demo_namespace("tiny", dataclasses.replace(cfg, rope_theta=5e5), 0,
                                     "float32"),  # same shapes, other RoPE
              command.demo_namespace("tiny", dataclasses.replace(cfg, norm_eps=1e-6), 0,
                                     "float32")}
    assert ns not in others and len(others) == 4


def test_namespaces_and_geometries_never_share_store_keys(tmp_path):
    a = kvxfer.KVCacheManager(_caches(), num_host_blocks=1)
    b = kvxfer.KVCacheManager(testing.random_caches(2, 8, (4, 32), "float16"),
                              num_host_blocks=1)
    disk = store.DiskStore(tmp_path / "pages")
    keys = {kvxfer.HostCache(a, disk, namespace="test-model").store_key(5),
            kvxfer.HostCache(b, disk, namespace="test-model").store_key(5),
            kvxfer.HostCache(a, disk, namespace="m2:").store_key(5)}
    assert len(keys) == 3
    a.close(), b.close(), disk.close()


_WRITER = textwrap.dedent("""
    import sys
    import kvxfer
    from kvxfer import store, testing

    caches = testing.random_caches(2, 8, (4, 32), "bfloat16")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    with store.RedisStore(sys.argv[1]) as redis_store:
        cache = kvxfer.HostCache(mgr, redis_store, write_through=True, namespace="test-model")
        cache.put(caches, [0, 1, 2], [10, 11, 12], wait=True)
        cache.flush()
        print(cache.stats()["store_pages_written"])
        cache.close()
    mgr.close()
""")


def test_two_processes_share_pages_through_redis(redis_server):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _WRITER, redis_server], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "3"
    want = [testing.bits(c) for c in _caches()]
    caches = _blank(_caches())
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    with store.RedisStore(redis_server) as redis_store:
        cache = kvxfer.HostCache(mgr, redis_store, namespace="test-model")
        hit = cache.lookup([10, 11, 12])
        assert hit.tiers == ("store",) * 3
        caches, load = cache.load(caches, hit, [5, 6, 7])
        assert load.result().verified_prefix == 3
        for layer in range(2):
            got = testing.bits(caches[layer])
            assert all((got[5 + j] == want[layer][j]).all() for j in range(3))
        cache.close()
    mgr.close()


# -- the demo, from the command line ----------------------------------------------------

_DEMO = ["--requests", "12", "--system-pages", "2", "3", "--new-tokens", "2",
         "--device-blocks", "5", "--host-blocks", "3", "--quiet", "--json"]


def _demo(*args):
    out = subprocess.run([sys.executable, "-m", "kvxfer", "demo", *_DEMO, *args],
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout), out.stderr


@pytest.mark.parametrize("where", ["disk", "redis"])
def test_demo_restarts_on_its_store_and_survives_a_flip_at_rest(tmp_path, request, where):
    spec = str(tmp_path / "store") if where == "disk" else \
        request.getfixturevalue("redis_server")
    first, _ = _demo("--store", spec)
    assert first["store_pages_written"] > 0 and first["tokens_match"]
    second, _ = _demo("--store", spec)  # cold device and host tiers, a warm store
    assert second["store_hits"] > 0 and second["requests_by_kind"]["miss"] == 0
    assert second["tokens_match"]
    third, err = _demo("--store", spec, "--inject", "store-bitflip", "--injections", "1")
    assert len(third["injections"]) == 1 and third["corruptions_detected"] == 1
    assert third["store_bad_pages"] == 1 and third["tokens_match"]
    assert "failed verification on the device" in err and where in err


# -- failure paths found in review -------------------------------------------------------


class _DeleteFails(store.DiskStore):
    """A real disk store whose deletes fail, as a Redis timeout would."""

    def delete(self, key):
        raise store.StoreError(f"delete of {key!r} timed out")


def test_a_file_truncated_at_rest_is_a_miss_with_a_warning(tmp_path, caplog):
    _spill(tmp_path)
    caches, mgr, disk, cache = _reopen(tmp_path)
    path = tmp_path / "pages" / file_name(cache.store_key(11))
    os.truncate(path, path.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        hit = cache.lookup([10, 11, 12])
    assert hit.keys == (10,)
    assert "is damaged" in caplog.text and f"{11:016x}" in caplog.text
    assert "disk store" in caplog.text
    cache.release(hit)
    cache.close(), mgr.close(), disk.close()


def test_store_errors_neither_leak_pins_nor_lose_a_load_result(tmp_path, caplog):
    _spill(tmp_path)
    caches = _blank(_caches())
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    disk = _DeleteFails(tmp_path / "pages")
    cache = kvxfer.HostCache(mgr, disk, namespace="test-model")
    disk.put(cache.store_key(11), b"not a page", replace=True)
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        hit = cache.lookup([10, 11])  # 11 is bad and cannot be deleted: still a miss
    assert hit.keys == (10,) and "could not be deleted" in caplog.text
    cache.release(hit)
    assert cache.stats()["pinned_pages"] == 0
    hit = cache.lookup([10, 12])
    testing.flip_bit(mgr, hit.pages[1], layer=0)
    caches, load = cache.load(caches, hit, [4, 5])
    assert load.result().verified_prefix == 1  # the failed delete is logged, not raised
    assert cache.stats()["pinned_pages"] == 0
    cache.close(), mgr.close(), disk.close()


def test_a_page_the_store_lost_is_written_back_once_the_cache_finds_out(tmp_path):
    # A page the cache knows the store holds is never written again (no store call);
    # flush() and lookups ask the store, and a page found missing is written again.
    caches = _caches()
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    disk = store.DiskStore(tmp_path / "pages")
    cache = kvxfer.HostCache(mgr, disk, write_through=True, namespace="test-model")
    cache.put(caches, [0, 1], [10, 11], wait=True)
    cache.flush()
    assert disk.delete(cache.store_key(10))  # the store's own LRU (another writer, say)
    assert cache.flush() == 1 and disk.contains(cache.store_key(10))  # asked: written
    assert disk.delete(cache.store_key(11))
    cache.put(caches, [2, 3], [12, 13], wait=True)  # evicts 10 and 11 from host
    cache.flush()
    assert cache.stats()["store_writes_skipped"] == 2  # both known: no store call
    assert not disk.contains(cache.store_key(11))  # lost behind the cache's back
    assert cache.lookup([11]).num_pages == 0  # the lookup finds it missing...
    cache.put(caches, [1], [11], wait=True)  # ...so putting it again writes it
    cache.flush()
    assert disk.contains(cache.store_key(11)) and disk.contains(cache.store_key(10))
    cache.close(), mgr.close(), disk.close()


def test_pages_without_digests_live_under_keys_of_their_own(tmp_path, caplog):
    caches = _caches()
    off = kvxfer.KVCacheManager(caches, num_host_blocks=2, integrity="off")
    disk = store.DiskStore(tmp_path / "pages")
    off_cache = kvxfer.HostCache(off, disk, write_through=True, namespace="test-model")
    off_cache.put(caches, [0], [10], wait=True)
    off_cache.close()
    on = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    on_cache = kvxfer.HostCache(on, disk, namespace="test-model")
    assert on_cache.store_key(10) != off_cache.store_key(10)
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        assert on_cache.lookup([10]).num_pages == 0  # a plain miss: nothing to warn of
    assert caplog.text == "" and disk.contains(off_cache.store_key(10))
    on_cache.close(), on.close(), off.close(), disk.close()


def test_a_store_page_of_some_slice_classes_only_is_a_miss(tmp_path, caplog):
    mixed = testing.random_caches(1, 8, (4, 32), "float32") + \
        testing.random_caches(1, 8, (2, 32), "bfloat16")
    mgr = kvxfer.KVCacheManager(mixed, num_host_blocks=2)
    disk = store.DiskStore(tmp_path / "pages")
    cache = kvxfer.HostCache(mgr, disk, namespace="test-model")
    (page,) = mgr.offload(mixed, {0: [3]}, keys=[10]).wait()  # class 0 only
    disk.put(cache.store_key(10), mgr.export_page(page))
    mgr.free([page])
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        assert cache.lookup([10]).num_pages == 0
    assert "holds slice classes [0] of 2" in caplog.text
    assert not disk.contains(cache.store_key(10)) and mgr.num_free_pages == 2
    cache.close(), mgr.close(), disk.close()


def test_close_writes_through_offloads_in_flight_and_stats_still_read(tmp_path):
    caches = _caches()
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    disk = store.DiskStore(tmp_path / "pages")
    cache = kvxfer.HostCache(mgr, disk, write_through=True, namespace="test-model")
    cache.put(caches, [0], [10])  # no wait
    cache.close()
    assert disk.contains(cache.store_key(10))
    disk.close()
    assert cache.stats()["store_pages_written"] == 1  # the closed store: counters only
    mgr.close()


def test_metrics_of_a_cache_with_a_store_have_no_clashing_names(tmp_path):
    import prometheus_client
    from prometheus_client.openmetrics import exposition, parser

    import kvxfer.metrics

    want = _spill(tmp_path)
    caches, mgr, disk, cache = _reopen(tmp_path)
    registry = prometheus_client.CollectorRegistry()
    kvxfer.metrics.register(mgr, registry=registry)
    kvxfer.metrics.register(cache, registry=registry)
    hit = cache.lookup([10, 11])
    caches, load = cache.load(caches, hit, [4, 5])
    load.result()
    text = exposition.generate_latest(registry).decode()
    names = [f.name for f in parser.text_string_to_metric_families(text)]  # rejects clashes
    assert len(names) == len(set(names))
    assert registry.get_sample_value("kvxfer_cache_store_hits_total") == 2
    assert registry.get_sample_value("kvxfer_cache_store_tier_hits_total") == 2
    assert want is not None
    cache.close(), mgr.close(), disk.close()
