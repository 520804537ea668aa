"""Counters and timing percentiles, kept cheaply and read as one snapshot.

Shared by the manager (transfers) and the host cache (hits per tier, store writes).
"""

from __future__ import annotations

import collections
import re
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["Counters", "reason_kind"]

# Transfer times a percentile is taken over (the most recent ones).
_WINDOW = 1024


def reason_kind(reason: str) -> str:
    """The kind of a load's reason text: ``"digest mismatch"``, ``"wrong key"``, ...

    Example:
        >>> reason_kind("wrong key: expected 0x1, page holds 0x2")
        'wrong key'
        >>> reason_kind("shard disagreement: digest mismatch in layer 3 on shard(s) [1] of 2")
        'shard disagreement'
        >>> reason_kind("digest mismatch in layer 0")
        'digest mismatch'
    """
    head = re.split(r"[:(]| in layer", reason, maxsplit=1)[0].strip()
    return head or "unknown"


class Counters:
    """Thread-safe named counters, labelled counters and timing windows.

    Example:
        >>> c = Counters()
        >>> c.add(pages_loaded=3); c.add_labelled("mismatches", "wrong key")
        >>> c.time("load", 0.002)
        >>> s = c.snapshot()
        >>> s["pages_loaded"], s["mismatches"], s["load_seconds"]["count"]
        (3, {'wrong key': 1}, 1)
    """

    def __init__(self, names: Iterable[str] = (), labelled: Iterable[str] = (),
                 timings: Iterable[str] = ()):
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {n: 0 for n in names}
        self._labelled: dict[str, collections.Counter] = {n: collections.Counter()
                                                          for n in labelled}
        self._times: dict[str, collections.deque] = {n: collections.deque(maxlen=_WINDOW)
                                                     for n in timings}
        self._totals: dict[str, list[float]] = {n: [0, 0.0] for n in timings}

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._counts[name] = self._counts.get(name, 0) + int(n)

    def add_labelled(self, name: str, label: str, n: int = 1) -> None:
        with self._lock:
            self._labelled.setdefault(name, collections.Counter())[label] += n

    def time(self, name: str, seconds: float) -> None:
        with self._lock:
            self._times.setdefault(name, collections.deque(maxlen=_WINDOW)).append(seconds)
            total = self._totals.setdefault(name, [0, 0.0])
            total[0] += 1
            total[1] += seconds

    def snapshot(self) -> dict[str, Any]:
        """Every counter; each timing as count, sum and p50/p90/p99 (seconds)."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            for name, c in self._labelled.items():
                out[name] = dict(sorted(c.items()))
            for name, window in self._times.items():
                count, total = self._totals[name]
                q = np.quantile(np.asarray(window), [0.5, 0.9, 0.99]).tolist() if window \
                    else [0.0, 0.0, 0.0]
                out[f"{name}_seconds"] = {"count": count, "sum": total, "p50": q[0],
                                          "p90": q[1], "p99": q[2]}
            return out
