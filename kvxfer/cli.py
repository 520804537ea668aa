"""The ``kvxfer`` command line: inspect | plan | probe | bench | demo.

Every command has ``--json``. Bad input exits 2 with one line on stderr; a valid
array that is not addressable is a verdict, not an error (exit 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvxfer import catalog as _catalog
from kvxfer._text import format_bytes, table
from kvxfer.layout import LayoutError, SliceGeometry, inspect

__all__ = ["main", "format_bytes"]


class UsageError(Exception):
    """Bad input on the command line: reported on one line, exit status 2."""


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.replace("[", "").replace("]", "").split(",")
                      if s.strip())
    except ValueError:
        raise UsageError(f"--shape {text!r} must be comma-separated integers, "
                         "e.g. 512,3,2048") from None
    if not shape or any(d < 0 for d in shape):
        raise UsageError(f"--shape {text!r} must list one or more non-negative sizes")
    return shape


def _geometry_row(g: SliceGeometry) -> list[Any]:
    return [g.text, g.block_dim, format_bytes(g.physical_bytes),
            format_bytes(g.bytes_per_block), g.granularity, f"{g.padding_factor:.2f}",
            "addressable" if g.addressable else "NOT addressable"]


_GEOMETRY_HEADER = ["array", "block_dim", "physical", "bytes/block", "granularity",
                    "padding", "verdict"]


def _cmd_inspect(args: argparse.Namespace) -> int:
    sources = [args.catalog is not None, args.shape is not None, args.config is not None]
    if sum(sources) != 1:
        raise UsageError("give exactly one of --shape (with --dtype and --layout), "
                         "--catalog FILE or --config FILE")
    if args.shape is not None:
        if args.dtype is None:
            raise UsageError("--dtype is required with --shape")
        g = inspect(_parse_shape(args.shape), args.dtype, args.layout,
                    block_dim=args.block_dim)
        if args.json:
            print(json.dumps(g.as_dict()))
        else:
            print(table([_geometry_row(g)], _GEOMETRY_HEADER))
            print(g.reason)
        return 0
    if args.config is not None:
        from kvxfer import config as _config

        spec = _config.load(args.config)
        geos = [g for _, g in spec.inspect_layers()]
        if args.json:
            for g in geos:
                print(json.dumps(g.as_dict()))
        else:
            print(table([_geometry_row(g) for g in geos], _GEOMETRY_HEADER))
        return 0
    cat = _catalog.load(args.catalog)
    results = cat.check()
    if args.json:
        for r in results:
            print(json.dumps(r.geometry.as_dict()))
    else:
        rows = [[r.entry.name] + _geometry_row(r.geometry) +
                [r.entry.source, "ok" if r.agrees else "DISAGREES: " + r.disagreement]
                for r in results]
        print(table(rows, ["name"] + _GEOMETRY_HEADER + ["source", "check"]))
    bad = [r for r in results if not r.agrees]
    for r in bad:
        print(f"kvxfer inspect: {r.entry.name}: {r.disagreement}", file=sys.stderr)
    return 1 if bad else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvxfer",
        description="Verified KV-cache transfers between accelerator and host memory.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="prove whether KV blocks are contiguous byte ranges",
                       description="Reads an XLA layout and reports, per array, whether "
                       "each block (one index of the block dim) is one contiguous byte "
                       "range, the bytes per block and the granularity.")
    p.add_argument("--shape", help="logical shape, e.g. 512,3,2048")
    p.add_argument("--dtype", help="e.g. bfloat16, bf16, int8, float8_e4m3fn, int4")
    p.add_argument("--layout", help="XLA layout text, e.g. '{2,0,1:T(8,128)(2,1)}' "
                   "(default row-major)")
    p.add_argument("--block-dim", type=int, default=0, help="the block dim (default 0)")
    p.add_argument("--catalog", help="a layouts/ catalogue: check every entry's verdict")
    p.add_argument("--config", help="a configs/ model spec: inspect every layer's cache")
    p.add_argument("--json", action="store_true", help="one JSON object per array")
    p.set_defaults(func=_cmd_inspect)

    for register in _extra_commands():
        register(sub)
    return parser


def _cmd_plan(args: argparse.Namespace) -> int:
    from kvxfer import config as _config
    from kvxfer.plan import BudgetError, make_plan

    spec = _config.load_builtin(args.config)
    layers = spec.layer_specs(args.num_blocks, num_devices=args.devices,
                              emulate_tpu=not args.no_tpu_layouts)
    hosts = args.num_host_blocks or spec.num_host_blocks
    try:
        plan = make_plan(layers, hosts, path=args.path, host_memory_budget=args.budget)
    except BudgetError as e:
        if args.json:
            print(json.dumps({"config": spec.name, "refused": True, "error": str(e)}))
        print(f"kvxfer plan: refused: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"config": spec.name, "refused": False, **plan.as_dict()}))
    else:
        print(f"{spec.name}: {spec.description}")
        print(plan)
    return 0


def _register_plan(sub: Any) -> None:
    p = sub.add_parser("plan", help="host-memory plan of a model's KV caches, per slice class",
                       description="Groups a model's layers into slice classes, sizes each "
                       "class's host pool on its own and checks the total against the "
                       "host-memory budget, before anything is allocated.")
    p.add_argument("--config", required=True, help="a configs/ name or TOML path")
    p.add_argument("--num-host-blocks", type=int, help="host pages (default: the config's)")
    p.add_argument("--num-blocks", type=int, help="device blocks per layer (default: config)")
    p.add_argument("--path", choices=["staged", "direct"], default="staged",
                   help="staged stores dense blocks; direct stores the device bytes a raw "
                   "copy moves (whole granularity groups when not addressable)")
    p.add_argument("--budget", type=int, help="host-memory budget in bytes (default: half "
                   "of the available host memory)")
    p.add_argument("--devices", type=int, default=1, help="shard KV heads over N devices")
    p.add_argument("--no-tpu-layouts", action="store_true",
                   help="plan with row-major layouts instead of the emulated TPU ones")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=_cmd_plan)


def _extra_commands() -> list[Callable[[Any], None]]:
    from kvxfer import bench, probe
    from kvxfer.demo import serving

    return [_register_plan, probe.register_cli, bench.register_cli, serving.register_cli]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    devices = getattr(args, "devices", None)
    if isinstance(devices, int) and devices > 1:
        # On the CPU backend, several devices exist only if asked for before start-up;
        # once JAX has started (an in-process caller), the devices it has are what count.
        import jax

        try:
            jax.config.update("jax_num_cpu_devices", devices)
        except RuntimeError:
            pass
    try:
        return int(args.func(args) or 0)
    except (UsageError, LayoutError, ValueError, OSError, KeyError, TimeoutError) as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"kvxfer {args.command}: error: {message}", file=sys.stderr)
        return 2


def main_entry() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
