"""What the host tier asks of the tier below it (``StoreTier`` is the one there is).

The host tier hands the tier below each page that arrives, each lookup's hit and each
page it evicts; it never asks more. Naming that here lets ``_host`` do without the
store tier's module, which uses the host tier: the two depend one way.
"""

from __future__ import annotations

from typing import Protocol

from kvxfer.hostpool import PageRef

__all__ = ["TierBelow"]


class TierBelow(Protocol):
    """The tier below host memory, as the host tier sees it."""

    def arrived(self, key: int, ref: PageRef) -> None:
        """A page was just indexed on host."""

    def hit(self, key: int, ref: PageRef, hits: int) -> None:
        """A lookup found host page ``key``, its ``hits``-th time."""

    def spill(self, key: int, ref: PageRef, hits: int) -> None:
        """Host page ``key``, found ``hits`` times, is being evicted (still valid)."""
