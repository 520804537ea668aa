"""What a lookup hands back: ``CacheHit`` (pinned pages) and ``CacheLoad`` (their load)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kvxfer.hostpool import PageRef
from kvxfer.manager import LoadHandle, LoadResult

__all__ = ["CacheHit", "CacheLoad", "Pin", "check_hit"]


@dataclasses.dataclass
class Pin:
    """Whether a hit still holds its pins (each hit releases them once), and whose."""

    held: bool = True
    owner: Any = None  # the HostCache whose lookup pinned it


@dataclasses.dataclass(frozen=True)
class CacheHit:
    """The longest cached prefix of a request, pinned until loaded or released.

    Attributes:
      keys: the keys of the prefix, in request order.
      pages: their host pages (promoted from the store where ``tiers[j]`` is
        ``"store"``).
      tiers: where each page was found: ``"host"`` or ``"store"``.
    """

    keys: tuple[int, ...]
    pages: tuple[PageRef, ...]
    tiers: tuple[str, ...]
    _pin: Pin = dataclasses.field(default_factory=Pin, compare=False, repr=False)

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class CacheLoad:
    """A load of a ``CacheHit`` in flight (see ``LoadHandle``).

    ``result()`` settles the cache once: verified pages count as hits of their tier,
    pages proven bad leave the index (and the store, if it holds them), and the pins
    are released. A load that ends unread is settled by the cache's next call.
    """

    def __init__(self, hit: CacheHit, handle: LoadHandle,
                 settle: Callable[[CacheLoad, LoadResult | None], None]):
        self.hit = hit
        self.handle = handle
        self._settle = settle  # the cache's: once per load, however often it is called

    def layer_ready(self, layer: int, timeout: float | None = None) -> int:
        """See ``LoadHandle.layer_ready``."""
        return self.handle.layer_ready(layer, timeout)

    def done(self) -> bool:
        return self.handle.done()

    def result(self, timeout: float | None = None) -> LoadResult:
        """The load's result, once every layer is verified (see ``LoadHandle.result``)."""
        try:
            result = self.handle.result(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self._settle(self, None)
            raise
        self._settle(self, result)
        return result


def check_hit(hit: Any, owner: Any) -> None:
    """Refuses what is not a ``CacheHit`` of ``owner``'s lookups (an empty hit is any
    cache's)."""
    if not isinstance(hit, CacheHit):
        raise TypeError(f"hit must be a CacheHit from lookup(). Got {type(hit).__name__}")
    if hit._pin.owner is not owner and (hit._pin.owner is not None or hit.keys):
        # Its pins are another cache's: taking them here would leave that cache's
        # pages pinned for good.
        raise ValueError("this hit comes from another HostCache's lookup(); release or "
                         "load it through that cache")
