"""Text helpers shared by printable values and the command line."""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Sequence
from typing import Any

__all__ = ["format_bytes", "parse_bytes", "table", "fit_width", "MAX_BYTES"]

MAX_BYTES = 1 << 60
"""The largest size ``parse_bytes`` takes (1 EiB): anything above is a typo."""

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
          "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def format_bytes(n: int | None) -> str:
    """``32768`` → ``'32 KiB'``; ``6291456`` → ``'6 MiB'``; None → ``'-'``."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if n % size else f"{n // size} {unit}"
    return f"{n} B"


def parse_bytes(text: str) -> int:
    """``'64GiB'`` -> ``68719476736``: a size in bytes with an optional unit (B, KiB,
    MiB, GiB, TiB, PiB in powers of 1024; KB, MB, GB, TB in powers of 1000; any case).

    Raises:
      ValueError: not a size, a fraction of a byte, or above ``MAX_BYTES``; naming the text.

    Example:
        >>> parse_bytes("64GiB"), parse_bytes("512 mib"), parse_bytes("1.5GB")
        (68719476736, 536870912, 1500000000)
    """
    m = _SIZE.fullmatch(text) if isinstance(text, str) and len(text) <= 64 else None
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with a unit "
                         "such as 64GiB, 512MiB or 2GB")
    digits = m.group(1)
    value = int(digits) * unit if "." not in digits else float(digits) * unit
    if not math.isfinite(value) or value > MAX_BYTES:
        raise ValueError(f"{text!r} is above {format_bytes(MAX_BYTES)}, the largest size "
                         "taken")
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A plain aligned text table."""
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


_RULE = re.compile(r"-+(?:  -+)*")


def fit_width(text: str, width: int = 100, key_width: int = 24) -> str:
    """``text`` with no line over ``width`` columns: a ``table`` wider than that is cut
    into parts of whole columns, each repeating the leading columns that name a row (as
    many as fit in ``key_width``, one at least); any other line is wrapped, its
    continuation lined up after a leading label column, else indented like it plus two
    spaces.

    Example:
        >>> wide = table([["a", "1" * 30, "2" * 30]], ["key", "first", "second"])
        >>> print(fit_width(wide, 45))
        key  first
        ---  ------------------------------
        a    111111111111111111111111111111
        <BLANKLINE>
        key  second
        ---  ------------------------------
        a    222222222222222222222222222222
    """
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        rule = lines[i + 1] if i + 1 < len(lines) else ""
        if len(rule) > width and _RULE.fullmatch(rule):
            gaps = [k for k, c in enumerate(rule) if c == " "]
            end = i + 2
            # A row of the table: no text where the rule has its gaps between columns.
            while end < len(lines) and lines[end].strip() and len(lines[end]) <= len(rule) \
                    and all(k >= len(lines[end]) or lines[end][k] == " " for k in gaps):
                end += 1
            out += _split_table(lines[i:end], rule, width, key_width)
            i = end
            continue
        if len(line) <= width:
            out.append(line)
        else:
            # A continuation lines up after a leading label column (``cpu       text``),
            # else after the line's own indent and two spaces.
            label = re.match(r"\s*\S+ {2,}(?=\S)", line)
            hang = len(label.group(0)) if label and len(label.group(0)) <= 24 else \
                len(line) - len(line.lstrip()) + 2
            out += textwrap.wrap(line, width, subsequent_indent=" " * hang,
                                 break_on_hyphens=False) or [line[:width]]
        i += 1
    return "\n".join(out)


def _split_table(block: list[str], rule: str, width: int, key_width: int) -> list[str]:
    """A table (header, rule, rows) cut into parts of whole columns that fit ``width``."""
    spans = [(m.start(), m.end()) for m in re.finditer(r"-+", rule)]
    cells = [[ln[a:(spans[k + 1][0] if k + 1 < len(spans) else len(ln))].strip()
              for k, (a, _) in enumerate(spans)] for ln in block]
    widths = [b - a for a, b in spans]
    keys, used = 1, widths[0]
    while keys < len(widths) - 1 and used + 2 + widths[keys] <= key_width:
        used += 2 + widths[keys]
        keys += 1
    parts: list[list[int]] = []
    current: list[int] = []
    for k in range(keys, len(widths)):
        size = used + sum(2 + widths[j] for j in current) + 2 + widths[k]
        if current and size > width:
            parts.append(current)
            current = []
        current.append(k)
    if current:
        parts.append(current)
    out: list[str] = []
    for n, part in enumerate(parts):
        columns = list(range(keys)) + part
        if n:
            out.append("")
        for r, row in enumerate(cells):
            text = "  ".join(("-" * widths[k]) if r == 1 else row[k].ljust(widths[k])
                             for k in columns)
            out.append(text.rstrip())
    return out
