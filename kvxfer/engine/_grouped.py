"""Page axes sharded over data parallelism: a mover per slice class, run group by group.

Engines with data-parallel attention shard the block dim itself
(``P("data", None, "tensor", ...)``): each data-parallel group of devices holds a range
of the blocks, split over its own devices like any sharded cache. Block ids stay
global (what the engine's block table holds). ``GroupedMover`` wraps the mover of such
a class: a batch is split by the group holding each block, each group's pages move
through the inner mover on that group's devices (local block ids, the group's shards
as a cache of its own), and the loaded arrays are put back together with the caller's
sharding. A page's host bytes and digests do not depend on the group it came from, so
a page offloaded from one group loads into any other.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from kvxfer.engine._batch import PageBatch, ShardedLayer, _index_key, assemble
from kvxfer.engine._mover import LoadRequest, LoadT, Mover, OffloadT, Pending, StagedT, \
    TransferError

__all__ = ["BlockGroups", "GroupedMover", "GroupedOffload"]

GroupedOffload = list[tuple[np.ndarray, OffloadT]]
"""Per group holding pages of the batch: its rows of the request, the inner mover's state."""


def _group_sharding(keys: list[tuple[int, ...]], devices: list[list[Any]]
                    ) -> jax.sharding.NamedSharding:
    """A sharding over one group's devices that splits dims 1.. as the shards do.

    ``keys[s]`` are shard ``s``'s start offsets in dims 1..; ``devices[s]`` its replicas.
    """
    ndim = len(keys[0])
    starts = [sorted({k[d] for k in keys}) for d in range(ndim)]
    grid = np.empty((len(devices[0]), *[len(s) for s in starts]), dtype=object)
    for key, reps in zip(keys, devices):
        pos = tuple(starts[d].index(key[d]) for d in range(ndim))
        for r, device in enumerate(reps):
            grid[(r, *pos)] = device
    names = ("replica",) + tuple(f"dim{d + 1}" for d in range(ndim))
    mesh = jax.sharding.Mesh(grid, names)
    spec = jax.sharding.PartitionSpec(None, *[names[d + 1] if len(starts[d]) > 1 else None
                                              for d in range(ndim)])
    return jax.sharding.NamedSharding(mesh, spec)


@dataclasses.dataclass(frozen=True)
class BlockGroups:
    """How a layer's block dim is split over data-parallel groups of devices.

    Attributes:
      count: groups (2+).
      blocks: blocks each group holds (group ``g`` holds ``[g * blocks, (g+1) * blocks)``).
      shards: shards per group (the class's ``num_shards``).
      shape: the shape of one group's part of the array.
      shardings: per group, a sharding of that part over the group's devices.
    """

    count: int
    blocks: int
    shards: int
    shape: tuple[int, ...]
    shardings: tuple[jax.sharding.Sharding, ...]

    @classmethod
    def of(cls, array: jax.Array, name: str) -> BlockGroups | None:
        """The groups of ``array``'s block dim, or None when dim 0 is not sharded.

        Raises:
          ValueError: groups of unequal size or shape, or groups this process does
            not hold (a data-parallel page axis across processes), naming the layer.
        """
        by_group: dict[int, dict[tuple[int, ...], list[Any]]] = {}
        sizes = set()
        for s in array.addressable_shards:
            key = _index_key(s.index, array.shape)
            by_group.setdefault(key[0], {}).setdefault(key[1:], []).append(s.device)
            sizes.add(s.data.shape[0])
        if len(by_group) == 1 and sizes == {array.shape[0]}:
            return None
        starts = sorted(by_group)
        blocks = array.shape[0] // len(starts) if array.shape[0] % len(starts) == 0 else 0
        if not array.is_fully_addressable:
            raise ValueError(f"{name}: the block dim (dim 0) is sharded across processes "
                             "(a data-parallel page axis over hosts); kvxfer moves pages "
                             "of the groups one process holds: shard dim 0 over the "
                             "devices of one process")
        if sizes != {blocks} or starts != [g * blocks for g in range(len(starts))]:
            raise ValueError(f"{name}: the block dim (dim 0, {array.shape[0]} blocks) is "
                             f"split into unequal ranges (starts {starts}, sizes "
                             f"{sorted(sizes)}); shard it evenly over the data axis")
        layouts = {tuple(sorted(g)) for g in by_group.values()}
        if len(layouts) != 1:
            raise ValueError(f"{name}: the groups of the block dim split the other dims "
                             "differently; every data-parallel group must shard a block "
                             "the same way")
        keys = sorted(by_group[starts[0]])
        shardings = tuple(_group_sharding(keys, [by_group[st][k] for k in keys])
                          for st in starts)
        return cls(len(starts), blocks, len(keys), (blocks, *array.shape[1:]), shardings)

    def split(self, layer: ShardedLayer | None, g: int) -> ShardedLayer | None:
        """Group ``g``'s shards of a layer (its shards sorted group-major)."""
        if layer is None:
            return None
        return ShardedLayer(layer.shards[g * self.shards:(g + 1) * self.shards])

    def array(self, layer: ShardedLayer, g: int) -> jax.Array:
        """Group ``g``'s part of a layer as an array of its own, over the same buffers."""
        flat = [a for reps in layer.shards for a in reps]
        return jax.make_array_from_single_device_arrays(self.shape, self.shardings[g], flat)

    def abstract(self, template: jax.ShapeDtypeStruct, g: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, template.dtype, sharding=self.shardings[g])


class _MergedPending(Pending):
    """The digests of several groups' pages, put back in request order."""

    def __init__(self, parts: list[tuple[np.ndarray, Pending]], k: int):
        super().__init__([], k)
        self._groups = parts

    def get(self) -> np.ndarray:
        out = None
        for rows, pending in self._groups:
            got = pending.get()  # [positions, shards, len(rows), D]
            if out is None:
                out = np.zeros(got.shape[:2] + (self._k,) + got.shape[3:], got.dtype)
            out[:, :, rows] = got
        assert out is not None
        return out


class GroupedMover(Mover[GroupedOffload[OffloadT], list[StagedT], list[LoadT]]):
    """Runs another mover group by group over a block dim sharded by data parallelism.

    Args:
      inner: the mover of the class, built as for any class (its shards are one
        group's shards).
      groups: how the class's layers split their block dim.
    """

    def __init__(self, inner: Mover[OffloadT, StagedT, LoadT], groups: BlockGroups):
        super().__init__(inner.cls, inner.pool)
        self.inner = inner
        self.groups = groups
        self.name = inner.name  # what mgr.paths reports: the mover that moves the bytes
        self.writes_buffers = inner.writes_buffers
        self._splits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def host_copied(self) -> int:
        return self.inner.host_copied()

    def fell_back(self) -> dict[str, int]:
        return self.inner.fell_back()

    def discard(self, staged: Any) -> None:
        for s in staged:
            self.inner.discard(s)

    def staged_done(self, staged: Any) -> bool:
        return all(self.inner.staged_done(s) for s in staged)

    def _split(self, batch: PageBatch) -> list[tuple[int, np.ndarray, PageBatch]]:
        """Per group holding pages of the batch: (group, request rows, its batch)."""
        out = self._splits.get(batch)
        if out is None:
            group, ids = np.divmod(batch.ids, self.groups.blocks)
            out = []
            for g in range(self.groups.count):
                rows = np.flatnonzero(group == g)
                if rows.size:
                    out.append((g, rows, batch.subset(rows, ids[rows])))
            self._splits[batch] = out
        return out

    def _request(self, request: LoadRequest, rows: np.ndarray, batch: PageBatch) -> LoadRequest:
        return LoadRequest(batch, np.asarray(request.slots)[rows], request.shared)

    # -- offload ----------------------------------------------------------------

    def start_offload(self, layers: Sequence[ShardedLayer], batch: PageBatch,
                      slots: np.ndarray, with_digest: bool) -> GroupedOffload[OffloadT]:
        slots = np.asarray(slots)
        state: GroupedOffload[OffloadT] = []
        try:
            for g, rows, sub in self._split(batch):
                state.append((rows, self.inner.start_offload(
                    [self.groups.split(l, g) for l in layers], sub, slots[rows], with_digest)))
        except BaseException:
            self.quiesce(state)  # the groups enqueued write the slots given back next
            raise
        return state

    def finish_offload(self, state: GroupedOffload[OffloadT], slots: np.ndarray) -> None:
        slots = np.asarray(slots)
        for rows, inner in state:
            self.inner.finish_offload(inner, slots[rows])

    # -- load -------------------------------------------------------------------

    def stage_load(self, layers: Sequence[ShardedLayer],
                   request: LoadRequest) -> list[StagedT]:
        return [self.inner.stage_load([self.groups.split(l, g) for l in layers],
                                      self._request(request, rows, sub))
                for g, rows, sub in self._split(request.batch)]

    def start_load(self, arrays: Sequence[jax.Array], layers: Sequence[ShardedLayer],
                   request: LoadRequest, staged: list[StagedT] | None
                   ) -> tuple[list[jax.Array], list[LoadT]]:
        splits = self._split(request.batch)
        staged = [None] * len(splits) if staged is None else staged  # type: ignore[list-item]
        loaded: dict[int, list[jax.Array]] = {}
        states: list[LoadT] = []
        for (g, rows, sub), st in zip(splits, staged):
            part = [self.groups.split(l, g) for l in layers]
            try:
                out, state = self.inner.start_load([self.groups.array(p, g) for p in part],
                                                   part, self._request(request, rows, sub), st)
            except Exception as e:
                self.quiesce(states)  # the groups enqueued read the pins released next
                if isinstance(e, TransferError) and e.kv_caches is not None:
                    loaded[g] = list(e.kv_caches)
                raise TransferError(f"{e} (data-parallel group {g} of "
                                    f"{self.groups.count})",
                                    kv_caches=self._whole(arrays, layers, loaded)) from e
            loaded[g] = out
            states.append(state)
        return self._whole(arrays, layers, loaded), states

    def _whole(self, arrays: Sequence[jax.Array], layers: Sequence[ShardedLayer],
               loaded: dict[int, list[jax.Array]]) -> list[jax.Array]:
        """Every layer as one array again: loaded groups' new parts, the others as given."""
        out = []
        for pos, (array, layer) in enumerate(zip(arrays, layers)):
            shards: list[tuple[jax.Array, ...]] = []
            for g in range(self.groups.count):
                part = ShardedLayer.of(loaded[g][pos]) if g in loaded else \
                    self.groups.split(layer, g)
                shards.extend(part.shards)
            try:
                out.append(assemble(array, shards))
            except Exception:  # a part was consumed and not handed back
                out.append(array)
        return out

    def quiesce(self, state: Any) -> None:
        for entry in state:  # an offload's entries are (request rows, state) pairs
            pair = isinstance(entry, tuple) and len(entry) == 2 and \
                isinstance(entry[0], np.ndarray)
            self.inner.quiesce(entry[1] if pair else entry)

    def load_layer_waits(self, state: list[LoadT], pos: int) -> bool:
        return any(self.inner.load_layer_waits(inner, pos) for inner in state)

    def finish_load_layer(self, state: list[LoadT], pos: int) -> None:
        for inner in state:
            self.inner.finish_load_layer(inner, pos)

    def digests(self, layers, batch, positions, replica=0):
        return _MergedPending(
            [(rows, self.inner.digests([self.groups.split(l, g) for l in layers], sub,
                                       positions, replica))
             for g, rows, sub in self._split(batch)], batch.k)

    def warmup(self, arrays, layers, b, with_digest):
        for g in range(self.groups.count):
            self.inner.warmup([self.groups.abstract(a, g) for a in arrays],
                              [self.groups.split(l, g) for l in layers], b, with_digest)

