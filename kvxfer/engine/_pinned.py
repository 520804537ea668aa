"""The pinned mover: compiled programs between the caches and a pinned host pool.

For every backend with a ``pinned_host`` memory kind, in one of two routes
(``pinned_mode``): *in place* where XLA updates a ``pinned_host`` pool inside a program
(``IN_PLACE_PLATFORMS``: XLA:CPU, measured), this module; the *pages* route elsewhere
(``kvxfer.engine._pinned_pages``: each page an array of pinned memory of its own, as
XLA:GPU cannot update a host pool in place). ``pinned_mover`` picks the class.

In place, the class's host pool is one buffer in the ``pinned_host`` memory of one
device (the pool device: where the class's first shard lives), held as a JAX array
of words (``ClassPool.array``).

* **Offload**: one program per shard gathers the blocks of every layer of the class.
  On the pool device it writes the pages into their slots *in place*: the pool array
  is donated and updated by dynamic-update-slices, so the bytes reach the pool with
  no copy beside the program's own, and it digests the blocks it reads, so an
  offload dispatches one program a shard. A shard on another device (pinned memory
  belongs to a device) gets its pages in that device's ``pinned_host`` memory
  (``out_shardings``), and the transfer thread copies them into the pool: one host
  copy (``host_copy_bytes``); its digests are the digest programs loads verify with
  (``Mover.digests``), enqueued first.
* **Load**: one program per shard replica reads the request's pages and writes them
  into the donated caches in place. On the pool device it reads the pool itself; a
  replica on another device reads a pinned buffer of its own device that the
  caller's thread fills from the pool (one host copy). Every replica of a replicated
  layer is loaded; each is stored once.

Blocks are written by a loop of dynamic-update-slices (on XLA:CPU 4-5x as fast as a
scatter from gathered pages), whose page count is a runtime value, so the programs
that reach the pool itself are made once per class for every transfer of up to
``_batch.loop_pages`` pages, not once per bucket (raw bits without a copy of the
caches, see ``_programs._write_blocks``). Every program is enqueued on the caller's
thread; the transfer thread only waits and copies host bytes. Blocks move as their
raw bits where XLA:CPU would rewrite NaN payloads (``needs_raw_bits``).

``KVCacheManager(pinned_route=...)`` (``"in-place"`` or ``"pages"``) overrides the
route, so that CPU tests run what a GPU runs and a device check can measure both.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from kvxfer.engine._batch import assemble, bucket, device_of, layer_nums, loop_pages
from kvxfer.engine._mover import LoadDone, LoadRequest, Mover, Pending, TransferError, \
    WaitsOnce, _args_abstract, _pool_load_abstract, _sds
from kvxfer.engine._pinned_programs import pinned_gather, pinned_load, pinned_write, where_of
from kvxfer.engine._programs import compile_ahead, compile_zeros, page_loops, zeros
from kvxfer.engine._pinned_pages import PinnedPagesMover
from kvxfer.engine._slot_pool import (SlotPool, aliasing_refusal, tiled_pool,
                                      slot_format, slot_geometry)
from kvxfer.engine._raw import RowCopy
from kvxfer.hostpool import ClassPool, PoolError, has_pinned_host, word_bytes
from kvxfer.plan import SliceClass

__all__ = ["PinnedMover", "IN_PLACE_PLATFORMS", "PINNED_ROUTES", "pinned_capable",
           "pinned_mode", "pinned_mover", "in_place_refusal"]

#: Backends whose programs update the pinned pool in place and read it directly
#: (XLA:CPU, measured with jax 0.10.2: the donated pool keeps its buffer; TPU, its
#: programs compiled deviceless to one DMA a page into the donated ``S(5)`` pool, the
#: pool a ``SlotPool``, whose aliasing is checked before it is used).
IN_PLACE_PLATFORMS = frozenset({"cpu", "tpu"})

#: The pinned mover's routes (``KVCacheManager(pinned_route=...)``).
PINNED_ROUTES = ("in-place", "pages")


def pinned_capable(array: jax.Array) -> bool:
    """Whether every device holding ``array`` offers a ``pinned_host`` memory kind."""
    return all(has_pinned_host(d) for d in array.sharding.device_set)


def pinned_mode(platform: str, route: str | None = None) -> str:
    """The pinned mover's route on ``platform``: ``route`` where one is asked for, else
    ``"in-place"`` on ``IN_PLACE_PLATFORMS`` and ``"pages"`` elsewhere.

    Raises:
      ValueError: ``route`` is not one of ``PINNED_ROUTES`` (or None).

    Example:
        >>> pinned_mode("cpu"), pinned_mode("gpu"), pinned_mode("cpu", "pages")
        ('in-place', 'pages', 'pages')
    """
    if route is None:
        return "in-place" if platform in IN_PLACE_PLATFORMS else "pages"
    if route not in PINNED_ROUTES:
        raise ValueError(f"pinned_route={route!r}; expected one of {PINNED_ROUTES} or None")
    return route


def _pinned(device: Any) -> jax.sharding.SingleDeviceSharding:
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def _host_view(a: jax.Array) -> np.ndarray:
    """The bytes of a ready ``pinned_host`` array, viewed in place (no copy)."""
    raw = (ctypes.c_uint8 * a.nbytes).from_address(a.unsafe_buffer_pointer())
    return np.ctypeslib.as_array(raw).reshape(a.shape[0], -1)


class PinnedOffload(NamedTuple):
    """What an offload enqueued: digests, pages to copy into the pool, the pool written.

    Attributes:
      digests: the digests being computed (None with integrity off).
      copies: ``(shard, pages)`` for shards off the pool device: ``pages`` lives in the
        pinned memory of the shard's device, ``[bucket, L * shard words]``.
      written: an output of each in-place program, ready once it wrote the pool (the
        pool array itself may be donated by the next program before anyone waits).
    """

    digests: Pending | None
    copies: list[tuple[int, jax.Array]]
    written: list[jax.Array]


class PinnedInputs(NamedTuple):
    """One shard replica's load inputs, on its device.

    ``src`` is None where the program reads the pool itself (a replica on the pool
    device; the pool array is taken when the program is enqueued);
    otherwise a pinned buffer of the request's pages of that shard on the replica's
    device, ``[bucket, L * shard words]``.
    """

    shard: int
    replica: int
    src: jax.Array | None
    rows: jax.Array


class PinnedLoad(LoadDone):
    """What the pinned mover's load programs return that the caller never holds."""


class PinnedMover(WaitsOnce, Mover[PinnedOffload, list[PinnedInputs], PinnedLoad]):
    """Compiled programs between the caches and a pinned host pool, in place."""

    name = "pinned"
    pinned_pool = True

    def __init__(self, cls: SliceClass, pool: ClassPool | None, *,
                 num_slots: int | None = None):
        super().__init__(cls, pool)
        if pool is not None and not pool.pinned:
            raise ValueError(f"the pinned mover needs a pinned host pool for {cls.name}; "
                             "the pool was allocated in pageable memory")
        self._unit = word_bytes(cls)
        self._words = cls.shard_block_bytes // self._unit  # words of one shard block
        self._pool_device: Any = None  # where the pool is, naming programs without one
        #: Slots of the pool (what programs are compiled for without one: ``naming``).
        self.num_slots = num_slots if pool is None else pool.data.shape[0] \
            if pool.data is not None else pool.pages.num_slots

    @classmethod
    def naming(cls, slice_class: SliceClass, num_slots: int) -> PinnedMover:
        return cls(slice_class, None, num_slots=num_slots)

    @classmethod
    def host_backing(cls, slice_class, layers):
        device = device_of(layers[0].shards[0][0])
        if not tiled_pool(device.platform):
            return None
        return lambda num_slots: SlotPool(slice_class, num_slots, device)

    # -- geometry -----------------------------------------------------------------

    @property
    def _store(self) -> Any:
        """What holds the pool's array and takes the arrays programs return (``swap``):
        the ``SlotPool`` where the pool is slot-major, else the ``ClassPool``."""
        return self.pool.pages if isinstance(self.pool.pages, SlotPool) else self.pool

    def _start(self, shard: int) -> int:
        """Where shard ``shard``'s part of a page starts in its slot, in words."""
        if self.pool is None or isinstance(self.pool.pages, SlotPool):
            return 0
        return self.pool.word_offsets(shard)[0]

    @staticmethod
    def _gathered(device: Any) -> bool:
        """Whether programs on ``device`` gather pages per layer first: with a slot-major
        pool (TPU), and wherever they do not loop over pages (not XLA:CPU)."""
        return tiled_pool(device.platform) or not page_loops(device)

    def _direct(self, device: Any) -> bool:
        """Whether programs on ``device`` reach the pool itself."""
        if self.pool is None:  # naming programs: the pool is on the first shard's device
            return device == self._pool_device
        return device == self.pool.device

    @staticmethod
    def _direct_pages(k: int, array: Any) -> int:
        """Entries of the index arrays of the programs that reach the pool itself, for
        ``k`` pages of ``array``'s blocks.

        On XLA:CPU they loop over the pages (the count a runtime value, the blocks read
        in the loop), so one program serves every transfer up to ``loop_pages``, not one
        per bucket; elsewhere they gather the bucket's pages first, so the bucket.
        """
        if PinnedMover._gathered(device_of(array)):
            return bucket(k)
        return loop_pages(k, array.shape[0])

    def _pool_abstract(self) -> jax.ShapeDtypeStruct:
        if self.pool is not None:
            a = self._store.array
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where_of(a))
        device = self._pool_device
        if tiled_pool(device.platform):
            g = slot_geometry(self.cls, self.num_slots)
            return jax.ShapeDtypeStruct(g.shape, np.uint32, sharding=slot_format(g, device))
        return jax.ShapeDtypeStruct((self.num_slots, self.cls.page_bytes // self._unit),
                                    np.dtype(f"u{self._unit}"), sharding=_pinned(device))

    def _packed_shape(self, b: int) -> tuple[int, int]:
        return (b, len(self.cls.layers) * self._words)

    @staticmethod
    def _padded(rows: np.ndarray, b: int) -> np.ndarray:
        # Padding entries repeat the first page: they rewrite the same bytes.
        out = np.full(b, rows[0] if len(rows) else 0, dtype=np.int32)
        out[:len(rows)] = rows
        return out

    # -- offload ------------------------------------------------------------------

    def start_offload(self, layers, batch, slots, with_digest):
        # Where every shard writes the pool itself (XLA:CPU), its program digests the
        # blocks it reads: an offload dispatches one program a shard. Elsewhere the
        # digests are programs of their own (the ones loads verify with): a copy
        # program made per bucket compiled 5x as slowly with them inside, and ran no
        # faster.
        fused = with_digest and self._digests_in_offload(layers)
        digests = self.digests(layers, batch, range(len(layers))) \
            if with_digest and not fused else None
        copies, written, parts = [], [], []
        for s in range(self.cls.num_shards):
            arrays = tuple(layer.primary[s] for layer in layers)
            device = device_of(arrays[0])
            if self._direct(device):
                # Its index arrays as numpy arguments (XLA:CPU), as the load's.
                size = self._direct_pages(batch.k, arrays[0])
                ids, base, count = batch.host(s, size)
                digest = (base, layer_nums(device, tuple(self.cls.layers))) if fused else None
                with self.pool.lock:
                    new, done, *d = pinned_write(
                        arrays, self._store.array, ids, self._padded(np.asarray(slots), size),
                        count, self._start(s), self._unit, self._gathered(device),
                        digest=digest)
                    self._swap(new)
                written.append(done)
                parts.append(d)
            else:
                ids_d, _, _ = batch.args(device, s)
                copies.append((s, pinned_gather(arrays, ids_d, _pinned(device), self._unit)))
        if fused:
            digests = Pending(parts, batch.k)
        return PinnedOffload(digests, copies, written)

    def _digests_in_offload(self, layers) -> bool:
        """Whether an offload's programs digest what they read: where every shard's
        program writes the pool itself (XLA:CPU)."""
        return all(self._direct(device_of(a)) for a in layers[0].primary)

    def _swap(self, new: jax.Array) -> None:
        try:
            self._store.swap(new)
        except PoolError as e:
            raise TransferError(f"pinned offload of {self.cls.name} failed: {e}") from e

    def finish_offload(self, state: PinnedOffload, slots):
        k = len(slots)
        for s, pages in state.copies:
            pages.block_until_ready()
            view = _host_view(pages)[:k]  # [k, L * shard bytes], in pinned memory
            self.copied_on_host(view.nbytes)
            # Pages are shard-major: the shard's layers are one range of each slot.
            lo, hi = self.pool.shard_span(s)
            RowCopy(slots, np.arange(k), hi - lo)(self.pool.data[:, lo:hi], view)
        for done in state.written:
            done.block_until_ready()
        if state.digests is not None:
            d = state.digests.get()
            for s in range(self.cls.num_shards):
                self._store_digests(slots, s, d[:, s])

    # -- load ---------------------------------------------------------------------

    def stage_load(self, layers, request: LoadRequest) -> list[PinnedInputs]:
        batch, slots = request.batch, np.asarray(request.slots)
        k, b = batch.k, len(batch.padded)
        work = []
        for s in range(self.cls.num_shards):
            packed = None
            lo, hi = self.pool.shard_span(s)  # the shard's layers: one range of a slot
            for r in range(len(layers[0].shards[s])):
                device = device_of(layers[0].shards[s][r])
                if self._direct(device):
                    # The program takes its index arrays as numpy arguments (XLA:CPU).
                    rows = self._padded(slots, self._direct_pages(k, layers[0].shards[s][r]))
                    work.append(PinnedInputs(s, r, None, rows))
                    continue
                # Pinned memory belongs to a device: this replica's pages are copied
                # from the pool into a pinned buffer of its own device (one host copy).
                src = zeros(self._packed_shape(b), self.pool.array.dtype, _pinned(device))
                src.block_until_ready()
                view = _host_view(src)
                self.copied_on_host(k * (hi - lo))
                if packed is None:
                    RowCopy(np.arange(k), slots, hi - lo)(view, self.pool.data[:, lo:hi])
                    packed = view
                else:
                    view[:k] = packed[:k]
                rows = jax.device_put(self._padded(np.arange(k), b), device)
                work.append(PinnedInputs(s, r, src, rows))
        return work

    def start_load(self, arrays, layers, request: LoadRequest, staged: list[PinnedInputs]):
        # On one device the program's outputs are the new arrays, with nothing to
        # assemble: the call returns sooner after the dispatch (on XLA:CPU the program
        # then runs on the cores the caller's thread needs).
        single = isinstance(arrays[0].sharding, jax.sharding.SingleDeviceSharding)
        new_shards: list[list[list[jax.Array]]] = [] if single else [
            [[] for _ in range(self.cls.num_shards)] for _ in layers]
        done = []
        # Where every replica reads the pool itself (XLA:CPU), the load's programs
        # digest what they wrote: a small load then dispatches one program, not five.
        fused = request.on_digested is not None and self._digests_in_load(layers)
        for shard, replica, src, rows in staged:
            local = tuple(arrays) if single else tuple(layer.shards[shard][replica]
                                                       for layer in layers)
            device = device_of(local[0])
            if src is None:
                ids_d, base_d, count = request.batch.host(shard, rows.shape[0])
            else:
                ids_d, base_d, count = request.batch.args(device, shard, rows.shape[0])
            if src is None:
                digest = (base_d, layer_nums(device, tuple(self.cls.layers))) if fused else None
                with self.pool.lock:  # the pool array of the moment, before any donation
                    out, d, *digests = pinned_load(local, self._store.array, ids_d, rows, count,
                                                   self._start(shard), self._unit,
                                                   self._gathered(device), digest=digest)
                if fused:
                    request.on_digested(shard, replica, digests[0])
            else:
                out, d = pinned_load(local, src, ids_d, rows, count, 0, self._unit,
                                     self._gathered(device))
            done.append(d)
            if single:
                return list(out), PinnedLoad(done)
            for pos, a in enumerate(out):
                new_shards[pos][shard].append(a)
        new = [assemble(arr, shards) for arr, shards in zip(arrays, new_shards)]
        return new, PinnedLoad(done)

    def _digests_in_load(self, layers) -> bool:
        """Whether a load's programs digest what they write (a load without transfer
        hooks, with integrity on): where every replica reads the pool itself (XLA:CPU),
        so a small load dispatches one program, not five."""
        return all(self._direct(device_of(a)) for reps in layers[0].shards for a in reps)

    # -- warm-up ------------------------------------------------------------------

    def warmup(self, arrays, layers, b, with_digest):
        # What the transfers run: where both directions digest inside their own
        # programs, no digest program of its own is compiled (a transfer hook's load
        # compiles one when it first runs).
        self._pool_device = device_of(layers[0].primary[0])
        fused = with_digest and self._digests_in_load(layers)
        fused_offload = with_digest and self._digests_in_offload(layers)
        if with_digest and not (fused and fused_offload):
            super().warmup(arrays, layers, b, with_digest)
        for s in range(self.cls.num_shards):
            primary = tuple(layer.primary[s] for layer in layers)
            device = device_of(primary[0])
            if self._direct(device):
                n = self._direct_pages(b, primary[0])
                pool = self._pool_abstract()
                compile_ahead("pinned_write", primary, pool,
                              *_pool_load_abstract(n, len(layers), device, fused_offload),
                              with_digest=fused_offload,
                              options=(where_of(pool), self._start(s), self._unit,
                                       self._gathered(device)))
            else:
                compile_ahead("pinned_gather", primary, _args_abstract(b, device)[0],
                              options=(_pinned(device), self._unit))
            for r in range(len(layers[0].shards[s])):
                local = tuple(layer.shards[s][r] for layer in layers)
                device = device_of(local[0])
                if self._direct(device):
                    pool = self._pool_abstract()
                    n = self._direct_pages(b, local[0])
                    compile_ahead("pinned_load", local, pool,
                                  *_pool_load_abstract(n, len(layers), device, fused),
                                  with_digest=fused,
                                  options=(where_of(pool), self._start(s), self._unit,
                                           self._gathered(device)))
                    continue
                rows = _sds((b,), np.int32, device)
                shape, dtype = self._packed_shape(b), self.pool.array.dtype
                compile_zeros(shape, dtype, _pinned(device))
                src = jax.ShapeDtypeStruct(shape, dtype, sharding=_pinned(device))
                ids, _, count = _args_abstract(b, device)
                compile_ahead("pinned_load", local, src, ids, rows, count,
                              options=(src.sharding, 0, self._unit, self._gathered(device)))


def in_place_refusal(platform: str, shards: Sequence[Sequence[Any]],
                     live: bool = True) -> str | None:
    """Why the in-place route cannot move a class whose first layer has ``shards``
    (per shard, its replicas' arrays) on ``platform``, or None where it can.

    Off XLA:CPU every program must reach the pool itself (a page copied between two
    devices' pinned memories would be a host copy): one shard, one replica; and, with
    ``live`` devices (not deviceless ones, compiling ahead), the runtime must alias
    the donated pool (``_slot_pool.aliasing_refusal``).
    """
    if not tiled_pool(platform):
        return None
    devices = {device_of(a) for reps in shards for a in reps}
    if len(devices) > 1:
        return (f"its shards live on {len(devices)} devices; an in-place pool is one "
                "device's pinned memory, and a copy between two would be a host copy")
    return aliasing_refusal(next(iter(devices))) if live else None


def pinned_mover(platform: str, shards: Sequence[Sequence[Any]] | None = None,
                 live: bool = True, route: str | None = None) -> type[Mover]:
    """The pinned mover's class on ``platform``: ``PinnedMover`` in place, else the
    pages route's ``PinnedPagesMover`` (``pinned_mode``, with the ``route`` asked for;
    on TPU also where ``in_place_refusal`` refuses the class's ``shards``)."""
    if pinned_mode(platform, route) == "in-place" and (
            shards is None or in_place_refusal(platform, shards, live) is None):
        return PinnedMover
    return PinnedPagesMover
