"""The host tier's calls of its ``CachePolicy``, checked so a policy that errs costs
pages of one call, never the cache.

A policy is the caller's code: it may raise, or answer ``evict`` with keys it must not
(pinned, not a page of the cache, repeated, more than asked). ``PolicyGuard`` makes
each call, and keeps the rule the host tier relies on: every indexed page is in the
policy, so every unpinned page can be evicted.

* ``insert`` that raises: the arriving page is not indexed (the tier frees it), so
  no page is left that the policy cannot evict.
* ``touch``, ``remove``, ``used_together`` that raise: logged; the page goes on (a
  key the policy lost is found by ``orphans`` and evicted by the tier when the policy
  gives no room).
* ``evict`` that raises or answers wrongly: the answer is refused whole, before any
  page leaves: each indexed key it named is given back to the policy (``insert``),
  and ``PolicyError`` names the policy and what was wrong.
* ``order`` that raises: the index's own order.

Example:
    >>> from kvxfer.cache._policy import LRUPolicy
    >>> policy = LRUPolicy(); policy.bind(4)
    >>> guard = PolicyGuard(policy)
    >>> guard.insert(1), guard.insert(2)
    (True, True)
    >>> guard.evict(1, pinned={1}, indexed={1, 2})
    [2]
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Container

from kvxfer.cache._policy import CachePolicy

__all__ = ["PolicyGuard", "PolicyError"]

log = logging.getLogger("kvxfer")


class PolicyError(RuntimeError):
    """A ``CachePolicy`` raised, or answered ``evict`` with keys it must not return."""


class PolicyGuard:
    """Calls ``policy`` for the host tier, checking what it does.

    Attributes:
      policy: the cache's policy.
      suspect: a call raised since the last ``orphans`` sweep found none (the policy
        may have lost keys).
    """

    def __init__(self, policy: CachePolicy):
        self.policy = policy
        self.suspect = False

    @property
    def name(self) -> str:
        return self.policy.name

    def _raised(self, call: str, key: object, e: BaseException) -> None:
        self.suspect = True
        log.error("the %r policy's %s(%r) raised %s: %s", self.name, call, key,
                  type(e).__name__, e)

    def insert(self, key: int) -> bool:
        """Whether the policy took ``key`` (if not, the caller must not index it)."""
        try:
            self.policy.insert(key)
            return True
        except Exception as e:
            self._raised("insert", key, e)
        self.remove(key)  # whatever half of it the policy kept
        return False

    def touch(self, key: int) -> None:
        try:
            self.policy.touch(key)
        except Exception as e:
            self._raised("touch", key, e)

    def used_together(self, keys: list[int]) -> None:
        try:
            self.policy.used_together(keys)
        except Exception as e:
            self._raised("used_together", keys, e)

    def remove(self, key: int) -> None:
        try:
            self.policy.remove(key)
        except Exception as e:
            self._raised("remove", key, e)

    def holds(self, key: int) -> bool:
        """Whether the policy holds ``key`` (yes when it cannot say)."""
        try:
            return key in self.policy
        except Exception as e:
            self._raised("__contains__", key, e)
            return True

    def order(self, indexed: Collection[int]) -> list[int]:
        """The indexed keys in the policy's order (those it leaves out last); the
        index's order when it raises."""
        try:
            order = [k for k in self.policy.order() if k in indexed]
        except Exception as e:
            self._raised("order", "", e)
            return list(indexed)
        seen = set(order)
        return list(dict.fromkeys(order)) + [k for k in indexed if k not in seen]

    def evict(self, n: int, pinned: Container[int], indexed: Container[int]) -> list[int]:
        """Up to ``n`` distinct unpinned indexed keys the policy gave up.

        Raises:
          PolicyError: the policy raised, or its answer named a key that is pinned,
            not a page of the cache, repeated, or more than ``n`` keys (then nothing
            is evicted: the indexed keys it named are back in the policy).
        """
        try:
            victims = list(self.policy.evict(n, pinned))
        except Exception as e:
            self.suspect = True  # it may have dropped keys before raising
            raise PolicyError(f"the {self.name!r} policy's evict({n}) raised "
                              f"{type(e).__name__}: {e}") from e
        why = _wrong(victims, n, pinned, indexed)
        if why is None:
            return victims
        self.suspect = True  # a policy that answers wrongly may have lost other keys
        for key in dict.fromkeys(victims):
            if key in indexed:
                self.insert(key)  # it left the policy in evict(): back, still indexed
        raise PolicyError(f"the {self.name!r} policy evicted {why}: a CachePolicy must "
                          "return unpinned keys it holds, each once, at most n; nothing "
                          "was evicted")

    def orphans(self, indexed: Collection[int], pinned: Container[int]) -> list[int]:
        """Unpinned indexed keys the policy no longer holds (looked for only after a
        call of it raised: ``suspect``)."""
        if not self.suspect:
            return []
        out = [k for k in indexed if k not in pinned and not self.holds(k)]
        if not out:
            self.suspect = False
        return out


def _wrong(victims: list[object], n: int, pinned: Container[int],
           indexed: Container[int]) -> str | None:
    """What is wrong with an ``evict(n)`` answer, or None."""
    if len(victims) > n:
        return f"{len(victims)} pages when asked for {n}"
    seen: set[object] = set()
    for key in victims:
        if not isinstance(key, int):
            return f"{key!r}, which is not a page key"
        if key in seen:
            return f"page {key!r} twice"
        seen.add(key)
        if key in pinned:
            return f"page {key!r}, which is pinned"
        if key not in indexed:
            return f"page {key!r}, which is not a page of this cache"
    return None
