"""Argument checks shared by the public entry points: each names the bad value."""

from __future__ import annotations

import argparse
import math
import threading
from typing import Any

import numpy as np

__all__ = ["check_int", "check_timeout", "positive_int", "path_name"]


def check_int(value: Any, name: str, *, minimum: int | None = None) -> int:
    """``value`` as an int, if it is one (numpy ints too; not bool, not 1.5).

    Integral floats (``2.0``, ``1e9``) are accepted as the int they equal.

    Raises:
      TypeError: not an integer, naming ``name``, the value and its type.
      ValueError: below ``minimum``.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be an int, not a bool")
    if isinstance(value, (int, np.integer)):
        out = int(value)
    elif isinstance(value, (float, np.floating)) and math.isfinite(value) and \
            float(value).is_integer():
        out = int(value)
    else:
        raise TypeError(f"{name}={value!r} must be an int. Got {value!r} of type "
                        f"{type(value).__name__}")
    if minimum is not None and out < minimum:
        raise ValueError(f"{name}={out} must be >= {minimum}")
    return out


def check_timeout(timeout: Any, name: str = "timeout") -> float | None:
    """``timeout`` if it is None or a finite number of seconds >= 0, as a float.

    A finite timeout longer than any wait the platform can make (``threading.TIMEOUT_MAX``,
    about 292 years on Linux; ``1e300``, ``2**63``, ``10**400``) is clamped to it, so
    every wait that takes it works as "as good as never".

    Raises:
      ValueError: NaN, infinite or negative, naming ``name``.
      TypeError: not a number.

    Example:
        >>> check_timeout(2), check_timeout(10**400) == threading.TIMEOUT_MAX
        (2.0, True)
    """
    if timeout is None:
        return None
    if isinstance(timeout, (bool, np.bool_)) or \
            not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}={timeout!r} must be None or a number of seconds. Got "
                        f"{type(timeout).__name__}")
    try:
        finite = math.isfinite(timeout)
    except OverflowError:  # an int past a float's range: finite, and very long
        finite = True
    if not finite or timeout < 0:
        raise ValueError(f"{name}={timeout!r} must be None or a finite number of seconds "
                         ">= 0")
    if timeout >= threading.TIMEOUT_MAX:
        return float(threading.TIMEOUT_MAX)
    return float(timeout)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (``--pages 0`` is an error, not a default).

    Example:
        >>> positive_int("3")
        3
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def path_name(text: str) -> str:
    """An argparse type for ``--path``: ``direct``, the raw path's former name, is an
    error that names ``raw`` (the choices check the rest).

    Example:
        >>> path_name("raw")
        'raw'
    """
    if text == "direct":
        raise argparse.ArgumentTypeError("'direct' is now called 'raw' (the raw mover); "
                                         "pass --path raw")
    return text
