"""Raw-bits helpers: compare arrays as the bytes they hold, NaN payloads included."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvxfer.layout import dtype_of

__all__ = ["bits", "same_bits", "random_bits"]

# Sub-byte types numpy (ml_dtypes) holds one to a byte, in the low bits.
_SUB_BYTE_INTS = ("int4", "uint4", "int2", "uint2")
_SUB_BYTE_FLOATS = ("float4_e2m1fn",)


def bits(x: Any) -> np.ndarray:
    """A host copy of an array's bits, as unsigned ints of the element's width.

    On CPU ``np.asarray`` of a ``jax.Array`` may view the live device buffer, so this
    always copies. numpy holds one sub-byte element per byte: int4 compares as its byte.

    Example:
        >>> import numpy as np
        >>> bits(np.array([1.0, -0.0], np.float32)).tolist()
        [1065353216, 2147483648]
    """
    a = np.array(x)
    if a.dtype == np.bool_:
        return a.view(np.uint8)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def same_bits(a: Any, b: Any) -> bool:
    """Whether two arrays have the same shape and the same bytes (NaNs compare by bits).

    Example:
        >>> import numpy as np
        >>> nan = np.array([np.nan], np.float32)
        >>> bool(np.array_equal(nan, nan)), same_bits(nan, nan.copy())
        (False, True)
    """
    x, y = np.asarray(a), np.asarray(b)
    return x.shape == y.shape and x.dtype.itemsize == y.dtype.itemsize and \
        np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes()


def random_bits(shape: tuple[int, ...] | list[int], dtype: Any,
                seed: int | tuple[int, ...] | np.random.Generator = 0) -> np.ndarray:
    """An array of uniformly random bit patterns (NaNs, -0 and subnormals included).

    Sub-byte integers hold in-range values and 4-bit floats any 4-bit pattern;
    booleans hold 0 or 1. Deterministic in ``seed`` (an int, a tuple of ints, or a
    ``np.random.Generator`` to draw from).

    Example:
        >>> x = random_bits((2, 3), "bfloat16", seed=1)
        >>> x.shape, x.dtype.name, same_bits(x, random_bits((2, 3), "bfloat16", seed=1))
        ((2, 3), 'bfloat16', True)
    """
    dt = dtype_of(dtype)
    shape = tuple(int(d) for d in shape)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    if dt.name in _SUB_BYTE_INTS:
        import jax.numpy as jnp

        info = jnp.iinfo(dt)
        return rng.integers(int(info.min), int(info.max), size=shape, dtype=np.int8,
                            endpoint=True).astype(dt)
    nbytes = math.prod(shape) * dt.itemsize
    words = rng.integers(0, np.iinfo(np.uint64).max, size=-(-nbytes // 8), dtype=np.uint64,
                         endpoint=True)
    raw = words.view(np.uint8)[:nbytes]
    if dt == np.bool_:
        raw = raw & 1
    elif dt.name in _SUB_BYTE_FLOATS:
        raw = raw & 0x0F
    return raw.view(dt).reshape(shape)
