"""Verification of a load, layer by layer.

A load's pages are digested on the device after they arrive (programs enqueued on the
caller's thread) and compared with the digests made before they left; layer i is
released (``gate="layer"``) once its pages are checked, and the load's verified prefix
on this process is the first bad page over every layer, shard and replica.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from kvxfer import integrity as _integrity
from kvxfer.engine import DIGEST_CHUNK, Mover, PageBatch, Pending, ShardedLayer
from kvxfer.hostpool import HostPool, PageRef
from kvxfer.manager._handles import Gate, LoadHandle, LoadResult
from kvxfer.plan import Plan, SliceClass

__all__ = ["TransferHook", "LoadVerifier", "DigestStarter", "DigestJob", "Verified",
           "VerifyOnce"]

TransferHook = Callable[[str, int, jax.Array | None], Any]
"""``hook(event, layer, array)``: see ``KVCacheManager.set_transfer_hook``. A
``"loaded_layer"`` hook may return a ``jax.Array`` to stand for what the load wrote
(any other return value is ignored); ``array`` is None for ``"host_written"``."""


def _replacement(layer: int, array: jax.Array, new: jax.Array) -> jax.Array:
    """Checks the array a ``"loaded_layer"`` hook returned in place of ``array``."""
    if new.shape != array.shape or new.dtype != array.dtype or \
            not new.sharding.is_equivalent_to(array.sharding, array.ndim):
        raise ValueError(f"the loaded_layer hook returned {new.dtype}{list(new.shape)} on "
                         f"{new.sharding} for layer {layer}; expected the loaded array's "
                         f"{array.dtype}{list(array.shape)} on {array.sharding}")
    return new


@dataclasses.dataclass
class _LoadCheck:
    """One load being verified: what it moved and what was found so far."""

    handle: LoadHandle
    slots: np.ndarray
    reasons: dict[int, str]
    prefix: int
    proven_bad: set[int] = dataclasses.field(default_factory=set)
    #: (layer, prefix) verified and not yet released (``release_held``)
    held: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def release_held(self) -> None:
        """Releases the layers verified so far, with one wake-up of the waiters."""
        if self.held:
            self.handle._release_many(self.held)
            self.held = []


class VerifyOnce:
    """The one point of verification of a load that one digest job covers, run once,
    by whichever thread gets to it first.

    The transfer thread runs it; a caller blocked in ``LoadHandle.layer_ready``
    runs it itself when it gets there first. On a small load that saves a thread
    hand-off on the way to the caller: with every core busy with the load's program,
    the transfer thread often gets one only once the program has ended, and the
    caller then waits for it to wake, compare and wake the caller in turn. Only the
    wait, the comparison and the release run on the caller's thread; settling the
    pages and ending the handle (its done-callbacks) stay on the transfer thread.

    The transfer thread waits for the load's digests (``wait``) before it takes the
    verification, so a caller already blocked in ``layer_ready`` holds it when the
    programs end (a 1-page x 32-layer hit: 20-30 us sooner on a 2-core CPU).
    """

    def __init__(self, run: Callable[[], bool], ready: Callable[[], None]):
        self._run: Callable[[], bool] | None = run
        self._ready: Callable[[], None] | None = ready
        self._lock = threading.Lock()
        self._outcome: tuple[bool, Exception | None] | None = None

    def wait(self) -> None:
        """Waits until what the verification compares is computed, running none of it.

        A failure there is left to the verification, which meets it and reports it.
        """
        ready = self._ready
        if ready is not None and self._outcome is None:
            try:
                ready()
            except Exception:
                pass

    def __call__(self) -> bool:
        """Runs the verification, or waits for the thread running it; its outcome
        (whether it verified the load) or its exception, on every thread."""
        with self._lock:
            if self._outcome is None:
                run = self._run
                try:
                    self._outcome = (run(), None)
                except Exception as e:  # recorded: the transfer thread reports it
                    self._outcome = (False, e)
                self._run = self._ready = None  # what they hold (the load's arrays) goes
            verified, error = self._outcome
        if error is not None:
            raise error
        return verified


class Verified(NamedTuple):
    """What verification found on this process."""

    prefix: int
    proven_bad: frozenset[int]


@dataclasses.dataclass(frozen=True)
class DigestJob:
    """The digests of some layers of one class, being computed (one per replica)."""

    cls: SliceClass
    positions: list[int]
    parts: list[Pending]

    def wait(self) -> None:
        """Waits until the digests are computed (every replica's), fetching none."""
        for part in self.parts:
            part.wait()


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


class DigestStarter:
    """Enqueues a load's digest programs as its layers are written (caller's thread).

    The programs read the arrays the load returns, so they run before anything the
    caller dispatches next (a donating step included), and the digest of one layer
    runs on the device while the next layer is written. Either gate makes one job per
    group of up to ``DIGEST_CHUNK`` layers of a class: a job per layer would enqueue a
    program per layer, and XLA:CPU blocks the dispatching thread once a few dozen
    executions are in flight (the caller's queued steps count too), so a per-layer
    load would wait on the device work queued before it.
    """

    def __init__(self, verifier: LoadVerifier, batches: dict[int, PageBatch], gate: Gate):
        self._verifier = verifier
        self._batches = batches
        self._gate = gate
        k = next(iter(batches.values())).k
        self._active = bool(k) and verifier.verify_pages
        self._layers: dict[int, ShardedLayer] = {}
        self._arrays: dict[int, jax.Array] = {}  # what the load returns, by layer
        self._jobs: list[DigestJob] = []
        # Per class, made when its first layer is written (a class whose program
        # digests what it wrote never needs them): its groups of layer positions,
        # (class, position) -> its group, and (class, group) -> layers still unwritten.
        self._groups: dict[int, list[list[int]]] = {}
        self._group_of: dict[tuple[int, int], int] = {}
        self._unwritten: dict[tuple[int, int], int] = {}
        # class -> {(shard, replica): digests} its mover computed while writing
        self._fused: dict[int, dict[tuple[int, int], jax.Array]] = {}

    def digested(self, c: int) -> Callable[[int, int, jax.Array], None] | None:
        """What ``LoadRequest.on_digested`` takes for class ``c``: None where the load
        checks no pages, or where a transfer hook may stand in for what was written (its
        digests must then read the arrays the hook returned)."""
        if not self._active or self._verifier.hook is not None:
            return None
        return lambda shard, replica, d: self._fused.setdefault(c, {}).__setitem__(
            (shard, replica), d)

    def written(self, c: int, pos: int, array: jax.Array) -> jax.Array:
        """Layer ``pos`` of class ``c`` holds its loaded bytes: ``array`` (once each).

        Returns:
          The array the load returns for that layer: ``array``, or what the
          ``"loaded_layer"`` hook returned in its place.
        """
        cls = self._verifier.plan.classes[c]
        layer = cls.layers[pos]
        if layer in self._arrays:
            return self._arrays[layer]
        hook = self._verifier.hook
        if hook is not None:
            new = hook("loaded_layer", layer, array)
            if isinstance(new, jax.Array):  # anything else (None, say) keeps ``array``
                array = _replacement(layer, array, new)
        self._arrays[layer] = array
        if not self._active or c in self._fused:
            return array
        self._layers[layer] = ShardedLayer.of(array)
        if c not in self._groups:
            self._group(c, len(cls.layers))
        g = self._group_of[(c, pos)]
        self._unwritten[(c, g)] -= 1
        if not self._unwritten[(c, g)]:
            group = self._groups[c][g]
            by_pos = [self._layers.get(j) for j in cls.layers]
            # Every replica of a replicated layer received the pages: check each copy.
            self._jobs.append(DigestJob(cls, group, [
                self._verifier.movers[c].digests(by_pos, self._batches[c], group, replica=r)
                for r in range(cls.replicas)]))
        return array

    def _group(self, c: int, num_positions: int) -> None:
        """Splits class ``c``'s layer positions into groups of ``DIGEST_CHUNK``."""
        positions = list(range(num_positions))
        self._groups[c] = [positions[a:a + DIGEST_CHUNK]
                           for a in range(0, num_positions, DIGEST_CHUNK)]
        for g, group in enumerate(self._groups[c]):
            self._unwritten[(c, g)] = len(group)
            for p in group:
                self._group_of[(c, p)] = g

    def returned(self, layers: Sequence[int], arrays: Sequence[jax.Array]) -> list[jax.Array]:
        """What the load returns for ``layers``, whose mover handed back ``arrays``."""
        if not self._arrays:  # no layer went through ``written`` (one program digested)
            return list(arrays)
        return [self._arrays.get(i, a) for i, a in zip(layers, arrays)]

    def finish(self, new: list[jax.Array]) -> dict[int, DigestJob] | list[DigestJob]:
        """Starts what is left (movers that write everything at once report nothing).

        ``new`` (the arrays the load returns) takes the arrays hooks returned.

        Returns:
          The jobs, each under every layer it digests for ``gate="layer"``, else a
          list.
        """
        for c in self._batches:
            if c in self._fused:
                continue  # its program digested what it wrote: nothing to start
            for pos, i in enumerate(self._verifier.plan.classes[c].layers):
                new[i] = self.written(c, pos, new[i])
        for c, got in self._fused.items():
            cls, k = self._verifier.plan.classes[c], self._batches[c].k
            replicas = sorted({r for _, r in got})
            if set(got) != {(s, r) for s in range(cls.num_shards) for r in replicas}:
                raise RuntimeError(f"the {self._verifier.movers[c].name} mover digested "
                                   f"(shard, replica) {sorted(got)} of {cls.name}: not every "
                                   "shard of every replica")
            self._jobs.append(DigestJob(cls, list(range(len(cls.layers))), [
                Pending([[got[(s, r)]] for s in range(cls.num_shards)], k)
                for r in replicas]))
        if self._gate == "layer":
            by_layer: dict[int, DigestJob] = {}
            for job in self._jobs:
                layers = job.cls.layers
                by_layer.update(dict.fromkeys(
                    layers if len(job.positions) == len(layers) else
                    [layers[p] for p in job.positions], job))
            return by_layer
        return self._jobs


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

    def verify(self, handle: LoadHandle, new: list[jax.Array], states: dict[int, Any],
               jobs: dict[int, DigestJob] | list[DigestJob], slots: np.ndarray,
               batches: dict[int, PageBatch], reasons: dict[int, str], *,
               may_stop: bool = False, once: VerifyOnce | None = None) -> Verified:
        """Completes a load layer by layer, checking and releasing (transfer thread).

        Layers of classes the load does not move are released as they come (their
        contents did not change). With ``may_stop``, once the handle is cancelled
        every layer is still waited for (its programs read the pool) but nothing
        more is checked or released; the prefix returned then means nothing.

        Args:
          handle: the load's handle (layers are released on it).
          new: the arrays the load returned.
          states: the load state of each class moved.
          jobs: the digests a ``DigestStarter`` enqueued.
          slots: host slot of each page moved.
          batches: the pages moved, per class moved.
          reasons: request index -> why that page is bad; filled in here.
          once: what ``once`` made for this load, if anything.

        Returns:
          The local verified prefix (over every layer and shard of this process) and
          the pages proven bad by their own digests.
        """
        check = _LoadCheck(handle, slots, reasons, len(slots))

        def stopped() -> bool:
            return may_stop and handle.cancel_requested

        if jobs and handle.gate == "all":
            for i in range(self.num_layers):
                if self.layer_class[i][0].index in batches:
                    self._finish_layer(states, new, i)
            for job in jobs:
                if stopped():
                    break
                gots, bad = self._job_digests(check, job)
                for j in np.flatnonzero(bad):
                    self._check_layer(check, job.cls, job.positions[j], [g[j] for g in gots])
        else:
            try:
                self._verify_layers(check, states, new, jobs, batches, stopped, once)
            finally:
                check.release_held()  # what was verified stays released, whatever follows
        return Verified(min([check.prefix] + list(reasons)), frozenset(check.proven_bad))

    def _verify_layers(self, check: _LoadCheck, states: dict[int, Any], new: list[jax.Array],
                       jobs: dict[int, DigestJob] | list[DigestJob],
                       batches: dict[int, PageBatch], stopped: Callable[[], bool],
                       once: VerifyOnce | None = None) -> None:
        """Waits for and checks layer after layer (``gate="layer"``, or no digests).

        The layers of one digest job are released together once the job's last layer
        is checked (one wake-up of the waiters, not one per layer; a job's digests
        cover all of its layers at once), or before a wait that may block (a layer's
        program, a hook), other layers as they come.
        """
        if once is not None:
            once.wait()
        if once() if once is not None else self._verify_as_one(check, states, jobs, stopped):
            return
        handle = check.handle
        # id(job) -> its digests and which of its layers hold a bad page, once waited
        got: dict[int, tuple[list[np.ndarray], np.ndarray]] = {}
        for i in range(self.num_layers):
            cls, pos = self.layer_class[i]
            if cls.index in batches and len(check.slots):
                if check.held and (self.hook is not None or self.movers[cls.index].
                                   load_layer_waits(states[cls.index], pos)):
                    check.release_held()  # what was verified is not held behind a wait
                self._finish_layer(states, new, i)
            if stopped():
                continue
            if i in jobs:
                job = jobs[i]
                if id(job) not in got:
                    check.release_held()  # before waiting for another job's digests
                    got[id(job)] = self._job_digests(check, job)
                gots, bad = got[id(job)]
                j = job.positions.index(pos)
                if bad[j]:
                    self._check_layer(check, cls, pos, [g[j] for g in gots])
                elif handle.gate == "layer":
                    check.held.append((i, check.prefix))
                if pos == job.positions[-1]:
                    check.release_held()
            elif handle.gate == "layer":
                check.held.append((i, check.prefix))
                check.release_held()

    def once(self, handle: LoadHandle, states: dict[int, Any],
             jobs: dict[int, DigestJob] | list[DigestJob], slots: np.ndarray,
             reasons: dict[int, str], *, may_stop: bool = False) -> VerifyOnce | None:
        """The verification of a ``gate="layer"`` load that one digest job covers, as
        a ``VerifyOnce`` for ``verify`` and the handle's waiters (None for others)."""
        if handle.gate != "layer" or not self._one_job(jobs, slots):
            return None
        check = _LoadCheck(handle, slots, reasons, len(slots))
        return VerifyOnce(functools.partial(
            self._verify_as_one, check, states, jobs,
            lambda: may_stop and handle.cancel_requested), jobs[0].wait)

    def _one_job(self, jobs: dict[int, DigestJob] | list[DigestJob], slots: np.ndarray
                 ) -> bool:
        """Whether one digest job covers every layer of a load, with no transfer hook."""
        if self.hook is not None or not len(slots) or not isinstance(jobs, dict) or \
                len(jobs) != self.num_layers:
            return False
        return all(map(operator.is_, jobs.values(), itertools.repeat(jobs[0])))

    def _verify_as_one(self, check: _LoadCheck, states: dict[int, Any],
                       jobs: dict[int, DigestJob] | list[DigestJob],
                       stopped: Callable[[], bool]) -> bool:
        """A load whose every layer one job digests (one class, its digests computed by
        the program that wrote it) has one point of verification: the layers are
        waited for, the digests compared once and, where no page is bad, every layer
        released with one wake-up. Without the per-layer bookkeeping of
        ``_verify_layers`` a 1-page x 32-layer hit is verified in a fraction of the
        time.

        Returns:
          Whether it verified the load; False (nothing released, nothing recorded)
          where a hook is installed, the layers are not one job's, or a page is bad:
          ``_verify_layers`` then goes layer by layer.
        """
        if not self._one_job(jobs, check.slots):
            return False
        job = jobs[0]
        c = job.cls.index
        mover, state = self.movers[c], states[c]
        expected = self._expected(check, job)  # while the programs run
        mover.finish_load(state, len(job.cls.layers))
        if stopped():
            return True
        if self._job_digests(check, job, expected)[1].any():
            return False
        check.handle._release_all(check.prefix)
        return True

    def _expected(self, check: _LoadCheck, job: DigestJob) -> np.ndarray:
        """The digests a job's pages were offloaded with, ``[P, S, k, D]`` (the slots
        are pinned by the load: they cannot change while it runs)."""
        digests = self.pool.pools[job.cls.index].digests[check.slots]  # [k, L, S, words]
        if len(job.positions) == digests.shape[1]:  # every layer (positions are in order)
            expected = digests[..., :_integrity.DIGEST_WORDS]
        else:
            expected = digests[:, job.positions, :, :_integrity.DIGEST_WORDS]
        return np.moveaxis(expected, 0, 2)

    def _job_digests(self, check: _LoadCheck, job: DigestJob,
                     expected: np.ndarray | None = None
                     ) -> tuple[list[np.ndarray], np.ndarray]:
        """Waits for a job's digests (one array per replica, ``[P, S, k, D]``) and says
        which of its layers hold a page that differs on some shard or replica
        (``bool[P]``), comparing the whole job at once: the layers that do are checked
        one by one (``_check_layer``) for the reasons. ``expected``: what
        ``_expected`` gave, where the caller computed it before waiting."""
        gots = [part.get() for part in job.parts]
        if expected is None:
            expected = self._expected(check, job)
        bad = np.zeros(len(job.positions), dtype=bool)
        for got in gots:
            if not np.array_equal(got, expected):  # a match (the rule) costs one call
                bad |= (got != expected).reshape(len(job.positions), -1).any(axis=1)
        return gots, bad

    def _check_layer(self, check: _LoadCheck, cls: SliceClass, pos: int,
                     gots: list[np.ndarray]) -> None:
        """Compares one layer's digests (one array per replica) and releases it."""
        i = cls.layers[pos]
        expected = np.swapaxes(self.pool.pools[cls.index].digests[
            check.slots, pos, :, :_integrity.DIGEST_WORDS], 0, 1)  # [S, k, D]
        per_replica = [(got != expected).any(axis=-1) for got in gots]  # [S, k] each
        bad = np.logical_or.reduce(per_replica)
        for j in np.flatnonzero(bad.any(axis=0)):
            check.proven_bad.add(int(j))
            if int(j) not in check.reasons:
                check.reasons[int(j)] = _mismatch_reason(cls, i, bad[:, j],
                                                         [b[:, j] for b in per_replica])
            check.prefix = min(check.prefix, int(j))
        if check.handle.gate == "layer":
            check.held.append((i, check.prefix))

    def _finish_layer(self, states: dict[int, Any], new: list[jax.Array], layer: int) -> None:
        cls, pos = self.layer_class[layer]
        hook = self.hook
        if hook is not None:
            hook("load_layer", layer, new[layer])
        self.movers[cls.index].finish_load_layer(states[cls.index], pos)

    def settle(self, handle: LoadHandle, pages: list[PageRef], first_bad: int,
               bad_on: dict[int, tuple[int, ...]], reasons: dict[int, str],
               moved: set[int], rank: int = 0) -> LoadResult:
        """Releases (gate="all"), frees the pages proven bad, reports.

        Only a page proven bad is freed: its host copy failed its own digests on
        some process (``bad_on``: position -> those ranks; every rank frees it, so
        their caches stay the same). A page this request could not use for another
        reason (the caller expected another key, it comes after the first bad page,
        the transfer delivered it wrong while its host copy is intact) stays valid
        for its holders.
        """
        if handle.gate == "all":
            handle._release_all(first_bad)
        invalid = tuple(range(first_bad, len(pages)))
        freed = []
        for j in invalid:
            if j in bad_on:
                p = pages[j]
                self.pool.invalidate(p.slot, p.generation)
                freed.append(j)
                others = [r for r in bad_on[j] if r != rank]
                if j not in reasons and others:
                    reasons[j] = (f"proven bad on rank(s) {others}: its host copy there "
                                  "failed its digests; freed on every rank")
        if first_bad < len(pages) and first_bad not in reasons:
            reasons[first_bad] = "invalid on another process"
        released = handle.released_prefixes
        consumed = any(r is not None and r > first_bad for i, r in enumerate(released)
                       if self.layer_class[i][0].index in moved)
        return LoadResult(first_bad, invalid, dict(sorted(reasons.items())), consumed,
                          released, tuple(freed))
