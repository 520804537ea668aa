"""The raw mover: byte-range copies between XLA:CPU buffers and the host pool.

XLA:CPU buffers are host memory, so a block whose layout is row-major is one byte
range of its buffer (``unsafe_buffer_pointer``), copied as a DMA engine would.
XLA:CPU upcasts bf16 and fp8 scatters to f32 over the whole buffer, so moving raw
bits in place is what makes a CPU load cost what it moves.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from kvxfer.engine._batch import ShardedLayer, assemble, device_of
from kvxfer.engine._mover import LoadRequest, Mover, Pending, TransferError
from kvxfer.engine._programs import alias, compile_ahead
from kvxfer.layout import Layout, LayoutError, inspect, natural_bits

__all__ = ["RawMover", "RowCopy", "raw_capable", "shared_buffers", "private_layers"]


class RawOffload(NamedTuple):
    """The digests being computed (the bytes were copied on the caller's thread)."""

    digests: Pending | None


# (address, blocks, block bytes) -> a view of that memory. A view owns nothing and
# only names an address range, so it serves any buffer later placed at the same
# address with the same size: a load's buffers stay where they are through donation,
# and a view costs microseconds to make (32 layers a load).
_views: dict[tuple[int, int, int], np.ndarray] = {}
_VIEWS = 4096


def _buffer_view(a: jax.Array, block_bytes: int) -> np.ndarray:
    """A writable ``uint8[num_blocks, block_bytes]`` view of a CPU array's buffer."""
    nbytes = a.shape[0] * block_bytes
    if a.nbytes != nbytes:  # never read or write past the buffer
        raise TransferError(f"buffer of {a.nbytes} bytes does not hold {a.shape[0]} blocks of "
                            f"{block_bytes} bytes")
    key = (a.unsafe_buffer_pointer(), a.shape[0], block_bytes)
    view = _views.get(key)
    if view is None:
        raw = (ctypes.c_uint8 * nbytes).from_address(key[0])
        view = np.ctypeslib.as_array(raw).reshape(a.shape[0], block_bytes)
        if len(_views) >= _VIEWS:
            _views.clear()
        _views[key] = view
    return view


def raw_capable(array: jax.Array) -> bool:
    """Whether ``RawMover`` may copy this array's blocks as raw bytes.

    XLA:CPU buffers are host memory; a block is then its logical bytes exactly when
    the stored layout is row-major and elements are whole bytes as numpy stores
    them. XLA:CPU stores no tiles, but a layout that *reports* tiles the inspector
    rejects is refused all the same: the raw path copies only what is proven.
    """
    if any(d.platform != "cpu" for d in array.devices()):
        return False
    if array.dtype.itemsize * 8 != natural_bits(array.dtype):
        return False
    try:
        layout = Layout.of(array)
    except LayoutError:
        return False
    if layout.minor_to_major != tuple(range(array.ndim - 1, -1, -1)):
        return False
    return inspect(array.shape, array.dtype, layout).addressable


# Rows at least this large are copied one by one (each a memcpy); smaller scattered
# rows go through one fancy-indexed copy, whose temporary costs less than the calls.
_ROW_COPY_BYTES = 32 << 10


class RowCopy:
    """Copies rows ``src[src_rows[i]] -> dst[dst_rows[i]]`` between 2-D byte arrays.

    Runs of consecutive rows on both sides become single slice copies (memcpy, no
    temporary); the plan is made once per transfer and reused for every layer.
    """

    def __init__(self, dst_rows: np.ndarray, src_rows: np.ndarray, row_bytes: int):
        dst_rows = np.asarray(dst_rows, dtype=np.int64)
        src_rows = np.asarray(src_rows, dtype=np.int64)
        self.dst_rows, self.src_rows = dst_rows, src_rows
        breaks = np.flatnonzero((np.diff(dst_rows) != 1) | (np.diff(src_rows) != 1)) + 1
        starts = np.concatenate([[0], breaks]).astype(np.int64)
        ends = np.concatenate([breaks, [len(dst_rows)]]).astype(np.int64)
        self.runs = [(int(dst_rows[a]), int(src_rows[a]), int(b - a))
                     for a, b in zip(starts, ends)] if len(dst_rows) else []
        self.sliced = row_bytes >= _ROW_COPY_BYTES or len(self.runs) * 4 <= len(dst_rows)
        k = len(dst_rows)
        # One side consecutive: a single gather or scatter pass, still no temporary.
        self.src_run = k > 0 and bool((np.diff(src_rows) == 1).all())
        self.dst_run = k > 0 and bool((np.diff(dst_rows) == 1).all())

    def __call__(self, dst: np.ndarray, src: np.ndarray) -> None:
        if self.sliced:
            for d, s, n in self.runs:
                dst[d:d + n] = src[s:s + n]
        elif self.src_run:
            s = int(self.src_rows[0])
            dst[self.dst_rows] = src[s:s + len(self.src_rows)]
        elif self.dst_run:
            d = int(self.dst_rows[0])
            # mode="clip" (ids were checked) lets numpy write into ``out`` unbuffered.
            np.take(src, self.src_rows, axis=0, out=dst[d:d + len(self.dst_rows)],
                    mode="clip")
        else:
            dst[self.dst_rows] = src[self.src_rows]


def shared_buffers(arrays: Sequence[jax.Array]) -> frozenset:
    """Buffer addresses that back more than one array, or one array more than once,
    among ``arrays``: what a mover writing into (or donating) the caches must copy first.

    One array passed twice (one cache as two layers) shares its buffers on any backend.
    On XLA:CPU distinct arrays may share one too: one buffer under every replica of a
    replicated ``device_put``, a 64-byte-aligned numpy array aliased, found by address
    among the arrays the raw mover may copy (``raw_capable``). Elsewhere no address is
    asked for (an array still being computed might make the call wait) but those of
    an array passed twice.
    """
    owners: dict[int, list[jax.Array]] = {}
    counts: dict[int, int] = {}
    for a in arrays:
        counts[id(a)] = counts.get(id(a), 0) + 1
    for a in arrays:
        on_cpu = all(d.platform == "cpu" for d in a.sharding.device_set)
        if not on_cpu and counts[id(a)] < 2:
            continue
        try:
            pointers = [s.data.unsafe_buffer_pointer() for s in a.addressable_shards]
        except Exception:  # an array whose buffers have no address: nothing to copy
            continue
        for p in pointers:
            owners.setdefault(p, []).append(a)
    shared = set()
    # The addresses first: proving an array raw-capable costs tens of microseconds (a
    # layout inspection), and only arrays whose buffers repeat need the proof.
    for p, of in owners.items():
        if len(of) > 1 and (len({id(a) for a in of}) < len(of)
                            or sum(raw_capable(a) for a in of) > 1):
            shared.add(p)
    return frozenset(shared)


def private_layers(layers: Sequence[ShardedLayer], shared: frozenset[int]
                   ) -> list[ShardedLayer]:
    """``layers`` with every shard whose buffer is in ``shared`` copied to a buffer of
    its own.

    Writing into the caches' buffers (raw copies), or donating them to a program, needs
    buffers no other array holds: one cache passed as two layers, and on XLA:CPU one
    buffer under every replica of a replicated ``device_put`` (or a 64-byte-aligned
    numpy array it aliased). The copies are made once: the arrays a load returns keep
    them.
    """
    if not shared:
        return list(layers)
    return [ShardedLayer(tuple(
        tuple(jax.device_put(a, device_of(a), may_alias=False)
              if a.unsafe_buffer_pointer() in shared else a for a in reps)
        for reps in layer.shards)) for layer in layers]


class RawMover(Mover[RawOffload, None, None]):
    """Raw byte-range copies between XLA:CPU buffers and the host pool."""

    name = "raw"
    writes_buffers = True

    def start_offload(self, layers, batch, slots, with_digest):
        # The digests are enqueued first (they read the caches on XLA's threads while
        # this thread copies); the copy is made now, on the caller's thread, once the
        # caches' pending writers are done, so a step that donates the caches right
        # after this call cannot change what is stored.
        digests = self.digests(layers, batch, range(len(layers))) if with_digest else None
        copy = RowCopy(slots, batch.ids, self.cls.shard_block_bytes)
        for s in range(self.cls.num_shards):
            for pos, layer in enumerate(layers):
                view = _buffer_view(layer.shards[s][0].block_until_ready(),
                                    self.cls.shard_block_bytes)
                lo, hi = self.pool.shard_range(pos, s)
                copy(self.pool.data[:, lo:hi], view)
                self.copied_on_host(batch.k * self.cls.shard_block_bytes)
        return RawOffload(digests)

    def finish_offload(self, state: RawOffload, slots):
        if state.digests is not None:
            d = state.digests.get()
            for s in range(self.cls.num_shards):
                self._store_digests(slots, s, d[:, s])

    def warmup(self, arrays, layers, b, with_digest):
        super().warmup(arrays, layers, b, with_digest)
        compile_ahead("alias", tuple(arrays))

    def start_load(self, arrays, layers, request: LoadRequest, staged: None):
        layers = private_layers(layers, request.shared)
        inputs = tuple(assemble(a, layer.shards) for a, layer in zip(arrays, layers))
        # A donating identity program hands the buffers over in XLA's order: it runs
        # once every computation dispatched earlier that reads or writes them is done,
        # so the copy below never changes what such a computation sees, and anything
        # dispatched after this call reads the loaded bytes. (New Array objects, too:
        # the old ones may hold a cached host copy that would go stale.)
        new = list(alias(inputs))
        copy = RowCopy(request.batch.ids, request.slots, self.cls.shard_block_bytes)
        try:
            for pos, a in enumerate(new):
                a.block_until_ready()
                for s, reps in enumerate(ShardedLayer.of(a).shards):
                    lo, hi = self.pool.shard_range(pos, s)
                    src = self.pool.data[:, lo:hi]
                    for r in reps:
                        copy(_buffer_view(r, self.cls.shard_block_bytes), src)
                    self.copied_on_host(len(reps) * len(request.slots)
                                        * self.cls.shard_block_bytes)
                request.written(pos, a)  # its digest runs while the next layer is copied
        except Exception as e:
            # The inputs were donated: the layers live in ``new`` now.
            raise TransferError(f"raw load failed after taking the buffers: {e}",
                                kv_caches=new) from e
        return new, None
