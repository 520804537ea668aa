"""The choices the public calls and the command line share.

This module imports nothing heavy, so the command line can offer these choices without
starting JAX; the modules that act on them re-export them.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["PathMode", "PATHS", "IntegrityMode", "Gate", "Fault", "FAULTS", "GENERATIONS",
           "PlanPath"]

PathMode = Literal["auto", "staged", "raw", "pinned", "pallas", "dma"]
"""``"auto"``: the fastest proven mover per class (``AUTO_RULES``); ``"staged"``:
compiled programs through pageable host buffers for every class; ``"raw"``: the raw
mover's byte-range copies only (the emulated mover's with ``layouts=``), refusing
what is not proven; ``"pinned"``: compiled programs
straight to and from a pinned host pool, for every class (backends with a
``pinned_host`` memory kind); ``"pallas"``: Pallas TPU DMA kernels for every class
(interpret mode off TPU), refusing what is not proven; ``"dma"``: copy-engine copies
ordered by XLA's stream between the caches and a pool pinned outside XLA, for every
class (NVIDIA GPUs with ``cuda-bindings``; XLA:CPU with its host copy engine),
refusing what it cannot address."""
PATHS: tuple[str, ...] = get_args(PathMode)

IntegrityMode = Literal["page", "off"]
"""``"page"`` digests every page on the device; ``"off"`` skips digests."""

Gate = Literal["all", "layer"]
"""``"layer"`` releases each layer once its pages are verified; ``"all"`` releases
nothing until every layer is verified."""

Fault = Literal["bitflip", "wrong-key", "misfile", "stale-slot", "one-shard", "torn",
                "transfer", "zero-dma"]
FAULTS: tuple[str, ...] = get_args(Fault)
"""The faults ``kvxfer.testing.inject`` and ``kvxfer probe --inject`` know (meanings:
``kvxfer.testing``)."""

GENERATIONS: tuple[str, ...] = ("v4", "v5e", "v5p", "v6e", "tpu7x")
"""The TPU generations libtpu compiles for here, oldest first (``kvxfer.tpu``)."""

PlanPath = Literal["staged", "raw", "auto"]
"""How a plan sizes host blocks (``kvxfer.plan.Path``): ``"staged"`` dense logical
blocks; ``"raw"`` the device bytes a raw copy moves; ``"auto"`` device bytes where
addressable, else dense."""
