"""How a cache's work ends: ``flush`` (every host page the store lacks written, and
waited for) and ``close`` (the host pages the store lacks written back, what is left
given one deadline, the threads stopped).

Both wait on futures others may cancel (``close`` cancels queued writes and
prefetches): they wait with ``wait_done``, which counts a cancel as done, and say what
they gave up on.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvxfer.cache._blocks import describe_pages
from kvxfer._counters import Counters
from kvxfer.cache._deadline import CLOSE_TIMEOUT_S, FLUSH_TIMEOUT_S, Deadline, wait_done
from kvxfer.manager import Agreement

if TYPE_CHECKING:
    from kvxfer.cache._events import EventHub
    from kvxfer.cache._host import HostTier
    from kvxfer.cache._prefetch import Prefetcher
    from kvxfer.cache._store_tier import StoreTier

__all__ = ["Ending"]

log = logging.getLogger("kvxfer")


class Ending:
    """``HostCache.flush`` and ``HostCache.close``."""

    # What the cache itself provides (``HostCache.__init__`` and its methods).
    _stats: Counters
    _lock: threading.RLock
    _closing: threading.Lock
    _closed: bool
    _host: HostTier
    _store: StoreTier | None
    _prefetch: Prefetcher
    _events: EventHub
    _agreement: Agreement
    _check_open: Callable[[], None]
    _collect: Callable[[], None]
    _write_back_on_close: bool

    def flush(self, *, timeout: float | None = FLUSH_TIMEOUT_S) -> int:
        """Writes every host page the store lacks, and waits for all store writes.

        Under selective write-through (``write_through=N``) only pages found N times
        or more are written. A write the store refuses is counted
        (``store_write_errors``) and logged, not raised.

        Args:
          timeout: seconds to wait in all (None: as long as it takes).

        Returns:
          The pages this call wrote (spills already in flight are waited for, not
          counted).

        Raises:
          TimeoutError: writes were not done within ``timeout`` (named; they go on).
          RuntimeError: ``close()`` dropped queued writes meanwhile (named).
        """
        deadline = Deadline(timeout)
        if self._store is None:
            return 0
        with self._lock:
            self._check_open()
            self._host.wait_all(deadline)
            self._collect()
            mine, unstarted = self._write_missing(self._store, deadline)
            queued = self._store.pending()
        _, late = wait_done(queued.values(), deadline)
        if late or unstarted:
            keys = [k for k, f in queued.items() if f in late] + unstarted
            raise TimeoutError(f"flush() gave up after {deadline}: the store writes "
                               f"of {describe_pages(keys)} were not done; they go "
                               "on in the background")
        dropped = [k for k, f in queued.items() if f.cancelled()]
        if dropped:
            raise RuntimeError(f"the HostCache was closed while flush() waited: the "
                               f"queued store writes of {describe_pages(dropped)} "
                               "were dropped")
        return sum(1 for f in mine if f.exception() is None and f.result())

    def _write_missing(self, store: StoreTier, deadline: Deadline, call: str = "flush()"
                       ) -> tuple[list[concurrent.futures.Future], list[int]]:
        """Starts writes of every valid host page the store lacks (that selective
        write-through lets through), asked in one ``contains_many``; the writes started,
        and the pages not started because ``deadline`` passed (each write exports its
        page on this thread first).

        Raises:
          TimeoutError: the store did not say which pages it holds by ``deadline``.
        """
        host = self._host
        ask = [k for k in host.keys() if not store.writing(k) and store.wants(host.hits(k))]
        batch = store.has_many(ask, deadline)
        if ask and all(isinstance(batch.errors.get(k), TimeoutError) for k in ask):
            raise TimeoutError(f"{call} gave up after {deadline}: the {store.name} store "
                               f"did not say which of {len(ask)} host pages it holds")
        mine: list[concurrent.futures.Future] = []
        for j, key in enumerate(ask):
            if deadline.expired:
                return mine, [k for k in ask[j:] if not batch.got.get(k)]
            ref = host.page_of(key)
            if ref is not None and not store.writing(key) and \
                    not store.holds(key, batch) and host.mgr.is_valid(ref):
                future = store.write(key, ref)
                if future is not None:
                    mine.append(future)
        return mine, []

    def close(self, timeout: float | None = CLOSE_TIMEOUT_S, *,
              write_back: bool | None = None) -> None:
        """Indexes offloads in flight, writes back the host pages the store lacks,
        cancels prefetches not started, and gives the running one, the store writes,
        then the events not delivered yet, ``timeout`` seconds in all (one deadline,
        not one per write).

        Write-back: with a store, every valid host page the store does not hold yet
        (under selective write-through, those found often enough) is written to it,
        as ``flush()`` would, so that a cache opened later over the same store (this
        process or another, after a restart) finds them. Writes not done by the
        deadline are dropped, logged and counted (``stats()["store_writes_dropped"]``);
        a store that does not say in time which pages it holds gets none (logged,
        counted the same way). Then a late prefetch imports nothing, calls waiting
        on what was cancelled end (``flush`` raises), and no page stays pinned (a hit
        not loaded or released by then pins nothing). The manager and the store stay
        open. In a multi-process job it then waits (up to the manager's
        ``agreement_timeout``) for every rank to close its cache.

        Callable from any thread, an event callback included (the events queued after
        the callback's batch are then delivered once it returns). A second call, or one
        while another thread closes, returns at once. Nothing a policy or a transfer
        raises stops it: the cache's threads always stop.

        Args:
          timeout: seconds for all of it (None: as long as it takes).
          write_back: whether to write back the host pages the store lacks (None:
            as ``HostCache(write_back_on_close=)`` says, True by default). False
            drops them, as a cache whose host memory is all it should keep would.
        """
        deadline = Deadline(timeout)  # a bad timeout is refused before anything ends
        if write_back is not None and not isinstance(write_back, bool):
            raise TypeError(f"write_back must be a bool or None. Got {write_back!r} of "
                            f"type {type(write_back).__name__}")
        if not self._closing.acquire(blocking=False):
            return  # closed, or closing on another thread
        if write_back is None:
            write_back = self._write_back_on_close
        # Each step runs whatever the one before it raised: a second close() returns at
        # once, so this one must stop every thread.
        writes: list[concurrent.futures.Future] = []
        try:
            try:
                writes = self._stop(deadline, write_back)
            finally:
                try:
                    self._prefetch.close(deadline)
                finally:
                    if self._store is not None:
                        self._store.close(writes, deadline.timeout, deadline.at)
        finally:
            self._closed = True
            self._host.drop_pins()  # no eviction any more: no hit pins a page for good
            try:
                self._events.close(deadline.left)  # events of the last writes included
            finally:
                self._agreement.meet("close")

    def _stop(self, deadline: Deadline, write_back: bool) -> list[concurrent.futures.Future]:
        """Marks the cache closed once offloads in flight are indexed (write-through
        pages of those offloads start writes) and, with ``write_back``, the writes of
        the host pages the store lacks are started; the store writes queued."""
        locked = self._lock.acquire(timeout=-1 if deadline.at is None else deadline.left)
        try:
            if locked:
                try:
                    self._host.wait_all(deadline)
                    self._collect()
                except Exception:  # a policy, a load's settling: closing goes on
                    log.exception("close(): indexing the last offloads failed")
                if write_back and self._store is not None:
                    self._write_back(self._store, deadline)
            else:
                log.warning("close() did not get the cache's lock within %s (a call "
                            "holds it); closing without it", deadline)
                if write_back and self._store is not None and len(self._host):
                    log.warning("close() wrote none of the %d host pages back to the "
                                "%s store", len(self._host), self._store.name)
                    self._stats.add(store_writes_dropped=len(self._host))
            self._closed = True
            return [] if self._store is None else self._store.stop_writes()
        finally:
            if locked:
                self._lock.release()

    def _write_back(self, store: StoreTier, deadline: Deadline) -> None:
        """Starts the writes of the host pages the store lacks (close's write-back); a
        store that cannot say which those are by ``deadline`` gets none (logged and
        counted)."""
        try:
            _, unstarted = self._write_missing(store, deadline, "close()")
            if unstarted:
                log.warning("close() gave up after %s: %s not written back to the %s "
                            "store", deadline, describe_pages(unstarted), store.name)
                self._stats.add(store_writes_dropped=len(unstarted))
        except Exception as e:  # a stalled store, a policy: closing goes on
            left = [k for k in self._host.keys()
                    if not store.writing(k) and store.wants(self._host.hits(k))]
            log.warning("close() wrote none of %d host pages back to the %s store: %s: %s",
                        len(left), store.name, type(e).__name__, e)
            self._stats.add(store_writes_dropped=len(left))
