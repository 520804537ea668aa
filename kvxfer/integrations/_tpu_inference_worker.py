"""The tpu-inference connector worker: saves and verified loads of the engine's chunks.

``kvxfer.integrations.tpu_inference`` describes the contract with the engine and
re-exports ``KvxferOffloadWorker``; this module holds the worker, its chunk
bookkeeping (which kvxfer page each CPU chunk holds, what is in flight, why a
chunk holds nothing) and a read-only view of the chunks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer._check import check_timeout
from kvxfer.engine import TransferError
from kvxfer.hostpool import PageRef
from kvxfer.integrations._tpu_inference_chunks import ChunkTable, HostChunks, Save
from kvxfer.integrations._tpu_inference_stats import new_stats
from kvxfer.manager import KVCacheManager, OffloadHandle

__all__ = ["KvxferOffloadWorker"]

_DEFAULT_CHUNKS = 1024  # tpu-inference's TPU_OFFLOAD_NUM_CPU_CHUNKS default
_DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # its TPU_OFFLOAD_BLOCK_SIZE_BUCKETS default

log = logging.getLogger("kvxfer")


@dataclasses.dataclass(eq=False)
class _Load:
    """One request's load of a step: its chunks, blocks, pages and staging."""

    req_id: str
    src: list[int]
    dst: list[int]
    pages: list[PageRef]
    reason: str | None  # why the pages stop short of src (a chunk holding nothing)
    staged: Any = None  # its prefetch handle, until its load takes it


class KvxferOffloadWorker:
    """tpu-inference's ``TPUOffloadConnectorWorker``, every transfer made and verified by kvxfer.

    Saves (``start_save_kv``, once per step) enqueue one offload per request on the
    calling thread and return: the chunk holds the blocks' bytes as they were at the
    call, whatever the runner computes or donates next. A save lands in
    ``finished_save_chunks`` once its host copy is complete. Loads (``start_load_kv``)
    are blocking, as the engine's: every request's pages staged first, then one
    verified load per request into ``runner.kv_caches``; blocks not verified go to
    ``get_block_ids_with_load_errors``.
    No engine call raises for a failed transfer: it is logged and reported.

    Args:
      vllm_config: vLLM's config (``cache_config.block_size`` is read).
      connector: the connector whose ``_get_connector_metadata()`` holds the step's
        ``TPUOffloadConnectorMetadata``.
      num_cpu_chunks: host chunks (default: ``TPU_OFFLOAD_NUM_CPU_CHUNKS``, else 1024).
      precompile: compile the transfers in ``register_runner`` (default: unless
        ``TPU_OFFLOAD_SKIP_JAX_PRECOMPILE=1``).
      integrity: ``"page"`` (default) digests every chunk; ``"off"`` skips digests.
      path: kvxfer's mover choice (``KVCacheManager(path=)``).
      host_memory_budget: bytes (``KVCacheManager(host_memory_budget=)``).
      pinned: host chunks in ``pinned_host`` memory (``KVCacheManager(pinned=)``;
        default: ``False`` when ``TPU_OFFLOAD_USE_UNPINNED_HOST=1``, as the engine
        keeps its chunks in unpinned host memory then, else kvxfer's choice).
        ``host_memory_kind`` says where they are once ``register_runner`` has run.

    Raises:
      ValueError: a non-positive ``num_cpu_chunks``.
    """

    def __init__(self, vllm_config: Any, connector: Any, *, num_cpu_chunks: int | None = None,
                 precompile: bool | None = None, integrity: str = "page",
                 path: str = "auto", host_memory_budget: int | None = None,
                 pinned: bool | None = None) -> None:
        if num_cpu_chunks is None:
            num_cpu_chunks = int(os.getenv("TPU_OFFLOAD_NUM_CPU_CHUNKS", _DEFAULT_CHUNKS))
        if isinstance(num_cpu_chunks, bool) or not isinstance(num_cpu_chunks, (int, np.integer)) \
                or num_cpu_chunks <= 0:
            raise ValueError(f"num_cpu_chunks must be a positive int. Got {num_cpu_chunks!r}")
        if precompile is None:
            precompile = not bool(int(os.getenv("TPU_OFFLOAD_SKIP_JAX_PRECOMPILE", "0")))
        if pinned is None and bool(int(os.getenv("TPU_OFFLOAD_USE_UNPINNED_HOST", "0"))):
            pinned = False
        self.vllm_config = vllm_config
        self.connector = connector
        self.block_size = int(vllm_config.cache_config.block_size)
        self.num_cpu_chunks = int(num_cpu_chunks)
        self.use_bucketed_swap_ops = bool(precompile)
        self.runner: Any = None
        self.mesh: Any = None
        self._options = dict(integrity=integrity, path=path,
                             host_memory_budget=host_memory_budget, pinned=pinned)
        #: Where the host chunks live: ``"pinned_host"`` when every class's pool is in
        #: pinned memory, else ``"unpinned_host"`` (set by ``register_runner``).
        self.host_memory_kind: str | None = None
        self._mgr: KVCacheManager | None = None
        self._lock = threading.Lock()  # the pending saves and the counters
        # Saves taken from the pending list and not yet published (another thread may
        # be publishing them): wait_for_saves waits for them too.
        self._publishing = 0
        self._published = threading.Condition(self._lock)
        # The reports (offload_stats, finished_save_reqs): saves are published from any
        # thread that polls, while the engine thread reads and resets them.
        self._report_lock = threading.Lock()
        self._table = ChunkTable(self.num_cpu_chunks)
        self._pending_save_futures: list[tuple[OffloadHandle, list[Save]]] = []
        self._load_errors: set[int] = set()
        self._processed_save_for_step = False
        self.finished_save_reqs: set[str] = set()
        self.offload_stats = new_stats()
        self.cpu_backend = HostChunks(self._table, self)
        self.grouped_layer_indices: list[list[int]] = []
        self._counts = {"saves_failed": 0, "loads_failed": 0, "blocks_load_errors": 0,
                        "chunks_dropped": 0}

    # -- what the engine and its tests read ----------------------------------------

    @property
    def manager(self) -> KVCacheManager:
        """The ``KVCacheManager`` moving the chunks (stats, fault injection).

        Raises:
          RuntimeError: ``register_runner`` has not run.
        """
        if self._mgr is None:
            raise RuntimeError("KvxferOffloadWorker: register_runner() has not run")
        return self._mgr

    def page_of(self, chunk_id: int) -> PageRef | None:
        """The kvxfer page a chunk holds (None: never saved, in flight, or dropped)."""
        return self._table.page(chunk_id)

    def stats(self) -> dict[str, Any]:
        """The worker's failure counters beside the manager's ``stats()``."""
        return {**self._counts, "manager": self.manager.stats()}

    def close(self) -> None:
        """Closes the manager (waits for transfers in flight)."""
        if self._mgr is not None:
            self._mgr.close()

    # -- registration ------------------------------------------------------------------

    def register_runner(self, runner: Any) -> None:
        """Takes the runner's caches and builds the manager; precompiles if asked.

        Raises:
          ValueError: the runner has no KV caches.
          BudgetError: the host chunks exceed the budget (nothing allocated).
        """
        caches = list(runner.kv_caches or [])
        if not caches:
            raise ValueError("KvxferOffloadWorker registered with no KV caches.")
        self.runner = runner
        self.mesh = getattr(runner, "mesh", None)
        self.devices = getattr(runner, "devices", None)
        first = caches[0]
        self.num_layers = len(caches)
        self.shape = list(first.shape)
        self.dtype = first.dtype
        self.device_sharding = first.sharding
        self.num_kv_blocks = int(first.shape[0])
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, c in enumerate(caches):  # the engine's grouping of hybrid layers
            groups.setdefault(tuple(c.shape[2:]), []).append(i)
        self.grouped_layer_indices = [groups[s] for s in sorted(groups, key=str)]
        self._mgr = KVCacheManager(caches, num_host_blocks=self.num_cpu_chunks,
                                   **self._options)  # type: ignore[arg-type]
        self.host_memory_kind = ("pinned_host" if all(p.pinned for p in self._mgr.host_pool.pools)
                                 else "unpinned_host")
        log.info("kvxfer offload worker: %d layers %s %s, %d chunks, paths %s",
                 self.num_layers, self.shape, self.dtype, self.num_cpu_chunks,
                 sorted(set(self._mgr.paths)))
        if self.use_bucketed_swap_ops:
            self.precompile()

    def precompile(self, max_blocks: int | None = None) -> list[int]:
        """Compiles every save and load of up to ``max_blocks`` blocks; moves nothing.

        Default: the largest of ``TPU_OFFLOAD_BLOCK_SIZE_BUCKETS`` (else 64), capped by
        the device blocks and the host chunks. The caches are not touched.

        Returns:
          The block-count buckets compiled (powers of two).
        """
        if max_blocks is None:
            raw = os.getenv("TPU_OFFLOAD_BLOCK_SIZE_BUCKETS", "")
            buckets = [int(x) for x in raw.replace(",", " ").split()] or list(_DEFAULT_BUCKETS)
            max_blocks = max(buckets)
        cap = min(int(max_blocks), self.num_kv_blocks, self.num_cpu_chunks)
        return self.manager.warmup(cap) if cap > 0 else []

    def _precompile_kv_swap_operations(self) -> None:
        """The engine's name for ``precompile()``."""
        self.precompile()

    # -- saves ---------------------------------------------------------------------------

    def start_save_kv(self) -> None:
        """Starts this step's saves (idempotent until the next ``start_load_kv``).

        Every device program is enqueued before this returns. A request whose save
        spec does not fit its blocks, or whose offload is refused, is logged and saves
        nothing; its chunks then hold nothing and a load of them is a load error.
        """
        if self._processed_save_for_step:
            return
        self._processed_save_for_step = True
        metadata = self.connector._get_connector_metadata()
        for meta in getattr(metadata, "requests_meta", None) or ():
            spec = getattr(meta, "save_spec", None)
            if spec is None:
                continue
            if spec.skip_save:
                if spec.is_final_save:
                    self._finish_save(meta.req_id, [], True)
                continue
            try:
                plan = self._save_plan(meta)
            except ValueError as e:
                log.error("kvxfer offload worker: request %s: %s; nothing saved",
                          meta.req_id, e)
                self._fail_chunks(list(spec.dst_chunks), f"save refused: {e}")
                self._counts["saves_failed"] += 1
                plan = None
            if plan is None:
                if spec.is_final_save:
                    self._finish_save(meta.req_id, [], True)
                continue
            self._save(meta.req_id, *plan, spec.is_final_save)

    def _save_plan(self, meta: Any) -> tuple[list[int], list[int]] | None:
        """The blocks and chunks to save, None when there is nothing new to save."""
        spec = meta.save_spec
        blocks = [int(b) for b in spec.src_blocks]
        chunks = [int(c) for c in spec.dst_chunks]
        n_tokens = int(spec.num_total_tokens) - int(spec.num_skip_leading_tokens)
        if n_tokens <= 0 or not blocks:
            return None
        if len(blocks) != len(chunks):
            raise ValueError(f"src_blocks ({len(blocks)}) and dst_chunks ({len(chunks)}) "
                             "differ in length")
        _require_contiguous(blocks, list(meta.local_block_ids), "src_blocks")
        for c in chunks:
            if not 0 <= c < self.num_cpu_chunks:
                raise ValueError(f"chunk id {c} outside [0, {self.num_cpu_chunks})")
        if len(set(chunks)) != len(chunks):
            raise ValueError(f"duplicate chunk ids in dst_chunks {chunks}")
        return blocks, chunks

    def _save(self, req_id: str, blocks: list[int], chunks: list[int], final: bool) -> None:
        # kvxfer refuses two offloads writing one slot: a chunk saved again while its
        # last save is in flight waits for that one (the scheduler rarely does this).
        waits = self._table.saves_writing(chunks)
        for s in waits:
            s.handle.exception()
        if waits:
            self._process_completed_saves()
        keys = self._table.begin(chunks)
        try:
            handle = self.manager.offload(list(self.runner.kv_caches), blocks, keys,
                                          slots=chunks)
        except (ValueError, TypeError, MemoryError, TransferError) as e:
            # PoolError (a slot being read) is a ValueError; nothing was written.
            log.error("kvxfer offload worker: request %s: save of blocks %s to chunks %s "
                      "failed: %s", req_id, blocks, chunks, e)
            self._counts["saves_failed"] += 1
            self._fail_chunks(chunks, f"save failed: {e}")
            self._finish_save(req_id, chunks, final)
            return
        save = Save(handle, req_id, chunks, final)
        self._table.start(save)  # before a poller can see it pending
        with self._lock:
            self._pending_save_futures.append((handle, [save]))

    def _process_completed_saves(self) -> None:
        """Publishes the saves that have landed (the engine's name)."""
        # One done() read per handle: a save landing between two reads would be in
        # neither list and never published.
        with self._lock:
            done, pending = [], []
            for e in self._pending_save_futures:
                (done if e[0].done() else pending).append(e)
            self._pending_save_futures = pending
            self._publishing += len(done)
        for handle, saves in done:
            try:
                for save in saves:
                    self._publish(handle, save)
            finally:
                with self._published:
                    self._publishing -= 1
                    self._published.notify_all()

    def _publish(self, handle: OffloadHandle, save: Save) -> None:
        try:
            pages: list[PageRef] | None = handle.result()
            error = None
        except Exception as e:  # noqa: BLE001 — a failed save is reported, never raised
            pages, error = None, e
        if error is not None:
            log.error("kvxfer offload worker: request %s: save to chunks %s failed: %s",
                      save.req_id, save.chunks, error)
            with self._lock:
                self._counts["saves_failed"] += 1
        self._table.land(save, pages, error)
        self._finish_save(save.req_id, save.chunks, save.is_final_save)

    def _finish_save(self, req_id: str, chunks: list[int], final: bool) -> None:
        # A failed save is still reported finished: the scheduler frees its staging
        # slots, and the chunk, holding nothing, is a load error if it is ever loaded.
        with self._report_lock:
            if chunks:
                self.offload_stats.record_save(req_id, chunks)
            if final:
                self.finished_save_reqs.add(req_id)

    def _fail_chunks(self, chunks: Sequence[int], reason: str) -> None:
        self._table.fail(chunks, reason)

    def wait_for_saves(self, timeout: float | None = None) -> None:
        """Blocks until every save started so far has landed and is published, by this
        thread or by another that is publishing it (``timeout``: seconds per wait).

        Raises:
          TypeError, ValueError: ``timeout`` is not None or a finite number >= 0.
        """
        timeout = check_timeout(timeout)
        with self._lock:
            handles = [h for h, _ in self._pending_save_futures]
        for h in handles:
            try:
                h.exception(timeout)
            except Exception:  # noqa: BLE001 — cancelled or failed: published as failed
                pass
        self._process_completed_saves()
        with self._published:
            self._published.wait_for(lambda: self._publishing == 0, timeout)

    # -- loads ---------------------------------------------------------------------------

    def start_load_kv(self, fwd_ctx: Any = None, **kwargs: Any) -> None:
        """Loads this step's chunks into ``runner.kv_caches``, verified, before returning.

        Every request's pages are staged first (``mgr.prefetch``: host-to-device copies
        started, no cache touched), then each request is loaded and verified in turn,
        so the copies of later requests run while earlier ones scatter and verify.
        Blocks not verified (a chunk never saved, dropped, overwritten, or whose digest
        failed; a transfer failure) are reported by ``get_block_ids_with_load_errors``;
        the chunks are recorded as loaded either way, so the scheduler unpins them.
        Also starts a new step for ``start_save_kv``.

        Raises:
          RuntimeError: ``register_runner`` has not run.
        """
        self._processed_save_for_step = False
        metadata = self.connector._get_connector_metadata()
        metas = getattr(metadata, "requests_meta", None) or ()
        if not metas:
            return
        if self._mgr is None:  # the engine's worker raises here too
            raise RuntimeError("KV caches not registered: register_runner() must run first")
        loads = []
        for meta in metas:
            spec = getattr(meta, "load_spec", None)
            if spec is None or not spec.can_load:
                continue
            if int(spec.num_matched_tokens) - int(spec.num_skip_leading_tokens) <= 0:
                continue
            load = self._plan_load(meta.req_id, [int(b) for b in spec.dst_blocks],
                                   [int(c) for c in spec.src_chunks],
                                   list(meta.local_block_ids))
            if load is not None:
                loads.append(load)
        try:
            for load in loads:
                load.staged = self._prefetch(load)
            for load in loads:
                self._finish_load(load)
        finally:
            for load in loads:  # a load refused before it took its handle: unpin
                if load.staged is not None:
                    load.staged.release()

    def _plan_load(self, req_id: str, dst: list[int], src: list[int],
                   local: list[int]) -> _Load | None:
        """One request's load: its chunks' pages (None when reported as failed already)."""
        try:
            if not dst:
                raise ValueError("no dst_blocks to load")
            if len(src) < len(dst):
                raise ValueError(f"{len(src)} src_chunks for {len(dst)} dst_blocks")
            _require_contiguous(dst, local, "dst_blocks")
        except ValueError as e:
            log.error("kvxfer offload worker: request %s: bad load spec: %s", req_id, e)
            self._report_load(req_id, src[:len(dst)], dst, 0, {0: str(e)})
            return None
        src = src[:len(dst)]
        waits = self._table.saves_writing(src)
        for s in waits:  # the scheduler loads only saved chunks; be sure
            s.handle.exception()
        if waits:
            self._process_completed_saves()
        pages, reason = self._table.pages(src, self.manager.is_valid)
        return _Load(req_id, src, dst, pages, reason)

    def _prefetch(self, load: _Load) -> Any:
        """Stages a request's pages for its load (None: nothing to stage, or it failed
        and the load stages them itself)."""
        if not load.pages:
            return None
        try:
            return self.manager.prefetch(load.pages)
        except (TransferError, ValueError, TypeError) as e:  # PoolError is a ValueError
            log.warning("kvxfer offload worker: request %s: staging its load failed (%s); "
                        "the load stages it", load.req_id, e)
            return None

    def _finish_load(self, load: _Load) -> None:
        verified, reasons = 0, {}
        if load.pages:
            staged, load.staged = load.staged, None
            try:
                verified, freed, reasons = self._load_pages(
                    load.req_id, load.pages, load.dst[:len(load.pages)], staged)
            finally:
                if staged is not None:
                    staged.release()  # a no-op once the load consumed it
            self._drop(load.src, load.pages, freed, reasons)
        if load.reason is not None and verified == len(load.pages):
            reasons[len(load.pages)] = load.reason  # the load stopped short at a missing chunk
        self._report_load(load.req_id, load.src, load.dst, verified, reasons)

    def _load_pages(self, req_id: str, pages: list[PageRef], dst: list[int],
                    staged: Any = None) -> tuple[int, tuple[int, ...], dict[int, str]]:
        """(verified prefix, request indices freed, reasons) of one verified load."""
        try:
            new, handle = self.manager.load(list(self.runner.kv_caches), pages, dst,
                                            keys=[p.key for p in pages], gate="all",
                                            prefetched=staged)
        except TransferError as e:
            if e.kv_caches is not None:
                self.runner.kv_caches = list(e.kv_caches)
            return 0, (), {0: f"transfer error: {e}"}
        except (ValueError, TypeError) as e:  # refused before anything moved
            return 0, (), {0: f"load refused: {e}"}
        self.runner.kv_caches = new
        try:
            result = handle.result()
        except Exception as e:  # noqa: BLE001 — the caches returned are usable, unverified
            return 0, (), {0: f"transfer error: {e}"}
        return result.verified_prefix, tuple(result.freed_pages), dict(result.reasons)

    def _drop(self, src: list[int], pages: list[PageRef], freed: tuple[int, ...],
              reasons: dict[int, str]) -> None:
        # A chunk whose host copy failed its own digests is gone: later loads of it are
        # load errors, never its bytes.
        dropped = self._table.drop([(src[j], pages[j],
                                     f"dropped: {reasons.get(j, 'host copy bad')}")
                                    for j in freed])
        with self._lock:
            self._counts["chunks_dropped"] += dropped

    def _report_load(self, req_id: str, src: list[int], dst: list[int], verified: int,
                     reasons: dict[int, str]) -> None:
        bad = dst[verified:]
        if bad:
            self._load_errors.update(bad)
            self._counts["loads_failed"] += 1
            self._counts["blocks_load_errors"] += len(bad)
            log.warning("kvxfer offload worker: request %s: %d of %d blocks verified; "
                        "blocks %s reported as load errors: %s", req_id, verified,
                        len(dst), bad, reasons)
        if src:
            with self._report_lock:
                self.offload_stats.record_load(req_id, src)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device block ids whose load failed since the last call (then cleared).

        vLLM's ``KVConnectorBase_V1.get_block_ids_with_load_errors``: the scheduler
        recomputes these blocks.
        """
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- reporting -----------------------------------------------------------------------

    def get_kv_connector_stats(self) -> Any:
        """This step's finished chunks (``KVOffloadConnectorStats``), or None if none."""
        self._process_completed_saves()
        with self._report_lock:
            if self.offload_stats.is_empty():
                return None
            return self.offload_stats.clone_and_reset()

    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(finished saves, finished loads)``: requests whose final save has landed.

        Runs this step's saves if ``start_save_kv`` has not (the engine may skip the
        forward pass of a request's last step). Loads are synchronous: none finish
        later, so the second set is empty, as the engine's worker returns it.
        """
        self.start_save_kv()
        self._process_completed_saves()
        with self._report_lock:
            done, self.finished_save_reqs = self.finished_save_reqs, set()
        return done, set()

    def __repr__(self) -> str:
        state = "unregistered" if self._mgr is None else f"paths={sorted(set(self._mgr.paths))}"
        return (f"KvxferOffloadWorker({len(self._table)}/{self.num_cpu_chunks} chunks, "
                f"{state})")


def _require_contiguous(blocks: list[int], local: list[int], name: str) -> None:
    """The engine's check: ``blocks`` is a contiguous run of the request's blocks."""
    try:
        first = local.index(blocks[0])
    except ValueError:
        raise ValueError(f"{name} {blocks} contains blocks not present in "
                         f"local_block_ids {local}") from None
    if local[first:first + len(blocks)] != blocks:
        raise ValueError(f"{name} {blocks} is not a contiguous run of local_block_ids "
                         f"{local}")

