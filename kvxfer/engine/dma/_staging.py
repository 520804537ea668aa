"""What a transfer enqueued, and the staging its copies beside XLA's stream use: held
until they end (``Transfer.finish``), or, once ``discard``ed, by the device's
``Staging`` until ``reap`` (at the mover's next call) finds them ended; never let go of
by garbage collection."""

from __future__ import annotations

import functools
import threading
from typing import Any

from kvxfer.engine._mover import TransferError
from kvxfer.engine.dma._engines import let_go, wait_all
from kvxfer.engine.dma._jobs import TICKETS, CopyJob

__all__ = ["Staging", "Transfer"]


def _free_bytes(device: Any) -> int | None:
    """Device memory not in use, where the device says (None: it does not)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0) if "bytes_limit" in stats else None


class Staging:
    """One device's staging: the bytes transfers hold (``held``; see ``take``), and the
    transfers let go of before their copies ended (``kept``)."""

    _devices: dict[Any, Staging] = {}
    _lock = threading.Lock()  # every device's figures: a transfer takes on several

    def __init__(self) -> None:
        self.held = 0
        self.kept: list[Transfer] = []

    @classmethod
    def take(cls, wanted: dict[Any, int], limit: int) -> list[tuple[Staging, int]] | None:
        """Takes the bytes ``wanted`` on each device if all fit, else none (None): within
        ``limit``, or alone on its device, and within half its free memory."""
        free = {device: _free_bytes(device) for device in wanted}
        with cls._lock:
            owners = [(cls._devices.setdefault(d, Staging()), n, free[d])
                      for d, n in wanted.items()]
            if any(o.held and o.held + n > limit or f is not None and n > f // 2
                   for o, n, f in owners):
                return None
            for owner, n, _ in owners:
                owner.held += n
        return [(owner, n) for owner, n, _ in owners]

    @classmethod
    def reap(cls) -> None:
        """Lets go of kept transfers whose programs and copies have ended (never blocks)."""
        with cls._lock:
            kept = [t for owner in cls._devices.values() for t in owner.kept]
        for transfer in kept:
            try:
                ended = all(d.is_ready() for d in transfer.done) and all(
                    c.end(block=False) for job in transfer.jobs.values() for c in job.completions)
            except BaseException:  # noqa: BLE001 - a failed query: its stream runs no more
                ended = True
            if ended:
                transfer.finish()

    @classmethod
    def bytes_held(cls) -> int:
        """Staging held now, every device."""
        with cls._lock:
            return sum(owner.held for owner in cls._devices.values())


class Transfer:
    """A transfer's programs for a slice class (``add``), its ``digests``, the staging
    its copies use with the budget ``taken``; ``staged``: a load's staging transfer. A
    staging transfer's ``k`` pages have ``rows`` rows."""

    def __init__(self, taken: list | None = None, k: int = 0, rows: int = 0, staged: Any = None):
        self.jobs, self.done, self.buffers = {}, [], {}  # by key; outputs; by key
        self.taken, self.k, self.rows, self.staged = taken or [], k, rows, staged
        self.digests, self.finished, self.error = None, False, None  # done: let go; why
        self._lock = threading.Lock()

    def add(self, job: CopyJob, done: Any, buffer: Any, key: Any) -> None:
        """Records a program's job, an output ready once it ran (else ``buffer``), and
        the buffer its copies use beside XLA's stream (None: none)."""
        self.jobs[key] = job
        self.done.append(buffer if done is None else done)
        if buffer is not None:
            self.buffers[key] = buffer

    def finish(self) -> BaseException | None:
        """Waits for the programs, the copies beside XLA's stream and ``staged``, then lets
        go of the staging and its budget, once: the first failure (never raises)."""
        with self._lock:
            if self.finished:
                return self.error
            ran, waits = wait_all(d.block_until_ready for d in self.done), []
            for job in self.jobs.values():  # every copy waited for, whatever failed
                TICKETS.withdraw(job)
                waits.append(wait_all(functools.partial(c.end, True) for c in job.completions))
            error = next((e for e in [j.error for j in self.jobs.values()] + [ran, *waits]
                          if e is not None), None)
            if error is None and not all(job.ran for job in self.jobs.values()):
                lost = list(TICKETS.lost)
                error = RuntimeError("a program ended without running its copies" + (
                    f" (latest callback failure: {lost[-1]})" if lost else ""))
            let_go(self.jobs.values())
            self.buffers.clear()
            with Staging._lock:
                for owner, n in self.taken:
                    owner.held -= n
                    owner.kept = [t for t in owner.kept if t is not self]
                self.taken = []
            staged = self.staged.finish() if self.staged is not None else None
            self.finished, self.error = True, error or staged
            return self.error

    def raise_for(self, what: str) -> None:
        """``finish``, raising ``TransferError`` naming ``what`` and the first failure."""
        if (error := self.finish()) is not None:
            raise TransferError(f"{what} failed: {type(error).__name__}: {error}") from error

    def discard(self) -> None:
        """Lets the transfer go (never blocks): its device's ``Staging`` keeps what it
        holds until its programs and copies end."""
        with Staging._lock:
            if self.taken:  # not given back yet
                self.taken[0][0].kept.append(self)
