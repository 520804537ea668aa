"""Reading figures out of a report: every number with its path, the pinned mover's row.

Example:
    >>> list(iter_figures({"a": [1, {"b": 2.5}], "ok": True}))
    [('a[0]', 1), ('a[1].b', 2.5)]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["ZERO_OK", "iter_figures", "pinned_figures"]

#: Figures that may legitimately be zero: differences, the fraction of calls that
#: returned after the queued steps were done, and the policy section's counts (a tier
#: a case never hits, a write-through setting that gates nothing); all others are > 0.
ZERO_OK = frozenset({"host_transient_bytes", "device_persistent_bytes",
                     "device_transient_bytes", "steps_done_at_return", "host_hits",
                     "store_hits", "misses", "host_hit_rate", "store_hit_rate", "hit_rate",
                     "evictions", "store_pages_written", "store_bytes_written",
                     "store_writes_gated", "dropped"})

#: The pinned mover's figures in a row: (name, method when auto is another mover,
#: method when auto is the pinned mover itself).
_PINNED = (("offload off", "offload_pinned_off", "offload_off"),
           ("offload page", "offload_pinned_page", "offload_page"),
           ("load off", "load_pinned_off_all", "load_off_all"),
           ("load page", "load_pinned_page_all", "load_page_all"))


def pinned_figures(row: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The pinned mover's offload and load stats in a throughput or sweep row.

    From its own variants where ``path="auto"`` took another mover, from auto's
    where auto is the pinned mover; None where neither was measured.

    Example:
        >>> row = {"paths": ["pinned"], "pinned_methods": False,
        ...        "methods": {m: {"gbps": 1.0} for _, _, m in _PINNED}}
        >>> sorted(pinned_figures(row))
        ['load off', 'load page', 'offload off', 'offload page']
    """
    if row.get("pinned_methods"):
        return {name: row["methods"][own] for name, own, _ in _PINNED}
    if row.get("paths") == ["pinned"]:
        return {name: row["methods"][auto] for name, _, auto in _PINNED}
    return None


def iter_figures(obj: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a report with its path (booleans are flags, not figures).

    Example:
        >>> list(iter_figures({"a": [1, {"b": 2.5}], "ok": True, "name": "x"}))
        [('a[0]', 1), ('a[1].b', 2.5)]
    """
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_figures(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from iter_figures(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj
