"""The offload path: the caller's half enqueues every read, the transfer thread commits.

``Offloads.start`` (the caller's thread) checks the arguments, takes host slots and
enqueues every class's device programs before it returns, so the caller may donate
its caches right away; ``Offloads.finish`` (the transfer thread) moves the host bytes
and digests in and commits the pages, or releases their slots.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from kvxfer.engine import Mover, PageBatch, TransferError, layers_of, own_context
from kvxfer.hostpool import HostPool, PageRef
from kvxfer.manager._checks import Checks, check_key, page_batches
from kvxfer.manager._handles import OffloadHandle
from kvxfer.manager._thread import TransferThread
from kvxfer._counters import Counters
from kvxfer.manager._verify import LoadVerifier
from kvxfer.plan import Plan

__all__ = ["Offloads"]


class Offloads:
    """The offloads of one manager.

    Args:
      plan: the host-memory plan.
      pool: the host pool the pages go to.
      movers: the mover of each slice class.
      verifier: holds the transfer hook (``KVCacheManager.set_transfer_hook``).
      checks: the manager's argument checks.
      stats: the manager's counters.
      worker: the transfer thread.
      with_digest: whether pages are digested on the device.
    """

    def __init__(self, plan: Plan, pool: HostPool, movers: Sequence[Mover[Any, Any, Any]],
                 verifier: LoadVerifier, checks: Checks, stats: Counters,
                 worker: TransferThread, with_digest: bool):
        self._plan = plan
        self._pool = pool
        self._movers = movers
        self._verifier = verifier
        self._checks = checks
        self._stats = stats
        self._worker = worker
        self._with_digest = with_digest

    def start(self, kv_caches: Sequence[jax.Array], device_blocks: Any, keys: Sequence[Any],
              slots: Sequence[int] | None) -> OffloadHandle:
        """The caller's half of ``KVCacheManager.offload``: checked, enqueued, handed on."""
        try:
            return self._start(kv_caches, device_blocks, keys, slots)
        except TransferError:
            self._stats.add(transfer_errors=1)  # failed in the call: still counted
            raise

    def _start(self, kv_caches: Sequence[jax.Array], device_blocks: Any, keys: Sequence[Any],
               slots: Sequence[int] | None) -> OffloadHandle:
        started = time.perf_counter()
        caches = self._checks.caches(kv_caches)
        keys = list(keys)
        blocks = self._checks.blocks(device_blocks, len(keys), "keys")
        keys = [check_key(k, f"keys[{j}]") for j, k in enumerate(keys)]
        if slots is None:
            refs = self._pool.allocate(len(keys))
        else:
            refs = self._pool.claim(self._checks.slots(slots, len(keys)))
        slot_ids = np.array([s for s, _ in refs], dtype=np.int64)
        states: dict[int, Any] = {}
        try:  # from here on, a failure gives back the slots taken
            batches = page_batches(blocks, keys, [g for _, g in refs])
            self._gather(caches, batches, slot_ids, states)
        except Exception as e:
            # Not before the programs enqueued so far can no longer write the slots.
            self._quiesce(states)
            for s, g in refs:
                self._pool.release(s, g)
            raise TransferError(f"offload of {len(keys)} blocks failed: {e}") from e

        handle = OffloadHandle()
        try:
            self._worker.submit(handle.run, self.finish, handle, states, slot_ids, refs, keys,
                                started)
        except RuntimeError as e:  # closed meanwhile
            self._quiesce(states)
            for s, g in refs:
                self._pool.release(s, g)
            raise TransferError(f"offload of {len(keys)} blocks failed: {e}") from e
        return handle

    def _quiesce(self, states: dict[int, Any]) -> None:
        """Waits until no program of a failed offload can still write its slots."""
        for c, state in states.items():
            self._movers[c].quiesce(state)

    def _gather(self, caches: list[jax.Array], batches: dict[int, PageBatch],
                slots: np.ndarray, states: dict[int, Any]) -> None:
        """Enqueues every class's reads of the batch (caller's thread) into ``states``
        (each class's offload state, as soon as its programs are enqueued)."""
        hook = self._verifier.hook
        layers = layers_of(caches)
        for c, batch in batches.items():
            cls = self._plan.classes[c]
            states[c] = self._movers[c].start_offload(
                [layers[i] for i in cls.layers], batch, slots, self._with_digest)
            if hook is not None:
                hook("gather_enqueued", cls.layers[0], caches[cls.layers[0]])

    @own_context
    def finish(self, handle: OffloadHandle, states: dict[int, Any], slots: np.ndarray,
               refs: list[tuple[int, int]], keys: list[int], started: float) -> None:
        """The transfer thread's half of an offload: host bytes in, pages committed."""
        hook = self._verifier.hook
        try:
            for c, state in states.items():
                self._movers[c].finish_offload(state, slots)
                if hook is not None:
                    hook("host_written", self._plan.classes[c].layers[0], None)
            cancelled = handle.claim()  # from here on cancel() fails
        except Exception as e:
            self._quiesce(states)  # a class not waited for may still be copying
            for s, g in refs:
                self._pool.release(s, g)
            self._stats.add(transfer_errors=1)
            error = TransferError(f"offload of {len(refs)} blocks failed: {e}")
            error.__cause__ = e
            handle._finish(error=error, cancelled=handle.claim())
            return
        if cancelled:  # the copies are done: the slots are free to reuse
            self._pool.release_many(refs)
            handle._finish(cancelled=True)
            return
        for (s, g), k in zip(refs, keys):
            self._pool.commit(s, g, k, frozenset(states))
        self._stats.add(pages_offloaded=len(refs), bytes_offloaded=len(refs) * sum(
            self._plan.classes[c].page_bytes for c in states))
        self._stats.time("offload", time.perf_counter() - started)
        handle._finish([PageRef(k, s, g) for (s, g), k in zip(refs, keys)])
