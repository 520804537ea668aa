"""The DMA mover: copy-engine copies between the caches and a pinned pool, in XLA's order.

One jitted program per slice class, shard replica and transfer (one per bucket of page
counts; on XLA:CPU one for every transfer of up to ``loop_pages`` pages):

* **offload**: digests the blocks on the device, then calls a ``buffer_callback`` that
  enqueues one batch of copies from the blocks to the pages' host slots. Where the copy
  engine has a stream of its own (CUDA; ``DmaOptions(stream="xla")`` turns it off) the
  program first gathers the pages into rows it returns (aliased: no copy), and the
  callback records an event on XLA's stream and enqueues the copies on the engine's
  stream after it: the engine's next step does not wait for them. The offload holds
  the rows until the copies' own event says they are done (the transfer thread waits
  for it before the pages are committed); the staging held at once on a device,
  offloads' and loads', is bounded by ``DmaOptions.staging_bytes`` (1 GiB) and half
  the device's free memory, past which a transfer copies on XLA's stream (so does one
  whose staging finds no device memory); otherwise, on the stream XLA hands the
  callback;
* **load**: where the copy engine has a stream of its own, the copies start before
  the load's program, at ``prefetch`` or else at ``load`` (``stage_load``): a program
  whose callback enqueues them on the engine's stream into device staging, in groups
  of layers with an event after each; the load's program then makes XLA's stream wait
  for one group's event at a time and scatters that group into the caches (donated,
  written in place) while later groups still cross (``_dma_side``). Otherwise the
  program calls the callback with the caches aliased in to out, copying the pages'
  host slots into the blocks on XLA's stream. Either way it then digests the landed
  blocks on the device.

The host pool is allocated outside XLA (``kvxfer._hostmem.HostMemory``), page-major,
page-locked by the copy engine and placed on the device's NUMA node. No payload byte
passes through a CPU copy and no arithmetic reads host memory: the digests read
device buffers only. A copy engine executes the descriptors (``_copies``): the CUDA
driver's on a GPU (``_cuda``), ``memmove`` on XLA:CPU (CI runs every line but the
driver calls). XLA:CPU runs a program that holds a host callback on the dispatching
thread when its inputs are ready (to avoid deadlocks with reentrant callbacks), so
there the call itself copies; behind pending writers it is scheduled like any
program.

Blocks of a class become one copy each, merged where adjacent on both sides. Where
they are small (``RELAYOUT_BELOW``), the program first gathers a transfer's pages on
the device into one page-major buffer (each page's layers side by side, as the pool
holds them), so each page is one copy: copy engines run copies below about 28 KiB at
a fraction of the link. ``DmaOptions(relayout=...)`` (``auto``, ``always``, ``never``)
overrides the choice, so a device check can measure both. An engine that loops (one
driver call per copy: a driver without ``cuMemcpyBatchAsync``, or
``DmaOptions(copy="loop")``) relayouts whatever the block size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental.buffer_callback import ExecutionStage, buffer_callback

from kvxfer._hostmem import HostMemory
from kvxfer.engine._batch import assemble, device_of, layer_nums, loop_pages
from kvxfer.engine._copies import TICKETS, CopyEngine, CopyJob, HostCopyEngine, \
    buffer_address, let_go, step_fault
from kvxfer.engine._cuda import cuda_engine, cuda_unavailable
from kvxfer.engine._dma_side import _SIDE, CallbackRecord, DmaStaged, SideLoadJob, \
    _spies, _spy, layer_groups, reap, spy_callbacks
from kvxfer.engine._dma_options import DmaOptions
from kvxfer.engine._dma_side import quiesce as _quiesce
from kvxfer.engine._mover import LoadRequest, Mover, Pending, TransferError, _args_abstract, \
    _sds
from kvxfer.engine import _programs
from kvxfer.engine._programs import (_digest_impl, compile_ahead, page_loops,
                                     page_rows, register_kind, scatter_rows, unit_count)
from kvxfer.engine._raw import private_layers
from kvxfer.hostpool import word_bytes
from kvxfer.layout import Layout, LayoutError, inspect, natural_bits

__all__ = ["DmaMover", "DmaOptions", "COPY_ENGINES", "copy_engine", "dma_refusal",
           "RELAYOUT_BELOW", "CallbackRecord", "spy_callbacks"]

#: Shard blocks smaller than this are gathered on the device first (one copy a page
#: of a shard). Why 64 KiB: batched copies of scattered 64 KiB blocks ran at about
#: 0.94x the link on an H100 and at 5-7 GB/s (about 0.1x) below 28 KiB (vllm#42212),
#: while the gather costs the device a read and a write of the same bytes, at HBM
#: rates about 50x the link: about 4 % of the copy's time, worth it below 64 KiB and
#: not above. ``kvxfer.bench.first_check``'s copy-size step measures the same sweep on
#: the device at hand; ``DmaOptions(relayout=...)`` overrides.
RELAYOUT_BELOW = 64 << 10

_HOST_ENGINE = HostCopyEngine()

#: The copy engine of each platform, by ``device.platform`` (``copy_engine``), made as
#: ``make(device, copy)`` for a ``DmaOptions.copy`` mode: tests may put another engine
#: here (CUDA's over entry points of their own, say).
COPY_ENGINES: dict[str, Callable[..., CopyEngine]] = {
    "cpu": lambda device, copy="batch": _HOST_ENGINE,
    "gpu": cuda_engine,
    "cuda": cuda_engine,
}


def copy_engine(device: Any, copy: str = "batch") -> CopyEngine:
    """The engine that executes the DMA mover's copies for ``device``.

    Raises:
      ValueError: the platform has none (naming why).
    """
    make = COPY_ENGINES.get(device.platform)
    if make is None:
        raise ValueError(f"no copy engine for the {device.platform} backend ({device})")
    return make(device, copy)


def _engine_refusal(device: Any) -> str | None:
    make = COPY_ENGINES.get(device.platform)
    if make is None:
        return f"no copy engine for the {device.platform} backend"
    return cuda_unavailable(device) if make is cuda_engine else None


def dma_refusal(array: jax.Array) -> str | None:
    """Why the DMA mover cannot move ``array``'s blocks (None: it can).

    It needs a copy engine reaching every device holding the array (XLA:CPU, or an
    NVIDIA GPU with ``cuda-bindings``), and every block must be one byte range at a
    fixed stride: a row-major layout of whole-byte elements (what the copy
    descriptors address), proven addressable by the inspector.

    Example:
        >>> import jax.numpy as jnp
        >>> dma_refusal(jnp.zeros((8, 128), jnp.bfloat16)) is None
        True
    """
    for device in array.sharding.device_set:
        why = _engine_refusal(device)
        if why is not None:
            return why
    if array.dtype.itemsize * 8 != natural_bits(array.dtype):
        return f"{array.dtype} elements are not whole bytes"
    try:
        layout = Layout.of(array)
    except LayoutError as e:
        return str(e)
    if layout.minor_to_major != tuple(range(array.ndim - 1, -1, -1)):
        return f"layout {layout} is not row-major"
    shard = array.sharding.shard_shape(array.shape)
    geometry = inspect(shard, array.dtype, layout)
    return None if geometry.addressable else geometry.reason


# -- the programs -------------------------------------------------------------------

_DONE = jax.ShapeDtypeStruct((1,), np.uint32)


def _callback(ctx: Any, out: Any, token: Any, *operands: Any) -> None:
    """Runs the ``CopyJob`` filed under ``token`` on the buffers XLA hands over.

    Never raises: an exception here would fail the program after XLA confirmed the
    donation of its inputs, so a load would lose the caches. Every failure is
    recorded on the job (or, before the job is found, with the tickets) for the
    transfer thread, and the program ends normally: a load's outputs, aliased to its
    inputs, still hold the caches.
    """
    try:
        if ctx.stage != ExecutionStage.EXECUTE:
            return  # a handler may also be called to prepare: the copies belong to execution
        step_fault("ticket")
        address = buffer_address(token)
        step_fault("lookup")
        job = TICKETS.take(address)
    except BaseException as e:  # noqa: BLE001 - see above
        TICKETS.lose(e)
        return
    if _spies:
        try:
            _spy(ctx, job)
        except BaseException:  # noqa: BLE001 - a spy never fails a transfer
            pass
    if job is None:
        return
    try:
        if job.ids is None:  # the staging buffer: an operand (offload) or the output (load)
            buffers = [operands[0] if job.direction == "offload" else out[0]]
        else:  # the caches: read (offload), or written in place (load: aliased outputs)
            buffers = operands if job.direction == "offload" else out[:-1]
        stream = ctx.stream if job.engine.uses_stream else None
    except BaseException as e:  # noqa: BLE001 - see above
        job.error = e
        return
    job.run(buffers, stream)


def _digests(arrays, ids, count, digest, raw, loop):
    base, nums = digest
    return _digest_impl(arrays, ids, base, nums, count, raw=raw, loop=loop)


# The callbacks are declared without side effects: their outputs are always the
# program's own (the caches, a ``done`` word), so XLA keeps them, and a program with an
# effect leaves JAX's C++ dispatch for its Python path (60 us more a call on XLA:CPU).


def _offload_impl(arrays, token, ids, count, *digest, raw: bool, relayout: bool, loop: bool,
                  unit: int, side: bool, callback: Callable[..., None]):
    # The digests read the blocks on the device; the copies read them too, so the two
    # may run in either order.
    out = (_digests(arrays, ids, count, digest, raw, loop),) if digest else ()
    if side:
        # Copies beside XLA's stream read the gathered rows after the program ends:
        # the rows come back as an output (aliased, no copy) that the offload holds
        # until its copies are done, so XLA cannot hand their memory to a later step.
        rows = page_rows(arrays, ids, raw, unit)
        staging, done = buffer_callback(
            callback, (jax.ShapeDtypeStruct(rows.shape, rows.dtype), _DONE),
            has_side_effect=False, input_output_aliases={1: 0})(token, rows)
        return (done, staging, *out)
    if relayout:
        operands = (page_rows(arrays, ids, raw, unit),)
    else:
        operands = tuple(arrays)
    done = buffer_callback(callback, _DONE, has_side_effect=False)(token, *operands)
    return (done, *out)


def _load_impl(arrays, token, ids, count, *digest, raw: bool, relayout: bool, loop: bool,
               unit: int, callback: Callable[..., None]):
    if relayout:
        # The staging rows start as the blocks' own bytes and the callback writes them
        # in place, so a callback that copies nothing (it failed) scatters every block
        # back unchanged: a failed load leaves the caches as they were.
        rows = page_rows(arrays, ids, raw, unit)
        staging, done = buffer_callback(
            callback, (jax.ShapeDtypeStruct(rows.shape, rows.dtype), _DONE),
            has_side_effect=False, input_output_aliases={1: 0})(token, rows)
        out = scatter_rows(arrays, staging, ids, count, raw, unit)
    else:
        *out, done = buffer_callback(
            callback, (*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays), _DONE),
            has_side_effect=False,
            input_output_aliases={1 + i: i for i in range(len(arrays))})(token, *arrays)
    extra = (_digests(out, ids, count, digest, raw, loop),) if digest else ()
    return (tuple(out), done, *extra)


def _stage_impl(arrays, *, rows: int, words: int, dtype: str, callback: Callable[..., None]):
    # The callback enqueues the copies into a buffer XLA allocates for the output
    # (nothing initializes it): on the copy engine's own stream, after an event on
    # XLA's (``_dma_side``). One row more than the pages: the load reads the pages'
    # rows at an index it computes (``_dma_side._load_side_impl``).
    staging, _ = buffer_callback(callback, (jax.ShapeDtypeStruct((rows + 1, words), dtype),
                                            _DONE),
                                 has_side_effect=False)(*arrays)
    return staging


def _stage_parts(formats: tuple, raw: bool, with_digest: bool, options: tuple):
    rows, words, dtype = options
    return (functools.partial(_stage_impl, rows=rows, words=words, dtype=dtype,
                              callback=_callback), dict(in_shardings=(formats,)))


def _offload_parts(formats: tuple, raw: bool, with_digest: bool, options: tuple):
    relayout, loop, unit, side = options
    return (functools.partial(_offload_impl, raw=raw, relayout=relayout, loop=loop, unit=unit,
                              side=side, callback=_callback),
            dict(in_shardings=(formats, None, None, None) + (None, None) * with_digest))


def _load_parts(formats: tuple, raw: bool, with_digest: bool, options: tuple):
    relayout, loop, unit = options
    return (functools.partial(_load_impl, raw=raw, relayout=relayout, loop=loop, unit=unit,
                              callback=_callback),
            dict(donate_argnums=(0,),
                 in_shardings=(formats, None, None, None) + (None, None) * with_digest,
                 out_shardings=(formats, None) + (None,) * with_digest))


register_kind("dma_offload", _offload_parts)
register_kind("dma_load", _load_parts, same_formats=0)
register_kind("dma_stage", _stage_parts)


# -- the mover ----------------------------------------------------------------------

class DmaOffload(NamedTuple):
    """What an offload enqueued: its jobs, an output of each program (ready once its
    copies are done, or enqueued beside XLA's stream), the digests being computed
    (None with integrity off), and for copies beside XLA's stream the gathered rows
    they read (held until they are done; emptied then) and the budget they took."""

    jobs: list[CopyJob]
    done: list[jax.Array]
    digests: Pending | None
    staging: list[jax.Array]
    taken: dict | None = None


def _finish_side(state: DmaOffload, strict: bool) -> None:
    """Waits for copies run beside XLA's stream, then lets their staging go (and its
    bytes from the budget; once). ``strict``: raise ``TransferError`` for a failed
    wait."""
    if not state.staging:
        return
    error = None
    for job in state.jobs:
        for completion in job.completions:
            try:
                completion.wait()
            except BaseException as e:  # noqa: BLE001 - every copy is waited for first
                error = error or e
    let_go(state.jobs)
    state.staging.clear()
    _SIDE.give(state.taken or {})
    if error is not None and strict:
        raise TransferError(f"the copies beside XLA's stream failed: {error}") from error


class DmaLoad(NamedTuple):
    """A load's jobs and an output of each program the caller never holds; for a load
    beside XLA's stream, the staging its copies crossed into."""

    jobs: list[Any]
    done: list[jax.Array]
    staged: DmaStaged | None = None


def _settle(jobs: list[CopyJob], done: list[jax.Array], what: str) -> None:
    """Waits for the programs, then raises ``TransferError`` if a job's copies failed.

    Every program is waited for before anything is given back, also when one of them
    failed: a program still queued may run its callback, which must find its own job
    under its ticket (never a later call's) and the pool it copies to still mapped.
    """
    error = _quiesce(jobs, done)
    for job in jobs:
        if job.error is not None:
            raise TransferError(f"{what}: the copies failed: {type(job.error).__name__}: "
                                f"{job.error}") from job.error
    if error is not None:
        raise TransferError(f"{what}: a program failed: {error}") from error
    for job in jobs:
        if not job.ran:
            lost = TICKETS.lost()
            raise TransferError(f"{what}: a program ended without running its copies"
                                + (f" (latest callback failure: {lost[-1]})" if lost else ""))


class DmaMover(Mover[DmaOffload, "DmaStaged | None", DmaLoad]):
    """Copy-engine copies between the caches and a pinned pool, ordered by XLA."""

    name = "dma"
    writes_buffers = True  # its loads donate the caches: shared buffers are copied first

    def __init__(self, cls, pool, options: DmaOptions = DmaOptions()):
        super().__init__(cls, pool)
        if pool.memory is None and pool.nbytes:
            raise ValueError(f"the DMA mover needs a pool of its own host memory for "
                             f"{cls.name} (DmaMover.host_backing)")
        self.options = options
        #: Transfers that copied on XLA's stream though asked to copy beside it, by why.
        self.fallbacks = {"budget": 0, "out_of_memory": 0}
        self._unit = word_bytes(cls)
        mode = options.relayout
        # An engine without a batch call pays a call per copy (about 5 us of the
        # caller's time each on CUDA): one copy a page is worth a device gather at any
        # block size. A page holds each shard's layers side by side (shard-major), so
        # a shard's gathered page is one copy under tensor parallelism too.
        looped = getattr(self._engine(pool.device), "mode", "batch") == "loop"
        self._relayout = mode == "always" or mode == "auto" and (
            looped or cls.shard_block_bytes < RELAYOUT_BELOW and not page_loops(pool.device))
        self._offsets = [np.array([pool.shard_range(pos, s)[0] for pos in range(len(cls.layers))],
                                  dtype=np.uint64) for s in range(cls.num_shards)]
        # A load beside XLA's stream waits for its copies group by group (one group,
        # one copy a page, where every copy costs a driver call).
        self._groups = ((0, len(cls.layers)),) if looped else tuple(
            layer_groups(len(cls.layers), cls.shard_block_bytes))
        self._words = cls.shard_block_bytes // self._unit

    @classmethod
    def host_backing(cls, slice_class, layers):
        engine = copy_engine(device_of(layers[0].shards[0][0]))

        def make(num_slots: int) -> HostMemory:
            return HostMemory(num_slots * slice_class.page_bytes, numa_node=engine.numa_node(),
                              pin=engine.pin)
        return make

    @property
    def relayout(self) -> bool:
        """Whether transfers gather pages on the device first (one copy a page)."""
        return self._relayout

    def _size(self, k: int, array: Any) -> int | None:
        """Entries of a program's index arrays: ``loop_pages`` where the digests loop
        (XLA:CPU, one program for every transfer up to it), else the bucket (None)."""
        if self._relayout or not page_loops(device_of(array)):
            return None
        return loop_pages(k, array.shape[0])

    def _engine(self, device: Any) -> CopyEngine:
        return copy_engine(device, self.options.copy)

    def _job(self, direction: str, device: Any, shard: int, slots: np.ndarray,
             ids: np.ndarray, side: bool = False) -> CopyJob:
        return CopyJob(self._engine(device), direction, self.pool.memory.address,
                       self.cls.page_bytes, slots, self._offsets[shard],
                       self.cls.shard_block_bytes,
                       None if self._relayout or side else ids, memory=self.pool.memory,
                       beside=side)

    def _options(self, device: Any, side: bool | None = None) -> tuple:
        """The programs' options; with ``side`` (an offload's), whether its copies run
        beside XLA's stream."""
        options = (self._relayout, page_loops(device), self._unit)
        return options if side is None else options + (side,)

    def _beside(self) -> bool:
        """Whether offloads may run their copies beside XLA's stream."""
        return self.options.stream == "side" and getattr(self._engine(self.pool.device),
                                                         "side_stream", False)

    def _take(self, wanted: dict[Any, int]) -> dict[Any, int] | None:
        """Takes staging bytes by device from the budget (None, counted: they do not fit)."""
        taken = _SIDE.take(wanted, int(self.options.staging_bytes))
        if taken is None:
            self.fallbacks["budget"] += 1
        return taken

    def fell_back(self) -> dict[str, int]:
        """Transfers that copied on XLA's stream though asked to copy beside it."""
        return dict(self.fallbacks)

    # -- offload ------------------------------------------------------------------

    def _run(self, kind: str, arrays: tuple, shard: int, batch, slots: np.ndarray,
             with_digest: bool, side: bool = False) -> tuple[Any, CopyJob]:
        """Files a program's copies under a ticket and enqueues it: its outputs, its job."""
        device = device_of(arrays[0])
        ids, base, count = batch.args(device, shard, self._size(batch.k, arrays[0]))
        offload = kind == "dma_offload"
        job = self._job("offload" if offload else "load", device, shard, slots, batch.ids,
                        side)
        token = TICKETS.issue(device, job)
        digest = (base, layer_nums(device, tuple(self.cls.layers))) if with_digest else ()
        try:
            return _programs.run(kind, arrays, token, ids, count, *digest,
                                 with_digest=with_digest,
                                 options=self._options(device, side if offload else None)), job
        except BaseException:
            TICKETS.withdraw(job)
            raise

    def start_offload(self, layers, batch, slots, with_digest):
        reap()
        taken = None
        if self._beside():
            # The rows of the padded block ids, every layer, on each shard's device.
            rows = self._size(batch.k, layers[0].primary[0]) or len(batch.padded)
            wanted: dict[Any, int] = {}
            for s in range(self.cls.num_shards):
                device = device_of(layers[0].primary[s])
                wanted[device] = wanted.get(device, 0) + rows * len(self.cls.layers) * \
                    self.cls.shard_block_bytes
            taken = self._take(wanted)
        side = taken is not None
        state = DmaOffload([], [], None, [], taken)
        parts = []
        try:
            for s in range(self.cls.num_shards):
                out, job = self._run("dma_offload", tuple(layer.primary[s] for layer in layers),
                                     s, batch, slots, with_digest, side)
                state.jobs.append(job)
                state.done.append(out[0])
                if side:
                    state.staging.append(out[1])
                parts.append(list(out[2 if side else 1:]))
        except BaseException:
            # The shards enqueued write the offload's slots: the caller gives them back
            # once these programs can no longer copy (a failure in the call waits).
            _quiesce(state.jobs, state.done)
            if state.staging:
                _finish_side(state, strict=False)
            else:  # no program was enqueued: the budget taken goes back
                _SIDE.give(state.taken or {})
            raise
        return state._replace(digests=Pending(parts, batch.k) if with_digest else None)

    def finish_offload(self, state: DmaOffload, slots):
        try:
            _settle(state.jobs, state.done, f"DMA offload of {self.cls.name}")
        except BaseException:
            _finish_side(state, strict=False)
            raise
        _finish_side(state, strict=True)  # the host pages are written after this
        if state.digests is not None:
            d = state.digests.get()
            for s in range(self.cls.num_shards):
                self._store_digests(slots, s, d[:, s])

    def quiesce(self, state) -> None:
        _quiesce(state.jobs, state.done)
        if isinstance(state, DmaOffload):
            _finish_side(state, strict=False)
        elif state.staged is not None:
            state.staged.finish(strict=False)

    # -- load ---------------------------------------------------------------------

    def stage_load(self, layers, request: LoadRequest) -> DmaStaged | None:
        """Starts the load's copies beside XLA's stream (``_dma_side``), where the copy
        engine has a stream of its own and the staging fits the budget; else None (the
        load's own program copies, on XLA's stream)."""
        reap()
        if not self._beside():
            return None
        slots = np.asarray(request.slots)
        rows = len(request.batch.padded)
        replicas = [len(layers[0].shards[s]) for s in range(self.cls.num_shards)]
        wanted: dict[Any, int] = {}
        for s in range(self.cls.num_shards):
            for r in range(replicas[s]):
                device = device_of(layers[0].shards[s][r])
                wanted[device] = wanted.get(device, 0) + (rows + 1) * len(self.cls.layers) * \
                    self.cls.shard_block_bytes
        taken = self._take(wanted)
        if taken is None:
            return None
        staged = DmaStaged(request.batch.k, rows, taken)
        options = (rows, len(self.cls.layers) * self._words, f"uint{8 * self._unit}")
        try:
            for s in range(self.cls.num_shards):
                for r in range(replicas[s]):
                    device = device_of(layers[0].shards[s][r])
                    job = CopyJob(self._engine(device), "load", self.pool.memory.address,
                                  self.cls.page_bytes, slots, self._offsets[s],
                                  self.cls.shard_block_bytes, None, memory=self.pool.memory,
                                  beside=True, groups=self._groups)
                    token = TICKETS.issue(device, job)
                    try:
                        staging = _programs.run("dma_stage", (token,), options=options)
                    except BaseException:
                        TICKETS.withdraw(job)
                        raise
                    staged.add(s, r, staging, job)
        except BaseException as e:
            staged.finish(strict=False)
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            # No device memory for the staging: the load copies on XLA's stream.
            self.fallbacks["out_of_memory"] += 1
            return None
        return staged

    def _run_side(self, arrays: tuple, shard: int, replica: int, batch,
                  staged: DmaStaged, with_digest: bool) -> tuple[Any, SideLoadJob]:
        """Enqueues one shard replica's load from its staging: its outputs, its job."""
        device = device_of(arrays[0])
        ids, base, count = batch.args(device, shard, staged.rows)
        job = SideLoadJob(staged.jobs[shard, replica], len(self._groups))
        token = TICKETS.issue(device, job)
        digest = (base, layer_nums(device, tuple(self.cls.layers))) if with_digest else ()
        try:
            out, done, *digests = _programs.run(
                "dma_load_side", arrays, token, staged.staging[shard, replica], ids, count,
                *digest, with_digest=with_digest, options=self._side_options(device))
        except BaseException:
            TICKETS.withdraw(job)
            raise
        return (out, done, *digests), job

    def _side_options(self, device: Any) -> tuple:
        return (self._groups, page_loops(device), self._unit,
                (self._words,) * len(self.cls.layers))

    def start_load(self, arrays, layers, request: LoadRequest, staged: DmaStaged | None):
        if staged is not None and (staged.k != request.batch.k or
                                   staged.rows < len(request.batch.padded)):
            staged.finish(strict=False)  # staged for other pages: the load copies itself
            staged = None
        if request.shared:
            layers = private_layers(layers, request.shared)
            arrays = [assemble(a, layer.shards) for a, layer in zip(arrays, layers)]
        single = isinstance(arrays[0].sharding, jax.sharding.SingleDeviceSharding)
        # Each shard replica's arrays: the loaded ones once its program is enqueued.
        new_shards: list[list[list[jax.Array]]] = [
            [list(layer.shards[s]) for s in range(self.cls.num_shards)] for layer in layers]
        batch, slots = request.batch, np.asarray(request.slots)
        fused = request.on_digested is not None
        jobs, done = [], []
        try:
            for s in range(self.cls.num_shards):
                for r in range(len(layers[0].shards[s])):
                    local = tuple(arrays) if single else tuple(layer.shards[s][r]
                                                               for layer in layers)
                    if staged is not None:
                        (out, d, *digests), job = self._run_side(local, s, r, batch, staged,
                                                                 fused)
                    else:
                        (out, d, *digests), job = self._run("dma_load", local, s, batch,
                                                            slots, fused)
                    jobs.append(job)
                    done.append(d)
                    if single:
                        new_shards = [[[a]] for a in out]
                    else:
                        for pos, a in enumerate(out):
                            new_shards[pos][s][r] = a
                    if fused:
                        request.on_digested(s, r, digests[0])
        except BaseException as e:
            # Shards already enqueued consumed their inputs (donated): hand back what
            # every layer lives in now, the loaded shards and the untouched ones, once
            # no program can still copy out of the load's slots.
            _quiesce(jobs, done)
            if staged is not None:
                staged.finish(strict=False)
            raise TransferError(f"DMA load of {self.cls.name} failed after {len(jobs)} "
                                f"shard program(s) were enqueued: {e}", kv_caches=[
                                    self._whole(a, shards, single)
                                    for a, shards in zip(arrays, new_shards)]) from e
        return [self._whole(a, shards, single) for a, shards in zip(arrays, new_shards)], \
            DmaLoad(jobs, done, staged)

    @staticmethod
    def _whole(array: jax.Array, shards: list[list[jax.Array]], single: bool) -> jax.Array:
        return shards[0][0] if single else assemble(array, shards)

    def load_layer_waits(self, state: DmaLoad, pos: int) -> bool:
        return any(not d.is_ready() for d in state.done)

    def finish_load_layer(self, state: DmaLoad, pos: int) -> None:
        self.finish_load(state, len(self.cls.layers))

    def finish_load(self, state: DmaLoad, num_layers: int) -> None:
        try:
            _settle(state.jobs, state.done, f"DMA load of {self.cls.name}")
        except BaseException:
            if state.staged is not None:
                state.staged.finish(strict=False)
            raise
        if state.staged is not None:
            state.staged.finish(strict=True)

    def compiled_load(self, layers, b: int, with_digest: bool) -> jax.stages.Compiled:
        """The load program of ``b`` pages into shard 0's first replica, compiled (for
        checks: its HLO and ``memory_analysis()``); ``layers`` abstract or live."""
        local = tuple(layer.shards[0][0] for layer in layers)
        device = device_of(local[0])
        ids, base, count = _args_abstract(self._size(b, local[0]) or b, device)
        digest = (base, _sds((len(layers),), np.uint32, device)) if with_digest else ()
        return _programs.compiled("dma_load", local, _sds((1,), np.uint32, device), ids,
                                  count, *digest, with_digest=with_digest,
                                  options=self._options(device))

    # -- warm-up ------------------------------------------------------------------

    def warmup(self, arrays, layers, b, with_digest):
        # Both directions digest inside their own programs; a load under a transfer
        # hook compiles its digest programs when it first runs.
        for s in range(self.cls.num_shards):
            for r in range(len(layers[0].shards[s])):
                local = tuple(layer.shards[s][r] for layer in layers)
                device = device_of(local[0])
                n = self._size(b, local[0]) or b
                token = _sds((1,), np.uint32, device)
                ids, base, count = _args_abstract(n, device)
                digest = (base, _sds((len(layers),), np.uint32, device)) if with_digest else ()
                if self._beside():
                    words = len(self.cls.layers) * self._words
                    dtype = np.dtype(f"uint{8 * self._unit}")
                    compile_ahead("dma_stage", (token,), options=(b, words, dtype.name))
                    ids_b, base_b, count_b = _args_abstract(b, device)
                    digest_b = (base_b,) + digest[1:] if with_digest else ()
                    compile_ahead("dma_load_side", local, token,
                                  _sds((b + 1, words), dtype, device),
                                  ids_b, count_b, *digest_b, with_digest=with_digest,
                                  options=self._side_options(device))
                # Every offload's program, beside XLA's stream and on it (past the
                # staging budget), and the load's on XLA's stream: no transfer that
                # falls back compiles inside the call.
                if r == 0:
                    for side in {self._beside(), False}:
                        compile_ahead("dma_offload", local, token, ids, count, *digest,
                                      with_digest=with_digest,
                                      options=self._options(device, side))
                compile_ahead("dma_load", local, token, ids, count, *digest,
                              with_digest=with_digest, options=self._options(device))
