"""The one interface every mover implements, and the state passed between its halves."""

from __future__ import annotations

import abc
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar, cast

import jax
import numpy as np

from kvxfer import integrity
from kvxfer.engine._batch import PageBatch, ShardedLayer, device_of, layer_nums, loop_pages, \
    numpy_args
from kvxfer.engine._programs import DIGEST_CHUNK, compile_ahead, digest_blocks, page_loops
from kvxfer.hostpool import ClassPool, HostBacking
from kvxfer.plan import SliceClass

__all__ = ["TransferError", "Mover", "WaitsOnce", "LoadRequest", "LoadDone", "Pending",
           "OffloadT",
           "StagedT", "LoadT"]

OffloadT = TypeVar("OffloadT")
"""What ``start_offload`` hands ``finish_offload`` (the mover's named offload state)."""
StagedT = TypeVar("StagedT")
"""What ``stage_load`` hands ``start_load`` (None for movers with nothing to stage)."""
LoadT = TypeVar("LoadT")
"""What ``start_load`` hands ``finish_load_layer`` (None for movers with nothing to wait for)."""


class TransferError(RuntimeError):
    """A device or transfer failure: never reported as a cache miss.

    Attributes:
      kv_caches: for a load that failed in the call, the caches to continue with
        (classes already loaded replaced, the rest as given); for a load whose handle
        failed, the arrays ``load()`` returned; None otherwise.
    """

    def __init__(self, message: str, *, kv_caches: list[jax.Array] | None = None):
        super().__init__(message)
        self.kv_caches = kv_caches


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """What a load moves into one slice class.

    Attributes:
      batch: the pages' device block ids and identities.
      slots: host slot of each page, in request order.
      shared: buffer addresses backing more than one array among the caches (movers
        that write into device buffers must copy those first).
      on_written: called as ``on_written(pos, new_array)`` once layer ``pos`` holds its
        loaded bytes, so its digest can start while later layers are written (movers
        that write every layer at once need not call it).
      on_digested: where the load wants its digests and a mover may compute them in
        the program that writes the pages (no program of their own for a small load
        to dispatch): called as ``on_digested(shard, replica, digests)`` with
        ``uint32[L, n, D]`` digests of the blocks written (rows past the batch's ``k``
        ignored), for every shard and replica of the class, before any ``written``;
        a mover that does not call it leaves the digests to their own programs. None:
        the load wants no digests, or wants them from the arrays its hooks see.
    """

    batch: PageBatch
    slots: np.ndarray
    shared: frozenset[int] = frozenset()
    on_written: Callable[[int, jax.Array], None] | None = None
    on_digested: Callable[[int, int, jax.Array], None] | None = None

    def written(self, pos: int, array: jax.Array) -> None:
        """Tells the load that layer ``pos`` of the class holds its bytes (``array``)."""
        if self.on_written is not None:
            self.on_written(pos, array)


def _sds(shape: tuple[int, ...], dtype: Any, device: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))


def _batch_abstract(b: int, device: Any) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """What ``PageBatch.on`` puts on ``device`` for ``b`` padded pages, abstractly."""
    return (_sds((b,), np.int32, device),
            _sds((b, integrity.IDENTITY_WORDS), np.uint32, device))


def _host_abstract(b: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """What ``PageBatch.host`` gives for ``b`` padded pages, abstractly (uncommitted)."""
    return (jax.ShapeDtypeStruct((b,), np.int32),
            jax.ShapeDtypeStruct((b, integrity.IDENTITY_WORDS), np.uint32),
            jax.ShapeDtypeStruct((), np.int32))


def _args_abstract(b: int, device: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
    """What ``PageBatch.args`` gives a program on ``device`` for ``b`` padded pages,
    abstractly."""
    if numpy_args(device):
        return _host_abstract(b)
    return _batch_abstract(b, device) + (_count_abstract(device),)


def _pool_load_abstract(n: int, layers: int, device: Any, digest: bool
                        ) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The arguments after the pool of a program that reads (a load) or writes (an
    offload) the pool in place, abstractly.

    Ids, rows (the pool's) and count come as numpy arguments (``PageBatch.host``:
    uncommitted); with ``digest``, the identities and the layer numbers of the digests
    it computes too.
    """
    ids, base, count = _host_abstract(n)
    out = (ids, ids, count)  # the rows are the pool's, shaped as the ids
    return out + (base, _sds((layers,), np.uint32, device)) if digest else out


def _count_abstract(device: Any) -> jax.ShapeDtypeStruct:
    """What ``PageBatch.count_on`` puts on ``device``, abstractly."""
    return _sds((), np.int32, device)


def _digest_size(k: int, arrays: Sequence[Any]) -> int | None:
    """The ``PageBatch.on`` size the digest programs of ``arrays`` take for ``k`` pages
    (None: the bucket)."""
    if not page_loops(device_of(arrays[0])):
        return None
    return loop_pages(k, min(a.shape[0] for a in arrays))


class Pending:
    """Digests being computed on the devices; ``get()`` waits and gathers them."""

    def __init__(self, parts: list[Any], k: int):
        self._parts = parts
        self._k = k

    def wait(self) -> None:
        """Waits until every digest is computed, fetching none."""
        for chunks in self._parts:
            for c in chunks:
                c.block_until_ready()

    def get(self) -> np.ndarray:
        """``uint32[positions, shards, k, D]``."""
        if len(self._parts) == 1 and len(self._parts[0]) == 1:  # one shard, one chunk
            return np.asarray(self._parts[0][0])[:, None, :self._k]
        return np.stack([np.concatenate([np.asarray(c)[:, :self._k] for c in chunks])
                         for chunks in self._parts], axis=1)


class LoadDone(NamedTuple):
    """Outputs of a load's programs that the caller never holds: ready once they ran.

    The transfer thread waits for them before the load's host slots are released,
    since the programs read the pool (or buffers filled from it) as they run. What
    was waited for is dropped, so later layers do not wait again.
    """

    done: list[jax.Array]

    def pending(self) -> bool:
        """Whether a program has not run yet (never blocks)."""
        return any(not d.is_ready() for d in self.done)

    def wait(self) -> None:
        """Waits for every program (one writes every layer of a shard replica)."""
        while self.done:
            self.done[-1].block_until_ready()
            self.done.pop()


class WaitsOnce:
    """Load completion for movers whose state is a ``LoadDone``: each program writes
    every layer of a shard replica, so a layer is in place once they all ran, and one
    wait serves every layer. Put it before ``Mover`` among the bases."""

    def load_layer_waits(self, state: LoadDone, pos: int) -> bool:
        return state.pending()

    def finish_load_layer(self, state: LoadDone, pos: int) -> None:
        state.wait()

    def finish_load(self, state: LoadDone, num_layers: int) -> None:
        state.wait()


class Mover(abc.ABC, Generic[OffloadT, StagedT, LoadT]):
    """Moves the pages of one slice class between device shards and its host pool.

    Generic over the state passed between its halves: ``Mover[OffloadT, StagedT,
    LoadT]``, each a named type of the mover (``StagedMover`` is a
    ``Mover[StagedOffload, list[StagedInputs], StagedLoad]``).

    Every device program of a transfer is enqueued on the caller's thread, before
    ``offload()`` / ``load()`` returns, so XLA orders it against whatever the caller
    dispatches next (donation included): ``start_offload``, ``stage_load``,
    ``start_load`` and ``digests`` run there. The transfer thread only waits for
    results and moves host bytes: ``finish_offload`` and ``finish_load_layer``.
    """

    name: ClassVar[str] = "mover"
    #: Whether loads write into the caches' device buffers (so buffers shared by
    #: several arrays must be copied first; see ``LoadRequest.shared``).
    writes_buffers: ClassVar[bool] = False
    #: Whether the mover needs its class's host pool in ``pinned_host`` memory of the
    #: device holding the class's first shard (``ClassPool.array``).
    pinned_pool: ClassVar[bool] = False

    def __init__(self, cls: SliceClass, pool: ClassPool):
        self.cls = cls
        self.pool = pool
        #: Payload bytes this mover copied on the host on a transfer's path (numpy or
        #: memmove copies of its own), besides what a copy engine executes.
        self.host_copy_bytes = 0
        self._counted = threading.Lock()

    @classmethod
    def naming(cls, slice_class: SliceClass, num_slots: int) -> Mover[Any, Any, Any]:
        """A mover that names its programs (``warmup`` under ``collected_compiles``)
        without a host pool, as for a pool of ``num_slots`` pages."""
        return cls(slice_class, None)  # type: ignore[arg-type]

    @classmethod
    def host_backing(cls, slice_class: SliceClass,
                     layers: Sequence[ShardedLayer]) -> HostBacking | None:
        """How this mover wants the class's host pool allocated (None: as ``HostPool`` does).

        Called once per class before the pool exists; ``layers`` are abstract
        (``ShardedLayer.abstract``).
        """
        return None

    @abc.abstractmethod
    def start_offload(self, layers: Sequence[ShardedLayer], batch: PageBatch,
                      slots: np.ndarray, with_digest: bool) -> OffloadT:
        """Reads the batch's blocks as they are now (and starts their digests).

        Caller's thread. Whatever the caller does to the caches afterwards (a
        donating step, say) cannot change what this offload stores.

        Returns:
          The mover's own offload state (a named type), for ``finish_offload``.
        """

    @abc.abstractmethod
    def finish_offload(self, state: OffloadT, slots: np.ndarray) -> None:
        """Moves what ``start_offload`` read into host ``slots`` (transfer thread)."""

    def stage_load(self, layers: Sequence[ShardedLayer], request: LoadRequest) -> StagedT:
        """Puts what a load needs on the devices, consuming nothing (caller's thread).

        Every class is staged before any class starts (``start_load`` may donate the
        caches), so a failure here leaves the caller's caches as they were.
        """
        return cast(StagedT, None)  # a mover that stages nothing has StagedT = None

    @abc.abstractmethod
    def start_load(self, arrays: Sequence[jax.Array], layers: Sequence[ShardedLayer],
                   request: LoadRequest, staged: StagedT) -> tuple[list[jax.Array], LoadT]:
        """Writes the request's host slots into its blocks (caller's thread).

        Returns:
          ``(new arrays, load state)``: the new arrays hold the loaded blocks for any
          computation dispatched after this call; the state goes to
          ``finish_load_layer``.
        """

    def finish_load_layer(self, state: LoadT, pos: int) -> None:
        """Waits until layer ``pos`` of the class is in place (transfer thread)."""

    def finish_load(self, state: LoadT, num_layers: int) -> None:
        """Waits until every layer of the class is in place: ``finish_load_layer`` of
        each in order (movers whose programs write every layer at once wait once)."""
        for pos in range(num_layers):
            self.finish_load_layer(state, pos)

    def quiesce(self, state: Any) -> None:
        """Waits, never raising, until no program of a transfer (``state``: what
        ``start_offload`` or ``start_load`` returned) can still touch the class's host
        pool outside XLA's view.

        A failed transfer calls it before its host slots are given back or its pins
        released, so a program still queued never copies into slots reused by then.
        Movers whose programs reach the pool only through XLA (or not at all) need not
        wait: XLA keeps what a queued program reads alive.
        """

    def load_layer_waits(self, state: LoadT, pos: int) -> bool:
        """Whether ``finish_load_layer(state, pos)`` may wait (never blocks itself):
        layers verified before it are released first where it may."""
        return type(self).finish_load_layer is not Mover.finish_load_layer

    def digests(self, layers: Sequence[ShardedLayer], batch: PageBatch,
                positions: Sequence[int], replica: int = 0) -> Pending:
        """Starts the device digests ``[len(positions), shards, k, D]`` of the blocks.

        Caller's thread (the programs read the arrays, so they are enqueued before
        the caller can donate them). ``replica`` picks which copy of a replicated
        layer is read.
        """
        positions = list(positions)
        chunks = [positions[i:i + DIGEST_CHUNK] for i in range(0, len(positions), DIGEST_CHUNK)]
        parts = []
        for s in range(self.cls.num_shards):
            device = device_of(layers[positions[0]].shards[s][replica])
            arrays = [tuple(layers[p].shards[s][replica] for p in chunk) for chunk in chunks]
            ids_d, base_d, count = batch.args(device, s, _digest_size(batch.k, arrays[0]))
            parts.append([digest_blocks(a, ids_d, base_d, layer_nums(device, tuple(
                                            self.cls.layers[p] for p in chunk)), count)
                          for a, chunk in zip(arrays, chunks)])
        return Pending(parts, batch.k)

    def warmup(self, arrays: Sequence[jax.ShapeDtypeStruct], layers: Sequence[ShardedLayer],
               b: int, with_digest: bool) -> None:
        """Compiles every program a transfer of ``b`` pages (a bucket) runs.

        ``arrays`` and ``layers`` are abstract values (``ShardedLayer.abstract``). The
        base compiles the digest programs (groups of ``DIGEST_CHUNK`` layers and the
        remainder, every replica); on XLA:CPU one digest program serves every bucket
        up to ``loop_pages`` (warm-up compiles it once).
        """
        if not with_digest:
            return
        n = len(layers)
        chunks = {min(n, DIGEST_CHUNK)} | ({n % DIGEST_CHUNK} if n > DIGEST_CHUNK and
                                           n % DIGEST_CHUNK else set())
        for s in range(self.cls.num_shards):
            for r in range(len(layers[0].shards[s])):
                device = device_of(layers[0].shards[s][r])
                for size in chunks:
                    arrays = tuple(layers[p].shards[s][r] for p in range(size))
                    ids, base, count = _args_abstract(_digest_size(b, arrays) or b, device)
                    compile_ahead("digest", arrays, ids, base, _sds((size,), np.uint32, device),
                                  count)

    def copied_on_host(self, nbytes: int) -> None:
        """Counts ``nbytes`` of payload copied on the host (``host_copy_bytes``)."""
        with self._counted:
            self.host_copy_bytes += int(nbytes)

    def host_copied(self) -> int:
        """Payload bytes copied on the host so far, by this mover and any it runs."""
        return self.host_copy_bytes

    def discard(self, staged: Any) -> None:
        """Lets what ``stage_load`` returned go unused (a prefetch released): caller's
        thread, never blocking (movers whose staging XLA keeps need do nothing)."""

    def staged_done(self, staged: Any) -> bool:
        """Whether discarded staging can no longer read the host slots it was staged
        from (never blocks)."""
        return True

    def fell_back(self) -> dict[str, int]:
        """Transfers that took a slower route than asked for, by why (the DMA mover's)."""
        return {}

    def _store_digests(self, slots: np.ndarray, shard: int, d: np.ndarray) -> None:
        # d: [L, k, D] -> pool.digests[slot, L, shard, D]
        self.pool.digests[slots, :, shard, :integrity.DIGEST_WORDS] = \
            np.swapaxes(d[:, :len(slots)], 0, 1)


