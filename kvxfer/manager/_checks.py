"""Argument checks of a manager: its construction, caches, block ids, slots, pages, keys.

``check_construction`` checks what ``KVCacheManager`` is built from and makes each
layer's spec; a ``Checks`` then holds what later caches must match (the format each
layer's mover was chosen for) and checks every call's arguments against it, naming the
bad value.
"""

from __future__ import annotations

import operator
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvxfer import integrity as _integrity
from kvxfer._check import check_int, check_timeout
from kvxfer.engine import BlockGroups, PageBatch, ShardedLayer, known_format
from kvxfer.hostpool import HostPool, PageRef, PoolError
from kvxfer.layout import Layout, shape_text
from kvxfer.manager._select import check_path
from kvxfer.plan import LayerSpec, Plan

__all__ = ["Checks", "check_construction", "check_key", "page_batches"]


def check_key(value: Any, where: str) -> int:
    """A page key: an int in [0, 2**64), or bytes hashed to one."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _integrity.key_from_bytes(bytes(value))
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and \
            0 <= int(value) < 1 << 64:
        return int(value)
    raise ValueError(f"{where}: key {value!r} of type {type(value).__name__} must be an int "
                     "in [0, 2**64) or bytes")


def _wait_ready(array: jax.Array, timeout: float | None, name: str) -> None:
    """Waits for a cache's value with a timeout (None: as long as it takes)."""
    if array.is_deleted():
        raise ValueError(f"{name} is a deleted array (donated or freed); pass the arrays "
                         "returned by the step that consumed it")
    if timeout is None:
        array.block_until_ready()
        return
    deadline = time.monotonic() + timeout
    delay = 1e-4
    while not array.is_ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} is still being computed after {timeout} s; wait "
                               "for the step that produces it, or raise ready_timeout")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


# A cache ``[2, n, ...]`` with ``n`` at least this many times 2 reads as K and V
# stacked on dim 0 (vLLM's GPU layout ``[2, num_blocks, block_size, heads, head_dim]``).
_STACKED_KV_RATIO = 8


def _check_block_dim_first(name: str, shape: tuple[int, ...]) -> None:
    """Refuses a cache that looks like ``[2, num_blocks, ...]``: kvxfer would take its
    K/V dim for the block dim and move 2 huge blocks."""
    if len(shape) >= 3 and shape[0] == 2 and shape[1] >= _STACKED_KV_RATIO * 2:
        raise ValueError(
            f"{name}: shape {list(shape)} looks like K and V stacked on dim 0 "
            f"([2, num_blocks, ...], vLLM's GPU layout), which kvxfer would take as 2 "
            f"blocks of {list(shape[1:])}. kvxfer takes the block dim first (dim 0; no "
            "option names another): pass K and V as two layers (cache[0] and cache[1]), "
            f"or move the block dim first (jnp.moveaxis(cache, 1, 0): "
            f"{[shape[1], 2, *shape[2:]]})")


def _brief(value: Any) -> str:
    """A value named in an error without printing whole arrays."""
    if isinstance(value, (tuple, list)):
        kinds = ", ".join(_brief(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"a {type(value).__name__} of {len(value)} ({kinds})"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{type(value).__name__} {value.dtype}{list(value.shape)}"
    text = repr(value)
    return f"{text[:80]}{'...' if len(text) > 80 else ''} of type {type(value).__name__}"


def _layer_spec(i: int, a: Any, layout: Any, ready_timeout: float | None) -> LayerSpec:
    """The spec of layer ``i``'s cache, checking what kvxfer can move."""
    name = f"layer {i}"
    if not isinstance(a, jax.Array):
        raise TypeError(f"{name}: expected a jax.Array. Got {_brief(a)}"
                        + ("; pass K and V as two layers" if isinstance(a, (tuple, list))
                           else ""))
    if a.ndim < 2:
        raise ValueError(f"{name}: shape {list(a.shape)} needs a block dim and a block")
    _check_block_dim_first(name, tuple(a.shape))
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        raise TypeError(f"{name}: dtype {a.dtype} is not supported; KV caches hold real "
                        "numbers (float, int or bool types)")
    _wait_ready(a, ready_timeout, name)
    groups = BlockGroups.of(a, name)  # a page axis sharded over data parallelism
    count = 1 if groups is None else groups.count
    layer = ShardedLayer.of(a)
    if layout is None:
        layout = Layout.of(a)
    elif not isinstance(layout, Layout):
        layout = Layout.of(layout)
    placement = tuple(tuple(d.id for r in reps for d in r.devices()) for reps in layer.shards)
    shape = a.shape if a.is_fully_addressable else _local_box(a, name)
    return LayerSpec(name, shape, a.dtype, layout, num_shards=len(layer.shards) // count,
                     replicas=len(layer.shards[0]), shard_shape=layer.shards[0][0].shape,
                     placement=placement, block_groups=count)


def _local_box(a: jax.Array, name: str) -> tuple[int, ...]:
    """The shape of what this process holds of an array that spans processes.

    A tensor-parallel rank keeps its own shards of every page (the host pages hold
    those, and nothing of the other ranks'), so its layer is the box its shards
    cover: ``[num_blocks, 2, 128]`` of a ``[num_blocks, 4, 128]`` cache split over
    the KV heads of two processes.
    """
    box = []
    for d, n in enumerate(a.shape):
        ranges = {s.index[d].indices(n)[:2] for s in a.addressable_shards}
        lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
        if sum(stop - start for start, stop in ranges) != hi - lo:  # not one range
            raise ValueError(f"{name}: this process holds pieces {sorted(ranges)} of dim "
                             f"{d} of {list(a.shape)}, not one range; arrays that span "
                             "processes must give each process one box of every page")
        box.append(hi - lo)
    if box[0] != a.shape[0]:
        raise ValueError(f"{name}: the block dim (dim 0) of {list(a.shape)} is split across "
                         f"processes (this one holds {box[0]} blocks); every process "
                         "must hold every block of its shards")
    return tuple(box)


def check_construction(kv_caches: Sequence[jax.Array], layouts: Sequence[Any] | None,
                       integrity: str, path: str, num_host_blocks: int,
                       ready_timeout: float
                       ) -> tuple[list[jax.Array], list[LayerSpec], int, float | None]:
    """``KVCacheManager``'s arguments checked: ``(caches, specs, num_host_blocks,
    ready_timeout)``."""
    if integrity not in ("page", "off"):
        raise ValueError(f"integrity={integrity!r}; expected 'page' or 'off'")
    check_path(path)
    if isinstance(kv_caches, jax.Array):
        raise TypeError(f"kv_caches must be a sequence of jax.Array, one per layer. Got "
                        f"one jax.Array of shape {list(kv_caches.shape)}; pass "
                        "[cache] for a single layer")
    num_host_blocks = check_int(num_host_blocks, "num_host_blocks", minimum=1)
    ready_timeout = check_timeout(ready_timeout, "ready_timeout")
    caches = list(kv_caches)
    if not caches:
        raise ValueError("kv_caches is empty; expected one jax.Array per layer")
    if layouts is not None and len(layouts) != len(caches):
        raise ValueError(f"layouts has {len(layouts)} entries for {len(caches)} layers")
    specs = [_layer_spec(i, a, None if layouts is None else layouts[i], ready_timeout)
             for i, a in enumerate(caches)]
    if layouts is not None and any(s.block_groups > 1 for s in specs):
        i = next(i for i, s in enumerate(specs) if s.block_groups > 1)
        raise ValueError(f"layer {i}: its block dim is sharded over data parallelism; "
                         "emulated layouts (layouts=) need the block dim whole")
    return caches, specs, num_host_blocks, ready_timeout


#: Block id lists up to this long are checked in Python (``Checks._ids``).
_SMALL = 256


def page_batches(blocks: dict[int, np.ndarray], keys: Sequence[int],
                 generations: Sequence[int]) -> dict[int, PageBatch]:
    """One page batch per class moved (classes given the same ids share one)."""
    made: dict[int, PageBatch] = {}
    return {c: made.setdefault(id(ids), PageBatch(ids, keys, generations))
            for c, ids in blocks.items()}


def _is(ref: weakref.ref, a: Any) -> bool:
    return ref() is a


class _Gone:
    pass


#: A reference to nothing: what a layer holds before an array was checked for it.
_NONE = weakref.ref(_Gone())
_IS_DELETED = operator.methodcaller("is_deleted")


def _same(refs: list[weakref.ref], arrays: list[Any]) -> bool:
    """Whether ``arrays`` are the arrays ``refs`` refer to, one for one (no Python
    runs per layer: a load's caller's thread checks 32 layers a call)."""
    return all(map(operator.is_, map(weakref.ref.__call__, refs), arrays))


class Checks:
    """Checks a manager's call arguments against what it was built for.

    Args:
      specs: each layer's spec, made at construction.
      caches: the caches the manager was built from (their shardings and layouts
        are what later caches must have).
      plan: the host-memory plan (its slice classes).
      pool: the host pool (its slots).
    """

    def __init__(self, specs: list[LayerSpec], caches: Sequence[jax.Array], plan: Plan,
                 pool: HostPool):
        self.specs = specs
        self.closed = False
        self._plan = plan
        self._pool = pool
        # What each layer's movers were chosen for: later caches must match it. The
        # arrays last checked (or returned by a load) skip the check, and those whose
        # buffers are known to be their own skip the sharing scan of raw loads. Held
        # weakly: a manager must not keep a caller's old caches alive.
        # An array whose format equals the registered one (what a jitted step returns)
        # passes with one comparison, and its programs get that one Format object.
        self._formats = [(a.format, Layout.of(a), tuple(a.shape)) for a in caches]
        self._validated: list[weakref.ref] = [_NONE] * len(caches)
        self._private: list[weakref.ref] = [_NONE] * len(caches)
        # The arrays a load consumed (donated), per layer, and which load it was: a
        # caller passing one back is told which call took it.
        self._consumed: list[weakref.ref] = [_NONE] * len(caches)
        self._consumed_by = [0] * len(caches)
        self._loads = 0
        self._limits: dict[tuple[int, ...], int] = {}

    @property
    def num_layers(self) -> int:
        return len(self.specs)

    def open(self) -> None:
        """Raises once the manager is closed."""
        if self.closed:
            raise RuntimeError("the KVCacheManager is closed; create a new one")

    def loaded(self, new: list[jax.Array], written: Sequence[int],
               given: Sequence[jax.Array] = ()) -> None:
        """Remembers what a load returned: every array has the registered format, and
        the buffers of the layers it wrote are their own (shared ones were copied);
        and which of the arrays it was ``given`` it consumed."""
        self._validated = list(map(weakref.ref, new))
        self._loads += 1
        for i in written:
            self._private[i] = weakref.ref(new[i])
            if given and given[i] is not new[i]:
                self._consumed[i] = weakref.ref(given[i])
                self._consumed_by[i] = self._loads

    def _deleted(self, i: int, a: jax.Array) -> ValueError:
        """The error for a deleted array at layer ``i``, naming the load that consumed
        it when this manager's load did."""
        if _is(self._consumed[i], a):
            return ValueError(
                f"layer {i} was consumed by this manager's load() (its load number "
                f"{self._consumed_by[i]}): load() donates the caches it is given; pass "
                "the arrays that load returned (new, handle = mgr.load(caches, ...))")
        return ValueError(f"layer {i} is a deleted array (donated or freed); pass the "
                          "arrays returned by the step that consumed it")

    def all_private(self, caches: Sequence[jax.Array]) -> bool:
        """Whether every cache is known to own its buffers (a load returned it)."""
        return _same(self._private, caches)

    def caches(self, kv_caches: Sequence[jax.Array]) -> list[jax.Array]:
        caches = list(kv_caches)
        if len(caches) != self.num_layers:
            raise ValueError(f"kv_caches has {len(caches)} layers; the manager has "
                             f"{self.num_layers}")
        if _same(self._validated, caches) and not any(map(_IS_DELETED, caches)):
            return caches  # what the last load returned, or was checked: nothing to check
        for i, (a, spec) in enumerate(zip(caches, self.specs)):
            if not isinstance(a, jax.Array):
                raise TypeError(f"layer {i}: expected a jax.Array. Got {type(a)}")
            if a.is_deleted():
                raise self._deleted(i, a)
            if _is(self._validated[i], a):
                continue  # checked (or returned by a load) before: skip the costly part
            registered, layout, shape = self._formats[i]
            if tuple(a.shape) != shape or a.dtype.name != spec.dtype:
                raise ValueError(f"layer {i}: got {shape_text(a.shape, a.dtype)}, the manager "
                                 f"was built for {shape_text(shape, spec.dtype)}")
            fmt = a.format
            if fmt == registered:
                fmt = registered
            elif not a.sharding.is_equivalent_to(registered.sharding, a.ndim):
                raise ValueError(f"layer {i}: sharding {a.sharding} differs from the one the "
                                 f"manager was built for ({registered.sharding})")
            elif Layout.of(fmt) != layout:
                raise ValueError(f"layer {i}: layout {Layout.of(fmt)} differs from the one "
                                 f"the manager was built for ({layout})")
            known_format(a, fmt)
            self._validated[i] = weakref.ref(a)
        return caches

    def blocks(self, device_blocks: Any, n: int, what: str) -> dict[int, np.ndarray]:
        """Block ids per slice class moved: one list for every class, or a mapping.

        A mapping ``{class index: ids}`` moves those classes only (layers of a class
        share their block count); a plain list moves every class, checked against
        every layer's own block count.
        """
        classes = self._plan.classes
        if isinstance(device_blocks, Mapping):
            if not device_blocks:
                raise ValueError("device_blocks is an empty mapping; give ids for at least "
                                 "one slice class")
            out = {}
            for c, ids in device_blocks.items():
                c = check_int(c, "device_blocks key (a slice class index)", minimum=0)
                if c >= len(classes):
                    raise ValueError(f"device_blocks key {c} is not a slice class; the plan "
                                     f"has classes 0..{len(classes) - 1}")
                out[c] = self._ids(ids, n, what, classes[c].layers, f"device_blocks[{c}]")
            return dict(sorted(out.items()))
        ids = self._ids(device_blocks, n, what, range(self.num_layers), "device_blocks")
        return {c.index: ids for c in classes}

    def _limit(self, layers: Sequence[int]) -> int:
        """The fewest blocks of any of ``layers`` (computed once per set of layers)."""
        key = tuple(layers)
        limit = self._limits.get(key)
        if limit is None:
            limit = self._limits[key] = min(self.specs[i].num_blocks for i in layers)
        return limit

    def _ids(self, device_blocks: Sequence[int], n: int, what: str,
             layers: Sequence[int], name: str) -> np.ndarray:
        if type(device_blocks) in (list, tuple) and len(device_blocks) == n <= _SMALL:
            # A short list of valid ids (a prefix hit) is checked without numpy's fixed
            # costs; anything else takes the general path below, which names the fault.
            limit = self._limit(layers)
            if all(type(b) is int and 0 <= b < limit for b in device_blocks) and \
                    len(set(device_blocks)) == n:
                return np.array(device_blocks, dtype=np.int32)
        if isinstance(device_blocks, (list, tuple)):
            for j, b in enumerate(device_blocks):  # numpy would read True as block 1
                if isinstance(b, (bool, np.bool_)):
                    raise ValueError(f"{name}[{j}] = {b!r} is a bool, not a block id")
        ids = np.asarray(device_blocks)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"{name} must be a 1-D sequence of ints. Got {device_blocks!r}")
        if len(ids) != n:
            raise ValueError(f"{len(ids)} {name} for {n} {what}")
        limit = self._limit(layers)
        out = (ids < 0) | (ids >= limit)
        if out.any():
            j = int(np.flatnonzero(out)[0])
            i = next(i for i in layers if not 0 <= ids[j] < self.specs[i].num_blocks)
            raise ValueError(f"{name}[{j}] = {int(ids[j])} is out of range for layer "
                             f"{i} ({self.specs[i].num_blocks} blocks)")
        if len(np.unique(ids)) != len(ids):
            seen: dict[int, int] = {}
            for j, b in enumerate(ids.tolist()):
                if b in seen:
                    raise ValueError(f"{name}[{j}] = {b} duplicates {name}[{seen[b]}]")
                seen[b] = j
        return ids.astype(np.int32)

    def slots(self, slots: Sequence[int], n: int) -> list[int]:
        if isinstance(slots, (str, bytes)) or not isinstance(slots, Sequence | np.ndarray):
            raise TypeError(f"slots must be a sequence of ints, one per key. Got {slots!r}")
        slots = list(slots)
        if len(slots) != n:
            raise ValueError(f"{len(slots)} slots for {n} keys")
        for j, s in enumerate(slots):
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or \
                    not 0 <= s < self._pool.num_slots:
                raise ValueError(f"slots[{j}] = {s!r} is not a host slot; slots are "
                                 f"0..{self._pool.num_slots - 1}")
        return [int(s) for s in slots]

    def pages(self, pages: Sequence[PageRef]) -> list[PageRef]:
        """The refs a load or prefetch reads, checked to be refs this pool handed out.

        A ref that was never valid here (an unknown slot, a generation never issued)
        is an engine bug, not a cache miss, so it raises; a ref that was valid once
        (freed, or its slot reused since) is left to the load, which reports a miss.

        Raises:
          TypeError: not a ``PageRef``.
          PoolError: a ref never valid for this pool, naming it.
        """
        pages = list(pages)
        for j, p in enumerate(pages):
            if not isinstance(p, PageRef):
                raise TypeError(f"pages[{j}]: expected a PageRef. Got {p!r} of type {type(p)}")
            if not 0 <= p.slot < self._pool.num_slots:
                raise PoolError(f"pages[{j}] ({p}): unknown host slot; slots are "
                                f"0..{self._pool.num_slots - 1}")
        never_issued = self._pool.never_issued([(p.slot, p.generation) for p in pages])
        for j, (p, never) in enumerate(zip(pages, never_issued)):
            if never is not None:
                raise PoolError(f"pages[{j}] ({p}) was never a page of this manager: "
                                f"{never}; pass refs that offload() or import_page() of "
                                "this manager returned")
        return pages
