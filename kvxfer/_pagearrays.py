"""A class pool held as one host-memory JAX array per page and shard.

For the pinned mover's pure-JAX route (accelerators without a copy engine kvxfer can
drive): an offload's program gathers its pages on the device and hands each page out
as an array in the ``pinned_host`` memory of the shard's device; that array *is* the
page's storage, so no byte is copied on the host to put it in a pool. A load's
program takes the arrays of its pages and moves them to the device itself.

Slot ``s`` holds, per shard, an array of that shard's bytes of the page, its layers
side by side (``[layer 0 | layer 1 | ...]``). Pages are shard-major (what blobs and
stores see: ``SliceClass.shard_range``), so each array is one contiguous range of the
page's bytes: a page is assembled from them, and written back to them, by one copy
per shard, on the host, off the transfer path.
Memory: one page per slot at most, as the plan sizes it, allocated by XLA as pages
arrive (XLA caps its ``pinned_host`` memory: 64 GB by default on GPU).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["PageArrays"]


class _Owned:
    """The bytes of a ready JAX array as numpy sees them, holding the array.

    ``np.asarray(_Owned(a))`` is a writable ``uint8`` view of ``a``'s buffer whose
    ``base`` is this object, so the view (and every slice of it) keeps ``a`` alive: a
    ctypes view made from ``unsafe_buffer_pointer()`` alone keeps nothing alive, and
    writing through it after the array is gone writes freed memory.
    """

    __slots__ = ("array", "__array_interface__")

    def __init__(self, array: jax.Array):
        self.array = array
        self.__array_interface__ = {"data": (array.unsafe_buffer_pointer(), False),
                                    "shape": (array.nbytes,), "typestr": "|u1",
                                    "version": 3}


class PageArrays:
    """Per slot and shard, the ``pinned_host`` array holding a page.

    Args:
      page_bytes: bytes of a page (every layer, every shard).
      shard_ranges: ``shard_ranges[pos][shard]``: where that shard of layer ``pos``
        lies in the page's bytes; a shard's layers must lie side by side, in layer
        order (shard-major pages), so its array is one range of the page.
      num_slots: slots of the pool.
      devices: the device of each shard (whose ``pinned_host`` memory holds its part).
      word: the bytes of the words the arrays hold (``hostpool.word_bytes``).
    """

    def __init__(self, page_bytes: int, shard_ranges: Sequence[Sequence[tuple[int, int]]],
                 num_slots: int, devices: Sequence[Any], word: int):
        self.page_bytes = page_bytes
        self.ranges = [list(r) for r in shard_ranges]
        self.devices = list(devices)
        self.word = word
        self.dtype = np.dtype(f"u{word}")
        kinds = [{m.kind for m in d.addressable_memories()} for d in self.devices]
        self.shardings = [jax.sharding.SingleDeviceSharding(
            d, memory_kind="pinned_host" if "pinned_host" in k else None)
            for d, k in zip(self.devices, kinds)]
        # Where each shard's part of a page (every layer's block of that shard) lies.
        self.spans = [(self.ranges[0][s][0], self.ranges[-1][s][1])
                      for s in range(len(self.devices))]
        for s, (lo, _) in enumerate(self.spans):
            ends = [lo] + [r[s][1] for r in self.ranges[:-1]]
            if [r[s][0] for r in self.ranges] != ends:
                raise ValueError(f"shard {s}'s layers are not side by side in a page "
                                 f"(ranges {[tuple(r[s]) for r in self.ranges]}); a page "
                                 "array holds one shard-major range")
        self.shard_bytes = [hi - lo for lo, hi in self.spans]
        self._arrays: list[list[jax.Array] | None] = [None] * num_slots
        self._views: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    @property
    def num_slots(self) -> int:
        return len(self._arrays)

    @property
    def nbytes(self) -> int:
        """The bytes the plan gives the pool (pages arrive as they are written)."""
        return self.num_slots * self.page_bytes

    def put(self, slot: int, arrays: Sequence[jax.Array]) -> None:
        """Makes ``arrays`` (one per shard) the storage of ``slot``'s page."""
        arrays = list(arrays)
        for s, a in enumerate(arrays):
            if a.nbytes != self.shard_bytes[s]:
                raise ValueError(f"shard {s} of a page is {self.shard_bytes[s]} bytes; "
                                 f"an array of {a.nbytes} bytes cannot hold it")
        with self._lock:
            self._arrays[slot] = arrays
            self._views.pop(slot, None)

    def get(self, slot: int) -> list[jax.Array]:
        """The arrays holding ``slot``'s page, one per shard.

        Raises:
          KeyError: the slot never held a page of this class.
        """
        arrays = self._arrays[slot]
        if arrays is None:
            raise KeyError(f"host slot {slot} holds no page of this slice class")
        return arrays

    def _shard_views(self, slot: int) -> list[np.ndarray]:
        # Writable views of the arrays' own buffers (np.asarray would give read-only
        # copies where it caches). Each view holds its array (``_Owned``), so a view
        # taken before the slot got new arrays, or was freed, never outlives its bytes.
        with self._lock:
            views = self._views.get(slot)
            if views is not None:
                return views
        arrays = self.get(slot)
        views = [np.asarray(_Owned(a)) for a in jax.block_until_ready(arrays)]
        with self._lock:
            if self._arrays[slot] is arrays:
                self._views[slot] = views
        return views

    def shard_view(self, slot: int, pos: int, shard: int) -> np.ndarray:
        """A writable view of one shard of layer ``pos`` of ``slot``'s page."""
        lo, hi = self.ranges[pos][shard]
        start = lo - self.spans[shard][0]
        return self._shard_views(slot)[shard][start:start + hi - lo]

    def read(self, slot: int) -> np.ndarray:
        """``slot``'s page in its byte order (a new array)."""
        out = np.empty(self.page_bytes, dtype=np.uint8)
        for (lo, hi), view in zip(self.spans, self._shard_views(slot)):
            out[lo:hi] = view
        return out

    def write(self, slot: int, data: np.ndarray) -> None:
        """Stores a page given in its byte order as new arrays of ``slot``."""
        data = np.asarray(data, dtype=np.uint8).reshape(-1)
        if data.size != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes; {data.size} were given")
        arrays = [jax.device_put(np.array(data[lo:hi]).view(self.dtype), sharding)
                  for (lo, hi), sharding in zip(self.spans, self.shardings)]
        self.put(slot, arrays)
