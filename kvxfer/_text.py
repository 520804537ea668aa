"""Text helpers shared by printable values and the command line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["format_bytes", "table"]


def format_bytes(n: int | None) -> str:
    """``32768`` → ``'32 KiB'``; ``6291456`` → ``'6 MiB'``; None → ``'-'``."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if n % size else f"{n // size} {unit}"
    return f"{n} B"


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A plain aligned text table."""
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
