"""Prefetching: store pages promoted into host memory ahead of the lookup that wants them.

``Prefetcher`` runs each ``HostCache.prefetch(keys)`` on one background thread: it
finds the prefix of ``keys`` as a lookup would (host pages first, the store pages past
them read in one batch with no cache lock held, then imported page by page), but pins
nothing once it is done and marks no host page used. A later lookup of those keys finds
them in host memory.

A lookup that needs a page a prefetch is still promoting waits for that prefetch (with
no lock held) rather than reading the page itself, so a page is read and imported once
and takes one host slot. A prefetch that fails costs its pages only: store errors and
bad blobs are counted and logged as a lookup's are, and anything else is counted
(``prefetch_errors``), logged and left in its future; a lookup never raises for it.

Each prefetch has a deadline from its call: its store read gets what is left, pages
not read by then are misses (logged), and one still queued at its deadline finds only
host pages, so its future is done by then (or by the deadline of the one running
before it, whichever is later). A lookup waits for a prefetch until the lookup's own
deadline. ``close()`` cancels the queued ones; a cancelled prefetch is done for every
waiter at once (``concurrent.futures.wait`` included). The running one gets until
close's deadline; if it is still reading then (a store that hangs, a prefetch without
a timeout), its future fails with a ``RuntimeError`` at once, and it imports nothing.
So every prefetch future is done when ``close()`` returns.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from typing import NamedTuple

from kvxfer._counters import Counters
from kvxfer.cache._deadline import Deadline, wait_done
from kvxfer.cache._host import HostTier
from kvxfer.cache._lookup import Finder
from kvxfer.cache._store_tier import unlocked

__all__ = ["Prefetcher", "COUNTERS"]

log = logging.getLogger("kvxfer")

#: The counters prefetching adds to the cache's ``stats()``.
COUNTERS = ("prefetches", "pages_prefetched", "prefetch_errors")

_IDLE_S = 5.0  # the worker leaves after this long without a prefetch (a new one starts it)


class _Job(NamedTuple):
    """One prefetch: its future, its keys, its deadline."""

    future: concurrent.futures.Future
    keys: list[int]
    deadline: Deadline


class Prefetcher:
    """A cache's prefetches: one worker thread, and which keys each one is promoting.

    Args:
      lock: the cache's lock (held to find and import pages, let go of around reads).
      finder: the cache's ``Finder``, which finds and promotes a prefix.
      host: the host tier (a prefetch's pins are dropped there once it is done).
      stats: the cache's counters.
    """

    def __init__(self, lock: threading.RLock, finder: Finder, host: HostTier,
                 stats: Counters):
        self._lock = lock
        self._finder = finder
        self._host = host
        self._stats = stats
        stats.add(**dict.fromkeys(COUNTERS, 0))
        # The queue and the worker's life; never held while a prefetch runs.
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[_Job] = collections.deque()
        self._thread: threading.Thread | None = None
        self._inflight: dict[int, concurrent.futures.Future] = {}  # key -> its prefetch
        self._closed = False

    def start(self, keys: list[int], deadline: Deadline) -> concurrent.futures.Future:
        """Queues a prefetch of ``keys``' prefix (the caller holds the cache lock)."""
        self._prune()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the HostCache is closed; create a new one")
            self._queue.append(_Job(future, keys, deadline))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, daemon=True,
                                                name="kvxfer-prefetch")
                self._thread.start()
            self._cond.notify()
        for key in keys:
            self._inflight[key] = future
        self._stats.add(prefetches=1)
        return future

    def _work(self) -> None:
        """The worker thread: the queued prefetches, one at a time, in order; it leaves
        once closed, or idle (so a cache dropped unclosed keeps no thread)."""
        while True:
            with self._cond:
                if not self._queue and not self._closed:
                    self._cond.wait(_IDLE_S)
                if not self._queue:
                    self._thread = None
                    return
                job = self._queue.popleft()
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled by its caller
            try:
                found = self._run(job.keys, job.deadline)
            except BaseException as e:  # in its future; the next prefetch still runs
                _settle(job.future, error=e)
            else:
                _settle(job.future, result=found)

    def wait_for(self, keys: list[int], deadline: Deadline) -> None:
        """Waits (the cache lock let go of) until ``deadline`` for the prefetches
        promoting pages a lookup of ``keys`` needs: those past the pages already in
        host memory."""
        self._prune()
        if not self._inflight:
            return
        n = 0
        while n < len(keys) and (self._host.peek(keys[n]) is not None or
                                 self._host.arriving(keys[n])):
            n += 1
        waits = {self._inflight[k] for k in keys[n:] if k in self._inflight}
        if waits:
            with unlocked(self._lock):
                _, late = wait_done(waits, deadline)
            if late:
                log.warning("a lookup of %d pages gave up waiting for a prefetch of them "
                            "after %s", len(keys), deadline)

    def _prune(self) -> None:
        for key in [k for k, f in self._inflight.items() if f.done()]:
            del self._inflight[key]

    def _run(self, keys: list[int], deadline: Deadline) -> int:
        """One prefetch (worker thread): how long a prefix of ``keys`` it left in host
        memory, the pages it promoted and those already there."""
        with self._lock:
            if self._closed:
                return 0
            try:
                found = self._finder.pin_prefix(keys, deadline, use=False)
            except Exception as e:
                log.warning("prefetch of %d pages failed: %s", len(keys), e)
                self._stats.add(prefetch_errors=1)
                raise
            self._host.unpin([f.key for f in found])
            self._stats.add(pages_prefetched=sum(f.tier == "store" for f in found))
            return len(found)

    def close(self, deadline: Deadline) -> None:
        """Cancels the prefetches not started and gives the running one until
        ``deadline``. Call it without the cache lock, once the store tier has stopped
        promoting (a prefetch still reading then imports nothing)."""
        with self._cond:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in queued:  # off the queue: the worker never sees them
            job.future.cancel()
            job.future.set_running_or_notify_cancel()  # done for every kind of waiter
        running = [f for f in list(self._inflight.values()) if not f.done()]
        _, late = wait_done(running, deadline)
        if late:
            log.warning("a prefetch was still reading from the store %s after close(); "
                        "it will import nothing", deadline)
        for future in late:  # settled now: no caller waits on a store that hangs
            _settle(future, error=RuntimeError(
                f"the HostCache was closed while this prefetch was still reading from "
                f"the store ({deadline} after close()); it imports nothing"))


def _settle(future: concurrent.futures.Future, *, result: int | None = None,
            error: BaseException | None = None) -> None:
    """Sets a running prefetch's outcome unless it has one (``close`` settles a late
    prefetch, and the worker may finish it at the same moment)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass
