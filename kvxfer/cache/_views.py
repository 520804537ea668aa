"""The read-only views of a ``HostCache``'s index: length, membership, keys, where a
page is. Each takes the cache's lock and first indexes finished offloads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvxfer.cache._deadline import LOOKUP_TIMEOUT_S, Deadline
from kvxfer.hostpool import PageRef
from kvxfer.manager import check_key

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable

    from kvxfer.cache._host import HostTier
    from kvxfer.cache._lookup import Finder

__all__ = ["IndexViews"]


class IndexViews:
    """What ``HostCache`` answers about its index without moving a page."""

    # What the cache itself provides (``HostCache.__init__`` and ``HostCache._collect``).
    _lock: threading.RLock
    _host: HostTier
    _finder: Finder
    _collect: Callable[[], None]

    def __len__(self) -> int:
        with self._lock:
            self._collect()
            return len(self._host)

    def __contains__(self, key: Any) -> bool:
        key = check_key(key, "key")
        with self._lock:
            self._collect()
            return self._host.holds(key)

    def keys(self) -> list[int]:
        """The keys of the cache's host pages, roughly in the order eviction would
        take them (least recently used first under LRU)."""
        with self._lock:
            self._collect()
            return self._host.keys()

    def page_of(self, key: Any) -> PageRef | None:
        """The host page cached under ``key`` (not pinned, not marked used), or None."""
        key = check_key(key, "key")
        with self._lock:
            self._collect()
            return self._host.page_of(key)

    def find(self, key: Any, *, timeout: float | None = LOOKUP_TIMEOUT_S) -> str | None:
        """Where page ``key`` is: ``"host"``, ``"store"`` or None (not marking it used;
        None too when the store does not answer within ``timeout`` seconds, logged)."""
        key = check_key(key, "key")
        deadline = Deadline(timeout)
        with self._lock:
            self._collect()
            return self._finder.where(key, deadline)

