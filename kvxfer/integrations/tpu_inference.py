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

This module holds the connector and re-exports the rest, each in a room of its own:
the worker (``_tpu_inference_worker``), its chunk table and host view
(``_tpu_inference_chunks``) and the finished-chunk reports (``_tpu_inference_stats``).

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

import functools
from typing import Any

from kvxfer.integrations._tpu_inference_stats import ENGINE_MODULE as _ENGINE_MODULE
from kvxfer.integrations._tpu_inference_stats import OffloadStats as OffloadStats
from kvxfer.integrations._tpu_inference_worker import KvxferOffloadWorker as KvxferOffloadWorker

__all__ = ["KvxferOffloadWorker", "OffloadStats", "ENGINE_COMMIT"]

ENGINE_COMMIT = "b8692ff01fa191343836996c27a39dc95f008b88"
"""The tpu-inference commit this integration was checked against (2026-08-22)."""


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
