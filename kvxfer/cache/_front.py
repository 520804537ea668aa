"""``HostCache``: the cache's face, one short method per call, over its tiers."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from kvxfer._check import check_int
from kvxfer._counters import Counters
from kvxfer.cache._blocks import columns, describe_pages, page_keys
from kvxfer.cache._deadline import FLUSH_TIMEOUT_S, LOOKUP_TIMEOUT_S, Deadline
from kvxfer.cache._ending import Ending
from kvxfer.cache._events import CacheEvent, EventHub, Subscription
from kvxfer.cache._hits import CacheHit, CacheLoad, Pin, check_hit
from kvxfer.cache._host import HostTier
from kvxfer.cache._lookup import Finder
from kvxfer.cache._options import check_options, check_write_through, make_policy
from kvxfer.cache._policy import CachePolicy, PolicyName
from kvxfer.cache._prefetch import Prefetcher
from kvxfer.cache._settle import Loads
from kvxfer.cache._store_tier import StoreTier, WriteThrough, store_key
from kvxfer.cache._views import IndexViews
from kvxfer.manager import Agreement, Blocks, Gate, KVCacheManager, check_key
from kvxfer.store import Sealer, Store

__all__ = ["HostCache"]


_COUNTERS = ("lookups", "pages_requested", "host_hits", "store_hits", "misses",
             "unused_pages", "pages_put", "duplicates", "dropped", "evictions",
             "store_pages_written", "store_bytes_written", "store_writes_gated",
             "store_write_errors", "store_read_errors", "bad_pages", "transfer_faults",
             "store_auth_failures", "events_dropped", "store_writes_dropped")


class HostCache(IndexViews, Ending):
    """A prefix cache of KV pages in a manager's host pool, over an optional store.

    Args:
      mgr: the manager whose host pool holds the pages; the cache's capacity is the
        pool's (pages the caller holds outside the cache are never evicted by it).
      store: a tier below host memory (``kvxfer.store.DiskStore``, ...), or None.
      namespace: prefixes every store key: two caches share store pages only with
        equal namespaces and equal ``mgr.fingerprint``. The fingerprint covers the
        KV's geometry only, and a store outlives the process, so with a store the
        namespace must name everything else that changes the KV's bytes: the model
        and its revision (a fine-tune has the same geometry), the weights' dtype and
        quantization, the tokenizer (page keys hash token ids), and any other
        setting that changes what the model computes (a RoPE scaling, a LoRA
        adapter). With a store, a missing or empty namespace is refused, unless
        ``allow_empty_namespace=True`` (every model of this geometry shares pages).
      policy: which host pages eviction takes: ``"lru"`` (least recently used,
        the default), ``"s3fifo"`` (scan-resistant: one-off pages leave first),
        ``"arc"`` (adapts between recency and frequency), or a ``CachePolicy`` of
        the caller's (one per cache). It orders the host tier only.
      write_through: when host pages reach the store: ``"never"`` (the default:
        write-back: when evicted from host, by ``flush()`` and by ``close()``),
        ``"always"`` (once on host, again when evicted if the store lost it), or N
        (selective write-through: once lookups found it N times; a page evicted
        with fewer hits is not written, so one-off prefixes cost no store
        bandwidth). ``True``/``False`` mean ``"always"``/``"never"``.
      auth_key: secret bytes (at least 16; 32 random bytes is right): every store
        blob carries an HMAC-SHA-256 over it and its store key, checked before a
        page is imported; a blob that fails is a miss, counted
        (``store_auth_failures``), logged and deleted. Caches sharing the store's
        pages need the same key. None (default): blobs trusted as far as the
        store's writers are. A ``kvxfer.store.Sealer`` instead rotates keys:
        ``Sealer(new, previous_keys=[old])`` reads pages sealed with ``old`` and
        writes them again under ``new`` (``store_rekeyed`` counts them).
      encrypt: also encrypt page bytes at rest (AES-256-GCM keyed from
        ``auth_key``; ``pip install 'kvxfer[crypto]'``), for stores shared across
        tenants.
      allow_empty_namespace: with a store, take a missing or empty ``namespace``
        (pages shared by every cache of the same geometry, whatever its weights).
      write_back_on_close: ``close()`` writes the host pages the store lacks (True).

    Thread-safe. Store writes run on one background thread (``flush()`` waits),
    prefetches on another. ``subscribe(callback)`` reports where pages arrive and leave.

    Every call that can block takes ``timeout`` (seconds; None waits as long as it
    takes), one deadline for the whole call: ``lookup``, ``find`` and ``prefetch``
    (default 10 s) count a page the store does not hand over by then as a miss
    (logged, counted in ``store_read_errors``); ``put(wait=True)`` and ``flush``
    (30 s) raise ``TimeoutError`` naming the pages not done; ``close`` (30 s) drops
    what is not done by then (logged), and ends in bounded time from any thread,
    an event callback included.

    In a multi-process job the ranks' caches stay identical and every request gets
    the same verified prefix on every rank, as long as every rank creates its
    managers and caches, and calls ``put``, ``lookup``, ``load`` and ``release``,
    in the same order (``kvxfer.cache`` says what the ranks agree on). Store keys
    carry the rank, so ranks sharing a store never read each other's shards.
    """

    def __init__(self, mgr: KVCacheManager, store: Store | None = None, *,
                 namespace: str | None = None, policy: PolicyName | CachePolicy = "lru",
                 write_through: WriteThrough | bool = "never",
                 auth_key: bytes | Sealer | None = None, encrypt: bool = False,
                 allow_empty_namespace: bool = False, write_back_on_close: bool = True):
        sealer = check_options(mgr, store, namespace, write_through, auth_key, encrypt,
                               allow_empty_namespace, write_back_on_close)
        self._write_back_on_close = write_back_on_close
        namespace = namespace or ""
        self.policy = make_policy(policy, mgr.plan.num_host_blocks)
        self.mgr = mgr
        self.store = store
        self.namespace = namespace
        self.write_through = check_write_through(write_through)
        self._sealer = sealer
        # Caches are created in the same order on every rank (like managers): the
        # n-th agreement of each process meets the n-th of the others.
        self._agreement = Agreement(timeout=mgr.agreement_timeout)
        self._lock = threading.RLock()
        self._stats = Counters(_COUNTERS, ("bad_pages_by_tier",))
        self._events = EventHub(self._stats)
        self._store = None if store is None else StoreTier(
            mgr, store, self._lock, self._stats, namespace=namespace,
            write_through=self.write_through, sealer=sealer, events=self._events)
        self._host = HostTier(mgr, self._stats, self._store, self.policy, self._events)
        self._finder = Finder(self._host, self._store, self._agreement)
        self._prefetch = Prefetcher(self._lock, self._finder, self._host, self._stats)
        self._loads = Loads(self._lock, self._host, self._store, self._stats)
        self._closed = False
        self._closing = threading.Lock()  # held by the one close() that closes

    # -- keys and index -------------------------------------------------------------

    def store_key(self, key: Any) -> str:
        """The store key of page ``key``: namespace, geometry fingerprint, page key.

        Pages of a manager with ``integrity="off"`` carry no digests: they get keys of
        their own, so a verifying cache never finds them. In a multi-process job the
        key names the rank too (each rank's page holds that rank's shards).
        """
        return store_key(self.namespace, self.mgr, self._sealer, check_key(key, "key"))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the HostCache is closed; create a new one")

    def _collect(self) -> None:
        """Indexes finished offloads and settles finished loads (caller's thread)."""
        self._host.collect()
        self._loads.collect()
        if self._store is not None:
            self._store.prune()

    def make_room(self, n: int) -> int:
        """Evicts unpinned pages (as the policy picks) until ``n`` host slots are free.

        Returns:
          How many of the ``n`` pages fit now (fewer when the rest is pinned or held
          outside the cache): a caller that must choose which pages to ``put`` picks
          that many.
        """
        with self._lock:
            self._check_open()
            self._collect()
            return self._host.make_room(check_int(n, "n", minimum=0))

    # -- the engine's calls --------------------------------------------------------

    def put(self, kv_caches: Sequence[jax.Array], device_blocks: Blocks,
            keys: Sequence[Any], *, wait: bool = False,
            timeout: float | None = FLUSH_TIMEOUT_S) -> list[int]:
        """Offloads the blocks whose keys are not cached yet; evictions make room.

        ``keys`` are a prefix's pages in order. The room comes from evicting unpinned
        pages of other prefixes, as the policy picks; the pages of ``keys`` already
        cached are never evicted for it. When the pool cannot hold every new page
        (the rest is pinned, or one put brings more pages than the pool has), the first
        new pages are kept and the rest are not cached (left out of the result,
        counted in ``stats()["dropped"]``): a page is of use only after the pages
        before it, so the start of a prefix is what a cache keeps.

        Args:
          kv_caches: the current caches.
          device_blocks: one block id per key, as ``KVCacheManager.offload`` takes
            them: one list for every slice class, or a mapping ``{class index: ids}``
            naming every class (a cached page holds every class).
          keys: the pages' keys: ints in [0, 2**64) or bytes (hashed as the manager
            hashes them).
          wait: return only once the pages are on host (else they are indexed as
            soon as their offload ends; a lookup meanwhile waits for them).
          timeout: with ``wait``, seconds to wait for the offload (None: as long as it
            takes).

        Returns:
          The keys being offloaded, as ints (keys cached already, repeated, or that
          found no room after every unpinned page was evicted are left out).

        Raises:
          TimeoutError: with ``wait``, the offload was not done within ``timeout``
            (it goes on; its pages are indexed when it ends).
        """
        deadline = Deadline(timeout)
        with self._lock:
            self._check_open()
            self._collect()
            keys = page_keys(keys, "keys")
            cols = columns(device_blocks, len(keys), len(self.mgr.plan.classes))
            new, handle = self._host.offload(kv_caches, cols, keys)
        if wait and handle is not None:
            try:
                handle.wait(deadline.left)
            except TimeoutError:
                raise TimeoutError(f"put() gave up after {deadline} waiting for the "
                                   f"offload of {describe_pages(new)}; its "
                                   "pages are indexed when it ends") from None
            finally:
                with self._lock:
                    self._collect()
        return new

    def lookup(self, keys: Sequence[Any], *,
               timeout: float | None = LOOKUP_TIMEOUT_S) -> CacheHit:
        """Pins the longest cached prefix of ``keys`` (host first, then the store).

        Store pages are imported into host memory (promoted) on the way, read in one
        ``get_many`` (no lock held) and checked page by page: the first missing or bad
        one ends the prefix; a page whose store write is still queued is imported from
        the blob queued (no store call). Pages a ``prefetch`` is promoting are waited
        for. ``timeout`` bounds it all: a page not on host or read from the store by
        then ends the prefix there (a miss, logged). The pins
        hold until ``load(...).result()`` or ``release(hit)``; the lookup is one use
        of each page it pins, as the policy counts uses. In a multi-process job
        every rank must call it for the same keys, in the same order: the ranks
        agree on the hit length (the minimum over ranks) before anything is pinned.

        Raises:
          AgreementError: another rank's lookup in the same turn was for other keys.
          TransferError: another rank did not take part within the manager's
            ``agreement_timeout`` (the ranks' agreement is not cut short by
            ``timeout``).
        """
        deadline = Deadline(timeout)
        with self._lock:
            self._check_open()
            self._collect()
            keys = page_keys(keys, "keys")
            self._prefetch.wait_for(keys, deadline)
            self._check_open()
            found = self._finder.find(keys, deadline)
            if self._closed:  # closed while the store was read (lock let go of)
                self._host.unpin([f.key for f in found])
                self._check_open()
            self._stats.add(lookups=1, pages_requested=len(keys),
                            misses=len(keys) - len(found))
            return CacheHit(tuple(f.key for f in found), tuple(f.ref for f in found),
                            tuple(f.tier for f in found), Pin(owner=self))

    def prefetch(self, keys: Sequence[Any], *,
                 timeout: float | None = LOOKUP_TIMEOUT_S) -> concurrent.futures.Future:
        """Starts promoting the store pages of the longest cached prefix of ``keys`` into
        host memory in the background, so that a later ``lookup(keys)`` finds them there
        (see Prefetch in ``kvxfer.cache``: an example, lookups meanwhile, errors, close,
        several ranks).

        Args:
          keys: the request's page keys.
          timeout: seconds from this call after which the prefetch reads no more:
            pages not read by then are not promoted (logged), and its future is done
            by then (or when the prefetch running before it gives up, if later).

        Returns:
          A ``concurrent.futures.Future`` of how long a prefix of ``keys`` it left in
          host memory (pages it promoted and pages already there).
        """
        deadline = Deadline(timeout)
        with self._lock:
            self._check_open()
            return self._prefetch.start(page_keys(keys, "keys"), deadline)

    def release(self, hit: CacheHit) -> None:
        """Unpins a hit that will not be loaded (a no-op once released or settled)."""
        check_hit(hit, self)
        with self._lock:
            self._loads.release(hit)

    def load(self, kv_caches: Sequence[jax.Array], hit: CacheHit,
             device_blocks: Sequence[int] | Mapping[int, Sequence[int]], *,
             gate: Gate = "all") -> tuple[list[jax.Array], CacheLoad]:
        """Loads a hit's pages into ``device_blocks`` (see ``KVCacheManager.load``).

        ``device_blocks``: one id per page, one list for every slice class or
        ``{class index: ids}``, as ``KVCacheManager.load`` takes them.

        Returns:
          ``(new caches, CacheLoad)``; its ``result()`` gives the verified prefix and
          releases the hit's pins.

        Raises:
          What ``KVCacheManager.load`` raises; the hit then stays pinned (load it
          again or ``release`` it).
        """
        check_hit(hit, self)
        with self._lock:
            self._check_open()
            return self._loads.start(kv_caches, hit, device_blocks, gate)

    def subscribe(self, callback: Callable[[list[CacheEvent]], object]) -> Subscription:
        """Calls ``callback`` with batches of ``CacheEvent``s (``kind``: ``"stored"``,
        ``"evicted"`` or ``"removed"``; ``key``; ``tier``: ``"host"`` or ``"store"``)
        from now on, in order, on a thread of the cache's own, never under its lock;
        a callback's exception is logged (see ``kvxfer.cache``'s ``_events``).

        Returns:
          The subscription: ``unsubscribe()`` ends it, ``wait(timeout)`` waits until
          every event so far was delivered.
        """
        return self._events.subscribe(callback)

    def stats(self) -> dict[str, Any]:
        """Lookups, hits per tier, misses, evictions, store writes, bad pages by tier.

        ``store_pages_written`` and ``store_bytes_written`` count the blobs the store
        took (sealed bytes when sealing); ``store_writes_gated`` the evicted pages
        selective write-through kept out of the store; ``events_dropped`` the events
        subscribers were too slow for. ``pages_requested`` = ``host_hits + store_hits + misses + unused_pages`` over
        settled loads (``unused_pages``: found but not used, after a bad page,
        refused for their key, or delivered wrong by the transfer while their host
        copy was intact, which ``transfer_faults`` counts apart); ``host_pages`` is
        the cache's pages in host memory, ``pinned_pages`` those pinned by a hit or a
        load; ``store`` holds the store's own counters (when there is a store), read
        on a thread of their own: a store that does not answer within 40 ms (or a
        closed cache) gives its last counters with ``stale: True``. Takes no lock a
        transfer or store read holds: cheap enough for every scrape, and it never
        blocks.
        """
        out = self._stats.snapshot()  # the counters' own lock, never the cache's
        out["host_pages"] = len(self._host)
        out["pinned_pages"] = self._host.num_pinned
        if self._store is not None:
            out["store"] = self._store.stats()
        return out
