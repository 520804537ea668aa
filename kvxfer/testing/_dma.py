"""Test hooks of the DMA mover: a failure injected at a step of its programs'
callbacks or at a CUDA driver call, a spy on what the callbacks see, and a watch on
the memory kvxfer lets go of while copies may still reach it."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvxfer.engine.dma import CALLBACK_STEPS, HOOKS

__all__ = ["CALLBACK_STEPS", "callback_fault", "driver_fault", "spy_callbacks",
           "ReleaseWatch", "watch_releases"]


@contextlib.contextmanager
def _hooked(kind: str, key: Any, value: Any) -> Iterator[Any]:
    table = HOOKS[kind]
    if isinstance(table, list):
        table.append(value)
    else:
        table[key] = value
    try:
        yield value
    finally:
        if isinstance(table, list):
            table.remove(value)
        else:
            table.pop(key, None)


def callback_fault(step: str, error: BaseException | None = None
                   ) -> contextlib.AbstractContextManager[Any]:
    """Makes step ``step`` (``CALLBACK_STEPS``) of every DMA callback run inside the
    block raise ``error``: the callback must record it and return, so the program ends
    normally and its aliased outputs still hold the caches.

    Example:
        >>> with callback_fault("copy") as error:
        ...     error
        RuntimeError("injected failure at the callback's copy step")
    """
    if step not in CALLBACK_STEPS:
        raise ValueError(f"step={step!r}; expected one of {CALLBACK_STEPS}")
    return _hooked("faults", step, error if error is not None else RuntimeError(
        f"injected failure at the callback's {step} step"))


def driver_fault(name: str, at: int = 0) -> contextlib.AbstractContextManager[Any]:
    """Makes call ``at`` (from 0, counted inside the block) of CUDA driver entry point
    ``name`` (``"cuMemcpyAsync"``, ``"cuEventRecord"``, ...) fail with a
    ``DriverError`` before it reaches the driver: a failure after some copies were
    enqueued, say.

    Example:
        >>> with driver_fault("cuMemcpyAsync", at=1) as rule:
        ...     rule
        [0, 1]
    """
    if at < 0:
        raise ValueError(f"at={at}; expected a call number from 0")
    return _hooked("driver", name, [0, at])


def spy_callbacks() -> contextlib.AbstractContextManager[list[Any]]:
    """Records every DMA callback run inside the block: its ``thread``, the ``stream``
    XLA handed it, whether it ``found`` its job and the job's ``direction`` (on a GPU
    the callback runs on the caller's thread at dispatch, with an int stream).

    Example:
        >>> with spy_callbacks() as seen:
        ...     pass
        >>> seen
        []
    """
    return _hooked("spies", None, [])


class ReleaseWatch:
    """The memory ranges the DMA mover let go of (``watch_releases``), in order.

    A stand-in copy engine asks ``now()`` when a copy is enqueued and ``freed_since``
    when it runs: a copy that runs into memory let go of after it was enqueued is one
    that the memory's next owner would see land.

    Example:
        >>> watch = ReleaseWatch()
        >>> t = watch.now()
        >>> watch(np.array([100], np.uint64), np.array([164], np.uint64))
        >>> watch.freed_since(t, np.array([128], np.uint64), np.array([136], np.uint64))
        True
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
        return any(np.any((starts[:, None] < e[None, :]) & (s[None, :] < ends[:, None]))
                   for s, e in later)


def watch_releases() -> contextlib.AbstractContextManager[ReleaseWatch]:
    """Records every range of memory the DMA mover lets go of inside the block (device
    staging and rows, host slots its copies reach), once it holds no copy can reach
    it any more.

    Example:
        >>> with watch_releases() as watch:
        ...     pass
        >>> watch.released
        []
    """
    return _hooked("released", None, ReleaseWatch())
