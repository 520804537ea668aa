"""When host pages reach the store: write-back ("never"), write-through ("always"), and
selective write-through after N hits; the store bytes each writes."""

import pytest

import kvxfer
from kvxfer import store, testing


@pytest.fixture
def rig(tmp_path):
    caches = testing.random_caches(2, 16, (4, 32), "bfloat16")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=3)
    disk = store.DiskStore(tmp_path / "pages")
    made = []

    def make(**options):
        cache = kvxfer.HostCache(mgr, disk, **{"namespace": "test-model", **options})
        made.append(cache)
        return cache

    yield caches, mgr, disk, make
    for cache in made:
        cache.close()
    mgr.close(), disk.close()


def _blob_bytes(mgr, cache, key):
    return len(mgr.export_page(cache.page_of(key)))


def _put_each(cache, caches, keys, first_block=0):
    for j, key in enumerate(keys):
        assert cache.put(caches, [first_block + j], [key], wait=True) == [key]


def _look(cache, keys, times=1):
    for _ in range(times):
        cache.release(cache.lookup(keys))


def test_never_writes_back_on_eviction_and_on_flush(rig):
    caches, mgr, disk, make = rig
    cache = make()
    assert cache.write_through == "never"
    _put_each(cache, caches, [1, 2, 3])
    blob = _blob_bytes(mgr, cache, 1)
    cache.lookup([])  # any call starts the writes due (none here)
    assert disk.stats()["puts"] == 0
    _put_each(cache, caches, [4], first_block=3)  # 1 is evicted: written back
    assert cache.flush() == 3  # the host pages the store lacks: 2, 3, 4 (1 is there)
    assert disk.stats()["puts"] == 4 and disk.contains(cache.store_key(1))
    st = cache.stats()
    assert st["store_pages_written"] == 4
    assert st["store_bytes_written"] == st["store_pages_written"] * blob
    assert st["store_writes_gated"] == 0


def test_always_writes_every_page_once_it_is_on_host(rig):
    caches, mgr, disk, make = rig
    cache = make(write_through="always")
    _put_each(cache, caches, [1, 2])
    cache.lookup([])
    cache.flush()
    assert all(disk.contains(cache.store_key(k)) for k in (1, 2)) and cache.flush() == 0
    st = cache.stats()
    assert st["store_pages_written"] == 2
    assert st["store_bytes_written"] == 2 * _blob_bytes(mgr, cache, 1)
    assert make(write_through=True).write_through == "always"  # the older spelling
    assert make(write_through=False).write_through == "never"


def test_a_hit_count_writes_a_page_on_its_nth_hit_and_never_a_one_off(rig):
    caches, mgr, disk, make = rig
    cache = make(write_through=2)
    _put_each(cache, caches, [1, 2, 3])
    blob = _blob_bytes(mgr, cache, 1)
    _look(cache, [1], times=2)  # the second hit writes 1
    _look(cache, [2])           # one hit: not yet
    assert cache.flush() == 0   # flush too leaves out pages under 2 hits
    assert disk.contains(cache.store_key(1)) and not disk.contains(cache.store_key(2))
    assert disk.stats()["puts"] == 1
    _put_each(cache, caches, [4, 5, 6], first_block=3)  # 1, 2, 3 evicted
    st = cache.stats()
    assert st["evictions"] == 3 and st["store_writes_gated"] == 2  # 2 and 3: one-offs
    assert st["store_pages_written"] == 1 and st["store_bytes_written"] == blob
    assert not disk.contains(cache.store_key(2)) and not disk.contains(cache.store_key(3))
    hit = cache.lookup([1, 2])  # 1 comes back from the store; 2 was never written
    assert hit.tiers == ("store",)
    caches, load = cache.load(caches, hit, [10])
    assert load.result().verified_prefix == 1


def test_a_page_promoted_from_the_store_is_not_written_again_on_its_hits(rig):
    caches, mgr, disk, make = rig
    first = make()
    _put_each(first, caches, [1])
    assert first.flush() == 1
    first.close()
    cache = make(write_through=1)
    hit = cache.lookup([1])
    assert hit.tiers == ("store",)
    cache.release(hit)
    puts = disk.stats()["puts"]
    _look(cache, [1], times=3)
    assert disk.stats()["puts"] == puts and cache.stats()["store_pages_written"] == 0


@pytest.mark.parametrize("bad", [0, -1, "sometimes", 1.5, None])
def test_bad_write_through_values_are_named(rig, bad):
    _, mgr, _, make = rig
    with pytest.raises(ValueError, match=r"Expected write_through 'always', 'never' or a "
                                         r"hit count >= 1. Got " + repr(bad).replace(".", r"\.")):
        make(write_through=bad)


def test_writing_to_the_store_needs_a_store(rig):
    _, mgr, _, _ = rig
    for value in ("always", 2, True):
        with pytest.raises(ValueError, match=f"write_through={value!r} needs a store"):
            kvxfer.HostCache(mgr, write_through=value)
    kvxfer.HostCache(mgr, write_through="never").close()
