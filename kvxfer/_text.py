"""Text helpers shared by printable values and the command line."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from typing import Any

__all__ = ["format_bytes", "parse_bytes", "unit_bytes", "table", "fit_width", "MAX_BYTES"]

MAX_BYTES = 1 << 60
"""The largest size ``parse_bytes`` takes (1 EiB): anything above is a typo."""

_BINARY = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_DECIMAL = {"k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4, "p": 1000**5}
# A number (digits, a point, digits) then a unit: B, KiB.., KB.., K.. or kb.. (see
# ``unit_bytes``). Exponents, signs and separators are not sizes.
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def unit_bytes(unit: str) -> int | None:
    """The bytes of one ``unit``, None if it is not one.

    ``KiB`` .. ``PiB`` (any case) are powers of 1024; ``KB`` .. ``PB`` (a capital B,
    SI's ``kB`` too) powers of 1000; a bare ``K``, ``M``, ``G``, ``T``, ``P`` (either
    case) is binary, as ``java -Xmx64g`` and ``docker --memory 64g`` read it; so is an
    all-lowercase ``kb`` .. ``pb`` (or ``Gb``), which ``docker --memory 64gb`` reads as
    64 GiB: only a capital B after the prefix makes a unit decimal.

    Example:
        >>> [unit_bytes(u) for u in ("", "B", "KiB", "KB", "kB", "K", "g", "gb", "GB", "x")]
        [1, 1, 1024, 1000, 1000, 1024, 1073741824, 1073741824, 1000000000, None]
    """
    if unit in ("", "b", "B"):
        return 1
    prefix, rest = unit[0].lower(), unit[1:]
    if prefix not in _BINARY:
        return None
    if rest.lower() == "ib" or rest in ("", "b"):
        return _BINARY[prefix]
    return _DECIMAL[prefix] if rest == "B" else None


def format_bytes(n: int | None) -> str:
    """``32768`` → ``'32 KiB'``; ``6291456`` → ``'6 MiB'``; None → ``'-'``."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if n % size else f"{n // size} {unit}"
    return f"{n} B"


def parse_bytes(text: str) -> int:
    """``'64GiB'`` -> ``68719476736``: a size in bytes with an optional unit, parsed
    exactly (no floating point): ``2.01KB`` is 2010 bytes, and a size that is not a
    whole number of bytes is refused. Units as ``unit_bytes`` reads them: ``KiB`` ..
    ``PiB`` binary, ``KB`` .. ``PB`` decimal, a bare ``K`` / ``M`` / ``G`` / ``T`` /
    ``P`` (and docker's lowercase ``gb``) binary.

    Raises:
      ValueError: not a size, a fraction of a byte, or above ``MAX_BYTES``; naming the text.

    Example:
        >>> parse_bytes("64GiB"), parse_bytes("512 mib"), parse_bytes("1.5GB")
        (68719476736, 536870912, 1500000000)
        >>> parse_bytes("2.01KB"), parse_bytes("64G"), parse_bytes("64g") == 64 << 30
        (2010, 68719476736, True)
        >>> parse_bytes("2.0001KB")
        Traceback (most recent call last):
        ...
        ValueError: '2.0001KB' is 2000.1 bytes, not a whole number of bytes
    """
    m = _SIZE.fullmatch(text) if isinstance(text, str) and len(text) <= 64 else None
    unit = unit_bytes(m.group(2)) if m else None
    if m is None or unit is None:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with a unit "
                         "such as 64GiB, 512MiB or 2GB (KiB/MiB/GiB binary, KB/MB/GB "
                         "decimal, a bare K/M/G binary)")
    whole, _, fraction = m.group(1).partition(".")
    # Exact: the digits as a ratio of integers, so 2.01KB is 2010 bytes, not 2009.99...
    scale = 10 ** len(fraction)
    numerator = (int(whole or "0") * scale + int(fraction or "0")) * unit
    value, remainder = divmod(numerator, scale)
    if value > MAX_BYTES or value == MAX_BYTES and remainder:
        raise ValueError(f"{text!r} is above {format_bytes(MAX_BYTES)}, the largest size "
                         "taken")
    if remainder:
        shown = f"{value}.{str(remainder * 10**64 // scale).zfill(64).rstrip('0')}"
        raise ValueError(f"{text!r} is {shown} bytes, not a whole number of bytes")
    return value


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
