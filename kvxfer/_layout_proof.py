"""The per-block addressability proof: ``inspect``, ``require_addressable``, ``SliceGeometry``.

Whether one index of the block dim (a KV block) is one contiguous byte range of an
array under its layout, and if not, the granularity: the smallest number of
consecutive blocks that is, proven from the physical axes alone
(``kvxfer.layout`` states the rule; this module holds the proof).

Example:
    >>> g = inspect((512, 6144), "bf16", "{1,0:T(8,128)(2,1)}")
    >>> g.addressable, g.granularity
    (False, 8)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from kvxfer._layout_dtypes import LayoutError, dtype_of
from kvxfer._layout_geometry import Axis, Layout, PhysicalGeometry, shape_text

__all__ = ["SliceGeometry", "inspect", "require_addressable"]


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
