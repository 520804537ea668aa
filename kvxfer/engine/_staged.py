"""The staged mover: compiled gather / donated scatter through host numpy buffers.

One compiled program per (class, bucket of block counts) gathers the requested blocks
of every layer of the class on each shard's device, with the page digests computed in
the same program; the reverse program scatters host pages into the caches in place
(argument donation). XLA indexes logically, so it is correct for any layout and
backend: the portable fallback.

On XLA:CPU device memory is host memory: the class's pool is allocated as a device
array (``host_backing``) and a load's program reads its pages from the pool where they
are, by slot, writing them into place in a loop (one program for every transfer size,
raw bits without a copy of the caches, see ``_programs._write_blocks``) and digesting
what it wrote: the caller's thread copies nothing. Where a shard's device cannot see
the pool without a copy (or where ``StagedMover.pool_in_place`` is set False, as tests
do to run what other backends run), a load stages its pages
page-major in a buffer of ``loop_pages`` pages (only the pages written are ever
touched, so the rest is address space, not memory), which ``device_put`` aliases.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, NamedTuple

import jax
import numpy as np

from kvxfer.engine._batch import assemble, device_of, layer_nums, loop_pages
from kvxfer.engine._mover import LoadDone, LoadRequest, Mover, WaitsOnce, _args_abstract, \
    _pool_load_abstract, _sds
from kvxfer.engine._raw import RowCopy
from kvxfer.engine._pinned_programs import pinned_load
from kvxfer.engine._programs import compile_ahead, gather, needs_raw_bits, page_loops, \
    scatter, staged_load, zeros
from kvxfer.hostpool import word_bytes

__all__ = ["StagedMover"]


def _device_pool(num_slots: int, *, words: int, dtype: Any, device: Any) -> jax.Array:
    """A class pool of ``num_slots`` rows of ``words`` words in ``device``'s memory."""
    return zeros((num_slots, words), dtype, jax.sharding.SingleDeviceSharding(device))


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


class StagingArena:
    """Page-major staging buffers of one class, reused once the load that read one ran.

    On XLA:CPU ``device_put`` aliases the staging buffer, so a fresh one is memory the
    load is first to write: on a VM its page faults cost 0.3 s per 128 MiB (0.4 GB/s),
    against 14 ms for memory the process has written before. Warm-up touches a buffer
    per staged size (``warm``); a load takes a spare buffer (``take``) and lends it
    back with the ballast arrays of the programs reading it (``lend``): the buffer is
    spare again only once every one of them is ready, so no program can read a buffer
    being refilled. Any thread (prefetches stage off the KV-owning thread).
    """

    #: Spare buffers kept per (shape, dtype): more in flight at once are allocated.
    KEEP = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spare: dict[tuple, list[np.ndarray]] = {}
        self._lent: list[tuple[tuple, np.ndarray, list[jax.Array]]] = []

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A staging buffer of ``shape``: a spare one where one is free, else new."""
        key = (tuple(shape), np.dtype(dtype))
        with self._lock:
            self._reap()
            spare = self._spare.get(key)
            if spare:
                return spare.pop()
        return _aligned_empty(key[0], key[1])

    def lend(self, buffer: np.ndarray, done: list[jax.Array]) -> None:
        """``buffer`` is being read by programs whose ballast arrays are ``done``."""
        if not done:
            return  # nothing tells when it is free: left to the garbage collector
        with self._lock:
            self._lent.append(((buffer.shape, buffer.dtype), buffer, done))

    def warm(self, shape: tuple[int, ...], dtype: np.dtype, rows: int) -> None:
        """Makes a spare buffer of ``shape`` whose first ``rows`` rows were written."""
        key = (tuple(shape), np.dtype(dtype))
        with self._lock:
            self._reap()
            if self._spare.get(key):
                return
        buffer = _aligned_empty(key[0], key[1])
        buffer[:rows].view(np.uint8).fill(0)
        self._give(key, buffer)

    def _give(self, key: tuple, buffer: np.ndarray) -> None:
        with self._lock:
            spare = self._spare.setdefault(key, [])
            if len(spare) < self.KEEP:
                spare.append(buffer)

    def _reap(self) -> None:
        """Moves lent buffers whose readers all ran back to the spares (lock held)."""
        still = []
        for key, buffer, done in self._lent:
            if all(d.is_ready() for d in done):
                spare = self._spare.setdefault(key, [])
                if len(spare) < self.KEEP:
                    spare.append(buffer)
            else:
                still.append((key, buffer, done))
        self._lent = still


class StagedInputs(NamedTuple):
    """One shard replica's pages, already on its device (block ids come at the load):
    ``[L, bucket, *block]``, or page-major ``[loop_pages, L, *block]`` where the load
    loops (``page_loops``), or the pool itself with ``rows``."""

    shard: int
    replica: int
    pages: jax.Array
    #: The host buffer ``pages`` aliases, where it came from the class's arena.
    staging: np.ndarray | None = None
    #: Where ``pages`` is the pool's words in place: the slot of each page
    #: (``loop_pages`` entries, padding repeats the first).
    rows: jax.Array | None = None


class StagedLoad(LoadDone):
    """What the staged mover's load programs that read the pool in place return."""


class StagedOffload(NamedTuple):
    """Per shard, the gathered pages ``[L, bucket, ...]`` and their digests (or None)."""

    k: int
    outs: list[tuple[jax.Array, jax.Array | None]]


class StagedMover(WaitsOnce, Mover[StagedOffload, list[StagedInputs], StagedLoad]):
    """Compiled gather / donated scatter programs; correct for every layout."""

    name = "staged"
    #: Whether loads on XLA:CPU read the pool where it is (else they stage their pages
    #: in a buffer first, as every other backend does; tests set it False).
    pool_in_place = True

    def __init__(self, cls, pool):
        super().__init__(cls, pool)
        self._arena = StagingArena()
        self._in_place_mode = self.pool_in_place
        self._unit = word_bytes(cls)
        self._pools: dict[Any, jax.Array | None] = {}  # device -> the pool's words there

    @classmethod
    def host_backing(cls, slice_class, layers):
        first = layers[0].shards[0][0]
        if not page_loops(device_of(first)) or not cls.pool_in_place:
            return None
        unit = word_bytes(slice_class)
        return functools.partial(_device_pool, words=slice_class.page_bytes // unit,
                                 dtype=np.dtype(f"u{unit}"), device=device_of(first))

    # -- the pool in place (XLA:CPU) -------------------------------------------------

    def _pool_on(self, device: Any) -> jax.Array | None:
        """The pool's words as an array on ``device`` over the pool's own buffer, or
        None where that would be a copy (then loads stage their pages)."""
        if not self._in_place_mode or not page_loops(device) or not len(self.pool.data):
            return None
        if device not in self._pools:
            owner, got = self.pool.owner, None
            shape = (len(self.pool.data), self.cls.page_bytes // self._unit)
            if owner is not None and device_of(owner) == device and \
                    owner.shape == shape and owner.dtype == np.dtype(f"u{self._unit}"):
                got = owner  # the pool was allocated as this device's array
            else:
                words = self.pool.data.view(np.dtype(f"u{self._unit}"))
                if words.ctypes.data % _ALIGN == 0:  # device_put aliases it, or copies
                    alias = jax.device_put(words, device)
                    if alias.unsafe_buffer_pointer() == words.ctypes.data:
                        got = alias
            self._pools[device] = got
        return self._pools[device]

    def _in_place(self, layers, shard: int) -> bool:
        return all(self._pool_on(device_of(a)) is not None for a in layers[0].shards[shard])

    def start_offload(self, layers, batch, slots, with_digest):
        out = []
        for s in range(self.cls.num_shards):
            arrays = tuple(layer.primary[s] for layer in layers)
            device = device_of(arrays[0])
            ids_d, base_d, _ = batch.args(device, s)
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
                self.copied_on_host(k * shard_bytes)
            if digests is not None:
                self._store_digests(slots, s, np.asarray(digests))

    def warmup(self, arrays, layers, b, with_digest):
        super().warmup(arrays, layers, b, with_digest)
        fused = with_digest and self._digests_in_load(layers)  # what a load runs
        for s in range(self.cls.num_shards):
            primary = tuple(layer.primary[s] for layer in layers)
            ids, base, _ = _args_abstract(b, device_of(primary[0]))
            compile_ahead("gather", primary, ids, base,
                          _sds((len(layers),), np.uint32,
                               device_of(primary[0])),
                          with_digest=with_digest)
            dtype = _staging_dtype(primary[0])
            for r in range(len(layers[0].shards[s])):
                local = tuple(layer.shards[s][r] for layer in layers)
                device = device_of(local[0])
                block = local[0].shape[1:]
                if self._in_place(layers, s):
                    pool = self._pool_on(device)
                    n = loop_pages(b, local[0].shape[0])
                    compile_ahead("pinned_load", local,
                                  jax.ShapeDtypeStruct(pool.shape, pool.dtype,
                                                       sharding=pool.sharding),
                                  *_pool_load_abstract(n, len(layers), device, fused),
                                  with_digest=fused,
                                  options=(pool.sharding, self.pool.word_offsets(s)[0],
                                           self._unit, False))
                elif page_loops(device):
                    n = loop_pages(b, local[0].shape[0])
                    if r == 0:
                        self._arena.warm((n, len(layers)) + block, dtype, b)
                    ids, _, count = _args_abstract(n, device)
                    compile_ahead("staged_load", local, ids,
                                  _sds((n, len(layers)) + block, dtype, device), count)
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
            if self._in_place(layers, s):
                # Nothing to copy: the load's program reads the pages from the pool.
                # Its index arrays come as numpy arguments (XLA:CPU takes them for a few
                # microseconds each; a device_put of them costs tens).
                n = loop_pages(k, first.shape[0])
                rows = np.full(n, slots[0] if k else 0, dtype=np.int32)
                rows[:k] = slots
                for r, device in enumerate(devices):
                    work.append(StagedInputs(s, r, self._pool_on(device), None, rows))
                continue
            if all(page_loops(d) for d in devices):
                # Page-major, ``loop_pages`` pages: rows past ``k`` are never written
                # nor read, so they cost no memory (device_put aliases the buffer).
                n = loop_pages(k, first.shape[0])
                staging = self._arena.take((n, len(layers)) + first.shape[1:], dtype)
                lent = staging
                flat = staging.reshape(n, -1).view(np.uint8)
                # Pages are shard-major: the shard's layers are one range of a slot.
                lo, hi = self.pool.shard_span(s)
                RowCopy(np.arange(k), slots, hi - lo)(flat, self.pool.data[:, lo:hi])
            else:
                # Padding rows are dropped by the scatter: left as they are, not zeroed;
                # each layer's rows are copied straight into place (runs of slots as
                # slices).
                copy = RowCopy(np.arange(k), slots, size)
                staging = _aligned_empty((len(layers), b) + first.shape[1:], dtype)
                lent = None
                flat = staging.reshape(len(layers), b, -1).view(np.uint8)
                for pos in range(len(layers)):
                    lo, hi = self.pool.shard_range(pos, s)
                    copy(flat[pos], self.pool.data[:, lo:hi])
            self.copied_on_host(k * len(layers) * size)
            for r, device in enumerate(devices):
                work.append(StagedInputs(s, r, jax.device_put(staging, device), lent))
        return work

    def start_load(self, arrays, layers, request: LoadRequest, staged: list[StagedInputs]):
        # On one device the program's outputs are the new arrays (nothing to assemble).
        single = isinstance(arrays[0].sharding, jax.sharding.SingleDeviceSharding)
        new_shards: list[list[list[jax.Array]]] = [] if single else [
            [[] for _ in range(self.cls.num_shards)] for _ in layers]
        new: list[jax.Array] = []
        batch = request.batch
        # Padding entries point past the end and are dropped by the scatter.
        ids_pad = np.full(len(batch.padded), np.iinfo(np.int32).max, dtype=np.int32)
        ids_pad[:batch.k] = batch.ids
        on_device: dict[object, jax.Array] = {}
        readers: dict[int, tuple[np.ndarray, list[jax.Array]]] = {}
        in_place: list[jax.Array] = []
        fused = request.on_digested is not None and self._digests_in_load(layers)
        for shard, replica, pages_d, staging, rows in staged:
            local = tuple(layer.shards[shard][replica] for layer in layers)
            device = device_of(local[0])
            if rows is not None:
                ids, base, count = batch.host(shard, rows.shape[0])
                digest = (base, layer_nums(device, tuple(self.cls.layers))) if fused else None
                out, done, *digests = pinned_load(local, pages_d, ids, rows, count,
                                                  self.pool.word_offsets(shard)[0], self._unit,
                                                  False, digest=digest)
                in_place.append(done)
                if fused:
                    request.on_digested(shard, replica, digests[0])
            elif page_loops(device):
                ids_d, _, count = batch.args(device, shard, pages_d.shape[0])
                done: list[jax.Array] = []
                out = staged_load(local, ids_d, pages_d, count, done)
                if staging is not None:
                    readers.setdefault(id(staging), (staging, []))[1].extend(done)
            else:
                if device not in on_device:
                    on_device[device] = jax.device_put(ids_pad, device)
                out = scatter(local, on_device[device], pages_d)
            if single:
                new = list(out)
                continue
            for pos, a in enumerate(out):
                new_shards[pos][shard].append(a)
        for staging, done in readers.values():
            self._arena.lend(staging, done)
        if not single:
            new = [assemble(arr, shards) for arr, shards in zip(arrays, new_shards)]
        return new, StagedLoad(in_place)

    def _digests_in_load(self, layers) -> bool:
        """Whether a load's programs digest what they write (a load without transfer
        hooks, with integrity on): where every replica reads the pool in place, so a
        small load dispatches one program, not five."""
        return all(self._in_place(layers, t) for t in range(self.cls.num_shards))

