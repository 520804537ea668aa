"""Host bytes for class pools: numpy memory, or XLA ``pinned_host`` memory viewed in place.

``allocate_bytes`` makes a class pool's zeroed bytes (pinned through a JAX array on a
device's ``pinned_host`` memory where asked), ``host_view`` views the buffer of a host
JAX array as bytes, and ``word_bytes`` says which words a pinned pool is held as.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer._requires import require_jax
from kvxfer.layout import dtype_of
from kvxfer.plan import SliceClass

__all__ = ["allocate_bytes", "has_pinned_host", "host_view", "word_bytes"]


def host_view(owner: Any, nbytes: int) -> np.ndarray:
    """A writable ``uint8[nbytes]`` view of a host-memory JAX array's buffer of
    ``nbytes`` bytes (the caller checks the size)."""
    import ctypes

    owner.block_until_ready()
    return np.ctypeslib.as_array(
        (ctypes.c_uint8 * nbytes).from_address(owner.unsafe_buffer_pointer()))


def word_bytes(cls: SliceClass) -> int:
    """The widest unsigned word (4, 2 or 1 bytes), no wider than an element of the
    class, that every shard's bytes of a page split into.

    A pinned pool is held as words of this size, so programs move whole words. A word
    no wider than an element is the element's own raw bits (or a part of them): on
    XLA:CPU, splitting a word into narrower elements inside a copy's loop made every
    block copy of a bfloat16 cache about 2x slower (a 64-page x 32-layer load took
    10 % longer with 4-byte words).

    Example:
        >>> from kvxfer.plan import LayerSpec, make_plan
        >>> plan = make_plan([LayerSpec("L0", (8, 3, 2), "bfloat16"),
        ...                   LayerSpec("L1", (8, 3, 2), "float32")], num_host_blocks=2)
        >>> [word_bytes(c) for c in plan.classes]
        [2, 4]
    """
    size = dtype_of(cls.dtype).itemsize
    return next(w for w in (4, 2, 1) if w <= size and cls.shard_block_bytes % w == 0)


def allocate_bytes(nbytes: int, pinned: bool, device: Any, word: int = 1,
                    rows: int = 1) -> tuple[np.ndarray, Any]:
    """Zeroed host bytes; pinned through JAX's ``pinned_host`` memory when asked.

    A pinned allocation is owned by a ``uint{8 * word}[rows, nbytes // word // rows]``
    JAX array on ``device``'s ``pinned_host`` memory; the bytes returned view its
    buffer.
    """
    if pinned and nbytes:
        import jax
        import jax.numpy as jnp

        require_jax()  # XLA:CPU compiles pinned_host outputs from JAX_FLOOR on

        if nbytes % (word * rows):
            raise ValueError(f"{nbytes} bytes are not {rows} rows of {word}-byte words")
        sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        dtype = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[word]
        owner = _zeros(sharding, dtype)((rows, nbytes // word // rows))
        return host_view(owner, nbytes), owner
    return np.zeros(nbytes, dtype=np.uint8), None


@functools.lru_cache(maxsize=32)
def _zeros(sharding: Any, dtype: Any) -> Callable[[tuple[int, int]], Any]:
    """One jitted allocator of zeros per sharding and dtype: pools of a shape made
    before reuse its program (a new function each time compiled one per pool)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda shape: jnp.zeros(shape, dtype), static_argnums=0,
                   out_shardings=sharding)


def has_pinned_host(device: Any) -> bool:
    """Whether ``device`` offers a ``pinned_host`` memory kind."""
    return any(m.kind == "pinned_host" for m in device.addressable_memories())
