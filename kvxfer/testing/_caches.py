"""Cache builders: random KV caches of a given block size, placed as a test needs them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from kvxfer.layout import dtype_of
from kvxfer.testing._bits import random_bits

__all__ = ["block_shape", "random_caches"]


def block_shape(block_bytes: int, dtype: Any, *, minor: int = 128,
                heads: int = 1) -> tuple[int, ...]:
    """The shape of one block of ``block_bytes`` bytes: ``(rows, heads, minor)``.

    Falls back to ``(elements,)`` when the block does not split that way.

    Example:
        >>> block_shape(64 << 10, "bfloat16", heads=2)
        (128, 2, 128)
    """
    itemsize = dtype_of(dtype).itemsize
    if block_bytes <= 0 or block_bytes % itemsize:
        raise ValueError(f"block_bytes={block_bytes} must be a positive multiple of the "
                         f"{dtype_of(dtype).name} item size ({itemsize})")
    elems = block_bytes // itemsize
    if elems % (minor * heads) == 0:
        return (elems // (minor * heads), heads, minor) if heads > 1 else \
            (elems // minor, minor)
    return (elems,)


def random_caches(num_layers: int, num_blocks: int, block: Sequence[int], dtype: Any, *,
                  sharding: jax.sharding.Sharding | Sequence[jax.sharding.Sharding] |
                  None = None, seed: int = 0) -> list[jax.Array]:
    """Random caches ``[num_blocks, *block]``, one per layer, each owning its buffers.

    Contents are ``random_bits``, deterministic in ``(seed, layer)``. XLA:CPU may
    alias an aligned numpy array (and puts one buffer under every replica of a
    replicated ``device_put``), so every cache is copied onto its own buffers.

    Args:
      num_layers: how many layers.
      num_blocks: blocks per layer (dim 0).
      block: the shape of one block.
      dtype: element type.
      sharding: one sharding for all layers, one per layer, or None (this process's
        first device, ``jax.local_devices()[0]``: in a multi-process job each process
        builds its caches on a device of its own).
      seed: random seed.

    Example:
        >>> caches = random_caches(2, 8, (4, 128), "float32")
        >>> [c.shape for c in caches]
        [(8, 4, 128), (8, 4, 128)]
    """
    dt = dtype_of(dtype)
    if sharding is None:
        shardings: Sequence[Any] = [
            jax.sharding.SingleDeviceSharding(jax.local_devices()[0])] * num_layers
    elif isinstance(sharding, jax.sharding.Sharding):
        shardings = [sharding] * num_layers
    else:
        shardings = list(sharding)
        if len(shardings) != num_layers:
            raise ValueError(f"{len(shardings)} shardings for {num_layers} layers")
    out = []
    for i, s in enumerate(shardings):
        host = random_bits((num_blocks, *block), dt, seed=(int(seed), i))
        out.append(jax.device_put(jax.device_put(host, s), s, may_alias=False))
    jax.block_until_ready(out)
    return out
