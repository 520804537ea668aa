"""The tpu-inference worker's chunk table: which kvxfer page each CPU chunk holds.

The scheduler names host chunks by id; kvxfer names pages by key. A chunk holds the
page of its last landed save (keyed by the chunk id and how often it was saved, so
a page of an earlier save is stale), is being written by a save in flight, or holds
nothing for a reason a load reports (never saved, a failed save, a dropped copy).
``HostChunks`` shows the chunks' bytes as the engine's CPU backend does.

Example:
    >>> table = ChunkTable(4)
    >>> table.begin([2]), table.page(2)
    ([4294967298], None)
    >>> table.fail([2, 9], "save refused"); table.pages([2], lambda page: True)
    ([], 'chunk 2: save refused')
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvxfer.hostpool import PageRef
from kvxfer.manager import OffloadHandle

__all__ = ["Save", "ChunkTable", "chunk_key", "HostChunks"]


@dataclasses.dataclass(eq=False)
class Save:
    """One request's save in flight: its offload and where its pages go."""

    handle: OffloadHandle
    req_id: str
    chunks: list[int]
    is_final_save: bool


def chunk_key(chunk_id: int, epoch: int) -> int:
    """The kvxfer key of a chunk's page: the chunk id and how often it was saved."""
    return ((epoch & 0xFFFFFFFF) << 32) | (chunk_id & 0xFFFFFFFF)


class ChunkTable:
    """The page each of ``num_chunks`` chunks holds, the save writing it, or why it
    holds nothing; safe to use from any thread."""

    def __init__(self, num_chunks: int) -> None:
        self.num_chunks = num_chunks
        self._lock = threading.Lock()
        self._pages: dict[int, PageRef] = {}   # chunk id -> its committed page
        self._dropped: dict[int, str] = {}     # chunk id -> why it holds nothing
        self._epoch: dict[int, int] = {}       # chunk id -> saves into it so far
        self._inflight: dict[int, Save] = {}   # chunk id -> the save writing it

    def __len__(self) -> int:
        """Chunks holding a committed page."""
        return len(self._pages)

    def page(self, chunk: int) -> PageRef | None:
        """The page a chunk holds (None: never saved, in flight, or dropped)."""
        with self._lock:
            return self._pages.get(int(chunk))

    def saves_writing(self, chunks: Sequence[int]) -> list[Save]:
        """The saves in flight into any of ``chunks``, each once."""
        with self._lock:
            found = {id(s): s for c in chunks if (s := self._inflight.get(c)) is not None}
        return list(found.values())

    def begin(self, chunks: Sequence[int]) -> list[int]:
        """The keys of a new save into ``chunks``; their old pages are stale from now."""
        keys = []
        with self._lock:
            for c in chunks:
                self._epoch[c] = self._epoch.get(c, 0) + 1
                keys.append(chunk_key(c, self._epoch[c]))
                self._pages.pop(c, None)
                self._dropped.pop(c, None)
        return keys

    def start(self, save: Save) -> None:
        """Marks ``save``'s chunks as being written by it."""
        with self._lock:
            for c in save.chunks:
                self._inflight[c] = save

    def land(self, save: Save, pages: list[PageRef] | None, error: BaseException | None
             ) -> None:
        """Commits a landed save's pages (or, failed, drops its chunks), except in
        chunks saved again since: the newer save owns those."""
        with self._lock:
            for k, c in enumerate(save.chunks):
                if self._inflight.get(c) is not save:
                    continue
                del self._inflight[c]
                if pages is not None:
                    self._pages[c] = pages[k]
                else:
                    self._dropped[c] = f"save failed: {error}"

    def fail(self, chunks: Sequence[int], reason: str) -> None:
        """The chunks (those in range and not in flight) hold nothing, for ``reason``."""
        with self._lock:
            for c in chunks:
                c = int(c)
                if 0 <= c < self.num_chunks and c not in self._inflight:
                    self._pages.pop(c, None)
                    self._dropped[c] = reason

    def pages(self, chunks: Sequence[int], is_valid: Callable[[PageRef], bool]
              ) -> tuple[list[PageRef], str | None]:
        """The pages of ``chunks`` up to the first that holds no valid page, and why
        that one does not (None when every chunk does)."""
        out: list[PageRef] = []
        with self._lock:
            for c in chunks:
                page = self._pages.get(c)
                if page is None or not is_valid(page):
                    return out, f"chunk {c}: {self._dropped.get(c, 'not in host memory')}"
                out.append(page)
        return out, None

    def drop(self, dropped: Sequence[tuple[int, PageRef, str]]) -> int:
        """Drops each ``(chunk, page, reason)`` whose chunk still holds ``page``; how
        many were dropped."""
        count = 0
        with self._lock:
            for c, page, reason in dropped:
                if self._pages.get(c) == page:
                    del self._pages[c]
                    self._dropped[c] = reason
                    count += 1
        return count


class HostChunks:
    """Read-only view of the saved chunks, shaped as the engine's ``LocalCPUBackend``.

    ``get(chunk)`` is the chunk's host bytes as ``[layers, *block]`` (hybrid models: a
    list per shape group, as the engine stacks them), or None; for inspection and the
    engine's own tests, unsharded caches only.
    """

    def __init__(self, table: ChunkTable, worker: Any) -> None:
        self._table = table
        self._worker = worker  # the KvxferOffloadWorker: its manager, runner and groups

    @property
    def num_saved_cpu_chunks(self) -> int:
        return len(self._table)

    def get(self, chunk_id: int) -> Any:
        w = self._worker
        page = self._table.page(chunk_id)
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
