"""Slice classes and the host-memory plan, checked against a budget before allocation.

Layers whose blocks have the same dtype, block shape, sharding and device geometry
form a *slice class*. Each class gets its own host pool, sized
``num_host_blocks × layers_in_class × bytes_per_block`` and stored page-first (one
slot holds one block index across every layer of the class). Inside a page the
layout is shard-major: each shard's blocks of every layer sit side by side
(``SliceClass.shard_range``), so a shard's part of a page is one contiguous range,
which a mover copying shard by shard moves as one copy rather than one per layer
(small strided copies run copy engines at a fraction of the link). No size or offset
is derived from another class's layers.

Example:
    >>> from kvxfer.plan import LayerSpec, make_plan
    >>> layers = [LayerSpec(f"L{i}", (512, 3, 2048), "bfloat16", "{2,0,1:T(8,128)(2,1)}")
    ...           for i in range(20)]
    >>> make_plan(layers, num_host_blocks=1886, path="staged").total_host_bytes // 2**20
    442
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any, get_args

from kvxfer._check import check_int
from kvxfer._names import PlanPath as Path
from kvxfer._text import format_bytes, table
from kvxfer.layout import Layout, SliceGeometry, dtype_name, dtype_of, inspect, shape_text

__all__ = ["BudgetError", "LayerSpec", "SliceClass", "Plan", "make_plan",
           "default_host_memory_budget", "DEFAULT_BUDGET_FRACTION", "Path",
           "RUNTIME_BYTES_PER_DEVICE"]


# The default budget leaves room for the serving engine's own host memory.
DEFAULT_BUDGET_FRACTION = 0.5

RUNTIME_BYTES_PER_DEVICE = 24 << 20
"""Host memory a JAX process holds per device beyond the arrays a command sizes (each
device's programs and their buffers; on XLA:CPU, where a command creates the devices it
is asked for, about 18 MB a device for ``kvxfer probe`` and 10 MB for ``kvxfer
demo``): the probe and the demo count it before they start."""


class BudgetError(MemoryError):
    """A plan needs more host memory than its budget; nothing was allocated."""


def available_host_memory() -> int:
    """Bytes of host memory available now (``MemAvailable``, else physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_host_memory_budget() -> int:
    """``DEFAULT_BUDGET_FRACTION`` of the host memory available now."""
    return int(available_host_memory() * DEFAULT_BUDGET_FRACTION)


@dataclasses.dataclass(frozen=True, slots=True)
class LayerSpec:
    """What the plan needs to know about one layer's KV cache array.

    Attributes:
      name: for messages and tables.
      shape: the full (global) array shape, block dim first.
      dtype: dtype name or dtype.
      layout: the device layout (real or emulated TPU); None for row-major.
      block_dim: the block dim (kvxfer moves blocks along dim 0; see ``validate``).
      num_shards: distinct shards the array is split into (1 when unsharded or
        replicated); each shard holds ``1/num_shards`` of every block.
      replicas: devices holding each shard (2+ when replicated under tensor parallelism).
      shard_shape: the shape of one shard (default: the whole shape when unsharded).
        On TPU each shard is laid out, tiled and padded on its own, so device
        geometry is computed per shard.
      placement: where the shards live (e.g. device ids per shard); layers placed
        differently never share a slice class, because a class moves together.
      block_groups: ranges the block dim is split into (2+ when the page axis is
        sharded over data parallelism); each holds ``shape[0] // block_groups``
        blocks, split into ``num_shards`` shards like the whole array.
    """

    name: str
    shape: tuple[int, ...]
    dtype: Any
    layout: Layout | str | None = None
    block_dim: int = 0
    num_shards: int = 1
    replicas: int = 1
    shard_shape: tuple[int, ...] | None = None
    placement: tuple = ()
    block_groups: int = 1

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        layout = self.layout
        if isinstance(layout, str):
            layout = Layout.parse(layout)
        object.__setattr__(self, "layout", layout or Layout.row_major(len(self.shape)))
        if self.block_dim != 0:
            raise ValueError(f"layer {self.name}: block_dim={self.block_dim}; kvxfer caches "
                             "keep the block dim first (dim 0)")
        if len(self.shape) < 1 or self.shape[0] < 1:
            raise ValueError(f"layer {self.name}: shape {list(self.shape)} has no blocks")
        if self.num_shards < 1 or self.replicas < 1 or self.block_groups < 1:
            raise ValueError(f"layer {self.name}: num_shards={self.num_shards}, "
                             f"replicas={self.replicas} and block_groups="
                             f"{self.block_groups} must be >= 1")
        if self.shard_shape is None:
            if self.num_shards > 1 or self.block_groups > 1:
                raise ValueError(f"layer {self.name}: num_shards={self.num_shards} needs "
                                 "shard_shape (the shape of one shard)")
            object.__setattr__(self, "shard_shape", self.shape)
        shard_shape = tuple(int(d) for d in self.shard_shape)
        object.__setattr__(self, "shard_shape", shard_shape)
        if len(shard_shape) != len(self.shape) or \
                shard_shape[0] * self.block_groups != self.shape[0]:
            raise ValueError(f"layer {self.name}: shard_shape {list(shard_shape)} must keep "
                             f"1/{self.block_groups} of the blocks of shape "
                             f"{list(self.shape)} (dim 0 split into block_groups)")

    @property
    def num_blocks(self) -> int:
        return self.shape[0]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def geometry(self) -> SliceGeometry:
        """The verdict for the whole array."""
        return inspect(self.shape, self.dtype, self.layout, block_dim=0)

    @property
    def shard_geometry(self) -> SliceGeometry:
        """The verdict for one shard, as each device lays it out."""
        return inspect(self.shard_shape, self.dtype, self.layout, block_dim=0)

    @property
    def logical_block_bytes(self) -> int:
        """Dense bytes of one block as the staged path stores it on the host."""
        return math.prod(self.block_shape) * dtype_of(self.dtype).itemsize

    def host_block_bytes(self, path: Path) -> int:
        """Host bytes one block of this layer takes on ``path`` (all shards)."""
        if path == "staged" or (path == "auto" and not self.shard_geometry.addressable):
            return self.logical_block_bytes
        # A raw copy moves each shard's device bytes, and whole granularity groups
        # of them: to keep one block on the host it must keep the group that holds it.
        return self.device_block_bytes * self.num_shards

    @property
    def device_block_bytes(self) -> int:
        """Device bytes one block of one shard takes (its group when not addressable)."""
        g = self.shard_geometry
        return g.bytes_per_block if g.addressable else g.group_bytes

    def class_key(self) -> tuple:
        g = self.shard_geometry
        return (self.dtype, self.block_shape, self.shard_shape, str(self.layout),
                self.num_shards, self.replicas, self.placement, g.addressable,
                g.bytes_per_block, g.group_bytes, self.block_groups)


@dataclasses.dataclass(frozen=True, slots=True)
class SliceClass:
    """One slice class and its host pool size.

    Attributes:
      index: position in the plan.
      layers: indices of the member layers in the manager's layer order.
      layer_names: their names.
      dtype, block_shape, layout, num_shards, replicas: shared by every member.
      bytes_per_block: host bytes of one block of one layer (all shards).
      device_bytes_per_block: device bytes of one block of one shard under the layout
        (padding included), or the group bytes when the layout is not addressable.
      addressable: whether blocks are contiguous on the device (per shard).
      granularity: the layout's granularity.
      padding_factor: device physical / logical bytes.
      page_bytes: bytes of one host slot (every layer of the class).
      host_bytes: ``num_host_blocks × page_bytes``.
    """

    index: int
    layers: tuple[int, ...]
    layer_names: tuple[str, ...]
    dtype: str
    block_shape: tuple[int, ...]
    layout: Layout
    num_shards: int
    replicas: int
    bytes_per_block: int
    device_bytes_per_block: int
    addressable: bool
    granularity: int
    padding_factor: float
    page_bytes: int
    host_bytes: int

    @property
    def name(self) -> str:
        return f"c{self.index}:{shape_text(self.block_shape, self.dtype)}"

    @property
    def shard_block_bytes(self) -> int:
        return self.bytes_per_block // self.num_shards

    def shard_range(self, pos: int, shard: int) -> tuple[int, int]:
        """Byte range of shard ``shard`` of layer position ``pos`` inside a page.

        Pages are shard-major: shard ``s``'s blocks of every layer sit side by side
        (``shard_span``), layer by layer, so a shard's part of a page is one range.

        Example:
            >>> plan = make_plan([LayerSpec(f"L{i}", (8, 4, 128), "float32", num_shards=2,
            ...                             shard_shape=(8, 2, 128)) for i in range(3)], 4)
            >>> c = plan.classes[0]
            >>> c.shard_block_bytes, c.shard_range(1, 0), c.shard_range(0, 1)
            (1024, (1024, 2048), (3072, 4096))
        """
        size = self.shard_block_bytes
        start = shard * len(self.layers) * size + pos * size
        return start, start + size

    def shard_span(self, shard: int) -> tuple[int, int]:
        """Byte range of shard ``shard``'s blocks of every layer inside a page.

        Example:
            >>> plan = make_plan([LayerSpec(f"L{i}", (8, 4, 128), "float32", num_shards=2,
            ...                             shard_shape=(8, 2, 128)) for i in range(3)], 4)
            >>> plan.classes[0].shard_span(1)
            (3072, 6144)
        """
        size = len(self.layers) * self.shard_block_bytes
        return shard * size, (shard + 1) * size


_HOST_FORMAT: dict[str, str] = {
    "staged": "host blocks hold dense logical bytes",
    "raw": "host blocks hold device bytes",
    "auto": "host blocks hold device bytes where addressable, else dense logical bytes",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """The host-memory plan: slice classes, their pool sizes, totals and budget.

    Attributes:
      classes: the slice classes, each with its pool size.
      num_host_blocks: host slots (pages).
      path: how host blocks are sized (``Path``), not which mover moves them.
      budget: the host-memory budget the plan was checked against.
      num_layers: layers in the plan.
      movers: the mover of each class (``"raw"``, ``"pinned"``, ...) once a
        ``KVCacheManager`` chose them; empty for a plan made on its own, which
        knows only how it sizes host blocks.
    """

    classes: tuple[SliceClass, ...]
    num_host_blocks: int
    path: Path
    budget: int
    num_layers: int
    movers: tuple[str, ...] = ()

    @property
    def total_host_bytes(self) -> int:
        return sum(c.host_bytes for c in self.classes)

    @property
    def page_bytes(self) -> int:
        """Host bytes of one page (one block index across every layer)."""
        return sum(c.page_bytes for c in self.classes)

    def class_of_layer(self, layer: int) -> tuple[SliceClass, int]:
        """(class, position of the layer inside the class)."""
        for c in self.classes:
            if layer in c.layers:
                return c, c.layers.index(layer)
        raise IndexError(f"layer {layer} is not in the plan (0..{self.num_layers - 1})")

    def as_dict(self) -> dict[str, Any]:
        out = {
            "path": self.path,
            "num_host_blocks": self.num_host_blocks,
            "num_layers": self.num_layers,
            "total_host_bytes": self.total_host_bytes,
            "page_bytes": self.page_bytes,
            "budget_bytes": self.budget,
            "classes": [{
                "name": c.name, "layers": list(c.layers), "dtype": c.dtype,
                "block_shape": list(c.block_shape), "layout": str(c.layout),
                "num_shards": c.num_shards, "replicas": c.replicas,
                "bytes_per_block": c.bytes_per_block,
                "device_bytes_per_block": c.device_bytes_per_block,
                "addressable": c.addressable, "granularity": c.granularity,
                "padding_factor": c.padding_factor, "page_bytes": c.page_bytes,
                "host_bytes": c.host_bytes} for c in self.classes],
        }
        for c, mover in zip(out["classes"], self.movers):
            c["mover"] = mover
        return out

    def __str__(self) -> str:
        """A table of the classes, then the total and the budget (in bytes too, as
        given: ``--budget 64G`` shows 68719476736); the mover column only once a
        manager chose the movers (a plan alone says how it sizes host blocks)."""
        rows = []
        for i, c in enumerate(self.classes):
            layers = _ranges_text(c.layers)
            rows.append([c.name, f"{len(c.layers)} ({layers})", str(c.layout),
                         format_bytes(c.bytes_per_block), format_bytes(c.host_bytes),
                         f"{c.padding_factor:.2f}",
                         "yes" if c.addressable else f"no (g={c.granularity})"]
                        + ([self.movers[i]] if self.movers else []))
        text = table(rows, ["class", "layers", "device layout", "bytes/block", "host bytes",
                            "padding", "addressable"] + (["mover"] if self.movers else []))
        return (f"{text}\ntotal: {format_bytes(self.total_host_bytes)} of host memory for "
                f"{self.num_host_blocks} host blocks x {self.num_layers} layers "
                f"({_HOST_FORMAT[self.path]})\nbudget: {format_bytes(self.budget)} "
                f"({self.budget} bytes)")


def _ranges_text(items: Sequence[int]) -> str:
    out, start = [], None
    for i, v in enumerate(items):
        if start is None:
            start = v
        if i + 1 == len(items) or items[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


def make_plan(layers: Sequence[LayerSpec], num_host_blocks: int, *, path: Path = "staged",
              host_memory_budget: int | None = None) -> Plan:
    """Groups layers into slice classes and sizes each class's host pool.

    Args:
      layers: one spec per layer, in the manager's order.
      num_host_blocks: host slots (pages) to provision.
      path: ``"staged"`` stores dense logical blocks; ``"raw"`` stores the device
        bytes a raw copy moves (whole granularity groups when not addressable);
        ``"auto"`` stores device bytes for addressable layers and dense blocks for the
        rest.
      host_memory_budget: bytes; default ``default_host_memory_budget()``.

    Returns:
      The plan. Nothing is allocated.

    Raises:
      BudgetError: the plan needs more than the budget (the message says how much).
      ValueError: bad arguments.

    Example:
      >>> make_plan([LayerSpec("L0", (64, 16, 8, 128), "bf16")], 8).total_host_bytes
      262144
    """
    if path == "direct":
        raise ValueError("path='direct' is now called path='raw' (the device bytes a raw "
                         "copy moves); pass path='raw'")
    if path not in get_args(Path):
        raise ValueError(f"path={path!r}; expected one of {get_args(Path)}")
    num_host_blocks = check_int(num_host_blocks, "num_host_blocks", minimum=1)
    if not layers:
        raise ValueError("a plan needs at least one layer")
    budget = default_host_memory_budget() if host_memory_budget is None else \
        check_int(host_memory_budget, "host_memory_budget", minimum=0)
    groups: dict[tuple, list[int]] = {}
    for i, spec in enumerate(layers):
        groups.setdefault(spec.class_key(), []).append(i)
    classes = []
    for index, members in enumerate(groups.values()):
        spec = layers[members[0]]
        g = spec.shard_geometry
        bpb = spec.host_block_bytes(path)
        page = bpb * len(members)
        classes.append(SliceClass(
            index=index, layers=tuple(members),
            layer_names=tuple(layers[m].name for m in members), dtype=spec.dtype,
            block_shape=spec.block_shape, layout=spec.layout, num_shards=spec.num_shards,
            replicas=spec.replicas, bytes_per_block=bpb,
            device_bytes_per_block=spec.device_block_bytes,
            addressable=g.addressable, granularity=g.granularity,
            padding_factor=g.padding_factor, page_bytes=page,
            host_bytes=page * num_host_blocks))
    plan = Plan(tuple(classes), num_host_blocks, path, budget, len(layers))
    if plan.total_host_bytes > budget:
        detail = "; ".join(f"{c.name} x{len(c.layers)} layers at "
                           f"{format_bytes(c.bytes_per_block)}/block = "
                           f"{format_bytes(c.host_bytes)}" for c in classes)
        raise BudgetError(
            f"host plan needs {format_bytes(plan.total_host_bytes)} "
            f"({plan.total_host_bytes} bytes) for {num_host_blocks} host blocks "
            f"({_HOST_FORMAT[path]}), over the budget of {format_bytes(budget)} "
            f"({budget} bytes); "
            f"nothing was allocated. Per class: {detail}")
    return plan
