"""``path="auto"`` on XLA:CPU: raw offloads when the caches are ready, pinned programs
for every load and for offloads behind pending writers.

The raw mover copies bytes of device buffers on the caller's thread, so it must wait
for whatever is still writing them (a decode step dispatched just before the call):
that would block the caller on device work queued before it. When any cache of the
class still has a pending writer (``not is_ready()``), this mover moves that offload
through the pinned mover's programs instead (enqueued, ordered by XLA after the
writers), over the same pool: the class's pool is allocated in ``pinned_host``
memory, which on XLA:CPU is host memory that ``pool.data`` views, so raw copies and
pinned programs read and write the same bytes.

Loads always run the pinned mover's in-place program (it reads the pages from the
pool, writes them into the donated caches and digests what it wrote): on XLA:CPU it
moves pages as fast as raw copies or faster (256 MiB per call: 1.0-1.75x, integrity
on or off) and the call returns once it is enqueued (3-7 ms against 43-107 ms of raw
copying on the caller's thread). Raw offloads stay: with digests they move 1.7x the
bytes per second of the pinned offload program.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from kvxfer.engine._batch import ShardedLayer
from kvxfer.engine._mover import LoadRequest
from kvxfer.engine._pinned import PinnedLoad, PinnedMover, PinnedOffload
from kvxfer.engine._raw import RawMover
from kvxfer.hostpool import ClassPool
from kvxfer.plan import SliceClass

__all__ = ["RawOrPinnedMover", "caches_ready"]


def caches_ready(layers: Sequence[ShardedLayer]) -> bool:
    """Whether no shard of ``layers`` has a pending writer (never blocks)."""
    return all(a.is_ready() for layer in layers for reps in layer.shards for a in reps)


class _Staged(NamedTuple):
    """Which mover a load was staged for, and what its ``stage_load`` returned."""

    pinned: bool
    staged: Any


class RawOrPinnedMover(RawMover):
    """Raw offloads of ready caches; the pinned mover's programs for loads (where they
    read the pool in place) and for caches still written.

    Reported as ``raw`` (``mgr.paths``): the pool and its bytes are the raw mover's.
    """

    pinned_pool = True

    def __init__(self, cls: SliceClass, pool: ClassPool):
        super().__init__(cls, pool)
        self._pinned = PinnedMover(cls, pool)
        #: Calls moved through the pinned programs, by direction (for tests and stats):
        #: every load where they read the pool in place.
        self.fallbacks = {"offload": 0, "load": 0}

    def host_copied(self) -> int:
        return self.host_copy_bytes + self._pinned.host_copied()

    def start_offload(self, layers, batch, slots, with_digest):
        if caches_ready(layers):
            return super().start_offload(layers, batch, slots, with_digest)
        self.fallbacks["offload"] += 1
        return self._pinned.start_offload(layers, batch, slots, with_digest)

    def finish_offload(self, state, slots):
        if isinstance(state, PinnedOffload):
            return self._pinned.finish_offload(state, slots)
        return super().finish_offload(state, slots)

    def stage_load(self, layers, request: LoadRequest) -> _Staged | None:
        if any(not isinstance(a, jax.Array) for reps in layers[0].shards for a in reps):
            return None  # a prefetch (abstract layers): the load picks the mover
        # Buffers shared by several arrays (one cache passed as two layers, XLA:CPU's
        # replicas of a replicated device_put) cannot be donated twice to one program:
        # the raw load gives them private copies first.
        # (Readiness last: the pinned program reads the pool in place, so the answer
        # is that program whatever it says, and asking costs 32 calls.)
        if request.shared and caches_ready(layers):
            return _Staged(False, super().stage_load(layers, request))
        self.fallbacks["load"] += 1
        return _Staged(True, self._pinned.stage_load(layers, request))

    def start_load(self, arrays, layers, request: LoadRequest, staged: _Staged | None):
        if staged is None:
            staged = self.stage_load(layers, request)
        if staged.pinned:
            return self._pinned.start_load(arrays, layers, request, staged.staged)
        return super().start_load(arrays, layers, request, staged.staged)

    def load_layer_waits(self, state, pos):
        if isinstance(state, PinnedLoad):
            return self._pinned.load_layer_waits(state, pos)
        return False  # a raw load copied every layer in the call

    def finish_load_layer(self, state, pos):
        if isinstance(state, PinnedLoad):
            self._pinned.finish_load_layer(state, pos)
        else:
            super().finish_load_layer(state, pos)

    def finish_load(self, state, num_layers):
        if isinstance(state, PinnedLoad):
            self._pinned.finish_load(state, num_layers)
        else:
            super().finish_load(state, num_layers)

    def warmup(self, arrays, layers, b, with_digest):
        super().warmup(arrays, layers, b, with_digest)
        # The digest programs are the same (compiled once); with digests, the pinned
        # load that digests what it writes.
        self._pinned.warmup(arrays, layers, b, with_digest)
