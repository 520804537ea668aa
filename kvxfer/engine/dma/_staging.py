"""What a transfer enqueued, and the device staging its copies beside XLA's stream use.

Staging is device memory that copies write or read outside XLA's view, so it is held
until they end, whatever becomes of the transfer: ``Transfer.finish`` waits for them
and lets go; ``Transfer.discard`` (a prefetch released, a load that stages again)
hands what it holds to its device's ``Staging``, which lets go once the programs and
copies have ended (``Staging.reap``, at the mover's next offload, stage, load or
discard). Every staging is held by a ``Transfer`` until one of the two: none is let
go of by garbage collection. The staging held on a device at once is bounded
(``DmaOptions.staging_bytes``, and half the device's free memory where it says; a
transfer larger than the bound still runs beside on a device holding no other).
"""

from __future__ import annotations

import threading
from typing import Any

import jax

from kvxfer.engine._mover import TransferError
from kvxfer.engine.dma._copies import let_go, wait_all
from kvxfer.engine.dma._jobs import TICKETS, CopyJob

__all__ = ["Staging", "Transfer"]


def _free_bytes(device: Any) -> int | None:
    """Device memory not in use, where the device reports it (None: it does not)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


class Staging:
    """The staging of one device (one object a device: ``Staging.of``): the bytes
    transfers hold against the budget, and what transfers let go of before their
    copies ended, kept until they have."""

    _devices: dict[Any, Staging] = {}
    _lock = threading.Lock()  # every device's figures: a transfer takes on several

    def __init__(self, device: Any):
        self.device = device
        self.held = 0
        self.kept: list[Transfer] = []

    @classmethod
    def of(cls, device: Any) -> Staging:
        with cls._lock:
            return cls._devices.setdefault(device, Staging(device))

    @classmethod
    def take(cls, wanted: dict[Any, int], limit: int) -> list[tuple[Staging, int]] | None:
        """Takes the bytes ``wanted`` on each device if they all fit, else none (None).
        A transfer larger than ``limit`` still fits a device that holds nothing else,
        within half its free memory."""
        owners = [(cls.of(device), n, _free_bytes(device)) for device, n in wanted.items()]
        with cls._lock:
            for owner, n, free in owners:
                if owner.held and owner.held + n > limit or free is not None and n > free // 2:
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
        """Lets go of kept transfers whose programs and copies have all ended (never
        blocks)."""
        with cls._lock:
            owners = list(cls._devices.values())
        for owner in owners:
            with cls._lock:
                kept = list(owner.kept)
            for transfer in kept:
                if all(d.is_ready() for d in transfer.done) and \
                        all(job.done() for job in transfer.jobs):
                    with cls._lock:
                        if transfer not in owner.kept:
                            continue
                        owner.kept.remove(transfer)
                    transfer.finish(strict=False)

    @classmethod
    def bytes_held(cls) -> int:
        """Staging held now, every device."""
        with cls._lock:
            return sum(owner.held for owner in cls._devices.values())


class Transfer:
    """One transfer's programs for a slice class: their jobs, an output of each (ready
    once it ran), the digests being computed, and the staging its copies beside XLA's
    stream read or write (by shard or shard replica) with the budget it took.

    Attributes:
      staged: for a load from staging, the transfer that put it under way.
      k, rows: the pages and the staging's rows (a staging transfer's).
    """

    def __init__(self, taken: list[tuple[Staging, int]] | None = None, k: int = 0,
                 rows: int = 0):
        self.jobs: list[CopyJob] = []
        self.done: list[jax.Array] = []
        self.digests: Any = None
        self.buffers: dict[Any, jax.Array] = {}
        self.stage_jobs: dict[Any, CopyJob] = {}
        self.taken = taken or []
        self.k, self.rows = k, rows
        self.staged: Transfer | None = None
        self._over = False
        self._lock = threading.Lock()

    @property
    def finished(self) -> bool:
        """Whether it let go of what it held (``finish``)."""
        return self._over

    def quiesce(self) -> BaseException | None:
        """Waits until no program can still start a copy (never raising); a job whose
        program ended without running its callback is withdrawn. Returns the first
        error a program raised."""
        first = wait_all(d.block_until_ready for d in self.done)
        for job in self.jobs:
            if not job.ran:  # its program ended: whatever it recorded, nothing takes it
                TICKETS.withdraw(job)
        let_go([job for job in self.jobs if not job.beside])  # ended with their programs
        return first

    def settle(self, what: str) -> None:
        """Waits for the programs, then raises ``TransferError`` if one failed or a job's
        copies did."""
        error = self.quiesce()
        for job in self.jobs:
            if job.error is not None:
                raise TransferError(f"{what}: the copies failed: {type(job.error).__name__}: "
                                    f"{job.error}") from job.error
        if error is not None:
            raise TransferError(f"{what}: a program failed: {error}") from error
        if not all(job.ran for job in self.jobs):
            lost = TICKETS.lost()
            raise TransferError(f"{what}: a program ended without running its copies"
                                + (f" (latest callback failure: {lost[-1]})" if lost else ""))

    def finish(self, strict: bool) -> None:
        """Waits for the programs and every copy beside XLA's stream, then lets the
        staging and its budget go (once). ``strict``: raise the first failure."""
        with self._lock:
            if self._over:
                return
            self._over = True
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
        """Lets the transfer go without waiting: its device's ``Staging`` keeps what it
        holds until its programs and copies end (``Staging.reap``)."""
        with self._lock:
            if self._over or not self.taken:
                return
        owner = self.taken[0][0]
        with Staging._lock:
            owner.kept.append(self)
