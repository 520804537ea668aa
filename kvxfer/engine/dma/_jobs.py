"""A program's copies (``CopyJob``), the callback, and the tickets it finds them by: a
one-word device array whose buffer address names a call while its program runs (no
device value is read on the host). A callback never raises into XLA (a load would fail
after XLA confirmed the donation of the caches): failures stay on the job, and the
program ends normally, its aliased outputs holding the caches.
"""

from __future__ import annotations

import collections
import threading
import types
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental.buffer_callback import ExecutionStage

from kvxfer.engine.dma._engines import HOOKS, Copies, buffer_address, step_fault

__all__ = ["CopyJob", "Tickets", "TICKETS", "callback"]


class CopyJob:
    """The copies of one program between one shard replica's blocks and host slots
    (``direction``: ``"offload"`` or ``"load"``), or (``stage``) a load's waits, one a
    layer group, for the copies a staging job put under way.

    ``slots`` and the shard's ``offsets`` place the blocks in the class's host ``pool``;
    ``ids`` are the device blocks (None: a page-major buffer); ``beside``: on the
    engine's own stream, a completion after each of ``groups`` (layer spans); ``fault``:
    a callback step made to fail (a self-check's). Set by the callback: ``ran``,
    ``error``, ``sets`` (the copies enqueued or tried), ``completions`` and ``addresses``.
    """

    def __init__(self, engine: Any, direction: str, pool: Any = None, offsets: Any = (),
                 slots: Any = (), ids: Any = None, beside: bool = False,
                 groups: Sequence[tuple[int, int]] | None = None, stage: CopyJob | None = None):
        self.engine, self.direction, self.pool, self.beside = engine, direction, pool, beside
        self.offsets, self.slots = (np.asarray(a, dtype=np.uint64) for a in (offsets, slots))
        self.ids = None if ids is None else np.asarray(ids, dtype=np.uint64)
        self.groups, self.stage, self.fault = groups, stage, None
        self.ran, self.error, self.ticket = False, None, None
        self.sets, self.completions, self.addresses = [], [], []

    def describe(self, device: Sequence[int], span: tuple[int, int] | None = None) -> Copies:
        """The copies given the device buffers' addresses (each layer's cache, or the
        page-major buffer); with ``span``, of layers ``[first, stop)`` only."""
        cls, bb = self.pool.cls, np.uint64(self.pool.cls.shard_block_bytes)
        first, stop = span or (0, len(self.offsets))
        host = (np.uint64(self.pool.memory.address) + self.slots[:, None] *
                np.uint64(cls.page_bytes) + self.offsets[None, first:stop])  # [k, L]
        if self.ids is None:  # row j holds page j: a page is one copy
            row = np.uint64(len(self.offsets)) * bb
            dev = (np.uint64(device[0]) + np.arange(len(self.slots), dtype=np.uint64)[:, None]
                   * row + np.arange(first, stop, dtype=np.uint64)[None, :] * bb)
        else:  # layer-major: a layer's consecutive blocks merge where their slots do
            dev = np.asarray(device, dtype=np.uint64)[:, None] + self.ids[None, :] * bb
            host = host.T
        src, dst = (dev, host) if self.direction == "offload" else (host, dev)
        return Copies(dst.ravel(), src.ravel(), np.full(dst.size, bb, dtype=np.uint64)).merged()

    def run(self, buffers: Sequence[Any], stream: int | None) -> None:
        """Enqueues the copies between ``buffers`` and the host slots; a failure is
        kept in ``error``."""
        try:
            step_fault("address", self)
            device = self.addresses = [buffer_address(b) for b in buffers]
            step_fault("describe", self)
            self.sets = [self.describe(device, span) for span in self.groups or [None]]
            step_fault("copy", self)
            self.engine.copy(self.sets, stream, self.direction,
                             self.completions if self.beside else None)
            self.ran = True
        except BaseException as e:  # noqa: BLE001 - reported by the transfer thread
            self.error = e

    def hold(self, group: int, ok: Any, staging: Any, stream: int | None) -> None:
        """A load's wait for group ``group``: ``stream`` waits for its copies, then 1 is
        written in the ``ok`` word (the group's scatter follows). Nothing is written
        unless ``staging`` is the buffer those copies write."""
        stage = self.stage
        if stage.error is not None:
            raise RuntimeError(f"the staging failed: {type(stage.error).__name__}: "
                               f"{stage.error}")
        if not stage.ran:
            raise RuntimeError("the staging program ended without enqueueing its copies")
        step_fault("address")
        if (handed := buffer_address(staging)) != stage.addresses[0]:
            raise RuntimeError(f"the load was handed staging at {handed:#x}, not the "
                               f"buffer its copies write ({stage.addresses[0]:#x})")
        address = buffer_address(ok)
        step_fault("copy")
        self.engine.hold(stage.completions[group], stream, address)


class Tickets:
    """Tickets by device, and the jobs filed under them (see the module). ``lost``: the
    latest failures of callbacks that never found their job."""

    def __init__(self) -> None:
        self._lock, self._free, self._jobs = threading.Lock(), {}, {}  # by device; address
        self.lost: collections.deque[str] = collections.deque(maxlen=8)

    def issue(self, device: Any, job: CopyJob) -> jax.Array:
        """A ticket on ``device`` with ``job`` filed under it."""
        with self._lock:
            job.ticket = (self._free.get(device) or [None]).pop()
        if job.ticket is None:
            token = jax.device_put(np.zeros(1, dtype=np.uint32), device)
            job.ticket = (token.unsafe_buffer_pointer(), token, device)
        with self._lock:
            self._jobs[job.ticket[0]] = job
        return job.ticket[1]

    def find(self, address: int, take: bool) -> CopyJob | None:
        """The job under the ticket at ``address`` (``take``: its ticket serves again),
        else None, recorded in ``lost``."""
        with self._lock:
            job = self._jobs.get(address)
        if job is None:
            self.lost.append(f"no job is filed under ticket {address:#x}")
        elif take:
            self.withdraw(job)
        return job

    def withdraw(self, job: CopyJob) -> None:
        """Takes back a job whose program took it or can no longer run its callback."""
        with self._lock:
            if self._jobs.get(job.ticket[0]) is job:
                del self._jobs[job.ticket[0]]
                self._free.setdefault(job.ticket[2], []).append(job.ticket)

    def pending(self) -> int:
        """Jobs filed and not yet taken."""
        with self._lock:
            return len(self._jobs)


TICKETS = Tickets()  #: where every DMA program's callback looks its job up


def callback(ctx: Any, out: Any, token: Any, *operands: Any, group: int | None = None,
             last: bool = True) -> None:
    """Runs the job filed under ``token`` on the buffers XLA hands over: its copies (of
    the page-major rows where there are, else the caches), or (``group``) a load's wait
    for that group, the last group taking the job."""
    try:
        if ctx.stage != ExecutionStage.EXECUTE:
            return  # a handler may also be called to prepare
        step_fault("ticket")
        address = buffer_address(token)
        step_fault("lookup")
        job = TICKETS.find(address, take=last)
    except BaseException as e:  # noqa: BLE001 - never raises into XLA (see the module)
        TICKETS.lost.append(f"{type(e).__name__}: {e}")
        return
    for seen in list(HOOKS["spies"]):
        try:
            stream = ctx.stream
        except Exception:  # noqa: BLE001 - XLA:CPU has no stream to give
            stream = None
        seen.append(types.SimpleNamespace(thread=threading.get_ident(), stream=stream,
                                          found=job is not None,
                                          direction=getattr(job, "direction", None)))
    if job is None or job.error is not None:
        return
    try:
        stream = ctx.stream if job.engine.uses_stream else None
        if group is not None:
            job.hold(group, out[0], operands[1], stream)
            job.ran = last
            return
        if job.direction == "offload":
            if job.beside and buffer_address(operands[0]) != buffer_address(out[0]):
                raise RuntimeError("the offload's rows were not handed back in place")
            buffers = [out[0]] if job.beside else [operands[0]] if job.ids is None else operands
        else:
            buffers = [out[0]] if job.ids is None else out[:-1]
    except BaseException as e:  # noqa: BLE001 - see above
        job.error = e
        return
    job.run(buffers, stream)
