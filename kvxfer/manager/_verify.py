"""Verification of a load, layer by layer, and agreement on its verified prefix.

A load's pages are digested on the device after they arrive and compared with the
digests made before they left; layer i is released (``gate="layer"``) once its pages
are checked, and the load's verified prefix is the first bad page over every layer,
shard and replica, agreed over every process of a multi-process job (minimum).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from kvxfer import integrity as _integrity
from kvxfer.engine import DIGEST_CHUNK, Mover, PageBatch, Pending, ShardedLayer
from kvxfer.hostpool import HostPool, PageRef
from kvxfer.manager._handles import LoadHandle, LoadResult
from kvxfer.plan import Plan, SliceClass

__all__ = ["TransferHook", "LoadVerifier", "agree_min"]

TransferHook = Callable[[str, int, jax.Array], None]
"""``hook(event, layer, array)``: see ``KVCacheManager.set_transfer_hook``."""


def agree_min(value: int) -> int:
    """The minimum of ``value`` over every process, through a JAX collective.

    Every process runs its loads in the same order on its transfer thread, so the
    collectives line up; all ranks then keep and recompute the same pages. The
    collective runs on the transfer thread: a job must not run other multi-process
    programs that could interleave with it differently on different ranks while a
    load is being verified (wait for ``result()`` first).
    """
    from jax.experimental import multihost_utils

    values = multihost_utils.process_allgather(np.array([value], dtype=np.int32))
    return int(np.min(values))


@dataclasses.dataclass
class _LoadCheck:
    """One load being verified: what it moved and what was found so far."""

    handle: LoadHandle
    slots: np.ndarray
    batch: PageBatch
    reasons: dict[int, str]
    prefix: int
    by_class: list[list[ShardedLayer]] = dataclasses.field(default_factory=list)


def _mismatch_reason(cls: SliceClass, layer: int, bad_shards: np.ndarray,
                     bad_replicas: list[np.ndarray]) -> str:
    """Why one page failed in one layer: which shards and replicas disagree."""
    shards = np.flatnonzero(bad_shards).tolist()
    what = f"digest mismatch in layer {layer}"
    if cls.num_shards > 1 and len(shards) < cls.num_shards:
        what = (f"shard disagreement: digest mismatch in layer {layer} on shard(s) "
                f"{shards} of {cls.num_shards}")
    replicas = [r for r, b in enumerate(bad_replicas) if b.any()]
    if cls.replicas > 1 and len(replicas) < cls.replicas:
        what += f" (replica(s) {replicas} of {cls.replicas})"
    return what


@dataclasses.dataclass
class LoadVerifier:
    """Completes and verifies the loads of one manager (runs on its transfer thread)."""

    plan: Plan
    movers: Sequence[Mover]
    pool: HostPool
    verify_pages: bool
    hook: TransferHook | None = None

    def __post_init__(self):
        self.num_layers = self.plan.num_layers
        self.layer_class = [self.plan.class_of_layer(i) for i in range(self.num_layers)]

    def verify(self, handle: LoadHandle, new: list[jax.Array], slots: np.ndarray,
               batch: PageBatch, states: list[Any], reasons: dict[int, str]) -> int:
        """Completes the copies layer by layer, verifying and releasing (gate="layer").

        The digest of layer i runs on the device while layer i+1 is copied.

        Args:
          handle: the load's handle (layers are released on it).
          new: the arrays the load returned.
          slots: host slot of each page moved.
          batch: the pages moved.
          states: each class mover's load state.
          reasons: request index -> why that page is bad; filled in here.

        Returns:
          The local verified prefix (over every layer and shard of this process).
        """
        check = _LoadCheck(handle, slots, batch, reasons, batch.k)
        if check.batch.k and self.verify_pages:
            layers = [ShardedLayer.of(a) for a in new]
            check.by_class = [[layers[j] for j in c.layers] for c in self.plan.classes]
            if handle.gate == "all":
                self._verify_grouped(check, states, new)
            else:
                self._verify_per_layer(check, states, new)
        else:
            for i in range(self.num_layers):
                if check.batch.k:
                    self._finish_layer(states, new, i)
                if handle.gate == "layer":
                    handle.release(i, check.prefix)
        return min([check.prefix] + list(reasons))

    def _verify_grouped(self, check: _LoadCheck, states: list[Any],
                        new: list[jax.Array]) -> None:
        # Nothing is released before the end, so layers are checked in groups: a
        # group's digest program runs on the device while the next group copies.
        jobs, waiting = [], {c.index: [] for c in self.plan.classes}
        for i in range(self.num_layers):
            cls, pos = self.layer_class[i]
            self._finish_layer(states, new, i)
            group = waiting[cls.index]
            group.append(pos)
            if len(group) == DIGEST_CHUNK or pos == len(cls.layers) - 1:
                jobs.append((cls, list(group), self._start(check, cls, list(group))))
                group.clear()
        for cls, group, parts in jobs:
            gots = [part.get() for part in parts]
            for j, pos in enumerate(group):
                self._check_layer(check, cls, pos, [got[j] for got in gots])

    def _verify_per_layer(self, check: _LoadCheck, states: list[Any],
                          new: list[jax.Array]) -> None:
        pending: tuple[SliceClass, int, list[Pending]] | None = None
        for i in range(self.num_layers):
            cls, pos = self.layer_class[i]
            try:
                self._finish_layer(states, new, i)
            except Exception:
                if pending is not None:  # release what was verified before the failure
                    self._settle_pending(check, pending)
                raise
            job = (cls, pos, self._start(check, cls, [pos]))
            if pending is not None:
                self._settle_pending(check, pending)
            pending = job
        if pending is not None:
            self._settle_pending(check, pending)

    def _start(self, check: _LoadCheck, cls: SliceClass, positions: list[int]
               ) -> list[Pending]:
        # Every replica of a replicated layer received the pages: check each copy.
        mover = self.movers[cls.index]
        return [mover.digests(check.by_class[cls.index], check.batch, positions, replica=r)
                for r in range(cls.replicas)]

    def _settle_pending(self, check: _LoadCheck,
                        job: tuple[SliceClass, int, list[Pending]]) -> None:
        cls, pos, parts = job
        self._check_layer(check, cls, pos, [part.get()[0] for part in parts])

    def _check_layer(self, check: _LoadCheck, cls: SliceClass, pos: int,
                     gots: list[np.ndarray]) -> None:
        """Compares one layer's digests (one array per replica) and releases it."""
        i = cls.layers[pos]
        expected = np.swapaxes(self.pool.pools[cls.index].digests[
            check.slots, pos, :, :_integrity.DIGEST_WORDS], 0, 1)  # [S, k, D]
        per_replica = [(got != expected).any(axis=-1) for got in gots]  # [S, k] each
        bad = np.logical_or.reduce(per_replica)
        for j in np.flatnonzero(bad.any(axis=0)):
            if int(j) not in check.reasons:
                check.reasons[int(j)] = _mismatch_reason(cls, i, bad[:, j],
                                                         [b[:, j] for b in per_replica])
            check.prefix = min(check.prefix, int(j))
        if check.handle.gate == "layer":
            check.handle.release(i, check.prefix)

    def _finish_layer(self, states: list[Any], new: list[jax.Array], layer: int) -> None:
        cls, pos = self.layer_class[layer]
        hook = self.hook
        if hook is not None:
            hook("load_layer", layer, new[layer])
        self.movers[cls.index].finish_load_layer(states[cls.index], pos)
        if hook is not None:
            hook("loaded_layer", layer, new[layer])

    def settle(self, handle: LoadHandle, pages: list[PageRef], first_bad: int,
               reasons: dict[int, str]) -> LoadResult:
        """Releases (gate="all"), invalidates the bad page and all after it, reports."""
        if handle.gate == "all":
            for i in range(self.num_layers):
                handle.release(i, first_bad)
        invalid = tuple(range(first_bad, len(pages)))
        for j in invalid:
            p = pages[j]
            self.pool.invalidate(p.slot, p.generation)
            if j == first_bad and j not in reasons:
                reasons[j] = "invalid on another process"
        released = handle.released_prefixes
        return LoadResult(first_bad, invalid, dict(sorted(reasons.items())),
                          any(r > first_bad for r in released), released)

