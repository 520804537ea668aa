"""vLLM TPU (tpu-inference) CPU offload: a connector worker whose transfers kvxfer makes.

``KvxferOffloadWorker`` is a drop-in for tpu-inference's
``TPUOffloadConnectorWorker`` (``tpu_inference.offload.tpu_offload_connector``): the
same constructor ``(vllm_config, connector)`` and the calls the connector and the
model runner make (``register_runner``, ``start_save_kv``, ``start_load_kv``,
``get_finished``, ``get_kv_connector_stats``), reading the same work orders
(``TPUOffloadConnectorMetadata.requests_meta``: ``TPUReqMeta`` with ``SaveSpec`` /
``LoadSpec``). Underneath, one ``kvxfer.KVCacheManager`` over ``runner.kv_caches``
moves the blocks with integrity on: the scheduler's CPU chunk ids are kvxfer slots
(``offload(..., slots=chunk_ids)``), a chunk saved again is overwritten in place (the
old page's refs go stale), and every load is verified on the device before the step
that reads it.

Loads are staged with ``mgr.prefetch`` inside ``start_load_kv``: the pages of every
request of the step before the first load, so the host-to-device copies of later
requests run while earlier ones scatter and verify (the scheduler's staging budget
bounds what one step stages). There is no earlier point, nor another thread, to
stage them from, as sglang-jax's controller does with ``stage_load`` ahead of
``flush_load``: vLLM's model runner binds the step's connector metadata and calls
``start_load_kv`` back to back on the thread that runs the forward pass
(tpu-inference's ``TPUModelRunner._execute_model``, through vLLM's
``KVConnectorModelRunnerMixin.maybe_get_kv_connector_output``), so which chunks a
step loads is known only there; and tpu-inference's scheduler asks for synchronous
loads (``TPUOffloadConnectorScheduler.get_num_new_matched_tokens`` returns
``load_kv_async=False``), so the step's forward pass reads them as soon as the call
returns and no load may finish later through ``get_finished``.

What the engine sees of a bad block: ``get_block_ids_with_load_errors()`` returns the
device block ids a load did not verify (the failing block and every later block of
that request), the path vLLM's scheduler takes to recompute them. The chunk is still
reported in ``finished_load_chunks`` (the load is over, the scheduler unpins it). A
chunk whose host copy failed its own digests is dropped, so every later load of it is
a load error too; a delivery fault over an intact host copy keeps the chunk.

Checked against tpu-inference commit b8692ff01fa191343836996c27a39dc95f008b88
(2026-08-22). Neither vLLM nor tpu-inference is imported by this module:
the worker reads only ``vllm_config.cache_config.block_size``, the connector's
``_get_connector_metadata()``, ``runner.kv_caches`` (reassigned as the engine's worker
does) and duck-typed work orders, and returns tpu-inference's
``KVOffloadConnectorStats`` when the engine has loaded it (a look in ``sys.modules``,
never an import), else ``OffloadStats`` with the same ``data``. The connector
selectable through ``kv_transfer_config`` (``KvxferOffloadConnector``) is built on first
access, importing tpu-inference then.

Example:
    >>> import types, jax.numpy as jnp
    >>> from kvxfer.integrations.tpu_inference import KvxferOffloadWorker
    >>> meta = types.SimpleNamespace(requests_meta=[])
    >>> conn = types.SimpleNamespace(_get_connector_metadata=lambda: meta)
    >>> cfg = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=4))
    >>> w = KvxferOffloadWorker(cfg, conn, num_cpu_chunks=8, precompile=False)
    >>> runner = types.SimpleNamespace(kv_caches=[jnp.ones((16, 4, 2, 2, 128))] * 2)
    >>> w.register_runner(runner)
    >>> save = types.SimpleNamespace(num_skip_leading_tokens=0, num_total_tokens=8,
    ...     src_blocks=[3, 5], dst_chunks=[0, 1], is_final_save=True, skip_save=False)
    >>> meta.requests_meta = [types.SimpleNamespace(req_id="a", token_ids=list(range(8)),
    ...     local_block_ids=[3, 5], save_spec=save, load_spec=None)]
    >>> w.start_save_kv(); w.wait_for_saves()
    >>> w.get_finished()
    ({'a'}, set())
    >>> w.get_kv_connector_stats().data["finished_save_chunks"]
    {'a': [[0, 0], [1, 0]]}
    >>> w.close()
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from kvxfer.engine import TransferError
from kvxfer.hostpool import PageRef
from kvxfer.manager import KVCacheManager, OffloadHandle

__all__ = ["KvxferOffloadWorker", "OffloadStats", "ENGINE_COMMIT"]

ENGINE_COMMIT = "b8692ff01fa191343836996c27a39dc95f008b88"
"""The tpu-inference commit this integration was checked against (2026-08-22)."""

_ENGINE_MODULE = "tpu_inference.offload.tpu_offload_connector"
_DEFAULT_CHUNKS = 1024  # tpu-inference's TPU_OFFLOAD_NUM_CPU_CHUNKS default
_DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # its TPU_OFFLOAD_BLOCK_SIZE_BUCKETS default

log = logging.getLogger("kvxfer")


class OffloadStats:
    """Finished chunks per request, as tpu-inference's ``KVOffloadConnectorStats``.

    ``data`` is ``{"finished_save_chunks": {req: [[chunk, process], ...]},
    "finished_load_chunks": {...}}``, the layout the engine's scheduler reads. Used
    when the engine's own class is not loaded (tests, a scheduler-less caller).
    """

    def __init__(self, data: dict[str, dict[str, list[list[int]]]] | None = None) -> None:
        self.data = data if data else {"finished_save_chunks": {}, "finished_load_chunks": {}}

    def record_save(self, req: str, saved_chunk_ids: Sequence[int]) -> None:
        """Records chunks of ``req`` saved by this process."""
        self._record("finished_save_chunks", req, saved_chunk_ids)

    def record_load(self, req: str, loaded_chunk_ids: Sequence[int]) -> None:
        """Records chunks of ``req`` whose load is over (verified or reported bad)."""
        self._record("finished_load_chunks", req, loaded_chunk_ids)

    def _record(self, kind: str, req: str, chunks: Sequence[int]) -> None:
        rank = jax.process_index()
        self.data[kind].setdefault(req, []).extend([int(c), rank] for c in chunks)

    def clone_and_reset(self) -> OffloadStats:
        """The stats so far; this object starts empty again."""
        old = copy.copy(self)
        self.data = {"finished_save_chunks": {}, "finished_load_chunks": {}}
        return old

    def is_empty(self) -> bool:
        """Nothing recorded since the last reset."""
        return not any(self.data[k] for k in ("finished_save_chunks", "finished_load_chunks"))

    def __repr__(self) -> str:
        return f"OffloadStats({self.data})"


def _new_stats() -> Any:
    # The engine's scheduler asserts isinstance(stats, KVOffloadConnectorStats): hand it
    # its own class whenever the engine has loaded it, without importing it ourselves.
    engine = sys.modules.get(_ENGINE_MODULE)
    cls = getattr(engine, "KVOffloadConnectorStats", None) if engine is not None else None
    return cls() if cls is not None else OffloadStats()


@dataclasses.dataclass(eq=False)
class _Save:
    """One request's save in flight: its offload and where its pages go."""

    handle: OffloadHandle
    req_id: str
    chunks: list[int]
    is_final_save: bool


@dataclasses.dataclass(eq=False)
class _Load:
    """One request's load of a step: its chunks, blocks, pages and staging."""

    req_id: str
    src: list[int]
    dst: list[int]
    pages: list[PageRef]
    reason: str | None  # why the pages stop short of src (a chunk holding nothing)
    staged: Any = None  # its prefetch handle, until its load takes it


class _HostChunks:
    """Read-only view of the saved chunks, shaped as the engine's ``LocalCPUBackend``.

    ``get(chunk)`` is the chunk's host bytes as ``[layers, *block]`` (hybrid models: a
    list per shape group, as the engine stacks them), or None; for inspection and the
    engine's own tests, unsharded caches only.
    """

    def __init__(self, worker: KvxferOffloadWorker) -> None:
        self._worker = worker

    @property
    def num_saved_cpu_chunks(self) -> int:
        return len(self._worker._chunks)

    def get(self, chunk_id: int) -> Any:
        w = self._worker
        page = w._chunks.get(int(chunk_id))
        if page is None or not w.manager.is_valid(page):
            return None
        caches = w.runner.kv_caches
        if any(c.num_shards > 1 for c in w.manager.plan.classes):
            raise NotImplementedError("host chunk views of sharded caches")
        layers = [np.frombuffer(w.manager.read_block_bytes(page, i), dtype=caches[i].dtype)
                  .reshape(caches[i].shape[1:]) for i in range(len(caches))]
        groups = w.grouped_layer_indices
        if len(groups) == 1:
            return np.stack(layers)
        return [np.stack([layers[i] for i in g]) for g in groups]


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
        self._lock = threading.Lock()
        # The reports (offload_stats, finished_save_reqs): saves are published from any
        # thread that polls, while the engine thread reads and resets them.
        self._report_lock = threading.Lock()
        self._chunks: dict[int, PageRef] = {}      # chunk id -> its committed page
        self._dropped: dict[int, str] = {}         # chunk id -> why it holds nothing
        self._epoch: dict[int, int] = {}           # chunk id -> saves into it so far
        self._inflight: dict[int, _Save] = {}      # chunk id -> the save writing it
        self._pending_save_futures: list[tuple[OffloadHandle, list[_Save]]] = []
        self._load_errors: set[int] = set()
        self._processed_save_for_step = False
        self.finished_save_reqs: set[str] = set()
        self.offload_stats = _new_stats()
        self.cpu_backend = _HostChunks(self)
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
        with self._lock:
            return self._chunks.get(int(chunk_id))

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
        waits = {id(s): s for c in chunks if (s := self._inflight.get(c)) is not None}
        for s in waits.values():
            s.handle.exception()
        if waits:
            self._process_completed_saves()
        with self._lock:
            keys = []
            for c in chunks:
                self._epoch[c] = self._epoch.get(c, 0) + 1
                keys.append(_key(c, self._epoch[c]))
                self._chunks.pop(c, None)  # overwritten: the old page is stale from now
                self._dropped.pop(c, None)
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
        save = _Save(handle, req_id, chunks, final)
        with self._lock:
            for c in chunks:
                self._inflight[c] = save
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
        for handle, saves in done:
            for save in saves:
                self._publish(handle, save)

    def _publish(self, handle: OffloadHandle, save: _Save) -> None:
        try:
            pages: list[PageRef] | None = handle.result()
            error = None
        except Exception as e:  # noqa: BLE001 — a failed save is reported, never raised
            pages, error = None, e
        if error is not None:
            log.error("kvxfer offload worker: request %s: save to chunks %s failed: %s",
                      save.req_id, save.chunks, error)
        with self._lock:
            if error is not None:
                self._counts["saves_failed"] += 1
            for k, c in enumerate(save.chunks):
                if self._inflight.get(c) is not save:
                    continue  # saved again since: the newer save owns the chunk
                del self._inflight[c]
                if pages is not None:
                    self._chunks[c] = pages[k]
                else:
                    self._dropped[c] = f"save failed: {error}"
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
        with self._lock:
            for c in chunks:
                c = int(c)
                if 0 <= c < self.num_cpu_chunks and c not in self._inflight:
                    self._chunks.pop(c, None)
                    self._dropped[c] = reason

    def wait_for_saves(self, timeout: float | None = None) -> None:
        """Blocks until every save started so far has landed and is published."""
        with self._lock:
            handles = [h for h, _ in self._pending_save_futures]
        for h in handles:
            try:
                h.exception(timeout)
            except Exception:  # noqa: BLE001 — cancelled or failed: published as failed
                pass
        self._process_completed_saves()

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
        waits = {id(s): s for c in src if (s := self._inflight.get(c)) is not None}
        for s in waits.values():  # the scheduler loads only saved chunks; be sure
            s.handle.exception()
        if waits:
            self._process_completed_saves()
        pages: list[PageRef] = []
        reason = None
        with self._lock:
            for c in src:
                page = self._chunks.get(c)
                if page is None or not self.manager.is_valid(page):
                    reason = self._dropped.get(c, "not in host memory")
                    reason = f"chunk {c}: {reason}"
                    break
                pages.append(page)
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
        with self._lock:
            for j in freed:
                c = src[j]
                if self._chunks.get(c) == pages[j]:
                    del self._chunks[c]
                    self._dropped[c] = f"dropped: {reasons.get(j, 'host copy bad')}"
                    self._counts["chunks_dropped"] += 1

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
        return (f"KvxferOffloadWorker({len(self._chunks)}/{self.num_cpu_chunks} chunks, "
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


def _key(chunk_id: int, epoch: int) -> int:
    """The kvxfer key of a chunk's page: the chunk id and how often it was saved."""
    return ((epoch & 0xFFFFFFFF) << 32) | (chunk_id & 0xFFFFFFFF)


@functools.lru_cache(maxsize=4)
def _connector_class(engine: Any) -> type:
    base = engine.TPUOffloadConnector
    role_enum = engine.KVConnectorRole

    class KvxferOffloadConnector(base):  # type: ignore[misc, valid-type]
        """tpu-inference's ``TPUOffloadConnector`` with ``KvxferOffloadWorker`` as its worker."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            # The engine's __init__ would build its own worker (a CPU backend and a
            # thread pool): run its base class's and its checks instead.
            engine.KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
            parallel = vllm_config.parallel_config
            if parallel.pipeline_parallel_size > 1:
                raise ValueError("Pipeline Parallelism (PP) is not supported with KV cache "
                                 f"offloading yet. pipeline_parallel_size="
                                 f"{parallel.pipeline_parallel_size}")
            if parallel.data_parallel_size > 1:
                raise ValueError("Data Parallelism (DP) is not supported with KV cache "
                                 f"offloading yet. data_parallel_size="
                                 f"{parallel.data_parallel_size}")
            if role == role_enum.SCHEDULER:
                self.connector_scheduler = engine.TPUOffloadConnectorScheduler(vllm_config)
                self.connector_worker = None
            else:
                self.connector_scheduler = None
                self.connector_worker = KvxferOffloadWorker(vllm_config, self)

        def get_block_ids_with_load_errors(self) -> set[int]:
            if self.connector_worker is None:
                return set()
            return self.connector_worker.get_block_ids_with_load_errors()

    KvxferOffloadConnector.__module__ = __name__
    return KvxferOffloadConnector


def __getattr__(name: str) -> Any:
    # vLLM resolves kv_connector in kv_connector_module_path with getattr: the
    # connector class is built then, importing tpu-inference, never at import time.
    if name == "KvxferOffloadConnector":
        import importlib

        return _connector_class(importlib.import_module(_ENGINE_MODULE))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
