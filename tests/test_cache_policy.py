"""Eviction policies: each one's textbook behaviour on small traces, pins never evicted,
and a HostCache on each (its shared behaviours are in tests/test_cache.py)."""

import logging
import random
import threading
import time

import pytest

import kvxfer
from kvxfer import store, testing
from kvxfer.cache import ARCPolicy, CachePolicy, LRUPolicy, S3FIFOPolicy

POLICIES = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy, "arc": ARCPolicy}


def _policy(name, capacity):
    p = POLICIES[name]()
    p.bind(capacity)
    return p


def _replay(policy, trace, capacity):
    """Runs ``trace`` as a cache of ``capacity`` pages would: a key present is a hit
    (touched), else room is made and it is inserted. Returns the hits, per access."""
    hits = []
    for key in trace:
        if key in policy:
            policy.touch(key)
            hits.append(True)
            continue
        if len(policy) >= capacity:
            assert len(policy.evict(len(policy) + 1 - capacity, pinned=())) == 1
        policy.insert(key)
        hits.append(False)
    return hits


def test_lru_evicts_the_least_recently_used():
    p = _policy("lru", 3)
    _replay(p, [1, 2, 3, 1, 4], 3)
    assert p.order() == [3, 1, 4] and 2 not in p


@pytest.mark.parametrize("name,survives", [("lru", False), ("s3fifo", True),
                                           ("arc", True)])
def test_a_scan_of_one_off_pages_flushes_lru_but_not_s3fifo_or_arc(name, survives):
    hot = [1, 2, 3]
    trace = hot + hot + list(range(100, 150)) + hot  # looked up again, a scan, again
    hits = _replay(_policy(name, 10), trace, 10)
    assert hits[-3:] == [survives] * 3
    assert sum(hits[6:-3]) == 0  # the scan itself never hits


def test_s3fifo_one_off_pages_leave_through_the_ghost_and_come_back_to_main():
    p = _policy("s3fifo", 4)  # a small queue of one page
    for key in (1, 2, 3, 4):
        p.insert(key)
    p.touch(2)
    assert p.evict(1, pinned=()) == [1]  # never looked up: out, its key a ghost
    assert p.queue_of(1) == "ghost" and p.queue_of(2) == "small"
    p.insert(1)  # back soon after: straight to the main queue
    assert p.queue_of(1) == "main"
    assert p.evict(1, pinned=()) == [3]  # 2 was looked up: moved to main, not evicted
    assert p.queue_of(2) == "main" and p.order() == [4, 1, 2]


def test_s3fifo_main_queue_gives_looked_up_pages_a_chance_per_lookup():
    p = _policy("s3fifo", 4)
    for key in (1, 2, 3, 4):
        p.insert(key)
    for key in (1, 2, 3):
        p.touch(key)
    assert p.evict(1, pinned=()) == [4]  # 1..3 move to main on the way
    p.touch(2)  # 2: frequency 2, 1 and 3: frequency 1
    assert p.evict(1, pinned=()) == [1]  # each passed over once, one lower
    assert p.evict(1, pinned=()) == [3]
    assert p.order() == [2] and p.evict(1, pinned=()) == [2]


def test_s3fifo_frequency_is_two_bits():
    p = _policy("s3fifo", 3)
    for key in (1, 2, 3):
        p.insert(key)
    for _ in range(10):
        p.touch(1)
    for _ in range(3):
        p.touch(2)
    assert p.evict(1, pinned=()) == [3]  # 1 and 2 move to main
    # Both at frequency 3 (1's ten lookups count as three): the older one goes first.
    assert p.evict(1, pinned=()) == [1]


def test_arc_moves_pages_seen_twice_to_t2_and_adapts_its_target():
    p = _policy("arc", 2)
    p.insert(1), p.insert(2)
    assert p.lists() == {"t1": [1, 2], "t2": [], "b1": [], "b2": []}
    assert p.evict(1, pinned=()) == [1] and p.lists()["b1"] == [1]
    p.insert(1)  # a ghost of T1 came back: T1 was too small, p grows
    assert p.target == 1.0 and p.lists() == {"t1": [2], "t2": [1], "b1": [], "b2": []}
    assert p.evict(1, pinned=()) == [1]  # |T1| = p: T2 gives the page
    p.insert(1)  # a ghost of T2 came back: p shrinks
    assert p.target == 0.0 and p.lists() == {"t1": [2], "t2": [1], "b1": [], "b2": []}
    p.touch(2)
    assert p.lists()["t2"] == [1, 2]


def test_arc_target_follows_the_workload():
    # A hot set seen twice fills T2; a loop of new pages then keeps coming back just
    # after T1 evicted them (ghost hits in B1): p grows until the loop fits. When the
    # hot set returns from B2, p shrinks again.
    p = _policy("arc", 8)
    hot, loop = [0, 1, 2, 3], list(range(10, 16))
    hits = _replay(p, hot * 2 + loop * 6, 8)
    assert p.target == 5.0 and hits[-6:] == [True] * 6
    assert p.lists()["b2"] == [0, 1]  # T2 gave up hot pages to make T1 room
    hits = _replay(p, hot * 4, 8)
    assert p.target == 1.0 and hits[-4:] == [True] * 4
    # A frequent set among one-off pages: it stays in T2 and every return is a hit,
    # where LRU (its stack distance is 11 pages) never hits it.
    hot = list(range(6))
    trace = hot * 3 + [k for j in range(40) for k in (100 + j, hot[j % 6])]
    assert sum(_replay(_policy("arc", 8), trace, 8)[-40:]) == 20
    assert sum(_replay(_policy("lru", 8), trace, 8)[-40:]) == 0


@pytest.mark.parametrize("seed", range(3))
def test_arc_lists_stay_within_their_bounds(seed):
    rng = random.Random(seed)
    p = _policy("arc", 6)
    for _ in range(400):
        _replay(p, [rng.randrange(20)], 6)
        sizes = {k: len(v) for k, v in p.lists().items()}
        assert sizes["t1"] + sizes["t2"] <= 6 and sizes["t1"] + sizes["b1"] <= 6
        assert sum(sizes.values()) <= 12 and 0 <= p.target <= 6


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_pinned_pages_are_never_evicted(name, seed):
    rng = random.Random(seed)
    p = _policy(name, 8)
    resident = set()
    for _ in range(600):
        key = rng.randrange(30)
        if key in resident:
            p.touch(key)
            continue
        if len(resident) >= 8:
            pinned = {k for k in resident if rng.random() < 0.5}
            want = rng.randint(1, 3)
            out = p.evict(want, pinned)
            assert not set(out) & pinned and set(out) <= resident and len(set(out)) == len(out)
            assert len(out) == min(want, len(resident - pinned))  # all it can, no more
            resident -= set(out)
            if len(resident) >= 8:
                continue
        p.insert(key)
        resident.add(key)
        assert len(p) == len(resident) and set(p.order()) == resident
    assert p.evict(3, pinned=resident) == []  # all pinned: nothing goes


@pytest.mark.parametrize("name", POLICIES)
def test_evict_returns_what_it_can_when_most_pages_are_pinned(name):
    p = _policy(name, 4)
    for key in (1, 2, 3, 4):
        p.insert(key)
        p.touch(key)
    assert p.evict(3, pinned={1, 2, 4}) == [3]
    assert sorted(p.order()) == [1, 2, 4]


# -- a HostCache on each policy ------------------------------------------------------


def _rig(policy, num_host_blocks=8, blocks=64):
    caches = testing.random_caches(2, blocks, (4, 32), "float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=num_host_blocks)
    return caches, mgr, kvxfer.HostCache(mgr, policy=policy)


@pytest.mark.parametrize("name,kept", [("lru", 0), ("s3fifo", 2), ("arc", 2)])
def test_a_cache_keeps_a_shared_prefix_through_a_scan(name, kept):
    caches, mgr, cache = _rig(name)
    assert cache.policy.name == name
    cache.put(caches, [0, 1], [1, 2], wait=True)
    cache.release(cache.lookup([1, 2]))  # the shared prefix is used again
    for j in range(20):  # long one-off prompts: pages nobody looks up again
        assert cache.put(caches, [2 + j], [100 + j], wait=True) == [100 + j]
    hit = cache.lookup([1, 2])
    assert hit.num_pages == kept and cache.stats()["evictions"] == 14
    cache.release(hit)
    cache.close(), mgr.close()


def test_a_store_page_promoted_under_s3fifo_enters_the_policy(tmp_path):
    caches = testing.random_caches(2, 64, (4, 32), "float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    disk = store.DiskStore(tmp_path / "pages")
    cache = kvxfer.HostCache(mgr, disk, policy="s3fifo", namespace="test-model")
    for j, key in enumerate((10, 11, 12, 13, 14)):  # 14 evicts 10, spilled to the store
        cache.put(caches, [j], [key], wait=True)
    assert cache.find(10) == "store" and cache.policy.queue_of(10) == "ghost"
    hit = cache.lookup([10])  # promoted: 11 makes room, 10's ghost sends it to main
    assert hit.tiers == ("store",) and cache.keys() == [12, 13, 14, 10]
    assert cache.policy.queue_of(10) == "main" and cache.policy.queue_of(11) == "ghost"
    caches, load = cache.load(caches, hit, [20])
    assert load.result().verified_prefix == 1 and cache.stats()["store_hits"] == 1
    cache.close(), mgr.close(), disk.close()


class _Evicts(CachePolicy):
    """A policy that evicts the key it is told to, pinned or not."""

    def __init__(self, victim):
        self.victim, self.keys = victim, []

    def __len__(self):
        return len(self.keys)

    def __contains__(self, key):
        return key in self.keys

    def order(self):
        return list(self.keys)

    def insert(self, key):
        self.keys.append(key)

    def touch(self, key):
        pass

    def remove(self, key):
        if key in self.keys:
            self.keys.remove(key)

    def evict(self, n, pinned):
        self.keys.remove(self.victim)
        return [self.victim]


def test_a_policy_that_evicts_a_pinned_page_is_refused_by_name():
    caches, mgr, _ = _rig("lru", num_host_blocks=2)
    cache = kvxfer.HostCache(mgr, policy=_Evicts(victim=10))
    cache.put(caches, [0, 1], [10, 11], wait=True)
    hit = cache.lookup([10])
    with pytest.raises(RuntimeError, match=r"'custom' policy evicted page 10, which is "
                                           r"pinned: a CachePolicy must return unpinned"):
        cache.put(caches, [2], [12], wait=True)
    assert cache.page_of(10) is not None and mgr.is_valid(cache.page_of(10))
    cache.release(hit)
    cache.close(), mgr.close()


def test_policy_arguments_are_checked():
    caches, mgr, cache = _rig("lru")
    with pytest.raises(ValueError, match=r"Expected policy in \('lru', 's3fifo', 'arc'\) or "
                                         r"a CachePolicy. Got 'clock' of type str"):
        kvxfer.HostCache(mgr, policy="clock")
    shared = ARCPolicy()
    kvxfer.HostCache(mgr, policy=shared).close()
    with pytest.raises(ValueError, match="this ARCPolicy serves a cache already"):
        kvxfer.HostCache(mgr, policy=shared)
    with pytest.raises(ValueError, match=r"Expected small_fraction in \(0, 1\). Got 1.5"):
        S3FIFOPolicy(small_fraction=1.5)
    assert cache.policy.capacity == 8
    cache.close(), mgr.close()


class _Careless(LRUPolicy):
    """LRU that, while ``careless`` names a way, answers ``evict`` wrongly that way: it
    takes its n oldest keys, pinned or not (``"pinned"``), adds a key it never held or
    more keys than asked to its unpinned ones (``"foreign"``, ``"too many"``), or drops
    its n oldest keys and then raises (``"raises"``)."""

    name = "careless"

    def __init__(self):
        super().__init__()
        self.careless = None

    def evict(self, n, pinned):
        if self.careless in (None, "foreign", "too many"):
            out = super().evict(n, pinned)
            extra = {"foreign": [999], "too many": [200, 201]}.get(self.careless, [])
            return extra + out
        out = list(self._order)[:n]
        for key in out:
            del self._order[key]
        if self.careless == "raises":
            raise KeyError("lost my place")
        return out


@pytest.mark.parametrize("careless", ["pinned", "foreign", "too many", "raises"])
def test_a_wrong_evict_answer_costs_no_slot(careless):
    # Each key of a wrong answer has left the policy: taken at its word, the cache
    # would keep pages no eviction can take (2 of 3 slots, for good).
    policy = _Careless()
    caches, mgr, cache = _rig(policy, num_host_blocks=3)
    cache.put(caches, [0, 1, 2], [10, 11, 12], wait=True)
    hit = cache.lookup([10])  # 10 is pinned
    policy.careless = careless
    why = {"pinned": "page 10, which is pinned", "raises": r"evict\(3\) raised KeyError",
           "foreign": "page 999, which is not a page of this cache",
           "too many": "4 pages when asked for 3"}[careless]  # (2 unpinned, 2 more)
    said = "'s" if careless == "raises" else " evicted"
    with pytest.raises(RuntimeError, match=f"the 'careless' policy{said} {why}"):
        cache.put(caches, [3, 4, 5], [13, 14, 15], wait=True)
    assert sorted(cache.keys()) == [10, 11, 12] and mgr.num_free_pages == 0
    if careless != "raises":  # refused whole: every page it named is back in the policy
        assert sorted(policy.order()) == [10, 11, 12]
    assert mgr.is_valid(cache.page_of(10)) and hit.num_pages == 1
    policy.careless = None
    cache.release(hit)
    assert cache.put(caches, [3, 4, 5], [13, 14, 15], wait=True) == [13, 14, 15]
    assert sorted(cache.keys()) == [13, 14, 15] and cache.stats()["evictions"] == 3
    cache.close(), mgr.close()


class _Refuses(LRUPolicy):
    """LRU whose ``insert`` of one key always raises."""

    name = "refuses"

    def insert(self, key):
        if key == 13:
            raise ValueError("no room in my table for 13")
        super().insert(key)


def _cache_threads():
    return {t for t in threading.enumerate() if t.name.startswith("kvxfer-") and
            not t.name.startswith("kvxfer-transfer")}


def test_an_insert_that_keeps_raising_costs_its_page_only_and_close_stops_the_threads(
        tmp_path, caplog):
    caches = testing.random_caches(2, 16, (4, 32), "float32")
    disk = store.DiskStore(tmp_path / "pages")
    before = _cache_threads()
    with kvxfer.KVCacheManager(caches, num_host_blocks=4) as mgr:
        cache = kvxfer.HostCache(mgr, disk, policy=_Refuses(), write_through=True,
                                 namespace="test-model")
        cache.subscribe(lambda events: None)
        with caplog.at_level(logging.ERROR, logger="kvxfer"):
            assert cache.put(caches, [0, 1, 2], [12, 13, 14], wait=True) == [12, 13, 14]
        assert "the 'refuses' policy's insert(13) raised ValueError: no room in my " \
               "table for 13" in caplog.text
        assert sorted(cache.keys()) == [12, 14] and mgr.num_free_pages == 2  # 13 freed
        assert cache.stats()["dropped"] == 1
        assert cache.lookup([12]).num_pages == 1  # later calls go on
        assert cache.prefetch([14]).result(10) == 1
        assert cache.flush() == 0  # written through already
        assert len(_cache_threads() - before) >= 3  # writer, prefetcher, events
        cache.close()
        for _ in range(500):  # executor threads leave once idle
            if not _cache_threads() - before:
                break
            time.sleep(0.01)
        assert not _cache_threads() - before
    disk.close()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_prefix_under_memory_pressure_comes_back_whole(name, tmp_path):
    # Pool of 8, a disk store below: prefix A (6 pages), then B (4 pages) pushes two of
    # A's pages out. Promoting them must not evict A's own host pages (a lookup cut
    # A short to its 2 store pages), and the put takes A's tail, not its head.
    caches = testing.random_caches(2, 16, (4, 32), "float32")
    disk = store.DiskStore(tmp_path / "pages")
    with kvxfer.KVCacheManager(caches, num_host_blocks=8) as mgr:
        cache = kvxfer.HostCache(mgr, disk, policy=name, namespace="test-model")
        a, b = [100 + i for i in range(6)], [200 + i for i in range(4)]
        cache.put(caches, list(range(6)), a, wait=True)
        cache.put(caches, list(range(6, 10)), b, wait=True)
        assert sorted(cache.keys()) == a[:4] + b  # A's tail went, its head stayed
        hit = cache.lookup(a)
        assert hit.keys == tuple(a) and hit.tiers == ("host",) * 4 + ("store",) * 2
        caches, load = cache.load(caches, hit, list(range(10, 16)))
        assert load.result().verified_prefix == 6
        hit = cache.lookup(b)  # what A's promotion evicted comes back from the store
        assert hit.keys == tuple(b)
        cache.release(hit)
        assert cache.stats()["pinned_pages"] == 0
        cache.close()
    disk.close()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_prefix_used_together_is_ordered_tail_first(name):
    p = _policy(name, 10)
    for k in (1, 2, 3, 4):
        p.insert(k)
    p.used_together([1, 2, 3, 4])
    assert p.evict(2, pinned=()) == [4, 3]
    p.used_together([1, 99])  # keys it does not hold are passed over
    assert p.evict(2, pinned=()) == [2, 1]


class _HeadFirst(LRUPolicy):
    """LRU that ignores prefixes: a put's head is its oldest page, evicted first."""

    name = "head-first"

    def used_together(self, keys):
        pass


def test_promoting_a_prefix_head_never_evicts_its_own_tail(tmp_path):
    # A's head (2 pages) in the store only, its tail (4) on host, B (4) on host and
    # more recent: promoting the head must evict B's pages, not A's tail.
    caches = testing.random_caches(2, 16, (4, 32), "float32")
    disk = store.DiskStore(tmp_path / "pages")
    with kvxfer.KVCacheManager(caches, num_host_blocks=8) as mgr:
        cache = kvxfer.HostCache(mgr, disk, policy=_HeadFirst(), namespace="test-model")
        a, b = [100 + i for i in range(6)], [200 + i for i in range(4)]
        cache.put(caches, list(range(6)), a, wait=True)
        cache.put(caches, list(range(6, 10)), b, wait=True)
        assert sorted(cache.keys()) == a[2:] + b
        hit = cache.lookup(a)
        assert hit.keys == tuple(a) and hit.tiers == ("store",) * 2 + ("host",) * 4
        cache.release(hit)
        assert sorted(cache.keys()) == a + b[2:] and cache.stats()["pinned_pages"] == 0
        cache.close()
    disk.close()


class _TouchRaises(LRUPolicy):
    """LRU whose ``touch`` (and ``used_together``) of key 11 raises ``error``."""

    name = "touchy"

    def __init__(self, error):
        super().__init__()
        self.error = error

    def touch(self, key):
        if key == 11 and self.error is not None:
            raise self.error
        super().touch(key)

    def used_together(self, keys):
        if 11 in keys and self.error is not None:
            raise self.error
        super().used_together(keys)


@pytest.mark.parametrize("error", [RuntimeError("lost my place"), KeyboardInterrupt()],
                         ids=["Exception", "BaseException"])
def test_a_touch_that_raises_leaves_no_pin(error):
    # The pages a lookup pinned before the policy raised are unpinned (a lookup that
    # raises returns no hit to release them with), and the cache goes on.
    policy = _TouchRaises(None)
    caches, mgr, cache = _rig(policy, num_host_blocks=4)
    cache.put(caches, [0, 1, 2], [10, 11, 12], wait=True)
    policy.error = error
    if isinstance(error, Exception):
        hit = cache.lookup([10, 11, 12])  # logged; the lookup is a use all the same
        assert hit.num_pages == 3
        cache.release(hit)
    else:
        with pytest.raises(KeyboardInterrupt):
            cache.lookup([10, 11, 12])
    assert cache.stats()["pinned_pages"] == 0
    policy.error = None
    assert cache.put(caches, [3, 4, 5, 6], [20, 21, 22, 23], wait=True) == [20, 21, 22, 23]
    cache.close(), mgr.close()
