"""The Pallas mover: per-block DMAs between the device caches and host memory (TPU).

For slice classes the inspector proves addressable, Pallas TPU kernels
(``kvxfer.engine._pallas_kernels``) issue one async copy per block and layer, block ids
through scalar prefetch, one DMA semaphore per layer, between the caches and page
buffers in the host memory of each shard's device (``pinned_host`` on TPU):

* An offload's kernels fill a page buffer ``[pages, layers, *shard_block]`` per shard
  (page ``j`` of the transfer in row ``j``), and the transfer thread copies it into
  the pages' slots.
* A load stages each layer's pages of a shard into a page buffer ``[pages,
  *shard_block]`` on every replica's device before any class starts; one kernel per
  layer and shard replica then writes them into the cache in place (the cache donated
  and aliased to the output), so layer i is complete (its ``done`` token ready) on its
  own, and its digests are enqueued as soon as its kernels are.

The host side of every DMA sits at a static row of a page buffer: the TPU compiler
(libtpu 0.0.42.1) refuses DMAs to or from host memory at a runtime offset (see
``kvxfer.engine._pallas_kernels``), so the kernels cannot write a page into its slot of
the pool itself, and on TPU they are made per bucket with their pages unrolled, one
layer an offload kernel (compile time grows with pages x layers). The host then copies
every page twice, so ``path="auto"`` never takes this mover: on TPU it takes the pinned
mover in place (one DMA a page into the pool's slot, no host copy); ``path="pallas"``
asks for it.

Pages hold each block's logical bytes, row-major, as every other mover stores them,
so the page digests are the existing digest program's (on the caller's thread, over
the caches: it reads HBM, ~50x faster than the host link) and host-side digests,
``read_block_bytes``, stores and faults see the same bytes. A digest fused into the
kernels would be a second implementation of the digest to keep bit-identical, for a
program that costs a fiftieth of the transfer.

Off TPU the same kernels run in Pallas TPU interpret mode, looping over the pages, so
the CPU backend tests everything but the HOST memory space itself. The interpreter
copies each operand in and each output out whole, so there a transfer costs what its
buffers hold, and it runs each kernel to the end before its call returns.

Interpreted kernels hold host callbacks, which JAX's persistent compilation cache does
not keep, so every process compiles them again. Off TPU the page buffers therefore
hold ``loop_pages`` pages whatever the transfer moves (the kernels' page count is a
runtime value already), and an offload kernel moves up to ``_INTERPRETED_LAYERS``
layers: one offload and one load kernel per class serve every transfer size, instead
of one per bucket.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from kvxfer.engine import _pallas_kernels as _kernels
from kvxfer.engine._batch import ShardedLayer, assemble, bucket, device_of, loop_pages
from kvxfer.engine._mover import LoadRequest, Mover, Pending, TransferError
from kvxfer.engine._programs import compile_job
from kvxfer.layout import natural_bits, shape_text
from kvxfer.plan import LayerSpec, SliceClass

__all__ = ["PallasMover", "pallas_refusal"]

# Platforms whose devices run the kernels: compiled on TPU, interpreted on CPU.
_PLATFORMS = ("tpu", "cpu")

# Off TPU the kernels run in TPU interpret mode, whose state is process-wide.
_INTERPRET_LOCK = threading.Lock()

# Layers per interpreted offload kernel: its lowering grows with the layers, and
# interpreted kernels are compiled again in every process (a class of 32 layers runs
# one kernel of 8 four times). On TPU a kernel moves one layer: its pages are
# unrolled, and one layer's kernel serves every layer of the class.
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


class PallasOffload(NamedTuple):
    """What an offload started: per shard, its kernels' ``done`` tokens and their page
    buffers in layer order, and the digests."""

    k: int
    done: list[tuple[jax.Array, ...]]
    buffers: list[tuple[jax.Array, ...]]
    digests: Pending | None


class PallasInputs(NamedTuple):
    """What one shard replica's load kernels read: a page buffer on its device for
    every layer of the class."""

    shard: int
    replica: int
    buffers: tuple[jax.Array, ...]


class PallasLoad(NamedTuple):
    """Per layer position, the ``done`` tokens of every shard replica's kernel."""

    done: list[list[jax.Array]]


def _buffer_pages(k: int, array: Any) -> int:
    """Pages of a page buffer (and entries of the ids) for ``k`` pages of ``array``'s
    blocks: the bucket on TPU, ``loop_pages`` in interpret mode."""
    if _kernels.compiled(device_of(array)):
        return bucket(k)
    return loop_pages(k, array.shape[0])


def _offload_chunks(num_layers: int, device: Any) -> list[tuple[int, int]]:
    """The layer positions ``[lo, hi)`` each offload kernel on ``device`` moves."""
    step = 1 if _kernels.compiled(device) else _INTERPRETED_LAYERS
    return [(lo, min(num_layers, lo + step)) for lo in range(0, num_layers, step)]


def _offload_shape(size: int, layers: int, array: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((size, layers, *array.shape[1:]), array.dtype)


def _load_shape(size: int, array: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((size, *array.shape[1:]), array.dtype,
                                sharding=_kernels.host_sharding(device_of(array)))


def _scalars(device: Any, b: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Abstract scalar-prefetch operands as transfers pass them: the page count
    ``int32[1]`` from the host, the ids ``int32[b]`` already on ``device``."""
    ids = jax.ShapeDtypeStruct((b,), np.int32,
                               sharding=jax.sharding.SingleDeviceSharding(device))
    return jax.ShapeDtypeStruct((1,), np.int32), ids


def compile_kernels(layers: Sequence[ShardedLayer], b: int,
                    job: Callable[[tuple, Callable[[], Any]], None] = compile_job) -> None:
    """Hands ``job(key, compile)`` every kernel a transfer of ``b`` pages of the class
    (``layers``, abstract) runs: each shard's offload kernels and each replica's load
    kernel (``compile()`` returns the compiled program)."""
    for s in range(len(layers[0].shards)):
        primary = tuple(layer.primary[s] for layer in layers)
        device = device_of(primary[0])
        size = _buffer_pages(b, primary[0])
        formats = tuple(a.format for a in primary)
        for lo, hi in _offload_chunks(len(layers), device):
            host = _offload_shape(size, hi - lo, primary[0])
            program = _kernels.offload_program(formats[lo:hi], host, device)
            args = (*_scalars(device, size), primary[lo:hi])
            job(("pallas", "offload", primary[lo:hi], formats[lo:hi], device, host),
                lambda program=program, args=args: program.lower(*args).compile())
        for r, local in enumerate(layers[0].shards[s]):
            device = device_of(local)
            size = _buffer_pages(b, local)
            program = _kernels.load_program(local.format, device)
            args = (*_scalars(device, size), local, _load_shape(size, local))
            job(("pallas", "load", local, local.format, device, size),
                lambda program=program, args=args: program.lower(*args).compile())


class PallasMover(Mover[PallasOffload, list[PallasInputs], PallasLoad]):
    """Pallas DMAs between the caches and host page buffers, for proven-addressable
    classes."""

    name = "pallas"

    def _call(self, program, device: Any, *args):
        if _kernels.compiled(device):
            return program(*args)
        # TPU interpret mode keeps its simulated memory in one process-wide state and
        # copies every operand in and out whole: one kernel at a time, run to its end
        # here.
        with _INTERPRET_LOCK:
            try:
                return jax.block_until_ready(program(*args))
            except Exception:
                _kernels.reset_interpreter()
                raise

    # -- offload ----------------------------------------------------------------

    def start_offload(self, layers, batch, slots, with_digest):
        k = batch.k
        n = np.array([k], np.int32)
        done, buffers = [], []
        for s in range(self.cls.num_shards):
            caches = tuple(layer.primary[s] for layer in layers)
            device = device_of(caches[0])
            formats = tuple(a.format for a in caches)
            size = _buffer_pages(k, caches[0])
            ids_d, _ = batch.on(device, s, size)
            outs = []
            for lo, hi in _offload_chunks(len(layers), device):
                host = _offload_shape(size, hi - lo, caches[0])
                program = _kernels.offload_program(formats[lo:hi], host, device)
                outs.append(self._call(program, device, n, ids_d, caches[lo:hi]))
            buffers.append(tuple(buffer for buffer, _ in outs))
            done.append(tuple(token for _, token in outs))
        digests = self.digests(layers, batch, range(len(layers))) if with_digest else None
        return PallasOffload(k, done, buffers, digests)

    def finish_offload(self, state: PallasOffload, slots):
        k, done, buffers, digests = state
        for s, (tokens, chunks) in enumerate(zip(done, buffers)):
            jax.block_until_ready(tokens)
            first = 0
            for buffer in chunks:
                host = np.asarray(buffer)  # [pages, layers of the kernel, *block]
                raw = host.reshape(host.shape[0], -1).view(np.uint8)[:k]
                m = host.shape[1]
                # Pages are shard-major: a shard's consecutive layers are one range.
                lo, hi = self.pool.shard_range(first, s)[0], \
                    self.pool.shard_range(first + m - 1, s)[1]
                self.pool.data[slots, lo:hi] = raw
                self.copied_on_host(raw.nbytes)
                first += m
        if digests is not None:
            d = digests.get()
            for s in range(self.cls.num_shards):
                self._store_digests(slots, s, d[:, s])

    # -- load -------------------------------------------------------------------

    def stage_load(self, layers, request: LoadRequest) -> list[PallasInputs]:
        k, slots = request.batch.k, request.slots
        out = []
        for s in range(self.cls.num_shards):
            first = layers[0].shards[s][0]
            size = _buffer_pages(k, first)
            # Layer-major: each layer's pages are a page buffer of their own (a load
            # kernel moves one layer, from static rows).
            staging = np.zeros((len(layers), size) + first.shape[1:], first.dtype)
            flat = staging.reshape(len(layers), size, -1).view(np.uint8)
            for pos in range(len(layers)):
                lo, hi = self.pool.shard_range(pos, s)
                flat[pos, :k] = self.pool.data[slots, lo:hi]
                self.copied_on_host(flat[pos, :k].nbytes)
            for r, local in enumerate(layers[0].shards[s]):
                where = _kernels.host_sharding(device_of(local))
                out.append(PallasInputs(s, r, tuple(jax.device_put(list(staging), where))))
        return out

    def start_load(self, arrays, layers, request: LoadRequest, staged: list[PallasInputs]):
        batch = request.batch
        n = np.array([batch.k], np.int32)
        new: list[jax.Array] = []
        done: list[list[jax.Array]] = []
        for pos, (array, layer) in enumerate(zip(arrays, layers)):
            shards: list[list[jax.Array]] = [[] for _ in layer.shards]
            tokens = []
            try:
                for shard, replica, buffers in staged:
                    local = layer.shards[shard][replica]
                    device = device_of(local)
                    program = _kernels.load_program(local.format, device)
                    host = buffers[pos]
                    ids_d = batch.on(device, shard, host.shape[0])[0]
                    out, token = self._call(program, device, n, ids_d, local, host)
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
        # Queued with warm-up's other compiles (side by side), once per kernel.
        compile_kernels(layers, b)
