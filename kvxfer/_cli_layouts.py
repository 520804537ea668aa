"""Where ``kvxfer inspect`` and ``kvxfer plan`` take layouts from, and their reports:
one ``kvxfer.layout_source.LayoutSource`` chosen from the options (``--target``,
``--layout``, ``--no-tpu-layouts``, else the config's or catalogue's own), then the
same report whatever the source. Imports no numpy until a command runs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvxfer._text import format_bytes, table

__all__ = ["add_source_arguments", "source_of", "inspect_shape", "inspect_config",
           "inspect_catalog", "plan_layers"]

_TARGET_HELP = ("take layouts from the real TPU compiler for this generation (v4, v5e, "
                "v5p, v6e, tpu7x) or topology (v6e:2x4), deviceless, in a worker process; "
                "needs 'kvxfer[tpu]'")


def add_source_arguments(p: argparse.ArgumentParser, *, inspect: bool) -> None:
    """``--target`` (and for ``inspect``, ``--devices``, ``--shard-dim``, ``--num-blocks``)."""
    from kvxfer._check import positive_int

    p.add_argument("--target", metavar="TOPOLOGY", help=_TARGET_HELP)
    if inspect:
        p.add_argument("--devices", type=positive_int, default=1,
                       help="devices the array (or config) is split over; the verdict is "
                       "one shard's")
        p.add_argument("--shard-dim", type=positive_int,
                       help="with --shape: the dim split over --devices (default: "
                       "replicated)")
        p.add_argument("--num-blocks", type=positive_int,
                       help="with --config: blocks per layer (default: the config's "
                       "num_device_blocks)")


def source_of(args: argparse.Namespace, data: Any = None) -> Any:
    """The layout source the options name: ``--target`` (the compiler), ``--layout`` (a
    given layout), ``--no-tpu-layouts`` (row-major), else ``data``'s own (a config's or
    a catalogue's), else row-major. Two of them at once are a ``ValueError``."""
    from kvxfer import catalog, config, layout_source

    named = [(flag, value) for flag, value in (
        ("--target", args.target), ("--layout", getattr(args, "layout", None)),
        ("--no-tpu-layouts", getattr(args, "no_tpu_layouts", False) or None))
        if value is not None]
    if len(named) > 1:
        raise ValueError(f"{named[1][0]} and {named[0][0]} both say where the layout comes "
                         "from: give one")
    flag, value = named[0] if named else (None, None)
    if flag == "--target":
        return layout_source.Compiler(value)
    if flag is None and isinstance(data, config.ModelSpec):
        return layout_source.ConfigLayouts(data)
    if flag is None and isinstance(data, catalog.Catalog):
        return layout_source.CatalogLayouts(data)
    return layout_source.Given(value if flag == "--layout" else None)


def _source_lines(source: Any, got: list[Any], names: list[str], at: str = "") -> list[str]:
    """Where the layouts came from, the source's note on each, and for each that is not
    addressable where the source looked for better, the nearest shape that is."""
    lines = [line + at for line in [source.describe(got)] if line]
    for name, s in zip(names, got):
        if s.note:
            lines.append(f"{name}: {s.note}")
        if s.alternatives is None or s.geometry().addressable:
            continue
        where = s.facts.get("target", source.name)
        if not s.alternatives:
            lines.append(f"{name}: not addressable at {s.array.shape[0]} blocks on {where}, "
                         "and no nearby shape is (padding the minor dim to 128, a unit dim "
                         "after the block dim)")
            continue
        best, g = s.alternatives[0], s.alternatives[0].geometry()
        lines.append(f"{name}: not addressable at {s.array.shape[0]} blocks on {where}; the "
                     f"nearest shape that is: {list(best.array.shape)} ({best.layout}, "
                     f"{format_bytes(g.bytes_per_block)}/block, padding "
                     f"{g.padding_factor:.2f})")
    return lines


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


def inspect_shape(args: argparse.Namespace, row: Any, header: list[str],
                  shape: tuple[int, ...]) -> int:
    """``kvxfer inspect --shape``: one array, laid out by the source asked."""
    from kvxfer.layout_source import ArraySpec

    _only_where_used(args)
    source = source_of(args)
    array = ArraySpec(shape, args.dtype, args.devices, args.shard_dim,
                      block_dim=args.block_dim)
    (s,) = source.layouts([array])
    g = s.geometry()
    if args.json:
        print(json.dumps({**g.as_dict(), **s.as_dict()}))
        return 0
    print(table([row(g)], header))
    print(g.reason)
    for line in _source_lines(source, [s], ["array"]):
        print(line)
    return 0


def inspect_config(args: argparse.Namespace, row: Any, header: list[str]) -> int:
    """``kvxfer inspect --config``: every layer, as the source lays out one shard of it;
    identical layers share one row (a slice class)."""
    from kvxfer import config as _config
    from kvxfer.layout import inspect
    from kvxfer.layout_source import config_layer_specs

    _only_where_used(args)
    spec = _config.load(args.config)
    source = source_of(args, spec)
    layers, got = config_layer_specs(spec, source, args.num_blocks, args.devices)
    group = [i for i, g in enumerate(spec.groups) for _ in range(g.count)]
    found = [inspect(ls.shard_shape, ls.dtype, ls.layout) for ls in layers]
    classes: dict[tuple, list[int]] = {}
    for i, g in enumerate(found):
        classes.setdefault((g.text, g.block_dim), []).append(i)
    class_of = {i: c for c, members in enumerate(classes.values()) for i in members}
    if args.json:
        for i, (ls, g) in enumerate(zip(layers, found)):
            print(json.dumps({"layer": i, "name": ls.name, "slice_class": class_of[i],
                              **g.as_dict(), **got[group[i]].as_dict()}))
        return 0
    rows = [[f"class {c}", _layer_list(members)] + row(found[members[0]])
            for c, members in enumerate(classes.values())]
    print(f"{spec.name}: {spec.num_layers} layers in {len(classes)} slice class"
          f"{'es' if len(classes) != 1 else ''}")
    print(table(rows, ["slice class", "layers"] + header))
    for line in _source_lines(source, got, [g.name for g in spec.groups]):
        print(line)
    return 0


def _layer_list(members: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2,5'``."""
    out, start = [], members[0]
    for a, b in zip(members, members[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def inspect_catalog(args: argparse.Namespace, row: Any, header: list[str]) -> int:
    """``kvxfer inspect --catalog``: each entry's expected verdict, and the entry against
    the source's layout for its shape (the catalogue's own unless another is asked):
    an entry the source lays out otherwise must say why it is kept."""
    from kvxfer import catalog as _catalog
    from kvxfer.layout import Layout
    from kvxfer.layout_source import ArraySpec

    _only_where_used(args)
    cat = _catalog.load(args.catalog)
    source = source_of(args, cat)
    # The source is asked of each entry's shape; the entry's block dim is its own.
    got = source.layouts([ArraySpec(e.shape, e.dtype, name=e.name) for e in cat.entries])
    rows, bad = [], []
    for r, s in zip(cat.check(), got):
        e, same = r.entry, s.layout == Layout.parse(r.entry.layout)
        check = "ok" if r.agrees else "DISAGREES: " + r.disagreement
        if not same:
            check = (f"kept on purpose (--json: why); the {source.name} chooses {s.layout}"
                     if e.tpu_default_note else f"DIFFERS: the {source.name} chooses {s.layout}")
        if not r.agrees:
            bad.append(f"{e.name}: {r.disagreement}")
        if not same and not e.tpu_default_note:
            bad.append(f"{e.name}: not the {source.name}'s layout and no note says why it "
                       "is kept")
        if args.json:
            extra = {} if same and not s.facts else {
                "source_layout": str(s.layout), "source_default": same,
                "note": e.tpu_default_note or None, **s.as_dict()}
            print(json.dumps({"name": e.name, **r.geometry.as_dict(), "source": e.source,
                              "expected": dict(e.expected), "matches": r.agrees,
                              "disagreement": r.disagreement or None, **extra}))
        rows.append([e.name] + row(r.geometry) + [e.source, check])
    if not args.json:
        print(table(rows, ["name"] + header + ["source", "check"]))
        if source.describe(got):
            print(source.describe(got))
    for line in bad:
        print(f"kvxfer inspect: {line}", file=sys.stderr)
    return 1 if bad else 0


def plan_layers(spec: Any, args: argparse.Namespace) -> tuple[list[Any], list[str], dict]:
    """The plan's layers as the source lays them out, lines that say where each group's
    layout came from, and the JSON fields saying so."""
    from kvxfer.layout_source import config_layer_specs

    source = source_of(args, spec)
    n = args.num_blocks or spec.num_device_blocks
    layers, got = config_layer_specs(spec, source, args.num_blocks, args.devices)
    names = [g.name for g in spec.groups]
    lines = _source_lines(source, got, names, at=f", at {n} blocks")
    facts = {k: v for k, v in got[0].facts.items() if k in ("target", "device_kind", "libtpu")}
    return layers, lines, {
        "layout_source": source.name, **facts, "num_blocks": n,
        "groups": {name: s.as_dict() for name, s in zip(names, got)},
        "layout_notes": {name: s.note for name, s in zip(names, got) if s.note},
        "addressable_alternatives": {name: s.as_dict()["addressable_alternatives"]
                                     for name, s in zip(names, got)
                                     if s.alternatives is not None
                                     and not s.geometry().addressable}}
