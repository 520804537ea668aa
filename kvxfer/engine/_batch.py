"""What one transfer moves: a layer's shards and replicas, and a batch of pages."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from kvxfer import integrity

__all__ = ["ShardedLayer", "layers_of", "PageBatch", "assemble", "bucket", "loop_pages",
           "LOOP_PAGES", "device_of", "layer_nums", "abstract", "local", "own_context"]


def bucket(k: int) -> int:
    """Block counts are padded to powers of two so each class compiles a few programs.

    Example:
        >>> [bucket(k) for k in (0, 1, 2, 3, 5, 8)]
        [1, 1, 2, 4, 8, 8]
    """
    return 1 << max(0, k - 1).bit_length()


#: The fewest pages a loop program (one page an iteration, the page count a runtime
#: value) is made for: one program then serves every transfer of up to this many pages.
#: Its index arrays and outputs are sized by it, so it stays small enough that a
#: 1-page transfer does not pay for them.
LOOP_PAGES = 256


def loop_pages(k: int, blocks: int) -> int:
    """Pages a loop program moving ``k`` pages of ``blocks``-block arrays is made for.

    Programs that loop over the pages with the count as a runtime value cost what
    they move, whatever their index arrays hold: one size serves every transfer of up
    to ``min(bucket(blocks), LOOP_PAGES)`` pages (a transfer names distinct blocks, so
    it never moves more than ``blocks``); beyond that, buckets as ``bucket`` pads them.

    Example:
        >>> [loop_pages(k, 128) for k in (1, 7, 64, 128)]
        [128, 128, 128, 128]
        >>> [loop_pages(k, 4096) for k in (1, 256, 257)]
        [256, 256, 512]
    """
    return max(bucket(k), min(bucket(blocks), LOOP_PAGES))


def device_of(a: jax.Array | jax.ShapeDtypeStruct) -> Any:
    """The one device of a single-device array (or of its abstract value)."""
    return next(iter(a.sharding.device_set))


def own_context(fn):
    """Runs ``fn`` under no context mesh: kvxfer's programs never see the caller's.

    Engines call kvxfer inside ``jax.set_mesh(mesh)`` (any mesh, Explicit axes or
    Auto, even one over other devices than the caches); the programs kvxfer compiles
    and runs work on single-device shards and must compile the same whatever that
    context is. The caller's context is restored on return.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with jax.set_mesh(None):
            return fn(*args, **kwargs)
    return wrapper


def local(a: jax.Array) -> jax.Array:
    """A single-device shard typed as a ``SingleDeviceSharding`` array, zero-copy.

    A shard of a one-device array is the array itself, with the caller's sharding:
    under a mesh with Explicit axes its type carries them (``f32[16@data,...]``), and
    kvxfer's programs, which index blocks, must not depend on the caller's types.
    The result shares the buffer (donating it consumes the caller's array, as
    donating the caller's array itself would).
    """
    if isinstance(a.sharding, jax.sharding.SingleDeviceSharding):
        return a
    device = device_of(a)
    return jax.make_array_from_single_device_arrays(
        a.shape, jax.sharding.SingleDeviceSharding(device, memory_kind=a.sharding.memory_kind),
        [a])


def abstract(a: jax.Array) -> jax.ShapeDtypeStruct:
    """An array's shape, dtype, sharding and layout, without its buffers."""
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.format)


def numpy_args(device: Any) -> bool:
    """Whether programs on ``device`` take their index arrays as numpy arguments
    (XLA:CPU: a few microseconds each, where a ``device_put`` of them costs tens)."""
    return device.platform == "cpu"


@functools.lru_cache(maxsize=1024)
def layer_nums(device: Any, layers: tuple[int, ...]) -> jax.Array:
    """Device copies of layer-number vectors, made once (there are few distinct ones:
    a class's layers, and its groups of ``DIGEST_CHUNK``); each digest program of a
    load takes one, and a device_put per program cost more host time than the program's
    own dispatch."""
    return jax.device_put(np.asarray(layers, dtype=np.uint32), device)


_SINGLE = jax.sharding.SingleDeviceSharding


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s.indices(d)[0] for s, d in zip(index, shape))


class ShardedLayer(NamedTuple):
    """One layer's array split into its distinct shards, each with its replicas.

    A named tuple: a load makes one per layer on the caller's thread (32 a call),
    and a tuple is made in a third of the time of a frozen dataclass.

    Attributes:
      shards: ``shards[s]`` lists the single-device arrays holding shard ``s``
        (one per replica), ordered by the shard's position in the global array.
    """

    shards: tuple[tuple[jax.Array, ...], ...]

    @classmethod
    def of(cls, array: jax.Array) -> ShardedLayer:
        if isinstance(array.sharding, _SINGLE):
            return cls(((array,),))  # the common case, without building shard objects
        groups: dict[tuple[int, ...], list[jax.Array]] = {}
        for s in array.addressable_shards:
            groups.setdefault(_index_key(s.index, array.shape), []).append(local(s.data))
        return cls(tuple(tuple(groups[k]) for k in sorted(groups)))

    def abstract(self) -> ShardedLayer:
        """The same shards as abstract values (for compiling ahead, holding nothing)."""
        return ShardedLayer(tuple(tuple(abstract(a) for a in reps) for reps in self.shards))

    @property
    def primary(self) -> tuple[jax.Array, ...]:
        """One replica of each shard (where offloads read)."""
        return tuple(r[0] for r in self.shards)


_tuple_new = tuple.__new__


def layers_of(arrays: Sequence[jax.Array]) -> list[ShardedLayer]:
    """``ShardedLayer.of`` of each array: a load's caller's thread splits every layer
    (32 a call), so arrays on one device each (the common case) are taken whole at
    once, without a call per layer."""
    if all(isinstance(a.sharding, _SINGLE) for a in arrays):
        return [_tuple_new(ShardedLayer, (((a,),),)) for a in arrays]
    return [ShardedLayer.of(a) for a in arrays]


def assemble(template: jax.Array, shard_arrays: Sequence[Sequence[jax.Array]]) -> jax.Array:
    """A global array like ``template`` from new per-shard (per-replica) arrays."""
    flat = [a for reps in shard_arrays for a in reps]
    if len(flat) == 1 and flat[0].sharding == template.sharding:
        return flat[0]
    # Typed as the caller's array (Explicit axes included), over the same buffers.
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
        # Python ints: a few pages cost less than numpy's uint64 operators would.
        keys = [int(key) for key in keys]
        base[:self.k, 0] = [key & 0xFFFFFFFF for key in keys]
        base[:self.k, 1] = [key >> 32 for key in keys]
        base[:self.k, 3] = list(generations)
        self._base = base
        self._device: dict[tuple[Any, int, int], tuple[jax.Array, jax.Array]] = {}
        self._count: dict[Any, jax.Array] = {}

    def subset(self, rows: np.ndarray, ids: np.ndarray) -> PageBatch:
        """The pages at ``rows`` of this batch under other block ids (same identities)."""
        out = PageBatch.__new__(PageBatch)
        out.ids = np.asarray(ids, dtype=np.int32)
        out.k = len(out.ids)
        out.padded = _pad_ids(out.ids)
        base = np.zeros((len(out.padded), integrity.IDENTITY_WORDS), dtype=np.uint32)
        base[:out.k] = self._base[rows]
        out._base = base
        out._device = {}
        out._count = {}
        return out

    def identity(self, layer: int, shard: int) -> np.ndarray:
        """``uint32[k, 5]`` identities of one layer and shard (host side)."""
        out = self._base[:self.k].copy()
        out[:, 2] = layer
        out[:, 4] = shard
        return out

    def on(self, device: Any, shard: int, size: int | None = None
           ) -> tuple[jax.Array, jax.Array]:
        """(padded ids, identities without the layer) on ``device``.

        Padded to ``size`` entries (a loop program's, see ``loop_pages``), or to the
        bucket; padding ids repeat the first page.
        """
        size = len(self.padded) if size is None else size
        key = (device, shard, size)
        if key not in self._device:
            self._put(device, shard, size)
        return self._device[key]

    def host(self, shard: int, size: int | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(padded ids, identities without the layer, the count) as numpy arrays, what
        ``on`` and ``count_on`` put on a device.

        A program on XLA:CPU may take them as they are: handing a program its numpy
        arguments costs a few microseconds each, a ``device_put`` of them tens.
        """
        size = len(self.padded) if size is None else size
        ids, base = self._host(shard, size)
        return ids, base, np.int32(self.k)

    def args(self, device: Any, shard: int, size: int | None = None
             ) -> tuple[Any, Any, Any]:
        """(padded ids, identities without the layer, the count) as a program on
        ``device`` takes them: numpy arguments on XLA:CPU (``host``), device arrays
        elsewhere (``on`` and ``count_on``: made once per device, for every program).

        On XLA:CPU a ``device_put`` of them cost 50-110 us of the caller's time, and
        3-5x that right after a step; a program takes numpy arguments for a few
        microseconds each.
        """
        if numpy_args(device):
            return self.host(shard, size)
        ids, base = self.on(device, shard, size)
        return ids, base, self.count_on(device)

    def _host(self, shard: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.full(size, self.padded[0], dtype=np.int32)
        n = min(size, len(self.padded))
        ids[:n] = self.padded[:n]
        base = np.zeros((size, integrity.IDENTITY_WORDS), dtype=np.uint32)
        base[:n] = self._base[:n]
        base[:, 4] = shard
        return ids, base

    def _put(self, device: Any, shard: int, size: int) -> None:
        ids, base = self._host(shard, size)
        # One transfer call for the arrays (and the count, once per device): each
        # device_put call costs tens of microseconds of host time on its own.
        count = [] if device in self._count else [np.int32(self.k)]
        out = jax.device_put([ids, base, *count], device)
        self._device[(device, shard, size)] = (out[0], out[1])
        if count:
            self._count[device] = out[2]

    def count_on(self, device: Any) -> jax.Array:
        """The page count ``k`` as an ``int32`` scalar on ``device`` (a loop's trip count)."""
        if device not in self._count:
            self._count[device] = jax.device_put(np.int32(self.k), device)
        return self._count[device]


def _pad_ids(ids: np.ndarray) -> np.ndarray:
    k = len(ids)
    out = np.full(bucket(k), ids[0] if k else 0, dtype=np.int32)
    out[:k] = ids
    return out


