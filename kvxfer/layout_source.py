"""Where a layout comes from: one interface, whatever the source.

A KV cache's layout comes from one of these places, each a ``LayoutSource``:

* ``ArrayFormats``: the array's own format (``jax.Array.format``), the truth on the
  hardware it lives on;
* ``ConfigLayouts``: a model config's catalogue of TPU layouts (the compiler's choices
  by block and shard count that ``tools/tpu_catalog.py`` recorded, or a layout kept on
  purpose), emulated on any backend;
* ``Compiler``: the real XLA:TPU compiler for a target (``kvxfer.tpu``), deviceless, in
  a worker process: libtpu never loads in the caller's process, and a compile that
  aborts ends only the worker;
* ``CatalogLayouts``: a catalogue of layouts chosen on purpose (``layouts/*.json``);
* ``Given``: a layout written by hand (one for every array, one per array, or
  row-major).

Every source answers the same question the same way: ``source.layouts(arrays)`` takes
``ArraySpec``s (shape, dtype, how the array splits over devices) and returns a
``SourcedLayout`` for each: one shard's layout, which source gave it, what the source
says of it and, for the compiler, the nearest shapes it lays out addressably. ``kvxfer
inspect``, ``kvxfer plan`` and ``kvxfer aot`` take a source and never ask which one it is.

Example:
    >>> from kvxfer import config
    >>> from kvxfer.layout_source import ArraySpec, ConfigLayouts, Given
    >>> spec = config.load("llama3-8b")
    >>> arrays = [ArraySpec((1024, 16, 2, 8, 128), "bf16", name="attn")]
    >>> [str(s.layout) for s in ConfigLayouts(spec).layouts(arrays)]
    ['{4,3,2,1,0:T(8,128)(2,1)}']
    >>> (s,) = Given().layouts(arrays)
    >>> s.source, str(s.layout), s.geometry().bytes_per_block
    ('row-major', '{4,3,2,1,0}', 65536)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvxfer._check import check_int
from kvxfer.layout import Layout, LayoutError, SliceGeometry, dtype_name, inspect
from kvxfer.plan import LayerSpec

if TYPE_CHECKING:
    from kvxfer.catalog import Catalog
    from kvxfer.config import ModelSpec

__all__ = ["ArraySpec", "SourcedLayout", "LayoutSource", "Given", "ArrayFormats",
           "ConfigLayouts", "CatalogLayouts", "Compiler", "config_layer_specs"]


@dataclasses.dataclass(frozen=True, slots=True)
class ArraySpec:
    """One KV cache array a layout is asked for.

    Attributes:
      shape: the global shape.
      dtype: dtype name.
      num_devices: devices the array is spread over.
      shard_dim: the dim split over them (None: replicated); each shard is laid out on
        its own.
      block_dim: the block dim.
      name: what the array is called (a catalogue looks layouts up by it: a config's
        layer group, ``"attn"`` or its layer ``"attn.3"``).
      format: the live array's own format (``jax.Array.format``), or None.
    """

    shape: tuple[int, ...]
    dtype: str
    num_devices: int = 1
    shard_dim: int | None = None
    block_dim: int = 0
    name: str = ""
    format: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if isinstance(self.shape, (str, bytes)) or not isinstance(self.shape, Sequence):
            raise TypeError(f"shape={self.shape!r} must be a sequence of ints")
        shape = tuple(check_int(d, f"shape[{i}]", minimum=0) for i, d in enumerate(self.shape))
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        devices = check_int(self.num_devices, "num_devices", minimum=1)
        object.__setattr__(self, "num_devices", devices)
        if self.shard_dim is not None and devices > 1:
            dim = check_int(self.shard_dim, "shard_dim", minimum=0)
            if dim >= len(shape) or shape[dim] % devices:
                raise ValueError(f"shard_dim={dim} of shape {list(shape)} does not split "
                                 f"over {devices} devices")
        elif self.shard_dim is not None:
            object.__setattr__(self, "shard_dim", None)  # one device: nothing is split

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """One shard's shape (the whole shape when not split)."""
        if self.shard_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.shard_dim] //= self.num_devices
        return tuple(shape)

    @classmethod
    def of(cls, array: Any, name: str = "") -> ArraySpec:
        """The spec of a live ``jax.Array`` (its shape, dtype, split and own format).

        Raises:
          LayoutError: the array is split along more than one dim.
        """
        shape = tuple(array.shape)
        sharding = array.sharding
        shard = tuple(sharding.shard_shape(shape))
        split = [d for d, (a, b) in enumerate(zip(shape, shard)) if a != b]
        if len(split) > 1:
            raise LayoutError(f"{name or 'array'}: split along dims {split} of "
                              f"{list(shape)}; a layout source describes one split dim")
        # Split: one device a distinct shard (replicas lay theirs out alike).
        devices = shape[split[0]] // shard[split[0]] if split else len(sharding.device_set)
        return cls(shape, array.dtype, devices, split[0] if split else None, name=name,
                   format=array.format)

    @classmethod
    def of_layer(cls, layer: LayerSpec) -> ArraySpec:
        """The spec of a plan's layer: split along the dim its shards divide."""
        split = [d for d, (a, b) in enumerate(zip(layer.shape, layer.shard_shape)) if a != b]
        if split:  # each shard's devices lay it out alike: one device a shard
            return cls(layer.shape, layer.dtype, layer.num_shards, split[0], name=layer.name)
        return cls(layer.shape, layer.dtype, layer.replicas, name=layer.name)


@dataclasses.dataclass(frozen=True, slots=True)
class SourcedLayout:
    """One array's layout (one shard's) and where it came from.

    Attributes:
      array: what was asked.
      layout: the layout of one shard.
      source: the source's name (``LayoutSource.name``).
      note: what the source says of this layout ('' nothing: e.g. a config's layout
        kept on purpose, or one past the block counts it was checked at).
      facts: what the source adds to ``--json`` (the compiler: target, chip, libtpu).
      alternatives: nearby shapes the source lays out addressably, best first, when
        this one is not; None when the source does not look for any.
    """

    array: ArraySpec
    layout: Layout
    source: str
    note: str = ""
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    alternatives: tuple[SourcedLayout, ...] | None = None

    def geometry(self) -> SliceGeometry:
        """The inspector's verdict on one shard under this layout."""
        return inspect(self.array.shard_shape, self.array.dtype, self.layout,
                       block_dim=self.array.block_dim)

    def as_dict(self) -> dict[str, Any]:
        """What ``--json`` adds to the inspector's object for this array."""
        a, out = self.array, dict(self.facts)
        if a.num_devices > 1 or out:
            out.update(shape=list(a.shape), devices=a.num_devices, shard_dim=a.shard_dim,
                       shard_shape=list(a.shard_shape))
        if self.note:
            out["layout_note"] = self.note
        if self.alternatives is not None:
            out["addressable_alternatives"] = [
                {"shape": list(alt.array.shape), "layout": str(alt.layout),
                 "bytes_per_block": alt.geometry().bytes_per_block,
                 "padding_factor": alt.geometry().padding_factor}
                for alt in self.alternatives]
        return out


class LayoutSource(Protocol):
    """Where layouts come from. Every source has this one signature."""

    #: What ``--json`` calls it (``layout_source``): "compiler", "config", ...
    name: str

    def layouts(self, arrays: Sequence[ArraySpec]) -> list[SourcedLayout]:
        """One ``SourcedLayout`` per array, in order.

        Raises:
          LayoutError (a ValueError), ValueError, TypeError: an array the source cannot
            lay out, naming it and the value at fault.
        """
        ...

    def describe(self, got: Sequence[SourcedLayout]) -> str:
        """One line saying where ``got`` came from ('' when there is nothing to say)."""
        ...


class Given:
    """Layouts written by hand: one for every array, one per array (None entries
    row-major), or row-major for all (``layouts=None``).

    Example:
        >>> (s,) = Given("{2,0,1:T(8,128)(2,1)}").layouts([ArraySpec((512, 3, 2048), "bf16")])
        >>> s.source, s.geometry().granularity
        ('given', 512)
        >>> Given(["{1,0}"]).layouts([ArraySpec((4, 4), "f32")] * 2)
        Traceback (most recent call last):
        ...
        ValueError: Given(['{1,0}']) has 1 layouts for 2 arrays; expected one per array
    """

    def __init__(self, layouts: Layout | str | Sequence[Layout | str | None] | None = None):
        self.given = layouts
        self.name = "row-major" if layouts is None else "given"

    def __repr__(self) -> str:
        return f"Given({self.given!r})"

    def layouts(self, arrays: Sequence[ArraySpec]) -> list[SourcedLayout]:
        given = self.given
        if given is None or isinstance(given, (Layout, str)):
            given = [given] * len(arrays)
        if len(given) != len(arrays):
            raise ValueError(f"{self!r} has {len(given)} layouts for {len(arrays)} arrays; "
                             "expected one per array")
        return [SourcedLayout(a, Layout.row_major(len(a.shape)) if g is None
                              else Layout.of(g), self.name)
                for a, g in zip(arrays, given)]

    def describe(self, got: Sequence[SourcedLayout]) -> str:
        return ""


@dataclasses.dataclass(frozen=True)
class ArrayFormats:
    """Each array's own format: what the runtime laid it out as (``ArraySpec.of``).

    Example:
        >>> import jax.numpy as jnp
        >>> (s,) = ArrayFormats().layouts([ArraySpec.of(jnp.zeros((8, 128)), "k")])
        >>> s.source, str(s.layout)
        ('array', '{1,0}')
    """

    name = "array"

    def layouts(self, arrays: Sequence[ArraySpec]) -> list[SourcedLayout]:
        out = []
        for i, a in enumerate(arrays):
            if a.format is None:
                raise LayoutError(f"array {a.name or i} ({list(a.shape)} {a.dtype}) has no "
                                  "format: the arrays' own layouts need live arrays "
                                  "(ArraySpec.of(array))")
            out.append(SourcedLayout(a, Layout.of(a.format), self.name))
        return out

    def describe(self, got: Sequence[SourcedLayout]) -> str:
        return ""


@dataclasses.dataclass(frozen=True)
class ConfigLayouts:
    """A model config's TPU layouts (``LayerGroup.layout_for``), looked up by the
    array's name (a layer group, or one of its layers): the compiler's choice recorded
    for the block and shard count asked, or a layout kept on purpose (row-major where
    the config gives none). Each carries the config's note on it (``compiled_note``).

    Example:
        >>> from kvxfer import config
        >>> src = ConfigLayouts(config.load("deepseek-mla"))
        >>> [s.geometry().addressable for s in src.layouts(
        ...     [ArraySpec((n, 16, 576), "bf16", name="mla") for n in (115, 116)])]
        [True, False]
        >>> src.layouts([ArraySpec((8, 16, 576), "bf16", name="attn")])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        kvxfer._layout_dtypes.LayoutError: array 'attn' is no layer group of config ...
    """

    spec: ModelSpec
    name = "config"

    def layouts(self, arrays: Sequence[ArraySpec]) -> list[SourcedLayout]:
        groups = {g.name: g for g in self.spec.groups}
        out = []
        for a in arrays:
            g = groups.get(a.name.split(".")[0])
            if g is None:
                raise LayoutError(f"array {a.name!r} is no layer group of config "
                                  f"{self.spec.name!r} (groups: {', '.join(groups)})")
            if (a.shape[1:], a.dtype, a.block_dim) != (g.block_shape, g.dtype, 0):
                raise LayoutError(f"array {a.name!r}: {list(a.shape)} {a.dtype} (block dim "
                                  f"{a.block_dim}) is not a cache of group {g.name!r} of "
                                  f"{self.spec.name!r} ([N, {', '.join(map(str, g.block_shape))}]"
                                  f" {g.dtype}, block dim 0)")
            shards = 1 if a.shard_dim is None else a.num_devices
            if shards > 1 and a.shard_dim != g.shard_dim:
                raise LayoutError(f"array {a.name!r}: split along dim {a.shard_dim}; config "
                                  f"{self.spec.name!r} splits {g.name!r} along {g.shard_dim}")
            layout = g.layout_for(a.shape[0], shards) or Layout.row_major(len(a.shape))
            out.append(SourcedLayout(a, layout, self.name, g.compiled_note(a.shape[0], shards),
                                     {"layout_source": self.name}))
        return out

    def describe(self, got: Sequence[SourcedLayout]) -> str:
        return ""


@dataclasses.dataclass(frozen=True)
class CatalogLayouts:
    """A layout catalogue's entries (``kvxfer.catalog``, ``layouts/*.json``), looked up
    by the array's name (an entry's); each carries the entry's note on why it is kept
    where the TPU compiler picks another layout for its shape.

    Example:
        >>> from kvxfer import catalog
        >>> src = CatalogLayouts(catalog.load("seeds"))
        >>> e = src.catalog.entries[0]
        >>> (s,) = src.layouts([ArraySpec(e.shape, e.dtype, name=e.name)])
        >>> str(s.layout) == e.layout, s.source
        (True, 'catalogue')
    """

    catalog: Catalog
    name = "catalogue"

    def layouts(self, arrays: Sequence[ArraySpec]) -> list[SourcedLayout]:
        out = []
        for a in arrays:
            named = [e for e in self.catalog.entries if e.name == a.name]
            if not named:
                raise LayoutError(f"array {a.name!r} is no entry of the catalogue")
            found = [e for e in named if (e.shape, e.dtype) == (a.shape, a.dtype)]
            if not found:
                e = named[0]
                raise LayoutError(f"array {a.name!r}: {list(a.shape)} {a.dtype} is not the "
                                  f"catalogue's {list(e.shape)} {e.dtype}")
            if len({str(Layout.parse(e.layout)) for e in found}) > 1:
                raise LayoutError(f"array {a.name!r}: {len(found)} entries of the catalogue "
                                  "have that name and shape, with different layouts; name "
                                  "them apart")
            e = found[0]
            out.append(SourcedLayout(a, Layout.parse(e.layout), self.name, e.tpu_default_note))
        return out

    def describe(self, got: Sequence[SourcedLayout]) -> str:
        return ""


class Compiler:
    """The real XLA:TPU compiler for ``target`` (``kvxfer.tpu.compiled_layout``),
    deviceless.

    Args:
      target: a TPU generation (``"v6e"``) or topology (``"v6e:2x4"``); checked here.
      isolated: compile in a worker process (``kvxfer.tpu.compile_worker``, one per
        ``layouts`` call), so libtpu never loads in this one and an abort inside it
        ends only the worker; False compiles here (for a caller that is itself such a
        worker, as ``kvxfer aot``'s compiles are).
      nearest: also look for the nearest shapes laid out addressably, for each array
        that is not (``kvxfer.tpu.addressable_alternatives``).

    Example (with the ``tpu`` extra installed, as CI has it):
        >>> (s,) = Compiler("v6e").layouts([ArraySpec((4096, 16, 576), "bf16")])
        >>> str(s.layout), [a.array.shape for a in s.alternatives][:1]
        ('{0,2,1:T(8,128)(2,1)}', [(4096, 16, 640)])
        >>> Compiler("v9")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: target='v9': unknown TPU generation 'v9'; expected one of v4, ...
    """

    name = "compiler"

    def __init__(self, target: str, *, isolated: bool = True, nearest: bool = True):
        from kvxfer import tpu

        tpu.topology(target)  # a bad target is refused before anything is compiled
        self.target, self.isolated, self.nearest = target.strip(), isolated, nearest

    def __repr__(self) -> str:
        return f"Compiler({self.target!r}, isolated={self.isolated}, nearest={self.nearest})"

    def layouts(self, arrays: Sequence[ArraySpec]) -> list[SourcedLayout]:
        from kvxfer import tpu

        for a in arrays:
            if a.block_dim != 0:
                raise ValueError(f"array {a.name or list(a.shape)}: block_dim={a.block_dim}; "
                                 "the TPU compiler is asked of caches whose block dim is 0")
            tpu.topology(self.target, a.num_devices)  # too many devices: refused here
        tpu.require_compiler()  # here, so a missing extra is one line in this process
        asked = [(a.shape, a.dtype, a.num_devices, a.shard_dim) for a in arrays]
        if not asked:
            return []
        if self.isolated:
            with tpu.compile_worker() as worker:
                got = worker.call(_compile, asked, self.target, self.nearest)
        else:
            got = _compile(asked, self.target, self.nearest)
        return [self._sourced(a, c, alts) for a, (c, alts) in zip(arrays, got)]

    def _sourced(self, a: ArraySpec, c: Any, alts: list[Any] | None) -> SourcedLayout:
        facts = {"layout_source": self.name, "target": c.target, "device_kind": c.device_kind,
                 "libtpu": c.libtpu}
        if alts is not None:
            alts = tuple(self._sourced(dataclasses.replace(
                a, shape=alt.shape, shard_dim=alt.shard_dim), alt, None) for alt in alts)
        return SourcedLayout(a, c.layout, self.name, "", facts, alts)

    def describe(self, got: Sequence[SourcedLayout]) -> str:
        if not got:
            return ""
        f, a = got[0].facts, got[0].array
        where = f"{f['target']} ({f['device_kind']}), libtpu {f['libtpu']}"
        if len(got) > 1:
            return f"layouts from the TPU compiler: {where}, per shard"
        return (f"layout from the TPU compiler: {where}, {a.num_devices} "
                f"device{'s' if a.num_devices != 1 else ''}"
                + (f", split along dim {a.shard_dim}" if a.shard_dim is not None else ""))


def _compile(asked: list[tuple], target: str, nearest: bool) -> list[tuple[Any, Any]]:
    """``Compiler``'s work, where libtpu may load: per array, the compiled layout and
    (with ``nearest``, for one not addressable) its addressable alternatives."""
    from kvxfer import tpu

    out = []
    for shape, dtype, devices, shard_dim in asked:
        c = tpu.compiled_layout(shape, dtype, target, num_devices=devices, shard_dim=shard_dim)
        alts = None
        if nearest:
            alts = [] if c.geometry().addressable else [alt for _, alt in (
                tpu.addressable_alternatives(shape, dtype, target, num_devices=devices,
                                             shard_dim=shard_dim))]
        out.append((c, alts))
    return out


def config_layer_specs(spec: ModelSpec, source: LayoutSource, num_blocks: int | None = None,
                       num_devices: int = 1) -> tuple[list[LayerSpec], list[SourcedLayout]]:
    """A model config's ``LayerSpec``s (for ``kvxfer.make_plan``) with each layer's shard
    laid out as ``source`` says, asked once per layer group.

    Args:
      spec: a ``kvxfer.config.ModelSpec``.
      source: where the layouts come from.
      num_blocks: blocks per layer (default: the config's ``num_device_blocks``).
      num_devices: devices the caches are split over, as the config splits them.

    Returns:
      The layer specs, and the sourced layout of each layer group, in group order.

    Example:
        >>> from kvxfer import config
        >>> spec = config.load("tiny")
        >>> specs, got = config_layer_specs(spec, ConfigLayouts(spec), 64)
        >>> len(specs), [s.note.split(" (")[0] for s in got]
        (4, ['kept on purpose', 'kept on purpose'])
    """
    specs = spec.layer_specs(num_blocks, num_devices=num_devices, emulate_tpu=False)
    group_of = [i for i, g in enumerate(spec.groups) for _ in range(g.count)]
    firsts = {}
    for s, i in zip(specs, group_of):
        firsts.setdefault(i, dataclasses.replace(ArraySpec.of_layer(s),
                                                 name=spec.groups[i].name))
    got = source.layouts(list(firsts.values()))
    return [dataclasses.replace(s, layout=got[i].layout)
            for s, i in zip(specs, group_of)], got
