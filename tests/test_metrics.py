"""Prometheus export of the manager's and the cache's counters (a real registry)."""

import prometheus_client
import pytest

import kvxfer
import kvxfer.metrics
from kvxfer import testing


def _sample(registry, name, **labels):
    value = registry.get_sample_value(name, labels or None)
    assert value is not None, (name, labels, prometheus_client.generate_latest(registry))
    return value


def test_manager_and_cache_counters_reach_a_registry():
    caches = testing.random_caches(2, 8, (4, 32), "float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    cache = kvxfer.HostCache(mgr)
    registry = prometheus_client.CollectorRegistry()
    kvxfer.metrics.register(mgr, registry=registry)
    kvxfer.metrics.register(cache, prefix="kvxfer_cache", registry=registry)
    cache.put(caches, [0, 1, 2], [1, 2, 3], wait=True)
    hit = cache.lookup([1, 2, 3])
    testing.flip_bit(mgr, hit.pages[2], layer=0)
    caches, load = cache.load(caches, hit, [4, 5, 6])
    load.result()
    assert _sample(registry, "kvxfer_pages_offloaded_total") == 3
    assert _sample(registry, "kvxfer_pages_verified_total") == 2
    assert _sample(registry, "kvxfer_mismatches_total", reason="digest mismatch") == 1
    assert _sample(registry, "kvxfer_load_seconds_count") == 1
    assert _sample(registry, "kvxfer_load_seconds_quantile", quantile="0.99") > 0
    assert _sample(registry, "kvxfer_host_free_pages") == 2
    assert _sample(registry, "kvxfer_cache_host_hits_total") == 2
    assert _sample(registry, "kvxfer_cache_bad_pages_by_tier_total", tier="host") == 1
    # A scrape reads the counters as they are now.
    cache.put(caches, [7], [9], wait=True)
    assert _sample(registry, "kvxfer_pages_offloaded_total") == 4
    cache.close(), mgr.close()


def test_bad_sources_and_prefixes():
    with pytest.raises(TypeError, match="stats"):
        kvxfer.metrics.register(object())
    with pytest.raises(ValueError, match="prefix='a-b'"):
        kvxfer.metrics.register(kvxfer.HostCache.__new__(kvxfer.HostCache), prefix="a-b")
