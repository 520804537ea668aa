"""A class pool as one ``pinned_host`` array with a pinned, slot-major layout (TPU).

The pinned mover's in-place route writes each page into its slot with one
dynamic-update-slice and reads it back with one dynamic-slice. On TPU these compile to
one DMA per page at pool + slot x slot bytes (``dynamic-update-slice-start/done`` on
``S(5)``), but only when a slot is one contiguous range of the pool: the compiler's
own choice for a ``u32[slots, words]`` array tiles 8 slots together (``T(8,128)``),
and for ``u32[S, 2196, 128]`` moved the slot dim inside (``{2,0,1}``). So the pool is
``uint32[slots, rows, 128]`` with its layout pinned to ``{2,1,0:T(8,128)}`` and
``rows`` a multiple of 8: a slot is ``rows`` whole tiles, one range of
``rows * 512`` bytes, which ``kvxfer.inspect`` proves for the array as allocated
(``SlotPool`` refuses a layout that does not give it). A page (``page_bytes``,
shard-major, kvxfer's page format) fills the start of its slot; the rest of the slot
is padding (under 4 KiB), never read. Byte for byte the tiled slot is the row-major
one (a tile is 128 whole words wide), so the host reads a page at slot x slot bytes.

The same pool runs on XLA:CPU, where tests check the route byte for byte
(``TILED_POOL_PLATFORMS`` names where the mover takes it by default).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvxfer._pagearrays import PageArrays
from kvxfer.hostpool import PoolError
from kvxfer.layout import Layout, inspect
from kvxfer.plan import SliceClass

__all__ = ["SlotGeometry", "SlotPool", "slot_geometry", "slot_format", "aliasing_refusal",
           "tiled_pool",
           "TILED_POOL_PLATFORMS", "SLOT_LANES", "SLOT_SUBLANES"]

#: Backends whose pinned in-place pool is a ``SlotPool`` (a pinned, tiled, slot-major
#: layout); elsewhere the pool is ``ClassPool``'s own ``[slots, words]`` array.
TILED_POOL_PLATFORMS = frozenset({"tpu"})

def tiled_pool(platform: str) -> bool:
    """Whether the pinned in-place pool on ``platform`` is a ``SlotPool`` (and its
    programs gather pages per layer first, as on TPU): ``TILED_POOL_PLATFORMS``.

    Example:
        >>> tiled_pool("tpu"), tiled_pool("cpu")
        (True, False)
    """
    return platform in TILED_POOL_PLATFORMS


#: A slot's rows are this many words wide (a TPU tile's lanes) ...
SLOT_LANES = 128
#: ... and a slot holds a multiple of this many rows (a 32-bit tile's sublanes).
SLOT_SUBLANES = 8


@dataclasses.dataclass(frozen=True, slots=True)
class SlotGeometry:
    """Where pages live in a slot-major pool of 32-bit words.

    Attributes:
      num_slots: slots of the pool.
      page_bytes: bytes of one page (every layer, every shard).
      rows: rows of ``SLOT_LANES`` words a slot holds (a multiple of ``SLOT_SUBLANES``).

    Example:
        >>> g = SlotGeometry(num_slots=4, page_bytes=192, rows=8)
        >>> g.shape, g.slot_bytes, str(g.layout)
        ((4, 8, 128), 4096, '{2,1,0:T(8,128)}')
    """

    num_slots: int
    page_bytes: int
    rows: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """The pool array's shape, ``uint32``."""
        return (self.num_slots, self.rows, SLOT_LANES)

    @property
    def slot_bytes(self) -> int:
        """Bytes from one slot to the next (the page, padded to whole tiles)."""
        return self.rows * SLOT_LANES * 4

    @property
    def layout(self) -> Layout:
        """The pinned layout: slot dim outermost, 8 x 128-word tiles."""
        return Layout((2, 1, 0), ((SLOT_SUBLANES, SLOT_LANES),))


def slot_geometry(cls: SliceClass, num_slots: int) -> SlotGeometry:
    """The slot-major pool of ``num_slots`` pages of ``cls``.

    Example:
        >>> from kvxfer.plan import LayerSpec, make_plan
        >>> plan = make_plan([LayerSpec("L0", (8, 2, 8), "float32")], num_host_blocks=3)
        >>> slot_geometry(plan.classes[0], 3)
        SlotGeometry(num_slots=3, page_bytes=64, rows=8)
    """
    words = -(-cls.page_bytes // 4)
    rows = -(-words // (SLOT_LANES * SLOT_SUBLANES)) * SLOT_SUBLANES
    return SlotGeometry(num_slots, cls.page_bytes, max(rows, SLOT_SUBLANES))


@functools.lru_cache(maxsize=32)
def _zeros(shape: tuple[int, ...], sharding: Any) -> Any:
    return jax.jit(lambda: jnp.zeros(shape, jnp.uint32), out_shardings=sharding)


def slot_format(geometry: SlotGeometry, device: Any) -> Any:
    """The pool's sharding with its layout pinned (``jax.experimental.layout.Format``)."""
    from jax.experimental.layout import Format

    return Format(geometry.layout.to_jax(),
                  jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))


def _touch(pool: jax.Array, count: jax.Array) -> jax.Array:
    # The in-place programs' own form: a loop of whole-slot dynamic-update-slices of
    # the donated pool, ``count`` of them (0: nothing written).
    def body(j, p):
        return jax.lax.dynamic_update_slice(p, jnp.zeros((1, *p.shape[1:]), p.dtype),
                                            (j, 0, 0))
    return jax.lax.fori_loop(0, count, body, pool)


@functools.lru_cache(maxsize=16)
def _toucher(where: Any) -> Any:
    return jax.jit(_touch, donate_argnums=0, in_shardings=(where, None), out_shardings=where)


def pool_aliases(array: jax.Array) -> bool:
    """Whether a program that donates the slot-major pool ``array`` and writes it in place
    returns the same buffer (checked by running one that writes nothing).

    The array is donated: use what ``array`` was only through the buffer's address.
    """
    before = array.unsafe_buffer_pointer()
    out = _toucher(array.format)(array, np.int32(0))
    out.block_until_ready()
    return out.unsafe_buffer_pointer() == before


@functools.lru_cache(maxsize=64)
def aliasing_refusal(device: Any) -> str | None:
    """Why a slot-major pool on ``device`` cannot be updated in place, or None.

    Runs, once per device and process, a program that donates a small slot-major pool
    and writes it in place, and compares the buffers before and after: where the
    runtime does not alias the donated pool, XLA would copy the whole pool through
    device memory on every transfer, and the pages written would not reach the host
    bytes the pool's views read.
    """
    try:
        g = SlotGeometry(2, 4, SLOT_SUBLANES)
        array = _zeros(g.shape, slot_format(g, device))()
        if not pool_aliases(array):
            return (f"the runtime did not alias a donated pinned_host pool on {device} "
                    "(the buffer changed across a program that writes it in place)")
    except Exception as e:  # noqa: BLE001 - XLA's errors carry no common type
        text = str(e).strip().splitlines()
        return f"a slot-major pinned_host pool on {device} failed: " \
            f"{text[0] if text else type(e).__name__}"
    return None


class SlotPool(PageArrays):
    """One class's pages in one slot-major ``pinned_host`` array (see the module doc).

    A ``PageArrays`` to ``ClassPool`` (a pool of one shard's pages on one device): the
    host reads and writes pages through ``shard_view``, ``read`` and ``write``; the
    mover's programs take ``array`` (donated) and hand what they return to ``swap``.

    Args:
      cls: the slice class (one shard).
      num_slots: slots of the pool.
      device: the device whose ``pinned_host`` memory holds the pool.

    Raises:
      PoolError: the array's layout does not make a slot one contiguous range of
        ``slot_bytes`` (the compiler or runtime did not keep the pinned layout).
    """

    def __init__(self, cls: SliceClass, num_slots: int, device: Any):
        if cls.num_shards != 1:
            raise ValueError(f"a slot pool holds one shard's pages; {cls.name} has "
                             f"{cls.num_shards} shards")
        super().__init__(cls.page_bytes, [[cls.shard_range(pos, 0)] for pos in
                                          range(len(cls.layers))], num_slots, [device], 4)
        self.geometry = slot_geometry(cls, num_slots)
        self.name = cls.name
        refused = aliasing_refusal(device)
        if refused is not None:
            raise PoolError(f"no in-place pool for {cls.name}: {refused}")
        array = _zeros(self.geometry.shape, slot_format(self.geometry, device))()
        array.block_until_ready()
        got = Layout.of(array)
        proof = inspect(array.shape, array.dtype, got)
        if not proof.addressable or proof.bytes_per_block != self.geometry.slot_bytes:
            raise PoolError(f"the pool of {cls.name} came out {got} ({proof.reason or ''}): "
                            f"a slot is not one range of {self.geometry.slot_bytes} bytes; "
                            f"expected {self.geometry.layout}")
        self._array = array
        self.address = array.unsafe_buffer_pointer()
        # The buffer outlives every array over it: each program that writes the pool
        # donates it and returns it (``swap`` checks), so the view stays valid.
        raw = (ctypes.c_uint8 * array.nbytes).from_address(self.address)
        self._flat = np.ctypeslib.as_array(raw).reshape(num_slots, self.geometry.slot_bytes)

    @property
    def array(self) -> Any:
        """The array over the pool's buffer now (donated by every program that writes it)."""
        return self._array

    def swap(self, new: Any) -> None:
        """Takes ``new`` (what a program that donated ``array`` returned) as the pool.

        Raises:
          PoolError: ``new`` is another buffer (the runtime did not alias the donated
            pool: the pages it wrote would not reach the host bytes), naming both.
        """
        if new.shape != self._array.shape or new.dtype != self._array.dtype:
            raise PoolError(f"pool array {new.dtype}{list(new.shape)} replaces "
                            f"{self._array.dtype}{list(self._array.shape)}")
        pointer = new.unsafe_buffer_pointer()
        if pointer != self.address:
            raise PoolError(f"the program did not update the pinned pool of {self.name} in "
                            f"place (buffer {pointer:#x}, pool {self.address:#x}): the "
                            "runtime did not alias the donated pool")
        self._array = new

    @property
    def physical_bytes(self) -> int:
        """The pool's bytes with each slot's padding."""
        return self._flat.nbytes

    def put(self, slot: int, arrays: Any) -> None:
        raise TypeError("a slot pool's pages are written by the mover's programs in place")

    def get(self, slot: int) -> Any:
        raise TypeError("a slot pool's pages are read by the mover's programs in place")

    def _shard_views(self, slot: int) -> list[np.ndarray]:
        return [self._flat[slot, :self.page_bytes]]

    def write(self, slot: int, data: np.ndarray) -> None:
        data = np.asarray(data, dtype=np.uint8).reshape(-1)
        if data.size != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes; {data.size} were given")
        self._flat[slot, :self.page_bytes] = data
