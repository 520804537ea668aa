"""sglang-jax HiCache: a host KV pool whose transfers kvxfer makes and verifies.

``KvxferHostKVPool`` is a drop-in for sglang-jax's ``LRUHostKVPool``
(``sgl_jax.srt.mem_cache.host_kv_pool``): the same constructor arguments and the
same calls (``alloc``/``free``, ``reserve``/``release``, ``inc_lock_ref``/
``dec_lock_ref``, ``stage_backup``/``flush_backup``, ``stage_load``/``flush_load``,
``copy_into``/``copy_to_device``, ``precompile_transfers``, ``available_size``/
``total_size``), with the same page-id boundary: every int crossing it is a page id,
device page ids are global over the data-parallel page axis. Underneath, a
``kvxfer.KVCacheManager`` over the device pool's ``kv_buffer`` moves the pages with
integrity on by default: the engine's host page ids are kvxfer slots
(``offload(..., slots=ids)``), ``stage_load`` stages with ``mgr.prefetch`` (no cache
touched, any thread) and ``flush_load`` runs ``mgr.load(..., prefetched=)`` on the
thread that owns the caches and waits for its verification.

Checked against sglang-jax commit cddbf6f1cc33cbdd453bd8f36ff7051cf46ca176
(2026-08-21). sglang-jax is never imported: the pool reads only the device pool's
``kv_buffer`` (a list of per-layer arrays, page axis first, reassigned element by
element as the engine's own pool does) and, in ``precompile_transfers``, its
``size`` and the page size.

Example:
    >>> import types, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from kvxfer.integrations.sglang_jax import KvxferHostKVPool
    >>> dev = types.SimpleNamespace(kv_buffer=[jnp.ones((9, 1, 2, 1, 128))] * 2)
    >>> pool = KvxferHostKVPool(dev, 4, 1, 2, (1, 2, 1, 128), jnp.float32, None,
    ...                         P(None, None, None, None, None))
    >>> ids = [int(i) for i in pool.alloc(2)]
    >>> pool.copy_into([1, 2], ids)
    >>> pool.copy_to_device(ids, [5, 6]).verified_pages
    2
    >>> pool.close()
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import operator
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvxfer.engine import PageBatch, TransferError, bucket
from kvxfer.hostpool import PageRef, PoolError
from kvxfer.manager import KVCacheManager, OffloadHandle

if TYPE_CHECKING:  # what mgr.prefetch returns; not a name kvxfer.manager exports
    from kvxfer.manager import PrefetchHandle

__all__ = ["KvxferHostKVPool", "FlushLoadResult", "ENGINE_COMMIT"]

ENGINE_COMMIT = "cddbf6f1cc33cbdd453bd8f36ff7051cf46ca176"
"""The sglang-jax commit this integration was checked against (2026-08-21)."""

log = logging.getLogger("kvxfer")


@dataclasses.dataclass(frozen=True, slots=True)
class FlushLoadResult:
    """What one ``flush_load`` (or ``copy_to_device``) delivered, by host page id.

    Attributes:
      host_ids: the host page ids of the call, in call order.
      loaded: the host ids whose pages are now in their device pages, verified.
      missed: the host ids not delivered, in call order: a page whose digest failed,
        every page the load did not verify after it, a slot reused since its
        ``stage_load`` (stale), or a slot whose host copy was proven bad before.
        Their device pages hold unverified bytes: the engine must recompute them.
      dropped: the host ids whose host copy failed its own digests: kvxfer freed the
        copy, the id stays allocated to the engine (``free`` it), and every later load
        of it is a miss. A page whose delivery failed over an intact host copy is
        missed but not dropped.
      reasons: host id -> why it was missed.
    """

    host_ids: tuple[int, ...]
    loaded: tuple[int, ...]
    missed: tuple[int, ...]
    dropped: tuple[int, ...]
    reasons: dict[int, str]

    @property
    def verified_pages(self) -> int:
        """Leading host ids of the call that were loaded (the verified prefix)."""
        missed = set(self.missed)
        n = 0
        while n < len(self.host_ids) and self.host_ids[n] not in missed:
            n += 1
        return n

    @property
    def ok(self) -> bool:
        """Every page of the call was loaded and verified."""
        return not self.missed


@dataclasses.dataclass(eq=False)
class _Gather:
    """One ``stage_backup``: its offload, its host ids, and ids freed meanwhile."""

    handle: OffloadHandle
    ids: list[int]
    orphaned: set[int] = dataclasses.field(default_factory=set)
    reaped: set[int] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(eq=False)
class _Stage:
    """One ``stage_load``: its prefetch (None once released) and its pages."""

    handle: PrefetchHandle | None
    pages: list[PageRef]


@dataclasses.dataclass(frozen=True, slots=True)
class _PendingGather:
    """A host id's part of a ``stage_backup``: the backup and the id's place in it."""

    group: _Gather
    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Staged:
    """A host id staged for ``flush_load``: its page, or why it has none."""

    stage: _Stage
    page: PageRef | None
    reason: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class _HostCopy:
    """What a host id's slot holds: its committed kvxfer page, and where it lives.

    Attributes:
      page: the page (``KvxferHostKVPool.page_of``).
      sharding: the sharding of the host pool array holding the page
        (``SingleDeviceSharding(..., memory_kind="pinned_host")`` for a pinned pool),
        or None for a pool in plain host memory (``path="staged"`` on CPU).
    """

    page: PageRef
    sharding: Any


class _HostSlots(Sequence):
    """A read-only view of the pool's slots: id -> ``_HostCopy``, or None when empty."""

    def __init__(self, pool: KvxferHostKVPool):
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.total_size()

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        j = operator.index(i)
        if not -n <= j < n:
            raise IndexError(f"host page id={i} outside pool range [0, {n})")
        page = self._pool.page_of(j % n)
        return None if page is None else _HostCopy(page, self._pool._copy_sharding)

    def __repr__(self) -> str:
        return f"_HostSlots({list(self)!r})"


@dataclasses.dataclass(frozen=True, slots=True)
class _BackupCall:
    """The ``stage_backup`` whose offload runs on this thread (for the gather point)."""

    buffers: list[Any]
    device_indices: list[int]
    keys: list[int]
    generations: list[int]



def _pairs(host_buffer_ids: Any, device_indices: Any) -> tuple[list[int], list[int]]:
    """Host ids and device pages as ints, checked to pair up one to one."""
    ids = [int(i) for i in host_buffer_ids]
    pages = [int(d) for d in device_indices]
    if len(ids) != len(pages):
        raise ValueError(f"host_buffer_ids ({len(ids)}) and device_indices ({len(pages)}) "
                         "differ in length")
    return ids, pages

class KvxferHostKVPool:
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
    are dropped, so the pool never again delivers them. sglang-jax at the checked
    commit drops the result: ``HiCacheController.flush_load`` does not return what
    the pool returns, and ``UnifiedRadixCache.finish_load_back`` runs after the
    request was admitted with the loaded prefix. For the unverified radix nodes to
    become a miss the engine needs, in ``finish_load_back``::

        result = self.host_pool.flush_load(host_pages, global_pages)  # not the controller's
        if not result.ok: <tombstone the plan's nodes from the first missed page on
                           (device value dropped; host_value dropped for result.dropped)
                           and restart the request from the verified prefix>

    which is more than a one-line change; the pool does not patch the engine.
    ``on_load_miss`` lets ``init_hicache`` wire that handler without touching the
    controller.

    **Engine-compatible internals.** sglang-jax's own tests read and rewrite some of
    ``LRUHostKVPool``'s private state; these names are the pool's real state, with the
    engine pool's meaning:

    * ``_generation[i]``: the allocation epoch of host id ``i``, bumped by every
      ``alloc``/``reserve`` that hands it out.
    * ``_pending_gather``: host id -> ``(epoch, entry)`` for each ``stage_backup`` not
      flushed yet. ``flush_backup`` publishes an entry only while its epoch is the
      slot's; any other epoch (the id freed and reused since, or an entry rewritten
      to another epoch) publishes nothing and the backup's page is freed.
    * ``_pending_load``: host id -> ``(epoch, entry)`` for each ``stage_load`` not
      flushed yet. ``flush_load`` scatters an entry only while its epoch is the
      slot's; otherwise its device page keeps what it holds and the id is missed
      (``"stale: ..."``).
    * ``_pending_lock``, ``_pending_load_lock``: both are the pool's one lock, which
      guards all of the above. Hold it to read or rewrite the two dicts; call no
      pool method while holding it.
    * ``_slots``: a read-only sequence over the host ids: ``_slots[i]`` is None while
      ``i`` holds no committed page (never backed up, freed, stale, dropped), else a
      record of its ``page`` and of the ``sharding`` of the host pool array holding
      it: ``memory_kind="pinned_host"`` where the mover keeps its pool as a pinned
      JAX array (``path="auto"`` does on CPU and TPU), None where no JAX array holds it
      (plain host memory, or the DMA mover's pool, pinned outside XLA: ``path="auto"``
      on a GPU with ``cuda-bindings``).
    * ``_pad_to_page_bucket(n)``: the page count kvxfer's page batches pad a transfer
      of ``n`` pages to (powers of two).
    * ``_jit_gather_one_layer(buf, idx, sharding)``: the per-layer point of
      ``stage_backup``, after it captured the ids' epochs and before it publishes.
      Called on the caller's thread inside the offload, once kvxfer has enqueued the
      reads of a layer's pages, for each layer: ``buf`` is the layer's cache as
      given, ``idx`` the device pages padded to ``_pad_to_page_bucket`` (``int32``,
      the padding repeats the first page), ``sharding`` where the host copy goes.
      The default does nothing: kvxfer's reads already hold the pages as they were
      at the call. A replacement assigned on the instance may call the pool (no pool
      lock is held there), e.g. ``free`` and ``alloc`` an id of the backup: the
      reused id then receives nothing from it. An exception raised there fails the
      backup with ``TransferError`` (nothing staged). The point runs under no
      context mesh, through the manager's transfer hook the pool installs:
      ``kvxfer.testing``'s faults chain to it; a hook installed over it without
      chaining (``manager.set_transfer_hook(h)``) skips it.

    Example:
        >>> import types, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> dev = types.SimpleNamespace(kv_buffer=[jnp.ones((9, 1, 2, 1, 128))] * 2)
        >>> pool = KvxferHostKVPool(dev, 4, 1, 2, (1, 2, 1, 128), jnp.float32, None,
        ...                         P(None, None, None, None, None))
        >>> (i,) = pool.alloc(1).tolist()
        >>> pool._slots[i] is None, pool._pad_to_page_bucket(3)
        (True, 4)
        >>> pool.stage_backup([3], [i])
        >>> with pool._pending_lock:
        ...     pool._pending_gather[i][0] == pool._generation[i]
        True
        >>> pool.flush_backup([i])
        >>> pool._slots[i].sharding.memory_kind
        'pinned_host'
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
        with self._lock:
            self._check_range(host_id)
            return self._pages[host_id]

    def close(self) -> None:
        """Closes the manager (waits for transfers in flight)."""
        self._mgr.close()

    # -- the engine's white-box names (see the class docstring) -------------------

    @property
    def _pending_lock(self) -> threading.Lock:
        return self._lock

    @property
    def _pending_load_lock(self) -> threading.Lock:
        return self._lock

    @property
    def _slots(self) -> _HostSlots:
        return self._slot_view

    _pad_to_page_bucket = staticmethod(bucket)

    def _jit_gather_one_layer(self, buf: Any, idx: np.ndarray, sharding: Any) -> None:
        """The per-layer point of ``stage_backup``; kvxfer's reads are enqueued already."""
        return None

    def _transfer_point(self, event: str, layer: int, array: Any) -> None:
        # The manager's transfer hook: once an offload has enqueued the reads of a
        # slice class, each layer of the class passes the gather point.
        if event != "gather_enqueued":
            return None
        call: _BackupCall | None = getattr(self._backup_call, "call", None)
        if call is None:
            return None
        cls, _ = self._mgr.plan.class_of_layer(layer)
        idx = PageBatch(np.asarray(call.device_indices), call.keys, call.generations).padded
        sharding = self._class_sharding[cls.index]
        for i in cls.layers:
            self._jit_gather_one_layer(call.buffers[i], idx, sharding)
        return None

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
        self.free([buffer_id])

    def free(self, host_page_ids: Sequence[int]) -> None:
        """Returns slots, deduplicated; checks every id before freeing any.

        Raises:
          ValueError: an id is out of range.
          RuntimeError: a slot is free already, or locked (``lock_ref != 0``).
        """
        ids = list(dict.fromkeys(int(i) for i in host_page_ids))
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
        with self._lock:
            self._require_allocated(buffer_id)
            self._lock_ref[buffer_id] += 1

    def dec_lock_ref(self, buffer_id: int) -> None:
        """Undoes one ``inc_lock_ref``.

        Raises:
          ValueError: out of range. RuntimeError: not allocated, or not locked.
        """
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

        Raises:
          ValueError: lengths differ, or a device page or host id out of range.
          RuntimeError: a host id is not allocated.
        """
        ids, device_indices = _pairs(host_buffer_ids, device_indices)
        if not ids:
            return
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

        Touches no cache: runs on the engine's D2H worker.

        Raises:
          RuntimeError: a host id has no staged backup (``stage_backup`` first).
          TransferError: the copy failed (the slot holds nothing new).
        """
        ids = [int(i) for i in host_buffer_ids]
        if not ids:
            return
        entries = []
        with self._lock:
            for i in ids:
                if i not in self._pending_gather:
                    raise RuntimeError(f"flush_backup of host page id={i} with no staged "
                                       "backup; stage_backup() must run first")
            for i in ids:
                entries.append((i, *self._pending_gather.pop(i)))
        for _, _, pending in entries:
            pending.group.handle.exception()
        for i, gen, pending in entries:
            group = pending.group
            page = group.handle.result()[pending.index]
            with self._lock:
                # The epoch the entry carries decides: the slot's own publishes, any
                # other (the id freed and reused since) leaves the slot as it is.
                if self._allocated[i] and self._generation[i] == gen:
                    self._pages[i] = page
                    self._dropped[i] = None
                    continue
                group.orphaned.add(i)
            self._reap(group)

    def copy_into(self, device_indices: Sequence[int], host_buffer_ids: Sequence[int]
                  ) -> None:
        """``stage_backup`` then ``flush_backup`` on one thread."""
        self.stage_backup(device_indices, host_buffer_ids)
        self.flush_backup(host_buffer_ids)

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
          ValueError: a host id out of range.
          RuntimeError: a host id is not allocated, or holds no page.
          TransferError: staging failed.
        """
        ids = [int(i) for i in host_buffer_ids]
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
          ValueError: lengths differ, or a host id or device page out of range.
          RuntimeError: a host id has no staged load (``stage_load`` first).
          TransferError: a device or transfer failure (``kv_buffer`` holds the
            caches to continue with).
        """
        ids, device_indices = _pairs(host_buffer_ids, device_indices)
        if not ids:
            return FlushLoadResult((), (), (), (), {})
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
        """``stage_load`` then ``flush_load`` on one thread."""
        ids = list(host_buffer_ids)
        self.stage_load(ids)
        return self.flush_load(ids, device_indices)

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
        if entry is not None:
            group = entry[1].group
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


def _key(host_id: int, generation: int) -> int:
    """The kvxfer key of a slot's page: the host id and the allocation's epoch."""
    return ((generation & 0xFFFFFFFF) << 32) | host_id
