"""What a transfer hands back: offload and load handles, and the result of a load."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import Literal

from kvxfer._check import check_timeout
from kvxfer.engine import TransferError
from kvxfer.hostpool import PageRef

__all__ = ["Gate", "IntegrityError", "LoadResult", "OffloadHandle", "LoadHandle"]

Gate = Literal["all", "layer"]
"""``"layer"`` releases each layer once its pages are verified; ``"all"`` releases
nothing until every layer is verified."""


class IntegrityError(RuntimeError):
    """A page was consumed before it was found bad (see ``LoadResult``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    """What a load delivered.

    Attributes:
      verified_prefix: pages ``[0, verified_prefix)`` are loaded and verified in every
        layer and shard; the caller recomputes the rest.
      invalid_pages: request indices this load did not deliver (the first bad page
        and all after it).
      reasons: request index → why that page is bad (only pages found bad themselves).
      consumed_before_failure: a layer was released with a longer prefix than the
        final one; the caller must restart from ``verified_prefix``.
      released_prefixes: the prefix each layer was released with.
      freed_pages: request indices kvxfer freed because their own digest proved them
        bad (freeing them again is a no-op). Every other page, also past the
        prefix, is intact and still the caller's: a page the caller expected under
        another key is a miss for this request only.
    """

    verified_prefix: int
    invalid_pages: tuple[int, ...]
    reasons: dict[int, str]
    consumed_before_failure: bool
    released_prefixes: tuple[int, ...]
    freed_pages: tuple[int, ...] = ()

    def raise_if_consumed(self) -> None:
        """Raises ``IntegrityError`` when a layer was released with a longer prefix.

        Raises:
          IntegrityError: naming the layers and the prefixes they were released with.
        """
        if self.consumed_before_failure:
            layers = [i for i, p in enumerate(self.released_prefixes)
                      if p > self.verified_prefix]
            raise IntegrityError(
                f"layers {layers} were released with prefixes "
                f"{[self.released_prefixes[i] for i in layers]} before page "
                f"{self.verified_prefix} was found bad ({self.reasons}); restart the "
                f"request from page {self.verified_prefix}")


class OffloadHandle:
    """An offload in flight; ``wait()`` gives the page refs once the bytes are on host."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> list[PageRef]:
        """Blocks until the pages are on the host.

        Raises:
          TransferError: the transfer failed (its slots were freed).
          TimeoutError: not done within ``timeout`` seconds.
        """
        timeout = check_timeout(timeout)
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"offload not done after {timeout} s") from None


class LoadHandle:
    """A load in flight, with per-layer readiness gated on verification."""

    def __init__(self, num_layers: int, num_pages: int, gate: Gate):
        self.gate = gate
        self.num_pages = num_pages
        self._events = [threading.Event() for _ in range(num_layers)]
        self._released = [0] * num_layers
        self._done = threading.Event()
        self._result: LoadResult | None = None
        self._error: BaseException | None = None
        self._verified = [False] * num_layers

    # -- transfer-thread side ----------------------------------------------------

    def release(self, layer: int, prefix: int) -> None:
        """Marks layer ``layer`` verified with pages ``[0, prefix)`` (transfer thread)."""
        self._released[layer] = prefix
        self._verified[layer] = True
        self._events[layer].set()

    def finish(self, result: LoadResult | None, error: BaseException | None) -> None:
        """Ends the load with its result or its error (transfer thread)."""
        self._result, self._error = result, error
        for e in self._events:
            e.set()
        self._done.set()

    # -- caller side ----------------------------------------------------------

    def layer_ready(self, layer: int, timeout: float | None = None) -> int:
        """Blocks until layer ``layer`` is verified and released.

        Returns:
          The verified prefix at release: pages ``[0, prefix)`` of this layer may
          be consumed.

        Raises:
          TransferError: the transfer failed before this layer was released (a
            layer released earlier keeps its prefix; ``result()`` raises).
          TimeoutError: not released within ``timeout`` seconds.
        """
        if not 0 <= layer < len(self._events):
            raise IndexError(f"layer {layer} out of range [0, {len(self._events)})")
        timeout = check_timeout(timeout)
        if not self._events[layer].wait(timeout):
            raise TimeoutError(f"layer {layer} not ready after {timeout} s")
        if not self._verified[layer]:
            raise TransferError(f"load failed before layer {layer} was ready: "
                                f"{self._error}") from self._error
        return self._released[layer]

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> LoadResult:
        """Blocks until every layer is verified; the verified prefix and what failed.

        Raises:
          TransferError: a device or transfer failure (never reported as a miss).
        """
        timeout = check_timeout(timeout)
        if not self._done.wait(timeout):
            raise TimeoutError(f"load not done after {timeout} s")
        if self._error is not None:
            raise TransferError(f"load failed: {self._error}") from self._error
        assert self._result is not None
        return self._result

    @property
    def released_prefixes(self) -> tuple[int, ...]:
        """The prefix each layer was released with so far (0 for layers not released)."""
        return tuple(self._released)


