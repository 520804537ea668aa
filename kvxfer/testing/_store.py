"""Store tiers under test: damage a stored page the way a disk or a network does, and
count the calls a cache makes to its store."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kvxfer.manager import first_span
from kvxfer.store import Store

__all__ = ["flip_stored_bit", "CountingStore"]


def flip_stored_bit(store: Store, key: str, bit: int | None = None, *, seed: int = 0) -> int:
    """Flips one bit of a stored page's bytes (past its headers), in place at rest.

    The blob keeps its framing, so it imports as a whole page: only the digest
    check on the device, at load, can find the flip.

    Returns:
      The bit index flipped within the page bytes of the blob's first slice class.

    Raises:
      KeyError: nothing is stored under ``key``.
    """
    blob = store.get(key)
    if blob is None:
        raise KeyError(f"no page stored under {key!r} in the {store.name} store")
    start, end = first_span(blob)
    if bit is None:
        bit = int(np.random.default_rng(seed).integers(0, (end - start) * 8))
    if not 0 <= bit < (end - start) * 8:
        raise ValueError(f"bit {bit} is outside the page's {end - start} bytes")
    damaged = bytearray(blob)
    damaged[start + bit // 8] ^= 1 << (bit % 8)
    store.put(key, bytes(damaged), replace=True)
    return bit


class CountingStore(Store):
    """A real store behind a wrapper that counts every call made to it, by name
    (``calls``): what shows how many store round trips a cache makes.

    Args:
      inner: the store every call goes to.
      batched: pass the batched calls (``get_many``, ``put_many``, ``contains_many``)
        on to ``inner`` (default); False runs them as ``Store``'s defaults do, one
        single-key call per key (as a store without batches would), each counted.

    Example:
        >>> import tempfile
        >>> from kvxfer import store, testing
        >>> with tempfile.TemporaryDirectory() as d:
        ...     counted = testing.CountingStore(store.DiskStore(d), batched=False)
        ...     counted.put_many({"a": b"x", "b": b"y"})
        ...     counted.get_many(["a", "b", "c"])
        ...     sorted(counted.calls.items())
        [True, True]
        [b'x', b'y', None]
        [('get', 3), ('get_many', 1), ('put', 2), ('put_many', 1)]
    """

    def __init__(self, inner: Store, *, batched: bool = True):
        if not isinstance(inner, Store):
            raise TypeError(f"inner must be a kvxfer.store.Store. Got {type(inner).__name__}")
        self.inner = inner
        self.batched = batched
        self.name = inner.name
        self.calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1

    def put(self, key: str, blob: bytes, *, replace: bool = False) -> bool:
        self._count("put")
        return self.inner.put(key, blob, replace=replace)

    def get(self, key: str) -> bytes | None:
        self._count("get")
        return self.inner.get(key)

    def contains(self, key: str) -> bool:
        self._count("contains")
        return self.inner.contains(key)

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        self._count("get_many")
        return self.inner.get_many(keys) if self.batched else super().get_many(keys)

    def put_many(self, items: Iterable[tuple[str, bytes]] | Mapping[str, bytes], *,
                 replace: bool = False) -> list[bool]:
        self._count("put_many")
        if self.batched:
            return self.inner.put_many(items, replace=replace)
        return super().put_many(items, replace=replace)

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        self._count("contains_many")
        return self.inner.contains_many(keys) if self.batched else super().contains_many(keys)

    def delete(self, key: str) -> bool:
        self._count("delete")
        return self.inner.delete(key)

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()  # not counted: a cache reads it on a thread of its own

    def cap_blob_bytes(self, max_bytes: int) -> None:
        """Caps this wrapper and passes the cap on, so the real store refuses an
        oversized blob before reading it."""
        super().cap_blob_bytes(max_bytes)
        self.inner.cap_blob_bytes(max_bytes)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"CountingStore({self.inner!r}, batched={self.batched})"
