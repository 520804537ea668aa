"""Every blocking call of the host tier ends by its deadline, and says what it gave up
on: closes with prefetches or writes still queued, lookups behind a write-behind queue,
and calls against a real redis-server that stops answering (CLIENT PAUSE, SIGSTOP)."""

import concurrent.futures
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import uuid

import numpy as np
import pytest

import kvxfer
from kvxfer import store, testing

KEYS = [500 + i for i in range(16)]


def _caches():
    return testing.random_caches(2, 24, (4, 32), "float32", seed=5)


def _elapsed(call):
    t0 = time.monotonic()
    out = call()
    return out, time.monotonic() - t0


@contextlib.contextmanager
def _paused(url, what):
    """redis-server stops answering until the block ends: ``"WRITE"`` pauses its
    clients' writes (CLIENT PAUSE), ``"ALL"`` stops the process itself (SIGSTOP)."""
    import redis
    with redis.Redis.from_url(url) as admin:
        if what == "ALL":
            pid = admin.info("server")["process_id"]
            os.kill(pid, signal.SIGSTOP)
        else:
            admin.execute_command("CLIENT", "PAUSE", 30000, what)
        try:
            yield
        finally:
            if what == "ALL":
                os.kill(pid, signal.SIGCONT)
            else:
                admin.execute_command("CLIENT", "UNPAUSE")


def _redis(url, **options):
    return store.RedisStore(url, prefix=f"deadline-{uuid.uuid4().hex[:8]}:", **options)


def _ends(thread, box, within=10.0):
    thread.join(within)
    assert not thread.is_alive(), "the call never ended"
    return box


# -- close with prefetches queued (a plain cancelled future is never "done" to wait) ----


class _Slow(testing.CountingStore):
    """A real store whose batched reads take ``delay`` seconds (a slow network)."""

    def __init__(self, inner, delay):
        super().__init__(inner)
        self.delay, self.started = delay, threading.Event()

    def get_many(self, keys):
        self.started.set()
        time.sleep(self.delay)
        return super().get_many(keys)


@pytest.mark.parametrize("timeout", [3.0, None])
def test_close_with_a_prefetch_queued_ends_with_the_running_one(tmp_path, timeout):
    disk = store.DiskStore(tmp_path / "pages")
    caches = _caches()
    with kvxfer.KVCacheManager(caches, num_host_blocks=16) as mgr:
        first = kvxfer.HostCache(mgr, disk, write_through=True, namespace="test-model")
        first.put(caches, list(range(16)), KEYS, wait=True)
        first.close()
    with kvxfer.KVCacheManager(caches, num_host_blocks=16) as mgr:
        slow = _Slow(disk, delay=0.3)
        cache = kvxfer.HostCache(mgr, slow, namespace="test-model")
        running = cache.prefetch(KEYS[:8])
        queued = cache.prefetch(KEYS[8:])
        assert slow.started.wait(10)
        box = {}

        def look():
            try:
                box["hit"] = cache.lookup(KEYS[8:], timeout=None)  # waits on `queued`
            except RuntimeError as e:
                box["error"] = e

        looking = threading.Thread(target=look)
        looking.start()
        time.sleep(0.2)  # the lookup waits for `queued`
        closing = threading.Thread(target=lambda: cache.close(timeout))
        _, took = _elapsed(lambda: (closing.start(), closing.join(10)))
        assert not closing.is_alive() and took < 2.0, took  # not 3 s, not forever
        assert queued.cancelled() and running.done()
        done, _ = concurrent.futures.wait([queued], timeout=5)  # the stdlib's wait too
        assert queued in done
        assert "the HostCache is closed" in str(_ends(looking, box)["error"])
    disk.close()


# -- close with store writes queued -----------------------------------------------------


def test_flush_names_the_writes_it_gave_up_on_and_close_ends_a_waiting_flush(redis_server):
    caches = _caches()
    slow = _redis(redis_server, timeout_s=5)
    with kvxfer.KVCacheManager(caches, num_host_blocks=8) as mgr:
        cache = kvxfer.HostCache(mgr, slow, write_through=True, namespace="test-model")
        box = {}
        with _paused(redis_server, "WRITE"):
            cache.put(caches, [0, 1, 2, 3], KEYS[:4], wait=True)  # one SET held, 3 queued
            with pytest.raises(TimeoutError, match=r"flush\(\) gave up after 0.3 s: the "
                                                   r"store writes of 4 pages \(keys 0x1f4, "
                                                   r"0x1f5, 0x1f6, 0x1f7\) were not done"):
                cache.flush(timeout=0.3)

            def flush():
                try:
                    box["wrote"] = cache.flush(timeout=None)
                except RuntimeError as e:
                    box["error"] = e

            flushing = threading.Thread(target=flush)
            flushing.start()
            time.sleep(0.5)  # the flush waits for the writes
            _, took = _elapsed(lambda: cache.close(timeout=0.3))
            assert took < 2.0, took
        error = _ends(flushing, box)["error"]  # the held SET ends once the pause does
        assert "closed while flush() waited: the queued store writes of 3 pages" in \
            str(error)
    slow.clear()
    slow.close()


# -- a lookup behind the write-behind queue ---------------------------------------------


def test_a_page_whose_write_is_queued_is_read_from_the_queue_not_waited_for(redis_server):
    # 16 evicted pages queue their writes behind a SET the paused server holds (each
    # would fail after timeout_s=1): the lookup of the last one does not wait for them.
    caches = _caches()
    counted = testing.CountingStore(_redis(redis_server, timeout_s=1))
    with kvxfer.KVCacheManager(caches, num_host_blocks=4) as mgr:
        cache = kvxfer.HostCache(mgr, counted, namespace="test-model")
        with _paused(redis_server, "WRITE"):
            for j in range(0, 20, 4):  # each put evicts the four before it
                cache.put(caches, list(range(j, j + 4)), [600 + j + i for i in range(4)],
                          wait=True)
            wanted = [612, 613, 614, 615]
            hit, took = _elapsed(lambda: cache.lookup(wanted))
            assert took < 1.0, took
            assert hit.tiers == ("store",) * 4 and counted.calls["get_many"] == 0
            caches, load = cache.load(caches, hit, [20, 21, 22, 23])
            assert load.result(10).verified_prefix == 4
            got = testing.bits(caches[1])
            assert (got[20:24] == got[12:16]).all()  # the bytes of the pages queued
            cache.close(timeout=0.5)
    counted.inner.clear()
    counted.inner.close()


# -- a store that stops answering -------------------------------------------------------


def test_each_call_ends_by_its_deadline_while_the_store_is_paused(redis_server, caplog):
    caches = _caches()
    paused = _redis(redis_server, timeout_s=5)
    with kvxfer.KVCacheManager(caches, num_host_blocks=4) as mgr:
        cache = kvxfer.HostCache(mgr, paused, namespace="test-model")
        cache.put(caches, [0, 1], KEYS[:2], wait=True)
        cache.flush()
        cache.put(caches, [2, 3, 4, 5], KEYS[2:6], wait=True)  # 500, 501: store only
        with _paused(redis_server, "ALL"), caplog.at_level(logging.WARNING, "kvxfer"):
            hit, took = _elapsed(lambda: cache.lookup(KEYS[:2], timeout=0.3))
            assert hit.num_pages == 0 and took < 1.5, took
            assert f"could not be read for page {KEYS[0]:#x}: no answer within the " \
                   "call's deadline (0.3 s)" in caplog.text
            future, took = _elapsed(lambda: cache.prefetch(KEYS[:2], timeout=0.3))
            assert future.result(5) == 0
            where, took = _elapsed(lambda: cache.find(KEYS[0], timeout=0.3))
            assert where is None and took < 1.5, took
            with pytest.raises(TimeoutError, match=r"flush\(\) gave up after 0.3 s: the "
                                                   r"redis store did not say which of"):
                cache.flush(timeout=0.3)
            _, took = _elapsed(lambda: cache.close(timeout=0.5))
            assert took < 2.0, took
        assert cache.stats()["store_read_errors"] >= 3
    paused.clear()
    paused.close()


def test_deadlines_are_checked_and_named():
    caches = _caches()
    with kvxfer.KVCacheManager(caches, num_host_blocks=4) as mgr:
        cache = kvxfer.HostCache(mgr)
        for call in (lambda: cache.lookup([1], timeout=-1),
                     lambda: cache.prefetch([1], timeout=float("nan")),
                     lambda: cache.flush(timeout=-0.5),
                     lambda: cache.find(1, timeout=float("inf"))):
            with pytest.raises(ValueError, match=r"timeout=.* must be None or a finite "
                                                 r"number of seconds >= 0"):
                call()
        with pytest.raises(TypeError, match=r"timeout='1' must be None or a number"):
            cache.close(timeout="1")
        assert cache.lookup([1], timeout=None).num_pages == 0
        cache.close()


HUGE = [1e20, 1e300, sys.float_info.max, 2**63, 10**400, np.float64(1e300)]


@pytest.mark.parametrize("timeout", HUGE, ids=str)
def test_a_huge_finite_deadline_is_as_good_as_none(tmp_path, timeout):
    # Finite, so accepted; past what a wait can take, so it is clamped rather than
    # raising OverflowError out of a lock or condition half way through a call.
    caches = _caches()
    disk = store.DiskStore(tmp_path / "pages")
    before = {t for t in threading.enumerate() if t.name.startswith("kvxfer-")}
    with kvxfer.KVCacheManager(caches, num_host_blocks=4) as mgr:
        cache = kvxfer.HostCache(mgr, disk, namespace="test-model")
        assert cache.put(caches, [0, 1], KEYS[:2], wait=True, timeout=timeout) == KEYS[:2]
        hit = cache.lookup(KEYS[:3], timeout=timeout)
        assert hit.num_pages == 2
        caches, load = cache.load(caches, hit, [2, 3])
        assert load.layer_ready(1, timeout) == 2 and load.result(timeout).verified_prefix == 2
        assert cache.find(KEYS[0], timeout=timeout) == "host"
        assert cache.prefetch(KEYS[:2], timeout=timeout).result(10) == 2
        assert cache.flush(timeout=timeout) == 2
        assert cache.subscribe(lambda events: None).wait(timeout)
        page, = mgr.offload(caches, [4], keys=[9]).wait(timeout)
        mgr.free([page])
        cache.close(timeout=timeout)  # every thread stops: no second chance
        with pytest.raises(RuntimeError, match="the HostCache is closed"):
            cache.lookup(KEYS[:1])
    for _ in range(500):
        if not {t for t in threading.enumerate() if t.name.startswith("kvxfer-") and
                not t.name.startswith("kvxfer-transfer")} - before:
            break
        time.sleep(0.01)
    assert not {t.name for t in threading.enumerate() if t.name.startswith("kvxfer-") and
                not t.name.startswith("kvxfer-transfer")} - {t.name for t in before}
    disk.close()


def test_close_leaves_no_page_pinned_and_every_prefetch_settled(tmp_path):
    # Lookups and prefetches on other threads while close() runs: a lookup whose
    # store read close() cut short raised closed, but a lookup past its check returned
    # a hit of its host pages after close, which then could never be loaded (4 pages
    # pinned); a hit never released or loaded pinned its pages for good too.
    disk = store.DiskStore(tmp_path / "pages")
    caches = _caches()
    with kvxfer.KVCacheManager(caches, num_host_blocks=16) as mgr:
        first = kvxfer.HostCache(mgr, disk, write_through=True, namespace="test-model")
        first.put(caches, list(range(8)), KEYS[:8], wait=True)
        first.close()
    with kvxfer.KVCacheManager(caches, num_host_blocks=16) as mgr:
        slow = _Slow(disk, delay=0.5)
        cache = kvxfer.HostCache(mgr, slow, namespace="test-model")
        cache.put(caches, list(range(8, 12)), KEYS[8:12], wait=True)
        kept = cache.lookup(KEYS[8:10])  # never loaded nor released
        box = {}

        def look():  # host pages pinned, then the store read that close() outlasts
            try:
                box["hit"] = cache.lookup(KEYS[8:12] + KEYS[:4], timeout=None)
            except RuntimeError as e:
                box["error"] = e

        looking = threading.Thread(target=look)
        looking.start()
        assert slow.started.wait(10)  # the lookup reads the store, its lock let go of
        futures = [cache.prefetch(KEYS[4:8]), cache.prefetch(KEYS[6:8], timeout=0)]
        cache.close(timeout=5)
        assert "the HostCache is closed" in str(_ends(looking, box).get("error"))
        done, late = concurrent.futures.wait(futures, timeout=10)
        assert not late
        assert cache.stats()["pinned_pages"] == 0
        cache.release(kept)  # after close: a no-op, nothing goes below zero
        assert cache.stats()["pinned_pages"] == 0
    disk.close()


class _Hung(testing.CountingStore):
    """A real store whose batched reads hang until ``release`` is set."""

    def __init__(self, inner):
        super().__init__(inner)
        self.started, self.release = threading.Event(), threading.Event()

    def get_many(self, keys):
        self.started.set()
        self.release.wait(30)
        return super().get_many(keys)


def test_close_settles_a_prefetch_whose_store_read_hangs(tmp_path):
    # A prefetch without a timeout, reading from a store that does not answer: its
    # future stayed pending after close() returned, as long as the store hung.
    disk = store.DiskStore(tmp_path / "pages")
    caches = _caches()
    with kvxfer.KVCacheManager(caches, num_host_blocks=8) as mgr:
        first = kvxfer.HostCache(mgr, disk, write_through=True, namespace="test-model")
        first.put(caches, [0, 1], KEYS[:2], wait=True)
        first.close()
    with kvxfer.KVCacheManager(caches, num_host_blocks=8) as mgr:
        hung = _Hung(disk)
        cache = kvxfer.HostCache(mgr, hung, namespace="test-model")
        running = cache.prefetch(KEYS[:2], timeout=None)
        assert hung.started.wait(10)
        _, took = _elapsed(lambda: cache.close(timeout=0.3))
        assert took < 5 and running.done()
        with pytest.raises(RuntimeError, match="closed while this prefetch was still "
                                               "reading from the store"):
            running.result(0)
        hung.release.set()  # the read ends: the worker finds its future settled
        for _ in range(500):
            if not any(t.name == "kvxfer-prefetch" for t in threading.enumerate()):
                break
            time.sleep(0.01)
        assert cache.stats()["pinned_pages"] == 0 and mgr.num_free_pages == 8
    disk.close()
