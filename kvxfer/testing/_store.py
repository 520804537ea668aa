"""Faults at rest in a store tier: damage a stored page the way a disk or a network does."""

from __future__ import annotations

import numpy as np

from kvxfer.manager import first_span
from kvxfer.store import Store

__all__ = ["flip_stored_bit"]


def flip_stored_bit(store: Store, key: str, bit: int | None = None, *, seed: int = 0) -> int:
    """Flips one bit of a stored page's bytes (past its headers), in place at rest.

    The blob keeps its framing, so it imports as a whole page: only the digest
    check on the device, at load, can find the flip.

    Returns:
      The bit index flipped within the page bytes of the blob's first slice class.

    Raises:
      KeyError: nothing is stored under ``key``.
    """
    blob = store.get(key)
    if blob is None:
        raise KeyError(f"no page stored under {key!r} in the {store.name} store")
    start, end = first_span(blob)
    if bit is None:
        bit = int(np.random.default_rng(seed).integers(0, (end - start) * 8))
    if not 0 <= bit < (end - start) * 8:
        raise ValueError(f"bit {bit} is outside the page's {end - start} bytes")
    damaged = bytearray(blob)
    damaged[start + bit // 8] ^= 1 << (bit % 8)
    store.put(key, bytes(damaged), replace=True)
    return bit
