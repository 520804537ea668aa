"""Model KV-cache specs (``configs/*.toml``) and their loader.

A config describes the KV cache of one model: groups of identical layers, each
with its block shape, dtype, the (emulated) TPU layout of its device array and the
dim split across devices under tensor parallelism. From it kvxfer builds
``kvxfer.plan.LayerSpec`` lists, inspects every layer's slice geometry, and builds
random caches on the current backend for tests, probes and benchmarks.

Format (TOML, read with ``tomllib``)::

    name = "llama3-8b"                  # optional; default the file's stem
    description = "Llama-3-8B-like: 32 layers, 8 KV heads, head dim 128, bf16"
    num_device_blocks = 16      # blocks per layer when building caches (small: runs on CPU)
    num_host_blocks = 64        # default host pages for `kvxfer plan`
    block_size = 16             # optional: tokens per block (informational)

    [[layers]]                  # a group of identical layers; at least one group
    name = "attn"               # letters, digits, '_' and '-'; unique in the file
    count = 32                  # layers in the group, >= 1
    block_shape = [16, 2, 8, 128]        # dims after the block dim: tokens, K/V, kv heads, head dim
    dtype = "bfloat16"                   # any kvxfer dtype name: bf16, int8, float8_e4m3fn, int4...
    tpu_layout = "{4,3,2,1,0:T(8,128)(2,1)}"  # optional: emulated TPU layout of the FULL
                                              # [blocks, *block_shape] array (rank 1+len(block_shape))
    shard_dim = 3               # optional: dim of the FULL array split across devices
                                # (e.g. kv heads), 1..rank-1, never the block dim 0;
                                # omit = replicated under tensor parallelism
    tpu_compiled = [            # optional: the real TPU compiler's layout of ONE SHARD,
      { shards = 1, blocks = [1, 65536], layout = "{4,3,2,1,0:T(8,128)(2,1)}" },
      { shards = 4, blocks = [1, 65536], layout = "{4,3,2,1,0:T(2,128)(2,1)}" },
    ]                           # by shard count and block count (inclusive ranges);
                                # `python tools/tpu_catalog.py` writes it
    tpu_layout_note = "..."     # required when tpu_layout is not the compiler's choice
                                # for one device at engine sizes: why it is kept

Where a group has ``tpu_compiled``, the layouts of its caches (``layer_specs``,
``inspect_layers``, ``tpu_layouts``) are the compiler's choice for the shard count and
block count asked (the last range's beyond it), and ``tpu_layout`` must be that
choice for one device at the largest block count, unless ``tpu_layout_note`` says
why the config keeps another (a non-default layout an engine can request): then
``tpu_layout`` is used for every count.

Layers are numbered in file order; layer ``i`` of group ``g`` is named ``"g.i"``.
Unknown keys are errors (a typo must not be silently ignored), and every error is a
``ConfigError`` naming the file and the offending key, e.g.
``configs/x.toml: layers[1].dtype: unknown dtype 'bfloat17'``.

Example:
    >>> from kvxfer import config
    >>> spec = config.load_builtin("tiny")
    >>> spec.num_layers, spec.layer_names()[:3]
    (4, ['kv32.0', 'kv32.1', 'kv16.0'])
    >>> [s.shape for s in spec.layer_specs(num_blocks=8)][:1]
    [(8, 16, 2, 2, 32)]
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (TPU VM images): the same parser, as a package
    import tomli as tomllib

from kvxfer import _resources
from kvxfer._check import MAX_LAYERS
from kvxfer.layout import (Layout, LayoutError, SliceGeometry, dtype_name, dtype_of,
                           inspect)
from kvxfer.plan import LayerSpec

__all__ = ["ConfigError", "LayerGroup", "ModelSpec", "load", "load_builtin",
           "builtin_names", "MAX_LAYERS"]


# What a real model can need: layers per model (MAX_LAYERS, kvxfer._check's, so the
# command line names it without this module), and block ids and host pages that fit
# the int32 ids the engine uses. Larger values are refused before anything grows.
_MAX_COUNT = 2**31 - 1

_TOP_KEYS = ("name", "description", "num_device_blocks", "num_host_blocks", "block_size",
             "layers")
_GROUP_KEYS = ("name", "count", "block_shape", "dtype", "tpu_layout", "shard_dim",
               "tpu_compiled", "tpu_layout_note")
_NAME_RE = re.compile(r"[A-Za-z0-9_\-]+")


class ConfigError(ValueError):
    """A model config that is malformed; the message names the file and the key."""


# An error factory: (key, message) -> ConfigError with the right prefix.
_Err = Callable[[str, str], ConfigError]


def _prefixed(prefix: str) -> _Err:
    return lambda key, msg: ConfigError(f"{prefix}: {key}: {msg}")


def _check_int(value: Any, key: str, err: _Err, minimum: int = 1,
               maximum: int = _MAX_COUNT) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise err(key, f"expected an integer, got {value!r}")
    if value < minimum:
        raise err(key, f"{value} must be >= {minimum}")
    if value > maximum:
        raise err(key, f"{value} is more than any real model needs (at most {maximum})")
    return int(value)


def _check_str(value: Any, key: str, err: _Err) -> str:
    if not isinstance(value, str):
        raise err(key, f"expected a string, got {value!r}")
    return value


def _check_name(value: Any, key: str, err: _Err) -> str:
    value = _check_str(value, key, err)
    if not _NAME_RE.fullmatch(value):
        raise err(key, f"{value!r} must be non-empty letters, digits, '_' or '-'")
    return value


def _unknown_keys(table: Mapping[str, Any], allowed: Sequence[str], where: str,
                  err: _Err) -> None:
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise err(f"{where}{key}", f"unknown key; {hint}expected one of "
                      f"{', '.join(allowed)}")


def _validate_layout(text: Any, key: str, block_shape: tuple[int, ...], dtype: str,
                     err: _Err) -> Layout:
    rank = 1 + len(block_shape)
    if isinstance(text, Layout):
        layout = text
    else:
        try:
            layout = Layout.parse(_check_str(text, key, err))
        except LayoutError as e:
            raise err(key, f"bad layout {text!r}: {e}") from None
    if layout.rank != rank:
        raise err(key, f"layout {str(layout)!r} has rank {layout.rank}, but "
                  f"the full array [blocks, *block_shape={list(block_shape)}] has rank "
                  f"{rank}")
    try:  # tiles must fit the shape (sub-tiles dividing their tiles, ...)
        inspect((1, *block_shape), dtype, layout)
    except LayoutError as e:
        raise err(key, f"layout {str(layout)!r} does not fit "
                  f"{dtype}[blocks,{','.join(map(str, block_shape))}]: {e}") from None
    return layout


def _validate_compiled(raw: Any, block_shape: tuple[int, ...], dtype: str,
                       shard_dim: int | None, err: _Err) -> tuple[tuple[int, int, int, str], ...]:
    """``tpu_compiled`` as ``(shards, first, last, layout)`` tuples, ranges checked."""
    if raw is None:
        return ()
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
        raise err("tpu_compiled", f"expected a list of {{ shards, blocks, layout }} tables, "
                  f"got {raw!r}")
    out = []
    for i, item in enumerate(raw):
        key = f"tpu_compiled[{i}]"
        if isinstance(item, tuple) and len(item) == 4:
            item = dict(zip(("shards", "first", "last", "layout"), item))
            item["blocks"] = [item.pop("first"), item.pop("last")]
        if not isinstance(item, Mapping) or set(item) != {"shards", "blocks", "layout"}:
            raise err(key, f"expected {{ shards = N, blocks = [first, last], layout = "
                      f"\"...\" }}, got {item!r}")
        shards = _check_int(item["shards"], f"{key}.shards", err)
        if shards > 1 and (shard_dim is None or block_shape[shard_dim - 1] % shards):
            raise err(f"{key}.shards", f"{shards} shards: the group has no shard_dim that "
                      f"divides into {shards}")
        blocks = item["blocks"]
        if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence) or \
                len(blocks) != 2:
            raise err(f"{key}.blocks", f"expected [first, last], got {blocks!r}")
        first = _check_int(blocks[0], f"{key}.blocks[0]", err)
        last = _check_int(blocks[1], f"{key}.blocks[1]", err, minimum=first)
        shard_shape = list(block_shape)
        if shards > 1:
            shard_shape[shard_dim - 1] //= shards
        layout = _validate_layout(item["layout"], f"{key}.layout", tuple(shard_shape),
                                  dtype, err)
        prev = [o for o in out if o[0] == shards]
        if prev and first <= prev[-1][2]:
            raise err(f"{key}.blocks", f"[{first}, {last}] overlaps or precedes "
                      f"[{prev[-1][1]}, {prev[-1][2]}] of the same shard count")
        out.append((shards, first, last, str(layout)))
    return tuple(out)


def _validate_group(name: Any, count: Any, block_shape: Any, dtype: Any, tpu_layout: Any,
                    shard_dim: Any, err: _Err, tpu_compiled: Any = None,
                    tpu_layout_note: Any = None) -> dict[str, Any]:
    """Checks one group's values; returns them normalized (LayerGroup's fields)."""
    name = _check_name(name, "name", err)
    count = _check_int(count, "count", err, maximum=MAX_LAYERS)
    if isinstance(block_shape, (str, bytes)) or not isinstance(block_shape, Sequence):
        raise err("block_shape", f"expected a list of dims, got {block_shape!r}")
    if not block_shape:
        raise err("block_shape", "must list at least one dim")
    block_shape = tuple(_check_int(d, f"block_shape[{i}]", err)
                        for i, d in enumerate(block_shape))
    rank = 1 + len(block_shape)
    try:
        dt = dtype_of(dtype)
    except (LayoutError, TypeError, ValueError):
        raise err("dtype", f"unknown dtype {dtype!r}") from None
    if dt.kind not in "biufV" or dt.itemsize == 0:
        raise err("dtype", f"unknown dtype {dtype!r}: {dt.name} is not a real numeric type")
    dtype = dtype_name(dt)
    layout_text = None
    if tpu_layout is not None:
        layout_text = str(_validate_layout(tpu_layout, "tpu_layout", block_shape, dtype, err))
    if shard_dim is not None:
        shard_dim = _check_int(shard_dim, "shard_dim", err, minimum=0)
        if shard_dim == 0:
            raise err("shard_dim", "0 is the block dim, which is never split across "
                      f"devices; use 1..{rank - 1} (a dim of the full array)")
        if shard_dim >= rank:
            raise err("shard_dim", f"{shard_dim} is out of range for the full array of rank "
                      f"{rank}; use 1..{rank - 1}")
    compiled = _validate_compiled(tpu_compiled, block_shape, dtype, shard_dim, err)
    if tpu_layout_note is not None:
        tpu_layout_note = _check_str(tpu_layout_note, "tpu_layout_note", err)
        if not tpu_layout_note.strip():
            raise err("tpu_layout_note", "must say why the layout is kept (empty)")
    one = [c for c in compiled if c[0] == 1]
    if one and tpu_layout_note is None and layout_text != one[-1][3]:
        raise err("tpu_layout", f"{layout_text!r} is not the compiler's choice for one "
                  f"device at engine sizes ({one[-1][3]!r}, tpu_compiled); use it, or say "
                  "why the config keeps another in tpu_layout_note")
    return dict(name=name, count=count, block_shape=block_shape, dtype=dtype,
                tpu_layout=layout_text, shard_dim=shard_dim, tpu_compiled=compiled,
                tpu_layout_note=tpu_layout_note)


@dataclasses.dataclass(frozen=True, slots=True)
class LayerGroup:
    """A group of identical layers.

    Attributes:
      name: group name; its layers are named ``"<name>.<i>"``.
      count: layers in the group (>= 1).
      block_shape: dims after the block dim.
      dtype: canonical dtype name (``kvxfer.layout.dtype_name``).
      tpu_layout: canonical XLA text of the emulated TPU layout of the full
        ``[blocks, *block_shape]`` array, or None (row-major).
      shard_dim: dim of the full array split across devices (1..rank-1), or None
        when the layer is replicated under tensor parallelism.
      tpu_compiled: the TPU compiler's layout of one shard, as ``(shards, first
        block count, last block count, layout text)`` ranges (``tools/tpu_catalog.py``).
      tpu_layout_note: why ``tpu_layout`` is kept though the compiler chooses
        another (None: it is the compiler's choice).
    """

    name: str
    count: int
    block_shape: tuple[int, ...]
    dtype: str
    tpu_layout: str | None = None
    shard_dim: int | None = None
    tpu_compiled: tuple[tuple[int, int, int, str], ...] = ()
    tpu_layout_note: str | None = None

    def __post_init__(self):
        values = _validate_group(self.name, self.count, self.block_shape, self.dtype,
                                 self.tpu_layout, self.shard_dim,
                                 _prefixed(f"layer group {self.name!r}"), self.tpu_compiled,
                                 self.tpu_layout_note)
        for key, value in values.items():
            object.__setattr__(self, key, value)

    @property
    def rank(self) -> int:
        """Rank of the full array (block dim included)."""
        return 1 + len(self.block_shape)

    @property
    def layout(self) -> Layout | None:
        """The parsed TPU layout, or None."""
        return None if self.tpu_layout is None else Layout.parse(self.tpu_layout)

    def layout_for(self, num_blocks: int, num_shards: int = 1) -> Layout | None:
        """The TPU layout of one shard of a ``num_blocks`` cache split ``num_shards`` ways.

        The compiler's choice from ``tpu_compiled`` for that shard count and block
        count (past the last range checked, its choice); ``tpu_layout`` where the
        config keeps it on purpose (``tpu_layout_note``) or has no compiled choice.
        """
        ranges = [c for c in self.tpu_compiled if c[0] == num_shards]
        if self.tpu_layout_note is not None or not ranges:
            return self.layout
        for _, first, last, text in ranges:
            if first <= num_blocks <= last:
                return Layout.parse(text)
        below = [c for c in ranges if c[2] < num_blocks]
        return Layout.parse((below or ranges)[-1][3])

    def compiled_note(self, num_blocks: int, num_shards: int = 1) -> str:
        """What the config says of the layout at this size: '' when it is the
        compiler's choice for it, else why not (kept on purpose; the count beyond what
        was checked; no compiled choice; the choice changes with the block count)."""
        ranges = [c for c in self.tpu_compiled if c[0] == num_shards]
        if self.tpu_layout_note is not None:
            chosen = next((c[3] for c in ranges if c[1] <= num_blocks <= c[2]), None)
            return (f"kept on purpose ({self.tpu_layout_note})" +
                    (f"; the compiler chooses {chosen}" if chosen else ""))
        if not ranges:
            return "no compiled choice in the config (emulated layout)"
        if num_blocks > ranges[-1][2]:
            return f"checked up to {ranges[-1][2]} blocks"
        if len(ranges) > 1:
            cur = next(c for c in ranges if c[1] <= num_blocks <= c[2])
            return f"the compiler's choice for {cur[1]}-{cur[2]} blocks; it changes with " \
                   "the block count"
        return ""

    @property
    def logical_block_bytes(self) -> int:
        """Dense bytes of one block of one layer (what the staged path stores)."""
        return math.prod(self.block_shape) * dtype_of(self.dtype).itemsize

    def num_shards(self, num_devices: int) -> int:
        """Shards over ``num_devices``: all of them when ``shard_dim`` divides, else 1."""
        if self.shard_dim is None or num_devices <= 1:
            return 1
        return num_devices if self.block_shape[self.shard_dim - 1] % num_devices == 0 else 1

    def geometry(self, num_blocks: int) -> SliceGeometry:
        """Slice geometry of one layer's ``[num_blocks, *block_shape]`` array."""
        return inspect((num_blocks, *self.block_shape), self.dtype,
                       self.layout_for(num_blocks))


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model's KV cache: groups of identical layers and default block counts.

    Attributes:
      name: model name.
      description: free text.
      num_device_blocks: blocks per layer when building caches.
      num_host_blocks: default host pages (``kvxfer plan``).
      block_size: tokens per block (informational), or None.
      groups: the layer groups, in layer order.
      source: the file it was loaded from ("" when built in code).
    """

    name: str
    description: str
    num_device_blocks: int
    num_host_blocks: int
    block_size: int | None
    groups: tuple[LayerGroup, ...]
    source: str = ""

    def __post_init__(self):
        err = _prefixed(self.source or f"model {self.name!r}")
        _check_str(self.name, "name", err)
        _check_str(self.description, "description", err)
        _check_int(self.num_device_blocks, "num_device_blocks", err)
        _check_int(self.num_host_blocks, "num_host_blocks", err)
        if self.block_size is not None:
            _check_int(self.block_size, "block_size", err)
        groups = tuple(self.groups)
        if not groups:
            raise err("layers", "a model needs at least one [[layers]] group")
        seen: dict[str, int] = {}
        for i, g in enumerate(groups):
            if not isinstance(g, LayerGroup):
                raise err(f"layers[{i}]", f"expected a LayerGroup, got {g!r}")
            if g.name in seen:
                raise err(f"layers[{i}].name", f"{g.name!r} is already the name of "
                          f"layers[{seen[g.name]}]")
            seen[g.name] = i
        object.__setattr__(self, "groups", groups)

    # -- layers ---------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Layers in the model (every group's count)."""
        return sum(g.count for g in self.groups)

    def layer_names(self) -> list[str]:
        """``["attn.0", "attn.1", ...]`` in layer order."""
        return [f"{g.name}.{i}" for g in self.groups for i in range(g.count)]

    def _layers(self) -> list[tuple[str, LayerGroup]]:
        return [(f"{g.name}.{i}", g) for g in self.groups for i in range(g.count)]

    def _num_blocks(self, num_blocks: int | None) -> int:
        if num_blocks is None:
            return self.num_device_blocks
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, numbers.Integral) \
                or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} must be a positive int")
        return int(num_blocks)

    def layer_specs(self, num_blocks: int | None = None, num_devices: int = 1,
                    emulate_tpu: bool = True) -> list[LayerSpec]:
        """One ``kvxfer.plan.LayerSpec`` per layer.

        Args:
          num_blocks: blocks per layer; default ``num_device_blocks``.
          num_devices: devices the caches are spread over (tensor parallelism). A
            layer whose ``shard_dim`` divides by it is split into that many shards;
            every other layer is replicated on every device.
          emulate_tpu: give each layer its TPU layout (when the config has one);
            False gives row-major layouts, as the CPU backend stores them.

        Returns:
          The specs, in layer order.
        """
        n = self._num_blocks(num_blocks)
        if isinstance(num_devices, bool) or not isinstance(num_devices, numbers.Integral) \
                or num_devices < 1:
            raise ValueError(f"num_devices={num_devices!r} must be a positive int")
        specs = []
        for name, g in self._layers():
            shards = g.num_shards(num_devices)
            shape = (n, *g.block_shape)
            shard_shape = list(shape)
            if shards > 1:
                shard_shape[g.shard_dim] //= shards
            specs.append(LayerSpec(
                name, shape, g.dtype, g.layout_for(n, shards) if emulate_tpu else None,
                num_shards=shards, replicas=num_devices if shards == 1 else 1,
                shard_shape=tuple(shard_shape)))
        return specs

    def inspect_layers(self, num_blocks: int | None = None
                       ) -> list[tuple[str, SliceGeometry]]:
        """(layer name, slice geometry) per layer, under the TPU layouts.

        Layers without a ``tpu_layout`` are inspected row-major.
        """
        n = self._num_blocks(num_blocks)
        cache = {g.name: g.geometry(n) for g in self.groups}
        return [(name, cache[g.name]) for name, g in self._layers()]

    def tpu_layouts(self, num_blocks: int | None = None, num_devices: int = 1
                    ) -> list[Layout | None]:
        """Per-layer TPU layouts of one shard (None where the config gives none).

        For ``KVCacheManager(layouts=...)``: the compiler's choice for ``num_blocks``
        blocks split as ``layer_specs(num_blocks, num_devices)`` splits them (see
        ``LayerGroup.layout_for``).
        """
        return [s.layout if g.layout_for(s.shape[0], s.num_shards) is not None else None
                for s, (_, g) in zip(self.layer_specs(num_blocks, num_devices),
                                     self._layers())]

    # -- caches ---------------------------------------------------------------

    def shardings(self, devices: Sequence[Any] | None = None) -> list[Any]:
        """Per-layer shardings ``build_caches`` places the caches with.

        Args:
          devices: None (this process's first device, ``jax.local_devices()[0]``) or a
            list of jax devices. Over 2+
            devices, a layer whose ``shard_dim`` divides by their number gets
            ``NamedSharding(Mesh(devices, ("kv",)), PartitionSpec(None, ..., "kv"))``
            (``"kv"`` at ``shard_dim``); every other layer is replicated
            (``PartitionSpec()``).
        """
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

        if devices is None:
            one = SingleDeviceSharding(jax.local_devices()[0])
            return [one] * self.num_layers
        devices = list(devices)
        if not devices:
            raise ValueError("devices must list at least one device")
        if len(devices) == 1:
            return [SingleDeviceSharding(devices[0])] * self.num_layers
        mesh = Mesh(np.array(devices), ("kv",))
        out = []
        for g in self.groups:
            if g.num_shards(len(devices)) > 1:
                spec = PartitionSpec(*([None] * g.shard_dim), "kv")
            else:
                spec = PartitionSpec()
            out.extend([NamedSharding(mesh, spec)] * g.count)
        return out

    def build_caches(self, num_blocks: int | None = None, *,
                     devices: Sequence[Any] | None = None, seed: int = 0) -> list[Any]:
        """Random KV caches, one ``jax.Array`` per layer, on the current backend.

        Contents are random bits, deterministic in ``(seed, layer index)`` and
        independent of ``devices``: float caches hold raw random bit patterns (NaNs
        included), so byte-exactness is tested on raw bits; sub-byte integer types
        hold in-range values. Arrays are row-major (the CPU backend's storage); give
        ``tpu_layouts()`` to a manager to emulate TPU layouts.

        Args:
          num_blocks: blocks per layer; default ``num_device_blocks``.
          devices: None for the default device, or a list of jax devices; over 2+
            devices the layers are sharded or replicated as ``shardings`` says.
          seed: random seed.

        Returns:
          The caches, in layer order, each ``[num_blocks, *block_shape]``.

        Raises:
          ConfigError: a dtype the backend cannot hold (64-bit without jax x64).
        """
        import jax

        from kvxfer.testing import random_bits

        n = self._num_blocks(num_blocks)
        shardings = self.shardings(devices)
        caches = []
        index = 0
        for gi, g in enumerate(self.groups):
            dt = dtype_of(g.dtype)
            if jax.dtypes.canonicalize_dtype(dt) != dt:
                raise ConfigError(f"{self.source or self.name}: layers[{gi}].dtype: "
                                  f"{g.dtype} needs jax_enable_x64 to build a cache")
            for _ in range(g.count):
                host = random_bits((n, *g.block_shape), dt, seed=(int(seed), index))
                # XLA:CPU may alias an aligned numpy array (one buffer under every
                # replica): copy, so each cache owns its device buffers.
                cache = jax.device_put(host, shardings[index])
                caches.append(jax.device_put(cache, shardings[index], may_alias=False))
                index += 1
        return caches


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def _parse(data: Mapping[str, Any], display: str, source: str) -> ModelSpec:
    err = _prefixed(display)
    _unknown_keys(data, _TOP_KEYS, "", err)
    for key in ("num_device_blocks", "num_host_blocks", "layers"):
        if key not in data:
            raise err(key, "missing (required)")
    name = _check_str(data.get("name", Path(display).stem), "name", err)
    if not name.strip():
        raise err("name", "must not be empty")
    description = _check_str(data.get("description", ""), "description", err)
    num_device_blocks = _check_int(data["num_device_blocks"], "num_device_blocks", err)
    num_host_blocks = _check_int(data["num_host_blocks"], "num_host_blocks", err)
    block_size = data.get("block_size")
    if block_size is not None:
        block_size = _check_int(block_size, "block_size", err)
    layers = data["layers"]
    if not isinstance(layers, list) or not all(isinstance(t, dict) for t in layers):
        raise err("layers", "expected an array of tables ([[layers]] sections)")
    if not layers:
        raise err("layers", "a model needs at least one [[layers]] group")
    groups = []
    seen: dict[str, int] = {}
    for i, table in enumerate(layers):
        where = f"layers[{i}]"
        _unknown_keys(table, _GROUP_KEYS, f"{where}.", err)
        for key in ("name", "count", "block_shape", "dtype"):
            if key not in table:
                raise err(f"{where}.{key}", "missing (required)")

        def group_err(key: str, msg: str, _where: str = where) -> ConfigError:
            return ConfigError(f"{display}: {_where}.{key}: {msg}")

        values = _validate_group(table["name"], table["count"], table["block_shape"],
                                 table["dtype"], table.get("tpu_layout"),
                                 table.get("shard_dim"), group_err,
                                 table.get("tpu_compiled"), table.get("tpu_layout_note"))
        if values["tpu_layout"] is not None:
            try:  # the layout must fit the default cache too
                inspect((num_device_blocks, *values["block_shape"]), values["dtype"],
                        values["tpu_layout"])
            except LayoutError as e:
                raise group_err("tpu_layout", f"does not fit num_device_blocks="
                                f"{num_device_blocks}: {e}") from None
        if values["name"] in seen:
            raise group_err("name", f"{values['name']!r} is already the name of "
                            f"layers[{seen[values['name']]}]")
        seen[values["name"]] = i
        groups.append(LayerGroup(**values))
        total = sum(g.count for g in groups)
        if total > MAX_LAYERS:
            raise group_err("count", f"brings the model to {total} layers, more than any "
                            f"real model has (at most {MAX_LAYERS})")
    return ModelSpec(name=name, description=description,
                     num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks,
                     block_size=block_size, groups=tuple(groups), source=source)


def builtin_names() -> list[str]:
    """Names of the built-in configs, sorted.

    Example:
        >>> "tiny" in builtin_names()
        True
    """
    return _resources.builtin_names("configs")


def load(path: str | os.PathLike[str]) -> ModelSpec:
    """Loads a model config: a built-in name (``"llama3-8b"``) or a TOML file.

    Built-in names are found from any directory (the configs ship in the wheel).

    Args:
      path: a built-in name or a file.

    Returns:
      The validated spec; ``source`` is the file's absolute path.

    Raises:
      ConfigError: no such file or built-in name (listing the built-in ones),
        invalid TOML, or a bad key or value (the message names the file and key).
    """
    display = os.fspath(path)
    try:
        p, raw = _resources.read("configs", display)
    except _resources.UnknownNameError as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(f"{display}: cannot read: {e.strerror or e}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{display}: not UTF-8 text (byte {e.start}): not a TOML "
                          "config") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{display}: invalid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{display}: invalid TOML: nested too deeply") from None
    return _parse(data, display, str(p.resolve()))


load_builtin = load
"""The same as ``load`` (a built-in name or a path)."""


def device_blocks(path: str | os.PathLike[str]) -> int | None:
    """A config's ``num_device_blocks`` read from its TOML alone, parsing no dtype (so
    an argument check needs neither ml_dtypes nor JAX); None where it cannot be read
    (``load`` then says why).

    Example:
        >>> device_blocks("tiny")
        32
    """
    try:
        data = tomllib.loads(_resources.read("configs", os.fspath(path))[1].decode("utf-8"))
    except (_resources.UnknownNameError, OSError, UnicodeDecodeError, tomllib.TOMLDecodeError,
            RecursionError):
        return None
    blocks = data.get("num_device_blocks")
    return blocks if isinstance(blocks, int) and not isinstance(blocks, bool) else None
