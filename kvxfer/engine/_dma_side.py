"""The DMA mover's copies beside XLA's stream: the staging they hold, and loads whose
host-to-device copies start before the program that writes the caches.

A load beside XLA's stream (a copy engine with a stream of its own, ``KVXFER_DMA_STREAM``
``side``) runs in two programs per shard replica:

* **stage** (at ``prefetch``, else at ``load``; ``DmaMover.stage_load``): a program
  whose callback enqueues the pages' copies from their host slots into a device
  staging buffer it returns (page-major rows, a page's layers side by side), on the
  engine's own stream, in groups of layers (``layer_groups``) with an event after each
  group. Nothing waits for them: the caller's steps keep running on XLA's stream while
  the pages cross;
* **load** (``dma_load_side``): for each group in turn, a callback makes XLA's stream
  wait for that group's event (``CopyEngine.hold``) and writes a word saying the
  copies were enqueued; then that group's layers are scattered from the staging rows
  into the caches (donated, written in place). A group's scatter waits only for its own
  copies, so it runs while later groups are still crossing. The scatter writes only
  where the word says the copies were enqueued: a load whose staging failed leaves
  every block as it was.

Staging is device memory the copies write outside XLA's view, so it is held until
its copies are done, whatever becomes of the load or the prefetch that made it
(``DmaStaged``): a staging dropped unfinished is parked and let go once its copies
end. The staging held at once, offloads' and loads' together, is bounded by
``KVXFER_DMA_SIDE_BYTES`` (1 GiB by default); a transfer past it runs on XLA's
stream.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import ExecutionStage, buffer_callback

from kvxfer.engine._copies import TICKETS, CopyJob, buffer_address, let_go, step_fault
from kvxfer.engine._mover import TransferError
from kvxfer.engine._programs import _digest_impl, register_kind, scatter_rows

__all__ = ["layer_groups", "SideLoadJob", "DmaStaged",
           "GROUP_BYTES", "CallbackRecord", "spy_callbacks"]

#: A load beside XLA's stream waits for its copies in groups of layers holding at
#: least this much of a page (one copy a page each): a group per layer from 64 KiB
#: blocks, fewer and larger copies below (copy engines run copies below about 28 KiB
#: at a fraction of the link).
GROUP_BYTES = 64 << 10

_DONE = jax.ShapeDtypeStruct((1,), np.uint32)


def _free_bytes(device: Any) -> int | None:
    """Device memory not in use, where the device reports it (None: it does not)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


class _SideBudget:
    """Bytes of device staging the transfers beside XLA's stream hold at once, per
    device (``DmaOptions.staging_bytes``, and at most half the device's free memory);
    a transfer that would pass it runs on XLA's stream."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Any, int] = {}

    def take(self, wanted: dict[Any, int], limit: int) -> dict[Any, int] | None:
        """Takes the bytes ``wanted`` on each device if they all fit, else none (None).
        One transfer larger than ``limit`` still runs beside on a device that holds
        nothing else, if it fits half the device's free memory."""
        free = {device: _free_bytes(device) for device in wanted}
        with self._lock:
            for device, nbytes in wanted.items():
                held, room = self._held.get(device, 0), free[device]
                if held and held + nbytes > limit or room is not None and nbytes > room // 2:
                    return None
            for device, nbytes in wanted.items():
                self._held[device] = self._held.get(device, 0) + nbytes
        return dict(wanted)

    def give(self, taken: dict[Any, int]) -> None:
        """Gives back what ``take`` took, by device."""
        with self._lock:
            for device, nbytes in taken.items():
                self._held[device] -= nbytes

    def held(self) -> int:
        """Bytes held now, every device."""
        with self._lock:
            return sum(self._held.values())


_SIDE = _SideBudget()


def layer_groups(num_layers: int, block_bytes: int, at_least: int = GROUP_BYTES
                 ) -> list[tuple[int, int]]:
    """Consecutive layer spans ``[first, stop)`` of at least ``at_least`` bytes of a page
    each (the last may hold less where it would otherwise be alone), one per layer where
    a block holds that much.

    Example:
        >>> layer_groups(4, 64 << 10)
        [(0, 1), (1, 2), (2, 3), (3, 4)]
        >>> layer_groups(5, 16 << 10)
        [(0, 5)]
        >>> layer_groups(9, 16 << 10)
        [(0, 4), (4, 9)]
    """
    per = max(1, -(-at_least // max(1, block_bytes)))
    spans = [(a, min(a + per, num_layers)) for a in range(0, num_layers, per)]
    if len(spans) > 1 and spans[-1][1] - spans[-1][0] < per:
        spans[-2:] = [(spans[-2][0], num_layers)]
    return spans


class CallbackRecord(NamedTuple):
    """What one callback saw (``spy_callbacks``): the thread it ran on, the stream XLA
    handed it, and whether it found its job under its ticket (and which direction)."""

    thread: int
    stream: Any
    found: bool
    direction: str | None


_spies: list[list[CallbackRecord]] = []


@contextlib.contextmanager
def spy_callbacks() -> Iterator[list[CallbackRecord]]:
    """Records every DMA callback that executes inside the block (a device check's spy:
    on a GPU the callback runs on the caller's thread at dispatch, with an int stream).

    Example:
        >>> with spy_callbacks() as seen:
        ...     pass
        >>> seen
        []
    """
    seen: list[CallbackRecord] = []
    _spies.append(seen)
    try:
        yield seen
    finally:
        _spies.remove(seen)


def _spy(ctx: Any, job: CopyJob | None) -> None:
    try:
        stream = ctx.stream
    except Exception:  # noqa: BLE001 - XLA:CPU has no stream to give
        stream = None
    record = CallbackRecord(threading.get_ident(), stream, job is not None,
                            None if job is None else job.direction)
    for seen in _spies:
        seen.append(record)


# -- waiting, never raising --------------------------------------------------------

def wait_all(done: Sequence[jax.Array]) -> BaseException | None:
    """Waits until every program has ended, whatever any of them raised; returns the
    first error."""
    first = None
    for d in done:
        try:
            d.block_until_ready()
        except BaseException as e:  # noqa: BLE001 - the others are still waited for
            first = first if first is not None else e
    return first


def quiesce(jobs: Sequence[Any], done: Sequence[jax.Array]) -> BaseException | None:
    """Waits until none of the programs can still copy (never raising); a job whose
    program ended without running its callback is withdrawn, its ticket free again.
    Returns the first error a program raised."""
    error = wait_all(done)
    for job in jobs:
        if not job.ran and job.error is None:
            TICKETS.withdraw(job)
    # Copies on XLA's stream ended with their programs.
    let_go([job for job in jobs if not getattr(job, "beside", True)])
    return error


# -- staging held until its copies end ----------------------------------------------

_parked: list[tuple[list[CopyJob], list[jax.Array], int]] = []
_parked_lock = threading.Lock()


def _park(jobs: dict[Any, CopyJob], staging: dict[Any, jax.Array], taken: dict) -> None:
    """Keeps a dropped staging's buffers until its copies end (a finalizer: no waits)."""
    with _parked_lock:
        _parked.append((list(jobs.values()), list(staging.values()), taken))


def reap() -> None:
    """Lets go of parked staging whose copies have all ended (never blocks)."""
    with _parked_lock:
        parked = list(_parked)
    for entry in parked:
        jobs, _, taken = entry
        try:
            done = all(c.done() for job in jobs for c in job.completions)
        except BaseException:  # noqa: BLE001 - a failed query: the copies are over
            done = True
        if done:
            with _parked_lock:
                # By identity: entries hold arrays, whose == compares elements.
                kept = [e for e in _parked if e is not entry]
                if len(kept) < len(_parked):
                    _parked[:] = kept
                    let_go(jobs)
                    _SIDE.give(taken)


class DmaStaged:
    """A load's pages crossing into device staging beside XLA's stream
    (``DmaMover.stage_load``): a staging buffer and the job of its copies per shard
    replica, and the budget it took.

    The buffers are held until the copies end: ``finish`` waits for them (a load that
    consumed the staging); a staging dropped unfinished (a prefetch released, a load
    that staged again) is parked until they end.
    """

    def __init__(self, k: int, rows: int, taken: dict[Any, int]):
        self.k = k
        self.rows = rows
        self.taken = taken
        self.staging: dict[tuple[int, int], jax.Array] = {}
        self.jobs: dict[tuple[int, int], CopyJob] = {}
        self._lock = threading.Lock()
        # The dicts, not the object: a finalizer must not keep what it finalizes.
        self._finalizer = weakref.finalize(self, _park, self.jobs, self.staging, taken)

    def add(self, shard: int, replica: int, staging: jax.Array, job: CopyJob) -> None:
        """Files one shard replica's staging and the job copying into it."""
        self.staging[shard, replica] = staging
        self.jobs[shard, replica] = job

    def finish(self, strict: bool) -> None:
        """Waits for the copies, then lets the staging and its budget go (once).
        ``strict``: raise the first failure of the staging's programs or copies."""
        with self._lock:
            if not self._finalizer.alive:
                return
            self._finalizer.detach()
        jobs = list(self.jobs.values())
        error = quiesce(jobs, list(self.staging.values()))
        for job in jobs:
            for c in job.completions:
                try:
                    c.wait()
                except BaseException as e:  # noqa: BLE001 - every copy is waited for first
                    error = error or e
            error = error or job.error
        let_go(jobs)
        self.staging.clear()
        _SIDE.give(self.taken)
        reap()  # staging dropped earlier: its copies ran before these on the same stream
        if error is not None and strict:
            raise TransferError(f"the load's copies beside XLA's stream failed: "
                                f"{type(error).__name__}: {error}") from error


# -- the load program ---------------------------------------------------------------

class SideLoadJob:
    """A load program's waits: one per layer group, for the copies its staging job
    (``stage``) enqueued beside XLA's stream.

    Filed under the program's ticket; every group's callback looks it up, the last
    one takes it (``ran`` then says every group waited).
    """

    __slots__ = ("engine", "stage", "groups", "ran", "error", "keep", "direction", "held")

    def __init__(self, stage: CopyJob, groups: int):
        self.engine = stage.engine
        self.stage = stage
        self.groups = groups
        self.direction = "load"
        self.ran = False
        self.error: BaseException | None = None
        self.keep: Any = None
        self.held = 0  # groups whose wait was enqueued

    def hold(self, group: int, ok: Any, staging: Any, stream: int | None) -> None:
        """Makes ``stream`` wait for group ``group``'s copies, then writes 1 in the
        ``ok`` word in its order (the scatter of that group then writes its blocks).
        Writes nothing unless ``staging`` is the buffer those copies write."""
        stage = self.stage
        if stage.error is not None:
            raise RuntimeError(f"the staging failed: {type(stage.error).__name__}: "
                               f"{stage.error}")
        if not stage.ran:
            raise RuntimeError("the staging program ended without enqueueing its copies")
        step_fault("address")
        handed = buffer_address(staging)
        if handed != stage.addresses[0]:
            raise RuntimeError(f"the load was handed staging at {handed:#x}, not the "
                               f"buffer its copies write ({stage.addresses[0]:#x})")
        address = buffer_address(ok)
        step_fault("copy")
        self.engine.hold(stage.completions[group], stream)
        self.engine.set_word(address, 1, stream)
        self.held += 1


def _group_callback(ctx: Any, out: Any, token: Any, *operands: Any, group: int,
                    last: bool) -> None:
    """Group ``group``'s wait of a load beside XLA's stream (``SideLoadJob.hold``).

    Never raises (a load's program must end normally: its outputs, aliased to the
    donated caches, still hold them). A failure is kept on the job, and later groups
    then write nothing either.
    """
    try:
        if ctx.stage != ExecutionStage.EXECUTE:
            return
        step_fault("ticket")
        address = buffer_address(token)
        step_fault("lookup")
        job = TICKETS.take(address) if last else TICKETS.peek(address)
    except BaseException as e:  # noqa: BLE001 - see above
        TICKETS.lose(e)
        return
    if job is None:
        return
    if job.error is None:
        try:
            stream = ctx.stream if job.engine.uses_stream else None
            job.hold(group, out[0], operands[1], stream)
        except BaseException as e:  # noqa: BLE001 - see above
            job.error = e
    if last and job.error is None:
        job.ran = True


def _load_side_impl(arrays, token, staging, ids, count, *digest, groups: tuple, raw: bool,
                    loop: bool, unit: int, widths: tuple,
                    callback: Callable[..., None]):
    # Nothing aliases the staging and nothing donates it (copies beside XLA's stream
    # may still write it whatever becomes of this program): each group's callback is
    # handed it only to check it is the buffer its copies write, and returns a word.
    # The group's rows are read from a row computed from that word (0 when it is 1;
    # the staging has one row more than the pages, so the read is never the whole
    # staging, which XLA would take without the index), so no read of the staging can
    # run before the callback that waits for its copies (XLA:CPU runs independent
    # work at once) and XLA has no reason to copy it. Each callback after the first also reads every layer the
    # group before it wrote, so its wait comes after those scatters: a group's scatter
    # runs while later groups are still crossing.
    out = list(arrays)
    starts = np.concatenate([[0], np.cumsum(widths)]).tolist()
    after: tuple = ()
    ok = None
    for g, (a, b) in enumerate(groups):
        ok, = buffer_callback(
            functools.partial(callback, group=g, last=g == len(groups) - 1), (_DONE,),
            has_side_effect=False, input_output_aliases={1: 0})(
                token, jnp.zeros((1,), jnp.uint32), staging, *after)
        first = ok[0].astype(jnp.int32) - 1
        rows = jax.lax.dynamic_slice(staging, (first, starts[a]),
                                     (staging.shape[0] - 1, starts[b] - starts[a]))
        written = jnp.where(ok[0] == 1, count, 0)
        out[a:b] = scatter_rows(out[a:b], rows, ids, written, raw, unit)
        after = tuple(out[a:b])
    extra = ()
    if digest:
        base, nums = digest
        extra = (_digest_impl(out, ids, base, nums, count, raw=raw, loop=loop),)
    return (tuple(out), ok, *extra)


def _load_side_parts(formats: tuple, raw: bool, with_digest: bool, options: tuple):
    groups, loop, unit, widths = options
    return (functools.partial(_load_side_impl, groups=groups, raw=raw, loop=loop, unit=unit,
                              widths=widths, callback=_group_callback),
            dict(donate_argnums=(0,),
                 in_shardings=(formats, None, None, None, None) + (None, None) * with_digest,
                 out_shardings=(formats, None) + (None,) * with_digest))


register_kind("dma_load_side", _load_side_parts, same_formats=0)
