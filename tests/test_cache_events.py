"""Cache events: stored / evicted / removed per tier, batched, in order, on a thread of
their own and never under the cache's lock; a callback's failure is logged."""

import logging
import threading

import pytest

import kvxfer
from kvxfer import store, testing
from kvxfer._counters import Counters
from kvxfer.cache import CacheEvent
from kvxfer.cache._events import EventHub


@pytest.fixture
def rig(tmp_path):
    caches = testing.random_caches(2, 16, (4, 32), "float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    disk = store.DiskStore(tmp_path / "pages")
    cache = kvxfer.HostCache(mgr, disk, namespace="test-model")
    yield caches, mgr, disk, cache
    cache.close(), mgr.close(), disk.close()


class Recorder:
    """A callback that keeps its batches and the thread each came on."""

    def __init__(self):
        self.batches, self.threads = [], set()

    def __call__(self, events):
        self.batches.append(list(events))
        self.threads.add(threading.current_thread().name)

    @property
    def events(self):
        return [(e.kind, e.key, e.tier) for b in self.batches for e in b]


def test_pages_arriving_and_leaving_each_tier_are_reported_in_order(rig):
    caches, mgr, disk, cache = rig
    rec = Recorder()
    sub = cache.subscribe(rec)
    cache.put(caches, [0, 1], [10, 11], wait=True)
    cache.put(caches, [2], [12], wait=True)  # a full pool: 11 (the tail) is spilled
    cache.flush()  # the spill is written; 10 and 12 too
    assert sub.wait(10)
    assert rec.events[:4] == [("stored", 10, "host"), ("stored", 11, "host"),
                              ("evicted", 11, "host"), ("stored", 12, "host")]
    assert sorted(rec.events[4:]) == [("stored", k, "store") for k in (10, 11, 12)]
    assert rec.threads == {"kvxfer-cache-events"}
    assert all(isinstance(e, CacheEvent) for b in rec.batches for e in b)
    hit = cache.lookup([10, 11])  # 11 promoted: 12 is evicted (stored: no new write)
    caches, load = cache.load(caches, hit, [5, 6])
    assert load.result().verified_prefix == 2
    cache.flush()
    sub.wait(10)
    assert rec.events[-2:] == [("evicted", 12, "host"), ("stored", 11, "host")]


def test_a_page_proven_bad_is_removed_from_every_tier(rig, caplog):
    caches, mgr, disk, cache = rig
    cache.put(caches, [0, 1], [10, 11], wait=True)
    cache.flush()
    rec = Recorder()
    sub = cache.subscribe(rec)
    hit = cache.lookup([10])
    testing.flip_bit(mgr, hit.pages[0], layer=0)
    caches, load = cache.load(caches, hit, [5])
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        assert load.result().verified_prefix == 0
    sub.wait(10)
    assert rec.events == [("removed", 10, "host"), ("removed", 10, "store")]


def test_a_callback_that_raises_is_logged_and_the_others_still_get_their_events(rig,
                                                                                caplog):
    caches, mgr, disk, cache = rig

    def broken(events):
        raise RuntimeError("router down")

    rec = Recorder()
    with caplog.at_level(logging.ERROR, logger="kvxfer"):
        bad, good = cache.subscribe(broken), cache.subscribe(rec)
        assert cache.put(caches, [0], [10], wait=True) == [10]  # the cache call is fine
        assert bad.wait(10) and good.wait(10)
        cache.put(caches, [1], [11], wait=True)
        good.wait(10)
    assert rec.events == [("stored", 10, "host"), ("stored", 11, "host")]
    assert "a cache event callback" in caplog.text and "router down" in caplog.text


def test_callbacks_run_outside_the_cache_lock_and_may_call_the_cache(rig):
    caches, mgr, disk, cache = rig
    go, seen = threading.Event(), []

    def slow(events):
        go.wait(30)  # a slow router: the cache's callers do not wait for it
        seen.append((len(cache), cache.find(events[0].key)))

    sub = cache.subscribe(slow)
    cache.put(caches, [0], [10], wait=True)
    cache.put(caches, [1], [11], wait=True)
    hit = cache.lookup([10, 11])  # the callback is still blocked: nothing waits for it
    assert hit.num_pages == 2
    cache.release(hit)
    go.set()
    assert sub.wait(10)
    assert seen and seen[0] == (2, "host")  # it called the cache from its own thread


def test_unsubscribe_stops_deliveries_and_a_new_subscriber_sees_only_later_events(rig):
    caches, mgr, disk, cache = rig
    first = Recorder()
    sub = cache.subscribe(first)
    cache.put(caches, [0], [10], wait=True)
    sub.wait(10)
    sub.unsubscribe()
    with cache.subscribe(Recorder()) as later:
        cache.put(caches, [1], [11], wait=True)
        assert later.wait(10)
        assert later.callback.events == [("stored", 11, "host")]
    cache.put(caches, [2], [12], wait=True)
    assert first.events == [("stored", 10, "host")]


def test_close_delivers_what_is_queued(rig):
    caches, mgr, disk, cache = rig
    rec = Recorder()
    cache.subscribe(rec)
    cache.put(caches, [0, 1], [10, 11], wait=True)
    cache.put(caches, [2], [12])  # still on its way in: indexed by close()
    cache.close()
    assert ("stored", 12, "host") in rec.events and ("stored", 11, "store") in rec.events
    with pytest.raises(RuntimeError, match="the HostCache is closed"):
        cache.subscribe(rec)


def test_subscribe_refuses_what_it_cannot_call(rig):
    *_, cache = rig
    with pytest.raises(TypeError, match="callback must be callable .* Got 3 of type int"):
        cache.subscribe(3)


def test_events_past_the_queue_bound_are_dropped_counted_and_logged(caplog):
    stats = Counters(("events_dropped",))
    hub = EventHub(stats, max_queued=4)
    started, go, got = threading.Event(), threading.Event(), []

    def slow(events):
        started.set()
        go.wait(30)
        got.extend(e.key for e in events)

    sub = hub.subscribe(slow)
    hub.emit("stored", 0, "host")  # taken by the delivery thread, which then blocks
    assert started.wait(10)
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        for key in range(1, 11):
            hub.emit("stored", key, "host")
    assert stats.snapshot()["events_dropped"] == 6
    assert caplog.text.count("cache events are not delivered fast enough") == 1
    go.set()
    assert sub.wait(10)
    assert got == [0, 7, 8, 9, 10]  # the oldest of the waiting ones went
    hub.close()


@pytest.mark.parametrize("escape", [SystemExit, KeyboardInterrupt])
def test_a_callback_raising_systemexit_or_keyboardinterrupt_stops_no_delivery(rig, caplog,
                                                                               escape):
    # One delivery thread serves every subscriber: a callback's exit must not end it.
    caches, mgr, disk, cache = rig

    def leaving(events):
        raise escape("the router is shutting down")

    rec = Recorder()
    with caplog.at_level(logging.ERROR, logger="kvxfer"):
        bad, good = cache.subscribe(leaving), cache.subscribe(rec)
        cache.put(caches, [0], [10], wait=True)
        assert good.wait(5) and bad.wait(5)
        cache.put(caches, [1], [11], wait=True)  # a later batch still arrives
        assert good.wait(5)
    assert rec.events == [("stored", 10, "host"), ("stored", 11, "host")]
    assert "raised; its batch of 1 events is dropped" in caplog.text
    assert escape.__name__ in caplog.text


def _event_threads():
    return sum(t.name == "kvxfer-cache-events" for t in threading.enumerate())


def test_close_from_a_callback_closes_the_cache_and_ends_the_delivery_thread(rig):
    caches, mgr, disk, cache = rig
    before, box = _event_threads(), {}

    def closer(events):
        if "closed" not in box:
            try:
                box["closed"] = cache.close(timeout=5)
            except BaseException as e:  # 'cannot join current thread' before the fix
                box["closed"] = e

    rec = Recorder()
    cache.subscribe(closer), cache.subscribe(rec)
    assert _event_threads() == before + 1
    cache.put(caches, [0, 1], [10, 11], wait=True)
    for _ in range(500):  # the callback closes the cache; then its thread ends
        if "closed" in box and _event_threads() == before:
            break
        threading.Event().wait(0.01)
    assert box["closed"] is None and _event_threads() == before
    assert ("stored", 10, "host") in rec.events  # the batch it closed in still arrived
    with pytest.raises(RuntimeError, match="the HostCache is closed"):
        cache.lookup([10])
    cache.close()  # closed already: returns at once
