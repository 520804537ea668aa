"""The host memory of the process running the bench: resident now, and its peak.

The peak is the kernel's high-water mark of this process's own memory (``VmHWM``):
``ru_maxrss`` would also count a parent's, as Linux carries it across ``fork`` and
``exec`` (a bench started from a 2 GB test session would report 2 GB). The memory
section resets the mark to time one offload + load (``reset_peak``); the peak seen
before each reset is kept, so ``peak_bytes`` is the peak since ``start``.

Example:
    >>> start()
    >>> before = peak_bytes()
    >>> grown = b"x" * (64 << 20)  # 64 MiB written: resident
    >>> del grown
    >>> reset_peak() or True
    True
    >>> peak_bytes() - before > 60 << 20 or platform.system() != "Linux"
    True
"""

from __future__ import annotations

import platform

__all__ = ["rss", "reset_peak", "start", "peak_bytes"]

# The highest mark ``reset_peak`` wiped since ``start``.
_before_resets = 0


def rss() -> tuple[int, int] | None:
    """(current, peak) resident bytes of this process, or None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def reset_peak() -> bool:
    """Sets the peak to the current resident memory (keeping the old one for
    ``peak_bytes``); whether the kernel allowed it."""
    global _before_resets
    now = rss()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    if now is not None:
        _before_resets = max(_before_resets, now[1])
    return True


def start() -> None:
    """Counts the peak from here (where the mark can be reset: Linux)."""
    global _before_resets
    _before_resets = 0
    reset_peak()
    _before_resets = 0


def peak_bytes() -> int | None:
    """The most memory this process has held since ``start`` (where the mark cannot be
    reset, since it started; off Linux from ``ru_maxrss``); None where neither exists."""
    now = rss()
    if now is not None:
        return max(_before_resets, now[1])
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if platform.system() == "Darwin" else peak * 1024  # bytes there, KiB here
