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
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

from kvxfer._counters import Counters
from kvxfer.cache._host import HostTier
from kvxfer.cache._lookup import Finder
from kvxfer.cache._store_tier import unlocked

__all__ = ["Prefetcher", "COUNTERS"]

log = logging.getLogger("kvxfer")

#: The counters prefetching adds to the cache's ``stats()``.
COUNTERS = ("prefetches", "pages_prefetched", "prefetch_errors")


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
        self._worker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvxfer-prefetch")
        self._inflight: dict[int, concurrent.futures.Future] = {}  # key -> its prefetch
        self._closed = False

    def start(self, keys: list[int]) -> concurrent.futures.Future:
        """Queues a prefetch of ``keys``' prefix (the caller holds the cache lock)."""
        self._prune()
        future = self._worker.submit(self._run, keys)
        for key in keys:
            self._inflight[key] = future
        self._stats.add(prefetches=1)
        return future

    def wait_for(self, keys: list[int]) -> None:
        """Waits (the cache lock let go of) for the prefetches promoting pages a lookup
        of ``keys`` needs: those past the pages already in host memory."""
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
                concurrent.futures.wait(waits)

    def _prune(self) -> None:
        for key in [k for k, f in self._inflight.items() if f.done()]:
            del self._inflight[key]

    def _run(self, keys: list[int]) -> int:
        """One prefetch (worker thread): how long a prefix of ``keys`` it left in host
        memory, the pages it promoted and those already there."""
        with self._lock:
            if self._closed:
                return 0
            try:
                found = self._finder.pin_prefix(keys, use=False)
            except Exception as e:
                log.warning("prefetch of %d pages failed: %s", len(keys), e)
                self._stats.add(prefetch_errors=1)
                raise
            self._host.unpin([f.key for f in found])
            self._stats.add(pages_prefetched=sum(f.tier == "store" for f in found))
            return len(found)

    def close(self, timeout: float | None, deadline: float | None) -> None:
        """Cancels the prefetches not started and gives the running one until
        ``deadline`` (``time.monotonic()``; None: forever). Call it without the cache
        lock, once the store tier has stopped promoting (a prefetch still reading then
        imports nothing)."""
        with self._lock:
            self._closed = True
            running = [f for f in self._inflight.values() if not f.done()]
        self._worker.shutdown(wait=False, cancel_futures=True)
        left = None if deadline is None else max(deadline - time.monotonic(), 0)
        _, late = concurrent.futures.wait(running, left)
        if late:
            log.warning("a prefetch was still reading from the store %g s after close(); "
                        "it will import nothing", timeout)
