"""``--target TOPOLOGY`` for ``kvxfer inspect`` and ``kvxfer plan``: layouts from the
real TPU compiler (``kvxfer.tpu``), deviceless, at the block count asked."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvxfer._text import format_bytes, table

__all__ = ["add_target_arguments", "inspect_target", "plan_layers", "source_line",
           "alternatives_lines"]

_TARGET_HELP = ("take layouts from the real TPU compiler for this generation (v4, v5e, "
                "v5p, v6e, tpu7x) or topology (v6e:2x4), deviceless; needs "
                "'kvxfer[tpu]'")


def add_target_arguments(p: argparse.ArgumentParser, *, inspect: bool) -> None:
    """``--target`` (and for ``inspect``, ``--devices``, ``--shard-dim``, ``--num-blocks``)."""
    from kvxfer._check import positive_int

    p.add_argument("--target", metavar="TOPOLOGY", help=_TARGET_HELP)
    if inspect:
        p.add_argument("--devices", type=positive_int, default=1,
                       help="with --target: devices the array (or config) is split over")
        p.add_argument("--shard-dim", type=positive_int,
                       help="with --target --shape: the dim split over --devices "
                       "(default: replicated)")
        p.add_argument("--num-blocks", type=positive_int,
                       help="with --target --config: blocks per layer (default: the "
                       "config's num_device_blocks)")


def source_line(c: Any) -> str:
    """Where a layout came from, in words."""
    return (f"layout from the TPU compiler: {c.target} ({c.device_kind}), libtpu "
            f"{c.libtpu}, {c.num_devices} device{'s' if c.num_devices != 1 else ''}"
            + (f", split along dim {c.shard_dim}" if c.shard_dim is not None else ""))


def _alternatives(c: Any) -> list[dict[str, Any]]:
    from kvxfer import tpu

    if c.geometry().addressable:
        return []
    return [{"shape": list(shape), "layout": str(alt.layout),
             "bytes_per_block": alt.geometry().bytes_per_block,
             "padding_factor": alt.geometry().padding_factor}
            for shape, alt in tpu.addressable_alternatives(
                c.shape, c.dtype, c.target, num_devices=c.num_devices,
                shard_dim=c.shard_dim)]


def alternatives_lines(c: Any, what: str) -> list[str]:
    """For a layout that is not addressable: the nearest shapes that are."""
    alts = _alternatives(c)
    if c.geometry().addressable:
        return []
    if not alts:
        return [f"{what}: not addressable at {c.shape[0]} blocks on {c.target}, and no "
                "nearby shape is (padding the minor dim to 128, a unit dim after the "
                "block dim)"]
    best = alts[0]
    return [f"{what}: not addressable at {c.shape[0]} blocks on {c.target}; the nearest "
            f"shape that is: {best['shape']} ({best['layout']}, "
            f"{format_bytes(best['bytes_per_block'])}/block, padding "
            f"{best['padding_factor']:.2f})"]


def inspect_target(args: argparse.Namespace, row: Any, header: list[str],
                   parse_shape: Any) -> int:
    """``kvxfer inspect --target``: one array (``--shape``), every group of a config, or
    every entry of a catalogue. Bad combinations are ``ValueError``s (one line, exit 2)."""
    from kvxfer import tpu

    _only_where_used(args)
    tpu.require_compiler()
    if args.catalog is not None:
        return _inspect_catalog(args, row, header)
    if args.shape is not None:
        if args.dtype is None:
            raise ValueError("--dtype is required with --shape")
        if args.layout is not None:
            raise ValueError("--layout and --target both say where the layout comes "
                             "from: give one")
        if args.block_dim != 0:
            raise ValueError("--target compiles caches whose block dim is 0")
        items = [("array", tpu.compiled_layout(parse_shape(args.shape), args.dtype,
                                               args.target, num_devices=args.devices,
                                               shard_dim=args.shard_dim))]
    else:
        from kvxfer import config as _config

        spec = _config.load(args.config)
        _, per_group = tpu.compiler_layer_specs(spec, args.target, args.num_blocks,
                                                args.devices)
        items = [(f"{spec.name}/{g.name}", c) for g, c in zip(spec.groups, per_group)]
    if args.json:
        for name, c in items:
            g = c.geometry()
            print(json.dumps({"name": name, **g.as_dict(), **c.as_dict(),
                              "addressable_alternatives": _alternatives(c)}))
        return 0
    print(table([[name] + row(c.geometry()) for name, c in items], ["name"] + header))
    print(source_line(items[0][1]) if len(items) == 1 else
          f"layouts from the TPU compiler: {items[0][1].target} "
          f"({items[0][1].device_kind}), libtpu {items[0][1].libtpu}, per shard")
    for name, c in items:
        for line in alternatives_lines(c, name):
            print(line)
    return 0


def _only_where_used(args: argparse.Namespace) -> None:
    """Refuses an option the source of arrays asked for does not use, rather than
    ignoring it: with --shape the block count is the shape's, with --config the split
    is the config's, and a catalogue's entries are each one replicated array."""
    unused = {"shape": (("num_blocks",), "the block count is the shape's dim 0"),
              "config": (("shard_dim",), "the config says how its layers split"),
              "catalog": (("devices", "shard_dim", "num_blocks"),
                          "each entry is one array, replicated")}
    source = next(s for s in unused if getattr(args, s) is not None)
    options, why = unused[source]
    for option in options:
        value = getattr(args, option)
        if value is not None and not (option == "devices" and value == 1):
            raise ValueError(f"--{option.replace('_', '-')} {value} does not go with "
                             f"--{source} ({why})")


def _inspect_catalog(args: argparse.Namespace, row: Any, header: list[str]) -> int:
    """Each catalogue entry against the compiler's default for its shape."""
    import sys

    from kvxfer import catalog as _catalog
    from kvxfer import tpu
    from kvxfer.layout import inspect

    cat = _catalog.load(args.catalog)
    rows, out, bad = [], [], []
    for e in cat.entries:
        c = tpu.compiled_layout(e.shape, e.dtype, args.target)
        g = inspect(e.shape, e.dtype, c.layout, block_dim=e.block_dim)
        same = str(c.layout) == e.layout
        if same:
            verdict = "the compiler's default"
        elif e.tpu_default_note:
            verdict = "kept on purpose (--json: why)"
        else:
            verdict = f"DIFFERS: the compiler chooses {c.layout}"
            bad.append(e.name)
        rows.append([e.name, e.layout, str(c.layout)] + row(g)[3:] + [verdict])
        out.append({"name": e.name, "layout": e.layout, "compiler_layout": str(c.layout),
                    "compiler_default": same, "note": e.tpu_default_note or None,
                    **{k: v for k, v in c.as_dict().items() if k != "layout"},
                    "addressable": g.addressable, "granularity": g.granularity,
                    "bytes_per_block": g.bytes_per_block, "block_dim": e.block_dim})
    if args.json:
        for o in out:
            print(json.dumps(o))
    else:
        print(table(rows, ["name", "catalogue layout", "compiler's layout"] + header[3:]
                    + ["check"]))
    for name in bad:
        print(f"kvxfer inspect: {name}: not the compiler's layout and no note says why "
              "it is kept", file=sys.stderr)
    return 1 if bad else 0


def plan_layers(spec: Any, args: argparse.Namespace) -> tuple[list[Any], list[str], dict]:
    """The plan's layers, lines that say where each group's layout came from, and the
    JSON fields saying so."""
    n = args.num_blocks or spec.num_device_blocks
    if args.target is None:
        layers = spec.layer_specs(args.num_blocks, num_devices=args.devices,
                                  emulate_tpu=not args.no_tpu_layouts)
        if args.no_tpu_layouts:
            return layers, [], {"layout_source": "row-major"}
        lines, notes, index = [], {}, 0
        for g in spec.groups:
            note = g.compiled_note(n, layers[index].num_shards)
            index += g.count
            if note:
                lines.append(f"{g.name}: {note}")
                notes[g.name] = note
        return layers, lines, {"layout_source": "config", "layout_notes": notes}
    if args.no_tpu_layouts:
        raise ValueError("--no-tpu-layouts and --target both say where layouts come "
                         "from: give one")
    from kvxfer import tpu

    layers, per_group = tpu.compiler_layer_specs(spec, args.target, args.num_blocks,
                                                 args.devices)
    lines = [source_line(per_group[0]).replace("layout", "layouts", 1) + ", per shard, at "
             f"{n} blocks"]
    alternatives = {}
    for g, c in zip(spec.groups, per_group):
        lines += alternatives_lines(c, g.name)
        if not c.geometry().addressable:
            alternatives[g.name] = _alternatives(c)
    return layers, lines, {"layout_source": "compiler", "target": per_group[0].target,
                           "device_kind": per_group[0].device_kind,
                           "libtpu": per_group[0].libtpu, "num_blocks": n,
                           "groups": {g.name: c.as_dict()
                                      for g, c in zip(spec.groups, per_group)},
                           "addressable_alternatives": alternatives}
