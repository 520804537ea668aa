"""The one interface every mover implements, and the state passed between its halves."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import numpy as np

from kvxfer import integrity
from kvxfer.engine._batch import PageBatch, ShardedLayer, device_of, layer_nums
from kvxfer.engine._programs import DIGEST_CHUNK, digest_blocks
from kvxfer.hostpool import ClassPool
from kvxfer.plan import SliceClass

__all__ = ["TransferError", "Mover", "LoadRequest", "Pending"]


class TransferError(RuntimeError):
    """A device or transfer failure: never reported as a cache miss."""


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """What a load moves into one slice class.

    Attributes:
      batch: the pages' device block ids and identities.
      slots: host slot of each page, in request order.
      shared: buffer addresses backing more than one array among the caches (movers
        that write into device buffers must copy those first).
    """

    batch: PageBatch
    slots: np.ndarray
    shared: frozenset[int] = frozenset()


class Pending:
    """Digests being computed on the devices; ``get()`` waits and gathers them."""

    def __init__(self, parts: list[Any], k: int):
        self._parts = parts
        self._k = k

    def get(self) -> np.ndarray:
        """``uint32[positions, shards, k, D]``."""
        return np.stack([np.concatenate([np.asarray(c)[:, :self._k] for c in chunks])
                         for chunks in self._parts], axis=1)


class Mover(abc.ABC):
    """Moves the pages of one slice class between device shards and its host pool.

    Offload is split in two: ``gather`` runs in the caller's thread (it must read
    the caches before later work changes them) and ``finish_offload`` on the
    transfer thread. Load likewise: ``load`` returns the new arrays at once and
    ``finish_load_layer`` completes layer by layer on the transfer thread.
    """

    name: ClassVar[str] = "mover"
    #: Whether loads write into the caches' device buffers (so buffers shared by
    #: several arrays must be copied first; see ``LoadRequest.shared``).
    writes_buffers: ClassVar[bool] = False

    def __init__(self, cls: SliceClass, pool: ClassPool):
        self.cls = cls
        self.pool = pool

    @abc.abstractmethod
    def gather(self, layers: Sequence[ShardedLayer], batch: PageBatch, with_digest: bool
               ) -> Any:
        """Starts reading the batch's blocks (and their digests).

        Returns:
          The mover's own offload state (a named type), for ``finish_offload``.
        """

    @abc.abstractmethod
    def finish_offload(self, state: Any, slots: np.ndarray) -> None:
        """Writes what ``gather`` read into host ``slots`` (transfer thread)."""

    @abc.abstractmethod
    def load(self, arrays: Sequence[jax.Array], layers: Sequence[ShardedLayer],
             request: LoadRequest) -> tuple[list[jax.Array], Any]:
        """Starts writing the request's host slots into its blocks.

        Returns:
          ``(new arrays, load state)``; the state goes to ``finish_load_layer``.
        """

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
            device = device_of(layers[positions[0]].shards[s][replica])
            ids_d, base_d = batch.on(device, s)
            parts.append([digest_blocks(tuple(layers[p].shards[s][replica] for p in chunk), ids_d,
                                         base_d, layer_nums(device, tuple(
                                             self.cls.layers[p] for p in chunk)))
                          for chunk in chunks])
        return Pending(parts, batch.k)

    def _store_digests(self, slots: np.ndarray, shard: int, d: np.ndarray) -> None:
        # d: [L, k, D] -> pool.digests[slot, L, shard, D]
        self.pool.digests[slots, :, shard, :integrity.DIGEST_WORDS] = \
            np.swapaxes(d[:, :len(slots)], 0, 1)


