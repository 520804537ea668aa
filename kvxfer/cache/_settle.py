"""Settling loads: hits counted per tier, pages proven bad dropped from every tier."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import jax

from kvxfer._counters import Counters
from kvxfer.cache._hits import CacheHit, CacheLoad
from kvxfer.cache._host import HostTier
from kvxfer.cache._store_tier import StoreTier
from kvxfer.manager import Blocks, Gate, LoadResult

__all__ = ["Loads", "settle"]

log = logging.getLogger("kvxfer")


class Loads:
    """A cache's loads in flight, each settled once: by its ``result()``, or by the
    cache's next call once it is done."""

    def __init__(self, lock: threading.RLock, host: HostTier, store: StoreTier | None,
                 stats: Counters):
        self._lock = lock
        self._host = host
        self._store = store
        self._stats = stats
        self._loads: list[CacheLoad] = []

    def start(self, kv_caches: Sequence[jax.Array], hit: CacheHit, device_blocks: Blocks,
              gate: Gate) -> tuple[list[jax.Array], CacheLoad]:
        """Loads a pinned hit's pages (the caller holds the lock); the load holds the
        pins from here until it settles."""
        if not hit._pin.held:
            raise ValueError("this hit was released or loaded already; look up again")
        new, handle = self._host.mgr.load(kv_caches, list(hit.pages), device_blocks,
                                          keys=list(hit.keys), gate=gate)
        hit._pin.held = False
        load = CacheLoad(hit, handle, self.settle)
        self._loads.append(load)
        return new, load

    def release(self, hit: CacheHit) -> None:
        """Unpins a hit that will not be loaded (once; the caller holds the lock)."""
        if hit._pin.held:
            hit._pin.held = False
            self._host.unpin(hit.keys)

    def collect(self) -> None:
        """Settles the loads that are done (their callers see errors from ``result()``)."""
        for load in [ld for ld in self._loads if ld.done()]:
            try:
                load.result()
            except Exception:
                pass

    def settle(self, load: CacheLoad, result: LoadResult | None) -> None:
        """Releases a load's pins and, with its result, settles its pages (once)."""
        with self._lock:
            if load not in self._loads:
                return  # settled already
            self._loads.remove(load)
            self._host.unpin(load.hit.keys)
            if result is not None:
                settle(self._host, self._store, self._stats, load.hit, result)


def settle(host: HostTier, store: StoreTier | None, stats: Counters, hit: CacheHit,
           result: LoadResult) -> None:
    """Counts ``hit``'s verified pages as hits of their tier and handles the pages its
    load did not verify (the pins are released by the caller). The lookup that found
    the pages was their use, as the policy counts it: settling marks nothing used."""
    for j in range(result.verified_prefix):
        stats.add(**{f"{hit.tiers[j]}_hits": 1})
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
