"""The store tier: pages below host memory, written behind and promoted back.

``StoreTier`` names each page's store key, writes pages on one background thread
(write-behind: evicted pages; every page with write-through; pages found often
enough with selective write-through, ``WriteThrough``), reads pages back in batches
(one ``get_many`` or ``contains_many`` per lookup) and imports them into host memory
(promotion), drops store pages that are not whole pages of this cache, and reads the
store's counters without stalling a scrape. No cache lock is held across store I/O:
``unlocked`` lets go of it around every read.

It remembers which pages the store holds as far as this cache knows (it wrote them, or
read them from there), so a page it knows is there is never written again: no store
call at all. A page leaves that memory when this cache deletes it from the store, or
finds it missing there.

Sealed pages are stored under their key's id: caches with other keys miss them (and
never delete them); after a rotation, ``_rekey`` finds the pages sealed with the keys
it replaced, and this tier writes them again under the new key's id. The store is
capped, once, at the largest blob a page of this cache takes
(``Store.cap_blob_bytes``): a larger one is a miss, never read.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import jax

from kvxfer._counters import Counters
from kvxfer.cache._deadline import Calls, Deadline
from kvxfer.cache._events import EventHub
from kvxfer.cache._rekey import PreviousKeys
from kvxfer.hostpool import PageRef
from kvxfer.manager import KVCacheManager, PageFormatError, blob_bytes
from kvxfer.store import SealError, Sealer, Store, StoreBatchError, StoreError

if TYPE_CHECKING:
    from kvxfer.cache._host import HostTier

__all__ = ["StoreTier", "Batch", "WriteThrough", "store_key", "frame_bytes", "unlocked"]

#: When host pages reach the store: ``"always"`` (as soon as they are on host, and
#: again when evicted), ``"never"`` (write-back: when evicted, and by ``flush()``), or
#: a hit count N (once lookups found the page N times; evicted pages with fewer hits
#: are not written).
WriteThrough = Literal["always", "never"] | int

log = logging.getLogger("kvxfer")

_STATS_WAIT_S = 0.04  # stats() waits this long for the store's counters
DELETE_TIMEOUT_S = 10.0  # a bad page's delete, when its caller has no deadline


def store_key(namespace: str, mgr: KVCacheManager, sealer: Sealer | None, key: int) -> str:
    """The store key of page ``key``: namespace, geometry fingerprint, mode (and the
    sealing key's id), rank, key."""
    mode = "" if mgr.integrity == "page" else "-nodigest"
    if sealer is not None:  # sealed pages never meet unsealed readers, nor other keys'
        mode += f"-{sealer.mode}-{sealer.key_id}"
    # Each rank of a multi-process job holds its own shards of a page.
    rank = f"-rank{jax.process_index()}of{jax.process_count()}" \
        if jax.process_count() > 1 else ""
    return f"{namespace}{mgr.fingerprint}{mode}{rank}:{key:016x}"


def frame_bytes(mgr: KVCacheManager, sealer: Sealer | None) -> int:
    """The largest blob a page of ``mgr`` takes in a store: a whole page's blob, sealed
    when ``sealer`` is given (the tier frames nothing else around it)."""
    return blob_bytes(mgr.plan) + (0 if sealer is None else sealer.overhead)


@contextlib.contextmanager
def unlocked(lock: threading.RLock) -> Iterator[None]:
    """Lets go of ``lock`` (however deeply this thread holds it) around store or network
    I/O, so a stalled store never stalls lookups of host pages, puts or ``stats()``."""
    state = lock._release_save()  # type: ignore[attr-defined]
    try:
        yield
    finally:
        lock._acquire_restore(state)  # type: ignore[attr-defined]


class Batch(NamedTuple):
    """What one batched store call said of each page it asked about: ``got`` (a blob or
    None for a read, a bool for ``contains``), ``errors`` (the pages it could not answer
    for, each with its error, a ``TimeoutError`` where the call's deadline passed
    first), ``held`` (pages read from this cache's own write queue instead)."""

    got: dict[int, Any]
    errors: dict[int, OSError]
    #: The pages whose blob in ``got`` was found under a previous key's id, sealed again
    #: with the current key: written under its id once imported.
    rekeyed: frozenset[int] = frozenset()
    #: blobs of writes still queued (this cache's own, not sealed yet), by page
    held: dict[int, bytes] | None = None
    #: the deadline of the call that read it (a bad page's delete waits until then)
    deadline: Deadline | None = None


class StoreTier:
    """A cache's pages in ``store``: write-behind, promotion, bad pages dropped.

    Args:
      mgr: the cache's manager (its pages' export, import and fingerprint).
      store: the store.
      lock: the cache's lock, let go of around store I/O.
      stats: the cache's counters.
      namespace: prefixes every store key.
      write_through: when host pages are written (``WriteThrough``).
      sealer: seals blobs before they are written and opens them after reads, or None.
      events: where the tier's ``stored``/``removed`` events go.
    """

    def __init__(self, mgr: KVCacheManager, store: Store, lock: threading.RLock,
                 stats: Counters, *, namespace: str, write_through: WriteThrough,
                 sealer: Sealer | None, events: EventHub):
        self.mgr = mgr
        self.store = store
        self.namespace = namespace
        self.write_through = write_through
        self._lock = lock
        self._stats = stats
        self._sealer = sealer
        self._events = events
        self._writes: dict[int, concurrent.futures.Future] = {}
        self._held: dict[int, bytes] = {}  # the blobs of the writes in _writes
        self._known: set[int] = set()  # keys this cache knows the store holds
        self._spilled: set[int] = set()  # queued writes of pages gone from host memory
        stats.add(store_writes_skipped=0, store_rekeyed=0)
        store.cap_blob_bytes(frame_bytes(mgr, sealer))
        self._previous = None if sealer is None or not sealer.previous else PreviousKeys(
            sealer, functools.partial(store_key, namespace, mgr), stats, store.name)
        self._writer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvxfer-store")
        self._probe = _StatsProbe(store)
        self._io = Calls("kvxfer-store-io")  # reads, asks, deletes: a caller's deadline
        self._closed = False  # no write starts once the cache closes

    @property
    def name(self) -> str:
        return self.store.name

    def key(self, key: int) -> str:
        return store_key(self.namespace, self.mgr, self._sealer, key)

    # -- write-behind ----------------------------------------------------------------

    def wants(self, hits: int) -> bool:
        """Whether a host page found ``hits`` times may be written (by eviction or
        ``flush``): always, except below the hit count of selective write-through."""
        return not isinstance(self.write_through, int) or hits >= self.write_through

    def arrived(self, key: int, ref: PageRef) -> None:
        """A page just indexed on host: written now under ``"always"``."""
        self._spilled.discard(key)  # (in host memory again)
        if self.write_through == "always":
            self.write(key, ref)

    def hit(self, key: int, ref: PageRef, hits: int) -> None:
        """A lookup found host page ``key``, its ``hits``-th time: under a hit count N,
        the N-th hit writes it (unless the store is known to hold it)."""
        if hits == self.write_through and key not in self._known and \
                key not in self._writes:
            self.write(key, ref)

    def spill(self, key: int, ref: PageRef, hits: int) -> None:
        """A page being evicted from host, found ``hits`` times: written back unless a
        write is queued or selective write-through leaves it out (counted).

        Not written when this cache knows the store holds it (it wrote it, or promoted
        it from there): a store that evicted it behind the cache's back is not asked
        again (``flush`` asks).
        """
        if not self.wants(hits):
            self._stats.add(store_writes_gated=1)
        elif key not in self._writes:
            self.write(key, ref)
        if key in self._writes:  # the page is freed next: that write is its only copy
            self._spilled.add(key)

    def write(self, key: int, ref: PageRef) -> concurrent.futures.Future | None:
        """Exports a page now and stores it on the writer thread; no store call for a
        page this cache knows the store holds."""
        if self._closed:
            return None
        if key in self._known:
            self._stats.add(store_writes_skipped=1)
            return None
        try:
            blob = self.mgr.export_page(ref)
        except Exception as e:
            log.warning("page %#x could not be exported for the %s store: %s",
                        key, self.name, e)
            self._stats.add(store_write_errors=1)
            return None
        future = self._writes[key] = self._writer.submit(self._put, key, blob)
        self._held[key] = blob  # a lookup of the page meanwhile reads it from here
        return future

    def _put(self, key: int, blob: bytes, rekeyed: bool = False) -> bool:
        """Stores one blob (writer thread; ``rekeyed``: sealed already); whether it was
        written. Whatever the store raises is a write error, counted and logged."""
        skey = self.key(key)
        try:
            if self._sealer is not None and not rekeyed:
                blob = self._sealer.seal(skey, blob)
            written = self.store.put(skey, blob)
        except Exception as e:
            log.warning("page %#x was not written to the %s store: %s: %s", key,
                        self.name, type(e).__name__, e)
            self._stats.add(store_write_errors=1)
            return False
        self._known.add(key)
        if written:
            self._stats.add(store_pages_written=1, store_bytes_written=len(blob),
                            store_rekeyed=int(rekeyed))
            self._events.emit("stored", key, "store")
        return written

    def writing(self, key: int) -> bool:
        return key in self._writes

    def prune(self) -> None:
        """Forgets finished writes."""
        for key in [k for k, f in self._writes.items() if f.done()]:
            del self._writes[key]
            self._spilled.discard(key)
            self._held.pop(key, None)

    def pending(self) -> dict[int, concurrent.futures.Future]:
        return dict(self._writes)

    # -- reads and promotion -------------------------------------------------------

    def has(self, key: int, deadline: Deadline | None = None) -> bool:
        """Whether the store holds page ``key`` (or a write of it is queued)."""
        if key in self._writes:
            return True
        try:
            with unlocked(self._lock):
                there = self._io(lambda: self.store.contains(self.key(key)), deadline)
        except (StoreError, OSError) as e:
            log.warning("the %s store could not be asked for page %#x: %s",
                        self.name, key, e)
            self._stats.add(store_read_errors=1)
            return False
        if not there:
            self._known.discard(key)
        return there

    def has_many(self, keys: list[int], deadline: Deadline | None = None) -> Batch:
        """Whether the store holds each of ``keys`` (a queued write of it counts), asked
        in one ``contains_many`` with no cache lock held, until ``deadline``."""
        ask = [k for k in dict.fromkeys(keys) if k not in self._writes]
        with unlocked(self._lock):
            batch = self._batch(self.store.contains_many, ask, deadline)
            if self._previous is not None:  # a rotation: what old keys' ids hold
                self._previous.held(batch.got, batch.errors,
                                    self._io.bound(self.store.contains_many, deadline))
        batch.got.update((k, True) for k in keys if k not in batch.got)
        return batch

    def holds(self, key: int, batch: Batch) -> bool:
        """Whether ``has_many``'s ``batch`` says the store holds ``key``; a page it could
        not answer for is counted and logged (not held)."""
        if self._failed(key, batch, "asked"):
            return False
        there = bool(batch.got.get(key))
        if not there and key in batch.got:
            self._known.discard(key)
        return there

    def read_many(self, keys: list[int], deadline: Deadline | None = None) -> Batch:
        """The stored blobs of ``keys`` in one ``get_many`` (no lock held, by ``deadline``):
        a lookup's whole promotion is one read; a page whose write is queued is ``held``."""
        keys = list(dict.fromkeys(keys))
        held = {k: self._held[k] for k in keys if k in self._writes and k in self._held}
        with unlocked(self._lock):
            batch = self._batch(self.store.get_many, [k for k in keys if k not in held],
                                deadline)
            if self._previous is not None:  # a rotation: what old keys' ids hold
                batch = batch._replace(rekeyed=self._previous.read(
                    batch.got, batch.errors, self._io.bound(self.store.get_many, deadline)))
        return batch._replace(held={} if self._closed else held, deadline=deadline)

    def _batch(self, call: Callable[[list[str]], list[Any]], keys: list[int],
               deadline: Deadline | None) -> Batch:
        """One batched store call over ``keys``' store keys; what it said of each page."""
        if not keys:
            return Batch({}, {})
        errors: dict[int, OSError] = {}
        try:
            results = self._io(lambda: call([self.key(k) for k in keys]), deadline)
        except StoreBatchError as e:  # the other keys were answered
            results = e.results
            errors = {keys[i]: err for i, err in e.errors.items()}
        except (StoreError, OSError) as e:
            results, errors = [None] * len(keys), dict.fromkeys(keys, e)
        return Batch(dict(zip(keys, results)), errors)

    def _failed(self, key: int, batch: Batch, what: str) -> bool:
        """Whether ``batch`` has no answer for ``key`` because of a store error (counted
        and logged: the one page a lookup stops at, as one read of it would have)."""
        error = batch.errors.get(key)
        if error is None:
            return False
        log.warning("the %s store could not be %s for page %#x: %s", self.name, what,
                    key, error)
        self._stats.add(store_read_errors=1)
        return True

    def admit(self, key: int, batch: Batch, host: HostTier) -> PageRef | None:
        """Page ``key`` of ``read_many``'s ``batch`` imported into host memory, or None:
        not read, not stored, unreadable, failing its seal or not a whole page of this
        cache (those two are dropped from the store), no room, or the cache closed.

        Opening the seal and importing are per page: one bad blob is a miss of its page
        alone (the caller's prefix ends there).
        """
        if self._closed or key not in batch.got or self._failed(key, batch, "read"):
            return None
        blob = batch.got[key]
        if blob is None:
            self._known.discard(key)  # evicted from the store, or never there
            return None
        if self._sealer is not None:
            try:
                blob = self._sealer.open(self.key(key), blob)
            except SealError as e:
                self._stats.add(store_auth_failures=1)
                self.drop(key, f"{e}; a writer without the key changed it",
                          batch.deadline)
                return None
        try:
            ref = host.admit(key, blob)
        except PageFormatError as e:
            self.drop(key, str(e), batch.deadline)
            return None
        if ref is not None and key in batch.rekeyed:  # written under the new key's id
            self._writes[key] = self._writer.submit(self._put, key, batch.got[key], True)
        elif ref is not None:
            self._known.add(key)
        return ref

    # -- bad pages -----------------------------------------------------------------

    def drop(self, key: int, why: str, deadline: Deadline | None = None) -> None:
        """A store page that is not a whole page of this cache: a miss, deleted."""
        log.warning("page %#x in the %s store is bad (%s); dropped from the store", key,
                    self.name, why)
        self._stats.add(bad_pages=1)
        self._stats.add_labelled("bad_pages_by_tier", self.name)
        self.delete(key, deadline)

    def forget(self, key: int, tier: str) -> None:
        """A page proven bad: deleted from the store if it came from there or this cache
        wrote it."""
        if tier == "store" or key in self._known:
            self.delete(key)

    def delete(self, key: int, deadline: Deadline | None = None) -> None:
        self._known.discard(key)
        skey, deadline = self.key(key), deadline or Deadline(DELETE_TIMEOUT_S)
        try:
            with unlocked(self._lock):
                deleted = self._io(lambda: self.store.delete(skey), deadline)
            if deleted:
                self._events.emit("removed", key, "store")
        except Exception as e:  # a store's own exception never reaches the caller
            log.warning("page %#x could not be deleted from the %s store: %s", key,
                        self.name, e)

    # -- counters and close --------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return self._probe.read()

    def stop_writes(self) -> list[concurrent.futures.Future]:
        """No write starts from now on; the writes queued (for ``close``)."""
        self._closed = True
        return list(self._writes.values())

    def close(self, writes: list[concurrent.futures.Future], timeout: float | None,
              deadline: float | None) -> None:
        """Gives ``writes`` until ``deadline`` (None: forever); drops the late ones."""
        late: set[concurrent.futures.Future] = set(writes)
        try:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            _, late = concurrent.futures.wait(writes, left)
            self._stats.add(store_writes_dropped=len(late))
            if late:
                log.warning("%d store writes did not finish within %g s of close(); "
                            "dropped: %s", len(late), timeout,
                            _dropped(late, self._writes, self._spilled))
        finally:  # the threads stop, whatever the wait raised
            self._writer.shutdown(wait=not late, cancel_futures=True)
            self._io.close()
            self._held.clear()
            self._probe.close()


def _dropped(late: set[concurrent.futures.Future],
             writes: dict[int, concurrent.futures.Future], spilled: set[int]) -> str:
    """What dropping the ``late`` of ``writes`` costs, page by page: the ``spilled`` pages
    are in no tier but that write (close's warning)."""
    keys = [k for k, f in list(writes.items()) if f in late]
    lost = [k for k in keys if k in spilled]
    kept = [k for k in keys if k not in spilled]
    said = []
    if lost:
        said.append("lost from every tier (freed from host memory when evicted; "
                    f"recomputed when asked for again): {_pages(lost)}")
    if kept:
        said.append(f"kept in host memory until the manager frees them: {_pages(kept)}")
    return "; ".join(said) or f"{len(late)} writes of pages this cache no longer tracks"


def _pages(keys: list[int]) -> str:
    shown = ", ".join(f"{k:#x}" for k in keys[:8])
    return f"page{'s' if len(keys) > 1 else ''} {shown}" + \
        (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


class _StatsProbe:
    """A store's counters, read on a thread of their own and waited for briefly: a
    stalled store gives its last counters, marked ``stale``, not a stalled scrape."""

    def __init__(self, store: Store):
        self._store = store
        self._closed = False
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._future: concurrent.futures.Future | None = None
        self._last: dict[str, Any] = {}

    def read(self) -> dict[str, Any]:
        with self._lock:
            if self._closed:  # the cache is closed: its last reading, not a new one
                return dict(self._last, stale=True)
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="kvxfer-store-stats")
            fresh = self._future is None or self._future.done()
            if fresh:
                self._future = self._pool.submit(self._store.stats)
            future = self._future
        try:  # a probe still stuck from an earlier call is not waited for again
            self._last = future.result(timeout=_STATS_WAIT_S if fresh else 0)
            return dict(self._last)
        except concurrent.futures.TimeoutError:
            return dict(self._last, stale=True)
        except Exception as e:  # a closed or unreachable store: its counters only
            log.warning("the %s store's counters could not be read: %s", self._store.name, e)
            return {}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
