"""An XLA layout (``Layout``) and where it puts every element (``PhysicalGeometry``).

``Layout`` parses and prints XLA's layout text (``{2,0,1:T(8,128)(2,1)}``) and reads
the layout of a ``jax.Array`` or ``Format``. ``Layout.geometry(shape, dtype)`` turns
it into the *physical axes* of the final tiled shape, each one a digit of exactly
one logical dim (openxla/xla ``docs/tiled_layout.md``), from which every element's
byte offset and the physical size follow.

Example:
    >>> geo = Layout.parse("{1,0:T(8,128)}").geometry((16, 128), "float32")
    >>> geo.final_shape, int(geo.byte_offset([[8, 0]])[0])
    ((2, 1, 8, 128), 4096)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer._layout_dtypes import LayoutError, dtype_of, natural_bits, short_dtype_name

__all__ = ["Layout", "shape_text", "Axis", "PhysicalGeometry"]


def shape_text(shape: Sequence[int], dtype: Any, layout: Layout | None = None) -> str:
    """XLA-style text for an array: ``bf16[512,3,2048]{2,0,1:T(8,128)(2,1)}``."""
    text = f"{short_dtype_name(dtype)}[{','.join(str(int(d)) for d in shape)}]"
    return text + (str(layout) if layout is not None else "")


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
