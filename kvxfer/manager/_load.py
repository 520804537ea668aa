"""The load path: prefetch, the caller's half that enqueues, the transfer thread's half.

``Loads.load`` (the caller's thread) takes part in the load's agreement round, checks
the arguments, pins the pages (or takes a prefetch's pins and staged inputs), finds the
pages it cannot use, and enqueues every device program (``Loads.start``: staging, then
the writes into the caches, then the digests) before it returns. ``Loads.finish`` (the
transfer thread) waits layer by layer, verifies, agrees on the verified prefix across
processes, settles and unpins.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from kvxfer.engine import (GroupedMover, LoadRequest, Mover, PageBatch, ShardedLayer,
                           TransferError, layers_of, own_context, shared_buffers)
from kvxfer.hostpool import HostPool, PageRef
from kvxfer.manager._agree import Agreement, describe_keys
from kvxfer.manager._checks import Checks, check_key, page_batches
from kvxfer.manager._handles import Gate, LoadHandle, LoadResult
from kvxfer.manager._host import host_copy_intact
from kvxfer.manager._prefetch import PrefetchHandle
from kvxfer.manager._thread import TransferThread
from kvxfer._counters import Counters, reason_kind
from kvxfer.manager._verify import DigestJob, DigestStarter, LoadVerifier, TransferHook
from kvxfer.plan import Plan

__all__ = ["Loads"]

log = logging.getLogger("kvxfer")


def _span(layers: Sequence[int]) -> slice | None:
    """``slice(first, last + 1)`` where ``layers`` are consecutive, else None."""
    if list(layers) == list(range(layers[0], layers[0] + len(layers))):
        return slice(layers[0], layers[0] + len(layers))
    return None


class Loads:
    """The loads (and prefetches) of one manager.

    Args:
      plan: the host-memory plan.
      pool: the host pool the pages come from.
      movers: the mover of each slice class.
      verifier: completes and verifies loads, and holds the transfer hook.
      checks: the manager's argument checks.
      stats: the manager's counters.
      worker: the transfer thread.
      agreement: the lockstep agreement on each load's verified prefix.
      abstract_layers: each layer's abstract ``ShardedLayer`` (what prefetch stages for).
    """

    def __init__(self, plan: Plan, pool: HostPool, movers: Sequence[Mover[Any, Any, Any]],
                 verifier: LoadVerifier, checks: Checks, stats: Counters,
                 worker: TransferThread, agreement: Agreement,
                 abstract_layers: Sequence[ShardedLayer]):
        self._plan = plan
        self._pool = pool
        self._movers = movers
        self._verifier = verifier
        self._checks = checks
        self._stats = stats
        self._worker = worker
        self._agreement = agreement
        self._abstract = abstract_layers
        # Pins of prefetch handles dropped unused (a finalizer files them; ``reap``).
        self._dropped: collections.deque[tuple[list[int], dict]] = collections.deque()
        # Pins held until the discarded staging that reads their slots has ended.
        self._unpins: list[tuple[list[tuple[int, Any]], list[int]]] = []
        self._unpins_lock = threading.Lock()
        # Each class's layers as a slice of the caches, where they are consecutive
        # (a model of one kind of layer has one class of every layer).
        self._spans = [_span(c.layers) for c in plan.classes]

    # -- the caller's thread ------------------------------------------------------

    def load(self, kv_caches: Sequence[jax.Array], pages: Sequence[PageRef], device_blocks: Any,
             keys: Sequence[Any] | None, gate: Gate, prefetched: PrefetchHandle | None
             ) -> tuple[list[jax.Array], LoadHandle]:
        """``KVCacheManager.load``: one agreement round, also for a call that raises."""
        self.reap()
        round_ = self._agreement.next_round()
        try:
            return self._load(round_, kv_caches, pages, device_blocks, keys, gate,
                              prefetched)
        except BaseException as e:
            if isinstance(e, TransferError):
                self._stats.add(transfer_errors=1)  # failed in the call: still counted
            if self._agreement.multiprocess:
                try:
                    self._agreement.agree(round_, -1)  # the others learn this one failed
                except TransferError:
                    pass  # the original error is what the caller must see
            raise

    def _load(self, round_: int, kv_caches: Sequence[jax.Array], pages: Sequence[PageRef],
              device_blocks: Any, keys: Sequence[Any] | None,
              gate: Gate, prefetched: PrefetchHandle | None
              ) -> tuple[list[jax.Array], LoadHandle]:
        if gate not in ("all", "layer"):
            raise ValueError(f"gate={gate!r}; expected 'all' or 'layer'")
        started = time.perf_counter()
        self._checks.open()
        caches = self._checks.caches(kv_caches)
        pages = self._checks.pages(pages)
        blocks = self._checks.blocks(device_blocks, len(pages), "pages")
        if prefetched is not None and not isinstance(prefetched, PrefetchHandle):
            raise TypeError(f"prefetched= must be what prefetch() returned. Got "
                            f"{prefetched!r} of type {type(prefetched).__name__}")
        want = None
        if keys is not None:
            keys = list(keys)
            if len(keys) != len(pages):
                raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
            want = [check_key(k, f"keys[{j}]") for j, k in enumerate(keys)]

        handle = LoadHandle(self._checks.num_layers, len(pages), gate)
        staged: dict[int, Any] = {}
        if prefetched is None:
            problems, pinned_slots = self._pin(pages)
        else:
            staged, staged_n = prefetched.take(self, pages)
            problems = [prefetched.problems.get(j) for j in range(len(pages))]
            pinned_slots = [p.slot for p, problem in zip(pages, problems) if problem is None]
        reasons = self._reasons(pages, problems, want, blocks)
        n = min(reasons) if reasons else len(pages)
        discarded: list[tuple[int, Any]] = []  # staging the load does not use
        if prefetched is not None and staged_n != n:
            self._discard(staged)  # fewer pages pass the load's checks: stage them again
            discarded += staged.items()
            staged = {}
        slots = np.array([p.slot for p in pages[:n]], dtype=np.int64)
        batches = page_batches({c: ids[:n] for c, ids in blocks.items()},
                               [p.key for p in pages[:n]],
                               self._pool.seals_of([p.slot for p in pages[:n]]))
        new = caches
        states: dict[int, Any] = {}
        try:
            new, states, jobs = self.start(caches, batches, slots, gate, staged, states,
                                           discarded)
            self._checks.loaded(new, [i for c in states for i in self._plan.classes[c].layers],
                                caches)
            handle._verify_once = self._verifier.once(
                handle, states, jobs, slots, reasons, may_stop=not self._agreement.multiprocess)
            self._worker.submit(handle.run, self.finish, round_, handle, new,
                                pages, slots, batches, states, jobs, reasons, pinned_slots,
                                started, discarded)
        except BaseException as e:
            self._quiesce(states)  # the programs enqueued read the pinned slots
            self._release_after(discarded, pinned_slots)
            if self._checks.closed and not isinstance(e, TransferError):
                raise TransferError("the KVCacheManager was closed during the load",
                                    kv_caches=new) from e
            raise
        return new, handle

    def _pin(self, pages: list[PageRef]) -> tuple[list[str | None], list[int]]:
        """Pins the pages a transfer reads: a problem per page (or None), the slots pinned."""
        problems = self._pool.acquire_readers([(p.slot, p.generation) for p in pages])
        return problems, [p.slot for p, problem in zip(pages, problems) if problem is None]

    def _reasons(self, pages: list[PageRef], problems: Sequence[str | None],
                 want: list[int] | None, blocks: dict[int, np.ndarray]) -> dict[int, str]:
        """Request index -> why the load cannot use that page (pin, key, classes held)."""
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
        return reasons

    def prefetch(self, pages: Sequence[PageRef]) -> PrefetchHandle:
        """``KVCacheManager.prefetch``: pins the pages and stages what a load needs."""
        self.reap()
        pages = self._checks.pages(pages)
        problems, pinned = self._pin(pages)
        reasons = {j: f"{problem} ({p})" for j, (p, problem) in enumerate(zip(pages, problems))
                   if problem is not None}
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
                    layers = [self._abstract[i] for i in self._plan.classes[c].layers]
                    staged[c] = self._movers[c].stage_load(layers, request)
        except Exception as e:
            self._discard(staged, pinned)
            raise TransferError(f"prefetch of {len(pages)} pages failed: {e}") from e
        return PrefetchHandle(self, pages, reasons, pinned, staged, n,
                              self._pool.release_readers, self._dropped, self._discard)

    def _discard(self, staged: dict[int, Any], pinned: list[int] | None = None) -> None:
        """Lets staging go unused (a prefetch released or dropped, classes a load does
        not move); with ``pinned``, releases those pins once that staging's copies,
        which read their slots, have ended (``reap``)."""
        for c, s in staged.items():
            self._movers[c].discard(s)
        if pinned is not None:
            self._release_after(list(staged.items()), pinned)

    def _release_after(self, staged: list[tuple[int, Any]], pinned: list[int]) -> None:
        """Releases ``pinned`` once no discarded staging of ``staged`` (class, what its
        mover staged) can still read their slots."""
        with self._unpins_lock:
            self._unpins.append((staged, pinned))
        self._release_ready()

    def reap(self) -> None:
        """Gives back what prefetch handles dropped unused hold, and the pins whose
        discarded staging has ended (every entry point of the manager that takes or
        frees host slots calls it)."""
        while self._dropped:
            try:
                pinned, staged = self._dropped.popleft()
            except IndexError:
                break
            self._discard(staged, pinned)
        self._release_ready()

    def _release_ready(self) -> None:
        with self._unpins_lock:
            ready = [e for e in self._unpins if all(
                self._movers[c].staged_done(s) for c, s in e[0])]
            self._unpins = [e for e in self._unpins if not any(e is r for r in ready)]
        for _, pinned in ready:
            self._pool.release_readers(pinned)

    def _quiesce(self, states: dict[int, Any]) -> None:
        """Waits until no program of a failed load can still read its pinned slots."""
        for c, state in states.items():
            self._movers[c].quiesce(state)

    def start(self, caches: list[jax.Array], batches: dict[int, PageBatch],
              slots: np.ndarray, gate: Gate, prefetched: dict[int, Any],
              states: dict[int, Any] | None = None,
              discarded: list[tuple[int, Any]] | None = None
              ) -> tuple[list[jax.Array], dict[int, Any],
                         dict[int, DigestJob] | list[DigestJob]]:
        """The caller's-thread half of a load: every device program enqueued.

        ``states`` (filled as each class starts, so a caller whose load failed part
        way knows which programs may still run) is returned as the second item.

        Every class is staged before the first one starts (starting may donate the
        caches), so a failure while staging leaves the caches as they were; a failure
        once classes have started raises a ``TransferError`` whose ``kv_caches`` are
        the arrays to continue with (loaded classes replaced, the others as given).
        """
        n = len(slots)
        layers = layers_of(caches)
        new = list(caches)
        states = {} if states is None else states
        digests = DigestStarter(self._verifier, batches, gate)
        prefetched = dict(prefetched)  # what this load does not take is discarded
        discarded = [] if discarded is None else discarded

        def discard(unused: dict[int, Any]) -> None:
            self._discard(unused)
            discarded.extend(unused.items())
        if not n:
            discard(prefetched)
            return new, states, digests.finish(new)
        shared: frozenset[int] = frozenset()
        if any(self._movers[c].writes_buffers for c in batches) and \
                not self._checks.all_private(caches):
            shared = shared_buffers(caches)
        requests = {c: LoadRequest(b, slots, shared, functools.partial(digests.written, c),
                                   digests.digested(c))
                    for c, b in batches.items()}
        staged: dict[int, Any] = {}
        try:
            for c, request in requests.items():
                staged[c] = prefetched.pop(c) if c in prefetched else \
                    self._movers[c].stage_load(
                        [layers[i] for i in self._plan.classes[c].layers], request)
        except Exception as e:
            discard({**staged, **prefetched})
            raise TransferError(f"load of {n} pages failed while staging (the caches are "
                                f"unchanged): {e}", kv_caches=new) from e
        discard(prefetched)  # classes this load does not move
        hook = self._verifier.hook
        for c, request in requests.items():
            try:
                self._start_class(caches, layers, new, states, digests, hook, c, request,
                                  staged[c])
            except BaseException:
                # A class that started owns its staging; the others' goes unused.
                discard({d: s for d, s in staged.items() if d not in states})
                raise
        try:
            return new, states, digests.finish(new)
        except Exception as e:
            raise TransferError(f"load of {n} pages failed while starting its digests: {e}; "
                                "continue with err.kv_caches", kv_caches=new) from e

    def _start_class(self, caches: list[jax.Array], layers: list[ShardedLayer],
                     new: list[jax.Array], states: dict[int, Any], digests: DigestStarter,
                     hook: TransferHook | None, c: int, request: LoadRequest,
                     staged: Any) -> None:
        """Enqueues one class's writes into the caches; ``new`` and ``states`` get them."""
        cls, mover, span = self._plan.classes[c], self._movers[c], self._spans[c]
        try:
            if hook is not None:
                hook("start_load", cls.layers[0], new[cls.layers[0]])
            out, states[c] = mover.start_load(
                caches[span] if span is not None else [caches[i] for i in cls.layers],
                layers[span] if span is not None else [layers[i] for i in cls.layers],
                request, staged)
        except Exception as e:
            # A mover that failed after consuming its inputs hands back the arrays
            # its layers live in now.
            if isinstance(e, TransferError) and e.kv_caches is not None:
                for i, a in zip(cls.layers, e.kv_caches):
                    new[i] = a
            usable = [a for a in new if not a.is_deleted()]
            raise TransferError(
                f"load of {len(request.slots)} pages failed in {cls.name} (layers "
                f"{list(cls.layers)}): {e}; continue with err.kv_caches ({len(usable)} of "
                f"{len(new)} layers usable)", kv_caches=new) from e
        out = digests.returned(cls.layers, out)
        if span is not None:
            new[span] = out
        else:
            for i, a in zip(cls.layers, out):
                new[i] = a

    # -- the transfer thread --------------------------------------------------------

    @own_context
    def finish(self, round_: int, handle: LoadHandle, new: list[jax.Array],
               pages: list[PageRef], slots: np.ndarray, batches: dict[int, PageBatch],
               states: dict[int, Any], jobs: dict[int, DigestJob] | list[DigestJob],
               reasons: dict[int, str], pinned_slots: list[int], started: float,
               discarded: Sequence[tuple[int, Any]] = ()) -> None:
        """The transfer thread's half of a load: wait, verify, agree, settle.

        A cancelled load still waits for every program that reads the pool; on one
        process it skips the digest checks left and the settling (nothing is
        reported), in a multi-process job it verifies, agrees and settles as usual.
        """
        alone = not self._agreement.multiprocess
        try:
            prefix, proven_bad = self._verifier.verify(handle, new, states, jobs, slots,
                                                       batches, reasons, may_stop=alone,
                                                       once=handle._verify_once)
            proven_bad = self._triage(pages, proven_bad, reasons, set(batches))
            error: BaseException | None = None
        except Exception as e:  # a transfer or device failure is an error, not a miss
            prefix, proven_bad, error = -1, frozenset(), e
            self._quiesce(states)  # before the pins go: a program may still read them
        cancelled = handle.claim()  # from here on cancel() fails
        rank = self._agreement.rank
        bad_on = {j: (rank,) for j in proven_bad}
        try:
            if not alone:
                # Every rank takes part even after a local failure, so none hangs; a
                # page proven bad anywhere is freed everywhere.
                # What the round is about, as the other processes are told on a
                # mismatch (made here: a process alone never needs it).
                subject = describe_keys("load", [p.key for p in pages],
                                        f"classes {sorted(batches)}")
                agreed = self._agreement.agree(round_, prefix, subject=subject,
                                               bad=proven_bad)
                if agreed.value < 0 and error is None:
                    error = TransferError("a transfer failed on another process")
                prefix, bad_on = agreed.value, agreed.bad
            if error is not None:
                raise error
            result = None if cancelled and alone else self._verifier.settle(
                handle, pages, prefix, bad_on, reasons, set(batches), rank)
        except Exception as e:
            result, error = None, e
            self._stats.add(transfer_errors=1)
        else:
            if result is not None:
                self._count(result, len(slots), batches, started)
        finally:
            # Before the handle says done: a caller returning from result() finds the
            # pages it read free to evict (and freed ones free) at once; those that
            # staging the load did not use still reads, once it has ended.
            self._release_after(list(discarded), pinned_slots)
        # A failed load's arrays are the caches to continue with: its programs never
        # fail (a failure inside one is recorded, its outputs alias its inputs).
        handle._finish(result, error, cancelled, kv_caches=new)

    def _triage(self, pages: list[PageRef], proven_bad: frozenset[int],
                reasons: dict[int, str], moved: set[int]) -> frozenset[int]:
        """The pages whose host copies fail their own digests, of those the device caught.

        A device digest that fails over a host copy that still matches its digests
        is a delivery fault (a DMA that wrote zeros, say): the page is a miss for
        this load only, with a reason that starts with ``transfer``, and it stays in
        host memory (and in any store below). Only a bad host copy is freed.
        """
        classes = [self._plan.classes[c] for c in sorted(moved)]
        bad = set()
        for j in sorted(proven_bad):
            page = pages[j]
            if host_copy_intact(self._pool, classes, page.slot, page.key):
                reasons[j] = (f"transfer: {reasons.get(j, 'digest mismatch')}, while its host copy matches its "
                              "digests (the page is kept)")
                self._stats.add(transfer_faults=1)
                log.warning("load of page %#x: the transfer delivered bytes that fail "
                            "their digest (%s); the host copy is intact and kept",
                            page.key, reasons[j])
            else:
                bad.add(j)
        return frozenset(bad)

    def _count(self, result: LoadResult, moved: int, batches: dict[int, PageBatch],
               started: float) -> None:
        self._stats.add(pages_loaded=moved, pages_verified=result.verified_prefix,
                        pages_freed=len(result.freed_pages),
                        bytes_loaded=moved * sum(self._plan.classes[c].page_bytes
                                                 for c in batches))
        for reason in result.reasons.values():
            self._stats.add_labelled("mismatches", reason_kind(reason))
        self._stats.time("load", time.perf_counter() - started)
