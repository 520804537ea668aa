"""HostCache over host memory alone: prefixes, one page per key, LRU, pins, bad pages."""

import logging
import threading

import pytest

import kvxfer
from kvxfer import testing
from kvxfer.integrity import key_from_bytes


# Every behaviour here holds under each eviction policy (tests/test_cache_policy.py
# has what tells them apart).
@pytest.fixture(params=["lru", "s3fifo", "arc"])
def rig(request):
    caches = testing.random_caches(2, 16, (4, 32), "float32")
    want = [testing.bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    cache = kvxfer.HostCache(mgr, policy=request.param)
    state = {"caches": caches}
    yield mgr, cache, state, want
    cache.close()
    mgr.close()


def _put(cache, state, blocks, keys):
    return cache.put(state["caches"], blocks, keys, wait=True)


def test_longest_prefix_stops_at_the_first_missing_key(rig):
    mgr, cache, state, want = rig
    _put(cache, state, [0, 1, 2], [10, 11, 12])
    hit = cache.lookup([10, 11, 99, 12])
    assert hit.keys == (10, 11) and hit.tiers == ("host", "host")
    state["caches"], load = cache.load(state["caches"], hit, [8, 9])
    assert load.result().verified_prefix == 2
    for layer in range(2):
        got = testing.bits(state["caches"][layer])
        assert (got[8] == want[layer][0]).all() and (got[9] == want[layer][1]).all()
    st = cache.stats()
    assert st["host_hits"] == 2 and st["misses"] == 2 and st["pinned_pages"] == 0


def test_one_page_per_key(rig):
    mgr, cache, state, _ = rig
    assert _put(cache, state, [0, 1], [10, 11]) == [10, 11]
    assert _put(cache, state, [2, 3, 3], [11, 12, 12]) == [12]
    assert len(cache) == 3 and mgr.num_free_pages == 1
    assert cache.stats()["duplicates"] == 2


def test_eviction_order_follows_use(rig):
    # One prefix: its tail goes first (13, then 12), and 10, looked up again, stays
    # (LRU: the most recently used; S3-FIFO: the only page looked up; ARC: the only
    # page in T2).
    mgr, cache, state, _ = rig
    _put(cache, state, [0, 1, 2, 3], [10, 11, 12, 13])
    cache.release(cache.lookup([10]))
    _put(cache, state, [4, 5], [14, 15])  # a full pool: two pages must go
    assert [k in cache for k in (10, 11, 12, 13, 14, 15)] == [True, True, False, False,
                                                             True, True]
    assert cache.stats()["evictions"] == 2


def test_eviction_never_takes_a_page_a_load_reads(rig):
    mgr, cache, state, _ = rig
    _put(cache, state, [0, 1, 2, 3], [10, 11, 12, 13])
    hit = cache.lookup([10, 11, 12])  # pinned from here on
    assert _put(cache, state, [4, 5, 6], [14, 15, 16]) == [14]  # only 13 could go
    assert cache.stats()["dropped"] == 2
    go = threading.Event()
    mgr.set_transfer_hook(lambda event, layer, array: event == "load_layer" and go.wait(60))
    try:
        state["caches"], load = cache.load(state["caches"], hit, [8, 9, 10])
        # (no wait: the one transfer thread is held inside the load)
        assert cache.put(state["caches"], [5, 6], [15, 16]) == [15]  # 14 goes, not 10..12
        assert all(k in cache for k in (10, 11, 12))
    finally:
        go.set()
    assert load.result().verified_prefix == 3
    assert cache.stats()["pinned_pages"] == 0  # settled: evictable again
    assert _put(cache, state, [6, 7, 8], [16, 17, 18]) == [16, 17, 18]


def test_a_page_found_bad_leaves_the_index(rig, caplog):
    mgr, cache, state, _ = rig
    _put(cache, state, [0, 1, 2], [10, 11, 12])
    hit = cache.lookup([10, 11, 12])
    testing.flip_bit(mgr, hit.pages[1], layer=1)
    state["caches"], load = cache.load(state["caches"], hit, [8, 9, 10])
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        result = load.result()
    assert result.verified_prefix == 1
    assert 11 not in cache and 10 in cache and 12 in cache  # 12 is intact
    assert "page 0xb from host memory failed verification" in caplog.text
    st = cache.stats()
    assert st["bad_pages_by_tier"] == {"host": 1} and st["host_hits"] == 1
    assert cache.lookup([10, 11]).keys == (10,)


def test_a_lookup_waits_for_an_offload_in_flight(rig):
    mgr, cache, state, _ = rig
    assert cache.put(state["caches"], [0, 1], [10, 11]) == [10, 11]
    hit = cache.lookup([10, 11])  # no wait above: found once the offload ends
    assert hit.num_pages == 2
    cache.release(hit)


def test_bad_arguments_name_the_value(rig):
    mgr, cache, state, _ = rig
    with pytest.raises(ValueError, match=r"keys\[1\]: key -1"):
        cache.lookup([1, -1])
    with pytest.raises(ValueError, match="1 device_blocks for 2 keys"):
        cache.put(state["caches"], [0], [1, 2])
    with pytest.raises(TypeError, match="CacheHit"):
        cache.load(state["caches"], [1], [0])
    with pytest.raises(ValueError, match="write_through=True needs a store"):
        kvxfer.HostCache(mgr, write_through=True)


def test_keys_are_what_the_manager_takes(rig):
    # vLLM's block hashes are bytes; numpy ints come out of block tables.
    import numpy as np
    mgr, cache, state, want = rig
    assert _put(cache, state, np.array([0, 1]), [b"block-a", np.uint64(12)]) == [
        key_from_bytes(b"block-a"), 12]
    hit = cache.lookup([b"block-a", np.int64(12)])
    assert hit.num_pages == 2 and b"block-a" in cache and cache.find(b"block-a") == "host"
    state["caches"], load = cache.load(state["caches"], hit, [8, 9])
    assert load.result().verified_prefix == 2
    assert (testing.bits(state["caches"][1])[8] == want[1][0]).all()
    with pytest.raises(ValueError, match=r"keys\[0\]: key 'a' of type str"):
        cache.lookup(["a"])


def test_block_ids_per_slice_class():
    # Two slice classes with their own block ids, as the manager's offload and
    # load take them; a mapping that leaves a class out is refused, evicting nothing.
    caches = testing.random_caches(1, 16, (4, 32), "float32") + \
        testing.random_caches(1, 8, (2, 32), "float32", seed=1)
    want = [testing.bits(c) for c in caches]
    with kvxfer.KVCacheManager(caches, num_host_blocks=2) as mgr:
        cache = kvxfer.HostCache(mgr)
        assert len(mgr.plan.classes) == 2
        assert cache.put(caches, {0: [3, 4], 1: [6, 7]}, [10, 11], wait=True) == [10, 11]
        with pytest.raises(ValueError, match=r"names slice classes \[0\]; a cached page "
                                             r"holds every class: name all of 0..1"):
            cache.put(caches, {0: [5]}, [12])
        with pytest.raises(ValueError, match=r"1 device_blocks\[1\] for 2 keys"):
            cache.put(caches, {0: [5, 6], 1: [1]}, [12, 13])
        assert len(cache) == 2 and cache.stats()["evictions"] == 0
        hit = cache.lookup([10, 11])
        caches, load = cache.load(caches, hit, {0: [0, 1], 1: [0, 1]})
        assert load.result().verified_prefix == 2
        got = [testing.bits(c) for c in caches]
        assert (got[0][[0, 1]] == want[0][[3, 4]]).all()
        assert (got[1][[0, 1]] == want[1][[6, 7]]).all()
        cache.close()


def test_load_takes_block_ids_per_slice_class_as_its_annotation_says(rig):
    import inspect

    mgr, cache, state, want = rig
    hint = inspect.signature(kvxfer.HostCache.load).parameters["device_blocks"].annotation
    assert "Mapping[int, Sequence[int]]" in str(hint)
    _put(cache, state, [0, 1], [10, 11])
    hit = cache.lookup([10, 11])
    state["caches"], load = cache.load(state["caches"], hit, {0: [8, 9]})
    assert load.result().verified_prefix == 2
    for layer in range(2):
        got = testing.bits(state["caches"][layer])
        assert (got[8] == want[layer][0]).all() and (got[9] == want[layer][1]).all()


def test_bad_block_ids_evict_nothing(rig):
    mgr, cache, state, _ = rig
    _put(cache, state, [0, 1, 2, 3], [10, 11, 12, 13])
    with pytest.raises(ValueError, match="out of range"):
        cache.put(state["caches"], [99], [14])
    assert len(cache) == 4 and cache.stats()["evictions"] == 0


def test_pins_are_released_once_per_hit(rig):
    mgr, cache, state, _ = rig
    _put(cache, state, [0, 1, 2, 3], [10, 11, 12, 13])
    first, second = cache.lookup([10]), cache.lookup([10])
    with pytest.raises(ValueError):  # nothing moved: the hit keeps its pins
        cache.load(state["caches"], first, [99])
    cache.release(first)
    cache.release(first)  # a second release of the same hit is a no-op
    with pytest.raises(ValueError, match="released or loaded already"):
        cache.load(state["caches"], first, [8])
    assert cache.stats()["pinned_pages"] == 1  # the second hit still holds page 10
    assert _put(cache, state, [4, 5, 6, 7], [14, 15, 16, 17]) == [14, 15, 16]
    assert 10 in cache
    state["caches"], load = cache.load(state["caches"], second, [8])
    assert load.result().verified_prefix == 1
    cache.release(second)  # settled already: a no-op
    assert cache.stats()["pinned_pages"] == 0


def test_a_page_freed_behind_the_cache_is_put_again(rig):
    mgr, cache, state, _ = rig
    _put(cache, state, [0], [10])
    mgr.free([cache.page_of(10)])
    assert _put(cache, state, [0], [10]) == [10]
    assert mgr.is_valid(cache.page_of(10))


def test_a_put_larger_than_the_pool_keeps_the_start_of_its_prefix(rig):
    # A page is of use only after the pages before it: one put of 6 pages into a pool
    # of 4 keeps the first 4 (evicting the other prefix's pages to make room).
    mgr, cache, state, _ = rig
    _put(cache, state, [0, 1], [90, 91])
    assert _put(cache, state, [2, 3, 4, 5, 6, 7], [10, 11, 12, 13, 14, 15]) == \
        [10, 11, 12, 13]
    st = cache.stats()
    assert st["evictions"] == 2 and st["dropped"] == 2
    assert cache.lookup([10, 11, 12, 13, 14, 15]).num_pages == 4


def test_a_put_never_evicts_the_prefix_it_extends(rig):
    # The pool holds the first two pages of a prefix and two of another; putting the
    # whole prefix evicts the other's pages, not its own start: 4 usable pages, not a
    # tail without its head.
    mgr, cache, state, _ = rig
    _put(cache, state, [0, 1], [10, 11])
    _put(cache, state, [2, 3], [90, 91])
    cache.release(cache.lookup([90, 91]))  # the other prefix is the more recent
    assert _put(cache, state, [0, 1, 4, 5, 6, 7], [10, 11, 12, 13, 14, 15]) == [12, 13]
    assert sorted(cache.keys()) == [10, 11, 12, 13]
    hit = cache.lookup([10, 11, 12, 13, 14, 15])
    assert hit.num_pages == 4
    cache.release(hit)


def test_the_cache_modules_import_one_way():
    # Each module of kvxfer.cache imports others of it (type-only imports too), never
    # one that imports it back, directly or round about.
    import ast
    import pathlib

    import kvxfer.cache
    root = pathlib.Path(kvxfer.cache.__file__).parent
    graph = {}
    for path in root.glob("_*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("kvxfer.cache._"):
                names.add(node.module.rsplit(".", 1)[1])
        graph[path.stem] = names

    def circle(start, node, seen):
        for nxt in graph.get(node, ()):
            if nxt == start:
                return [node, nxt]
            if nxt not in seen:
                seen.add(nxt)
                found = circle(start, nxt, seen)
                if found:
                    return [node, *found]
        return None

    assert "_host" in graph and "_store_tier" in graph
    circles = {m: circle(m, m, {m}) for m in graph}
    assert not {m: c for m, c in circles.items() if c}
