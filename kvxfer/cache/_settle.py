"""Settling a load: hits counted per tier, pages proven bad dropped from every tier."""

from __future__ import annotations

import logging

from kvxfer._counters import Counters
from kvxfer.cache._hits import CacheHit
from kvxfer.cache._host import HostTier
from kvxfer.cache._store_tier import StoreTier
from kvxfer.manager import LoadResult

__all__ = ["settle"]

log = logging.getLogger("kvxfer")


def settle(host: HostTier, store: StoreTier | None, stats: Counters, hit: CacheHit,
           result: LoadResult) -> None:
    """Counts ``hit``'s verified pages as hits of their tier (marking them used) and
    handles the pages its load did not verify (the pins are released by the caller)."""
    for j in range(result.verified_prefix):
        stats.add(**{f"{hit.tiers[j]}_hits": 1})
        host.touch(hit.keys[j])
    for j in result.invalid_pages:
        key, ref = hit.keys[j], hit.pages[j]
        if j in result.freed_pages:
            _drop_bad(host, store, stats, hit, j, result.reasons.get(j, "bad"))
            continue
        # Not used by this request but not proven bad (after the first bad page,
        # refused for its key, delivered wrong from an intact host copy): cached as
        # before unless gone.
        stats.add(unused_pages=1)
        if result.reasons.get(j, "").startswith("transfer"):
            stats.add(transfer_faults=1)
        if not host.mgr.is_valid(ref):
            host.discard(key, ref)


def _drop_bad(host: HostTier, store: StoreTier | None, stats: Counters, hit: CacheHit,
              j: int, reason: str) -> None:
    """Page ``j``'s host copy failed its own digests (here or on another rank): gone
    from every tier, on every rank."""
    key, ref, tier = hit.keys[j], hit.pages[j], hit.tiers[j]
    stats.add(bad_pages=1)
    from_store = tier == "store" and store is not None
    stats.add_labelled("bad_pages_by_tier", store.name if from_store else "host")
    host.discard(key, ref)
    where = f"the {store.name} store" if from_store else "host memory"
    log.warning("page %#x from %s failed verification on the device (%s), and its "
                "host copy fails its own digests; dropped", key, where, reason)
    if store is not None:
        store.forget(key, tier)
