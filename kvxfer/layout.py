"""XLA layouts, their physical geometry, and the per-block addressability proof.

XLA writes a layout as ``{2,0,1:T(8,128)(2,1)}``: ``minor_to_major`` lists the
logical dims from the most minor physical dim outward, and each ``T(...)`` is one
level of tiling (openxla/xla ``docs/tiled_layout.md``). kvxfer turns such a layout
into a list of *physical axes*: the row-major axes of the final tiled shape, each
one a digit of exactly one logical dim. Everything else follows from that list:

* the physical byte offset of any logical index (a vectorized mixed-radix sum);
* the physical size, padding included (sub-byte elements packed);
* whether one index of the block dim (a KV block) is one contiguous byte range,
  and if not, the granularity: the smallest number of consecutive blocks that is.

The granularity is the smallest ``g`` such that every aligned group of ``g``
consecutive blocks occupies one contiguous byte range of equal size at a fixed
stride, group ``j`` being group 0 moved by ``j`` strides bit for bit (so a raw copy
of the range moves the group) and every range inside the buffer; bytes that hold
no element of the array are padding, owned by no block, and the last group's
range may hold more of it. Addressable means granularity 1. The proof works on
the axes alone (no scan over bytes), so it costs the same for any size.

Example:
    >>> import kvxfer
    >>> g = kvxfer.inspect((512, 4, 2048), "bfloat16", "{2,1,0:T(8,128)(2,1)}")
    >>> g.addressable, g.bytes_per_block, g.padding_factor
    (True, 32768, 2.0)

    A dim that fits inside one sub-tile leaves the rest of the tile as padding;
    each block of s8[128,4] below is four consecutive bytes of one sub-tile:

    >>> g = kvxfer.inspect((128, 4), "int8", "{0,1:T(32,128)(4,1)}")
    >>> g.addressable, g.bytes_per_block, g.physical_bytes
    (True, 4, 4096)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "Layout",
    "LayoutError",
    "SliceGeometry",
    "inspect",
    "require_addressable",
    "dtype_of",
    "dtype_name",
    "short_dtype_name",
]


class LayoutError(ValueError):
    """A layout that is malformed, does not fit its shape, or is not addressable."""


# ---------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------

# XLA's primitive type names, so users can paste shapes like "bf16[512,6144]".
_XLA_DTYPE_NAMES = {
    "pred": "bool",
    "s4": "int4",
    "u4": "uint4",
    "s8": "int8",
    "u8": "uint8",
    "s16": "int16",
    "u16": "uint16",
    "s32": "int32",
    "u32": "uint32",
    "s64": "int64",
    "u64": "uint64",
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
    "f8e4m3b11fnuz": "float8_e4m3b11fnuz",
    "f8e4m3fnuz": "float8_e4m3fnuz",
    "f8e5m2fnuz": "float8_e5m2fnuz",
    "f4e2m1fn": "float4_e2m1fn",
    "fp8": "float8_e4m3fn",
    "int4": "int4",
}
_SHORT_NAMES = {v: k for k, v in _XLA_DTYPE_NAMES.items() if k not in ("fp8", "int4")}
_SUB_BYTE_BITS = {"int4": 4, "uint4": 4, "float4_e2m1fn": 4, "int2": 2, "uint2": 2}


def dtype_of(dtype: Any) -> np.dtype:
    """Returns the numpy dtype for a name (``"bfloat16"``, ``"bf16"``, ``"s8"``) or dtype.

    Raises:
      LayoutError: the name is not a known dtype.
    """
    import jax.numpy as jnp  # ml_dtypes' bfloat16, float8 and int4 come through jax.

    if isinstance(dtype, str):
        dtype = _XLA_DTYPE_NAMES.get(dtype.strip().lower(), dtype.strip())
    try:
        return np.dtype(jnp.dtype(dtype))
    except TypeError as e:
        raise LayoutError(f"Unknown dtype {dtype!r}; expected a name such as "
                          "'bfloat16', 'bf16', 'int8', 'float8_e4m3fn' or 'int4'") from e


def dtype_name(dtype: Any) -> str:
    """The canonical (numpy / ml_dtypes) name of a dtype, e.g. ``"bfloat16"``."""
    return dtype_of(dtype).name


def short_dtype_name(dtype: Any) -> str:
    """XLA's short name of a dtype, e.g. ``"bf16"``, as used in ``bf16[512,6144]``."""
    name = dtype_name(dtype)
    return _SHORT_NAMES.get(name, name)


def natural_bits(dtype: Any) -> int:
    """Bits of one element's value: 4 for int4, 16 for bfloat16."""
    name = dtype_name(dtype)
    return _SUB_BYTE_BITS.get(name, dtype_of(dtype).itemsize * 8)


def shape_text(shape: Sequence[int], dtype: Any, layout: Layout | None = None) -> str:
    """XLA-style text for an array: ``bf16[512,3,2048]{2,0,1:T(8,128)(2,1)}``."""
    text = f"{short_dtype_name(dtype)}[{','.join(str(int(d)) for d in shape)}]"
    return text + (str(layout) if layout is not None else "")


# ---------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------

_ATTR_RE = re.compile(r"\s*(T|E|S)\s*")
_INT_LIST_RE = re.compile(r"\s*\(\s*([^()]*)\)")


def _int_list(text: str, what: str, source: str) -> tuple[int, ...]:
    items = [s.strip() for s in text.split(",")] if text.strip() else []
    out = []
    for s in items:
        if s == "*":
            raise LayoutError(f"Layout {source!r}: combined tile dims ('*') in {what} "
                              "are not supported")
        if not re.fullmatch(r"\d+", s):
            raise LayoutError(f"Layout {source!r}: {what} entry {s!r} is not a "
                              "non-negative integer")
        out.append(int(s))
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """An XLA layout: dim order, tiles, element size and memory space.

    Attributes:
      minor_to_major: logical dims from the most minor physical dim outward
        (XLA's order; JAX's ``major_to_minor`` is its reverse).
      tiles: tiling levels, each a tuple of tile sizes applied to the most minor
        dims of the shape the previous level produced.
      element_size_bits: ``E(n)``; 0 means the dtype's value width (sub-byte types
        packed, as XLA stores them by default).
      memory_space: ``S(n)``; 0 is device memory (``S(5)`` is pinned host on TPU).

    Example:
      >>> str(Layout.parse("{ 2, 0,1 : T(8,128)(2,1) }"))
      '{2,0,1:T(8,128)(2,1)}'
    """

    minor_to_major: tuple[int, ...]
    tiles: tuple[tuple[int, ...], ...] = ()
    element_size_bits: int = 0
    memory_space: int = 0

    def __post_init__(self):
        m2m = tuple(int(d) for d in self.minor_to_major)
        tiles = tuple(tuple(int(t) for t in tile) for tile in self.tiles)
        object.__setattr__(self, "minor_to_major", m2m)
        object.__setattr__(self, "tiles", tiles)
        if sorted(m2m) != list(range(len(m2m))):
            raise LayoutError(f"minor_to_major {list(m2m)} is not a permutation of "
                              f"0..{len(m2m) - 1}")
        for tile in tiles:
            if not tile or any(t < 1 for t in tile):
                raise LayoutError(f"tile {tile} must be a non-empty tuple of positive sizes")
        if self.element_size_bits < 0 or self.element_size_bits > 64:
            raise LayoutError(f"element_size_bits={self.element_size_bits} must be in 0..64")
        if self.memory_space < 0:
            raise LayoutError(f"memory_space={self.memory_space} must be >= 0")

    # -- construction -------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Parses XLA layout text such as ``{1,0:T(8,128)(4,1)S(5)}`` or ``{}``.

        Raises:
          LayoutError: naming the text and what is wrong with it.
        """
        if not isinstance(text, str):
            raise LayoutError(f"Expected layout text (str). Got {text!r} of type {type(text)}")
        s = text.strip()
        if not (s.startswith("{") and s.endswith("}")):
            raise LayoutError(f"Layout {text!r} must be enclosed in braces, e.g. '{{1,0}}'")
        body = s[1:-1]
        dims_text, _, attrs = body.partition(":")
        m2m = _int_list(dims_text, "minor_to_major", text)
        tiles: list[tuple[int, ...]] = []
        element_bits = 0
        memory_space = 0
        pos = 0
        attrs = attrs.strip()
        seen_other = False
        while pos < len(attrs):
            m = _ATTR_RE.match(attrs, pos)
            if not m:
                raise LayoutError(f"Layout {text!r}: cannot parse {attrs[pos:]!r}; "
                                  "expected T(...), E(n) or S(n)")
            kind = m.group(1)
            pos = m.end()
            groups = []
            while True:
                g = _INT_LIST_RE.match(attrs, pos)
                if not g:
                    break
                groups.append(_int_list(g.group(1), f"{kind}(...)", text))
                pos = g.end()
                if kind != "T":
                    break
            if not groups:
                raise LayoutError(f"Layout {text!r}: {kind} must be followed by (...)")
            if kind == "T":
                if tiles or seen_other:
                    raise LayoutError(f"Layout {text!r}: tiles must be written once, "
                                      "before E(n) and S(n)")
                tiles.extend(groups)
            else:
                if len(groups[0]) != 1:
                    raise LayoutError(f"Layout {text!r}: {kind}(...) takes one integer")
                seen_other = True
                if kind == "E":
                    element_bits = groups[0][0]
                else:
                    memory_space = groups[0][0]
            while pos < len(attrs) and attrs[pos].isspace():
                pos += 1
        try:
            return cls(m2m, tuple(tiles), element_bits, memory_space)
        except LayoutError as e:
            raise LayoutError(f"Layout {text!r}: {e}") from None

    @classmethod
    def row_major(cls, rank: int) -> Layout:
        """The default dense layout ``{rank-1,...,1,0}``."""
        return cls(tuple(range(rank - 1, -1, -1)))

    @classmethod
    def of(cls, obj: Any) -> Layout:
        """The layout of a ``jax.Array``, a ``Format`` or a JAX ``Layout``.

        Works with ``compiled.input_formats`` / ``output_formats`` entries too.

        Example:
          >>> import jax.numpy as jnp
          >>> str(Layout.of(jnp.zeros((4, 8))))
          '{1,0}'
        """
        if isinstance(obj, Layout):
            return obj
        if isinstance(obj, str):
            return cls.parse(obj)
        memory_space = 0
        fmt = getattr(obj, "format", None)
        if fmt is not None and hasattr(obj, "shape"):  # a jax.Array
            if getattr(obj, "is_deleted", lambda: False)():
                raise LayoutError("Cannot read the layout of a deleted array")
            obj = fmt
        if hasattr(obj, "layout") and hasattr(obj, "sharding"):  # a Format
            if getattr(obj.sharding, "memory_kind", None) == "pinned_host":
                memory_space = 5
            obj = obj.layout
        if not hasattr(obj, "major_to_minor"):
            raise LayoutError(f"Expected a jax.Array, Format or Layout. Got {obj!r} of "
                              f"type {type(obj)}")
        m2m = tuple(reversed(tuple(obj.major_to_minor)))
        tiling = tuple(tuple(t) for t in (getattr(obj, "tiling", None) or ()))
        bits = int(getattr(obj, "sub_byte_element_size_in_bits", 0) or 0)
        return cls(m2m, tiling, bits, memory_space)

    def to_jax(self):
        """The equivalent ``jax`` layout object (for ``jax.device_put`` with a Format)."""
        from jax.experimental.layout import Layout as JaxLayout

        return JaxLayout(major_to_minor=tuple(reversed(self.minor_to_major)),
                         tiling=self.tiles or None,
                         sub_byte_element_size_in_bits=self.element_size_bits)

    # -- text ---------------------------------------------------------------

    def __str__(self) -> str:
        text = ",".join(str(d) for d in self.minor_to_major)
        attrs = "".join("(" + ",".join(str(t) for t in tile) + ")" for tile in self.tiles)
        if attrs:
            attrs = "T" + attrs
        if self.element_size_bits:
            attrs += f"E({self.element_size_bits})"
        if self.memory_space:
            attrs += f"S({self.memory_space})"
        return "{" + text + (":" + attrs if attrs else "") + "}"

    @property
    def rank(self) -> int:
        return len(self.minor_to_major)

    def geometry(self, shape: Sequence[int], dtype: Any) -> PhysicalGeometry:
        """The physical geometry of ``shape``/``dtype`` stored under this layout.

        Raises:
          LayoutError: the rank does not match, or a sub-tile does not divide the
            tile dims it splits.
        """
        return PhysicalGeometry.build(tuple(int(d) for d in shape), dtype, self)


# ---------------------------------------------------------------------------
# Physical geometry
# ---------------------------------------------------------------------------


# Offsets are int64 bit positions (numpy), so no array may span 2**63 bits or more:
# 1 EiB, far beyond any device, so a larger size is a mistake in the input.
_MAX_INDEX = 2**63 - 1


@dataclasses.dataclass(frozen=True, slots=True)
class Axis:
    """One row-major axis of the final tiled shape: a digit of one logical dim.

    The digit of logical index ``x`` on this axis is ``(x // divisor) % size``.
    ``dim`` is None for the size-1 axes XLA adds when a tile has more dims than
    the shape. ``bounded`` marks the outermost digit of a dim, whose size is
    rounded up (padding) rather than exact.
    """

    dim: int | None
    divisor: int
    size: int
    bounded: bool


@dataclasses.dataclass(frozen=True, slots=True)
class PhysicalGeometry:
    """Where every element of an array lives under a layout.

    Attributes:
      shape: the logical shape.
      dtype: numpy dtype.
      layout: the layout.
      element_bits: storage bits per element (``E(n)`` or the dtype's value width).
      axes: the axes of the final tiled shape, major to minor.
      tiled_shapes: the shape after each tiling level (the first entry is the
        physical shape before tiling, major to minor).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    layout: Layout
    element_bits: int
    axes: tuple[Axis, ...]
    tiled_shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def build(cls, shape: tuple[int, ...], dtype: Any, layout: Layout) -> PhysicalGeometry:
        dt = dtype_of(dtype)
        where = shape_text(shape, dt, layout)
        if any(d < 0 for d in shape):
            raise LayoutError(f"{where}: negative dimension in shape {list(shape)}")
        for d, size in enumerate(shape):
            if size > _MAX_INDEX:
                raise LayoutError(f"{where}: dim {d} has size {size}, beyond what an int64 "
                                  f"index can address (at most {_MAX_INDEX})")
        if layout.rank != len(shape):
            raise LayoutError(f"{where}: layout has rank {layout.rank} (minor_to_major "
                              f"{list(layout.minor_to_major)}) but the shape has rank "
                              f"{len(shape)}")
        storage_bits = dt.itemsize * 8
        # XLA packs sub-byte types by default (XLA:CPU stores int4 packed even when
        # JAX reports sub_byte_element_size_in_bits=0), so 0 means the value width.
        bits = layout.element_size_bits or natural_bits(dt)
        if bits > storage_bits:
            raise LayoutError(f"{where}: E({bits}) is wider than {dt.name}'s {storage_bits} "
                              "storage bits")
        if bits < natural_bits(dt):
            raise LayoutError(f"{where}: E({bits}) is narrower than {dt.name}'s "
                              f"{natural_bits(dt)} value bits")
        if bits < 8 and 8 % bits:
            raise LayoutError(f"{where}: E({bits}) does not divide a byte")
        # Physical axes before tiling, major to minor.
        axes = [Axis(d, 1, max(shape[d], 1) if shape[d] else 0, True)
                for d in reversed(layout.minor_to_major)]
        shapes = [tuple(a.size for a in axes)]
        for tile in layout.tiles:
            k = len(tile)
            if k > len(axes):  # XLA treats missing major dims as size 1.
                axes = [Axis(None, 1, 1, True)] * (k - len(axes)) + axes
            head, tail = axes[:-k], axes[-k:]
            outer, inner = [], []
            for a, t in zip(tail, tile):
                if not a.bounded and a.size % t:
                    raise LayoutError(
                        f"{where}: tile {tile} splits a tile dim of size {a.size} by "
                        f"{t}, which does not divide it")
                outer.append(Axis(a.dim, a.divisor * t, -(-a.size // t), a.bounded))
                inner.append(Axis(a.dim, a.divisor, min(t, a.size) if not a.bounded else t,
                                  False))
            axes = head + outer + inner
            shapes.append(tuple(a.size for a in axes))
        total_bits = math.prod(a.size for a in axes) * bits
        if total_bits > _MAX_INDEX:
            raise LayoutError(
                f"{where}: the physical size, {total_bits} bits ({-(-total_bits // 8)} "
                f"bytes) with padding, is 2**63 bits or more, so bit offsets would overflow "
                f"int64; no device holds that much (2**60 bytes, 1 EiB)")
        return cls(shape, dt, layout, bits, tuple(axes), tuple(shapes))

    # -- sizes --------------------------------------------------------------

    @property
    def final_shape(self) -> tuple[int, ...]:
        """The tiled shape after every tiling level (padding included)."""
        return tuple(a.size for a in self.axes)

    @property
    def num_elements(self) -> int:
        """Elements in the final tiled shape, padding included."""
        return math.prod(self.final_shape)

    @property
    def physical_bytes(self) -> int:
        return -(-self.num_elements * self.element_bits // 8)

    @property
    def logical_bytes(self) -> int:
        return -(-math.prod(self.shape) * natural_bits(self.dtype) // 8)

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """The logical shape padded to what the tiles cover (each dim's digit range)."""
        ext = [1] * len(self.shape)
        for a in self.axes:
            if a.dim is not None:
                ext[a.dim] *= a.size
        return tuple(ext)

    def strides(self) -> tuple[int, ...]:
        """Row-major element strides of the final tiled shape."""
        out, acc = [], 1
        for a in reversed(self.axes):
            out.append(acc)
            acc *= a.size
        return tuple(reversed(out))

    # -- offsets ------------------------------------------------------------

    def element_index(self, index: np.ndarray) -> np.ndarray:
        """Linear element position in the final tiled shape.

        Args:
          index: int array ``[..., rank]`` of logical indices (within the padded shape).

        Returns:
          int64 array ``[...]``.
        """
        index = np.asarray(index, dtype=np.int64)
        if index.shape[-1:] != (len(self.shape),):
            raise LayoutError(f"index has trailing dim {index.shape[-1:]}, expected "
                              f"({len(self.shape)},)")
        out = np.zeros(index.shape[:-1], dtype=np.int64)
        for a, stride in zip(self.axes, self.strides()):
            if a.dim is None or a.size == 1:
                continue
            out += ((index[..., a.dim] // a.divisor) % a.size) * stride
        return out

    def byte_offset(self, index: np.ndarray) -> np.ndarray:
        """Physical byte offset of each logical index (``[..., rank]`` → ``[...]``).

        For sub-byte elements this is the byte holding the element; see
        ``bit_offset`` for the exact position.
        """
        return self.bit_offset(index) // 8

    def bit_offset(self, index: np.ndarray) -> np.ndarray:
        return self.element_index(index) * self.element_bits


# ---------------------------------------------------------------------------
# The addressability proof
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SliceGeometry:
    """The inspector's verdict on one array and block dim.

    Attributes:
      shape, dtype, layout, block_dim: what was inspected (``dtype`` is a name).
      num_blocks: size of the block dim.
      addressable: every block is one contiguous byte range of the same size at a
        fixed stride (granularity 1).
      bytes_per_block: that size, padding included (the stride: block ``b``
        starts at ``b * bytes_per_block``); None when not addressable. The blocks
        may fill less than the buffer when the rest of it is padding.
      granularity: the smallest g such that every aligned group of g consecutive
        blocks is one contiguous byte range of equal size at a fixed stride
        (``num_blocks`` when the layout interleaves everything).
      group_bytes: bytes of one such group (the stride between groups; the whole
        buffer when the granularity is ``num_blocks``).
      physical_bytes: bytes of the whole buffer, padding included.
      logical_bytes: bytes of the values alone.
      padding_factor: physical / logical bytes.
      reason: why the verdict holds, naming the rule that failed if any.
    """

    shape: tuple[int, ...]
    dtype: str
    layout: Layout
    block_dim: int
    num_blocks: int
    addressable: bool
    bytes_per_block: int | None
    granularity: int
    group_bytes: int
    physical_bytes: int
    logical_bytes: int
    padding_factor: float
    reason: str

    @property
    def text(self) -> str:
        return shape_text(self.shape, self.dtype, self.layout)

    def block_offset(self, block: int) -> int:
        """Byte offset of one block (addressable arrays only)."""
        if not self.addressable:
            raise LayoutError(f"{self.text}: block {block} has no single byte offset: "
                              f"{self.reason}")
        if not 0 <= block < self.num_blocks:
            raise LayoutError(f"{self.text}: block {block} out of range "
                              f"[0, {self.num_blocks})")
        return block * self.bytes_per_block

    def as_dict(self) -> dict[str, Any]:
        """The ``kvxfer inspect --json`` object."""
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "layout": str(self.layout),
            "block_dim": self.block_dim,
            "physical_bytes": self.physical_bytes,
            "logical_bytes": self.logical_bytes,
            "addressable": self.addressable,
            "bytes_per_block": self.bytes_per_block,
            "granularity": self.granularity,
            "padding_factor": self.padding_factor,
            "reason": self.reason,
        }

    def __str__(self) -> str:
        verdict = (f"addressable, {self.bytes_per_block} bytes/block" if self.addressable
                   else f"not addressable, granularity {self.granularity}")
        return f"{self.text} block_dim={self.block_dim}: {verdict}"


def _resolve(array_or_shape: Any, dtype: Any, layout: Any) -> tuple[tuple[int, ...], np.dtype,
                                                                     Layout]:
    if hasattr(array_or_shape, "shape") and hasattr(array_or_shape, "dtype"):
        shape = tuple(int(d) for d in array_or_shape.shape)
        dt = dtype_of(dtype if dtype is not None else array_or_shape.dtype)
        if layout is None:
            layout = (Layout.of(array_or_shape) if hasattr(array_or_shape, "format")
                      else Layout.row_major(len(shape)))
    else:
        try:
            shape = tuple(int(d) for d in array_or_shape)
        except TypeError:
            raise LayoutError(f"Expected a jax.Array or a shape. Got {array_or_shape!r} of "
                              f"type {type(array_or_shape)}") from None
        if dtype is None:
            raise LayoutError(f"dtype is required when inspecting a shape ({list(shape)})")
        dt = dtype_of(dtype)
    if layout is None:
        layout = Layout.row_major(len(shape))
    elif isinstance(layout, str):
        layout = Layout.parse(layout)
    elif not isinstance(layout, Layout):
        layout = Layout.of(layout)
    return shape, dt, layout


def inspect(array_or_shape: Any, dtype: Any = None, layout: Any = None, *,
            block_dim: int = 0) -> SliceGeometry:
    """Proves whether each block of an array is one contiguous byte range.

    Args:
      array_or_shape: a ``jax.Array`` (its layout is read unless ``layout`` is
        given) or a shape.
      dtype: required with a shape; overrides the array's dtype otherwise.
      layout: a ``Layout``, XLA layout text, or a JAX layout; default row-major
        (or the array's own layout).
      block_dim: the dim whose indices are blocks.

    Returns:
      A ``SliceGeometry``; a non-addressable array is a verdict, not an error.

    Raises:
      LayoutError: malformed layout, rank mismatch, or a bad ``block_dim``.

    Example:
      >>> g = inspect((512, 6144), "bf16", "{1,0:T(8,128)(2,1)}")
      >>> g.addressable, g.granularity
      (False, 8)
    """
    shape, dt, layout = _resolve(array_or_shape, dtype, layout)
    geo = layout.geometry(shape, dt)
    where = shape_text(shape, dt, layout)
    rank = len(shape)
    if rank == 0:
        raise LayoutError(f"{where}: a scalar has no block dim")
    if not -rank <= block_dim < rank:
        raise LayoutError(f"{where}: block_dim={block_dim} is out of range for rank {rank}")
    block_dim %= rank
    n = shape[block_dim]
    if n == 0:
        raise LayoutError(f"{where}: block dim {block_dim} has size 0")
    return _prove(geo, block_dim, where)


def _axis_name(geo: PhysicalGeometry, a: Axis) -> str:
    if a.bounded:
        tiled = any(b.dim == a.dim and not b.bounded and b.size > 1 for b in geo.axes)
        return (f"the tile count of dim {a.dim}" if tiled else f"dim {a.dim}") + \
            f" (size {a.size})"
    return f"a tile row of dim {a.dim} ({a.size} elements)"


def _padding_note(geo: PhysicalGeometry, a: Axis) -> str:
    if a.dim is None:
        return f"the tile has {a.size} steps along a dim the array lacks, all but one padding"
    n = geo.shape[a.dim]
    return (f"dim {a.dim} has {n} element{'s' * (n != 1)}, so of the {a.size} tile steps of "
            f"{a.divisor} along it only the first holds data")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _nbytes(n: int) -> str:
    return f"{n} byte{'s' * (n != 1)}"


def _holds_data(geo: PhysicalGeometry, a: Axis) -> bool:
    # A digit of dim d with divisor q is non-zero only at indices >= q, so an axis
    # of a dim no larger than its divisor (a dim that fits inside one tile or
    # sub-tile of it) holds only padding and places no element.
    return a.size > 1 and a.dim is not None and geo.shape[a.dim] > a.divisor


def _prove(geo: PhysicalGeometry, block_dim: int, where: str) -> SliceGeometry:
    """The granularity of ``block_dim`` under ``geo``, derived from the axes alone.

    An element's position is ``sum(digit * stride)`` over the axes of the final
    tiled shape; ``pos(r)``, the position of block ``r``'s first element, sums the
    block dim's digits only, and every block holds the same pattern of other-dim
    elements after it. Only axes that hold data matter (``_holds_data``). Groups
    of ``g`` blocks are copies of one another at a stride of ``T`` bytes iff:

    * no group overlaps the next: every block digit below the first other-dim
      axis that holds data lies inside ``g`` (``g`` is a multiple of ``q``, the
      blocks one step of the lowest leading block digit covers);
    * the stride is uniform: ``pos(r) = (r // g) * pos(g) + pos(r % g)``. Where
      padding-only axes sit between two leading block digits (a gap), this holds
      for multiples of the blocks below the top gap, and otherwise only when the
      second and last group stays under one step of the digit above a gap;
    * ``pos(g)`` is a whole number of bytes, and all groups fit in the buffer.
    """
    n = geo.shape[block_dim]
    bits = geo.element_bits
    physical = geo.physical_bytes
    logical = geo.logical_bytes
    padding = physical / logical if logical else 1.0

    def verdict(g: int, group_bytes: int, reason: str) -> SliceGeometry:
        ok = g == 1
        return SliceGeometry(geo.shape, geo.dtype.name, geo.layout, block_dim, n, ok,
                             group_bytes if ok else None, g, group_bytes, physical, logical,
                             padding, reason)

    if n == 1:
        return verdict(1, physical, f"{where}: block dim {block_dim} has one block, the "
                       f"whole buffer of {physical} bytes")
    if 0 in geo.shape:
        return verdict(1, 0, f"{where}: the array holds no elements (dim "
                       f"{geo.shape.index(0)} has size 0); every block is an empty range")
    # (axis position, axis, element stride) of every axis that holds data.
    digits = [(i, a, s) for i, (a, s) in enumerate(zip(geo.axes, geo.strides()))
              if _holds_data(geo, a)]
    lead = next((k for k, (_, a, _) in enumerate(digits) if a.dim != block_dim), len(digits))
    upper = digits[:lead]  # the leading block digits, most significant first
    if not upper:
        return verdict(n, physical, (
            f"{where}: rule 'block dim outermost' failed: {_axis_name(geo, digits[0][1])} "
            f"holds data and is more major than block dim {block_dim}, so every block is "
            f"split across the buffer; granularity is the whole buffer ({n} blocks, "
            f"{physical} bytes)"))
    q = upper[-1][1].divisor
    n_up = _ceil_div(n, q)  # groups of q blocks; h below counts them

    def pos(h: int) -> int:
        return sum(((h // (a.divisor // q)) % a.size) * s for _, a, s in upper)

    # Gaps between consecutive leading digits, as the number of q-groups below each
    # (ascending), with the padding-only axis that opens it.
    gaps: list[tuple[int, Axis]] = []
    for (i, a, s), (j, b, t) in zip(upper, upper[1:]):
        if s != b.size * t:
            filler = next(c for c in geo.axes[i + 1:j] if c.size > 1)
            gaps.insert(0, (a.divisor // q, filler))
    weights = [w for w, _ in gaps]

    def fits(h: int) -> bool:  # whole bytes apart, and every group inside the buffer
        stride_bits = pos(h) * bits
        return stride_bits % 8 == 0 and _ceil_div(n, q * h) * stride_bits <= 8 * physical

    # Multiples of the q-groups below the top gap keep one stride; of those, the
    # smallest whole-bytes one is best (a larger multiple never fits where it fails).
    candidates = []
    top = weights[-1] if weights else 1
    k = 8 // math.gcd(pos(top) * bits, 8)
    if top * k < n_up and fits(top * k):
        candidates.append(top * k)
    # Any other h keeps one stride only when there are two groups and the second
    # stays within one step of the digit above the lowest gap whose weight (high)
    # does not divide h: h in (a * high, n_up), a multiple of the gap below (low).
    for low, high in zip([1] + weights, weights):
        a = _ceil_div(n_up, high) - 1
        if a < 1:
            continue
        e0 = max(1, _ceil_div(_ceil_div(n_up, 2) - a * high, low))  # two groups at most
        for e in range(e0, e0 + 8):  # pos(h) * bits % 8 repeats within 8 steps
            h = a * high + e * low
            if h >= n_up:
                break
            if fits(h):
                candidates.append(h)
                break
    if candidates:
        h = min(candidates)
        g, group_bytes = q * h, pos(h) * bits // 8
    else:
        g, group_bytes = n, physical

    if g == 1:
        skipped = [_padding_note(geo, a) for a in geo.axes[:upper[0][0]]
                   if a.size > 1 and a.dim != block_dim]
        reason = (f"{where}: block dim {block_dim} is the outermost physical dim that holds "
                  f"data; each block is one contiguous range of {_nbytes(group_bytes)}")
        if skipped:
            reason += f" ({'; '.join(skipped)})"
        if n * group_bytes < physical:
            reason += (f"; the blocks fill the first {n * group_bytes} of {physical} bytes, "
                       "the rest is padding")
        return verdict(1, group_bytes, reason)
    failed = []
    if q > 1:
        failed.append(f"rule 'block dim not interleaved' failed: {q} consecutive blocks of "
                      f"dim {block_dim} share each tile, interleaved by "
                      f"{_axis_name(geo, digits[lead][1])}")
    if gaps:
        w, filler = gaps[0]
        failed.append(f"rule 'uniform block stride' failed: {_padding_note(geo, filler)}; "
                      f"that padding lies between digits of block dim {block_dim}, so blocks "
                      f"{q * w - 1} and {q * w} are further apart than their neighbours")
    if not failed and pos(1) * bits % 8:
        failed.append(f"rule 'whole bytes per block' failed: consecutive blocks are "
                      f"{pos(1) * bits} bits apart, so blocks share bytes")
    if not failed:
        failed.append(f"rule 'groups fit the buffer' failed: {n} blocks of "
                      f"{_nbytes(pos(1) * bits // 8)} end past the buffer's {physical} bytes")
    if g < n:
        tail = f"granularity {g} ({_nbytes(group_bytes)} per group)"
    else:
        tail = (f"no smaller group is a whole number of bytes at one stride within the "
                f"buffer, so granularity is the whole buffer ({n} blocks, {physical} bytes)")
    return verdict(g, group_bytes, f"{where}: {'; '.join(failed)}; {tail}")


def require_addressable(array_or_shape: Any, dtype: Any = None, layout: Any = None, *,
                        block_dim: int = 0) -> SliceGeometry:
    """Like ``inspect`` but raises unless every block is one contiguous byte range.

    Raises:
      LayoutError: naming shape, dtype, layout and the rule that failed.

    Example:
      >>> require_addressable((512, 8, 2048), "bf16", "{2,1,0:T(8,128)(2,1)}").bytes_per_block
      32768
    """
    geo = inspect(array_or_shape, dtype, layout, block_dim=block_dim)
    if not geo.addressable:
        raise LayoutError(f"Not addressable per block: {geo.reason}")
    return geo
