"""``KVCacheManager``: the one object a serving engine holds to move KV pages.

Example:
    >>> import jax.numpy as jnp, kvxfer
    >>> caches = [jnp.zeros((64, 16, 2, 4, 32), jnp.bfloat16) for _ in range(4)]
    >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=32)
    >>> pages = mgr.offload(caches, [3, 9], keys=[11, 12]).wait()
    >>> caches, load = mgr.load(caches, pages, [20, 21])
    >>> load.result().verified_prefix
    2
    >>> mgr.close()
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from kvxfer import integrity as _integrity
from kvxfer._check import check_int, check_timeout
from kvxfer.engine import LoadRequest, Mover, PageBatch, ShardedLayer, TransferError
from kvxfer.engine._batch import abstract, bucket, own_context
from kvxfer.engine._raw import shared_buffers
from kvxfer.engine._grouped import BlockGroups, GroupedMover
from kvxfer.hostpool import HostPool, PageRef, PoolError
from kvxfer.layout import Layout, shape_text
from kvxfer.manager._handles import Gate, LoadHandle, LoadResult, OffloadHandle
from kvxfer.manager._select import PATHS, PathMode, plan_path, select_movers
from kvxfer.manager._agree import Agreement
from kvxfer.manager._pages import PageFormatError, decode, encode, fingerprint
from kvxfer.manager._prefetch import PrefetchHandle
from kvxfer.manager._stats import Counters, reason_kind
from kvxfer.manager._verify import DigestJob, DigestStarter, LoadVerifier, TransferHook
from kvxfer.plan import LayerSpec, Plan, make_plan

__all__ = ["KVCacheManager", "IntegrityMode", "Blocks"]

Blocks = Sequence[int] | Mapping[int, Sequence[int]]
"""Device block ids: one list for every slice class, or ``{class index: ids}``."""
IntegrityMode = Literal["page", "off"]
"""``"page"`` digests every page on the device; ``"off"`` skips digests."""


def _key(value: Any, where: str) -> int:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _integrity.key_from_bytes(bytes(value))
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and \
            0 <= int(value) < 1 << 64:
        return int(value)
    raise ValueError(f"{where}: key {value!r} of type {type(value).__name__} must be an int "
                     "in [0, 2**64) or bytes")


def _wait_ready(array: jax.Array, timeout: float | None, name: str) -> None:
    """Waits for a cache's value with a timeout (None: as long as it takes)."""
    if array.is_deleted():
        raise ValueError(f"{name} is a deleted array (donated or freed); pass the arrays "
                         "returned by the step that consumed it")
    if timeout is None:
        array.block_until_ready()
        return
    deadline = time.monotonic() + timeout
    delay = 1e-4
    while not array.is_ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} is still being computed after {timeout} s; wait "
                               "for the step that produces it, or raise ready_timeout")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def _layer_spec(i: int, a: Any, layout: Any, ready_timeout: float | None) -> LayerSpec:
    """The spec of layer ``i``'s cache, checking what kvxfer can move."""
    name = f"layer {i}"
    if not isinstance(a, jax.Array):
        raise TypeError(f"{name}: expected a jax.Array. Got {a!r} of type {type(a)}")
    if a.ndim < 2:
        raise ValueError(f"{name}: shape {list(a.shape)} needs a block dim and a block")
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        raise TypeError(f"{name}: dtype {a.dtype} is not supported; KV caches hold real "
                        "numbers (float, int or bool types)")
    _wait_ready(a, ready_timeout, name)
    groups = BlockGroups.of(a, name)  # a page axis sharded over data parallelism
    count = 1 if groups is None else groups.count
    layer = ShardedLayer.of(a)
    if layout is None:
        layout = Layout.of(a)
    elif not isinstance(layout, Layout):
        layout = Layout.of(layout)
    placement = tuple(tuple(d.id for r in reps for d in r.devices()) for reps in layer.shards)
    return LayerSpec(name, a.shape, a.dtype, layout, num_shards=len(layer.shards) // count,
                     replicas=len(layer.shards[0]), shard_shape=layer.shards[0][0].shape,
                     placement=placement, block_groups=count)


def _is(ref: weakref.ref | None, a: Any) -> bool:
    return ref is not None and ref() is a


class KVCacheManager:
    """Moves KV blocks between device caches and per-slice-class host pools.

    Args:
      kv_caches: one ``jax.Array`` per layer, block dim first. Layers may differ.
      num_host_blocks: host pages to provision.
      layouts: per-layer device layouts to assume (emulated TPU layouts on CPU);
        default: each array's own layout.
      integrity: ``"page"`` digests every page on the device before it leaves and
        verifies it after it returns; ``"off"`` skips digests.
      host_memory_budget: bytes; default ``kvxfer.plan.default_host_memory_budget()``.
      path: the mover of each slice class (``mgr.paths`` reports the choice):

        * ``"auto"``: per class, the fastest mover that can move it: on GPU and TPU
          ``pinned`` (on TPU ``pallas`` first, for classes proven addressable); on
          CPU ``raw`` copies where XLA:CPU buffers allow (row-major,
          whole-byte elements), else ``pinned``; ``staged`` on a backend without a
          ``pinned_host`` memory kind (or with ``pinned=False``). With ``layouts=``:
          emulated copies for classes proven addressable under them, else staged.
        * ``"pinned"``: compiled programs that gather pages (and their digests) into a
          pinned host pool and scatter them from it into the donated caches, for
          every class; needs a ``pinned_host`` memory kind (CPU and GPU have one).
        * ``"staged"``: compiled gather/scatter through pageable host buffers, any
          backend and layout (the portable fallback).
        * ``"direct"``: byte-range copies only; refuses layouts not proven
          addressable.
        * ``"pallas"``: Pallas TPU DMA kernels for every class, for layouts the
          inspector proves addressable (interpret mode off TPU; refuses the rest,
          and emulated layouts).
      ready_timeout: seconds to wait for caches still being computed.
      pinned: host pools in ``pinned_host`` memory (default: off on CPU, except for
        classes the pinned mover moves, which always get pinned pools; ``False``
        keeps ``"auto"`` off the pinned mover).
      agreement_timeout: seconds a multi-process load waits for every process's
        verified prefix before failing with ``TransferError`` (a crashed rank).

    Raises:
      BudgetError: the plan exceeds the budget (before any allocation).
      LayoutError: ``path="direct"`` or ``"pallas"`` over a layout that is not
        addressable.
      ValueError: ``path="pinned"`` on a backend without a ``pinned_host`` memory kind
        (naming the backend) or with ``pinned=False``.
      ValueError, TypeError: bad caches (deleted, block dim sharded, ...), naming
        the layer.
      TimeoutError: a cache is still being computed after ``ready_timeout``.
    """

    @own_context
    def __init__(self, kv_caches: Sequence[jax.Array], *, num_host_blocks: int,
                 layouts: Sequence[Any] | None = None, integrity: IntegrityMode = "page",
                 host_memory_budget: int | None = None, path: PathMode = "auto",
                 ready_timeout: float = 30.0, pinned: bool | None = None,
                 agreement_timeout: float = 300.0):
        # First, before any check that could fail on one rank only: every rank must
        # create its managers' agreements in the same order.
        self._agreement = Agreement(timeout=agreement_timeout)
        if integrity not in ("page", "off"):
            raise ValueError(f"integrity={integrity!r}; expected 'page' or 'off'")
        if path not in PATHS:
            raise ValueError(f"path={path!r}; expected one of {PATHS}")
        if isinstance(kv_caches, jax.Array):
            raise TypeError(f"kv_caches must be a sequence of jax.Array, one per layer. Got "
                            f"one jax.Array of shape {list(kv_caches.shape)}; pass "
                            "[cache] for a single layer")
        num_host_blocks = check_int(num_host_blocks, "num_host_blocks", minimum=1)
        ready_timeout = check_timeout(ready_timeout, "ready_timeout")
        caches = list(kv_caches)
        if not caches:
            raise ValueError("kv_caches is empty; expected one jax.Array per layer")
        if layouts is not None and len(layouts) != len(caches):
            raise ValueError(f"layouts has {len(layouts)} entries for {len(caches)} layers")
        specs = [_layer_spec(i, a, None if layouts is None else layouts[i], ready_timeout)
                 for i, a in enumerate(caches)]
        if layouts is not None and any(s.block_groups > 1 for s in specs):
            i = next(i for i, s in enumerate(specs) if s.block_groups > 1)
            raise ValueError(f"layer {i}: its block dim is sharded over data parallelism; "
                             "emulated layouts (layouts=) need the block dim whole")
        self.integrity = integrity
        self.ready_timeout = ready_timeout
        emulated = layouts is not None
        self._plan = make_plan(specs, num_host_blocks, path=plan_path(path, emulated),
                               host_memory_budget=host_memory_budget)
        mover_types = select_movers(self._plan, specs, caches, path, emulated, pinned)
        self._specs = specs
        # What each layer's movers were chosen for: later caches must match it. The
        # arrays last checked (or returned by a load) skip the check, and those whose
        # buffers are known to be their own skip the sharing scan of raw loads. Held
        # weakly: a manager must not keep a caller's old caches alive.
        self._formats = [(a.sharding, Layout.of(a)) for a in caches]
        self._validated: list[weakref.ref | None] = [None] * len(caches)
        self._private: list[weakref.ref | None] = [None] * len(caches)
        # Abstract values of every layer: enough to compile ahead, holding no buffer.
        self._abstract = [(abstract(a), ShardedLayer.of(a).abstract()) for a in caches]
        # A class whose mover reads and writes pinned memory gets its pool in the
        # pinned memory of the device holding its first shard; a mover may allocate
        # its class's pool itself (the Pallas kernels write a typed host array).
        firsts = [ShardedLayer.of(caches[c.layers[0]]).shards[0][0] for c in self._plan.classes]
        self._pool = HostPool(
            self._plan, pinned=[True if m.pinned_pool else pinned for m in mover_types],
            device=[next(iter(a.devices())) for a in firsts],
            backings={c.index: m.host_backing(c, [self._abstract[i][1] for i in c.layers])
                      for m, c in zip(mover_types, self._plan.classes)})
        self._movers: list[Mover] = [m(cls, pool) for m, cls, pool in
                                     zip(mover_types, self._plan.classes, self._pool.pools)]
        for c in self._plan.classes:  # a block dim sharded over data parallelism
            groups = BlockGroups.of(caches[c.layers[0]], f"layer {c.layers[0]}")
            if groups is not None:
                self._movers[c.index] = GroupedMover(self._movers[c.index], groups)
        self._layer_class = [self._plan.class_of_layer(i) for i in range(len(caches))]
        self._verifier = LoadVerifier(self._plan, self._movers, self._pool,
                                      integrity == "page")
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvxfer")
        # A shard's block shape (dim 0, the block count, sizes a deployment only).
        self._fingerprint = fingerprint(self._plan, [specs[c.layers[0]].shard_shape[1:]
                                                     for c in self._plan.classes])
        self._stats = Counters(
            ("pages_offloaded", "bytes_offloaded", "pages_loaded", "bytes_loaded",
             "pages_verified", "pages_freed", "transfer_errors", "pages_exported",
             "pages_imported"), ("mismatches", "imports_refused"), ("offload", "load"))
        self._closed = False

    # -- introspection ----------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """The host-memory plan (``str(mgr.plan)`` is a readable table)."""
        return self._plan

    @property
    def num_layers(self) -> int:
        return len(self._specs)

    @property
    def paths(self) -> list[str]:
        """The mover used for each layer: ``raw``, ``pinned``, ``pallas``, ``staged`` or
        ``emulated``."""
        return [self._movers[self._layer_class[i][0].index].name for i in range(self.num_layers)]

    def set_transfer_hook(self, hook: TransferHook | None) -> TransferHook | None:
        """Installs a hook called at points of every offload and load, for fault injection.

        ``hook(event, layer, array)`` (``kvxfer.testing`` builds its faults on it).
        An offload calls it

        * ``"gather_enqueued"``, on the caller's thread once the device programs
          that read the blocks of the class whose first layer is ``layer`` are
          enqueued; ``array`` is that layer's cache as given to ``offload`` (a test
          may free and rewrite the blocks here: the pages must hold them as they
          were at the call). Raising there makes ``offload`` raise
          ``TransferError``, its slots released;
        * ``"host_written"``, on the transfer thread once the host bytes (and
          digests) of that class are written, before the pages are committed;
          ``array`` is None (the caches may be donated by then). Raising there
          fails the offload: its slots are released and the handle carries a
          ``TransferError``.

        A load calls it

        * ``"start_load"``, on the caller's thread before the device work of the
          class whose first layer is ``layer`` starts (raising there is a failure in
          that class, after earlier classes were loaded);
        * ``"loaded_layer"``, on the caller's thread once ``layer``'s bytes are
          written (raw, emulated) or their programs enqueued (staged, pinned), before
          its digests are enqueued; ``array`` is what the load wrote into that layer.
          The hook may return a ``jax.Array`` of the same shape, dtype and sharding
          to stand for it: the load then digests and returns that array instead
          (``kvxfer.testing``'s ``zero-dma`` fault returns one whose loaded blocks
          are zeros, as a DMA that silently delivered nothing would leave them);
          any other return value (``None``, say) keeps ``array``;
        * ``"load_layer"``, on the transfer thread before the load waits for
          ``layer`` (raising there is a device failure reported by ``result()``).

        ``None`` removes the hook.

        Returns:
          The hook installed before.
        """
        previous, self._verifier.hook = self._verifier.hook, hook
        return previous

    @property
    def host_pool(self) -> HostPool:
        return self._pool

    @property
    def num_free_pages(self) -> int:
        return self._pool.num_free

    def close(self) -> None:
        """Waits for transfers in flight and stops the transfer thread."""
        if not self._closed:
            self._closed = True
            self._worker.shutdown(wait=True)

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- argument checks --------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the KVCacheManager is closed; create a new one")

    def _check_caches(self, kv_caches: Sequence[jax.Array]) -> list[jax.Array]:
        caches = list(kv_caches)
        if len(caches) != self.num_layers:
            raise ValueError(f"kv_caches has {len(caches)} layers; the manager has "
                             f"{self.num_layers}")
        for i, (a, spec) in enumerate(zip(caches, self._specs)):
            if not isinstance(a, jax.Array):
                raise TypeError(f"layer {i}: expected a jax.Array. Got {type(a)}")
            if a.is_deleted():
                raise ValueError(f"layer {i} is a deleted array (donated or freed); pass the "
                                 "arrays returned by the step that consumed it")
            if _is(self._validated[i], a):
                continue  # checked (or returned by a load) before: skip the costly part
            if tuple(a.shape) != spec.shape or a.dtype.name != spec.dtype:
                raise ValueError(f"layer {i}: got {shape_text(a.shape, a.dtype)}, the manager "
                                 f"was built for {shape_text(spec.shape, spec.dtype)}")
            sharding, layout = self._formats[i]
            if not a.sharding.is_equivalent_to(sharding, a.ndim):
                raise ValueError(f"layer {i}: sharding {a.sharding} differs from the one the "
                                 f"manager was built for ({sharding})")
            if Layout.of(a) != layout:
                raise ValueError(f"layer {i}: layout {Layout.of(a)} differs from the one the "
                                 f"manager was built for ({layout})")
            self._validated[i] = weakref.ref(a)
        return caches

    def _check_blocks(self, device_blocks: Any, n: int, what: str) -> dict[int, np.ndarray]:
        """Block ids per slice class moved: one list for every class, or a mapping.

        A mapping ``{class index: ids}`` moves those classes only (layers of a class
        share their block count); a plain list moves every class, checked against
        every layer's own block count.
        """
        classes = self._plan.classes
        if isinstance(device_blocks, Mapping):
            if not device_blocks:
                raise ValueError("device_blocks is an empty mapping; give ids for at least "
                                 "one slice class")
            out = {}
            for c, ids in device_blocks.items():
                c = check_int(c, "device_blocks key (a slice class index)", minimum=0)
                if c >= len(classes):
                    raise ValueError(f"device_blocks key {c} is not a slice class; the plan "
                                     f"has classes 0..{len(classes) - 1}")
                out[c] = self._check_ids(ids, n, what, classes[c].layers,
                                         f"device_blocks[{c}]")
            return dict(sorted(out.items()))
        ids = self._check_ids(device_blocks, n, what, range(self.num_layers), "device_blocks")
        return {c.index: ids for c in classes}

    def _check_ids(self, device_blocks: Sequence[int], n: int, what: str,
                   layers: Sequence[int], name: str) -> np.ndarray:
        ids = np.asarray(device_blocks)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"{name} must be a 1-D sequence of ints. Got {device_blocks!r}")
        if len(ids) != n:
            raise ValueError(f"{len(ids)} {name} for {n} {what}")
        limit = min(self._specs[i].num_blocks for i in layers)
        out = (ids < 0) | (ids >= limit)
        if out.any():
            j = int(np.flatnonzero(out)[0])
            i = next(i for i in layers if not 0 <= ids[j] < self._specs[i].num_blocks)
            raise ValueError(f"{name}[{j}] = {int(ids[j])} is out of range for layer "
                             f"{i} ({self._specs[i].num_blocks} blocks)")
        if len(np.unique(ids)) != len(ids):
            seen: dict[int, int] = {}
            for j, b in enumerate(ids.tolist()):
                if b in seen:
                    raise ValueError(f"{name}[{j}] = {b} duplicates {name}[{seen[b]}]")
                seen[b] = j
        return ids.astype(np.int32)

    def _check_slots(self, slots: Sequence[int], n: int) -> list[int]:
        if isinstance(slots, (str, bytes)) or not isinstance(slots, Sequence | np.ndarray):
            raise TypeError(f"slots must be a sequence of ints, one per key. Got {slots!r}")
        slots = list(slots)
        if len(slots) != n:
            raise ValueError(f"{len(slots)} slots for {n} keys")
        for j, s in enumerate(slots):
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or \
                    not 0 <= s < self._pool.num_slots:
                raise ValueError(f"slots[{j}] = {s!r} is not a host slot; slots are "
                                 f"0..{self._pool.num_slots - 1}")
        return [int(s) for s in slots]

    @staticmethod
    def _batches(blocks: dict[int, np.ndarray], keys: Sequence[int],
                 generations: Sequence[int]) -> dict[int, PageBatch]:
        """One page batch per class moved (classes given the same ids share one)."""
        made: dict[int, PageBatch] = {}
        return {c: made.setdefault(id(ids), PageBatch(ids, keys, generations))
                for c, ids in blocks.items()}

    def _layers(self, caches: list[jax.Array]) -> list[ShardedLayer]:
        return [ShardedLayer.of(a) for a in caches]

    # -- offload ----------------------------------------------------------------

    @own_context
    def offload(self, kv_caches: Sequence[jax.Array], device_blocks: Blocks,
                keys: Sequence[Any], *, slots: Sequence[int] | None = None) -> OffloadHandle:
        """Copies blocks to new host pages, asynchronously.

        Every device program is enqueued before this returns, so the caller may
        overwrite the blocks or donate the caches right away: the pages hold the
        bytes as they were at the call.

        An engine that chooses its host ids (sglang-jax's ``alloc``, vLLM TPU's chunk
        ids) names them with ``slots=``: the pages go to those host slots. A named
        slot holding a committed page is overwritten (every ref to the old page is
        stale from then on), unless a load is reading it: then the call raises
        ``PoolError`` and writes nothing. A failed offload leaves the named slots free.

        Example:
            >>> import jax.numpy as jnp, kvxfer
            >>> caches = [jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)]
            >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
            >>> old, = mgr.offload(caches, [1], keys=[5], slots=[3]).wait()
            >>> new, = mgr.offload(caches, [2], keys=[6], slots=[3]).wait()
            >>> new.slot, mgr.is_valid(old), mgr.is_valid(new)
            (3, False, True)
            >>> mgr.close()

        Args:
          kv_caches: the current caches (one per layer).
          device_blocks: block ids to copy, any order, no duplicates: one list for
            every slice class, or ``{class index: ids}`` to move those classes only
            (layers may hold different numbers of blocks).
          keys: one key per block (int in [0, 2**64) or bytes).
          slots: the host slot of each block (default: free slots kvxfer picks).

        Returns:
          An ``OffloadHandle``, a ``concurrent.futures.Future``: ``wait()`` (or
          ``result()``) gives one ``PageRef`` per block; ``cancel()`` before the
          pages are committed releases their slots instead.

        Raises:
          ValueError: bad caches, ids, keys or slots (nothing allocated).
          PoolExhaustedError: not enough free host slots (nothing allocated).
          PoolError: a named slot is being read by a load or written by another
            offload (nothing written).
        """
        self._check_open()
        started = time.perf_counter()
        caches = self._check_caches(kv_caches)
        keys = list(keys)
        blocks = self._check_blocks(device_blocks, len(keys), "keys")
        keys = [_key(k, f"keys[{j}]") for j, k in enumerate(keys)]
        if slots is None:
            refs = self._pool.allocate(len(keys))
        else:
            refs = self._pool.claim(self._check_slots(slots, len(keys)))
        slots = np.array([s for s, _ in refs], dtype=np.int64)
        batches = self._batches(blocks, keys, [g for _, g in refs])
        hook = self._verifier.hook
        try:
            layers = self._layers(caches)
            states = {}
            for c, batch in batches.items():
                cls = self._plan.classes[c]
                states[c] = self._movers[c].start_offload(
                    [layers[i] for i in cls.layers], batch, slots, self.integrity == "page")
                if hook is not None:
                    hook("gather_enqueued", cls.layers[0], caches[cls.layers[0]])
        except Exception as e:
            for s, g in refs:
                self._pool.release(s, g)
            raise TransferError(f"offload of {len(keys)} blocks failed: {e}") from e

        handle = OffloadHandle()
        try:
            self._worker.submit(handle.run, self._finish_offload, handle, states, slots,
                                refs, keys, started)
        except RuntimeError as e:  # closed meanwhile
            for s, g in refs:
                self._pool.release(s, g)
            raise TransferError(f"offload of {len(keys)} blocks failed: {e}") from e
        return handle

    @own_context
    def _finish_offload(self, handle: OffloadHandle, states: dict[int, Any],
                        slots: np.ndarray, refs: list[tuple[int, int]], keys: list[int],
                        started: float) -> None:
        """The transfer thread's half of an offload: host bytes in, pages committed."""
        hook = self._verifier.hook
        try:
            for c, state in states.items():
                self._movers[c].finish_offload(state, slots)
                if hook is not None:
                    hook("host_written", self._plan.classes[c].layers[0], None)
            cancelled = handle.claim()  # from here on cancel() fails
        except Exception as e:
            for s, g in refs:
                self._pool.release(s, g)
            self._stats.add(transfer_errors=1)
            error = TransferError(f"offload of {len(refs)} blocks failed: {e}")
            error.__cause__ = e
            handle.finish(error=error, cancelled=handle.claim())
            return
        if cancelled:  # the copies are done: the slots are free to reuse
            self._pool.release_many(refs)
            handle.finish(cancelled=True)
            return
        for (s, g), k in zip(refs, keys):
            self._pool.commit(s, g, k, frozenset(states))
        self._stats.add(pages_offloaded=len(refs), bytes_offloaded=len(refs) * sum(
            self._plan.classes[c].page_bytes for c in states))
        self._stats.time("offload", time.perf_counter() - started)
        handle.finish([PageRef(k, s, g) for (s, g), k in zip(refs, keys)])

    # -- load -------------------------------------------------------------------

    @own_context
    def load(self, kv_caches: Sequence[jax.Array], pages: Sequence[PageRef],
             device_blocks: Blocks, keys: Sequence[Any] | None = None,
             gate: Gate = "all", *, prefetched: PrefetchHandle | None = None
             ) -> tuple[list[jax.Array], LoadHandle]:
        """Copies host pages into device blocks; layers are released once verified.

        The input caches are consumed (as with donation): use the returned ones,
        and consume layer ``i`` only after ``handle.layer_ready(i)``. Every device
        program is enqueued before this returns: the returned arrays are the loaded
        values for any later computation, and the caller may donate them right away.

        Args:
          kv_caches: the current caches.
          pages: page refs from ``offload``, in request order (a prefix chain).
          device_blocks: destination block ids, one per page, no duplicates: one list
            for every slice class, or ``{class index: ids}`` (the pages must hold
            those classes).
          keys: the keys the caller expects (a page under another key is bad).
          gate: ``"layer"`` releases each layer once its pages are verified;
            ``"all"`` releases nothing until every layer is verified.
          prefetched: what ``prefetch(pages)`` staged for these pages: the load then
            only enqueues the scatter and the digests (the handle's pins pass to the
            load; a handle serves one load).

        Returns:
          ``(new_caches, LoadHandle)``; the handle is a ``concurrent.futures.Future``
          of the ``LoadResult``, and ``cancel()`` on it (an aborted request)
          releases the pages' pins once the device work reading them is done.

        Raises:
          ValueError, TypeError: bad caches, pages, ids, keys or gate (nothing moved).
          TransferError: a failure while the device work was being enqueued; its
            ``kv_caches`` are the caches to continue with.

        In a multi-process job every call takes part in the agreement on the verified
        prefix, also one that raises: the matching load on every other process then
        fails with ``TransferError``, and the next load agrees as usual.
        """
        round_ = self._agreement.next_round()
        try:
            return self._load(round_, kv_caches, pages, device_blocks, keys, gate,
                              prefetched)
        except BaseException:
            if self._agreement.multiprocess:
                try:
                    self._agreement.agree(round_, -1)  # the others learn this one failed
                except TransferError:
                    pass  # the original error is what the caller must see
            raise

    def _load(self, round_: int, kv_caches: Sequence[jax.Array], pages: Sequence[PageRef],
              device_blocks: Blocks, keys: Sequence[Any] | None,
              gate: Gate, prefetched: PrefetchHandle | None
              ) -> tuple[list[jax.Array], LoadHandle]:
        if gate not in ("all", "layer"):
            raise ValueError(f"gate={gate!r}; expected 'all' or 'layer'")
        started = time.perf_counter()
        self._check_open()
        caches = self._check_caches(kv_caches)
        pages = self._check_pages(pages)
        blocks = self._check_blocks(device_blocks, len(pages), "pages")
        if prefetched is not None and not isinstance(prefetched, PrefetchHandle):
            raise TypeError(f"prefetched= must be what prefetch() returned. Got "
                            f"{prefetched!r} of type {type(prefetched).__name__}")
        want = None
        if keys is not None:
            keys = list(keys)
            if len(keys) != len(pages):
                raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
            want = [_key(k, f"keys[{j}]") for j, k in enumerate(keys)]

        handle = LoadHandle(self.num_layers, len(pages), gate)
        staged: dict[int, Any] = {}
        if prefetched is None:
            problems = self._pool.acquire_readers([(p.slot, p.generation) for p in pages])
        else:
            _, staged, staged_n = prefetched.take(self, pages)
            problems = [prefetched.problems.get(j) for j in range(len(pages))]
        reasons: dict[int, str] = {}
        for j, (p, problem) in enumerate(zip(pages, problems)):
            if problem is not None:
                reasons[j] = f"{problem} ({p})"
            elif want is not None and want[j] != p.key:
                reasons[j] = f"wrong key: expected {want[j]:#x}, page holds {p.key:#x}"
            elif self._pool.key_of(p.slot) != p.key:
                reasons[j] = (f"wrong key: slot {p.slot} holds key "
                              f"{self._pool.key_of(p.slot):#x}, ref says {p.key:#x}")
            elif not set(blocks) <= self._pool.classes_of(p.slot):
                reasons[j] = (f"{p} holds slice classes "
                              f"{sorted(self._pool.classes_of(p.slot))}, the load asks for "
                              f"{sorted(blocks)}")
        n = min(reasons) if reasons else len(pages)
        pinned_slots = [p.slot for p, problem in zip(pages, problems) if problem is None]
        if prefetched is not None and staged_n != n:
            staged = {}  # fewer pages pass the load's checks: stage them again
        slots = np.array([p.slot for p in pages[:n]], dtype=np.int64)
        batches = self._batches({c: ids[:n] for c, ids in blocks.items()},
                                [p.key for p in pages[:n]],
                                self._pool.seals_of([p.slot for p in pages[:n]]))
        new = caches
        try:
            new, states, jobs = self._start_load(caches, batches, slots, gate, staged)
            # The arrays handed back have the registered formats, and after a raw load
            # the buffers of the layers it wrote are their own (shared ones were copied).
            self._validated = [weakref.ref(a) for a in new]
            for c in states:
                for i in self._plan.classes[c].layers:
                    self._private[i] = weakref.ref(new[i])
            self._worker.submit(handle.run, self._finish_load, round_, handle, new, pages,
                                slots, batches, states, jobs, reasons, pinned_slots, started)
        except BaseException as e:
            self._pool.release_readers(pinned_slots)
            if self._closed and not isinstance(e, TransferError):
                raise TransferError("the KVCacheManager was closed during the load",
                                    kv_caches=new) from e
            raise
        return new, handle

    def _check_pages(self, pages: Sequence[PageRef]) -> list[PageRef]:
        pages = list(pages)
        for j, p in enumerate(pages):
            if not isinstance(p, PageRef):
                raise TypeError(f"pages[{j}]: expected a PageRef. Got {p!r} of type {type(p)}")
            if not 0 <= p.slot < self._pool.num_slots:
                raise PoolError(f"pages[{j}] ({p}): unknown host slot")
        return pages

    @own_context
    def prefetch(self, pages: Sequence[PageRef]) -> PrefetchHandle:
        """Stages host pages on the devices for a later load, touching no cache.

        Any thread may call it (sglang-jax stages loads off the thread that owns the
        caches). The pages are pinned until the load that consumes the handle ends
        (or ``handle.release()``); ``load(..., prefetched=handle)`` then only
        enqueues the scatter into the caches and the digests. Movers that read the
        pool inside the load's own programs (raw copies, the pinned mover reading
        its pool in place) have nothing to stage: their loads are correct with the
        handle and cost what they cost without it. Neither have classes whose block
        dim is sharded over data parallelism: which devices a page goes to is known
        only from the load's block ids, so those classes stage at the load.

        Args:
          pages: the page refs the load will name, in the same order.

        Returns:
          A ``PrefetchHandle``; pages that cannot be loaded (stale, freed) are in its
          ``problems``, and staging stops before the first one.

        Raises:
          TypeError, PoolError: a bad page ref (nothing pinned).
          TransferError: staging failed (nothing left pinned).

        Example:
            >>> import jax.numpy as jnp, kvxfer
            >>> caches = [jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)]
            >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4, path="staged")
            >>> pages = mgr.offload(caches, [1, 2], keys=[5, 6]).wait()
            >>> staged = mgr.prefetch(pages)           # any thread
            >>> caches, load = mgr.load(caches, pages, [6, 7], prefetched=staged)
            >>> load.result().verified_prefix
            2
            >>> mgr.close()
        """
        self._check_open()
        pages = self._check_pages(pages)
        problems = self._pool.acquire_readers([(p.slot, p.generation) for p in pages])
        reasons = {j: f"{problem} ({p})" for j, (p, problem) in enumerate(zip(pages, problems))
                   if problem is not None}
        pinned = [p.slot for p, problem in zip(pages, problems) if problem is None]
        n = min(reasons) if reasons else len(pages)
        staged: dict[int, Any] = {}
        try:
            if n:
                head = pages[:n]
                held = frozenset.intersection(*(self._pool.classes_of(p.slot) for p in head))
                slots = np.array([p.slot for p in head], dtype=np.int64)
                # Staging reads the pool by slot; the block ids come with the load.
                request = LoadRequest(PageBatch(np.zeros(n, np.int32), [p.key for p in head],
                                                self._pool.seals_of(list(slots))), slots)
                for c in sorted(held):
                    if isinstance(self._movers[c], GroupedMover):
                        continue  # its pages go to the devices of the groups named at load
                    layers = [self._abstract[i][1] for i in self._plan.classes[c].layers]
                    staged[c] = self._movers[c].stage_load(layers, request)
        except Exception as e:
            self._pool.release_readers(pinned)
            raise TransferError(f"prefetch of {len(pages)} pages failed: {e}") from e
        return PrefetchHandle(self, pages, reasons, pinned, staged, n,
                              self._pool.release_readers)

    def _start_load(self, caches: list[jax.Array], batches: dict[int, PageBatch],
                    slots: np.ndarray, gate: Gate, prefetched: dict[int, Any]
                    ) -> tuple[list[jax.Array], dict[int, Any], list[DigestJob]]:
        """The caller's-thread half of a load: every device program enqueued.

        Every class is staged before the first one starts (starting may donate the
        caches), so a failure while staging leaves the caches as they were; a failure
        once classes have started raises a ``TransferError`` whose ``kv_caches`` are
        the arrays to continue with (loaded classes replaced, the others as given).
        """
        n = len(slots)
        layers = self._layers(caches)
        new = list(caches)
        states: dict[int, Any] = {}
        digests = DigestStarter(self._verifier, batches, gate)
        if not n:
            return new, states, digests.finish(new)
        shared: frozenset[int] = frozenset()
        if any(self._movers[c].writes_buffers for c in batches) and not all(
                _is(p, a) for a, p in zip(caches, self._private)):
            shared = shared_buffers(caches)
        pairs = [(self._plan.classes[c], self._movers[c],
                  LoadRequest(b, slots, shared, functools.partial(digests.written, c)))
                 for c, b in batches.items()]
        try:
            staged = [prefetched[cls.index] if cls.index in prefetched else
                      mover.stage_load([layers[i] for i in cls.layers], request)
                      for cls, mover, request in pairs]
        except Exception as e:
            raise TransferError(f"load of {n} pages failed while staging (the caches are "
                                f"unchanged): {e}", kv_caches=new) from e
        hook = self._verifier.hook
        for (cls, mover, request), st in zip(pairs, staged):
            try:
                if hook is not None:
                    hook("start_load", cls.layers[0], new[cls.layers[0]])
                out, states[cls.index] = mover.start_load(
                    [caches[i] for i in cls.layers], [layers[i] for i in cls.layers],
                    request, st)
            except Exception as e:
                # A mover that failed after consuming its inputs hands back the arrays
                # its layers live in now.
                if isinstance(e, TransferError) and e.kv_caches is not None:
                    for i, a in zip(cls.layers, e.kv_caches):
                        new[i] = a
                usable = [a for a in new if not a.is_deleted()]
                raise TransferError(
                    f"load of {n} pages failed in {cls.name} (layers {list(cls.layers)}): "
                    f"{e}; continue with err.kv_caches ({len(usable)} of {len(new)} layers "
                    "usable)", kv_caches=new) from e
            for i, a in zip(cls.layers, out):
                new[i] = digests.returned(i, a)
        try:
            return new, states, digests.finish(new)
        except Exception as e:
            raise TransferError(f"load of {n} pages failed while starting its digests: {e}; "
                                "continue with err.kv_caches", kv_caches=new) from e

    @own_context
    def _finish_load(self, round_: int, handle: LoadHandle, new: list[jax.Array],
                     pages: list[PageRef],
                     slots: np.ndarray, batches: dict[int, PageBatch], states: dict[int, Any],
                     jobs: list[DigestJob], reasons: dict[int, str],
                     pinned_slots: list[int], started: float) -> None:
        """The transfer thread's half of a load: wait, verify, agree, settle.

        A cancelled load still waits for every program that reads the pool; on one
        process it skips the digest checks left and the settling (nothing is
        reported), in a multi-process job it verifies, agrees and settles as usual.
        """
        alone = not self._agreement.multiprocess
        try:
            prefix, proven_bad = self._verifier.verify(handle, new, states, jobs, slots,
                                                       batches, reasons, may_stop=alone)
            error: BaseException | None = None
        except Exception as e:  # a transfer or device failure is an error, not a miss
            prefix, proven_bad, error = -1, frozenset(), e
        cancelled = handle.claim()  # from here on cancel() fails
        try:
            if not alone:
                # Every rank takes part even after a local failure, so none hangs.
                agreed = self._agreement.agree(round_, prefix)
                if agreed < 0 and error is None:
                    error = TransferError("a transfer failed on another process")
                prefix = agreed
            if error is not None:
                raise error
            result = None if cancelled and alone else self._verifier.settle(
                handle, pages, prefix, proven_bad, reasons, set(batches))
        except Exception as e:
            result, error = None, e
            self._stats.add(transfer_errors=1)
        else:
            if result is not None:
                self._count_load(result, len(slots), batches, started)
        finally:
            # Before the handle says done: a caller returning from result() finds the
            # pages it read free to evict (and freed ones free) at once.
            self._pool.release_readers(pinned_slots)
        handle.finish(result, error, cancelled)

    def _count_load(self, result: LoadResult, moved: int, batches: dict[int, PageBatch],
                    started: float) -> None:
        self._stats.add(pages_loaded=moved, pages_verified=result.verified_prefix,
                        pages_freed=len(result.freed_pages),
                        bytes_loaded=moved * sum(self._plan.classes[c].page_bytes
                                                 for c in batches))
        for reason in result.reasons.values():
            self._stats.add_labelled("mismatches", reason_kind(reason))
        self._stats.time("load", time.perf_counter() - started)

    # -- host pages ---------------------------------------------------------------

    def free(self, pages: Sequence[PageRef]) -> None:
        """Returns pages to the pool (deferred while a transfer reads them).

        Raises:
          PoolError: an unknown slot, a stale ref, or a double free (nothing freed).
        """
        pages = list(pages)
        for j, p in enumerate(pages):
            if not isinstance(p, PageRef):
                raise TypeError(f"pages[{j}]: expected a PageRef. Got {p!r} of type {type(p)}")
        self._pool.release_many([(p.slot, p.generation) for p in pages])

    @own_context
    def warmup(self, max_pages: int) -> list[int]:
        """Compiles every program transfers of up to ``max_pages`` pages will run.

        Offloads, loads (either gate) and digests, for every slice class and every
        bucket of page counts up to ``max_pages`` (counts are padded to powers of two),
        so the first request of each size does not pay for compiling.

        Returns:
          The buckets compiled.

        Example:
            >>> import jax.numpy as jnp, kvxfer
            >>> mgr = kvxfer.KVCacheManager([jnp.zeros((8, 128))], num_host_blocks=4)
            >>> mgr.warmup(5)
            [1, 2, 4, 8]
            >>> mgr.close()
        """
        self._check_open()
        max_pages = check_int(max_pages, "max_pages", minimum=1)
        buckets = [1 << i for i in range(bucket(max_pages).bit_length())]
        for b in buckets:
            for cls, mover in zip(self._plan.classes, self._movers):
                mover.warmup([self._abstract[i][0] for i in cls.layers],
                             [self._abstract[i][1] for i in cls.layers], b,
                             self.integrity == "page")
        return buckets

    def is_valid(self, page: PageRef) -> bool:
        """Whether ``page`` still holds the page it refers to (not freed, not reused).

        Example:
            >>> import jax.numpy as jnp, kvxfer
            >>> caches = [jnp.zeros((8, 128))]
            >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
            >>> (page,) = mgr.offload(caches, [1], keys=[7]).wait()
            >>> mgr.is_valid(page), (mgr.free([page]), mgr.is_valid(page))[1]
            (True, False)
            >>> mgr.close()
        """
        if not isinstance(page, PageRef):
            raise TypeError(f"expected a PageRef. Got {page!r} of type {type(page)}")
        gen, state, key = self._pool.state(page.slot)
        return gen == page.generation and state == "valid" and key == page.key

    def _page_range(self, page: PageRef, layer: int) -> tuple[np.ndarray, int, int]:
        if not isinstance(page, PageRef):
            raise TypeError(f"expected a PageRef. Got {page!r} of type {type(page)}")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        gen, state, key = self._pool.state(page.slot)
        if gen != page.generation or state != "valid":
            raise PoolError(f"{page} is not a valid page (slot generation {gen}, {state})")
        cls, pos = self._layer_class[layer]
        if cls.index not in self._pool.classes_of(page.slot):
            raise PoolError(f"{page} does not hold layer {layer} (it holds slice classes "
                            f"{sorted(self._pool.classes_of(page.slot))}; layer {layer} is "
                            f"in class {cls.index})")
        lo, hi = self._pool.pools[cls.index].layer_range(pos)
        return self._pool.pools[cls.index].data[page.slot], lo, hi

    def read_block_bytes(self, page: PageRef, layer: int) -> bytes:
        """The host bytes of one layer of a page (all shards, shard-major)."""
        row, lo, hi = self._page_range(page, layer)
        return row[lo:hi].tobytes()

    def write_block_bytes(self, page: PageRef, layer: int,
                          data: bytes | bytearray | memoryview) -> None:
        """Replaces the host bytes of one layer of a page and re-digests them.

        A deliberate write: the new bytes become the page's truth, so a later load
        verifies against digests made on the host here, not on a device. To bring
        back a page from a tier below host memory use ``import_page``, which keeps
        the device-made digests.

        Args:
          page: a valid page.
          layer: the layer.
          data: exactly ``plan.class_of_layer(layer)[0].bytes_per_block`` bytes.

        Raises:
          TypeError: ``data`` is not bytes-like. ValueError: wrong length.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, bytearray or memoryview. Got {type(data)}")
        buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        row, lo, hi = self._page_range(page, layer)
        if buf.size != hi - lo:
            raise ValueError(f"layer {layer}: {buf.size} bytes given, a block is {hi - lo}")
        with self._pool.pools[self._layer_class[layer][0].index].lock:
            row[lo:hi] = buf
        if self.integrity == "page":
            cls, pos = self._layer_class[layer]
            pool = self._pool.pools[cls.index]
            for s in range(cls.num_shards):
                a, b = pool.shard_range(pos, s)
                words = _integrity.as_words_np(row[a:b][None], batch_dims=1)
                ident = _integrity.identity_words(page.key, layer,
                                                  self._pool.seal_of(page.slot), s)
                pool.digests[page.slot, pos, s, :_integrity.DIGEST_WORDS] = \
                    _integrity.digest_np(words, ident)[0]

    # -- pages in and out of host memory --------------------------------------------

    @property
    def fingerprint(self) -> str:
        """Hex name of what this manager's pages mean (KV geometry, page format).

        Equal only for managers whose pages are interchangeable byte for byte: a store
        tier puts it in every key, so two geometries (another dtype, another sharding,
        another page size) never share a page. Weights are not geometry: give each
        model its own ``HostCache(namespace=)``.
        """
        return self._fingerprint.hex()

    def export_page(self, page: PageRef) -> bytes:
        """One page as a blob: its bytes, the digests made on the device, its identity.

        ``import_page`` (here or in another process with the same ``fingerprint``)
        brings it back; nothing is re-digested on either side, so a load of the
        imported page checks its bytes on the device against what left the first
        device.

        Raises:
          PoolError: ``page`` is not a valid page.

        Example:
            >>> import jax.numpy as jnp, kvxfer
            >>> caches = [jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)]
            >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
            >>> (page,) = mgr.offload(caches, [3], keys=[7]).wait()
            >>> blob = mgr.export_page(page)
            >>> mgr.free([page])
            >>> back = mgr.import_page(blob, key=7)
            >>> caches, load = mgr.load(caches, [back], [5])
            >>> load.result().verified_prefix, bool((caches[0][5] == caches[0][3]).all())
            (1, True)
            >>> mgr.close()
        """
        if not isinstance(page, PageRef):
            raise TypeError(f"expected a PageRef. Got {page!r} of type {type(page)}")
        problem, = self._pool.acquire_readers([(page.slot, page.generation)])
        if problem is not None:
            raise PoolError(f"{page} cannot be exported: {problem}")
        try:
            if self._pool.key_of(page.slot) != page.key:
                raise PoolError(f"{page}: slot {page.slot} holds key "
                                f"{self._pool.key_of(page.slot):#x}")
            parts = {c: (self._pool.pools[c].data[page.slot],
                         self._pool.pools[c].digests[page.slot])
                     for c in sorted(self._pool.classes_of(page.slot))}
            blob = encode(self._plan, self._fingerprint, page.key,
                          self._pool.seal_of(page.slot), self.integrity == "page", parts)
        finally:
            self._pool.release_readers([page.slot])
        self._stats.add(pages_exported=1)
        return blob

    @own_context
    def import_page(self, blob: bytes | bytearray | memoryview,
                    key: Any | None = None) -> PageRef:
        """A new host page holding an exported page, digests and identity unchanged.

        Args:
          blob: what ``export_page`` made (here, or in a process whose manager has the
            same ``fingerprint``).
          key: the key the caller expects; a blob of another key is refused.

        Returns:
          The new page's ref. Its bytes are checked on the device when it is loaded.

        Raises:
          PageFormatError: the blob is not a whole page of this geometry (cut short,
            another model's, another key's, ...), naming what is wrong; nothing is
            allocated.
          PoolExhaustedError: no free host slot.
        """
        self._check_open()
        want = None if key is None else _key(key, "key")
        try:
            page = decode(self._plan, self._fingerprint, blob)
            if want is not None and page.key != want:
                raise PageFormatError(f"page blob of key {page.key:#x} where key {want:#x} "
                                      "was expected", "wrong key")
            if self.integrity == "page" and not page.digested:
                raise PageFormatError("page blob carries no digests (exported with "
                                      "integrity='off'); this manager verifies every page",
                                      "no digests")
        except PageFormatError as e:
            self._stats.add_labelled("imports_refused", e.kind)
            raise
        (slot, generation), = self._pool.allocate(1)
        for c, data in page.data.items():
            pool = self._pool.pools[c]
            with pool.lock:  # no program copies the pool in and out meanwhile
                pool.data[slot] = data
                pool.digests[slot] = page.digests[c]
        self._pool.commit(slot, generation, page.key, frozenset(page.data), seal=page.seal)
        self._stats.add(pages_imported=1)
        return PageRef(page.key, slot, generation)

    def stats(self) -> dict[str, Any]:
        """Counters since the manager was made, as one snapshot.

        ``pages_offloaded`` / ``bytes_offloaded``, ``pages_loaded`` / ``bytes_loaded``
        (pages moved to the devices), ``pages_verified`` (in verified prefixes),
        ``pages_freed`` (proven bad and freed), ``mismatches`` (reason kind -> count),
        ``transfer_errors``, ``pages_exported`` / ``pages_imported``,
        ``imports_refused`` (reason -> count), ``host_pages`` / ``host_free_pages``,
        and ``offload_seconds`` / ``load_seconds`` (count, sum, p50, p90, p99 of the
        time from the call to the transfer's end).
        """
        out = self._stats.snapshot()
        out["host_pages"] = self._pool.num_slots
        out["host_free_pages"] = self._pool.num_free
        return out
