"""The staged mover: compiled gather / donated scatter through host numpy buffers.

One compiled program per (class, bucket of block counts) gathers the requested blocks
of every layer of the class on each shard's device, with the page digests computed in
the same program; the reverse program scatters host pages into the caches in place
(argument donation). XLA indexes logically, so it is correct for any layout and
backend: the portable fallback.

On XLA:CPU, whose ``device_put`` aliases an aligned numpy buffer instead of copying
it, a load stages its pages page-major in a buffer of ``loop_pages`` pages (only the
pages written are ever touched, so the rest is address space, not memory) and one
loop program per class writes them into place for every transfer size, raw bits
without a copy of the caches (see ``_programs._write_blocks``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from kvxfer.engine._batch import assemble, device_of, layer_nums, loop_pages
from kvxfer.engine._mover import LoadRequest, Mover, _batch_abstract, _count_abstract, _sds
from kvxfer.engine._raw import RowCopy
from kvxfer.engine._programs import compile_ahead, gather, needs_raw_bits, page_loops, \
    scatter, staged_load

__all__ = ["StagedMover"]


def _staging_dtype(a: jax.Array) -> np.dtype:
    """The dtype pages travel in: the raw bits where XLA:CPU would rewrite NaNs."""
    dtype = np.dtype(a.dtype)
    return np.dtype(f"u{dtype.itemsize}") if needs_raw_bits(a) else dtype


# XLA:CPU's device_put aliases a numpy array aligned to this many bytes instead of
# copying it: 128 MiB of pages staged cost 70-80 ms copied, 0.1 ms aliased.
_ALIGN = 64


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized array whose data starts on a ``_ALIGN``-byte boundary."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class StagedInputs(NamedTuple):
    """One shard replica's pages, already on its device (block ids come at the load):
    ``[L, bucket, *block]``, or page-major ``[loop_pages, L, *block]`` where the load
    loops (``page_loops``)."""

    shard: int
    replica: int
    pages: jax.Array


class StagedOffload(NamedTuple):
    """Per shard, the gathered pages ``[L, bucket, ...]`` and their digests (or None)."""

    k: int
    outs: list[tuple[jax.Array, jax.Array | None]]


class StagedMover(Mover[StagedOffload, list[StagedInputs], None]):
    """Compiled gather / donated scatter programs; correct for every layout."""

    name = "staged"

    def start_offload(self, layers, batch, slots, with_digest):
        out = []
        for s in range(self.cls.num_shards):
            arrays = tuple(layer.primary[s] for layer in layers)
            device = device_of(arrays[0])
            ids_d, base_d = batch.on(device, s)
            out.append(gather(arrays, ids_d, base_d, layer_nums(device, self.cls.layers),
                              with_digest=with_digest))
        return StagedOffload(batch.k, out)

    def finish_offload(self, state: StagedOffload, slots):
        k, outs = state
        shard_bytes = self.cls.shard_block_bytes
        for s, (pages, digests) in enumerate(outs):
            host = np.asarray(pages)  # [L, bucket, ...]; a device_get where not CPU
            raw = host.reshape(host.shape[0], host.shape[1], -1).view(np.uint8)[:, :k]
            for pos in range(raw.shape[0]):
                lo, hi = self.pool.shard_range(pos, s)
                self.pool.data[slots, lo:hi] = raw[pos].reshape(k, shard_bytes)
            if digests is not None:
                self._store_digests(slots, s, np.asarray(digests))

    def warmup(self, arrays, layers, b, with_digest):
        super().warmup(arrays, layers, b, with_digest)
        for s in range(self.cls.num_shards):
            primary = tuple(layer.primary[s] for layer in layers)
            ids, base = _batch_abstract(b, device_of(primary[0]))
            compile_ahead("gather", primary, ids, base,
                          _sds((len(layers),), np.uint32,
                               device_of(primary[0])),
                          with_digest=with_digest)
            dtype = _staging_dtype(primary[0])
            for r in range(len(layers[0].shards[s])):
                local = tuple(layer.shards[s][r] for layer in layers)
                device = device_of(local[0])
                block = local[0].shape[1:]
                if page_loops(device):
                    n = loop_pages(b, local[0].shape[0])
                    compile_ahead("staged_load", local, _sds((n,), np.int32, device),
                                  _sds((n, len(layers)) + block, dtype, device),
                                  _count_abstract(device))
                else:
                    compile_ahead("scatter", local, _sds((b,), np.int32, device),
                                  _sds((len(layers), b) + block, dtype, device))

    def stage_load(self, layers, request: LoadRequest) -> list[StagedInputs]:
        batch, slots = request.batch, np.asarray(request.slots)
        k, b = batch.k, len(batch.padded)
        size = self.cls.shard_block_bytes
        work = []
        for s in range(self.cls.num_shards):
            first = layers[0].primary[s]
            dtype = _staging_dtype(first)
            devices = [device_of(a) for a in layers[0].shards[s]]
            if all(page_loops(d) for d in devices):
                # Page-major, ``loop_pages`` pages: rows past ``k`` are never written
                # nor read, so they cost no memory (device_put aliases the buffer).
                n = loop_pages(k, first.shape[0])
                staging = _aligned_empty((n, len(layers)) + first.shape[1:], dtype)
                flat = staging.reshape(n, -1).view(np.uint8)
                if flat.shape[1] == self.pool.data.shape[1]:  # a page is the pool's row
                    RowCopy(np.arange(k), slots, flat.shape[1])(flat, self.pool.data)
                else:
                    copy = RowCopy(np.arange(k), slots, size)
                    for pos in range(len(layers)):
                        lo, hi = self.pool.shard_range(pos, s)
                        copy(flat[:, pos * size:(pos + 1) * size], self.pool.data[:, lo:hi])
            else:
                # Padding rows are dropped by the scatter: left as they are, not zeroed;
                # each layer's rows are copied straight into place (runs of slots as
                # slices).
                copy = RowCopy(np.arange(k), slots, size)
                staging = _aligned_empty((len(layers), b) + first.shape[1:], dtype)
                flat = staging.reshape(len(layers), b, -1).view(np.uint8)
                for pos in range(len(layers)):
                    lo, hi = self.pool.shard_range(pos, s)
                    copy(flat[pos], self.pool.data[:, lo:hi])
            for r, device in enumerate(devices):
                work.append(StagedInputs(s, r, jax.device_put(staging, device)))
        return work

    def start_load(self, arrays, layers, request: LoadRequest, staged: list[StagedInputs]):
        new_shards: list[list[list[jax.Array]]] = [[[] for _ in range(self.cls.num_shards)]
                                                    for _ in layers]
        batch = request.batch
        # Padding entries point past the end and are dropped by the scatter.
        ids_pad = np.full(len(batch.padded), np.iinfo(np.int32).max, dtype=np.int32)
        ids_pad[:batch.k] = batch.ids
        on_device: dict[object, jax.Array] = {}
        for shard, replica, pages_d in staged:
            local = tuple(layer.shards[shard][replica] for layer in layers)
            device = device_of(local[0])
            if page_loops(device):
                ids_d, _ = batch.on(device, shard, pages_d.shape[0])
                out = staged_load(local, ids_d, pages_d, batch.count_on(device))
            else:
                if device not in on_device:
                    on_device[device] = jax.device_put(ids_pad, device)
                out = scatter(local, on_device[device], pages_d)
            for pos, a in enumerate(out):
                new_shards[pos][shard].append(a)
        new = [assemble(arr, shards) for arr, shards in zip(arrays, new_shards)]
        return new, None
