"""dtype names as XLA writes them and the bits of an element, and ``LayoutError``.

The lowest room of the layout family (``kvxfer.layout`` re-exports it): a dtype
from a name such as ``"bf16"``, ``"s8"`` or ``"float8_e4m3fn"``, its canonical and
short names, and how many bits one value takes (sub-byte types packed).

Example:
    >>> dtype_name("bf16"), short_dtype_name("float8_e4m3fn"), natural_bits("int4")
    ('bfloat16', 'f8e4m3fn', 4)
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["LayoutError", "dtype_of", "dtype_name", "short_dtype_name", "natural_bits"]


class LayoutError(ValueError):
    """A layout that is malformed, does not fit its shape, or is not addressable."""

# XLA's primitive type names, so users can paste shapes like "bf16[512,6144]".
_XLA_DTYPE_NAMES = {
    "pred": "bool",
    "s4": "int4",
    "u4": "uint4",
    "s8": "int8",
    "u8": "uint8",
    "s16": "int16",
    "u16": "uint16",
    "s32": "int32",
    "u32": "uint32",
    "s64": "int64",
    "u64": "uint64",
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
    "f8e4m3b11fnuz": "float8_e4m3b11fnuz",
    "f8e4m3fnuz": "float8_e4m3fnuz",
    "f8e5m2fnuz": "float8_e5m2fnuz",
    "f4e2m1fn": "float4_e2m1fn",
    "fp8": "float8_e4m3fn",
    "int4": "int4",
}
_SHORT_NAMES = {v: k for k, v in _XLA_DTYPE_NAMES.items() if k not in ("fp8", "int4")}
_SUB_BYTE_BITS = {"int4": 4, "uint4": 4, "float4_e2m1fn": 4, "int2": 2, "uint2": 2}


def dtype_of(dtype: Any) -> np.dtype:
    """Returns the numpy dtype for a name (``"bfloat16"``, ``"bf16"``, ``"s8"``) or dtype.

    Raises:
      LayoutError: the name is not a known dtype.
    """
    import ml_dtypes  # bfloat16, float8 and int4 (what jax uses; without starting jax)

    if isinstance(dtype, str):
        dtype = _XLA_DTYPE_NAMES.get(dtype.strip().lower(), dtype.strip())
        extra = getattr(ml_dtypes, dtype, None)
        if isinstance(extra, type) and issubclass(extra, np.generic):
            return np.dtype(extra)
    try:
        return np.dtype(dtype)
    except TypeError as e:
        raise LayoutError(f"Unknown dtype {dtype!r}; expected a name such as "
                          "'bfloat16', 'bf16', 'int8', 'float8_e4m3fn' or 'int4'") from e


def dtype_name(dtype: Any) -> str:
    """The canonical (numpy / ml_dtypes) name of a dtype, e.g. ``"bfloat16"``."""
    return dtype_of(dtype).name


def short_dtype_name(dtype: Any) -> str:
    """XLA's short name of a dtype, e.g. ``"bf16"``, as used in ``bf16[512,6144]``."""
    name = dtype_name(dtype)
    return _SHORT_NAMES.get(name, name)


def natural_bits(dtype: Any) -> int:
    """Bits of one element's value: 4 for int4, 16 for bfloat16."""
    name = dtype_name(dtype)
    return _SUB_BYTE_BITS.get(name, dtype_of(dtype).itemsize * 8)
