"""Cache events for routers: where pages arrive and leave, delivered in batches.

A cache-aware router sends a request where its prefix is. ``HostCache.subscribe``
hands a callback every change of where this cache's pages are, as ``CacheEvent``s:

* ``stored``: the page is now in the tier (``host``: offloaded or promoted from the
  store; ``store``: this cache wrote it there);
* ``evicted``: the host tier evicted it to make room (its store copy, if any, stays);
* ``removed``: it left the tier for another reason: proven bad, freed behind the
  cache's back, or deleted from the store as bad.

Events are queued where they happen (under the cache's lock, or on its store writer
thread) and delivered on one thread of their own (``kvxfer-cache-events``), in
order, in batches of whatever is queued, never under a lock of the cache: a callback
may call the cache, ``close()`` included. A callback's exception (``SystemExit`` and
``KeyboardInterrupt`` too) is logged on ``logging.getLogger("kvxfer")`` and dropped:
the other subscribers, and later batches, are still delivered. A store's own
evictions (past its capacity) are not seen by the cache and not reported. At most
``max_queued`` events wait for delivery; past that the oldest are dropped and counted
(``stats()["events_dropped"]``): a router that misses events should rebuild its view.

Example:
    >>> hub = EventHub()
    >>> got = []
    >>> sub = hub.subscribe(got.extend)
    >>> hub.emit("stored", 11, "host"); hub.emit("evicted", 11, "host")
    >>> sub.wait(5.0), [(e.kind, e.key, e.tier) for e in got]
    (True, [('stored', 11, 'host'), ('evicted', 11, 'host')])
    >>> sub.unsubscribe(); hub.close()
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal

from kvxfer._check import check_timeout
from kvxfer._counters import Counters

__all__ = ["CacheEvent", "EventKind", "Tier", "Subscription", "EventHub"]

log = logging.getLogger("kvxfer")

#: What happened to a page in a tier.
EventKind = Literal["stored", "evicted", "removed"]
#: The tiers a page is in.
Tier = Literal["host", "store"]

_MAX_QUEUED = 1 << 16


@dataclasses.dataclass(frozen=True, slots=True)
class CacheEvent:
    """One change of where a page is.

    Attributes:
      kind: ``"stored"``, ``"evicted"`` or ``"removed"``.
      key: the page's key (an int in [0, 2**64)).
      tier: ``"host"`` or ``"store"``.
    """

    kind: EventKind
    key: int
    tier: Tier


class Subscription:
    """A callback's subscription to a cache's events (from ``HostCache.subscribe``).

    ``unsubscribe()`` (or leaving a ``with`` block) stops deliveries to it; a batch
    being delivered when it is called may still arrive.
    """

    def __init__(self, hub: EventHub, callback: Callable[[list[CacheEvent]], object],
                 start: int):
        self.callback = callback
        self._hub = hub
        self._start = start  # the events emitted before it subscribed: not its own
        self.active = True

    def unsubscribe(self) -> None:
        self._hub.drop(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until every event emitted before this call reached the callback (or
        the subscription ended); whether that happened within ``timeout`` seconds."""
        return self._hub.wait_delivered(self, check_timeout(timeout))

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unsubscribe()


class EventHub:
    """Queues a cache's events and delivers them to its subscribers on one thread.

    Args:
      stats: the counters ``events_dropped`` goes to (None: counted nowhere).
      max_queued: the most events waiting for delivery.
    """

    def __init__(self, stats: Counters | None = None, max_queued: int = _MAX_QUEUED):
        self._stats = stats
        self._max = max_queued
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[CacheEvent] = collections.deque()
        self._subs: list[Subscription] = []
        self._emitted = 0  # events emitted so far (dropped ones too)
        self._delivered = 0  # events handed to every subscriber so far
        self._thread: threading.Thread | None = None
        self._closing = False
        self._dropping = False

    def emit(self, kind: EventKind, key: int, tier: Tier) -> None:
        """Queues one event (a no-op without subscribers); never blocks on delivery."""
        if not self._subs:  # read without the lock: a subscriber added now sees later ones
            return
        with self._cond:
            if not self._subs or self._closing:
                return
            if len(self._queue) >= self._max:  # (a waiter never waits for it)
                self._queue.popleft()
                if self._stats is not None:
                    self._stats.add(events_dropped=1)
                if not self._dropping:
                    log.warning("cache events are not delivered fast enough: %d queued, "
                                "dropping the oldest", self._max)
                self._dropping = True
            self._queue.append(CacheEvent(kind, key, tier))
            self._emitted += 1
            self._cond.notify_all()

    def subscribe(self, callback: Callable[[list[CacheEvent]], object]) -> Subscription:
        if not callable(callback):
            raise TypeError(f"callback must be callable (it is given a list of "
                            f"CacheEvent). Got {callback!r} of type "
                            f"{type(callback).__name__}")
        with self._cond:
            if self._closing:
                raise RuntimeError("the HostCache is closed; create a new one")
            sub = Subscription(self, callback, self._emitted)
            self._subs = [*self._subs, sub]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="kvxfer-cache-events")
                self._thread.start()
            return sub

    def drop(self, sub: Subscription) -> None:
        with self._cond:
            sub.active = False
            self._subs = [s for s in self._subs if s is not sub]
            self._cond.notify_all()

    def wait_delivered(self, sub: Subscription, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._emitted
            while sub.active and self._delivered < target:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float | None = None) -> None:
        """Delivers what is queued (within ``timeout``), then stops the thread. Called
        from a callback (the delivery thread), it waits for nothing: the thread
        delivers what is queued once the callback returns, then stops."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("cache event callbacks did not return within %g s of close(); "
                            "the events still queued are dropped", timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return  # closing, everything delivered
                batch, first = list(self._queue), self._emitted - len(self._queue)
                self._queue.clear()
                self._dropping = False
                subs = self._subs
            self._deliver(batch, first, subs)
            with self._cond:
                self._delivered = max(self._delivered, first + len(batch))
                self._cond.notify_all()

    @staticmethod
    def _deliver(batch: list[CacheEvent], first: int, subs: Sequence[Subscription]) -> None:
        for sub in subs:
            mine = batch[max(sub._start - first, 0):]
            if not sub.active or not mine:
                continue
            try:
                sub.callback(mine)
            except BaseException:  # SystemExit too: this thread serves every subscriber
                log.exception("a cache event callback (%r) raised; its batch of %d events "
                              "is dropped for it", sub.callback, len(mine))
