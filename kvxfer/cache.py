"""``HostCache``: a prefix cache over a manager's host pool, with an optional store tier.

Pages are named by chained keys (a page's key names its whole prefix, e.g.
``kvxfer.demo.page_keys``). The cache keeps one host page per key in LRU order,
finds the longest cached prefix of a request, pins what a load reads so eviction
never takes it, and drops pages a load proves bad. Below host memory an optional
``kvxfer.store.Store`` (local disk, Redis) receives evicted pages (or every page,
``write_through=True``) as blobs carrying the digests made on the device at the
first offload; a page promoted back goes store -> host -> device and is checked on
the device against those digests. Store keys carry the manager's geometry
fingerprint, so two models or two dtypes never share a page.

Example:
    >>> import jax.numpy as jnp, kvxfer
    >>> caches = [jnp.ones((8, 4, 128), jnp.float32) * i for i in range(2)]
    >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    >>> cache = kvxfer.HostCache(mgr)
    >>> cache.put(caches, [0, 1], keys=[11, 12], wait=True)
    [11, 12]
    >>> cache.put(caches, [2, 1], keys=[13, 12])  # 12 is cached; 11, least recent, goes
    [13]
    >>> hit = cache.lookup([12, 13, 14])
    >>> hit.num_pages, hit.tiers
    (2, ('host', 'host'))
    >>> caches, load = cache.load(caches, hit, [5, 6])
    >>> load.result().verified_prefix
    2
    >>> cache.lookup([11]).num_pages, cache.stats()["evictions"]
    (0, 1)
    >>> cache.close(); mgr.close()
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from kvxfer._check import check_int
from kvxfer.hostpool import PageRef, PoolExhaustedError
from kvxfer.manager import Gate, KVCacheManager, LoadHandle, LoadResult
from kvxfer.manager._pages import PageFormatError
from kvxfer.manager._stats import Counters
from kvxfer.store import Store, StoreError

__all__ = ["HostCache", "CacheHit", "CacheLoad"]

log = logging.getLogger("kvxfer")


@dataclasses.dataclass
class _Pin:
    """Whether a hit still holds its pins (each hit releases them once)."""

    held: bool = True


@dataclasses.dataclass(frozen=True)
class CacheHit:
    """The longest cached prefix of a request, pinned until loaded or released.

    Attributes:
      keys: the keys of the prefix, in request order.
      pages: their host pages (promoted from the store where ``tiers[j]`` is
        ``"store"``).
      tiers: where each page was found: ``"host"`` or ``"store"``.
    """

    keys: tuple[int, ...]
    pages: tuple[PageRef, ...]
    tiers: tuple[str, ...]
    _pin: _Pin = dataclasses.field(default_factory=_Pin, compare=False, repr=False)

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class CacheLoad:
    """A load of a ``CacheHit`` in flight (see ``LoadHandle``).

    ``result()`` settles the cache once: verified pages become most recently used,
    pages proven bad leave the index (and the store, if it holds them), and the
    pins are released. A load that ends unread is settled by the cache's next call.
    """

    def __init__(self, cache: HostCache, hit: CacheHit, handle: LoadHandle):
        self.hit = hit
        self.handle = handle
        self._cache = cache
        self._settled = False

    def layer_ready(self, layer: int, timeout: float | None = None) -> int:
        """See ``LoadHandle.layer_ready``."""
        return self.handle.layer_ready(layer, timeout)

    def done(self) -> bool:
        return self.handle.done()

    def result(self, timeout: float | None = None) -> LoadResult:
        """The load's result, once every layer is verified (see ``LoadHandle.result``)."""
        try:
            result = self.handle.result(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self._cache._settle(self, None)
            raise
        self._cache._settle(self, result)
        return result


def _keys(keys: Sequence[Any], where: str) -> list[int]:
    out = []
    for j, k in enumerate(keys):
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < 1 << 64:
            raise ValueError(f"{where}[{j}] = {k!r}: keys are ints in [0, 2**64)")
        out.append(int(k))
    return out


class HostCache:
    """A prefix cache of KV pages in a manager's host pool, over an optional store.

    Args:
      mgr: the manager whose host pool holds the pages; the cache's capacity is the
        pool's (pages the caller holds outside the cache are never evicted by it).
      store: a tier below host memory (``kvxfer.store.DiskStore``, ``RedisStore``),
        or None.
      namespace: prefixes every store key (e.g. a model name): two caches share
        store pages only with equal namespaces and equal ``mgr.fingerprint``.
      write_through: write every page to the store once it is on host (default:
        only pages evicted from host, write-back).

    Thread-safe. Store writes run on one background thread; ``flush()`` waits.
    """

    def __init__(self, mgr: KVCacheManager, store: Store | None = None, *,
                 namespace: str = "", write_through: bool = False):
        if not isinstance(mgr, KVCacheManager):
            raise TypeError(f"mgr must be a KVCacheManager. Got {type(mgr).__name__}")
        if store is not None and not isinstance(store, Store):
            raise TypeError(f"store must be a kvxfer.store.Store or None. Got "
                            f"{type(store).__name__}")
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str. Got {namespace!r}")
        if write_through and store is None:
            raise ValueError("write_through=True needs a store")
        self.mgr = mgr
        self.store = store
        self.namespace = namespace
        self.write_through = write_through
        self._lock = threading.RLock()
        self._index: collections.OrderedDict[int, PageRef] = collections.OrderedDict()
        self._pins: collections.Counter[int] = collections.Counter()
        self._pending: dict[int, Any] = {}  # key -> OffloadHandle of its page
        self._offloads: list[tuple[Any, list[int]]] = []
        self._loads: list[CacheLoad] = []
        self._writes: dict[int, concurrent.futures.Future] = {}
        self._stored: set[int] = set()  # keys this cache knows the store holds
        self._writer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvxfer-store") if store is not None else None
        self._stats = Counters(
            ("lookups", "pages_requested", "host_hits", "store_hits", "misses", "unused_pages",
             "pages_put", "duplicates", "dropped", "evictions", "store_pages_written",
             "store_write_errors", "store_read_errors", "bad_pages"),
            ("bad_pages_by_tier",))
        self._closed = False

    # -- keys and index -------------------------------------------------------------

    def store_key(self, key: int) -> str:
        """The store key of page ``key``: namespace, geometry fingerprint, page key.

        Pages of a manager with ``integrity="off"`` carry no digests: they get keys of
        their own, so a verifying cache never finds them.
        """
        mode = "" if self.mgr.integrity == "page" else "-nodigest"
        return f"{self.namespace}{self.mgr.fingerprint}{mode}:{key:016x}"

    def __len__(self) -> int:
        with self._lock:
            self._collect()
            return len(self._index)

    def __contains__(self, key: int) -> bool:
        with self._lock:
            self._collect()
            return key in self._index or key in self._pending

    def keys(self) -> list[int]:
        """The keys of the cache's host pages, least recently used first."""
        with self._lock:
            self._collect()
            return list(self._index)

    def page_of(self, key: int) -> PageRef | None:
        """The host page cached under ``key`` (not pinned, not marked used), or None."""
        with self._lock:
            self._collect()
            return self._index.get(key)

    def find(self, key: int) -> str | None:
        """Where page ``key`` is: ``"host"``, ``"store"`` or None (not marking it used)."""
        with self._lock:
            self._collect()
            self._wait_pending(key)
            ref = self._index.get(key)
            if ref is not None and self.mgr.is_valid(ref):
                return "host"
            if self.store is not None and (key in self._writes or
                                           self.store.contains(self.store_key(key))):
                return "store"
            return None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the HostCache is closed; create a new one")

    def _collect(self) -> None:
        """Indexes finished offloads and settles finished loads (caller's thread)."""
        still = []
        for handle, keys in self._offloads:
            if not handle.done():
                still.append((handle, keys))
                continue
            for key in keys:
                self._pending.pop(key, None)
            try:
                refs = handle.wait()
            except Exception as e:  # the manager freed the slots; nothing to index
                log.warning("offload of %d cache pages failed: %s", len(keys), e)
                continue
            for key, ref in zip(keys, refs):
                self._index[key] = ref
                self._index.move_to_end(key)
                if self.write_through:
                    self._write(key, ref)
        self._offloads = still
        for load in [ld for ld in self._loads if ld.done()]:
            try:
                load.result()
            except Exception:
                pass  # settled; the caller sees the error from its own result()
        for key in [k for k, f in self._writes.items() if f.done()]:
            del self._writes[key]

    def _wait_pending(self, key: int) -> None:
        handle = self._pending.get(key)
        if handle is not None:
            try:
                handle.wait()
            except Exception:
                pass
            self._collect()

    # -- eviction and the store ----------------------------------------------------

    def _evict_one(self) -> bool:
        """Evicts the least recently used unpinned page (spilling it); False if none."""
        key = next((k for k in self._index if not self._pins[k]), None)
        if key is None:
            return False
        ref = self._index.pop(key)
        if self.mgr.is_valid(ref):
            # Written back even if this cache wrote it before: the store may have
            # evicted it since (the put is put-if-absent).
            if self.store is not None and key not in self._writes:
                self._write(key, ref)
            self.mgr.free([ref])
        self._stats.add(evictions=1)
        return True

    def _make_room(self, n: int) -> int:
        """Evicts until ``n`` host slots are free (or nothing more can go)."""
        while self.mgr.num_free_pages < n and self._evict_one():
            pass
        return min(n, self.mgr.num_free_pages)

    def make_room(self, n: int) -> int:
        """Evicts least recently used unpinned pages until ``n`` host slots are free.

        Returns:
          How many of the ``n`` pages fit now (fewer when the rest is pinned or held
          outside the cache): a caller that must choose which pages to ``put`` picks
          that many.
        """
        with self._lock:
            self._check_open()
            self._collect()
            return self._make_room(check_int(n, "n", minimum=0))

    def _write(self, key: int, ref: PageRef) -> concurrent.futures.Future | None:
        """Exports a page now and stores it on the writer thread."""
        if self._closed:
            return None
        try:
            blob = self.mgr.export_page(ref)
        except Exception as e:
            log.warning("page %#x could not be exported for the %s store: %s",
                        key, self.store.name, e)
            self._stats.add(store_write_errors=1)
            return None
        future = self._writes[key] = self._writer.submit(self._store_put, key, blob)
        return future

    def _store_put(self, key: int, blob: bytes) -> bool:
        """Stores one blob (writer thread); whether it was written (not there before)."""
        try:
            written = self.store.put(self.store_key(key), blob)
        except (StoreError, ValueError, OSError) as e:
            log.warning("page %#x was not written to the %s store: %s", key,
                        self.store.name, e)
            self._stats.add(store_write_errors=1)
            return False
        self._stored.add(key)
        if written:
            self._stats.add(store_pages_written=1)
        return written

    def _promote(self, key: int) -> PageRef | None:
        """The store's page ``key`` imported into host memory, or None (a miss)."""
        fut = self._writes.get(key)
        if fut is not None:
            fut.result()
        skey = self.store_key(key)
        try:
            blob = self.store.get(skey)
        except (StoreError, OSError) as e:
            log.warning("the %s store could not be read for page %#x: %s",
                        self.store.name, key, e)
            self._stats.add(store_read_errors=1)
            return None
        if blob is None:
            return None
        if self._make_room(1) < 1:
            return None
        try:
            ref = self.mgr.import_page(blob, key=key)
        except PoolExhaustedError:
            return None
        except PageFormatError as e:
            self._drop_stored(key, str(e))
            return None
        held = self.mgr.host_pool.classes_of(ref.slot)
        if len(held) < len(self.mgr.plan.classes):
            # A page of some slice classes only (put there by another writer): a
            # lookup of this cache loads every class, so it could never be used.
            self.mgr.free([ref])
            self._drop_stored(key, f"it holds slice classes {sorted(held)} of "
                              f"{len(self.mgr.plan.classes)}")
            return None
        self._stored.add(key)
        return ref

    def _drop_stored(self, key: int, why: str) -> None:
        """A store page that is not a whole page of this cache: a miss, deleted."""
        log.warning("page %#x in the %s store is bad (%s); dropped from the store", key,
                    self.store.name, why)
        self._stats.add(bad_pages=1)
        self._stats.add_labelled("bad_pages_by_tier", self.store.name)
        self._stored.discard(key)
        try:
            self.store.delete(self.store_key(key))
        except (StoreError, OSError) as e:
            log.warning("page %#x could not be deleted from the %s store: %s", key,
                        self.store.name, e)

    # -- the engine's calls --------------------------------------------------------

    def put(self, kv_caches: Sequence[jax.Array], device_blocks: Sequence[int],
            keys: Sequence[int], *, wait: bool = False) -> list[int]:
        """Offloads the blocks whose keys are not cached yet; LRU pages make room.

        Args:
          kv_caches: the current caches.
          device_blocks: one block id per key (one list for every slice class).
          keys: the pages' keys.
          wait: return only once the pages are on host (else they are indexed as
            soon as their offload ends; a lookup meanwhile waits for them).

        Returns:
          The keys being offloaded (keys cached already, repeated, or that found no
          room after every unpinned page was evicted are left out).
        """
        with self._lock:
            self._check_open()
            self._collect()
            keys = _keys(keys, "keys")
            if isinstance(device_blocks, Mapping):
                raise TypeError("HostCache.put takes one list of device block ids (a "
                                "cached page holds every slice class), not a mapping")
            blocks = list(device_blocks)
            if len(blocks) != len(keys):
                raise ValueError(f"{len(blocks)} device_blocks for {len(keys)} keys")
            todo: dict[int, int] = {}
            for key, block in zip(keys, blocks):
                ref = self._index.get(key)
                if ref is not None and not self.mgr.is_valid(ref):
                    del self._index[key]  # freed behind the cache's back: put it again
                if key in self._index or key in self._pending or key in todo:
                    self._stats.add(duplicates=1)
                    if key in self._index:
                        self._index.move_to_end(key)
                    continue
                todo[key] = block
            if todo:  # checked before anything is evicted: in range, distinct
                self.mgr._check_blocks(list(todo.values()), len(todo), "keys")
            room = self._make_room(len(todo))
            if room < len(todo):
                self._stats.add(dropped=len(todo) - room)
                todo = dict(list(todo.items())[:room])
            if not todo:
                return []
            handle = self.mgr.offload(kv_caches, list(todo.values()), list(todo))
            new = list(todo)
            for key in new:
                self._pending[key] = handle
            self._offloads.append((handle, new))
            self._stats.add(pages_put=len(new))
        if wait:
            try:
                handle.wait()
            finally:
                with self._lock:
                    self._collect()
        return new

    def lookup(self, keys: Sequence[int]) -> CacheHit:
        """Pins the longest cached prefix of ``keys`` (host first, then the store).

        Store pages are imported into host memory (promoted) on the way. The pins
        hold until ``load(...).result()`` or ``release(hit)``.
        """
        with self._lock:
            self._check_open()
            self._collect()
            keys = _keys(keys, "keys")
            found: list[tuple[int, PageRef, str]] = []
            try:
                for key in keys:
                    self._wait_pending(key)
                    ref = self._index.get(key)
                    tier = "host"
                    if ref is not None and not self.mgr.is_valid(ref):
                        del self._index[key]  # freed by someone else
                        ref = None
                    if ref is None and self.store is not None:
                        ref, tier = self._promote(key), "store"
                        if ref is not None:
                            self._index[key] = ref
                    if ref is None:
                        break
                    self._index.move_to_end(key)
                    self._pins[key] += 1
                    found.append((key, ref, tier))
            except BaseException:
                self._unpin([k for k, _, _ in found])
                raise
            self._stats.add(lookups=1, pages_requested=len(keys),
                            misses=len(keys) - len(found))
            return CacheHit(tuple(k for k, _, _ in found), tuple(r for _, r, _ in found),
                            tuple(t for _, _, t in found))

    def release(self, hit: CacheHit) -> None:
        """Unpins a hit that will not be loaded (a no-op once released or settled)."""
        if not isinstance(hit, CacheHit):
            raise TypeError(f"hit must be a CacheHit from lookup(). Got {type(hit).__name__}")
        with self._lock:
            self._release_hit(hit)

    def _release_hit(self, hit: CacheHit) -> None:
        if hit._pin.held:
            hit._pin.held = False
            self._unpin(hit.keys)

    def _unpin(self, keys: Sequence[int]) -> None:
        for key in keys:
            self._pins[key] -= 1
            if self._pins[key] <= 0:
                del self._pins[key]

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
        if not isinstance(hit, CacheHit):
            raise TypeError(f"hit must be a CacheHit from lookup(). Got {type(hit).__name__}")
        with self._lock:
            self._check_open()
            if not hit._pin.held:
                raise ValueError("this hit was released or loaded already; look up again")
            new, handle = self.mgr.load(kv_caches, list(hit.pages), device_blocks,
                                        keys=list(hit.keys), gate=gate)
            hit._pin.held = False  # the load holds the pins now, until it settles
            load = CacheLoad(self, hit, handle)
            self._loads.append(load)
            return new, load

    def _settle(self, load: CacheLoad, result: LoadResult | None) -> None:
        with self._lock:
            if load._settled:
                return
            load._settled = True
            if load in self._loads:
                self._loads.remove(load)
            hit = load.hit
            self._unpin(hit.keys)
            if result is None:
                return
            for j in range(result.verified_prefix):
                self._stats.add(**{f"{hit.tiers[j]}_hits": 1})
                if hit.keys[j] in self._index:
                    self._index.move_to_end(hit.keys[j])
            for j in result.invalid_pages:
                key, ref, tier = hit.keys[j], hit.pages[j], hit.tiers[j]
                if j not in result.freed_pages:
                    # Not used by this request but not proven bad (after the first bad
                    # page, or refused for its key): cached as before unless gone.
                    self._stats.add(unused_pages=1)
                    if not self.mgr.is_valid(ref) and self._index.get(key) == ref:
                        del self._index[key]
                    continue
                # Its own device digest proved it bad: gone from every tier.
                self._stats.add(bad_pages=1)
                self._stats.add_labelled("bad_pages_by_tier",
                                         self.store.name if tier == "store" else "host")
                if self._index.get(key) == ref:
                    del self._index[key]
                where = f"the {self.store.name} store" if tier == "store" else "host memory"
                log.warning("page %#x from %s failed verification on the device "
                            "(%s); dropped", key, where, result.reasons.get(j, "bad"))
                if self.store is not None and (tier == "store" or key in self._stored):
                    self._stored.discard(key)
                    try:
                        self.store.delete(self.store_key(key))
                    except (StoreError, OSError) as e:
                        log.warning("page %#x could not be deleted from the %s store: %s",
                                    key, self.store.name, e)

    def flush(self) -> int:
        """Writes every host page the store lacks, and waits for all store writes.

        Returns:
          The pages this call wrote (spills already in flight are waited for, not
          counted).
        """
        if self.store is None:
            return 0
        with self._lock:
            self._check_open()
            for handle, _ in list(self._offloads):
                try:
                    handle.wait()
                except Exception:
                    pass
            self._collect()
            mine = []
            for key, ref in list(self._index.items()):
                if key not in self._writes and not self.store.contains(self.store_key(key)):
                    mine.append(self._write(key, ref))
            futures = list(self._writes.values())
        concurrent.futures.wait(futures)
        return sum(1 for f in mine if f is not None and f.result())

    def stats(self) -> dict[str, Any]:
        """Lookups, hits per tier, misses, evictions, store writes, bad pages by tier.

        ``pages_requested`` = ``host_hits + store_hits + misses + unused_pages`` over
        settled loads (``unused_pages``: found but not used, after a bad page or
        refused for their key); ``host_pages`` is the cache's pages in host memory,
        ``pinned_pages`` those pinned by a hit or a load; ``store`` holds the store's
        own counters (when there is a store). Reads counters only: cheap enough for
        every scrape, and it never blocks on a transfer.
        """
        with self._lock:
            out = self._stats.snapshot()
            out["host_pages"] = len(self._index)
            out["pinned_pages"] = len(self._pins)
        if self.store is not None:
            try:
                out["store"] = self.store.stats()
            except Exception as e:  # a closed or unreachable store: its counters only
                out["store"] = {}
                log.warning("the %s store's counters could not be read: %s",
                            self.store.name, e)
        return out

    def close(self) -> None:
        """Indexes offloads in flight, waits for store writes; the manager and the
        store stay open."""
        if self._closed:
            return
        with self._lock:
            for handle, _ in list(self._offloads):
                try:
                    handle.wait()
                except Exception:
                    pass
            self._collect()  # write-through pages of those offloads start their writes
            self._closed = True
        if self._writer is not None:
            self._writer.shutdown(wait=True)
