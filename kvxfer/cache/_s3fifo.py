"""S3-FIFO: a small FIFO that filters one-off pages, a main FIFO, a ghost queue.

From Yang et al., "FIFO queues are all you need for cache eviction" (SOSP 2023):

* A new page enters the small queue (10% of the capacity), unless its key is in the
  ghost queue (evicted from the small queue not long ago): then it enters the main
  queue.
* A lookup raises the page's frequency (two bits: at most 3). Nothing moves. The
  pages of one prefix that arrived together swap places at the small queue's end, so
  that its tail is the first to leave it (``used_together``).
* Eviction takes from the small queue while it holds at least its share (or the
  main queue is empty), else from the main queue.
* Small queue: the oldest page moves to the main queue if it was looked up since it
  arrived, else it is evicted and its key enters the ghost queue.
* Main queue: the oldest page goes back to the end with its frequency less one if
  it is above zero, else it is evicted.
* The ghost queue holds keys only, as many as the main queue's share, oldest
  dropped first.

So a scan of one-off pages passes through the small queue and out, while a page
looked up again (a shared prefix) reaches the main queue and stays through the
scan. A pinned page is never evicted: at the head of the small queue it moves to the
main queue (a lookup pinned it, so it was looked up), at the head of the main queue
it goes back to the end with its frequency kept.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Container, Sequence

from kvxfer.cache._policy import CachePolicy

__all__ = ["S3FIFOPolicy"]

_MAX_FREQ = 3  # two bits


class S3FIFOPolicy(CachePolicy):
    """S3-FIFO eviction: scan-resistant, every operation O(1) amortized.

    Args:
      small_fraction: the small queue's share of the capacity (the paper's 10%).

    Example:
        >>> p = S3FIFOPolicy(); p.bind(10)  # a small queue of 1 page
        >>> p.insert(1); p.touch(1)          # a shared prefix, looked up again
        >>> evicted = []
        >>> for k in range(100, 120):        # a scan of one-off pages, a full cache
        ...     evicted += p.evict(max(0, len(p) + 1 - 10), pinned=()); p.insert(k)
        >>> 1 in p, evicted[:3], p.queue_of(1), p.queue_of(evicted[-1])
        (True, [100, 101, 102], 'main', 'ghost')
    """

    name = "s3fifo"

    def __init__(self, small_fraction: float = 0.1):
        if not isinstance(small_fraction, (int, float)) or isinstance(small_fraction, bool) \
                or not 0 < small_fraction < 1:
            raise ValueError(f"Expected small_fraction in (0, 1). Got {small_fraction!r}")
        self.small_fraction = float(small_fraction)
        self._small: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._main: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._ghost: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._freq: dict[int, int] = {}

    @property
    def _small_size(self) -> int:
        return max(1, round((self.capacity or 1) * self.small_fraction))

    @property
    def _ghost_size(self) -> int:
        return max(1, (self.capacity or 1) - self._small_size)

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def order(self) -> list[int]:
        return list(self._small) + list(self._main)

    def queue_of(self, key: int) -> str | None:
        """``"small"``, ``"main"``, ``"ghost"`` or None: where ``key`` is (for tests and
        the curious)."""
        for name, q in (("small", self._small), ("main", self._main),
                        ("ghost", self._ghost)):
            if key in q:
                return name
        return None

    def insert(self, key: int) -> None:
        self._freq[key] = 0
        if key in self._ghost:  # evicted from the small queue not long ago: to main
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: int) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, _MAX_FREQ)

    def used_together(self, keys: Sequence[int]) -> None:
        # Pages that just arrived together sit at the small queue's end, in key order:
        # they swap places there so the prefix's tail leaves first, O(len(keys)).
        # Pages a lookup found are left where they are: looked up, they move on to
        # the main queue rather than leave, and the main queue ages by frequency.
        mine = [k for k in keys if k in self._small]
        if len(mine) < 2:
            return
        newest = list(itertools.islice(reversed(self._small), len(mine)))
        if set(newest) != set(mine):
            return
        for key in newest:
            del self._small[key]
        for key in reversed(mine):
            self._small[key] = None

    def remove(self, key: int) -> None:
        if self._freq.pop(key, None) is not None:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def evict(self, n: int, pinned: Container[int]) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            key = self._evict_one(pinned)
            if key is None:
                break  # everything left is pinned
            out.append(key)
        return out

    def _evict_one(self, pinned: Container[int]) -> int | None:
        if self._small and (len(self._small) >= self._small_size or not self._main):
            key = self._evict_small(pinned)
            if key is not None:
                return key
        key = self._evict_main(pinned)
        if key is not None or not self._small:
            return key
        # The main queue is all pinned: the small queue gives a page, or empties into
        # the main queue (whose new pages then age out there).
        key = self._evict_small(pinned)
        return key if key is not None else self._evict_main(pinned)

    def _evict_small(self, pinned: Container[int]) -> int | None:
        """Evicts the oldest small-queue page not looked up (its key to the ghost
        queue), moving looked-up ones to the main queue; None if the queue empties."""
        while self._small:
            key, _ = self._small.popitem(last=False)
            if self._freq[key] > 0 or key in pinned:
                self._main[key] = None
                continue
            del self._freq[key]
            self._ghost[key] = None
            while len(self._ghost) > self._ghost_size:
                self._ghost.popitem(last=False)
            return key
        return None

    def _evict_main(self, pinned: Container[int]) -> int | None:
        """Evicts the oldest main-queue page whose frequency is down to zero (each page
        passed over goes back to the end, one lower); None if every page is pinned."""
        passed = 0  # pinned pages passed over in a row: a whole lap of them ends it
        while self._main and passed < len(self._main):
            key, _ = self._main.popitem(last=False)
            self._main[key] = None
            if key in pinned:
                passed += 1
                continue
            passed = 0
            if self._freq[key] > 0:
                self._freq[key] -= 1
                continue
            del self._main[key], self._freq[key]
            return key
        return None
