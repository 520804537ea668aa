"""Which mover moves each slice class, from the path asked for and what is proven."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import jax

from kvxfer.engine import (EmulatedMover, Mover, PallasMover, RawMover, StagedMover,
                           pallas_refusal, raw_capable)
from kvxfer.layout import LayoutError, shape_text
from kvxfer.plan import LayerSpec, Plan, SliceClass

__all__ = ["PathMode", "PATHS", "plan_path", "select_movers"]

PathMode = Literal["auto", "staged", "direct", "pallas"]
"""``"auto"``: the fastest proven mover per class; ``"staged"``: compiled programs for
every class; ``"direct"``: byte-range copies only, refusing what is not proven;
``"pallas"``: Pallas TPU DMA kernels for every class, refusing what is not proven."""
PATHS: tuple[str, ...] = get_args(PathMode)


def plan_path(path: PathMode, emulated: bool) -> str:
    """How the plan sizes host blocks for a manager on ``path``.

    With emulated TPU layouts (``layouts=``) the direct path stores device bytes;
    ``"auto"`` stores device bytes for classes proven addressable and dense blocks for
    the rest; raw XLA:CPU copies and the staged path store dense blocks.
    """
    # The plan's paths are named like the manager's; without emulated layouts every
    # mover stores dense blocks, and so do the Pallas kernels (their pages hold each
    # block's logical bytes; they refuse emulated layouts).
    return path if emulated and path != "pallas" else "staged"


def _refusal(cls: SliceClass, spec: LayerSpec, layer: int) -> LayoutError:
    # The decision is made on each shard's geometry (each device pads its own shard),
    # so the message names that geometry too.
    g = spec.shard_geometry
    shard = "" if cls.num_shards == 1 else f" (one shard of {cls.num_shards})"
    return LayoutError(f"Direct path refused for {cls.name} (layers {list(cls.layers)}), "
                       f"layer {layer}{shard}: {g.reason}")


def select_movers(plan: Plan, specs: Sequence[LayerSpec], caches: Sequence[jax.Array],
                  path: PathMode, emulated: bool) -> list[type[Mover]]:
    """The mover type of each slice class of ``plan``.

    Args:
      plan: the manager's plan.
      specs: each layer's spec (with the layout the manager assumes).
      caches: the caches, for what the backend's buffers allow.
      path: what was asked for.
      emulated: the layouts are emulated TPU layouts (``layouts=`` on CPU).

    Raises:
      LayoutError: ``path="direct"`` over a class with no proven direct copy, or
        ``path="pallas"`` over a class the Pallas kernels may not move, naming the
        class, the layer, its shard geometry and the rule that failed.
    """
    out: list[type[Mover]] = []
    for cls in plan.classes:
        first = cls.layers[0]
        if path == "pallas":
            refused = pallas_refusal(cls, specs, caches, emulated)
            if refused is not None:
                layer, reason = refused
                shard = "" if cls.num_shards == 1 else f" (one shard of {cls.num_shards})"
                raise LayoutError(f"Pallas path refused for {cls.name} (layers "
                                  f"{list(cls.layers)}), layer {layer}{shard}: {reason}")
            out.append(PallasMover)
            continue
        if emulated:
            # The bytes live in emulated TPU memory under the given layouts: only the
            # emulated mover reads them as such, and only where they are proven.
            if path == "direct" and not cls.addressable:
                raise _refusal(cls, specs[first], first)
            out.append(EmulatedMover if path != "staged" and cls.addressable else
                       StagedMover)
            continue
        raw_ok = [raw_capable(caches[i]) for i in cls.layers]
        if path == "direct" and not all(raw_ok):
            bad = cls.layers[raw_ok.index(False)]
            if not specs[bad].shard_geometry.addressable:
                raise _refusal(cls, specs[bad], bad)
            a = caches[bad]
            raise LayoutError(
                f"Direct path refused for layer {bad}: "
                f"{shape_text(a.shape, a.dtype, specs[bad].layout)} is addressable, but "
                "this backend has no direct path for it (raw copies need XLA:CPU "
                "row-major buffers of whole-byte elements; on TPU use path='pallas' "
                "for the Pallas DMA kernels; pass layouts= to use emulated TPU memory)")
        out.append(RawMover if path != "staged" and all(raw_ok) else StagedMover)
    return out
