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
import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from kvxfer._names import IntegrityMode as IntegrityMode
from kvxfer._check import check_int
from kvxfer.engine import (DmaOptions, ShardedLayer, abstract, bucket, deferred_compiles,
                           own_context, pinned_mode, staging_bytes_held)
from kvxfer.hostpool import HostPool, PageRef
from kvxfer.manager._agree import Agreement
from kvxfer.manager._dma_check import dma_self_check
from kvxfer.manager._checks import Checks, check_construction
from kvxfer.manager._handles import (Gate, LoadHandle, OffloadHandle, current_hook,
                                     hooked_call)
from kvxfer.manager._host import HostPages
from kvxfer.manager._load import Loads
from kvxfer.manager._offload import Offloads
from kvxfer.manager._pages import fingerprint
from kvxfer.manager._prefetch import PrefetchHandle
from kvxfer.manager._select import (MoverChoice, PathMode, choose_movers, make_movers,
                                    plan_path)
from kvxfer.manager._thread import TransferThread
from kvxfer._counters import Counters
from kvxfer.manager._verify import LoadVerifier, TransferHook
from kvxfer.plan import BudgetError, LayerSpec, Plan, make_plan

__all__ = ["KVCacheManager", "IntegrityMode", "Blocks"]

Blocks = Sequence[int] | Mapping[int, Sequence[int]]
"""Device block ids: one list for every slice class, or ``{class index: ids}``."""


def _call_hook(event: str, layer: int, array: jax.Array | None) -> Any:
    """The hook the verifier calls: that of the offload or load the event belongs to."""
    hook = current_hook()
    return None if hook is None else hook(event, layer, array)


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

        * ``"auto"``: per class, the fastest mover that can move it: on an NVIDIA
          GPU with ``cuda-bindings`` ``dma``, else ``pinned``; on TPU ``pinned``, in
          place where it can be, else its pages route (no payload byte copied on
          the host either way); on CPU ``raw`` copies where
          XLA:CPU buffers allow (row-major, whole-byte elements), else ``pinned``;
          ``staged`` on a backend without a ``pinned_host`` memory kind (or with
          ``pinned=False``). With ``layouts=``: emulated copies for classes proven
          addressable under them, else staged.
        * ``"dma"``: one program per class and transfer that digests on the device
          and enqueues batched copy-engine copies on XLA's stream between the
          caches' blocks and a pool pinned outside XLA, for every class (NVIDIA GPUs
          with ``cuda-bindings``; XLA:CPU with a host copy engine); refuses layouts it
          cannot address.
        * ``"pinned"``: compiled programs between the caches and ``pinned_host``
          memory, for every class: in place (a donated pool updated by the program)
          on XLA:CPU and TPU, elsewhere each page an array of pinned memory of its
          own, gathered and digested on the device (``pinned_route`` picks one);
          needs a ``pinned_host`` memory kind (CPU, GPU and TPU have one).
        * ``"staged"``: compiled gather/scatter through pageable host buffers, any
          backend and layout (the portable fallback).
        * ``"raw"``: the ``raw`` mover's byte-range copies of XLA:CPU buffers for
          every class (with ``layouts=``, the ``emulated`` mover's copies over
          emulated TPU memory); refuses layouts not proven addressable.
          (``"direct"``, its former name, is refused with a ``ValueError`` naming
          ``"raw"``.)
        * ``"pallas"``: Pallas TPU DMA kernels for every class, for layouts the
          inspector proves addressable (interpret mode off TPU; refuses the rest,
          and emulated layouts).
      ready_timeout: seconds to wait for caches still being computed.
      pinned: host pools in ``pinned_host`` memory (default: off on CPU, except for
        classes the pinned mover moves, which always get pinned pools; ``False``
        keeps ``"auto"`` off the pinned mover).
      agreement_timeout: seconds a multi-process load waits for every process's
        verified prefix before failing with ``TransferError`` (a crashed rank), and
        ``close()`` waits for the other ranks to close. The default, 60 s, is shorter
        than ``jax.distributed``'s heartbeat timeout (100 s).
      dma: how the DMA mover runs (``kvxfer.DmaOptions``: its streams, relayout,
        staging budget, copy calls and self-check); default ``DmaOptions()``.
      pinned_route: the pinned mover's route, ``"in-place"`` or ``"pages"`` (to run on
        CPU what a GPU runs, or to measure both); default (None): in place on XLA:CPU
        and TPU where the class allows, else pages.

    Raises:
      BudgetError: the plan exceeds the budget (before any allocation).
      LayoutError: ``path="raw"``, ``"pallas"`` or ``"dma"`` over a layout it cannot
        move (not addressable, not row-major for ``dma``), or ``path="dma"`` without a
        copy engine for the backend.
      ValueError: ``path="pinned"`` on a backend without a ``pinned_host`` memory kind
        (naming the backend) or with ``pinned=False``; a ``pinned_route`` not among
        the routes, naming it.
      ValueError, TypeError: bad caches (deleted, block dim sharded, K and V stacked
        on dim 0 as ``[2, num_blocks, ...]``, ...), naming the layer.
      TimeoutError: a cache is still being computed after ``ready_timeout``.
    """

    @own_context
    def __init__(self, kv_caches: Sequence[jax.Array], *, num_host_blocks: int,
                 layouts: Sequence[Any] | None = None, integrity: IntegrityMode = "page",
                 host_memory_budget: int | None = None, path: PathMode = "auto",
                 ready_timeout: float = 30.0, pinned: bool | None = None,
                 agreement_timeout: float = 60.0, dma: DmaOptions | None = None,
                 pinned_route: str | None = None):
        # First, before any check that could fail on one rank only: every rank must
        # create its managers' agreements in the same order.
        self._agreement = Agreement(timeout=agreement_timeout)
        caches, specs, num_host_blocks, ready_timeout = check_construction(
            kv_caches, layouts, integrity, path, num_host_blocks, ready_timeout)
        if dma is not None and not isinstance(dma, DmaOptions):
            raise TypeError(f"dma={dma!r}: expected a kvxfer.DmaOptions")
        dma = DmaOptions() if dma is None else dma
        pinned_mode("cpu", pinned_route)  # checks it: one of PINNED_ROUTES, or None
        self.integrity = integrity
        self.ready_timeout = ready_timeout
        emulated = layouts is not None
        try:
            plan = make_plan(specs, num_host_blocks, path=plan_path(path, emulated),
                             host_memory_budget=host_memory_budget)
        except BudgetError as e:  # the plan names how it sizes blocks, not the mover
            raise BudgetError(f"KVCacheManager(path={path!r}): {e}") from None
        chosen = choose_movers(plan, specs, caches, path, emulated, pinned,
                               functools.partial(dma_self_check, options=dma,
                                                 manager=KVCacheManager), pinned_route)
        mover_types = [mover for mover, _ in chosen]
        self._reasons = [reason for _, reason in chosen]
        # The plan sizes host blocks; its table names the mover of each class too.
        self._plan = dataclasses.replace(plan, movers=tuple(m.name for m in mover_types))
        self._specs: list[LayerSpec] = specs
        # Abstract values of every layer: enough to compile ahead, holding no buffer.
        self._abstract = [(abstract(a), ShardedLayer.of(a).abstract()) for a in caches]
        self._pool, self._movers = make_movers(
            self._plan, caches, mover_types, pinned, [layer for _, layer in self._abstract],
            dma)
        self._layer_class = [self._plan.class_of_layer(i) for i in range(len(caches))]
        self._verifier = LoadVerifier(self._plan, self._movers, self._pool,
                                      integrity == "page")
        self._worker = TransferThread("kvxfer")
        # A shard's block shape (dim 0, the block count, sizes a deployment only).
        self._fingerprint = fingerprint(self._plan, [specs[c.layers[0]].shard_shape[1:]
                                                     for c in self._plan.classes])
        self._stats = Counters(
            ("pages_offloaded", "bytes_offloaded", "pages_loaded", "bytes_loaded",
             "pages_verified", "pages_freed", "transfer_errors", "transfer_faults",
             "pages_exported", "pages_imported"), ("mismatches", "imports_refused"), ("offload", "load"))
        self._checks = Checks(specs, caches, self._plan, self._pool)
        parts = (self._plan, self._pool, self._movers, self._verifier, self._checks,
                 self._stats, self._worker)
        self._offloads = Offloads(*parts, integrity == "page")
        self._loads = Loads(*parts, self._agreement, [layer for _, layer in self._abstract])
        self._host = HostPages(self._plan, self._pool, self._fingerprint, self._stats,
                               integrity == "page")
        self._hook: TransferHook | None = None  # what set_transfer_hook installed

    # -- introspection ----------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """The host-memory plan (``str(mgr.plan)`` is a readable table, with the mover
        of each slice class)."""
        return self._plan

    @property
    def num_layers(self) -> int:
        return len(self._specs)

    @property
    def paths(self) -> list[str]:
        """The mover used for each layer: ``dma``, ``raw``, ``pinned``, ``pallas``,
        ``staged`` or ``emulated``, each with why as its ``reason`` (a
        ``MoverChoice``: with ``path="auto"``, why each mover tried before it did
        not apply, such as Pallas kernels the TPU compiler refuses)."""
        return [MoverChoice(self._movers[c.index].name, self._reasons[c.index])
                for c, _ in self._layer_class]

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

        Each offload and load keeps the hook installed when it was called, on both
        threads: installing another hook (or ``None``) applies to the transfers
        started afterwards, so a hook installed around a call also sees that
        transfer's ``"host_written"`` and ``"load_layer"`` events, however late the
        transfer thread reaches them.

        Returns:
          The hook installed before.
        """
        previous, self._hook = self._hook, hook
        if hook is not None:
            # From the first hook on, the transfers ask for the hook of their call;
            # a manager never given one calls nothing.
            self._verifier.hook = _call_hook
        return previous

    @property
    def host_pool(self) -> HostPool:
        return self._pool

    @property
    def num_free_pages(self) -> int:
        return self._pool.num_free

    def close(self) -> None:
        """Waits for transfers in flight and stops the transfer thread.

        In a multi-process job every rank must close its managers (in the same
        order): once its own transfers are done, ``close`` waits up to
        ``agreement_timeout`` for the other ranks to close theirs, so a rank that
        finishes first, rank 0 above all (it hosts ``jax.distributed``'s
        coordination service), does not take the service down while another rank
        still agrees on its last loads.
        """
        if not self._checks.closed:
            self._checks.closed = True
            self._worker.shutdown(wait=True)
            self._loads.reap()  # prefetch handles dropped unused
            self._agreement.meet("close")

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def agreement_timeout(self) -> float:
        """Seconds a multi-process agreement waits for every process (the constructor's
        ``agreement_timeout``)."""
        return self._agreement.timeout

    def check_blocks(self, device_blocks: Blocks, n: int, what: str = "keys"
                     ) -> dict[int, np.ndarray]:
        """Checks ``n`` block ids as ``offload`` checks them, moving nothing.

        A caller that must act before it offloads (a cache evicting to make room)
        refuses bad ids first. ``what`` names the ids' counterpart in the message.

        Returns:
          The ids per slice class, ``{class index: ids}``.

        Raises:
          ValueError: an id out of range or repeated, or not ``n`` of them.

        Example:
            >>> import jax.numpy as jnp, kvxfer
            >>> mgr = kvxfer.KVCacheManager([jnp.zeros((8, 128))], num_host_blocks=2)
            >>> {c: ids.tolist() for c, ids in mgr.check_blocks([3, 5], 2).items()}
            {0: [3, 5]}
            >>> mgr.check_blocks([3, 99], 2)
            Traceback (most recent call last):
            ...
            ValueError: device_blocks[1] = 99 is out of range for layer 0 (8 blocks)
            >>> mgr.close()
        """
        return self._checks.blocks(device_blocks, n, what)

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
        self._checks.open()
        self._loads.reap()
        with hooked_call(self._hook):
            return self._offloads.start(kv_caches, device_blocks, keys, slots)

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

        A page that was a valid page of this manager once but cannot be used now is a
        miss, not an error: the verified prefix stops before it (pages after it are
        not delivered either, and stay the caller's), and ``result().reasons`` says
        why, in these words:

        * ``"stale generation (page(...))"``: its slot was written again since (the
          page was freed and the slot reused, or overwritten by ``offload(slots=)``);
        * ``"freed (page(...))"``: the page was freed (by ``free``, or by kvxfer
          after a load proved it bad) and its slot not reused yet;
        * ``"wrong key: expected ..., page holds ..."``: ``keys=`` expected another
          key; ``"wrong key: slot ... holds key ..., ref says ..."``: the ref's key
          is not the page's;
        * ``"page(...) holds slice classes [...], the load asks for [...]"``: it was
          offloaded for fewer classes than ``device_blocks`` names;
        * ``"digest mismatch in layer ..."`` (``"shard disagreement: ..."`` for one
          shard): its bytes arrived damaged (the page is then freed:
          ``result().freed_pages``); ``"invalid on another process"``: another
          process of a multi-process job found its copy bad.

        Raises:
          TypeError: a page that is not a ``PageRef``; caches that are not arrays.
          PoolError: a ref that was never a page of this manager: an unknown host
            slot, or a generation its slot never had (0, ahead of the slot's, or the
            slot's own while its page is still being written: a ref of another
            manager, or one no ``offload``/``import_page`` returned). An engine bug,
            so not reported as a miss; nothing moved. (A ref of another manager that
            matches a slot and generation here is not detectable; its key or
            digests make it a miss.)
          ValueError: bad caches, ids, keys or gate (nothing moved).
          TransferError: a failure while the device work was being enqueued; its
            ``kv_caches`` are the caches to continue with. A device or transfer
            failure after the call is the ``TransferError`` the handle raises.

        In a multi-process job every call takes part in the agreement on the verified
        prefix, also one that raises: the matching load on every other process then
        fails with ``TransferError``, and the next load agrees as usual.
        """
        with hooked_call(self._hook):
            return self._loads.load(kv_caches, pages, device_blocks, keys, gate, prefetched)

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
          TypeError, PoolError: a ref that is not a ``PageRef``, or was never a page of
            this manager, as ``load`` checks them (nothing pinned).
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
        self._checks.open()
        return self._loads.prefetch(pages)

    # -- host pages ---------------------------------------------------------------

    def free(self, pages: Sequence[PageRef]) -> None:
        """Returns pages to the pool (deferred while a transfer reads them).

        Raises:
          PoolError: an unknown slot, a generation never issued, a stale ref, or a
            double free (nothing freed).
        """
        self._loads.reap()
        self._host.free(pages)

    @own_context
    def warmup(self, max_pages: int) -> list[int]:
        """Compiles every program transfers of up to ``max_pages`` pages will run.

        Offloads, loads (either gate) and digests, for every slice class and every
        bucket of page counts up to ``max_pages`` (counts are padded to powers of two),
        so the first request of each size does not pay for compiling. On XLA:CPU most
        programs loop over the pages and serve every bucket: 32 layers and
        ``max_pages=64`` compile 2 (raw) to 9 (staged) programs, 1.5-5 s on a 2-core CPU.

        An engine keeps the compiled programs across processes with JAX's persistent
        compilation cache, configured before the first compile::

            jax.config.update("jax_compilation_cache_dir", "/path/to/cache")
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

        A second process's warm-up then loads the programs instead of compiling them
        (for 32 layers and ``max_pages=64`` on a 2-core CPU: 0.4-1.4 s). Pallas kernels
        run in interpret mode (``path="pallas"`` off TPU) hold host callbacks, which the
        cache does not keep: those few are compiled again.

        Returns:
          The buckets compiled.

        Example:
            >>> import jax.numpy as jnp, kvxfer
            >>> mgr = kvxfer.KVCacheManager([jnp.zeros((8, 128))], num_host_blocks=4)
            >>> mgr.warmup(5)
            [1, 2, 4, 8]
            >>> mgr.close()
        """
        self._checks.open()
        max_pages = check_int(max_pages, "max_pages", minimum=1)
        buckets = [1 << i for i in range(bucket(max_pages).bit_length())]

        # The movers say what to compile; XLA compiles with the GIL released, so the
        # programs compile side by side, one per core, the largest buckets first.
        with deferred_compiles() as jobs:
            for b in reversed(buckets):
                for cls, mover in zip(self._plan.classes, self._movers):
                    mover.warmup([self._abstract[i][0] for i in cls.layers],
                                 [self._abstract[i][1] for i in cls.layers], b,
                                 self.integrity == "page")
        workers = max(1, min(len(jobs), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers, "kvxfer-warmup") as pool:
            for done in [pool.submit(own_context(job)) for job in jobs]:
                done.result()
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
        return self._host.is_valid(page)

    def read_block_bytes(self, page: PageRef, layer: int) -> bytes:
        """The host bytes of one layer of a page: every shard's block, shard 0 first.

        Gathered from the shards' ranges of the page (pages are shard-major: each
        shard's layers side by side), so this order does not depend on the page's.
        """
        return self._host.read_block_bytes(page, layer)

    def write_block_bytes(self, page: PageRef, layer: int,
                          data: bytes | bytearray | memoryview) -> None:
        """Replaces the host bytes of one layer of a page and re-digests them.

        A deliberate write: the new bytes become the page's truth, so a later load
        verifies against digests made on the host here, not on a device. To bring
        back a page from a tier below host memory use ``import_page``, which keeps
        the device-made digests.

        The bytes and their digests change as one step: a load, prefetch or export
        racing the write finds the page as it was or as written, never a mix.

        Args:
          page: a valid page.
          layer: the layer.
          data: exactly ``plan.class_of_layer(layer)[0].bytes_per_block`` bytes, in
            ``read_block_bytes``'s order (every shard's block, shard 0 first).

        Raises:
          TypeError: ``data`` is not bytes-like. ValueError: wrong length.
          PoolError: the page is stale or freed, or a load in flight or a prefetch
            holds it (naming the page; write once the load ends or the prefetch
            is released). Nothing is written then.
        """
        self._host.write_block_bytes(page, layer, data)

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
        return self._host.export_page(page)

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
        self._checks.open()
        return self._host.import_page(blob, key)

    def stats(self) -> dict[str, Any]:
        """Counters since the manager was made, as one snapshot.

        ``pages_offloaded`` / ``bytes_offloaded``, ``pages_loaded`` / ``bytes_loaded``
        (pages moved to the devices), ``pages_verified`` (in verified prefixes),
        ``pages_freed`` (proven bad and freed), ``mismatches`` (reason kind -> count),
        ``transfer_errors``, ``transfer_faults`` (pages a load's transfer delivered
        wrong while their host copies were intact: missed, kept),
        ``pages_exported`` / ``pages_imported``,
        ``imports_refused`` (reason -> count), ``host_copy_bytes`` (payload bytes the
        movers copied on the host on a transfer's path: numpy or memmove copies of
        kvxfer's own, not what a copy engine executes; 0 on ``dma`` and on the
        pinned mover's pure-JAX route), ``dma_fallbacks`` (DMA transfers that copied
        on XLA's stream though ``DmaOptions(stream="side")`` asked for the copy
        engine's own: ``budget``, past ``staging_bytes``; ``out_of_memory``, no device
        memory for the staging), ``dma_staging_bytes`` (device staging the DMA
        transfers of this process hold now, every device; a released prefetch's goes
        at the next transfer once its copies end), ``host_pages`` /
        ``host_free_pages``,
        and ``offload_seconds`` / ``load_seconds`` (count, sum, p50, p90, p99 of the
        time from the call to the transfer's end).
        """
        out = self._stats.snapshot()
        out["host_copy_bytes"] = sum(m.host_copied() for m in self._movers)
        fell = [m.fell_back() for m in self._movers]
        out["dma_fallbacks"] = {why: sum(f.get(why, 0) for f in fell)
                                for why in ("budget", "out_of_memory")}
        out["dma_staging_bytes"] = staging_bytes_held()
        out["host_pages"] = self._pool.num_slots
        out["host_free_pages"] = self._pool.num_free
        return out
