"""What the tpu-inference worker reports as finished: chunks per request.

``OffloadStats`` is shaped as tpu-inference's ``KVOffloadConnectorStats``; the
worker hands the engine its own class whenever the engine has loaded it.

Example:
    >>> stats = OffloadStats()
    >>> stats.record_save("a", [3, 4]); stats.is_empty()
    False
    >>> stats.clone_and_reset().data["finished_save_chunks"], stats.is_empty()
    ({'a': [[3, 0], [4, 0]]}, True)
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["OffloadStats", "ENGINE_MODULE", "new_stats"]

ENGINE_MODULE = "tpu_inference.offload.tpu_offload_connector"
"""The engine module that holds the connector and its stats class."""


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


def new_stats() -> Any:
    # The engine's scheduler asserts isinstance(stats, KVOffloadConnectorStats): hand it
    # its own class whenever the engine has loaded it, without importing it ourselves.
    engine = sys.modules.get(ENGINE_MODULE)
    cls = getattr(engine, "KVOffloadConnectorStats", None) if engine is not None else None
    return cls() if cls is not None else OffloadStats()
