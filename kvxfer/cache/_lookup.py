"""Finding a request's longest cached prefix: host first, then the store, pinned.

The pages past the host hit that are not in host memory are read from the store in one
batch (``get_many``; ``contains_many`` where a lookup only measures), with no cache
lock held, then opened, checked and imported page by page: a page that fails ends the
prefix there, as one read per page would have.

In a multi-process job the ranks agree on the hit length before anything is
pinned (the minimum over ranks, as SGLang's HiCache all-reduces its prefix length),
so every rank loads the same pages or misses alike.

Each call has a ``Deadline``: waits for offloads in flight and store calls get what is
left of it, and a page not there by then is a miss (logged), so a lookup ends by its
deadline whatever the store does. The ranks' agreement waits as long as the
manager's ``agreement_timeout`` says (a rank cannot leave a round alone).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from kvxfer.cache._deadline import Deadline
from kvxfer.cache._host import HostTier
from kvxfer.cache._store_tier import Batch, StoreTier
from kvxfer.hostpool import PageRef
from kvxfer.manager import Agreement, PageFormatError, describe_keys

__all__ = ["Found", "Finder"]

log = logging.getLogger("kvxfer")


class Found(NamedTuple):
    """One page of a prefix found: its key, its host page, the tier it was found in."""

    key: int
    ref: PageRef
    tier: str


class Finder:
    """Pins the longest prefix of a request's keys that the cache holds.

    Args:
      host: the host tier.
      store: the store tier, or None.
      agreement: the cache's agreement with the other ranks.
    """

    def __init__(self, host: HostTier, store: StoreTier | None, agreement: Agreement):
        self.host = host
        self.store = store
        self.agreement = agreement

    def where(self, key: int, deadline: Deadline) -> str | None:
        """``"host"``, ``"store"`` or None: where page ``key`` is (nothing marked used)."""
        self.host.wait_pending(key, deadline)
        if self.host.peek(key) is not None:
            return "host"
        if self.store is not None and self.store.has(key, deadline):
            return "store"
        return None

    def find(self, keys: list[int], deadline: Deadline) -> list[Found]:
        """The pinned prefix of ``keys`` (agreed across ranks in a multi-process job)."""
        if self.agreement.multiprocess:
            return self._together(keys, deadline)
        return self.pin_prefix(keys, deadline)

    def pin_prefix(self, keys: list[int], deadline: Deadline, *, use: bool = True
                   ) -> list[Found]:
        """Pins (promoting from the store) the longest prefix of ``keys`` this rank has.

        A lookup is one use of every page it finds: a host page is marked used (the
        policy's ``touch``, and a hit for ``write_through=N``); a page promoted from
        the store arrives in host memory (its ``insert`` is that use). ``use=False`` (a
        prefetch) marks nothing used. Each page is pinned as it is found, and the
        request's pages already in host memory past the first miss are pinned while
        the store's are promoted, so a promotion never evicts a page of the prefix it
        serves. The policy then hears that the prefix's pages were used together
        (``CachePolicy.used_together``), so that evictions take its tail first.
        """
        found: list[Found] = []
        try:
            for key in keys:
                ref = self._host_page(key, deadline)
                if ref is None:
                    break
                self._take(found, key, ref, "host", use)
            rest = keys[len(found):]
            if rest and self.store is not None:
                held = [k for k in dict.fromkeys(rest) if self.host.holds(k)]
                for key in held:
                    self.host.pin(key)
                try:
                    self._promote(rest, found, use, deadline)
                finally:
                    self.host.unpin(held)
            self.host.used_together([f.key for f in found if use or f.tier == "store"])
        except BaseException:  # whatever a policy or a store raised: nothing stays pinned
            self.host.unpin([f.key for f in found])
            raise
        return found

    def _promote(self, rest: list[int], found: list[Found], use: bool,
                 deadline: Deadline) -> None:
        """Extends ``found`` over ``rest`` (past the host hit): the store pages among
        them read in one batch, then imported in order up to the first miss. A page
        whose store write is still queued is imported from the blob queued."""
        assert self.store is not None
        batch = self.store.read_many(self._not_on_host(rest), deadline)  # lock let go
        for key in rest:
            ref, tier = self._host_page(key, deadline), "host"  # (promoted meanwhile?)
            if ref is None and batch.held and key in batch.held:
                ref, tier = self._from_queue(key, batch), "store"
            elif ref is None:
                ref, tier = self.store.admit(key, batch, self.host), "store"
            if ref is None:
                break
            self._take(found, key, ref, tier, use)

    def _from_queue(self, key: int, batch: Batch) -> PageRef | None:
        """Page ``key`` imported from the blob its queued store write holds, or None (no
        room; ``read_many`` holds none once the cache closed)."""
        assert self.store is not None and batch.held is not None
        try:
            return self.host.admit(key, batch.held[key])
        except PageFormatError as e:  # this cache's own export: its pool changed
            log.warning("page %#x, queued for the %s store, could not be imported: %s",
                        key, self.store.name, e)
            return None

    def _host_page(self, key: int, deadline: Deadline) -> PageRef | None:
        """The host page of ``key`` once an offload of it in flight is indexed (by
        ``deadline``), or None."""
        self.host.wait_pending(key, deadline)
        return self.host.get(key)

    def _not_on_host(self, keys: list[int]) -> list[int]:
        """The keys whose pages are neither in host memory nor on their way there."""
        return [k for k in keys if self.host.peek(k) is None and not self.host.arriving(k)]

    def _take(self, found: list[Found], key: int, ref: PageRef, tier: str,
              use: bool) -> None:
        self.host.pin(key)  # before the policy hears of it: whatever it raises, unpinned
        found.append(Found(key, ref, tier))
        if use and tier == "host":
            self.host.found(key)  # one use, and a hit for write_through=N

    def local_length(self, keys: list[int], deadline: Deadline) -> tuple[int, bool]:
        """How long a prefix this rank holds (nothing pinned or promoted), and whether
        some of it is only in the store: the store asked once, for every page past the
        host hit that is not in host memory."""
        n = 0
        while n < len(keys) and self._host_page(keys[n], deadline) is not None:
            n += 1
        if n == len(keys) or self.store is None:
            return n, False
        rest, in_store = keys[n:], False
        batch = self.store.has_many(self._not_on_host(rest), deadline)  # lock let go
        for key in rest:
            if self._host_page(key, deadline) is not None:
                n += 1
                continue
            if not self.store.holds(key, batch):
                break
            n, in_store = n + 1, True
        return n, in_store

    def _together(self, keys: list[int], deadline: Deadline) -> list[Found]:
        """The ranks agree on the hit length first.

        A promotion can still fail after the agreement (a store read error, no
        room): when any rank's hit reaches into the store, a second round agrees
        on what every rank actually pinned, and the extra pins are dropped.
        """
        agreement = self.agreement
        subject = describe_keys("lookup", keys)
        first = agreement.next_round()
        try:
            n, in_store = self.local_length(keys, deadline)
        except BaseException:
            agreement.agree(first, 0, subject=subject)
            raise
        agreed = agreement.agree(first, n, subject=subject, flag=in_store)
        if not agreed.flagged:
            return self.pin_prefix(keys[:agreed.value], deadline)
        second = agreement.next_round()
        try:
            found = self.pin_prefix(keys[:agreed.value], deadline)
        except BaseException:
            agreement.agree(second, 0, subject=subject)
            raise
        try:
            pinned = agreement.agree(second, len(found), subject=subject).value
        except BaseException:
            self.host.unpin([f.key for f in found])
            raise
        self.host.unpin([f.key for f in found[pinned:]])
        return found[:pinned]
