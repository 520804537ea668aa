"""Key rotation in the store tier: pages a cache misses under its key's id, looked for
under the ids of the keys it replaced.

Store keys of sealed pages carry the id of the key that sealed them, so a cache with a
new key misses every page sealed before (and never deletes one: it is another key's).
A cache built with ``Sealer(new, previous_keys=[old, ...])`` asks again, under each old
key's id in turn and only for the pages still missed, in one batched call per old key.
A page found there opens with that old key and is sealed with the new one; the store
tier imports it and writes it under the new key's id (``store_rekeyed``). The blobs
under old ids stay: caches still on those keys read them, and the store's LRU ages
them out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvxfer._counters import Counters
from kvxfer.store import SealError, Sealer, StoreBatchError

__all__ = ["PreviousKeys"]

log = logging.getLogger("kvxfer")


class PreviousKeys:
    """The keys a cache's sealer replaced, asked for the pages the cache misses.

    Args:
      sealer: the cache's sealer; its ``previous`` sealers are the old keys.
      name: the store key of a page under a sealer's key id (``store_key``, bound to
        the cache's namespace and manager).
      stats: the cache's counters (read errors and seals that fail, here).
      where: the store's name, for warnings.
    """

    def __init__(self, sealer: Sealer, name: Callable[[Sealer, int], str], stats: Counters,
                 where: str):
        self.sealer = sealer
        self._name = name
        self._stats = stats
        self._where = where

    def held(self, got: dict[int, Any], errors: dict[int, Any],
             contains_many: Callable[[list[str]], list[bool]]) -> None:
        """Marks held, in ``got`` (a ``contains_many`` per page), the pages missed there
        that a previous key's id holds."""
        for old in self.sealer.previous:
            there = self._ask(contains_many, _missed(got, errors), old)
            got.update((k, True) for k, held in there.items() if held)

    def read(self, got: dict[int, Any], errors: dict[int, Any],
             get_many: Callable[[list[str]], list[bytes | None]]) -> frozenset[int]:
        """Fills in ``got`` (a blob or None per page) the pages missed there that a
        previous key's id holds, each opened with that key and sealed with the current
        one; which pages it filled in.

        A blob that fails its old key's seal stays a miss (counted, left in the store:
        caches still on that key are its judges).
        """
        found = set()
        for old in self.sealer.previous:
            blobs = self._ask(get_many, _missed(got, errors), old)
            for key, blob in blobs.items():
                try:
                    blob = old.open(self._name(old, key), blob)
                except SealError as e:
                    log.warning("page %#x in the %s store under previous key %s: %s; left "
                                "there", key, self._where, old.key_id, e)
                    self._stats.add(store_auth_failures=1)
                    continue
                got[key] = self.sealer.seal(self._name(self.sealer, key), blob)
                found.add(key)
        return frozenset(found)

    def _ask(self, call: Callable[[list[str]], list[Any]], keys: list[int], old: Sealer
             ) -> dict[int, Any]:
        """What ``call`` says of ``keys`` under ``old``'s key id: the pages it found (any
        store failure is a miss of the pages it hit, counted and logged)."""
        if not keys:
            return {}
        try:
            results = call([self._name(old, k) for k in keys])
        except StoreBatchError as e:  # the other keys were answered
            results = e.results
            self._failed(len(e.errors), e)
        except Exception as e:  # whatever the store raised: misses, never the caller's
            results = [None] * len(keys)
            self._failed(len(keys), e)
        return {k: r for k, r in zip(keys, results) if r}

    def _failed(self, n: int, e: Exception) -> None:
        log.warning("the %s store could not be asked for %d pages under a previous key: "
                    "%s: %s", self._where, n, type(e).__name__, e)
        self._stats.add(store_read_errors=n)


def _missed(got: dict[int, Any], errors: dict[int, Any]) -> list[int]:
    """The pages found absent (not those the store could not answer for)."""
    return [k for k, v in got.items() if not v and k not in errors]
