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

The layout's rooms, re-exported here: ``kvxfer._layout_dtypes`` (dtype names and
``LayoutError``), ``kvxfer._layout_geometry`` (``Layout`` and ``PhysicalGeometry``),
``kvxfer._layout_proof`` (``inspect``, ``require_addressable``, ``SliceGeometry``).

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

from kvxfer._layout_dtypes import LayoutError as LayoutError
from kvxfer._layout_dtypes import dtype_name as dtype_name
from kvxfer._layout_dtypes import dtype_of as dtype_of
from kvxfer._layout_dtypes import natural_bits as natural_bits
from kvxfer._layout_dtypes import short_dtype_name as short_dtype_name
from kvxfer._layout_geometry import Axis as Axis
from kvxfer._layout_geometry import Layout as Layout
from kvxfer._layout_geometry import PhysicalGeometry as PhysicalGeometry
from kvxfer._layout_geometry import shape_text as shape_text
from kvxfer._layout_proof import SliceGeometry as SliceGeometry
from kvxfer._layout_proof import inspect as inspect
from kvxfer._layout_proof import require_addressable as require_addressable

__all__ = [
    "Layout",
    "LayoutError",
    "SliceGeometry",
    "inspect",
    "require_addressable",
    "dtype_of",
    "dtype_name",
    "short_dtype_name",
    "natural_bits",
    "shape_text",
    "Axis",
    "PhysicalGeometry",
]
