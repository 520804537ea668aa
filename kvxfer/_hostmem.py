"""Host memory that copy engines read and write directly, allocated outside XLA.

A class pool the DMA mover copies into lives in an anonymous mapping of its own:
page-aligned and zero-filled, bound to the NUMA node the device is attached to (where
the platform says which) before any page is touched, backed by transparent huge pages
where the kernel allows, and page-locked by the copy engine (``cuMemHostRegister`` on
CUDA, portable across the machine's GPUs) so transfers go straight to and from it. A
page-locked pool is not inherited by forked children (``MADV_DONTFORK``), so a fork
can never move the pages a DMA targets.
XLA's ``pinned_host`` memory kind is none of these: on GPU its pool is capped (64 GB by
default) and allocated on NUMA node 0.

Example:
    >>> mem = HostMemory(1 << 20)
    >>> view = mem.view()
    >>> view.nbytes, int(view.max()), mem.address % mmap.PAGESIZE
    (1048576, 0, 0)
    >>> mem.close()
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import platform
import threading
import weakref
from collections.abc import Callable

import numpy as np

__all__ = ["HostMemory", "Pin", "bind_numa"]

log = logging.getLogger("kvxfer")

Pin = Callable[[int, int], Callable[[], None]]
"""``pin(address, nbytes) -> unpin``: page-locks a range for a copy engine; ``unpin()``
undoes it. Raises when the range cannot be locked."""

# mbind(2): the syscall number per architecture, and the policy that prefers a node
# (falling back to others when it is full, as an engine's host RAM may be).
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}
_MPOL_PREFERRED = 1
_MASK_LONGS = 16  # nodes 0..1023


def bind_numa(address: int, nbytes: int, node: int) -> str | None:
    """Asks the kernel to place the pages of a range on NUMA ``node`` (preferred).

    Call before the pages are first touched. Returns None on success, else why not
    (no ``mbind`` on this architecture, or the kernel refused: no NUMA, a container
    without the permission).

    Example:
        >>> bind_numa(0, 0, -1)
        'NUMA node -1 is not a node'
    """
    if not 0 <= node < 64 * _MASK_LONGS:
        return f"NUMA node {node} is not a node"
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        return f"no mbind syscall number known for {platform.machine()}"
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    mask = (ctypes.c_ulong * _MASK_LONGS)()
    mask[node // 64] = 1 << (node % 64)
    # The kernel reads maxnode - 1 bits of the mask.
    rc = libc.syscall(ctypes.c_long(number), ctypes.c_void_p(address),
                      ctypes.c_ulong(nbytes), ctypes.c_int(_MPOL_PREFERRED), mask,
                      ctypes.c_ulong(64 * _MASK_LONGS + 1), ctypes.c_uint(0))
    if rc != 0:
        err = ctypes.get_errno()
        return f"mbind refused: {os.strerror(err)} (errno {err})"
    return None


class HostMemory:
    """``nbytes`` of zeroed, page-aligned host memory mapped outside XLA.

    Args:
      nbytes: the size (0 gives an empty region, address 0).
      numa_node: the NUMA node to place the pages on (None: the kernel's default).
        Placement is a preference; ``numa_node`` reports what was applied.
      pin: a copy engine's page-locking (``Pin``); None leaves the memory pageable.

    Attributes:
      address: the first byte's address.
      nbytes: the size.
      numa_node: the node the pages were bound to, or None (not asked, or refused).
      pinned: whether a copy engine page-locked the memory.

    Raises:
      MemoryError: the mapping failed.
      Exception: whatever ``pin`` raised (the mapping is released first).
    """

    def __init__(self, nbytes: int, *, numa_node: int | None = None, pin: Pin | None = None):
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        self.nbytes = int(nbytes)
        self.numa_node: int | None = None
        self._lock = threading.Lock()
        if not self.nbytes:
            self._view = np.zeros(0, dtype=np.uint8)
            self.address = 0
            self.pinned = False
            self._finalizer = weakref.finalize(self, lambda: None)
            return
        try:
            mapping = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError) as e:
            raise MemoryError(f"could not map {self.nbytes} bytes of host memory: {e}") from e
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mapping.madvise(mmap.MADV_HUGEPAGE)  # fewer TLB misses on every copy
            except OSError:
                pass
        self._view = np.frombuffer(mapping, dtype=np.uint8)
        self.address = int(self._view.ctypes.data)
        if numa_node is not None:
            why = bind_numa(self.address, self.nbytes, numa_node)
            if why is None:
                self.numa_node = numa_node
            else:
                log.info("host memory of %d bytes not bound to NUMA node %d: %s",
                         self.nbytes, numa_node, why)
        if pin is not None and hasattr(mmap, "MADV_DONTFORK"):
            # A forked child must not share pages a copy engine writes: copy-on-write
            # would move the parent's pages while DMA still targets the old ones.
            mapping.madvise(mmap.MADV_DONTFORK)
        unpin = pin(self.address, self.nbytes) if pin is not None else None
        self.pinned = unpin is not None
        # The mapping lives as long as any view of it; the pin ends with this object
        # (or close()), before the memory can be unmapped.
        self._finalizer = weakref.finalize(self, unpin if unpin is not None else lambda: None)

    def view(self) -> np.ndarray:
        """A writable ``uint8[nbytes]`` view of the memory (no copy)."""
        return self._view

    def close(self) -> None:
        """Ends the pin now (idempotent); the mapping goes once no view remains."""
        self._finalizer()

    def __repr__(self) -> str:
        where = "" if self.numa_node is None else f", NUMA node {self.numa_node}"
        return (f"HostMemory({self.nbytes} bytes at {self.address:#x}"
                f"{', pinned' if self.pinned else ''}{where})")
