"""The Pallas mover: per-block DMAs between the device caches and host memory (TPU).

For slice classes the inspector proves addressable, Pallas TPU kernels
(``kvxfer.engine._pallas_kernels``) issue one async copy per block and layer, block ids
and host slots through scalar prefetch, one DMA semaphore per layer:

* A class held by one device (unsharded; replicas may sit on other devices) has its
  host pool allocated as a host-memory JAX array ``[slots, layers, *block]``
  (``pinned_host`` on TPU), which ``ClassPool.data`` views byte for byte. An offload's
  kernel writes the pages straight into their slots (the pool is donated to the kernel
  and handed back as the same buffer); a load's kernels read them from there.
* Pinned host buffers belong to one device while a page keeps every shard of a layer
  side by side, so a shard on another device (a sharded class), or a replica other
  than the first, goes through a page buffer ``[bucket, layers, *shard_block]`` on its
  own device's host memory: an offload's kernel fills it and the transfer thread copies
  it into the pages; a load stages it from the pages before any class starts.

Loads write the caches in place: one kernel per layer and shard replica, the cache
donated and aliased to the output, so layer i is complete (its ``done`` token ready)
on its own, and its digests are enqueued as soon as its kernels are.

Pages hold each block's logical bytes, row-major, as every other mover stores them,
so the page digests are the existing digest program's (on the caller's thread, over
the caches: it reads HBM, ~50x faster than the host link) and host-side digests,
``read_block_bytes``, stores and faults see the same bytes. A digest fused into the
kernels would be a second implementation of the digest to keep bit-identical, for a
program that costs a fiftieth of the transfer.

Off TPU the same kernels run in Pallas TPU interpret mode, so the CPU backend tests
everything but the HOST memory space itself (see ``kvxfer.engine._pallas_kernels``).
The interpreter copies each operand in and each output out whole, the pool included, so
there a transfer costs what the pool holds (tests keep pools small), and it runs each
kernel to the end before its call returns.

Interpreted kernels hold host callbacks, which JAX's persistent compilation cache does
not keep, so every process compiles them again. Off TPU the page buffers therefore
hold ``loop_pages`` pages whatever the transfer moves (the kernels' page count is a
runtime value already), and a load's kernels get a buffer per layer (each kernel
moves one layer, and the interpreter copies its buffer whole): one offload and one
load kernel per class serve every transfer size, instead of one per bucket.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvxfer.engine import _pallas_kernels as _kernels
from kvxfer.engine._batch import ShardedLayer, assemble, bucket, device_of, loop_pages
from kvxfer.engine._mover import LoadRequest, Mover, Pending, TransferError
from kvxfer.engine._programs import compile_job
from kvxfer.hostpool import ClassPool, HostBacking
from kvxfer.layout import Layout, dtype_of, natural_bits, shape_text
from kvxfer.plan import LayerSpec, SliceClass

__all__ = ["PallasMover", "pallas_refusal"]

# Platforms whose devices run the kernels: compiled on TPU, interpreted on CPU (whose
# device memory is host memory, so the pool's numpy view is the array's buffer).
_PLATFORMS = ("tpu", "cpu")

# Off TPU the kernels run in TPU interpret mode, whose state is process-wide.
_INTERPRET_LOCK = threading.Lock()

# Layers per interpreted offload kernel: its lowering grows with the layers, and
# interpreted kernels are compiled again in every process (a class of 32 layers runs
# one kernel of 8 four times). On TPU one kernel moves every layer of the class.
_INTERPRETED_LAYERS = 8


def pallas_refusal(cls: SliceClass, specs: Sequence[LayerSpec], caches: Sequence[jax.Array],
                   emulated: bool) -> tuple[int, str] | None:
    """Why ``PallasMover`` may not move ``cls``: ``(layer, reason)``, or None.

    Args:
      cls: the slice class.
      specs: every layer's spec, with the layout the manager assumes.
      caches: the caches (their devices decide the backend).
      emulated: the layouts are emulated TPU layouts (``layouts=`` on CPU).

    Example:
        >>> import jax.numpy as jnp, kvxfer
        >>> from kvxfer.plan import LayerSpec, make_plan
        >>> spec = LayerSpec("L0", (512, 6144), "bf16", "{1,0:T(8,128)(2,1)}")
        >>> plan = make_plan([spec], 4)
        >>> layer, reason = pallas_refusal(plan.classes[0], [spec], [jnp.zeros((512, 6144))],
        ...                                False)
        >>> reason.startswith("bf16[512,6144]{1,0:T(8,128)(2,1)}")
        True
    """
    for i in cls.layers:
        g = specs[i].shard_geometry
        if not g.addressable:
            return i, g.reason
    first = cls.layers[0]
    spec = specs[first]
    what = shape_text(spec.shard_shape, spec.dtype, spec.layout)
    if emulated:
        return first, (
            f"{what}: the Pallas DMAs move the arrays' real buffers, while layouts= "
            "asks for emulated TPU memory whose pages hold each block's device image; "
            "use path='raw' (or 'auto') for emulated memory, or leave layouts= out "
            "to move the arrays in their own layouts")
    if natural_bits(spec.dtype) != np.dtype(caches[first].dtype).itemsize * 8:
        return first, (f"{what}: {spec.dtype} elements are narrower than a byte, and the "
                       "kernels copy whole elements")
    for i in cls.layers:
        for d in caches[i].sharding.device_set:
            if d.platform not in _PLATFORMS:
                return i, (f"{what}: layer {i} lives on {d.platform} device {d.id}; the "
                           "Pallas TPU kernels run on TPU (and in interpret mode on CPU); "
                           "use path='pinned'")
    return None


def _dense_row_major(layout: Layout, shape: tuple[int, ...], dtype: Any) -> bool:
    """Whether an array under ``layout`` stores its elements as numpy's C order does."""
    geo = layout.geometry(shape, dtype)
    if geo.element_bits != np.dtype(dtype).itemsize * 8:
        return False
    axes = [(a.dim, a.divisor, a.size) for a in geo.axes if a.size > 1]
    return axes == [(d, 1, n) for d, n in enumerate(shape) if n > 1]


def _pool_backing(num_slots: int, *, num_layers: int, block: tuple[int, ...], dtype: Any,
                  device: Any) -> jax.Array | None:
    """The pool as ``[num_slots, num_layers, *block]`` in the device's host memory.

    None when the backend lays it out otherwise than row-major (then ``data`` would not
    view the pages' bytes), and the pool keeps the default allocation.
    """
    shape = (num_slots, num_layers, *block)
    sharding = _kernels.host_sharding(device)
    targets = [sharding]
    if _kernels.compiled(device):
        # TPU may tile host arrays like device ones; ask for the dense layout first.
        from jax.experimental.layout import Format, Layout as JaxLayout

        targets.insert(0, Format(JaxLayout(tuple(range(len(shape))), tiling=()), sharding))
    for target in targets:
        make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=target)
        try:
            program = make.lower().compile()
        except (ValueError, RuntimeError):  # the backend refuses that layout
            continue
        if _dense_row_major(Layout.of(program.output_formats), shape, dtype):
            return program()
    return None


def _padded(values: np.ndarray, b: int) -> np.ndarray:
    out = np.zeros(b, dtype=np.int32)
    out[:len(values)] = values
    return out


class PallasOffload(NamedTuple):
    """What an offload started: per shard, its kernels' ``done`` tokens and their page
    buffers in layer order (None where the kernel wrote the pool itself), and the
    digests."""

    k: int
    done: list[tuple[jax.Array, ...]]
    buffers: list[tuple[jax.Array, ...] | None]
    digests: Pending | None


class PallasInputs(NamedTuple):
    """What one shard replica's load kernels read: page buffers on its device (None:
    the pool itself; one buffer of every layer, or off TPU one a layer) and the slot
    of each page in them."""

    shard: int
    replica: int
    buffers: tuple[jax.Array, ...] | None
    slots: np.ndarray


class PallasLoad(NamedTuple):
    """Per layer position, the ``done`` tokens of every shard replica's kernel."""

    done: list[list[jax.Array]]


class PallasMover(Mover[PallasOffload, list[PallasInputs], PallasLoad]):
    """Pallas DMAs between the caches and the host pool, for proven-addressable classes."""

    name = "pallas"

    def __init__(self, cls: SliceClass, pool: ClassPool):
        super().__init__(cls, pool)
        # Whether shard 0's first replica moves straight between the caches and the
        # pool (the pool is the array ``host_backing`` made), or through page buffers
        # (the backend gave no row-major host array, or the class is sharded).
        owner = pool.owner
        self._direct = cls.num_shards == 1 and owner is not None and \
            owner.shape[1:] == (len(cls.layers), *cls.block_shape) and \
            np.dtype(owner.dtype) == dtype_of(cls.dtype)
        # Only the device whose host memory holds the pool reaches it (under a page
        # axis sharded over data parallelism, other groups' devices use page buffers).
        self._pool_device = device_of(owner) if self._direct else None
        # Held from taking the pool's owner to handing the next one over, so a
        # program never receives an owner another thread has donated meanwhile.
        self._lock = threading.Lock()
        self._owner_checked = False

    @classmethod
    def host_backing(cls, slice_class: SliceClass,
                     layers: Sequence[ShardedLayer]) -> HostBacking | None:
        first = layers[0].shards[0][0]
        # Off TPU the interpreter copies every operand in and out whole: a pool it
        # wrote in place would undo host writes to other slots made meanwhile (an
        # import, say). There the pages go through page buffers, as sharded ones do.
        if slice_class.num_shards != 1 or not _kernels.compiled(device_of(first)):
            return None
        return functools.partial(_pool_backing, num_layers=len(layers),
                                 block=tuple(first.shape[1:]), dtype=first.dtype,
                                 device=device_of(first))

    def _call(self, program, device: Any, *args):
        if _kernels.compiled(device):
            return program(*args)
        # TPU interpret mode keeps its simulated memory in one process-wide state and
        # copies every operand in and out whole (the pool included): one kernel at a
        # time, run to its end here, and no host write to the pool meanwhile (the
        # manager's host writers hold the pool's lock too).
        with _INTERPRET_LOCK, self.pool.lock:
            try:
                return jax.block_until_ready(program(*args))
            except Exception:
                _kernels.reset_interpreter()
                raise

    def _direct_here(self, shard: int, replica: int, device: Any) -> bool:
        return self._direct and shard == 0 and replica == 0 and device == self._pool_device

    @staticmethod
    def _buffer_pages(k: int, array: Any) -> int:
        """Pages of a page buffer (and entries of the ids and slots) for ``k`` pages of
        ``array``'s blocks: the bucket on TPU, ``loop_pages`` in interpret mode."""
        if _kernels.compiled(device_of(array)):
            return bucket(k)
        return loop_pages(k, array.shape[0])

    # -- offload ----------------------------------------------------------------

    def start_offload(self, layers, batch, slots, with_digest):
        k, b = batch.k, len(batch.padded)
        n = np.array([k], np.int32)
        done, buffers = [], []
        for s in range(self.cls.num_shards):
            caches = tuple(layer.primary[s] for layer in layers)
            device = device_of(caches[0])
            formats = tuple(a.format for a in caches)
            if self._direct_here(s, 0, device):
                ids_d, _ = batch.on(device, s)
                with self._lock:
                    owner = self.pool.owner
                    program = _kernels.offload_program(formats, owner.format, device)
                    pool, token = self._call(program, device, n, ids_d, _padded(slots, b),
                                             caches, owner)
                    self.pool.hand_over(pool)
                buffers.append(None)
                done.append((token,))
            else:
                size = self._buffer_pages(k, caches[0])
                ids_d, _ = batch.on(device, s, size)
                rows = np.arange(size, dtype=np.int32)
                outs = []
                for lo, hi in self._offload_chunks(device):
                    shape = jax.ShapeDtypeStruct((size, hi - lo, *caches[0].shape[1:]),
                                                 caches[0].dtype)
                    program = _kernels.offload_program(formats[lo:hi], None, device)
                    outs.append(self._call(program, device, n, ids_d, rows, caches[lo:hi],
                                           shape))
                buffers.append(tuple(buffer for buffer, _ in outs))
                done.append(tuple(token for _, token in outs))
        digests = self.digests(layers, batch, range(len(layers))) if with_digest else None
        return PallasOffload(k, done, buffers, digests)

    def _offload_chunks(self, device: Any) -> list[tuple[int, int]]:
        """The layer positions ``[lo, hi)`` each offload kernel on ``device`` moves."""
        n = len(self.cls.layers)
        step = n if _kernels.compiled(device) else _INTERPRETED_LAYERS
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)]

    def finish_offload(self, state: PallasOffload, slots):
        k, done, buffers, digests = state
        for s, (tokens, chunks) in enumerate(zip(done, buffers)):
            jax.block_until_ready(tokens)
            if chunks is None:
                if not self._owner_checked:
                    with self._lock:
                        self.pool.check_owner()
                    self._owner_checked = True
                continue
            first = 0
            for buffer in chunks:
                host = np.asarray(buffer)  # [pages, layers of the kernel, *block]
                raw = host.reshape(host.shape[0], host.shape[1], -1).view(np.uint8)[:k]
                for i in range(raw.shape[1]):
                    lo, hi = self.pool.shard_range(first + i, s)
                    self.pool.data[slots, lo:hi] = raw[:, i]
                    self.copied_on_host(raw[:, i].nbytes)
                first += raw.shape[1]
        if digests is not None:
            d = digests.get()
            for s in range(self.cls.num_shards):
                self._store_digests(slots, s, d[:, s])

    # -- load -------------------------------------------------------------------

    def stage_load(self, layers, request: LoadRequest) -> list[PallasInputs]:
        batch, slots = request.batch, request.slots
        k, b = batch.k, len(batch.padded)
        out = []
        for s in range(self.cls.num_shards):
            first = layers[0].shards[s][0]
            size = self._buffer_pages(k, first)
            staging = None
            for r, local in enumerate(layers[0].shards[s]):
                device = device_of(local)
                if self._direct_here(s, r, device):
                    out.append(PallasInputs(s, r, None, _padded(slots, b)))
                    continue
                interpreted = not _kernels.compiled(device)
                if staging is None:
                    # Interpreted, layer-major: each layer's pages are a buffer of their
                    # own, ``[size, 1, *block]``; on TPU one buffer ``[b, L, *block]``.
                    shape = (len(layers), size) if interpreted else (size, len(layers))
                    staging = np.zeros(shape + first.shape[1:], first.dtype)
                    flat = staging.reshape(*shape, -1).view(np.uint8)
                    for pos in range(len(layers)):
                        lo, hi = self.pool.shard_range(pos, s)
                        rows = flat[pos, :k] if interpreted else flat[:k, pos]
                        rows[...] = self.pool.data[slots, lo:hi]
                        self.copied_on_host(rows.nbytes)
                where = _kernels.host_sharding(device)
                buffers = tuple(jax.device_put(staging[pos][:, None], where)
                                for pos in range(len(layers))) if interpreted else \
                    (jax.device_put(staging, where),)
                out.append(PallasInputs(s, r, buffers, np.arange(size, dtype=np.int32)))
        return out

    def start_load(self, arrays, layers, request: LoadRequest, staged: list[PallasInputs]):
        batch = request.batch
        new: list[jax.Array] = []
        done: list[list[jax.Array]] = []
        with self._lock:
            owner = self.pool.owner if self._direct else None
            for pos, (array, layer) in enumerate(zip(arrays, layers)):
                shards: list[list[jax.Array]] = [[] for _ in layer.shards]
                tokens = []
                try:
                    for shard, replica, buffers, slots in staged:
                        local = layer.shards[shard][replica]
                        device = device_of(local)
                        program = _kernels.load_program(local.format, device)
                        if buffers is None:
                            host, at = owner, pos
                        elif len(buffers) == 1:
                            host, at = buffers[0], pos
                        else:
                            host, at = buffers[pos], 0  # this layer's own buffer
                        meta = np.array([batch.k, at], np.int32)
                        out, token = self._call(program, device, meta,
                                                batch.on(device, shard, len(slots))[0], slots,
                                                local, host)
                        shards[shard].append(out)
                        tokens.append(token)
                except Exception as e:
                    # Replicas already written are donated: the layer continues from
                    # their new arrays and the others' old ones; later layers as given.
                    for s, reps in enumerate(layer.shards):
                        shards[s] += reps[len(shards[s]):]
                    kept = new + [assemble(array, shards)] + list(arrays[pos + 1:])
                    raise TransferError(f"pallas load failed in layer position {pos}: {e}",
                                        kv_caches=kept) from e
                loaded = assemble(array, shards)
                new.append(loaded)
                done.append(tokens)
                request.written(pos, loaded)  # its digests run while the next layer moves
        return new, PallasLoad(done)

    def finish_load_layer(self, state: PallasLoad, pos: int) -> None:
        jax.block_until_ready(state.done[pos])

    # -- compile ahead ----------------------------------------------------------

    def warmup(self, arrays, layers, b, with_digest):
        super().warmup(arrays, layers, b, with_digest)
        for s in range(self.cls.num_shards):
            primary = tuple(layer.primary[s] for layer in layers)
            device = device_of(primary[0])
            block = primary[0].shape[1:]
            formats = tuple(a.format for a in primary)
            pool = None
            if self._direct:
                owner = self.pool.owner
                pool = jax.ShapeDtypeStruct(owner.shape, owner.dtype, sharding=owner.format)
            if self._direct_here(s, 0, device):
                pool_format = self.pool.owner.format
                self._compile(("offload", formats, pool_format, device, b),
                              _kernels.offload_program(formats, pool_format, device),
                              *_scalars(device, 1, b), primary, pool)
            else:
                size = self._buffer_pages(b, primary[0])
                for lo, hi in self._offload_chunks(device):
                    host = jax.ShapeDtypeStruct((size, hi - lo, *block), primary[0].dtype)
                    self._compile(("offload", formats[lo:hi], None, device, size, host),
                                  _kernels.offload_program(formats[lo:hi], None, device),
                                  *_scalars(device, 1, size), primary[lo:hi], host)
            for r, local in enumerate(layers[0].shards[s]):
                device = device_of(local)
                size = self._buffer_pages(b, local)
                if self._direct_here(s, r, device):
                    size, host = b, pool
                elif _kernels.compiled(device):
                    host = jax.ShapeDtypeStruct((size, len(layers), *block), local.dtype,
                                                sharding=_kernels.host_sharding(device))
                else:
                    host = jax.ShapeDtypeStruct((size, 1, *block), local.dtype,
                                                sharding=_kernels.host_sharding(device))
                self._compile(("load", local.format, device, size, host),
                              _kernels.load_program(local.format, device),
                              *_scalars(device, 2, size), local, host)

    @staticmethod
    def _compile(key: tuple, program: Any, *args: Any) -> None:
        # Queued with warm-up's other compiles (side by side), once per program.
        compile_job(("pallas",) + key, lambda: program.lower(*args).compile())


def _scalars(device: Any, meta: int, b: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Abstract scalar-prefetch operands as transfers pass them: ``int32[meta]`` and
    the slots from the host, the ids ``int32[b]`` already on ``device``."""
    ids = jax.ShapeDtypeStruct((b,), np.int32,
                               sharding=jax.sharding.SingleDeviceSharding(device))
    return (jax.ShapeDtypeStruct((meta,), np.int32), ids,
            jax.ShapeDtypeStruct((b,), np.int32))
