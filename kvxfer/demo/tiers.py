"""The demo's device tier: page keys and device blocks (the host tier is ``HostCache``).

A *page* is one block index across every layer: the KV of ``block_size`` prompt
tokens in all layers, what one device block id addresses in every layer's cache
and what one host slot holds. Pages are named by a chained hash of their tokens
(``page_keys``), so a key names a page's whole prefix.

* ``DeviceBlocks``: the device tier, a block allocator with a prefix index.
  Blocks of cached pages are reference counted; unreferenced ones wait in an LRU
  list and are the first to go when a request needs blocks.

Example:
    >>> keys = page_keys(list(range(40)))  # two full pages; the partial third has no key
    >>> blocks = DeviceBlocks(4)
    >>> b, = blocks.allocate(1)
    >>> blocks.publish(keys[0], b), blocks.lookup(keys[0]) == b
    (True, True)
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["page_keys", "DeviceBlocks", "SCRATCH_KEY"]

SCRATCH_KEY = 0xFFFF_FFFF_0000_0000
"""Key of pages written only to compile transfers or to refill a slot, never indexed."""


def page_keys(tokens: Sequence[int] | np.ndarray, block_size: int = 16,
              parent: int = 0) -> list[int]:
    """Chained 64-bit keys of the *full* pages of a token sequence.

    ``key[j] = blake2b(key[j - 1] || tokens of page j)`` (``key[-1] = parent``), so a
    page's key names its whole prefix: two requests share page ``j`` only if they
    share pages ``0..j``. A trailing partial page gets no key: the model promises
    bit-identical KV only for full prompt pages.

    Args:
        tokens: Token ids.
        block_size: Tokens per page (the model's block size).
        parent: Key of the page before the first one (0 at the start of a prompt).

    Returns:
        One key in ``[0, 2**64)`` per full page.

    Example:
        >>> a = page_keys(list(range(40)))
        >>> len(a), a == page_keys(list(range(32)) + [9, 9])[:2]
        (2, True)
        >>> page_keys(list(range(16)))[0] == page_keys([1] + list(range(1, 16)))[0]
        False
    """
    toks = np.asarray(tokens, dtype="<i4").reshape(-1)
    keys, key = [], int(parent)
    for j in range(len(toks) // block_size):
        h = hashlib.blake2b(key.to_bytes(8, "little"), digest_size=8, person=b"kvxfer-page")
        h.update(toks[j * block_size:(j + 1) * block_size].tobytes())
        key = int.from_bytes(h.digest(), "little")
        keys.append(key)
    return keys


class DeviceBlocks:
    """Device block allocator with a device-tier prefix index (refcounts, LRU).

    A block is *free*, *held* (refcount > 0; cached or private to a request), or
    *cold* (cached, refcount 0, in the LRU list, evictable). ``evict`` takes cold
    blocks out of the index; the caller copies them out and then ``reclaim``\\ s them.

    Args:
        num_blocks: Device blocks per layer.

    Example:
        >>> blocks = DeviceBlocks(4)
        >>> b, = blocks.allocate(1)
        >>> blocks.publish(77, b)
        True
        >>> blocks.release(b)
        >>> blocks.lookup(77) == b, blocks.num_cold
        (True, 1)
        >>> blocks.evict(1) == [(b, 77)], blocks.lookup(77)
        (True, None)
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        self._refs = [0] * num_blocks
        self._index: dict[int, int] = {}  # key -> block
        self._key_of: dict[int, int] = {}  # block -> key (cached blocks only)
        # Cold cached blocks, least recently used first.
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cold(self) -> int:
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._index)

    def lookup(self, key: int) -> int | None:
        """The block caching ``key``, or None."""
        return self._index.get(key)

    def cached_pages(self) -> list[tuple[int, int]]:
        """``(block, key)`` of every cached block, held or cold."""
        return [(b, k) for k, b in self._index.items()]

    def cold_pages(self) -> list[tuple[int, int]]:
        """``(block, key)`` of cold cached blocks, least recently used first."""
        return [(b, self._key_of[b]) for b in self._lru]

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` free blocks (refcount 1 each).

        Raises:
            MemoryError: fewer than ``n`` blocks are free (nothing taken).
        """
        if n > len(self._free):
            raise MemoryError(f"{n} device blocks requested, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def acquire(self, block: int) -> None:
        """Adds a reference to a cached block (a prefix hit)."""
        self._refs[block] += 1
        self._lru.pop(block, None)

    def release(self, block: int) -> None:
        """Drops a reference; an unreferenced block goes cold (cached) or free."""
        if self._refs[block] <= 0:
            raise ValueError(f"device block {block} released with no reference held")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._lru[block] = None
                self._lru.move_to_end(block)
            else:
                self._free.append(block)

    def publish(self, key: int, block: int) -> bool:
        """Caches a held block under ``key``; False (nothing done) if ``key`` is cached."""
        if key in self._index or block in self._key_of:
            return False
        self._index[key] = block
        self._key_of[block] = key
        return True

    def evict(self, n: int) -> list[tuple[int, int]]:
        """Takes up to ``n`` cold blocks out of the index, LRU first: ``(block, key)``.

        The blocks are neither free nor cached until ``reclaim``: the caller copies
        their bytes out first.
        """
        out = []
        while self._lru and len(out) < n:
            block, _ = self._lru.popitem(last=False)
            key = self._key_of.pop(block)
            del self._index[key]
            out.append((block, key))
        return out

    def reclaim(self, blocks: Sequence[int]) -> None:
        """Returns evicted blocks to the free list."""
        self._free.extend(blocks)
