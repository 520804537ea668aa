"""What a transfer enqueued, and the device staging its copies beside XLA's stream use.

Copies write or read staging outside XLA's view, so a ``Transfer`` holds it until they
end, whatever becomes of the transfer: ``finish`` waits for them and lets go;
``discard`` (a prefetch released, a load that stages again) hands it to its device's
``Staging``, which lets go once the programs and copies have ended (``Staging.reap``,
at the mover's next call). Nothing is let go of by garbage collection. The staging a
device holds at once is bounded (``DmaOptions.staging_bytes`` and half the device's
free memory; a larger transfer still runs beside on a device holding no other).
"""

from __future__ import annotations

import threading
from typing import Any

import jax

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
    """One device's staging (``Staging.of``): the bytes transfers hold against the
    budget, and the transfers let go of before their copies ended (``kept``)."""

    _devices: dict[Any, Staging] = {}
    _lock = threading.Lock()  # every device's figures: a transfer takes on several

    def __init__(self, device: Any):
        self.device, self.held = device, 0
        self.kept: list[Transfer] = []

    @classmethod
    def of(cls, device: Any) -> Staging:
        with cls._lock:
            return cls._devices.setdefault(device, Staging(device))

    @classmethod
    def take(cls, wanted: dict[Any, int], limit: int) -> list[tuple[Staging, int]] | None:
        """Takes the bytes ``wanted`` on each device if all fit, else none (None): within
        ``limit``, or alone on its device, and within half its free memory."""
        owners = [(cls.of(device), n, _free_bytes(device)) for device, n in wanted.items()]
        with cls._lock:
            if any(o.held and o.held + n > limit or free is not None and n > free // 2
                   for o, n, free in owners):
                return None
            for owner, n, _ in owners:
                owner.held += n
        return [(owner, n) for owner, n, _ in owners]

    @classmethod
    def give(cls, taken: list[tuple[Staging, int]]) -> None:
        with cls._lock:
            for owner, n in taken:
                owner.held -= n

    @classmethod
    def reap(cls) -> None:
        """Lets go of kept transfers whose programs and copies have ended (never blocks)."""
        with cls._lock:
            kept = [t for owner in cls._devices.values() for t in owner.kept]
        for transfer in kept:
            if all(d.is_ready() for d in transfer.done) and all(j.done() for j in transfer.jobs):
                with cls._lock:
                    owner = transfer.taken[0][0]
                    if not any(t is transfer for t in owner.kept):
                        continue
                    owner.kept = [t for t in owner.kept if t is not transfer]
                transfer.finish(strict=False)

    @classmethod
    def bytes_held(cls) -> int:
        """Staging held now, every device."""
        with cls._lock:
            return sum(owner.held for owner in cls._devices.values())


class Transfer:
    """One transfer's programs for a slice class: their jobs, an output of each (ready
    once it ran), its digests, and the staging its copies beside XLA's stream use (by
    shard or shard replica) with the budget ``taken``. ``staged``: a load's staging
    transfer; ``k``, ``rows``: a staging transfer's pages and rows."""

    def __init__(self, taken: list[tuple[Staging, int]] | None = None, k: int = 0,
                 rows: int = 0):
        self.jobs: list[CopyJob] = []
        self.done: list[jax.Array] = []
        self.digests: Any = None
        self.buffers: dict[Any, jax.Array] = {}
        self.stage_jobs: dict[Any, CopyJob] = {}
        self.taken, self.k, self.rows = taken or [], k, rows
        self.staged: Transfer | None = None
        self.finished = False  # it let go of what it held
        self._lock = threading.Lock()

    def quiesce(self) -> BaseException | None:
        """Waits until no program can start a copy (a job whose program ended without
        its callback is withdrawn); the first error a program raised (never raises)."""
        first = wait_all(d.block_until_ready for d in self.done)
        for job in self.jobs:
            if not job.ran:
                TICKETS.withdraw(job)
        let_go([job for job in self.jobs if not job.beside])  # ended with their programs
        return first

    def settle(self, what: str) -> None:
        """Waits for the programs; raises ``TransferError`` if one, or its copies, failed."""
        error = self.quiesce()
        for job in self.jobs:
            if job.error is not None:
                raise TransferError(f"{what}: the copies failed: {type(job.error).__name__}: "
                                    f"{job.error}") from job.error
        if error is not None:
            raise TransferError(f"{what}: a program failed: {error}") from error
        if not all(job.ran for job in self.jobs):
            lost = list(TICKETS.lost)
            raise TransferError(f"{what}: a program ended without running its copies"
                                + (f" (latest callback failure: {lost[-1]})" if lost else ""))

    def finish(self, strict: bool) -> None:
        """Waits for the programs and every copy beside XLA's stream, then lets go of the
        staging and its budget, once; ``strict``: raises the first failure."""
        with self._lock:
            if self.finished:
                return
            self.finished = True
        error = self.quiesce()
        for job in self.jobs:
            error = job.wait() or error or job.error
        let_go(self.jobs)
        self.buffers.clear()
        Staging.give(self.taken)
        if error is not None and strict:
            raise TransferError(f"the copies beside XLA's stream failed: "
                                f"{type(error).__name__}: {error}") from error

    def discard(self) -> None:
        """Lets the transfer go without waiting: its device's ``Staging`` keeps it until
        its programs and copies end."""
        with self._lock:
            if self.finished or not self.taken:
                return
        with Staging._lock:
            self.taken[0][0].kept.append(self)
