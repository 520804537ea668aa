"""Prefetched loads: host pages staged on the devices before the load that consumes them.

An engine that splits a load in two (sglang-jax's ``stage_load`` on any thread, then
``flush_load`` on the thread that owns the KV caches) calls ``mgr.prefetch(pages)``
first: the pages are pinned and the movers put what a load of them needs on the
devices (pages copied out of the pool, host to device transfers started), without
touching the caches. ``mgr.load(..., prefetched=handle)`` then only enqueues the
scatter into the caches and the digests.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable
from typing import Any

from kvxfer.hostpool import PageRef

__all__ = ["PrefetchHandle"]


class PrefetchHandle:
    """Host pages staged on the devices for one later load.

    The pages stay pinned (never evicted, freed or overwritten) until the load that
    consumes the handle finishes, or until ``release()``; a handle dropped unused is
    released by the manager's next call. A handle is used by at most one load.

    Attributes:
      pages: the page refs staged, in request order.
      problems: request index -> why that page cannot be loaded (stale, freed, ...);
        staging stops before the first one.
    """

    def __init__(self, owner: object, pages: list[PageRef], problems: dict[int, str],
                 pinned_slots: list[int], staged: dict[int, Any], n: int,
                 unpin: Callable[[list[int]], None],
                 dropped: collections.deque[tuple[list[int], dict]] | None = None,
                 discard: Callable[[dict[int, Any]], None] | None = None):
        self.pages = pages
        self.problems = problems
        self._owner = owner
        self._pinned = pinned_slots
        self._staged = staged
        self._n = n
        self._unpin = unpin
        self._lock = threading.Lock()
        self._state = "staged"  # staged | consumed | released
        # A handle dropped unused files its pins for the manager's next call to give
        # back (a finalizer takes no lock: it may run inside any of them).
        self._discard = discard
        self._finalizer = weakref.finalize(self, dropped.append, (pinned_slots, staged)) \
            if dropped is not None else None

    @property
    def num_staged(self) -> int:
        """Pages staged (the request's prefix before its first problem)."""
        return self._n

    def release(self) -> bool:
        """Unpins the pages of a handle no load will consume (an aborted request).

        Returns:
          Whether it released anything (False once a load consumed the handle or
          after an earlier ``release``).
        """
        with self._lock:
            if self._state != "staged":
                return False
            self._state = "released"
            if self._finalizer is not None:
                self._finalizer.detach()
            pinned, staged = self._pinned, self._staged
            self._pinned, self._staged = [], {}
        if self._discard is not None:
            self._discard(staged, pinned)  # the pins go once the staging's copies end
        else:
            self._unpin(pinned)
        return True

    def take(self, owner: object, pages: list[PageRef]) -> tuple[dict[int, Any], int]:
        """Hands the pins (the load releases them) and the staged inputs to the load.

        Returns:
          ``(staged inputs by class, pages staged)``.

        Raises:
          ValueError: the handle is another manager's, was consumed or released
            already, or staged other pages than the load's.
        """
        with self._lock:
            if owner is not self._owner:
                raise ValueError("prefetched= is a handle of another KVCacheManager")
            if self._state != "staged":
                raise ValueError(f"prefetched= handle was {self._state} already; a "
                                 "handle serves one load")
            if pages != self.pages:
                raise ValueError(f"prefetched= staged {len(self.pages)} pages "
                                 f"{[str(p) for p in self.pages[:4]]}..., the load asks "
                                 f"for {len(pages)} pages {[str(p) for p in pages[:4]]}...; "
                                 "pass the pages the handle was made for, in that order")
            self._state = "consumed"
            if self._finalizer is not None:
                self._finalizer.detach()
            return self._staged, self._n

    def __repr__(self) -> str:
        return (f"PrefetchHandle({len(self.pages)} pages, {self._n} staged, "
                f"{self._state})")
