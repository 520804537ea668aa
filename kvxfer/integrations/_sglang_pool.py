"""sglang-jax's HiCache host pool, with every transfer made and verified by kvxfer.

``kvxfer.integrations.sglang_jax`` exports ``KvxferHostKVPool``; this module holds
it. Importing it never imports sglang-jax.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvxfer.engine import TransferError
from kvxfer.hostpool import PageRef, PoolError
from kvxfer.integrations._sglang_engine_names import _BackupCall, _EngineNames, _HostSlots
from kvxfer.integrations._sglang_records import (
    FlushLoadResult,
    _Gather,
    _id,
    _ids,
    _pairs,
    _PendingGather,
    _Stage,
    _Staged,
    _key,
    _unique,
)
from kvxfer.manager import KVCacheManager

__all__ = ["KvxferHostKVPool"]

if TYPE_CHECKING:  # what mgr.prefetch returns; not a name kvxfer.manager exports
    from kvxfer.manager import PrefetchHandle

log = logging.getLogger("kvxfer")


class KvxferHostKVPool(_EngineNames):
    """sglang-jax's ``LRUHostKVPool``, with every transfer made and verified by kvxfer.

    Each host slot holds one device page over every layer; the slot is the page's
    kvxfer slot, and its key binds the host id and the allocation's epoch, so a page
    read back under a reused id fails its identity check. A ``free``/``alloc`` that
    reuses an id while a transfer is in flight never lets the stale transfer publish
    into the new allocation: a stale backup is freed when it lands, a stale staged
    load is not scattered.

    **Integrity misses.** ``flush_load`` waits for the load's verification (the
    engine's own pool also blocks there) and returns a ``FlushLoadResult``; a short
    verified prefix is also logged and handed to ``on_load_miss``. The bad host copies
    are dropped, so the pool never again delivers them. sglang-jax's controller drops
    that result; ``install()`` makes its radix cache load and verify before a request
    is admitted and cut the prefix at the first miss (``load_back_verdict``).

    **Duplicates.** A call naming one host id (or, in a load, one device page) twice
    is refused with ``ValueError`` before anything is staged, flushed or dropped;
    ``free`` deduplicates, as the engine's pool does. Host ids and device pages are
    Python ints or integer arrays (any int dtype, numpy or jax); a float, a bool or an
    array of them is refused with ``TypeError`` naming it and the call, before
    anything changes (``1.9`` or ``True`` is never page 1).

    **Engine-compatible internals.** sglang-jax's own tests read and rewrite some of
    ``LRUHostKVPool``'s private state (``_generation``, ``_pending_gather``,
    ``_pending_load``, ``_pending_lock``, ``_slots``, ``_jit_gather_one_layer``, ...);
    the pool has them all, as its real state with the engine pool's meaning
    (``kvxfer/integrations/_sglang_engine_names.py`` states each one's contract).

    Example:
        >>> import types, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> dev = types.SimpleNamespace(kv_buffer=[jnp.ones((9, 1, 2, 1, 128))] * 2)
        >>> pool = KvxferHostKVPool(dev, 4, 1, 2, (1, 2, 1, 128), jnp.float32, None,
        ...                         P(None, None, None, None, None))
        >>> ids = pool.alloc(2).tolist()
        >>> pool.copy_into([3, 4], ids)
        >>> pool.copy_into([3, 4], [ids[0], ids[0]])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: stage_backup names host page id=0 more than once; ...
        >>> pool.copy_to_device(ids, [7, 8]).ok
        True
        >>> pool.close()

    Args:
      device_pool: the engine's device KV pool; its ``kv_buffer`` is a list of
        ``layer_num`` arrays shaped ``(pages, *per_layer_shape)``.
      pool_size: host page slots.
      page_size: tokens per page.
      layer_num: layers (``len(device_pool.kv_buffer)``).
      per_layer_shape: one page of one layer (``kv_buffer[0].shape[1:]``).
      dtype: the caches' dtype.
      mesh: the engine's mesh (kept for the engine; kvxfer uses the caches' own
        sharding).
      partition_spec: the caches' partition spec (kept likewise).
      pool_name: a name for logs.
      integrity: ``"page"`` (default) digests every page; ``"off"`` skips digests.
      path: kvxfer's mover choice (``KVCacheManager(path=)``).
      host_memory_budget: bytes (``KVCacheManager(host_memory_budget=)``).
      on_load_miss: called with the ``FlushLoadResult`` of every ``flush_load``
        that missed a page, on the thread that called it.

    Raises:
      ValueError: a non-positive ``pool_size``, or a ``layer_num`` other than
        ``len(device_pool.kv_buffer)`` (a ``per_layer_shape`` or ``dtype`` that does
        not match the buffers is logged: the buffers are moved as they are).
      BudgetError: the host pages exceed the budget (nothing allocated).
    """

    def __init__(self, device_pool: Any, pool_size: int, page_size: int, layer_num: int,
                 per_layer_shape: tuple[int, ...], dtype: Any, mesh: Any,
                 partition_spec: Any, *, pool_name: str = "hicache",
                 integrity: str = "page", path: str = "auto",
                 host_memory_budget: int | None = None,
                 on_load_miss: Callable[[FlushLoadResult], None] | None = None) -> None:
        if isinstance(pool_size, bool) or not isinstance(pool_size, (int, np.integer)) \
                or pool_size <= 0:
            raise ValueError(f"pool_size must be a positive int. Got {pool_size!r}")
        self.pool_name = pool_name
        buffers = list(device_pool.kv_buffer)
        if len(buffers) != layer_num:
            raise ValueError(f"{layer_num=} does not match the device pool's "
                             f"{len(buffers)} kv_buffer layers")
        # The engine's own pool moves what kv_buffer holds and callers pass shapes it
        # never checks (its tests pass per_layer_shape=(8,) for (1, 4, 2, 8) pages):
        # the device pool is the truth, a mismatch is only worth a warning.
        for i, a in enumerate(buffers):
            if tuple(a.shape[1:]) != tuple(per_layer_shape) or \
                    np.dtype(a.dtype) != np.dtype(dtype):
                log.warning("hicache pool %s: kv_buffer[%d] pages are %s %s, not the "
                            "per_layer_shape=%s dtype=%s given; moving what kv_buffer "
                            "holds", pool_name, i, np.dtype(a.dtype), tuple(a.shape[1:]),
                            tuple(per_layer_shape), np.dtype(dtype))
                break
        self._device_pool = device_pool
        self._pool_size = int(pool_size)
        self.page_size = page_size
        self.layer_num = layer_num
        self.per_layer_shape = tuple(per_layer_shape)
        self.dtype = dtype
        self.mesh = mesh
        self.partition_spec = partition_spec
        self._on_load_miss = on_load_miss
        self._mgr = KVCacheManager(buffers, num_host_blocks=self._pool_size,
                                   integrity=integrity, path=path,
                                   host_memory_budget=host_memory_budget)
        self._lock = threading.Lock()
        self._free_ids: collections.deque[int] = collections.deque(range(self._pool_size))
        self._allocated = [False] * self._pool_size
        self._generation = [0] * self._pool_size
        self._lock_ref = [0] * self._pool_size
        self._pages: list[PageRef | None] = [None] * self._pool_size
        self._dropped: list[str | None] = [None] * self._pool_size
        # Both keyed by host id, each value (the allocation's epoch, the entry): a
        # flush publishes or scatters an entry only while its epoch is the slot's.
        self._pending_gather: dict[int, tuple[int, _PendingGather]] = {}
        self._pending_load: dict[int, tuple[int, _Staged]] = {}
        # Backups of freed ids still in flight, by slot: a new backup into the slot
        # waits for them (kvxfer refuses two offloads writing one slot).
        self._orphans: dict[int, _Gather] = {}
        # Backups a flush_backup took from _pending_gather and waits on, by slot.
        self._flushing: dict[int, _Gather] = {}
        self._slot_view = _HostSlots(self)
        pools = self._mgr.host_pool.pools
        arrays = [p.array for p in pools]
        # A pool that is not pinned is plain host memory, even where it is held as an
        # XLA:CPU device array (the staged mover's, which its loads read in place).
        self._class_sharding = [a.sharding if a is not None and
                                getattr(a.sharding, "memory_kind", None) == "pinned_host"
                                else None for a in arrays]
        first, _ = self._mgr.plan.class_of_layer(0)
        self._copy_sharding = self._class_sharding[first.index]
        # The stage_backup running on each thread, for the gather point its offload
        # reaches (the manager calls the hook on the caller's thread).
        self._backup_call = threading.local()
        self._mgr.set_transfer_hook(self._transfer_point)

    # -- what the engine reads ---------------------------------------------------

    @property
    def manager(self) -> KVCacheManager:
        """The ``KVCacheManager`` moving the pages (stats, fault injection)."""
        return self._mgr

    @property
    def device_pool(self) -> Any:
        """The engine's device pool."""
        return self._device_pool

    def available_size(self) -> int:
        """Free page slots."""
        with self._lock:
            return len(self._free_ids)

    def total_size(self) -> int:
        """Page slots in the pool, free and in use."""
        return self._pool_size

    def page_of(self, host_id: int) -> PageRef | None:
        """The kvxfer page a host id holds (None: never backed up, or dropped)."""
        host_id = _id(host_id, "host page", "page_of")
        with self._lock:
            self._check_range(host_id)
            return self._pages[host_id]

    def close(self) -> None:
        """Closes the manager (waits for transfers in flight)."""
        self._mgr.close()

    # -- slots ----------------------------------------------------------------------

    def reserve(self) -> int | None:
        """Takes one free slot, or returns None when none is free (no eviction)."""
        ids = self._take(1)
        return None if ids is None else ids[0]

    def alloc(self, need_pages: int) -> np.ndarray | None:
        """Takes ``need_pages`` free slots, all or nothing (None when short).

        Raises:
          ValueError: ``need_pages`` is not positive.
        """
        if need_pages <= 0:
            raise ValueError(f"need_pages must be positive. Got {need_pages!r}")
        ids = self._take(int(need_pages))
        return None if ids is None else np.asarray(ids, dtype=np.int64)

    def release(self, buffer_id: int) -> None:
        """Returns one slot (its host page is freed).

        Raises:
          ValueError: the id is out of range.
          RuntimeError: the slot is free already, or locked.
        """
        self.free([_id(buffer_id, "host page", "release")])

    def free(self, host_page_ids: Sequence[int]) -> None:
        """Returns slots, deduplicated; checks every id before freeing any.

        Raises:
          ValueError: an id is out of range.
          RuntimeError: a slot is free already, or locked (``lock_ref != 0``).
        """
        ids = list(dict.fromkeys(_ids(host_page_ids, "host page", "free")))
        to_free: list[PageRef] = []
        releases: list[PrefetchHandle] = []
        with self._lock:
            for i in ids:
                self._check_range(i)
                if not self._allocated[i]:
                    raise RuntimeError(f"double free of host page id={i}")
                if self._lock_ref[i]:
                    raise RuntimeError(f"free of locked host page id={i} "
                                       f"(lock_ref={self._lock_ref[i]})")
            for i in ids:
                self._discard(i, to_free, releases)
                self._allocated[i] = False
                self._free_ids.append(i)
            orphaned = {id(g): g for i in ids if (g := self._orphans.get(i)) is not None}
        self._settle(to_free, releases)
        # A backup that landed before it was orphaned had its done callback already:
        # reap it here, or its page would stay in the pool for good.
        for group in orphaned.values():
            self._reap(group)

    def inc_lock_ref(self, buffer_id: int) -> None:
        """Locks an allocated slot against ``free``/``release``.

        Raises:
          ValueError: out of range. RuntimeError: not allocated.
        """
        buffer_id = _id(buffer_id, "host page", "inc_lock_ref")
        with self._lock:
            self._require_allocated(buffer_id)
            self._lock_ref[buffer_id] += 1

    def dec_lock_ref(self, buffer_id: int) -> None:
        """Undoes one ``inc_lock_ref``.

        Raises:
          ValueError: out of range. RuntimeError: not allocated, or not locked.
        """
        buffer_id = _id(buffer_id, "host page", "dec_lock_ref")
        with self._lock:
            self._require_allocated(buffer_id)
            if self._lock_ref[buffer_id] <= 0:
                raise RuntimeError(f"dec_lock_ref underflow on host page id={buffer_id}")
            self._lock_ref[buffer_id] -= 1

    # -- device to host -------------------------------------------------------------

    def stage_backup(self, device_indices: Sequence[int], host_buffer_ids: Sequence[int]
                     ) -> None:
        """Starts copying device pages into allocated slots, pairwise.

        Call on the thread that owns the caches: every device program is enqueued
        before it returns (the bytes are those of the call, whatever the caller
        donates next); ``flush_backup`` waits for the host copies.

        A host id freed and handed out again while a backup into it is still in
        flight (staged, or waited on by a ``flush_backup``) waits here for that backup
        to land; the old backup's page is freed, never published into the new owner.

        Raises:
          ValueError: lengths differ, a device page or host id out of range, or a
            host id named twice (refused before anything is staged).
          RuntimeError: a host id is not allocated.
        """
        ids, device_indices = _pairs(host_buffer_ids, device_indices, "stage_backup")
        if not ids:
            return
        _unique(ids, "host page", "stage_backup")
        with self._lock:
            gens = self._epochs(ids)
            waits = {id(g): g for i in ids if (g := self._orphans.get(i)) is not None}
        self._require_device_pages(device_indices)
        for g in waits.values():
            g.handle.exception()
            self._reap(g)
        buffers = list(self._device_pool.kv_buffer)
        keys = [_key(i, g) for i, g in zip(ids, gens)]
        # No lock held: what the gather point runs (a free(), an alloc()) may take it.
        outer = getattr(self._backup_call, "call", None)
        self._backup_call.call = _BackupCall(buffers, device_indices, keys, gens)
        try:
            handle = self._mgr.offload(buffers, device_indices, keys, slots=ids)
        finally:
            self._backup_call.call = outer
        group = _Gather(handle, ids)
        with self._lock:
            for k, (i, gen) in enumerate(zip(ids, gens)):
                if self._allocated[i] and self._generation[i] == gen:
                    self._pending_gather[i] = (gen, _PendingGather(group, k))
                else:
                    group.orphaned.add(i)
                    self._orphans[i] = group
        handle.add_done_callback(lambda _: self._reap(group))

    def flush_backup(self, host_buffer_ids: Sequence[int]) -> None:
        """Waits for the host copies ``stage_backup`` started and publishes them.

        Touches no cache: runs on the engine's D2H worker. An id freed while this
        waits is not published; a backup staged into it again waits for this one.

        Raises:
          ValueError: a host id out of range, or named twice (refused before anything
            is flushed: the staged backups stay staged).
          TypeError: a host id is not an integer (a float, a bool, a float array).
          RuntimeError: a host id has no staged backup (``stage_backup`` first).
          TransferError: the copy failed (the slot holds nothing new).
        """
        ids = _unique(_ids(host_buffer_ids, "host page", "flush_backup"), "host page",
                      "flush_backup")
        if not ids:
            return
        entries = []
        with self._lock:
            for i in ids:
                self._check_range(i)
                if i not in self._pending_gather:
                    raise RuntimeError(f"flush_backup of host page id={i} with no staged "
                                       "backup; stage_backup() must run first")
            for i in ids:
                gen, pending = self._pending_gather.pop(i)
                entries.append((i, gen, pending))
                # Still in flight: a free() meanwhile must make the id's next backup
                # wait for this one (kvxfer refuses two offloads writing one slot).
                self._flushing[i] = pending.group
        try:
            for _, _, pending in entries:
                pending.group.handle.exception()
        finally:
            published = self._publish(entries)
        for group in published:
            self._reap(group)
        for _, _, pending in entries:
            pending.group.handle.result()  # a failed copy raises its TransferError

    def _publish(self, entries: list[tuple[int, int, _PendingGather]]) -> list[_Gather]:
        """Publishes the landed pages of a flush; the groups holding orphans to reap."""
        to_reap: dict[int, _Gather] = {}
        with self._lock:
            for i, gen, pending in entries:
                group = pending.group
                if self._flushing.get(i) is group:
                    del self._flushing[i]
                handle = group.handle
                # The epoch the entry carries decides: the slot's own publishes, any
                # other (the id freed and reused since) leaves the slot as it is.
                if handle.done() and not handle.cancelled() and handle.exception() is None \
                        and self._allocated[i] and self._generation[i] == gen:
                    self._pages[i] = handle.result()[pending.index]
                    self._dropped[i] = None
                    continue
                group.orphaned.add(i)
                to_reap[id(group)] = group
        return list(to_reap.values())

    def copy_into(self, device_indices: Sequence[int], host_buffer_ids: Sequence[int]
                  ) -> None:
        """``stage_backup`` then ``flush_backup`` on one thread."""
        ids, pages = _pairs(host_buffer_ids, device_indices, "copy_into")
        self.stage_backup(pages, ids)
        self.flush_backup(ids)

    def copy_from_device(self, layers: Any, buffer_id: int) -> Any:
        """The disaggregation pool's call; a retaining HiCache pool has none.

        Raises:
          NotImplementedError: always.
        """
        raise NotImplementedError("KvxferHostKVPool retains pages: use copy_into / "
                                  "stage_backup, not copy_from_device")

    # -- host to device -------------------------------------------------------------

    def stage_load(self, host_buffer_ids: Sequence[int]) -> None:
        """Stages slots on the devices for a ``flush_load``, touching no cache.

        Runs on any thread (the engine's H2D worker). A slot whose host copy was
        dropped stages nothing; its ``flush_load`` reports it missed.

        Raises:
          ValueError: a host id out of range, or named twice (refused before
            anything is staged).
          RuntimeError: a host id is not allocated, or holds no page.
          TransferError: staging failed.
        """
        ids = _unique(_ids(host_buffer_ids, "host page", "stage_load"), "host page",
                      "stage_load")
        if not ids:
            return
        with self._lock:
            gens = self._epochs(ids)
            pages = [self._pages[i] for i in ids]
            reasons = [self._dropped[i] for i in ids]
        for i, page, reason in zip(ids, pages, reasons):
            if page is None and reason is None:
                raise RuntimeError(f"stage_load from empty host page id={i}")
        loadable = [p for p in pages if p is not None]
        stage = _Stage(self._mgr.prefetch(loadable) if loadable else None, loadable)
        releases: list[PrefetchHandle] = []
        with self._lock:
            for i, gen, page, reason in zip(ids, gens, pages, reasons):
                if not (self._allocated[i] and self._generation[i] == gen):
                    self._break(stage, releases)  # reused meanwhile: nothing to stage
                    continue
                old = self._pending_load.get(i)
                if old is not None:
                    self._break(old[1].stage, releases)
                self._pending_load[i] = (gen, _Staged(stage, page, reason))
        self._settle([], releases)

    def flush_load(self, host_buffer_ids: Sequence[int], device_indices: Sequence[int]
                   ) -> FlushLoadResult:
        """Scatters staged slots into device pages and waits for their verification.

        Call on the thread that owns the caches, in a donation-safe window: it
        replaces ``device_pool.kv_buffer[layer]`` for every layer. A slot reused
        since its ``stage_load`` is not scattered (its device page is untouched).

        Returns:
          A ``FlushLoadResult``: what was loaded and verified, what was missed and
          why, and which host copies were dropped as bad.

        Raises:
          ValueError: lengths differ, a host id or device page out of range, or a
            host id or device page named twice (refused before anything is flushed:
            the staged loads stay staged).
          RuntimeError: a host id has no staged load (``stage_load`` first).
          TransferError: a device or transfer failure (``kv_buffer`` holds the
            caches to continue with).
        """
        ids, device_indices = _pairs(host_buffer_ids, device_indices, "flush_load")
        if not ids:
            return FlushLoadResult((), (), (), (), {})
        _unique(ids, "host page", "flush_load")
        _unique(device_indices, "device page", "flush_load")
        self._require_device_pages(device_indices)
        reasons: dict[int, str] = {}
        todo: list[tuple[int, int, PageRef]] = []  # (host id, device page, page)
        stages: dict[int, _Stage] = {}
        releases: list[PrefetchHandle] = []
        with self._lock:
            for i in ids:
                self._check_range(i)
                if i not in self._pending_load:
                    raise RuntimeError(f"flush_load of host page id={i} with no staged "
                                       "load; stage_load() must run first")
            for i, d in zip(ids, device_indices):
                gen, entry = self._pending_load.pop(i)
                stages[id(entry.stage)] = entry.stage
                # As in flush_backup, the entry's epoch decides: a stale entry is not
                # scattered and its device page keeps what it holds.
                if not (self._allocated[i] and self._generation[i] == gen):
                    reasons[i] = "stale: the host page id was freed and reused since stage_load"
                elif entry.page is None:
                    reasons[i] = f"dropped before: {entry.reason}"
                else:
                    todo.append((i, d, entry.page))
            pages = [p for _, _, p in todo]
            prefetched = None
            if len(stages) == 1:
                (stage,) = stages.values()
                if stage.handle is not None and stage.pages == pages:
                    prefetched, stage.handle = stage.handle, None
            for stage in stages.values():
                self._break(stage, releases)
        self._settle([], releases)
        loaded: list[int] = []
        dropped: list[int] = []
        if todo:
            result = self._load(pages, [d for _, d, _ in todo], prefetched)
            invalid = set(result.invalid_pages)
            freed = set(result.freed_pages)
            with self._lock:
                for j, (i, _, page) in enumerate(todo):
                    if j not in invalid:
                        loaded.append(i)
                        continue
                    reasons[i] = result.reasons.get(
                        j, f"after page {result.verified_prefix} of the load, which failed")
                    if j in freed and self._pages[i] == page:
                        self._pages[i] = None
                        self._dropped[i] = reasons[i]
                        dropped.append(i)
        outcome = FlushLoadResult(tuple(ids), tuple(loaded),
                                  tuple(i for i in ids if i in reasons), tuple(dropped),
                                  reasons)
        if not outcome.ok:
            log.warning("hicache pool %s: flush_load verified %d of %d pages; missed %s "
                        "(dropped %s): %s", self.pool_name, outcome.verified_pages, len(ids),
                        list(outcome.missed), list(outcome.dropped), reasons)
            if self._on_load_miss is not None:
                self._on_load_miss(outcome)
        return outcome

    def copy_to_device(self, host_buffer_ids: Sequence[int], device_indices: Sequence[int]
                       ) -> FlushLoadResult:
        """``stage_load`` then ``flush_load`` on one thread (duplicates refused first)."""
        ids, pages = _pairs(host_buffer_ids, device_indices, "copy_to_device")
        _unique(pages, "device page", "copy_to_device")
        self.stage_load(ids)
        return self.flush_load(ids, pages)

    def precompile_transfers(self, max_pages: int | None = None) -> None:
        """Compiles every transfer serving can run, without moving a page.

        Up to ``min(pool_size, device pages, max_pages)`` pages per transfer; no slot
        is taken and no device page is written.
        """
        cap = min(self._pool_size, int(self._device_pool.kv_buffer[0].shape[0]))
        if max_pages is not None:
            cap = min(cap, int(max_pages))
        if cap > 0:
            self._mgr.warmup(cap)

    # -- internals ------------------------------------------------------------------

    def _take(self, n: int) -> list[int] | None:
        with self._lock:
            if len(self._free_ids) < n:
                return None
            ids = [self._free_ids.popleft() for _ in range(n)]
            for i in ids:
                self._allocated[i] = True
                self._generation[i] += 1
            return ids

    def _load(self, pages: list[PageRef], devices: list[int],
              prefetched: PrefetchHandle | None) -> Any:
        buffers = self._device_pool.kv_buffer
        try:
            new, handle = self._mgr.load(list(buffers), pages, devices,
                                         keys=[p.key for p in pages], gate="all",
                                         prefetched=prefetched)
        except TransferError as e:
            if e.kv_caches is not None:
                buffers[:] = e.kv_caches
            raise
        for layer, a in enumerate(new):
            buffers[layer] = a
        return handle.result()

    def _discard(self, i: int, to_free: list[PageRef], releases: list[PrefetchHandle]
                 ) -> None:
        # Under the lock: forget everything the allocation held.
        entry = self._pending_gather.pop(i, None)
        group = entry[1].group if entry is not None else self._flushing.pop(i, None)
        if group is not None:  # a backup into the id is still in flight
            group.orphaned.add(i)
            self._orphans[i] = group
        staged = self._pending_load.pop(i, None)
        if staged is not None:
            self._break(staged[1].stage, releases)
        if self._pages[i] is not None:
            to_free.append(self._pages[i])
        self._pages[i] = None
        self._dropped[i] = None

    @staticmethod
    def _break(stage: _Stage, releases: list[PrefetchHandle]) -> None:
        # A staging no longer matching one flush: its pins go, its pages load plainly.
        if stage.handle is not None:
            releases.append(stage.handle)
            stage.handle = None

    def _reap(self, group: _Gather) -> None:
        """Frees the pages of a backup that landed for ids freed meanwhile."""
        if not group.handle.done():
            return
        with self._lock:
            ids = [i for i in group.orphaned if i not in group.reaped]
            group.reaped.update(ids)
            for i in ids:
                if self._orphans.get(i) is group:
                    del self._orphans[i]
        if not ids or group.handle.cancelled() or group.handle.exception() is not None:
            return
        pages = group.handle.result()
        self._settle([pages[group.ids.index(i)] for i in ids], [])

    def _settle(self, to_free: list[PageRef], releases: list[PrefetchHandle]) -> None:
        # Outside the lock: kvxfer calls that may wait on its own locks.
        for h in releases:
            h.release()
        for page in to_free:
            if self._mgr.is_valid(page):
                try:
                    self._mgr.free([page])
                except PoolError:
                    pass  # overwritten meanwhile: the slot's new page is not ours to free

    def _check_range(self, i: int) -> None:
        if not 0 <= i < self._pool_size:
            raise ValueError(f"host page id={i} outside pool range [0, {self._pool_size})")

    def _epochs(self, ids: list[int]) -> list[int]:
        """The allocation epoch of each id (the lock held), once all are allocated.

        Raises:
          ValueError / RuntimeError: an id out of range, or not allocated.
        """
        for i in ids:
            self._require_allocated(i)
        return [self._generation[i] for i in ids]

    def _require_allocated(self, i: int) -> None:
        self._check_range(i)
        if not self._allocated[i]:
            raise RuntimeError(f"host page id={i} is not allocated (in the free list)")

    def _require_device_pages(self, device_indices: Sequence[int]) -> None:
        n = int(self._device_pool.kv_buffer[0].shape[0])
        for d in device_indices:
            if not 0 <= d < n:
                raise ValueError(f"device page id={d} outside range [0, {n})")

    def __repr__(self) -> str:
        return (f"KvxferHostKVPool({self.pool_name!r}, {self.available_size()}/"
                f"{self._pool_size} free, paths={self._mgr.paths})")
