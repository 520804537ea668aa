"""ARC: recency and frequency lists whose split adapts to the workload.

From Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache" (FAST
2003). With ``c`` the capacity:

* ``T1`` holds pages seen once lately, ``T2`` pages seen at least twice, each in LRU
  order; ``B1`` and ``B2`` (ghosts) hold the keys of pages evicted from ``T1`` and
  ``T2``.
* A lookup of a page in ``T1`` or ``T2`` moves it to the most recent end of ``T2``.
  The pages of one prefix used together are then ordered head last within their
  list (``used_together``), so the prefix's tail is evicted before its head.
* A page arriving whose key is in ``B1`` means ``T1`` was too small: the target
  ``p`` for ``T1``'s size grows by ``max(|B2| / |B1|, 1)`` (at most ``c``); in
  ``B2``, ``T2`` was too small: ``p`` shrinks by ``max(|B1| / |B2|, 1)`` (at least
  0). Either way the page enters ``T2``. Any other page enters ``T1``.
* Eviction takes ``T1``'s least recent page when ``|T1| > p`` (or ``T2`` is empty),
  else ``T2``'s, its key going to ``B1`` or ``B2``; ``|T1| + |B1| <= c`` and the four
  lists together ``<= 2c`` (the oldest ghosts are dropped).

Two departures, both forced by the cache evicting before a page arrives rather than
on its miss: the paper's tie-break (evict from ``T1`` when ``|T1| = p`` and the
arriving key is in ``B2``) is not taken, and ``p`` adapts when the ghost's page
arrives, after the eviction that made its room. A pinned page is passed over: the
least recent unpinned page of the chosen list goes, or, when all of that list is
pinned, of the other list.
"""

from __future__ import annotations

import collections
from collections.abc import Container, Sequence

from kvxfer.cache._policy import CachePolicy

__all__ = ["ARCPolicy"]


class ARCPolicy(CachePolicy):
    """ARC eviction: adapts between recency and frequency; O(1) a page plus one step
    for each pinned page passed over.

    Example:
        >>> p = ARCPolicy(); p.bind(2)
        >>> p.insert(1); p.insert(2); p.touch(1)   # 1 seen twice: T2; 2 once: T1
        >>> p.evict(1, pinned=()), p.lists()
        ([2], {'t1': [], 't2': [1], 'b1': [2], 'b2': []})
        >>> p.insert(2); p.target                 # 2 came back from B1: T1 was too small
        1.0
    """

    name = "arc"

    def __init__(self) -> None:
        self._t1: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._t2: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._b1: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._b2: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._p = 0.0

    @property
    def target(self) -> float:
        """``p``: the size ``T1`` is steered to, between 0 and the capacity."""
        return self._p

    def lists(self) -> dict[str, list[int]]:
        """The four lists, least recent first (for tests and the curious)."""
        return {"t1": list(self._t1), "t2": list(self._t2), "b1": list(self._b1),
                "b2": list(self._b2)}

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def order(self) -> list[int]:
        first, second = (self._t1, self._t2) if self._from_t1() else (self._t2, self._t1)
        return list(first) + list(second)

    def insert(self, key: int) -> None:
        c = float(self.capacity or 1)
        b1, b2 = len(self._b1), len(self._b2)
        if key in self._b1:
            self._p = min(c, self._p + max(b2 / b1, 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(b1 / b2, 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim()

    def touch(self, key: int) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def used_together(self, keys: Sequence[int]) -> None:
        # Within its own list (T1 or T2), each page of the prefix ends up more recent
        # than the pages after it: the tail is evicted first.
        for key in reversed(keys):
            for pages in (self._t1, self._t2):
                if key in pages:
                    pages.move_to_end(key)

    def remove(self, key: int) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def evict(self, n: int, pinned: Container[int]) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            key = self._replace(pinned)
            if key is None:
                break  # everything left is pinned
            out.append(key)
        return out  # each key went from T1 to B1 or T2 to B2: no bound is passed

    def _from_t1(self) -> bool:
        return bool(self._t1) and (len(self._t1) > self._p or not self._t2)

    def _replace(self, pinned: Container[int]) -> int | None:
        """ARC's REPLACE: the least recent unpinned page of T1 or T2, its key to B1 or B2."""
        lists = [(self._t1, self._b1), (self._t2, self._b2)]
        if not self._from_t1():
            lists.reverse()
        for pages, ghosts in lists:
            key = next((k for k in pages if k not in pinned), None)
            if key is not None:
                del pages[key]
                ghosts[key] = None
                return key
        return None

    def _trim(self) -> None:
        """Drops the oldest ghosts once a new page arrived: ``|T1| + |B1| <= c``, all four
        lists ``<= 2c``."""
        c = self.capacity or 1
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)
