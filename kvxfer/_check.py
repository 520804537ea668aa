"""Argument checks shared by the public entry points: each names the bad value."""

from __future__ import annotations

import argparse
import math
import os
import stat
import sys
import threading
from collections.abc import Callable
from typing import Any

from kvxfer._text import parse_bytes

__all__ = ["check_int", "check_timeout", "positive_int", "bounded_int", "byte_size",
           "path_name", "out_dir", "MAX_COUNT", "MAX_LAYERS"]

MAX_COUNT = 1 << 31
"""The largest count (pages, blocks, layers, ...) any command takes: larger values are
refused as typed, before anything is sized from them."""

MAX_LAYERS = 4096
"""The most layers a model config may have (what a real model can need)."""


def _kinds() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """``(bools, ints, floats)``, numpy's among them once numpy is imported (no numpy
    scalar exists before), so the command line's checks start without numpy."""
    np = sys.modules.get("numpy")
    if np is None:
        return (bool,), (int,), (float,)
    return (bool, np.bool_), (int, np.integer), (float, np.floating)


def check_int(value: Any, name: str, *, minimum: int | None = None) -> int:
    """``value`` as an int, if it is one (numpy ints too; not bool, not 1.5).

    Integral floats (``2.0``, ``1e9``) are accepted as the int they equal.

    Raises:
      TypeError: not an integer, naming ``name``, the value and its type.
      ValueError: below ``minimum``.
    """
    bools, ints, floats = _kinds()
    if isinstance(value, bools):
        raise TypeError(f"{name}={value!r} must be an int, not a bool")
    if isinstance(value, ints):
        out = int(value)
    elif isinstance(value, floats) and math.isfinite(value) and \
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
    bools, ints, floats = _kinds()
    if isinstance(timeout, bools) or not isinstance(timeout, ints + floats):
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


def _int_text(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    """An argparse type: an integer from 1 to ``MAX_COUNT`` (``--pages 0`` is an error,
    not a default).

    Example:
        >>> positive_int("3")
        3
        >>> positive_int("99999999999999999999")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: 99999999999999999999 is above 2147483648, the most any ...
    """
    value = _int_text(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{value} is above {MAX_COUNT}, the most any count "
                                         "may be")
    return value


def bounded_int(minimum: int, maximum: int, what: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from ``minimum`` to ``maximum`` (``what`` says why
    the maximum is what it is).

    Example:
        >>> seed = bounded_int(0, 2**32 - 1)
        >>> seed("7")
        7
        >>> seed("-1")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: -1 must be >= 0
    """
    def parse(text: str) -> int:
        value = _int_text(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{value} must be <= {maximum}"
                                             + (f" ({what})" if what else ""))
        return value

    parse.__name__ = f"integer from {minimum} to {maximum}"
    return parse


def byte_size(text: str) -> int:
    """An argparse type: a size in bytes, with or without a unit (``64GiB``, ``512 MiB``,
    ``1.5GB``, ``64G``, ``4096``), parsed exactly by ``parse_bytes``: ``KiB`` .. ``PiB``
    and a bare ``K`` / ``M`` / ``G`` (as ``-Xmx`` and docker read it) are powers of
    1024, ``KB`` .. ``PB`` powers of 1000.

    Example:
        >>> byte_size("64GiB"), byte_size("1.5 KiB"), byte_size("2GB"), byte_size("4096")
        (68719476736, 1536, 2000000000, 4096)
        >>> byte_size("64G") == byte_size("64GiB"), byte_size("2.01KB")
        (True, 2010)
    """
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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


def out_dir(text: str) -> str:
    """An argparse type for a directory written to: ``text`` unless it is empty or
    something other than a directory is there (it is created if missing).

    Example:
        >>> out_dir("/dev/null")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: /dev/null is not a directory
    """
    if not text.strip() or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory name")
    try:
        mode = os.stat(text).st_mode
    except (OSError, ValueError):
        return text
    if not stat.S_ISDIR(mode):
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return text
