"""Which mover moves each slice class, from the path asked for and what is proven."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from kvxfer._names import PATHS as PATHS
from kvxfer._names import PathMode as PathMode
from kvxfer.engine import (DmaMover, EmulatedMover, Mover, PallasMover, RawMover,
                           RawOrPinnedMover, StagedMover, dma_refusal, pallas_refusal,
                           pinned_capable, pinned_mover, raw_capable)
from kvxfer.layout import LayoutError, shape_text
from kvxfer.plan import LayerSpec, Plan, SliceClass

__all__ = ["PathMode", "PATHS", "AUTO_RULES", "check_path", "plan_path", "select_movers"]



def check_path(path: object) -> None:
    """Raises ``ValueError`` unless ``path`` is one of ``PATHS``.

    ``"direct"``, the raw path's former name, is refused with a message naming ``"raw"``.

    Example:
        >>> check_path("direct")
        Traceback (most recent call last):
        ...
        ValueError: path='direct' is now called path='raw' (the raw mover); pass path='raw'
    """
    if path == "direct":
        raise ValueError("path='direct' is now called path='raw' (the raw mover); pass "
                         "path='raw'")
    if path not in PATHS:
        raise ValueError(f"path={path!r}; expected one of {PATHS}")


#: What ``path="auto"`` tries for each class, by backend: the first mover that
#: applies to the class wins (``staged`` applies to every class). With emulated TPU
#: layouts (``layouts=``) the rule is: emulated for classes proven addressable, else
#: staged.
AUTO_RULES: dict[str, tuple[str, ...]] = {
    "cpu": ("raw", "pinned", "staged"),
    "gpu": ("dma", "pinned", "staged"),
    "tpu": ("pallas", "pinned", "staged"),
}
_OTHER_BACKENDS = ("pinned", "staged")

_MOVERS: dict[str, type[Mover]] = {"raw": RawMover, "pallas": PallasMover,
                                   "staged": StagedMover, "dma": DmaMover}


def plan_path(path: PathMode, emulated: bool) -> str:
    """How the plan sizes host blocks for a manager on ``path``.

    With emulated TPU layouts (``layouts=``) the raw path stores device bytes;
    ``"auto"`` stores device bytes for classes proven addressable and dense blocks for
    the rest; raw XLA:CPU copies, the pinned and the staged paths store dense blocks.
    """
    # The plan's paths are named like the manager's; without emulated layouts every
    # mover stores dense blocks, and so do the Pallas kernels (their pages hold each
    # block's logical bytes; they refuse emulated layouts).
    return path if emulated and path in ("auto", "raw") else "staged"


def _refusal(cls: SliceClass, spec: LayerSpec, layer: int) -> LayoutError:
    # The decision is made on each shard's geometry (each device pads its own shard),
    # so the message names that geometry too.
    g = spec.shard_geometry
    shard = "" if cls.num_shards == 1 else f" (one shard of {cls.num_shards})"
    return LayoutError(f"Raw path refused for {cls.name} (layers {list(cls.layers)}), "
                       f"layer {layer}{shard}: {g.reason}")


def _backend(caches: Sequence[jax.Array], cls: SliceClass) -> str:
    return next(iter(caches[cls.layers[0]].sharding.device_set)).platform


def _memory_kinds(a: jax.Array) -> list[str]:
    return sorted({m.kind for d in a.sharding.device_set for m in d.addressable_memories()})


def _applies(caches: Sequence[jax.Array], pinned: bool | None, specs: Sequence[LayerSpec],
             emulated: bool) -> dict[str, Callable[[SliceClass], bool]]:
    """Whether each mover can move a class (``AUTO_RULES`` names these)."""
    return {
        "pallas": lambda cls: pallas_refusal(cls, specs, caches, emulated) is None,
        "raw": lambda cls: all(raw_capable(caches[i]) for i in cls.layers),
        "dma": lambda cls: all(dma_refusal(caches[i]) is None for i in cls.layers),
        "pinned": lambda cls: pinned is not False and all(pinned_capable(caches[i])
                                                          for i in cls.layers),
        "staged": lambda cls: True,
    }


def _check_pinned(caches: Sequence[jax.Array], cls: SliceClass, pinned: bool | None) -> None:
    if pinned is False:
        raise ValueError("path='pinned' moves pages through pinned host pools; it cannot "
                         "run with pinned=False (pass pinned=None or True, or another "
                         "path)")
    for i in cls.layers:
        if not pinned_capable(caches[i]):
            a = caches[i]
            raise ValueError(
                f"path='pinned' needs a 'pinned_host' memory kind; layer {i} lives on the "
                f"{_backend(caches, cls)} backend, whose devices offer "
                f"{_memory_kinds(a)}; use path='staged' or 'auto'")


def _check_dma(caches: Sequence[jax.Array], cls: SliceClass) -> None:
    for i in cls.layers:
        why = dma_refusal(caches[i])
        if why is not None:
            raise LayoutError(f"DMA path refused for {cls.name} (layers {list(cls.layers)}), "
                              f"layer {i}: {why}; use path='pinned', 'staged' or 'auto'")


def select_movers(plan: Plan, specs: Sequence[LayerSpec], caches: Sequence[jax.Array],
                  path: PathMode, emulated: bool, pinned: bool | None = None
                  ) -> list[type[Mover]]:
    """The mover type of each slice class of ``plan``.

    Args:
      plan: the manager's plan.
      specs: each layer's spec (with the layout the manager assumes).
      caches: the caches, for what the backend's buffers allow.
      path: what was asked for.
      emulated: the layouts are emulated TPU layouts (``layouts=`` on CPU).
      pinned: the manager's ``pinned=`` (False keeps ``auto`` off the pinned mover).

    Raises:
      LayoutError: ``path="raw"`` over a class with no proven raw copy, or
        ``path="pallas"`` over a class the Pallas kernels may not move, naming the
        class, the layer, its shard geometry and the rule that failed.
      ValueError: ``path="pinned"`` on a backend without ``pinned_host`` memory (or
        with ``pinned=False``), naming the backend.
    """
    applies = _applies(caches, pinned, specs, emulated)
    return [_select_class(cls, specs, caches, path, emulated, pinned, applies)
            for cls in plan.classes]


def _select_class(cls: SliceClass, specs: Sequence[LayerSpec], caches: Sequence[jax.Array],
                  path: PathMode, emulated: bool, pinned: bool | None,
                  applies: dict[str, Callable[[SliceClass], bool]]) -> type[Mover]:
    """The mover type of one slice class (``select_movers``)."""
    first = cls.layers[0]
    if path == "pallas":
        refused = pallas_refusal(cls, specs, caches, emulated)
        if refused is not None:
            layer, reason = refused
            shard = "" if cls.num_shards == 1 else f" (one shard of {cls.num_shards})"
            raise LayoutError(f"Pallas path refused for {cls.name} (layers "
                              f"{list(cls.layers)}), layer {layer}{shard}: {reason}")
        return PallasMover
    if path == "pinned":
        _check_pinned(caches, cls, pinned)
        return pinned_mover(_backend(caches, cls))
    if path == "dma":
        if emulated:
            raise ValueError("path='dma' copies the arrays' own buffers; it cannot move "
                             "emulated TPU layouts (layouts=): use path='raw' or 'auto'")
        _check_dma(caches, cls)
        return DmaMover
    if emulated:
        # The bytes live in emulated TPU memory under the given layouts: only the
        # emulated mover reads them as such, and only where they are proven.
        if path == "raw" and not cls.addressable:
            raise _refusal(cls, specs[first], first)
        return EmulatedMover if path != "staged" and cls.addressable else StagedMover
    if path == "staged":
        return StagedMover
    if path == "auto":
        rule = AUTO_RULES.get(_backend(caches, cls), _OTHER_BACKENDS)
        name = next(name for name in rule if applies[name](cls))
        mover = pinned_mover(_backend(caches, cls)) if name == "pinned" else _MOVERS[name]
        # Raw copies wait for the caches' writers: a call whose caches are still
        # being written takes the pinned programs instead, where there are some.
        if mover is RawMover and applies["pinned"](cls):
            return RawOrPinnedMover
        return mover
    _check_raw(cls, specs, caches)  # path == "raw"
    return RawMover


def _check_raw(cls: SliceClass, specs: Sequence[LayerSpec],
                  caches: Sequence[jax.Array]) -> None:
    """Raises unless raw copies can move every layer of the class."""
    raw_ok = [raw_capable(caches[i]) for i in cls.layers]
    if not all(raw_ok):
        bad = cls.layers[raw_ok.index(False)]
        if not specs[bad].shard_geometry.addressable:
            raise _refusal(cls, specs[bad], bad)
        a = caches[bad]
        raise LayoutError(
            f"Raw path refused for layer {bad}: "
            f"{shape_text(a.shape, a.dtype, specs[bad].layout)} is addressable, but "
            "this backend has no raw path for it (raw copies need XLA:CPU "
            "row-major buffers of whole-byte elements; on TPU use path='pallas' "
            "for the Pallas DMA kernels; pass layouts= to use emulated TPU memory)")
