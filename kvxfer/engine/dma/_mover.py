"""``DmaMover``: a slice class's transfers as DMA programs (``_programs``), one a shard
replica, with their jobs (``_jobs``) and staging (``_staging``). Where the copy engine
has streams of its own and the staging fits, offloads copy beside XLA's stream and
loads start their copies at ``prefetch`` (else ``load``) into staging their program
scatters a layer group at a time as the copies land; else (``fell_back``) a transfer
copies on XLA's stream. The pool is pinned host memory on the device's NUMA node.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import numpy as np

from kvxfer._hostmem import HostMemory
from kvxfer._text import parse_bytes
from kvxfer.engine import _programs
from kvxfer.engine._batch import assemble, device_of, layer_nums, loop_pages
from kvxfer.engine._mover import LoadRequest, Mover, Pending, TransferError, _args_abstract, \
    _sds
from kvxfer.engine._programs import compile_ahead, page_loops
from kvxfer.engine._raw import private_layers
from kvxfer.engine.dma import _programs as _kinds  # noqa: F401 # registers the kinds
from kvxfer.engine.dma._engines import HostCopyEngine, cuda_engine, cuda_unavailable
from kvxfer.engine.dma._jobs import TICKETS, CopyJob
from kvxfer.engine.dma._staging import Staging, Transfer
from kvxfer.hostpool import word_bytes
from kvxfer.layout import Layout, LayoutError, inspect, natural_bits

__all__ = ["DmaMover", "DmaOptions", "COPY_ENGINES", "copy_engine", "dma_refusal",
           "RELAYOUT_BELOW", "GROUP_BYTES", "MAX_GROUPS", "layer_groups"]

#: Shard blocks under this are gathered on the device first (a copy a page of a
#: shard): batched copies of scattered blocks ran at about 0.94x the link at 64 KiB on
#: an H100 and about 0.1x below 28 KiB (vllm#42212); the gather runs at HBM rates.
RELAYOUT_BELOW = 64 << 10

#: A load beside XLA's stream waits in layer groups of at least this much of a page, at
#: most ``MAX_GROUPS`` of them (each is a Python callback holding the GIL).
GROUP_BYTES, MAX_GROUPS = 64 << 10, 8

_HOST_ENGINE = HostCopyEngine()

_CHOICES = {"stream": ("side", "xla"), "relayout": ("auto", "always", "never"),
            "copy": ("batch", "loop"), "self_check": (True, False)}


@dataclasses.dataclass(frozen=True)
class DmaOptions:
    """Options of the DMA mover (``KVCacheManager(..., dma=DmaOptions(...))``), checked
    when made; no environment variable is read.

    Attributes:
      stream: ``"side"`` (default): copies run on the copy engine's own streams (CUDA's),
        one a direction, so XLA's stream does not wait for them; ``"xla"``: on XLA's.
      relayout: ``"auto"`` (default) gathers a transfer's pages on the device first
        where shard blocks are under 64 KiB (a copy a page); ``"always"``, ``"never"``.
      staging_bytes: staging that transfers beside XLA's stream may hold on a device at
        once (bytes or a size, default ``"1GiB"``; at most half its free memory): past
        it a transfer not alone on its device copies on XLA's stream (``stats()``).
      copy: ``"batch"`` (default: a ``cuMemcpyBatchAsync`` a transfer where the driver
        has it) or ``"loop"`` (``cuMemcpyAsync`` a copy).
      self_check: the first manager of a process over a GPU runs a small round trip of
        every program form and one injected callback failure (``dma_self_check``); on a
        failure ``path="auto"`` takes the pinned route (``mgr.paths`` says why) and
        ``path="dma"`` raises.

    Raises:
      ValueError: a value not among the choices, or not a size, naming field and value.

    Example:
        >>> DmaOptions(staging_bytes="256MiB").staging_bytes
        268435456
        >>> DmaOptions(stream="aside")
        Traceback (most recent call last):
        ...
        ValueError: DmaOptions(stream='aside'): expected one of ('side', 'xla')
    """

    stream: str = "side"
    relayout: str = "auto"
    staging_bytes: int | str = 1 << 30
    copy: str = "batch"
    self_check: bool = True

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if not any(value is c if isinstance(c, bool) else value == c for c in choices):
                raise ValueError(f"DmaOptions({name}={value!r}): expected one of {choices}")
        size = self.staging_bytes
        try:
            if isinstance(size, bool) or not isinstance(size, (int, str)):
                raise ValueError("expected bytes (an int) or a size such as '1GiB'")
            nbytes = parse_bytes(size) if isinstance(size, str) else int(size)
            if nbytes < 0:
                raise ValueError("a size is not negative")
        except ValueError as e:
            raise ValueError(f"DmaOptions(staging_bytes={size!r}): {e}") from None
        object.__setattr__(self, "staging_bytes", nbytes)


#: Each platform's copy engine, ``make(device, copy)`` for a ``DmaOptions.copy`` mode
#: (tests may put CUDA's over their own driver here).
COPY_ENGINES: dict[str, Any] = {"cpu": lambda device, copy="batch": _HOST_ENGINE,
                                "gpu": cuda_engine, "cuda": cuda_engine}


def copy_engine(device: Any, copy: str = "batch") -> Any:
    """The engine running the DMA mover's copies on ``device`` (else ``ValueError``)."""
    if (make := COPY_ENGINES.get(device.platform)) is None:
        raise ValueError(f"no copy engine for the {device.platform} backend ({device})")
    return make(device, copy)


def dma_refusal(array: jax.Array) -> str | None:
    """Why the DMA mover cannot move ``array``'s blocks (None: it can): it needs a copy
    engine on each of its devices (XLA:CPU's, or an NVIDIA GPU's with ``cuda-bindings``)
    and row-major blocks of whole-byte elements that the inspector proves addressable.

    Example:
        >>> import jax.numpy as jnp
        >>> dma_refusal(jnp.zeros((8, 128), jnp.bfloat16)) is None
        True
    """
    for device in array.sharding.device_set:
        if (make := COPY_ENGINES.get(device.platform)) is None:
            return f"no copy engine for the {device.platform} backend"
        if make is cuda_engine and (why := cuda_unavailable(device)) is not None:
            return why
    if array.dtype.itemsize * 8 != natural_bits(array.dtype):
        return f"{array.dtype} elements are not whole bytes"
    try:
        layout = Layout.of(array)
    except LayoutError as e:
        return str(e)
    if layout.minor_to_major != tuple(range(array.ndim - 1, -1, -1)):
        return f"layout {layout} is not row-major"
    geometry = inspect(array.sharding.shard_shape(array.shape), array.dtype, layout)
    return None if geometry.addressable else geometry.reason


def layer_groups(num_layers: int, block_bytes: int, at_least: int = GROUP_BYTES,
                 most: int = MAX_GROUPS) -> list[tuple[int, int]]:
    """Consecutive layer spans ``[first, stop)`` of at least ``at_least`` bytes of a page
    each, at most ``most`` of them (a shorter tail joins the span before it).

    Example:
        >>> layer_groups(4, 64 << 10), layer_groups(5, 16 << 10), layer_groups(9, 16 << 10)
        ([(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 5)], [(0, 4), (4, 9)])
        >>> layer_groups(80, 1 << 20)[:2], len(layer_groups(80, 1 << 20))
        ([(0, 10), (10, 20)], 8)
    """
    per = max(1, -(-at_least // max(1, block_bytes)), -(-num_layers // max(1, most)))
    spans = [(a, min(a + per, num_layers)) for a in range(0, num_layers, per)]
    if len(spans) > 1 and spans[-1][1] - spans[-1][0] < per:
        spans[-2:] = [(spans[-2][0], num_layers)]
    return spans


class DmaMover(Mover[Transfer, "Transfer | None", Transfer]):
    """Copy-engine copies between the caches and a pinned pool, ordered by XLA.

    Attributes: ``options``; ``fallbacks``: transfers that copied on XLA's stream though
    asked to copy beside it, by why; ``relayout``: whether pages are gathered first
    (``RELAYOUT_BELOW``, or any size where the engine loops); ``groups``: the layer spans
    a load beside XLA's stream waits for in turn.
    """

    name = "dma"
    writes_buffers = True  # its loads donate the caches: shared buffers are copied first

    def __init__(self, cls, pool, options: DmaOptions = DmaOptions()):
        super().__init__(cls, pool)
        if pool.memory is None and pool.nbytes:
            raise ValueError(f"the DMA mover needs a pool of its own host memory for "
                             f"{cls.name} (DmaMover.host_backing)")
        self.options, self.fallbacks = options, {"budget": 0, "out_of_memory": 0}
        self.fault: str | None = None  # a callback step its jobs fail at (a self-check)
        self._unit = unit = word_bytes(cls)
        looped = getattr(self._engine(pool.device), "mode", "batch") == "loop"
        self.relayout = options.relayout == "always" or options.relayout == "auto" and (
            looped or cls.shard_block_bytes < RELAYOUT_BELOW and not page_loops(pool.device))
        self._words = cls.shard_block_bytes // unit
        self.groups = ((0, len(cls.layers)),) if looped else tuple(
            layer_groups(len(cls.layers), cls.shard_block_bytes))
        self._offsets = [np.array([pool.shard_range(pos, s)[0] for pos in range(len(cls.layers))],
                                  dtype=np.uint64) for s in range(cls.num_shards)]

    @classmethod
    def host_backing(cls, slice_class, layers):
        engine = copy_engine(device_of(layers[0].shards[0][0]))
        return lambda num_slots: HostMemory(num_slots * slice_class.page_bytes,
                                            numa_node=engine.numa_node(), pin=engine.pin)

    def fell_back(self) -> dict[str, int]:
        return dict(self.fallbacks)

    def _engine(self, device: Any) -> Any:
        return copy_engine(device, self.options.copy)

    def _beside(self) -> bool:
        return self.options.stream == "side" and self._engine(self.pool.device).side_stream

    def _size(self, k: int, array: Any) -> int | None:
        """Index entries: ``loop_pages`` where digests loop (XLA:CPU), else the bucket's."""
        return None if self.relayout or not page_loops(device_of(array)) else \
            loop_pages(k, array.shape[0])

    def _options(self, kind: str, device: Any, side: bool = False, rows: int = 0) -> tuple:
        """Program ``kind``'s options on ``device`` (``dma_stage``: for ``rows`` pages)."""
        if kind == "dma_stage":
            return rows, len(self.cls.layers) * self._words, f"uint{8 * self._unit}"
        if kind == "dma_load_side":
            return self.groups, page_loops(device), self._unit, self._words
        return (self.relayout, page_loops(device), self._unit) + (
            (side,) if kind == "dma_offload" else ())

    def _replicas(self, layers) -> list[tuple[int, int, Any]]:
        """Each shard replica's shard, replica and device."""
        return [(s, r, device_of(layers[0].shards[s][r])) for s in range(self.cls.num_shards)
                for r in range(len(layers[0].shards[s]))]

    def _take(self, devices: list[Any], rows: int) -> list | None:
        """Staging budget for ``rows`` rows on each of ``devices`` (None, counted: no fit)."""
        each = rows * self.cls.page_bytes // self.cls.num_shards
        wanted = {d: n * each for d, n in collections.Counter(devices).items()}
        if (taken := Staging.take(wanted, int(self.options.staging_bytes))) is None:
            self.fallbacks["budget"] += 1
        return taken

    def _run(self, kind: str, device: Any, arrays: tuple, args: tuple, job: CopyJob,
             with_digest: bool = False, **opt: Any) -> Any:
        """Enqueues ``kind`` over ``arrays`` (or the ticket alone) and ``args``, ``job`` filed."""
        job.fault = self.fault
        token = TICKETS.issue(device, job)
        try:
            return _programs.run(kind, *((arrays, token) if arrays else ((token,),)), *args,
                                 with_digest=with_digest,
                                 options=self._options(kind, device, **opt))
        except BaseException:
            TICKETS.withdraw(job)
            raise

    def _job(self, device: Any, direction: str, shard: int, slots: Any, ids: Any = None,
             **kw: Any) -> CopyJob:
        return CopyJob(self._engine(device), direction, self.pool, self._offsets[shard], slots,
                       ids, **kw)

    def _digest(self, device: Any, base: Any, with_digest: bool) -> tuple:
        return (base, layer_nums(device, tuple(self.cls.layers))) if with_digest else ()

    def start_offload(self, layers, batch, slots, with_digest):
        Staging.reap()
        primary = [tuple(layer.primary[s] for layer in layers)
                   for s in range(self.cls.num_shards)]
        rows = self._size(batch.k, primary[0][0]) or len(batch.padded)
        side = self._beside() and (taken := self._take(
            [device_of(p[0]) for p in primary], rows)) is not None
        state, parts = Transfer(taken if side else None), []
        try:
            for s, arrays in enumerate(primary):
                device = device_of(arrays[0])
                ids, base, count = batch.args(device, s, self._size(batch.k, arrays[0]))
                job = self._job(device, "offload", s, slots,
                                None if self.relayout or side else batch.ids, beside=side)
                out = self._run("dma_offload", device, arrays, (
                    ids, count, *self._digest(device, base, with_digest)), job,
                    with_digest=with_digest, side=side)
                state.add(job, out[0], out[1] if side else None, s)
                parts.append(list(out[2 if side else 1:]))
        except BaseException:
            state.finish()  # the shards enqueued may still write the slots
            raise
        state.digests = Pending(parts, batch.k) if with_digest else None
        return state

    def finish_offload(self, state: Transfer, slots):
        state.raise_for(f"DMA offload of {self.cls.name}")  # the host pages are written
        if state.digests is not None:
            d = state.digests.get()
            for s in range(self.cls.num_shards):
                self._store_digests(slots, s, d[:, s])

    def quiesce(self, state: Transfer) -> None:
        state.finish()

    def stage_load(self, layers, request: LoadRequest) -> Transfer | None:
        """Starts the load's copies beside XLA's stream into device staging where the
        engine can and the staging fits (else None: the load copies on XLA's stream)."""
        Staging.reap()
        replicas, rows = self._replicas(layers), len(request.batch.padded)
        if not self._beside() or (taken := self._take([d for *_, d in replicas],
                                                      rows + 1)) is None:
            return None
        staged = Transfer(taken, request.batch.k, rows)
        try:
            for s, r, device in replicas:
                job = self._job(device, "load", s, request.slots, beside=True,
                                groups=self.groups)
                staged.add(job, None, self._run("dma_stage", device, (), (), job, rows=rows),
                           (s, r))
        except BaseException as e:
            staged.finish()
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            self.fallbacks["out_of_memory"] += 1  # the load copies on XLA's stream
            return None
        return staged

    def discard(self, staged: Transfer | None) -> None:
        if staged is not None:
            staged.discard()
        Staging.reap()

    def staged_done(self, staged: Transfer | None) -> bool:
        Staging.reap()
        return staged is None or staged.finished

    def start_load(self, arrays, layers, request: LoadRequest, staged: Transfer | None):
        Staging.reap()
        if staged is not None and (staged.k != request.batch.k or
                                   staged.rows < len(request.batch.padded)):
            staged.discard()  # staged for other pages: the load copies itself
            staged = None
        if request.shared:
            layers = private_layers(layers, request.shared)
            arrays = [assemble(a, layer.shards) for a, layer in zip(arrays, layers)]
        single = isinstance(arrays[0].sharding, jax.sharding.SingleDeviceSharding)
        # Each shard replica's arrays: the loaded ones once its program is enqueued.
        shards = [[list(layer.shards[s]) for s in range(self.cls.num_shards)] for layer in layers]
        batch, fused = request.batch, request.on_digested is not None
        state = Transfer(staged=staged)
        try:
            for s, r, device in self._replicas(layers):
                local = tuple(arrays) if single else tuple(x[s][r] for x in shards)
                if staged is not None:
                    kind, job = "dma_load_side", CopyJob(self._engine(device), "load",
                                                         stage=staged.jobs[s, r])
                    ids, base, count = batch.args(device, s, staged.rows)
                    args: tuple = (staged.buffers[s, r], ids, count)
                else:
                    kind = "dma_load"
                    job = self._job(device, "load", s, request.slots,
                                    None if self.relayout else batch.ids)
                    ids, base, count = batch.args(device, s, self._size(batch.k, local[0]))
                    args = (ids, count)
                out, done, *digests = self._run(kind, device, local, (
                    *args, *self._digest(device, base, fused)), job, with_digest=fused)
                state.add(job, done, None, (s, r))
                for pos, a in enumerate(out):
                    shards[pos][s][r] = a
                if fused:
                    request.on_digested(s, r, digests[0])
        except BaseException as e:
            # Shards already enqueued consumed their inputs (donated): hand back what
            # every layer lives in now, once no program can still copy.
            state.finish()
            raise TransferError(f"DMA load of {self.cls.name} failed after {len(state.done)} "
                                f"shard program(s) were enqueued: {e}", kv_caches=[
                                    assemble(a, x) for a, x in zip(arrays, shards)]) from e
        return [assemble(a, x) for a, x in zip(arrays, shards)], state

    def load_layer_waits(self, state: Transfer, pos: int) -> bool:
        return any(not d.is_ready() for d in state.done)

    def finish_load_layer(self, state: Transfer, pos: int) -> None:
        self.finish_load(state, len(self.cls.layers))

    def finish_load(self, state: Transfer, num_layers: int) -> None:
        state.raise_for(f"DMA load of {self.cls.name}")

    def _abstract(self, local: tuple, b: int, with_digest: bool, kind: str) -> tuple:
        """Program ``kind``'s arguments after the arrays, abstract, for ``b`` pages."""
        device = device_of(local[0])
        ids, base, count = _args_abstract(b if kind == "dma_load_side" else
                                          self._size(b, local[0]) or b, device)
        digest = (base, _sds((len(local),), np.uint32, device)) if with_digest else ()
        staging = (_sds((b + 1, len(local) * self._words), np.dtype(
            self._options("dma_stage", device)[2]), device),) if kind == "dma_load_side" else ()
        return (_sds((1,), np.uint32, device), *staging, ids, count, *digest)

    def compiled_load(self, layers, b: int, with_digest: bool) -> jax.stages.Compiled:
        """The load program of ``b`` pages into shard 0's first replica, compiled on
        XLA's stream (for checks: its HLO and ``memory_analysis()``)."""
        local = tuple(layer.shards[0][0] for layer in layers)
        return _programs.compiled("dma_load", local, *self._abstract(
            local, b, with_digest, "dma_load"), with_digest=with_digest,
            options=self._options("dma_load", device_of(local[0])))

    def warmup(self, arrays, layers, b, with_digest):
        beside = self._beside()
        for s, r, device in self._replicas(layers):
            local = tuple(layer.shards[s][r] for layer in layers)
            calls = [("dma_load", False)] + [("dma_offload", side) for side in (
                {beside, False} if r == 0 else ())] + [("dma_load_side", False)] * beside
            if beside:
                compile_ahead("dma_stage", (_sds((1,), np.uint32, device),),
                              options=self._options("dma_stage", device, rows=b))
            for kind, side in calls:
                compile_ahead(kind, local, *self._abstract(local, b, with_digest, kind),
                              with_digest=with_digest, options=self._options(kind, device, side))
