"""Emulated TPU device memory: physical byte images of arrays under any layout.

XLA:CPU accepts tiled layouts but stores arrays row-major, so tiles cannot be
tested against real CPU buffers. This module builds the byte image an array
would have in TPU HBM under a layout (tile-interleaved, padded, sub-byte packed),
inverts it, and copies raw byte ranges between an image and host memory the way
a DMA engine would.

The image is built by literal reshape/transpose tiling (openxla/xla
``docs/tiled_layout.md``) and read back through ``PhysicalGeometry`` offsets; the
two are independent, so a round trip checks both.

Example:
    >>> import numpy as np
    >>> from kvxfer import emulate
    >>> x = np.arange(16 * 3, dtype=np.int8).reshape(16, 3)
    >>> img = emulate.to_image(x, "{1,0:T(8,128)(4,1)}")
    >>> img.nbytes, bool((emulate.from_image(img, x.shape, x.dtype, "{1,0:T(8,128)(4,1)}") == x).all())
    (2048, True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer.layout import (
    Layout,
    LayoutError,
    PhysicalGeometry,
    SliceGeometry,
    dtype_of,
    inspect,
    shape_text,
)

__all__ = ["to_image", "from_image", "EmulatedBuffer", "read_blocks", "write_blocks",
           "naive_bytes_per_block"]


def _as_layout(layout: Any, rank: int) -> Layout:
    if layout is None:
        return Layout.row_major(rank)
    return layout if isinstance(layout, Layout) else Layout.of(layout)


def _raw_uint(x: np.ndarray) -> np.ndarray:
    """The array's bits as unsigned integers of the same width."""
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Element bit patterns (flat, row-major physical order) to bytes, XLA style.

    Sub-byte elements are packed starting at the least significant bits of each
    byte; wider elements are stored little-endian.
    """
    if bits >= 8:
        return np.ascontiguousarray(values).view(np.uint8)
    per = 8 // bits
    v = (values.astype(np.uint8) & ((1 << bits) - 1))
    v = np.pad(v, (0, (-len(v)) % per)).reshape(-1, per)
    shifts = (np.arange(per, dtype=np.uint8) * bits)
    return np.bitwise_or.reduce(v << shifts, axis=1).astype(np.uint8)


def _unpack(image: np.ndarray, bits: int, count: int, storage: np.dtype) -> np.ndarray:
    if bits >= 8:
        return image[: count * bits // 8].view(storage)
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits)
    v = (image[:, None] >> shifts) & ((1 << bits) - 1)
    return v.reshape(-1)[:count].astype(storage)


def _tile(arr: np.ndarray, tile: tuple[int, ...]) -> np.ndarray:
    k = len(tile)
    if k > arr.ndim:
        arr = arr.reshape((1,) * (k - arr.ndim) + arr.shape)
    lead = arr.ndim - k
    pad = [(0, 0)] * lead + [(0, (-s) % t) for s, t in zip(arr.shape[lead:], tile)]
    arr = np.pad(arr, pad)
    split = list(arr.shape[:lead])
    for s, t in zip(arr.shape[lead:], tile):
        split += [s // t, t]
    arr = arr.reshape(split)
    order = list(range(lead)) + [lead + 2 * j for j in range(k)] + \
        [lead + 2 * j + 1 for j in range(k)]
    return arr.transpose(order)


def to_image(x: np.ndarray, layout: Any = None) -> np.ndarray:
    """The physical byte image of ``x`` under ``layout`` (padding is zero).

    Args:
      x: a numpy array of any dtype (bfloat16, float8 and int4 included).
      layout: ``Layout`` or XLA text; default row-major.

    Returns:
      uint8 array of ``physical_bytes``.
    """
    x = np.asarray(x)
    layout = _as_layout(layout, x.ndim)
    geo = layout.geometry(x.shape, x.dtype)
    arr = _raw_uint(x).transpose(tuple(reversed(layout.minor_to_major)))
    for tile in layout.tiles:
        arr = _tile(arr, tile)
    flat = np.ascontiguousarray(arr).reshape(-1)
    if geo.element_bits < 8 * x.dtype.itemsize:
        image = _pack(flat, geo.element_bits)
    else:
        image = flat.view(np.uint8)
    assert image.nbytes == geo.physical_bytes, (image.nbytes, geo.physical_bytes)
    return image.copy()


def from_image(image: np.ndarray, shape: Sequence[int], dtype: Any,
               layout: Any = None) -> np.ndarray:
    """Reads an array back from its physical byte image (inverse of ``to_image``)."""
    dt = dtype_of(dtype)
    shape = tuple(int(d) for d in shape)
    layout = _as_layout(layout, len(shape))
    geo = layout.geometry(shape, dt)
    image = np.asarray(image, dtype=np.uint8).reshape(-1)
    if image.nbytes != geo.physical_bytes:
        raise LayoutError(f"{shape_text(shape, dt, layout)}: image has {image.nbytes} "
                          f"bytes, expected {geo.physical_bytes}")
    storage = np.dtype(f"u{dt.itemsize}")
    elems = _unpack(image, geo.element_bits, geo.num_elements, storage)
    index = np.indices(shape, dtype=np.int64).reshape(len(shape), -1).T
    out = elems[geo.element_index(index)]
    return out.view(dt).reshape(shape)


def naive_bytes_per_block(geo: SliceGeometry) -> int:
    """The slice size a layout-blind manager derives: physical bytes / blocks."""
    return geo.physical_bytes // geo.num_blocks


def _ranges(geo: SliceGeometry, block_ids: Sequence[int], bypass_guard: bool
            ) -> tuple[np.ndarray, int]:
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if not bypass_guard and not geo.addressable:
        raise LayoutError(f"Direct copy refused: {geo.reason}")
    if ids.size and (ids.min() < 0 or ids.max() >= geo.num_blocks):
        bad = ids[(ids < 0) | (ids >= geo.num_blocks)][0]
        raise LayoutError(f"{geo.text}: block id {bad} out of range [0, {geo.num_blocks})")
    size = geo.bytes_per_block if geo.addressable else naive_bytes_per_block(geo)
    return ids * size, size


def read_blocks(image: np.ndarray, geo: SliceGeometry, block_ids: Sequence[int], *,
                bypass_guard: bool = False) -> np.ndarray:
    """Raw DMA reads: the byte range of each block, as ``uint8[len(ids), bytes]``.

    Args:
      image: the device image (``to_image``).
      geo: the inspector's verdict for that array.
      block_ids: blocks to read, any order.
      bypass_guard: read even when the layout is not addressable, with the naive
        slice formula (for demonstrating corruption only).

    Raises:
      LayoutError: the array is not addressable (unless bypassed), or an id is out
        of range.
    """
    starts, size = _ranges(geo, block_ids, bypass_guard)
    idx = starts[:, None] + np.arange(size, dtype=np.int64)[None, :]
    return image[idx]


def write_blocks(image: np.ndarray, geo: SliceGeometry, block_ids: Sequence[int],
                 data: np.ndarray, *, bypass_guard: bool = False) -> None:
    """Raw DMA writes of ``data[i]`` into the byte range of ``block_ids[i]`` (in place)."""
    starts, size = _ranges(geo, block_ids, bypass_guard)
    data = np.asarray(data, dtype=np.uint8).reshape(len(starts), -1)
    if data.shape[1] != size:
        raise LayoutError(f"{geo.text}: {data.shape[1]} bytes per block given, expected "
                          f"{size}")
    idx = starts[:, None] + np.arange(size, dtype=np.int64)[None, :]
    image[idx] = data


@dataclasses.dataclass
class EmulatedBuffer:
    """One array held in emulated TPU memory: its image plus what it is.

    Each row of f32[8,4] under ``T(8,128)`` is one tile row, padded to 128
    elements: the blocks are addressable at 512 bytes each.

    Example:
      >>> import numpy as np
      >>> buf = EmulatedBuffer.from_array(np.zeros((8, 4), np.float32), "{1,0:T(8,128)}")
      >>> buf.geometry.addressable, buf.geometry.bytes_per_block, buf.image.nbytes
      (True, 512, 4096)
    """

    image: np.ndarray
    shape: tuple[int, ...]
    dtype: np.dtype
    layout: Layout
    block_dim: int = 0

    @classmethod
    def from_array(cls, x: np.ndarray, layout: Any = None, block_dim: int = 0
                   ) -> EmulatedBuffer:
        x = np.asarray(x)
        layout = _as_layout(layout, x.ndim)
        return cls(to_image(x, layout), tuple(x.shape), x.dtype, layout, block_dim)

    @property
    def geometry(self) -> SliceGeometry:
        return inspect(self.shape, self.dtype, self.layout, block_dim=self.block_dim)

    @property
    def physical(self) -> PhysicalGeometry:
        return self.layout.geometry(self.shape, self.dtype)

    def to_array(self) -> np.ndarray:
        return from_image(self.image, self.shape, self.dtype, self.layout)

    def read_blocks(self, block_ids: Sequence[int], *, bypass_guard: bool = False
                    ) -> np.ndarray:
        return read_blocks(self.image, self.geometry, block_ids, bypass_guard=bypass_guard)

    def write_blocks(self, block_ids: Sequence[int], data: np.ndarray, *,
                     bypass_guard: bool = False) -> None:
        write_blocks(self.image, self.geometry, block_ids, data, bypass_guard=bypass_guard)
