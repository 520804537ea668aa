"""What one transfer moves: a layer's shards and replicas, and a batch of pages."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from kvxfer import integrity

__all__ = ["ShardedLayer", "PageBatch", "assemble", "bucket", "device_of", "layer_nums",
           "abstract"]


def bucket(k: int) -> int:
    """Block counts are padded to powers of two so each class compiles a few programs.

    Example:
        >>> [bucket(k) for k in (0, 1, 2, 3, 5, 8)]
        [1, 1, 2, 4, 8, 8]
    """
    return 1 << max(0, k - 1).bit_length()


def device_of(a: jax.Array | jax.ShapeDtypeStruct) -> Any:
    """The one device of a single-device array (or of its abstract value)."""
    return next(iter(a.sharding.device_set))


def abstract(a: jax.Array) -> jax.ShapeDtypeStruct:
    """An array's shape, dtype, sharding and layout, without its buffers."""
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.format)


@functools.lru_cache(maxsize=1024)
def layer_nums(device: Any, layers: tuple[int, ...]) -> jax.Array:
    """Device copies of layer-number vectors, made once (there are few distinct ones)."""
    return jax.device_put(np.asarray(layers, dtype=np.uint32), device)


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

    def abstract(self) -> ShardedLayer:
        """The same shards as abstract values (for compiling ahead, holding nothing)."""
        return ShardedLayer(tuple(tuple(abstract(a) for a in reps) for reps in self.shards))

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


