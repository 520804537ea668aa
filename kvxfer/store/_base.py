"""The one interface every store tier below host memory implements.

A store maps string keys to opaque page blobs (``KVCacheManager.export_page``
makes them; ``import_page`` checks them). A store never interprets a blob: the
identity, geometry fingerprint and device digests inside it are checked by the
manager, and the bytes are checked on the device when the page is loaded.
"""

from __future__ import annotations

import abc
from typing import Any

__all__ = ["Store", "StoreError"]


class StoreError(OSError):
    """A store that cannot be reached or written (never reported as a miss)."""


class Store(abc.ABC):
    """Page blobs under string keys, with a capacity and LRU eviction.

    Implementations are thread-safe. ``get`` of a key that was never put, was
    evicted, or whose blob is incomplete (a write cut short by a crash) is a miss
    (``None``), never a partial blob.
    """

    #: The tier's name in stats and warnings (``"disk"``, ``"redis"``).
    name: str = "store"

    @abc.abstractmethod
    def put(self, key: str, blob: bytes, *, replace: bool = False) -> bool:
        """Stores ``blob`` under ``key``; returns False (nothing written) if present.

        With ``replace=True`` an existing blob is overwritten. May evict least
        recently used blobs to stay within the capacity.

        Raises:
          ValueError: ``blob`` alone exceeds the capacity.
          StoreError: the store cannot be written.
        """

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The whole blob under ``key`` (and marks it recently used), or None."""

    @abc.abstractmethod
    def contains(self, key: str) -> bool:
        """Whether a whole blob is stored under ``key`` (not marking it used)."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Removes ``key``; returns whether it was there."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: ``blobs``, ``bytes``, ``capacity_bytes``, ``puts``, ``gets``,
        ``hits``, ``evictions``."""

    def close(self) -> None:
        """Releases connections or files (the stored blobs stay)."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
