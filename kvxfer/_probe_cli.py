"""``kvxfer probe``'s options, in a module that imports neither numpy nor JAX:
``kvxfer --help`` lists the command without them, and the command imports
``kvxfer.probe`` when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from kvxfer import _resources
from kvxfer._check import bounded_int, path_name, positive_int
from kvxfer._names import FAULTS, PATHS

__all__ = ["register_cli"]


def _cmd_probe(args: argparse.Namespace) -> int:
    from kvxfer import probe

    return probe._cmd_probe(args)


def register_cli(sub: Any) -> None:
    """Adds ``kvxfer probe`` to the command line's subparsers."""
    p = sub.add_parser("probe", help="registration + permuted per-block round trip",
                       description="Offloads a random permutation of blocks, clobbers the "
                       "device blocks, loads the pages elsewhere and checks every byte.")
    p.add_argument("--config", action="append", type=_resources.argument("configs"),
                   help=f"a built-in config name or a TOML file (repeatable); built in: "
                   f"{', '.join(_resources.builtin_names('configs'))}")
    p.add_argument("--seeds", action="store_true", help="the upstream report's seed shapes")
    p.add_argument("--pages", type=positive_int, default=16,
                   help="pages to move, at most the blocks per layer (default 16)")
    p.add_argument("--num-blocks", type=positive_int,
                   help="device blocks per layer (default: config)")
    p.add_argument("--devices", type=bounded_int(1, 256), default=1,
                   help="shard over N devices (at most 256)")
    p.add_argument("--path", type=path_name, choices=list(PATHS), default="auto",
                   help="the manager's path= (default: auto)")
    p.add_argument("--integrity", choices=["off", "page"],
                   help="default: off, or page with --inject")
    p.add_argument("--inject", choices=list(FAULTS),
                   help="damage the middle page before loading (on the host; zero-dma: "
                   "the load delivers zeros into its blocks of the middle layer); exit 0 "
                   "only if it is detected at that page and the pages before it load exact")
    p.add_argument("--gate", choices=["all", "layer"], default="all")
    p.add_argument("--no-tpu-layouts", action="store_true",
                   help="ignore the configs' emulated TPU layouts (the table then drops "
                   "its TPU-layout verdict and device bytes/block columns)")
    p.add_argument("--seed", type=bounded_int(0, 2**32 - 1), default=0,
                   help="the random bits' and block ids' seed (default 0)")
    p.add_argument("--json", action="store_true", help="one JSON object per config")
    p.set_defaults(func=_cmd_probe, on_interrupt=lambda args: (
        "kvxfer probe: interrupted: stopping before the next config (Ctrl-C again stops "
        "at once)"))
