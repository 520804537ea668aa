"""The names sglang-jax's tests read inside ``LRUHostKVPool``, on kvxfer's pool.

sglang-jax's own host-pool tests reach into the engine pool's private state;
``KvxferHostKVPool`` inherits ``_EngineNames`` so that each of those names is a view
of (or a hook into) its own bookkeeping, with the engine pool's meaning.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer.engine import PageBatch, bucket
from kvxfer.hostpool import PageRef

__all__: list[str] = []  # private: the names the engine's tests read inside its pool


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

    def __init__(self, pool: Any):  # the KvxferHostKVPool it views
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


class _EngineNames:
    """The engine pool's private names, as ``KvxferHostKVPool`` gives them.

    sglang-jax's own tests read and rewrite some of ``LRUHostKVPool``'s private
    state; these names are the pool's real state, with the engine pool's meaning:

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
        >>> from kvxfer.integrations.sglang_jax import KvxferHostKVPool
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
    """

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
