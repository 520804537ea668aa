"""Test hooks of the DMA mover: a failure injected at each step of its programs'
callbacks, a spy on what the callbacks see, and a watch on the memory kvxfer lets go
of while copies may still reach it."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator

import numpy as np

from kvxfer.engine._copies import CALLBACK_STEPS, RELEASE_WATCHERS, callback_fault
from kvxfer.engine._dma_side import CallbackRecord, spy_callbacks

__all__ = ["CALLBACK_STEPS", "callback_fault", "spy_callbacks", "CallbackRecord",
           "ReleaseWatch", "watch_releases"]


class ReleaseWatch:
    """The memory ranges the DMA mover let go of (``watch_releases``), in order.

    A stand-in copy engine asks ``now()`` when a copy is enqueued and ``freed_since``
    when it runs: a copy that runs into memory let go of after it was enqueued is
    one that a buffer's next owner would see land (a freed staging handed to the next
    allocation, a host slot given to the next page).

    Example:
        >>> watch = ReleaseWatch()
        >>> t = watch.now()
        >>> watch(np.array([100], np.uint64), np.array([164], np.uint64))
        >>> watch.freed_since(t, np.array([128], np.uint64), np.array([136], np.uint64))
        True
        >>> watch.freed_since(watch.now(), np.array([128], np.uint64), np.array([136], np.uint64))
        False
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clock = itertools.count()
        self.released: list[tuple[int, np.ndarray, np.ndarray]] = []

    def now(self) -> int:
        """A tick of the watch's clock."""
        with self._lock:
            return next(self._clock)

    def __call__(self, starts: np.ndarray, ends: np.ndarray) -> None:
        with self._lock:
            self.released.append((next(self._clock), np.array(starts, np.uint64),
                                  np.array(ends, np.uint64)))

    def freed_since(self, tick: int, starts: np.ndarray, ends: np.ndarray) -> bool:
        """Whether any of ``[starts, ends)`` was let go of after ``tick``."""
        with self._lock:
            later = [(s, e) for t, s, e in self.released if t > tick]
        starts, ends = np.asarray(starts, np.uint64), np.asarray(ends, np.uint64)
        for s, e in later:
            if np.any((starts[:, None] < e[None, :]) & (s[None, :] < ends[:, None])):
                return True
        return False


@contextlib.contextmanager
def watch_releases() -> Iterator[ReleaseWatch]:
    """Records every range of memory the DMA mover lets go of inside the block (device
    staging and rows, host slots its copies reach), once it says no copy can reach
    it any more.

    Example:
        >>> with watch_releases() as watch:
        ...     pass
        >>> watch.released
        []
    """
    watch = ReleaseWatch()
    RELEASE_WATCHERS.append(watch)
    try:
        yield watch
    finally:
        RELEASE_WATCHERS.remove(watch)
