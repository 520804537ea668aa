"""Eviction policies of the host tier: the ``CachePolicy`` interface and LRU.

A policy orders the cache's host pages and picks which go when room is needed; the
cache owns the pages (their refs, pins, the store below). It tells its policy five
things: a page arrived (``insert``), a lookup found it (``touch``, once per lookup
that pins it), the pages of one prefix were used or arrived together
(``used_together``, after their ``insert`` or ``touch``: a page is useless without
the pages before it, so a policy that can should evict the prefix's tail first, as
SGLang's radix cache evicts leaves first), it left for another reason than eviction
(``remove``: freed behind the cache's back, proven bad), and it needs ``n`` pages
gone (``evict``). ``evict`` is
given the pinned keys and never returns one of them; every key it returns has left
the policy. The cache calls its policy under its own lock, one call at a time, and
the same calls in the same order on every rank of a multi-process job, so a policy
must be deterministic (no clocks, no randomness) for the ranks' caches to stay
identical. The cache checks what a policy does: an ``evict`` answer with a pinned key,
a key it does not cache, a key twice or more than ``n`` keys is refused whole (a
``RuntimeError`` naming it; no page leaves), and a call that raises costs the pages of
that call only (an ``insert`` that raises: that page is not cached).

The policy governs the host tier only: the store tier below keeps its own order
(``DiskStore`` and ``RedisStore`` evict least recently used blobs past their
capacity), and which host pages reach it is ``HostCache(write_through=)``'s choice.
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Container, Sequence
from typing import ClassVar, Literal

from kvxfer._check import check_int

__all__ = ["CachePolicy", "LRUPolicy", "PolicyName"]

#: The policies ``HostCache(policy=)`` builds by name.
PolicyName = Literal["lru", "s3fifo", "arc"]


class CachePolicy(abc.ABC):
    """Which host pages an eviction takes. Subclass it for a policy of your own.

    A policy serves one cache: ``HostCache`` calls ``bind(capacity)`` (its host
    pool's pages) once, before any other call.

    Example:
        >>> class MRU(CachePolicy):  # evicts the most recently used page first
        ...     name = "mru"
        ...     def __init__(self): self._keys = []
        ...     def __len__(self): return len(self._keys)
        ...     def __contains__(self, key): return key in self._keys
        ...     def order(self): return self._keys[::-1]
        ...     def insert(self, key): self._keys.append(key)
        ...     def touch(self, key): self._keys.remove(key); self._keys.append(key)
        ...     def remove(self, key):
        ...         if key in self._keys: self._keys.remove(key)
        ...     def evict(self, n, pinned):
        ...         out = [k for k in self.order() if k not in pinned][:n]
        ...         for k in out: self._keys.remove(k)
        ...         return out
        >>> p = MRU(); p.bind(4)
        >>> for k in (1, 2, 3): p.insert(k)
        >>> p.evict(2, pinned={3})
        [2, 1]
    """

    #: The policy's name, as stats and the bench print it.
    name: ClassVar[str] = "custom"
    #: Host pages of the cache this policy serves (set by ``bind``).
    capacity: int | None = None

    def bind(self, capacity: int) -> None:
        """Called once by the cache this policy serves, before anything else."""
        if self.capacity is not None:
            raise ValueError(f"this {type(self).__name__} serves a cache already; give "
                             "each HostCache a policy of its own")
        self.capacity = check_int(capacity, "capacity", minimum=1)

    @abc.abstractmethod
    def __len__(self) -> int:
        """The pages in the policy (ghost entries of evicted pages not counted)."""

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is one of the policy's pages (not a ghost)."""

    @abc.abstractmethod
    def order(self) -> list[int]:
        """The pages, roughly in the order evictions would take them (first first)."""

    @abc.abstractmethod
    def insert(self, key: int) -> None:
        """A page arrived in host memory (it is not in the policy)."""

    @abc.abstractmethod
    def touch(self, key: int) -> None:
        """A lookup found the page (it is in the policy)."""

    def used_together(self, keys: Sequence[int]) -> None:
        """The pages ``keys`` (one prefix, head first, all in the policy) were just
        looked up or arrived together. A policy that orders pages by use may order
        them so that the last key goes first; the default changes nothing."""

    @abc.abstractmethod
    def remove(self, key: int) -> None:
        """The page left without being evicted (a no-op for a key not in the policy)."""

    @abc.abstractmethod
    def evict(self, n: int, pinned: Container[int]) -> list[int]:
        """Up to ``n`` pages to evict, none in ``pinned``, each removed from the policy;
        fewer (or none) when only pinned pages are left."""


class LRUPolicy(CachePolicy):
    """Least recently used first: a lookup or an arrival makes a page the most recent.

    The pages of a prefix used together are ordered tail first: its last page is
    evicted first and its head last (a tail is of no use without its head).

    ``evict`` costs O(1) a page plus one step for each pinned page it passes over
    (pins last only while a load reads them).

    Example:
        >>> p = LRUPolicy(); p.bind(3)
        >>> for k in (1, 2, 3): p.insert(k)
        >>> p.touch(1)
        >>> p.order(), p.evict(1, pinned={2}), p.order()
        ([2, 3, 1], [3], [2, 1])
        >>> p.insert(4); p.used_together([1, 4]); p.order()  # 4 goes before its head
        [2, 4, 1]
    """

    name = "lru"

    def __init__(self) -> None:
        self._order: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def order(self) -> list[int]:
        return list(self._order)

    def insert(self, key: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: int) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def used_together(self, keys: Sequence[int]) -> None:
        for key in reversed(keys):
            if key in self._order:
                self._order.move_to_end(key)

    def remove(self, key: int) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, pinned: Container[int]) -> list[int]:
        out = []
        for key in self._order:
            if len(out) == n:
                break
            if key not in pinned:
                out.append(key)
        for key in out:
            del self._order[key]
        return out
