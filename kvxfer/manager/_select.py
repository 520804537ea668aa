"""Which mover moves each slice class, from the path asked for and what is proven."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from kvxfer._names import PATHS as PATHS
from kvxfer._names import PathMode as PathMode
from kvxfer.engine import (BlockGroups, DmaMover, DmaOptions, EmulatedMover, GroupedMover,
                           Mover, PallasMover, RawMover, RawOrPinnedMover, ShardedLayer,
                           StagedMover, abstract_layer, dma_refusal, in_place_refusal,
                           pallas_refusal, pinned_capable, pinned_mode, pinned_mover,
                           raw_capable)
from kvxfer.hostpool import HostPool
from kvxfer.layout import LayoutError, shape_text
from kvxfer.plan import LayerSpec, Plan, SliceClass

__all__ = ["PathMode", "PATHS", "AUTO_RULES", "MoverChoice", "check_path", "plan_path",
           "select_movers", "choose_movers", "make_movers"]



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
    # Only routes that copy no payload byte on the host: the pinned mover in place,
    # else its pages route (``pinned_mover``); staged only with ``pinned=False``.
    "tpu": ("pinned", "staged"),
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


SelfCheck = Callable[[Any], "str | None"]
"""Why the DMA mover failed its self-check on a device (None: it passed)."""


def _applies(caches: Sequence[jax.Array], pinned: bool | None, specs: Sequence[LayerSpec],
             emulated: bool, check: SelfCheck | None
             ) -> dict[str, Callable[[SliceClass], str | None]]:
    """Why each mover cannot move a class, or None where it can (``AUTO_RULES`` names
    these)."""
    def pallas(cls: SliceClass) -> str | None:
        refused = pallas_refusal(cls, specs, caches, emulated)
        return None if refused is None else f"layer {refused[0]}: {refused[1]}"

    def dma(cls: SliceClass) -> str | None:
        refused = next((f"layer {i}: {why}" for i in cls.layers
                        if (why := dma_refusal(caches[i])) is not None), None)
        return refused or _self_check(caches, cls, check)

    def raw(cls: SliceClass) -> str | None:
        if all(raw_capable(caches[i]) for i in cls.layers):
            return None
        return ("raw copies need XLA:CPU row-major buffers of whole-byte elements "
                f"({_backend(caches, cls)} backend)")

    def pinned_why(cls: SliceClass) -> str | None:
        if pinned is False:
            return "pinned=False"
        if all(pinned_capable(caches[i]) for i in cls.layers):
            return None
        return f"no 'pinned_host' memory on the {_backend(caches, cls)} backend"

    return {"pallas": pallas, "raw": raw, "dma": dma, "pinned": pinned_why,
            "staged": lambda cls: None}


class MoverChoice(str):
    """A mover's name (what ``mgr.paths`` lists) with why it moves its class.

    Compares and prints as the name; ``reason`` says why: the path asked for, or for
    ``path="auto"`` why each mover before it in ``AUTO_RULES`` did not apply.

    Example:
        >>> c = MoverChoice("pinned", "auto: not pallas (bf16 elements ...)")
        >>> c == "pinned", c.reason.startswith("auto")
        (True, True)
    """

    reason: str

    def __new__(cls, name: str, reason: str) -> MoverChoice:
        out = super().__new__(cls, name)
        out.reason = reason
        return out

    def __reduce__(self):
        return MoverChoice, (str(self), self.reason)


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


def _self_check(caches: Sequence[jax.Array], cls: SliceClass, check: SelfCheck | None
                ) -> str | None:
    """Why the DMA mover's self-check failed on the devices of ``cls`` (None: passed):
    one device of each kind among this process's checks."""
    if check is None:
        return None
    kinds: dict[str, Any] = {}
    for device in sorted(caches[cls.layers[0]].sharding.device_set, key=lambda d: d.id):
        if device.process_index == jax.process_index():
            kinds.setdefault(device.device_kind, device)
    for device in kinds.values():
        why = check(device)
        if why is not None:
            return f"its self-check failed on {device}: {why}"
    return None


def _check_dma(caches: Sequence[jax.Array], cls: SliceClass, check: SelfCheck | None
               ) -> None:
    for i in cls.layers:
        why = dma_refusal(caches[i])
        if why is not None:
            raise LayoutError(f"DMA path refused for {cls.name} (layers {list(cls.layers)}), "
                              f"layer {i}: {why}; use path='pinned', 'staged' or 'auto'")
    why = _self_check(caches, cls, check)
    if why is not None:
        raise ValueError(f"path='dma' refused for {cls.name}: {why}; use path='pinned' or "
                         "'auto'")


def select_movers(plan: Plan, specs: Sequence[LayerSpec], caches: Sequence[jax.Array],
                  path: PathMode, emulated: bool, pinned: bool | None = None
                  ) -> list[type[Mover]]:
    """The mover type of each slice class of ``plan`` (``choose_movers`` without reasons)."""
    return [mover for mover, _ in choose_movers(plan, specs, caches, path, emulated, pinned)]


def choose_movers(plan: Plan, specs: Sequence[LayerSpec], caches: Sequence[jax.Array],
                  path: PathMode, emulated: bool, pinned: bool | None = None,
                  self_check: SelfCheck | None = None, pinned_route: str | None = None
                  ) -> list[tuple[type[Mover], str]]:
    """The mover type of each slice class of ``plan``, and why.

    Args:
      plan: the manager's plan.
      specs: each layer's spec (with the layout the manager assumes).
      caches: the caches, for what the backend's buffers allow (``jax.Array``, or
        ``jax.ShapeDtypeStruct`` with a sharding to choose for devices not at hand).
      path: what was asked for.
      emulated: the layouts are emulated TPU layouts (``layouts=`` on CPU).
      pinned: the manager's ``pinned=`` (False keeps ``auto`` off the pinned mover).
      self_check: why the DMA mover failed its self-check on a device (None: it did
        not; the manager's runs with its ``DmaOptions``); None: no check.
      pinned_route: the manager's ``pinned_route=`` (None: the platform's route).

    Raises:
      LayoutError: ``path="raw"`` over a class with no proven raw copy, or
        ``path="pallas"`` over a class the Pallas kernels may not move, naming the
        class, the layer, its shard geometry and the rule that failed.
      ValueError: ``path="pinned"`` on a backend without ``pinned_host`` memory (or
        with ``pinned=False``), naming the backend.
    """
    applies = _applies(caches, pinned, specs, emulated, self_check)
    return [_select_class(cls, specs, caches, path, emulated, pinned, applies, self_check,
                          pinned_route) for cls in plan.classes]


def _select_class(cls: SliceClass, specs: Sequence[LayerSpec], caches: Sequence[jax.Array],
                  path: PathMode, emulated: bool, pinned: bool | None,
                  applies: dict[str, Callable[[SliceClass], str | None]],
                  self_check: SelfCheck | None, route: str | None = None
                  ) -> tuple[type[Mover], str]:
    """The mover type of one slice class, and why (``choose_movers``)."""
    first = cls.layers[0]
    asked = f"path={path!r}"
    if path == "pallas":
        refused = pallas_refusal(cls, specs, caches, emulated)
        if refused is not None:
            layer, reason = refused
            shard = "" if cls.num_shards == 1 else f" (one shard of {cls.num_shards})"
            raise LayoutError(f"Pallas path refused for {cls.name} (layers "
                              f"{list(cls.layers)}), layer {layer}{shard}: {reason}")
        return PallasMover, asked
    if path == "pinned":
        _check_pinned(caches, cls, pinned)
        return _pinned_choice(caches, cls, asked, route)
    if path == "dma":
        if emulated:
            raise ValueError("path='dma' copies the arrays' own buffers; it cannot move "
                             "emulated TPU layouts (layouts=): use path='raw' or 'auto'")
        _check_dma(caches, cls, self_check)
        return DmaMover, asked
    if emulated:
        # The bytes live in emulated TPU memory under the given layouts: only the
        # emulated mover reads them as such, and only where they are proven.
        if path == "raw" and not cls.addressable:
            raise _refusal(cls, specs[first], first)
        if path != "staged" and cls.addressable:
            return EmulatedMover, f"{asked}: emulated TPU memory, proven addressable"
        return StagedMover, asked if path == "staged" else \
            f"{asked}: emulated TPU memory, not addressable: " \
            f"{specs[first].shard_geometry.reason}"
    if path == "staged":
        return StagedMover, asked
    if path == "auto":
        backend = _backend(caches, cls)
        rule = AUTO_RULES.get(backend, _OTHER_BACKENDS)
        skipped = []
        for name in rule:
            why = applies[name](cls)
            if why is None:
                break
            skipped.append(f"not {name}: {why}")
        reason = f"auto on {backend}" + "".join(f"; {s}" for s in skipped)
        if name == "pinned":
            return _pinned_choice(caches, cls, reason, route)
        mover = _MOVERS[name]
        # Raw copies wait for the caches' writers: a call whose caches are still
        # being written takes the pinned programs instead, where there are some.
        if mover is RawMover and applies["pinned"](cls) is None:
            return RawOrPinnedMover, reason
        return mover, reason
    _check_raw(cls, specs, caches)  # path == "raw"
    return RawMover, asked


def _pinned_choice(caches: Sequence[jax.Array], cls: SliceClass, reason: str,
                   route: str | None = None) -> tuple[type[Mover], str]:
    """The pinned mover's route for a class (in place, else pages), and why."""
    backend = _backend(caches, cls)
    first = caches[cls.layers[0]]
    shards = abstract_layer(first).shards
    live = isinstance(first, jax.Array)  # abstract caches: compiling ahead, deviceless
    mover = pinned_mover(backend, shards, live, route)
    if mover.pinned_pool:
        return mover, f"{reason}; in place"
    why = in_place_refusal(backend, shards, live) if pinned_mode(backend, route) == \
        "in-place" else f"pinned_route={route!r}" if route else "not on this backend"
    return mover, f"{reason}; pages route: not in place: {why}"


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


def make_movers(plan: Plan, caches: list[jax.Array], mover_types: list[type[Mover]],
                     pinned: bool | None, layers: list[ShardedLayer], dma: DmaOptions
                     ) -> tuple[HostPool, list[Mover[Any, Any, Any]]]:
    """The host pool of ``plan`` and each slice class's mover, of the types chosen
    (``choose_movers``); ``layers`` are abstract."""
    # A class whose mover reads and writes pinned memory gets its pool in the
    # pinned memory of the device holding its first shard; a mover may allocate
    # its class's pool itself (the Pallas kernels write a typed host array).
    firsts = [ShardedLayer.of(caches[c.layers[0]]).shards[0][0] for c in plan.classes]
    pool = HostPool(
        plan, pinned=[True if m.pinned_pool else pinned for m in mover_types],
        device=[next(iter(a.devices())) for a in firsts],
        backings={c.index: m.host_backing(c, [layers[i] for i in c.layers])
                  for m, c in zip(mover_types, plan.classes)})
    movers: list[Mover[Any, Any, Any]] = [m(cls, p, dma) if m is DmaMover else m(cls, p)
                                          for m, cls, p in
                                          zip(mover_types, plan.classes, pool.pools)]
    for c in plan.classes:  # a block dim sharded over data parallelism
        groups = BlockGroups.of(caches[c.layers[0]], f"layer {c.layers[0]}")
        if groups is not None:
            movers[c.index] = GroupedMover(movers[c.index], groups)
    return pool, movers
