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
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax

from kvxfer._check import check_int, check_timeout
from kvxfer.hostpool import PageRef, PoolExhaustedError
from kvxfer.manager import Blocks, Gate, KVCacheManager, LoadHandle, LoadResult
from kvxfer.manager._agree import Agreement, describe_keys
from kvxfer.manager._checks import check_key
from kvxfer.manager._pages import PageFormatError
from kvxfer.manager._stats import Counters
from kvxfer.store import Store, StoreError
from kvxfer.store._seal import SealError, Sealer

__all__ = ["HostCache", "CacheHit", "CacheLoad"]

log = logging.getLogger("kvxfer")

_STATS_WAIT_S = 0.04  # stats() waits this long for the store's counters


@dataclasses.dataclass
class _Pin:
    """Whether a hit still holds its pins (each hit releases them once), and whose."""

    held: bool = True
    owner: Any = None  # the HostCache whose lookup pinned it


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
    """Page keys as the manager takes them: ints in [0, 2**64) (numpy ones too) or bytes."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)) or \
            not hasattr(keys, "__iter__"):
        raise TypeError(f"{where} must be a sequence of keys (ints or bytes). Got {keys!r} "
                        f"of type {type(keys).__name__}")
    return [check_key(k, f"{where}[{j}]") for j, k in enumerate(keys)]


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
      auth_key: secret bytes (at least 16; 32 random bytes is right): every blob
        written to the store carries an HMAC-SHA-256 over the blob and its store
        key, checked before a page is imported. A blob that fails is a miss,
        counted (``store_auth_failures``), logged and deleted from the store. Every
        cache that shares the store's pages needs the same key. None (default):
        blobs as today, trusted as far as the store's writers are.
      encrypt: also encrypt page bytes at rest (AES-256-GCM keyed from
        ``auth_key``; ``pip install 'kvxfer[crypto]'``), for stores shared across
        tenants.

    Thread-safe. Store writes run on one background thread; ``flush()`` waits.

    In a multi-process job (tensor-parallel ranks, each holding its shards of every
    page) the ranks' caches stay identical, and every request gets the same
    verified prefix on every rank, as long as the engine keeps one contract: every
    rank creates its managers and caches in the same order, and calls ``put``,
    ``lookup``, ``load`` and ``release`` for the same requests in the same order,
    then ``close``. Then:

    * ``lookup`` agrees on the hit length across ranks (the minimum, as SGLang's
      HiCache all-reduces its prefix length) before anything is pinned, so every
      rank loads the same pages or misses alike;
    * a load agrees on its verified prefix, and a page proven bad on any rank is
      freed on every rank (each deletes its own store copy, once);
    * a delivery fault (the device got wrong bytes from an intact host copy) is a
      miss for that load only, on every rank; the page stays in host and store;
    * rounds of different requests never pair silently: each carries the keys it
      is about, and mismatched ones raise ``AgreementError`` on every rank;
    * ``close`` waits (up to the manager's ``agreement_timeout``) for every rank.

    A rank that dies is named in a ``TransferError`` by the others' next
    agreement, after ``agreement_timeout``; ``jax.distributed`` itself aborts the
    surviving processes once the dead rank misses its heartbeats (100 s by
    default), and at once if the dead rank is rank 0, which hosts the coordination
    service. Store keys carry the rank, so ranks sharing a store never read each
    other's shards.
    """

    def __init__(self, mgr: KVCacheManager, store: Store | None = None, *,
                 namespace: str = "", write_through: bool = False,
                 auth_key: bytes | None = None, encrypt: bool = False):
        if not isinstance(mgr, KVCacheManager):
            raise TypeError(f"mgr must be a KVCacheManager. Got {type(mgr).__name__}")
        if store is not None and not isinstance(store, Store):
            raise TypeError(f"store must be a kvxfer.store.Store or None. Got "
                            f"{type(store).__name__}")
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str. Got {namespace!r}")
        try:
            namespace.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: no store could hold its keys
            raise ValueError(f"namespace={namespace!r} is not valid UTF-8 text: {e}") \
                from None
        if write_through and store is None:
            raise ValueError("write_through=True needs a store")
        if encrypt and auth_key is None:
            raise ValueError("encrypt=True needs auth_key (the key material)")
        if auth_key is not None and store is None:
            raise ValueError("auth_key seals store blobs; it needs a store")
        self._sealer = None if auth_key is None else Sealer(auth_key, encrypt=encrypt)
        self.mgr = mgr
        self.store = store
        self.namespace = namespace
        self.write_through = write_through
        # Caches are created in the same order on every rank (like managers): the
        # n-th agreement of each process meets the n-th of the others.
        self._agreement = Agreement(timeout=mgr._agreement.timeout)
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
        self._probe: concurrent.futures.ThreadPoolExecutor | None = None
        self._probe_future: concurrent.futures.Future | None = None
        self._probe_lock = threading.Lock()
        self._last_store_stats: dict[str, Any] = {}
        self._stats = Counters(
            ("lookups", "pages_requested", "host_hits", "store_hits", "misses", "unused_pages",
             "pages_put", "duplicates", "dropped", "evictions", "store_pages_written",
             "store_write_errors", "store_read_errors", "bad_pages", "transfer_faults",
             "store_auth_failures"),
            ("bad_pages_by_tier",))
        self._closed = False

    # -- keys and index -------------------------------------------------------------

    def store_key(self, key: Any) -> str:
        """The store key of page ``key``: namespace, geometry fingerprint, page key.

        Pages of a manager with ``integrity="off"`` carry no digests: they get keys of
        their own, so a verifying cache never finds them. In a multi-process job the
        key names the rank too (each rank's page holds that rank's shards).
        """
        key = check_key(key, "key")
        mode = "" if self.mgr.integrity == "page" else "-nodigest"
        if self._sealer is not None:  # sealed pages never meet unsealed readers
            mode += f"-{self._sealer.mode}"
        # Each rank of a multi-process job holds its own shards of a page.
        rank = f"-rank{jax.process_index()}of{jax.process_count()}" \
            if jax.process_count() > 1 else ""
        return f"{self.namespace}{self.mgr.fingerprint}{mode}{rank}:{key:016x}"

    def __len__(self) -> int:
        with self._lock:
            self._collect()
            return len(self._index)

    def __contains__(self, key: Any) -> bool:
        key = check_key(key, "key")
        with self._lock:
            self._collect()
            return key in self._index or key in self._pending

    def keys(self) -> list[int]:
        """The keys of the cache's host pages, least recently used first."""
        with self._lock:
            self._collect()
            return list(self._index)

    def page_of(self, key: Any) -> PageRef | None:
        """The host page cached under ``key`` (not pinned, not marked used), or None."""
        key = check_key(key, "key")
        with self._lock:
            self._collect()
            return self._index.get(key)

    def find(self, key: Any) -> str | None:
        """Where page ``key`` is: ``"host"``, ``"store"`` or None (not marking it used)."""
        key = check_key(key, "key")
        with self._lock:
            self._collect()
            self._wait_pending(key)
            ref = self._index.get(key)
            if ref is not None and self.mgr.is_valid(ref):
                return "host"
            if self.store is not None and self._store_has(key):
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
        skey = self.store_key(key)
        try:
            if self._sealer is not None:
                blob = self._sealer.seal(skey, blob)
            written = self.store.put(skey, blob)
        except (StoreError, ValueError, OSError) as e:
            log.warning("page %#x was not written to the %s store: %s", key,
                        self.store.name, e)
            self._stats.add(store_write_errors=1)
            return False
        self._stored.add(key)
        if written:
            self._stats.add(store_pages_written=1)
        return written

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        """Lets go of the cache lock (however deeply held) around store or network I/O,
        so a stalled store never stalls lookups of host pages, puts or ``stats()``."""
        state = self._lock._release_save()
        try:
            yield
        finally:
            self._lock._acquire_restore(state)

    def _promote(self, key: int) -> tuple[PageRef | None, str]:
        """The store's page ``key`` imported into host memory, or None (a miss); and its
        tier (``"host"`` when another thread brought it into host memory meanwhile)."""
        fut = self._writes.get(key)
        skey = self.store_key(key)
        with self._unlocked():
            if fut is not None:
                fut.result()
            try:
                blob = self.store.get(skey)
            except (StoreError, OSError) as e:
                log.warning("the %s store could not be read for page %#x: %s",
                            self.store.name, key, e)
                self._stats.add(store_read_errors=1)
                blob = None
        ref = self._index.get(key)
        if ref is not None and self.mgr.is_valid(ref):
            return ref, "host"
        if blob is not None and self._sealer is not None:
            try:
                blob = self._sealer.open(skey, blob)
            except SealError as e:
                self._stats.add(store_auth_failures=1)
                self._drop_stored(key, f"{e}; a writer without the key changed it")
                return None, "store"
        if blob is None or self._make_room(1) < 1:
            return None, "store"
        try:
            ref = self.mgr.import_page(blob, key=key)
        except PoolExhaustedError:
            return None, "store"
        except PageFormatError as e:
            self._drop_stored(key, str(e))
            return None, "store"
        held = self.mgr.host_pool.classes_of(ref.slot)
        if len(held) < len(self.mgr.plan.classes):
            # A page of some slice classes only (put there by another writer): a
            # lookup of this cache loads every class, so it could never be used.
            self.mgr.free([ref])
            self._drop_stored(key, f"it holds slice classes {sorted(held)} of "
                              f"{len(self.mgr.plan.classes)}")
            return None, "store"
        self._stored.add(key)
        self._index[key] = ref
        return ref, "store"

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

    def put(self, kv_caches: Sequence[jax.Array], device_blocks: Blocks,
            keys: Sequence[Any], *, wait: bool = False) -> list[int]:
        """Offloads the blocks whose keys are not cached yet; LRU pages make room.

        Args:
          kv_caches: the current caches.
          device_blocks: one block id per key, as ``KVCacheManager.offload`` takes
            them: one list for every slice class, or a mapping ``{class index: ids}``
            naming every class (a cached page holds every class).
          keys: the pages' keys: ints in [0, 2**64) or bytes (hashed as the manager
            hashes them).
          wait: return only once the pages are on host (else they are indexed as
            soon as their offload ends; a lookup meanwhile waits for them).

        Returns:
          The keys being offloaded, as ints (keys cached already, repeated, or that
          found no room after every unpinned page was evicted are left out).
        """
        with self._lock:
            self._check_open()
            self._collect()
            keys = _keys(keys, "keys")
            columns = self._columns(device_blocks, len(keys))
            todo: dict[int, int] = {}  # key -> its index in the call
            for j, key in enumerate(keys):
                ref = self._index.get(key)
                if ref is not None and not self.mgr.is_valid(ref):
                    del self._index[key]  # freed behind the cache's back: put it again
                if key in self._index or key in self._pending or key in todo:
                    self._stats.add(duplicates=1)
                    if key in self._index:
                        self._index.move_to_end(key)
                    continue
                todo[key] = j
            if todo:  # checked before anything is evicted: in range, distinct
                self.mgr._check_blocks(self._pick(columns, todo.values()), len(todo), "keys")
            room = self._make_room(len(todo))
            if room < len(todo):
                self._stats.add(dropped=len(todo) - room)
                todo = dict(list(todo.items())[:room])
            if not todo:
                return []
            handle = self.mgr.offload(kv_caches, self._pick(columns, todo.values()),
                                      list(todo))
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

    def _columns(self, device_blocks: Blocks, n: int) -> list[Any] | dict[int, list[Any]]:
        """``put``'s block ids as one list, or per class (every class named), n each."""
        if not isinstance(device_blocks, Mapping):
            if isinstance(device_blocks, (str, bytes)):
                raise TypeError(f"device_blocks must be a sequence of block ids. Got "
                                f"{type(device_blocks).__name__}")
            blocks = list(device_blocks)
            if len(blocks) != n:
                raise ValueError(f"{len(blocks)} device_blocks for {n} keys")
            return blocks
        classes = len(self.mgr.plan.classes)
        columns = {check_int(c, "device_blocks key (a slice class index)", minimum=0):
                   list(ids) for c, ids in device_blocks.items()}
        if sorted(columns) != list(range(classes)):
            raise ValueError(f"device_blocks names slice classes {sorted(columns)}; a cached "
                             f"page holds every class: name all of 0..{classes - 1}")
        for c, ids in columns.items():
            if len(ids) != n:
                raise ValueError(f"{len(ids)} device_blocks[{c}] for {n} keys")
        return columns

    @staticmethod
    def _pick(columns: list[Any] | dict[int, list[Any]], rows: Any) -> Blocks:
        rows = list(rows)
        if isinstance(columns, dict):
            return {c: [ids[j] for j in rows] for c, ids in columns.items()}
        return [columns[j] for j in rows]

    def lookup(self, keys: Sequence[Any]) -> CacheHit:
        """Pins the longest cached prefix of ``keys`` (host first, then the store).

        Store pages are imported into host memory (promoted) on the way. The pins
        hold until ``load(...).result()`` or ``release(hit)``. In a multi-process job
        every rank must call it for the same keys, in the same order: the ranks
        agree on the hit length (the minimum over ranks) before anything is pinned.

        Raises:
          AgreementError: another rank's lookup in the same turn was for other keys.
          TransferError: another rank did not take part within the manager's
            ``agreement_timeout``.
        """
        with self._lock:
            self._check_open()
            self._collect()
            keys = _keys(keys, "keys")
            if self._agreement.multiprocess:
                found = self._lookup_together(keys)
            else:
                found = self._pin_prefix(keys)
            self._stats.add(lookups=1, pages_requested=len(keys),
                            misses=len(keys) - len(found))
            return CacheHit(tuple(k for k, _, _ in found), tuple(r for _, r, _ in found),
                            tuple(t for _, _, t in found), _Pin(owner=self))

    def _pin_prefix(self, keys: list[int]) -> list[tuple[int, PageRef, str]]:
        """Pins (promoting from the store) the longest prefix of ``keys`` this rank has."""
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
                    ref, tier = self._promote(key)
                if ref is None:
                    break
                self._index.move_to_end(key)
                self._pins[key] += 1
                found.append((key, ref, tier))
        except BaseException:
            self._unpin([k for k, _, _ in found])
            raise
        return found

    def _local_length(self, keys: list[int]) -> tuple[int, bool]:
        """How long a prefix this rank holds (nothing pinned or promoted), and whether
        some of it is only in the store."""
        n, in_store = 0, False
        for key in keys:
            self._wait_pending(key)
            ref = self._index.get(key)
            if ref is not None and self.mgr.is_valid(ref):
                n += 1
                continue
            if ref is not None:
                del self._index[key]  # freed by someone else
            if self.store is None or not self._store_has(key):
                break
            n, in_store = n + 1, True
        return n, in_store

    def _store_has(self, key: int) -> bool:
        if key in self._writes:
            return True
        try:
            with self._unlocked():
                return self.store.contains(self.store_key(key))
        except (StoreError, OSError) as e:
            log.warning("the %s store could not be asked for page %#x: %s",
                        self.store.name, key, e)
            self._stats.add(store_read_errors=1)
            return False

    def _lookup_together(self, keys: list[int]) -> list[tuple[int, PageRef, str]]:
        """``lookup`` in a multi-process job: the ranks agree on the hit length first.

        A promotion can still fail after the agreement (a store read error, no
        room): when any rank's hit reaches into the store, a second round agrees
        on what every rank actually pinned, and the extra pins are dropped.
        """
        agreement = self._agreement
        subject = describe_keys("lookup", keys)
        first = agreement.next_round()
        try:
            n, in_store = self._local_length(keys)
        except BaseException:
            agreement.agree(first, 0, subject=subject)
            raise
        agreed = agreement.agree(first, n, subject=subject, flag=in_store)
        if not agreed.flagged:
            return self._pin_prefix(keys[:agreed.value])
        second = agreement.next_round()
        try:
            found = self._pin_prefix(keys[:agreed.value])
        except BaseException:
            agreement.agree(second, 0, subject=subject)
            raise
        try:
            pinned = agreement.agree(second, len(found), subject=subject).value
        except BaseException:
            self._unpin([k for k, _, _ in found])
            raise
        self._unpin([k for k, _, _ in found[pinned:]])
        return found[:pinned]

    def release(self, hit: CacheHit) -> None:
        """Unpins a hit that will not be loaded (a no-op once released or settled)."""
        self._check_hit(hit)
        with self._lock:
            self._release_hit(hit)

    def _check_hit(self, hit: Any) -> None:
        if not isinstance(hit, CacheHit):
            raise TypeError(f"hit must be a CacheHit from lookup(). Got {type(hit).__name__}")
        if hit._pin.owner is not self and (hit._pin.owner is not None or hit.keys):
            # Its pins are another cache's: taking them here would leave that cache's
            # pages pinned for good.
            raise ValueError("this hit comes from another HostCache's lookup(); release or "
                             "load it through that cache")

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
        self._check_hit(hit)
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
                    # page, refused for its key, delivered wrong from an intact host
                    # copy): cached as before unless gone.
                    self._stats.add(unused_pages=1)
                    if result.reasons.get(j, "").startswith("transfer"):
                        self._stats.add(transfer_faults=1)
                    if not self.mgr.is_valid(ref) and self._index.get(key) == ref:
                        del self._index[key]
                    continue
                # Its host copy failed its own digests (here or on another rank):
                # gone from every tier, on every rank.
                self._stats.add(bad_pages=1)
                self._stats.add_labelled("bad_pages_by_tier",
                                         self.store.name if tier == "store" else "host")
                if self._index.get(key) == ref:
                    del self._index[key]
                where = f"the {self.store.name} store" if tier == "store" else "host memory"
                log.warning("page %#x from %s failed verification on the device (%s), and its "
                            "host copy fails its own digests; dropped", key, where,
                            result.reasons.get(j, "bad"))
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
                if key not in self._writes and not self._store_has(key) and \
                        self._index.get(key) == ref and self.mgr.is_valid(ref):
                    mine.append(self._write(key, ref))
            futures = list(self._writes.values())
        concurrent.futures.wait(futures)
        return sum(1 for f in mine if f is not None and f.result())

    def stats(self) -> dict[str, Any]:
        """Lookups, hits per tier, misses, evictions, store writes, bad pages by tier.

        ``pages_requested`` = ``host_hits + store_hits + misses + unused_pages`` over
        settled loads (``unused_pages``: found but not used, after a bad page,
        refused for their key, or delivered wrong by the transfer while their host
        copy was intact, which ``transfer_faults`` counts apart); ``host_pages`` is
        the cache's pages in host memory, ``pinned_pages`` those pinned by a hit or a
        load; ``store`` holds the store's own counters (when there is a store), read
        on a thread of their own: a store that does not answer within 40 ms gives
        its last counters with ``stale: True``. Takes no lock a transfer or store
        read holds: cheap enough for every scrape, and it never blocks.
        """
        out = self._stats.snapshot()  # the counters' own lock, never the cache's
        out["host_pages"] = len(self._index)
        out["pinned_pages"] = len(self._pins)
        if self.store is not None:
            out["store"] = self._store_stats()
        return out

    def _store_stats(self) -> dict[str, Any]:
        """The store's counters, read on a thread of their own and waited for briefly:
        a stalled store gives its last counters, marked ``stale``, not a stalled scrape."""
        with self._probe_lock:
            if self._probe is None:
                self._probe = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="kvxfer-store-stats")
            fresh = self._probe_future is None or self._probe_future.done()
            if fresh:
                self._probe_future = self._probe.submit(self.store.stats)
            future = self._probe_future
        try:  # a probe still stuck from an earlier call is not waited for again
            self._last_store_stats = future.result(timeout=_STATS_WAIT_S if fresh else 0)
            return dict(self._last_store_stats)
        except concurrent.futures.TimeoutError:
            return dict(self._last_store_stats, stale=True)
        except Exception as e:  # a closed or unreachable store: its counters only
            log.warning("the %s store's counters could not be read: %s",
                        self.store.name, e)
            return {}

    def close(self, timeout: float | None = 30.0) -> None:
        """Indexes offloads in flight and gives queued store writes ``timeout`` seconds
        in all (one deadline, not one per write); writes not done by then are dropped
        (logged). The manager and the store stay open. In a multi-process job it then
        waits (up to the manager's ``agreement_timeout``) for every rank to close its
        cache."""
        if self._closed:
            return
        timeout = check_timeout(timeout, "timeout")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            for handle, _ in list(self._offloads):
                try:
                    handle.wait()
                except Exception:
                    pass
            self._collect()  # write-through pages of those offloads start their writes
            self._closed = True
            writes = list(self._writes.values())
        if self._writer is not None:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            _, late = concurrent.futures.wait(writes, left)
            if late:
                log.warning("%d store writes did not finish within %g s of close(); "
                            "dropped (the pages stay in host memory until the manager "
                            "frees them)", len(late), timeout)
            self._writer.shutdown(wait=not late, cancel_futures=True)
        if self._probe is not None:
            self._probe.shutdown(wait=False, cancel_futures=True)
        self._agreement.meet("close")
