"""A cache call's arguments: page keys, and device block ids per key (per slice class)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvxfer._check import check_int
from kvxfer.manager import Blocks, check_key, describe_keys

__all__ = ["Columns", "page_keys", "columns", "pick", "describe_pages"]

#: Block ids of a call, one per key: one list for every slice class, or per class.
Columns = list[Any] | dict[int, list[Any]]


def page_keys(keys: Sequence[Any], where: str) -> list[int]:
    """Page keys as the manager takes them: ints in [0, 2**64) (numpy ones too) or bytes.

    Example:
        >>> page_keys([1, b"block-a"], "keys")[0]
        1
        >>> page_keys("ab", "keys")
        Traceback (most recent call last):
        ...
        TypeError: keys must be a sequence of keys (ints or bytes). Got 'ab' of type str
    """
    if isinstance(keys, (str, bytes, bytearray, memoryview)) or \
            not hasattr(keys, "__iter__"):
        raise TypeError(f"{where} must be a sequence of keys (ints or bytes). Got {keys!r} "
                        f"of type {type(keys).__name__}")
    return [check_key(k, f"{where}[{j}]") for j, k in enumerate(keys)]


def columns(device_blocks: Blocks, n: int, classes: int) -> Columns:
    """``put``'s block ids as one list, or per class (every one of ``classes`` named),
    ``n`` each.

    Example:
        >>> columns({0: [3, 4], 1: [6, 7]}, 2, classes=2)
        {0: [3, 4], 1: [6, 7]}
        >>> columns({0: [5]}, 1, classes=2)
        Traceback (most recent call last):
        ...
        ValueError: device_blocks names slice classes [0]; a cached page holds every class: name all of 0..1
    """
    if not isinstance(device_blocks, Mapping):
        if isinstance(device_blocks, (str, bytes)):
            raise TypeError(f"device_blocks must be a sequence of block ids. Got "
                            f"{type(device_blocks).__name__}")
        blocks = list(device_blocks)
        if len(blocks) != n:
            raise ValueError(f"{len(blocks)} device_blocks for {n} keys")
        return blocks
    out = {check_int(c, "device_blocks key (a slice class index)", minimum=0): list(ids)
           for c, ids in device_blocks.items()}
    if sorted(out) != list(range(classes)):
        raise ValueError(f"device_blocks names slice classes {sorted(out)}; a cached "
                         f"page holds every class: name all of 0..{classes - 1}")
    for c, ids in out.items():
        if len(ids) != n:
            raise ValueError(f"{len(ids)} device_blocks[{c}] for {n} keys")
    return out


def pick(cols: Columns, rows: Any) -> Blocks:
    """The block ids of ``rows`` (indices into the call's keys), in the columns' form.

    Example:
        >>> pick([7, 8, 9], [0, 2]), pick({0: [7, 8], 1: [1, 2]}, [1])
        ([7, 9], {0: [8], 1: [2]})
    """
    rows = list(rows)
    if isinstance(cols, dict):
        return {c: [ids[j] for j in rows] for c, ids in cols.items()}
    return [cols[j] for j in rows]


def describe_pages(keys: Sequence[int]) -> str:
    """Pages for an error or a log line, by count and key (the first few).

    Example:
        >>> describe_pages([11, 12])
        '2 pages (keys 0xb, 0xc)'
    """
    return describe_keys("", keys).removeprefix(" of ")
