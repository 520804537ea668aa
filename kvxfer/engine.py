"""The block transfer engine: batched device↔host page copies, per slice class.

Three movers, chosen per slice class:

* ``StagedMover`` (every backend, every layout): one compiled program per
  (class, bucket of block counts) gathers the requested blocks of every layer of
  the class on each shard's device, with the page digests computed in the same
  program; the reverse program scatters host pages into the caches in place
  (argument donation). XLA indexes logically, so it is correct for any layout.
* ``RawMover`` (XLA:CPU, row-major stored blocks): raw byte-range copies between
  the device buffers (``unsafe_buffer_pointer``) and the host pool, as a DMA
  engine would. XLA:CPU upcasts bf16 and fp8 scatters to f32 over the whole
  buffer, so moving raw bits in place is what makes a load cost what it moves.
* ``EmulatedMover`` (direct path over emulated TPU memory): raw byte-range copies
  between emulated device images (``kvxfer.emulate``) and the host pool, for
  layouts the inspector has proven addressable.

Movers work shard by shard on the devices that own the shards; replicas of a
replicated layer are stored once and loaded into every replica.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvxfer import emulate
from kvxfer import integrity
from kvxfer.hostpool import DIGEST_SLOTS, ClassPool
from kvxfer.layout import Layout, LayoutError, inspect, natural_bits
from kvxfer.plan import SliceClass

__all__ = ["TransferError", "ShardedLayer", "StagedMover", "RawMover", "EmulatedMover",
           "bucket", "PageBatch"]

assert integrity.DIGEST_WORDS <= DIGEST_SLOTS


class TransferError(RuntimeError):
    """A device or transfer failure: never reported as a cache miss."""


def bucket(k: int) -> int:
    """Block counts are padded to powers of two so each class compiles a few programs."""
    return 1 << max(0, (k - 1).bit_length())


# ---------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s.indices(d)[0] for s, d in zip(index, shape))


@dataclasses.dataclass(frozen=True)
class ShardedLayer:
    """One layer's array split into its distinct shards, each with its replicas.

    Attributes:
      shards: ``shards[s]`` lists the single-device arrays holding shard ``s``
        (one per replica), ordered by the shard's position in the global array.
    """

    shards: tuple[tuple[jax.Array, ...], ...]

    @classmethod
    def of(cls, array: jax.Array) -> ShardedLayer:
        groups: dict[tuple[int, ...], list[jax.Array]] = {}
        for s in array.addressable_shards:
            groups.setdefault(_index_key(s.index, array.shape), []).append(s.data)
        return cls(tuple(tuple(groups[k]) for k in sorted(groups)))

    @property
    def primary(self) -> tuple[jax.Array, ...]:
        """One replica of each shard (where offloads read)."""
        return tuple(r[0] for r in self.shards)


def assemble(template: jax.Array, shard_arrays: Sequence[Sequence[jax.Array]]) -> jax.Array:
    """A global array like ``template`` from new per-shard (per-replica) arrays."""
    flat = [a for reps in shard_arrays for a in reps]
    if len(flat) == 1 and template.sharding.is_fully_addressable and \
            len(template.sharding.device_set) == 1:
        return flat[0]
    return jax.make_array_from_single_device_arrays(template.shape, template.sharding, flat)


class PageBatch:
    """The pages of one transfer: device block ids and page identities.

    Digests are bound to (key, layer, generation, shard). The batch holds the
    per-page words once; programs insert the layer, and device copies of the ids
    and identities are made once per device, not once per layer.
    """

    def __init__(self, ids: np.ndarray, keys: Sequence[int], generations: Sequence[int]):
        self.ids = np.asarray(ids, dtype=np.int32)
        self.k = len(self.ids)
        self.padded = _pad_ids(self.ids)
        base = np.zeros((len(self.padded), integrity.IDENTITY_WORDS), dtype=np.uint32)
        keys64 = np.asarray(list(keys), dtype=np.uint64)
        base[:self.k, 0] = (keys64 & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        base[:self.k, 1] = (keys64 >> np.uint64(32)).astype(np.uint32)
        base[:self.k, 3] = np.asarray(list(generations), dtype=np.uint32)
        self._base = base
        self._device: dict[tuple[Any, int], tuple[jax.Array, jax.Array]] = {}

    def identity(self, layer: int, shard: int) -> np.ndarray:
        """``uint32[k, 5]`` identities of one layer and shard (host side)."""
        out = self._base[:self.k].copy()
        out[:, 2] = layer
        out[:, 4] = shard
        return out

    def on(self, device: Any, shard: int) -> tuple[jax.Array, jax.Array]:
        """(padded ids, identities without the layer) on ``device``."""
        key = (device, shard)
        if key not in self._device:
            base = self._base.copy()
            base[:, 4] = shard
            self._device[key] = (jax.device_put(self.padded, device),
                                 jax.device_put(base, device))
        return self._device[key]


def _pad_ids(ids: np.ndarray) -> np.ndarray:
    k = len(ids)
    out = np.full(bucket(k), ids[0] if k else 0, dtype=np.int32)
    out[:k] = ids
    return out


# ---------------------------------------------------------------------------
# Compiled programs (cached by jax.jit per shapes, dtypes and devices)
# ---------------------------------------------------------------------------


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def needs_raw_bits(a: jax.Array) -> bool:
    """Whether moving ``a`` in a program must go through its raw bits.

    XLA:CPU gathers and scatters bf16 and fp8 through f32, which rewrites NaN
    payloads; other backends and dtypes move bits as they are. A bitcast breaks
    buffer aliasing, so it is used only where it is needed for exactness.
    """
    return (any(d.platform == "cpu" for d in a.devices())
            and jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4
            and natural_bits(a.dtype) == 8 * a.dtype.itemsize)  # not fp4: no NaNs


def _bits(a: jax.Array, raw: bool) -> jax.Array:
    if raw:
        return jax.lax.bitcast_convert_type(a, _UINT[a.dtype.itemsize])
    return a


def _with_layer(base: jax.Array, layer: jax.Array) -> jax.Array:
    return base.at[:, 2].set(layer)


def _gather_impl(arrays, ids, base, layer_nums, *, raw: bool, with_digest: bool):
    pages = jnp.stack([_bits(a, raw)[ids] for a in arrays])
    if not with_digest:
        return pages, None
    words = integrity.as_words(pages, batch_dims=2)
    identity = jax.vmap(_with_layer, in_axes=(None, 0))(base, layer_nums)
    return pages, integrity.digest(words, identity)


def _digest_impl(arrays, ids, base, layer_nums, *, raw: bool):
    return jnp.stack([integrity.digest(integrity.as_words(_bits(a, raw)[ids], batch_dims=1),
                                       _with_layer(base, layer_nums[i]))
                      for i, a in enumerate(arrays)])


def _scatter_impl(arrays, ids, pages, *, raw: bool):
    out = []
    for i, a in enumerate(arrays):
        b = _bits(a, raw).at[ids].set(pages[i], mode="drop", unique_indices=True)
        out.append(jax.lax.bitcast_convert_type(b, a.dtype) if raw else b)
    return tuple(out)


# One compiled program per (kind, input formats, options); jax.jit then caches per
# shapes. The caches' formats are pinned so that a cache in a non-default layout (a
# compiler-chosen TPU layout, say) is neither converted on the way in nor comes back
# in the default layout.
@functools.lru_cache(maxsize=None)
def _program(kind: str, formats: tuple, raw: bool, with_digest: bool = False):
    if kind == "gather":
        fn = functools.partial(_gather_impl, raw=raw, with_digest=with_digest)
        return jax.jit(fn, in_shardings=(formats, None, None, None))
    if kind == "digest":
        return jax.jit(functools.partial(_digest_impl, raw=raw),
                       in_shardings=(formats, None, None, None))
    return jax.jit(functools.partial(_scatter_impl, raw=raw), donate_argnums=(0,),
                   in_shardings=(formats, None, None), out_shardings=formats)


def _run(kind: str, arrays: tuple[jax.Array, ...], *args, with_digest: bool = False):
    formats = tuple(a.format for a in arrays)
    return _program(kind, formats, needs_raw_bits(arrays[0]), with_digest)(arrays, *args)


def _gather(arrays, ids, base, layer_nums, with_digest: bool):
    """Blocks ``ids`` of every layer stacked ``[L, k, ...]``, and their digests."""
    return _run("gather", arrays, ids, base, layer_nums, with_digest=with_digest)


def _digest_blocks(arrays, ids, base, layer_nums):
    """Digests ``uint32[L, k, D]`` of blocks ``ids`` of every layer (no copy out)."""
    return _run("digest", arrays, ids, base, layer_nums)


def _scatter(arrays, ids, pages):
    """Writes ``pages[l, j]`` into block ``ids[j]`` of layer ``l``, in place (donated).

    Padding entries of ``ids`` are out of range and dropped.
    """
    return _run("scatter", arrays, ids, pages)


# ---------------------------------------------------------------------------
# Movers
# ---------------------------------------------------------------------------


class Pending:
    """Digests being computed on the devices; ``get()`` waits and gathers them."""

    def __init__(self, parts: list[Any], k: int):
        self._parts = parts
        self._k = k

    def get(self) -> np.ndarray:
        """``uint32[positions, shards, k, D]``."""
        return np.stack([np.concatenate([np.asarray(c)[:, :self._k] for c in chunks])
                         for chunks in self._parts], axis=1)


# Layers per digest program: compile time grows with the layers in a program, so a
# class of 61 layers compiles two programs of 8 (and one of 5), not one of 61.
DIGEST_CHUNK = 8

_LAYER_NUMS: dict[tuple[Any, tuple[int, ...]], jax.Array] = {}


def _layer_nums(device: Any, layers: tuple[int, ...]) -> jax.Array:
    """Device copies of layer-number vectors, made once (there are few distinct ones)."""
    key = (device, layers)
    if key not in _LAYER_NUMS:
        _LAYER_NUMS[key] = jax.device_put(np.asarray(layers, dtype=np.uint32), device)
    return _LAYER_NUMS[key]


def _device_of(a: jax.Array) -> Any:
    return next(iter(a.devices()))


class Mover(abc.ABC):
    """Moves the pages of one slice class between device shards and its host pool.

    Offload is split in two: ``gather`` runs in the caller's thread (it must read
    the caches before later work changes them) and ``finish_offload`` on the
    transfer thread. Load likewise: ``load`` returns the new arrays at once and
    ``finish_load_layer`` completes layer by layer on the transfer thread.
    """

    name = "mover"

    def __init__(self, cls: SliceClass, pool: ClassPool):
        self.cls = cls
        self.pool = pool

    @abc.abstractmethod
    def gather(self, layers: Sequence[ShardedLayer], batch: PageBatch, with_digest: bool
               ) -> Any:
        """Starts reading the batch's blocks (and their digests)."""

    @abc.abstractmethod
    def finish_offload(self, state: Any, slots: np.ndarray) -> None:
        """Writes what ``gather`` read into host ``slots``."""

    @abc.abstractmethod
    def load(self, arrays: Sequence[jax.Array], layers: Sequence[ShardedLayer],
             batch: PageBatch, slots: np.ndarray) -> tuple[list[jax.Array], Any]:
        """Starts writing host ``slots`` into blocks ``ids``; returns the new arrays."""

    def finish_load_layer(self, state: Any, pos: int) -> None:
        """Completes the copy of layer ``pos`` of the class (transfer thread)."""

    def digests(self, layers: Sequence[ShardedLayer], batch: PageBatch,
                positions: Sequence[int], replica: int = 0) -> Pending:
        """Starts the device digests ``[len(positions), shards, k, D]`` of the blocks.

        ``replica`` picks which copy of a replicated layer is read.
        """
        positions = list(positions)
        chunks = [positions[i:i + DIGEST_CHUNK] for i in range(0, len(positions), DIGEST_CHUNK)]
        parts = []
        for s in range(self.cls.num_shards):
            device = _device_of(layers[positions[0]].shards[s][replica])
            ids_d, base_d = batch.on(device, s)
            parts.append([_digest_blocks(tuple(layers[p].shards[s][replica] for p in chunk), ids_d,
                                         base_d, _layer_nums(device, tuple(
                                             self.cls.layers[p] for p in chunk)))
                          for chunk in chunks])
        return Pending(parts, batch.k)

    def _store_digests(self, slots: np.ndarray, shard: int, d: np.ndarray) -> None:
        # d: [L, k, D] -> pool.digests[slot, L, shard, D]
        self.pool.digests[slots, :, shard, :integrity.DIGEST_WORDS] = \
            np.swapaxes(d[:, :len(slots)], 0, 1)


class StagedMover(Mover):
    """Compiled gather / donated scatter programs; correct for every layout."""

    name = "staged"

    def gather(self, layers, batch, with_digest):
        out = []
        for s in range(self.cls.num_shards):
            arrays = tuple(layer.primary[s] for layer in layers)
            device = _device_of(arrays[0])
            ids_d, base_d = batch.on(device, s)
            out.append(_gather(arrays, ids_d, base_d, _layer_nums(device, self.cls.layers),
                               with_digest=with_digest))
        return batch.k, out

    def finish_offload(self, state, slots):
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

    def load(self, arrays, layers, batch, slots):
        k, b = batch.k, len(batch.padded)
        new_shards: list[list[list[jax.Array]]] = [[[] for _ in range(self.cls.num_shards)]
                                                    for _ in layers]
        # Padding entries point past the end and are dropped by the scatter.
        ids_pad = np.full(b, np.iinfo(np.int32).max, dtype=np.int32)
        ids_pad[:k] = batch.ids
        # Every transfer to the devices is made before the first donating scatter, so a
        # failure there leaves the caller's caches intact.
        work = []
        for s in range(self.cls.num_shards):
            first = layers[0].primary[s]
            dtype = np.dtype(first.dtype)
            if needs_raw_bits(first):
                dtype = np.dtype(f"u{dtype.itemsize}")
            staging = np.zeros((len(layers), b) + first.shape[1:], dtype=dtype)
            flat = staging.reshape(len(layers), b, -1).view(np.uint8)
            for pos in range(len(layers)):
                lo, hi = self.pool.shard_range(pos, s)
                flat[pos, :k] = self.pool.data[slots, lo:hi]
            for r in range(len(layers[0].shards[s])):
                local = tuple(layer.shards[s][r] for layer in layers)
                device = _device_of(local[0])
                work.append((s, local, jax.device_put(ids_pad, device),
                             jax.device_put(staging, device)))
        for s, local, ids_d, pages_d in work:
            for pos, a in enumerate(_scatter(local, ids_d, pages_d)):
                new_shards[pos][s].append(a)
        new = [assemble(arr, shards) for arr, shards in zip(arrays, new_shards)]
        return new, None


def _buffer_view(a: jax.Array, block_bytes: int) -> np.ndarray:
    """A writable ``uint8[num_blocks, block_bytes]`` view of a CPU array's buffer."""
    nbytes = a.shape[0] * block_bytes
    if a.nbytes != nbytes:  # never read or write past the buffer
        raise TransferError(f"buffer of {a.nbytes} bytes does not hold {a.shape[0]} blocks of "
                            f"{block_bytes} bytes")
    raw = (ctypes.c_uint8 * nbytes).from_address(a.unsafe_buffer_pointer())
    return np.ctypeslib.as_array(raw).reshape(a.shape[0], block_bytes)


def raw_capable(array: jax.Array) -> bool:
    """Whether ``RawMover`` may copy this array's blocks as raw bytes.

    XLA:CPU buffers are host memory; a block is then its logical bytes exactly when
    the stored layout is row-major and elements are whole bytes as numpy stores
    them. XLA:CPU stores no tiles, but a layout that *reports* tiles the inspector
    rejects is refused all the same: the direct path copies only what is proven.
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
    """Buffer addresses that back more than one device array among ``arrays``."""
    counts: dict[int, int] = {}
    for a in arrays:
        if raw_capable(a):
            for s in a.addressable_shards:
                p = s.data.unsafe_buffer_pointer()
                counts[p] = counts.get(p, 0) + 1
    return frozenset(p for p, c in counts.items() if c > 1)


class RawMover(Mover):
    """Raw byte-range copies between XLA:CPU buffers and the host pool."""

    name = "raw"

    def gather(self, layers, batch, with_digest):
        # The caller's thread only waits for the buffers to be computed and takes
        # views of them; the transfer thread copies (and starts the digests).
        views = [[_buffer_view(layer.shards[s][0].block_until_ready(),
                               self.cls.shard_block_bytes) for layer in layers]
                 for s in range(self.cls.num_shards)]
        return layers, views, batch, with_digest

    def finish_offload(self, state, slots):
        layers, views, batch, with_digest = state
        # The digests run on XLA's threads while this thread copies.
        digests = self.digests(layers, batch, range(len(layers))) if with_digest else None
        copy = RowCopy(slots, batch.ids, self.cls.shard_block_bytes)
        for s in range(self.cls.num_shards):
            for pos, view in enumerate(views[s]):
                lo, hi = self.pool.shard_range(pos, s)
                copy(self.pool.data[:, lo:hi], view)
        if any(layer.shards[s][0].is_deleted() for layer in layers
               for s in range(self.cls.num_shards)):
            raise TransferError("a cache was donated or deleted while its blocks were being "
                                "offloaded; wait() before donating the caches")
        if digests is not None:
            d = digests.get()
            for s in range(self.cls.num_shards):
                self._store_digests(slots, s, d[:, s])

    def load(self, arrays, layers, batch, slots, shared: frozenset = frozenset()):
        # Raw writes need buffers no one else reads: XLA:CPU places one buffer under
        # every replica of a replicated device_put (and may alias a 64-byte-aligned
        # numpy array), so any buffer seen twice gets a private copy first (once; the
        # returned arrays keep the copies).
        layers = [ShardedLayer(tuple(
            tuple(jax.device_put(a, _device_of(a), may_alias=False)
                  if a.unsafe_buffer_pointer() in shared else a for a in reps)
            for reps in layer.shards)) for layer in layers]
        # New Array objects over the buffers: the old objects may hold a cached host
        # copy (``np.asarray`` of a sharded array) that would go stale.
        new = [assemble(a, layer.shards) for a, layer in zip(arrays, layers)]
        return new, (layers, RowCopy(batch.ids, slots, self.cls.shard_block_bytes))

    def finish_load_layer(self, state, pos):
        layers, copy = state
        for s, reps in enumerate(layers[pos].shards):
            lo, hi = self.pool.shard_range(pos, s)
            src = self.pool.data[:, lo:hi]
            for a in reps:
                a.block_until_ready()
                copy(_buffer_view(a, self.cls.shard_block_bytes), src)


class EmulatedMover(Mover):
    """Direct copies over emulated TPU memory, for proven-addressable layouts."""

    name = "emulated"

    def __init__(self, cls: SliceClass, pool: ClassPool):
        super().__init__(cls, pool)
        self._layout = cls.layout

    def _geometry(self, local: jax.Array):
        g = inspect(local.shape, local.dtype, self._layout)
        if not g.addressable:
            raise LayoutError(f"Direct copy refused for class {self.cls.name}: {g.reason}")
        if g.bytes_per_block != self.cls.shard_block_bytes:
            raise LayoutError(f"class {self.cls.name}: shard blocks are {g.bytes_per_block} "
                              f"bytes under {self._layout}, the plan has "
                              f"{self.cls.shard_block_bytes}")
        return g

    def _image(self, local: jax.Array) -> np.ndarray:
        return emulate.to_image(np.asarray(local), self._layout)

    def _read(self, layers, ids, positions, replica: int = 0) -> list[np.ndarray]:
        """Per shard, ``uint8[len(positions), k, bytes]`` read from the device images."""
        out = []
        for s in range(self.cls.num_shards):
            out.append(np.stack([
                emulate.read_blocks(self._image(layers[p].shards[s][replica]),
                                    self._geometry(layers[p].shards[s][replica]), ids)
                for p in positions]))
        return out

    def _digest_raw(self, raw: list[np.ndarray], batch, positions) -> np.ndarray:
        out = []
        for s, r in enumerate(raw):
            ident = np.stack([batch.identity(self.cls.layers[p], s) for p in positions])
            out.append(self._digest_np(r, ident))
        return np.stack(out, axis=1)

    def gather(self, layers, batch, with_digest):
        positions = range(len(layers))
        out = self._read(layers, batch.ids, positions)
        digests = self._digest_raw(out, batch, positions) if with_digest else None
        return out, digests

    @staticmethod
    def _digest_np(raw: np.ndarray, identity: np.ndarray) -> np.ndarray:
        return integrity.digest_np(integrity.as_words_np(raw, batch_dims=2), identity)

    def finish_offload(self, state, slots):
        out, digests = state
        for s, raw in enumerate(out):
            for pos in range(raw.shape[0]):
                lo, hi = self.pool.shard_range(pos, s)
                self.pool.data[slots, lo:hi] = raw[pos]
            if digests is not None:
                self._store_digests(slots, s, digests[:, s])

    def load(self, arrays, layers, batch, slots):
        ids, new = batch.ids, []
        for pos, (arr, layer) in enumerate(zip(arrays, layers)):
            shards = []
            for s, reps in enumerate(layer.shards):
                lo, hi = self.pool.shard_range(pos, s)
                src = self.pool.data[slots, lo:hi]
                out = []
                for a in reps:
                    image = self._image(a)
                    emulate.write_blocks(image, self._geometry(a), ids, src)
                    host = emulate.from_image(image, a.shape, a.dtype, self._layout)
                    out.append(jax.device_put(host, _device_of(a)))
                shards.append(out)
            new.append(assemble(arr, shards))
        return new, None

    def digests(self, layers, batch, positions, replica=0):
        done = self._digest_raw(self._read(layers, batch.ids, positions, replica), batch,
                                positions)
        return _Done(done)


class _Done(Pending):
    """Digests already computed (numpy, on the host image)."""

    def __init__(self, value: np.ndarray):
        super().__init__([], 0)
        self._value = value

    def get(self) -> np.ndarray:
        return self._value
