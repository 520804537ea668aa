"""``kvxfer aot``'s options, in a module that imports no JAX: ``kvxfer --help`` lists
the command without starting it, and the command imports ``kvxfer.aot`` when it runs."""

from __future__ import annotations

import argparse
from typing import Any

from kvxfer import _resources
from kvxfer._check import MAX_LAYERS, bounded_int
from kvxfer._names import GENERATIONS

__all__ = ["register_cli"]


def _cmd_aot(args: argparse.Namespace) -> int:
    from kvxfer import aot

    return aot._cmd_aot(args)


def _target(text: str) -> str:
    """``--target``: a generation, optionally with a topology, checked before JAX loads."""
    generation = text.strip().partition(":")[0]
    if generation not in GENERATIONS:
        raise argparse.ArgumentTypeError(
            f"unknown TPU generation {generation!r} in {text!r}; expected one of "
            f"{', '.join(GENERATIONS)}, optionally with a topology (e.g. v6e:2x4)")
    return text.strip()


def register_cli(sub: Any) -> None:
    """Adds ``kvxfer aot`` to the command line's subparsers."""
    p = sub.add_parser(
        "aot", help="compile every transfer program for a TPU, without one",
        description="Compiles, deviceless, every program kvxfer would run on the target "
        "TPU for each config (the mover path='auto' picks there, each of its programs), "
        "and checks each: host compute (none allowed), DMAs a page to or from host "
        "memory, whether the host pool is updated in place, and device-memory staging "
        "against its bound. Exit 0 only when every program compiled clean; 2 on a bad "
        "argument or without libtpu (pip install 'kvxfer[tpu]').")
    p.add_argument("--target", required=True, type=_target,
                   help=f"a TPU generation ({', '.join(GENERATIONS)}) or topology "
                   "(e.g. v6e:2x4)")
    p.add_argument("--config", action="append", type=_resources.argument("configs"),
                   help="a built-in config name or a TOML file (repeatable; default: every "
                   f"built-in config: {', '.join(_resources.builtin_names('configs'))})")
    p.add_argument("--devices", type=bounded_int(1, 4096), default=1,
                   help="spread the caches over N devices, sharded as each config shards "
                   "(default 1)")
    p.add_argument("--num-blocks", type=bounded_int(1, 2**31 - 1),
                   help="device blocks per layer (default: the most one device's HBM "
                   "holds for each config, as an engine sizes its caches)")
    p.add_argument("--pages", type=bounded_int(1, 65536),
                   help="compile for transfers of up to N pages: every bucket up to N, "
                   "at most a layer's blocks and the host pool's (default 64, or fewer "
                   "where those hold fewer)")
    p.add_argument("--max-layers", type=bounded_int(1, MAX_LAYERS),
                   help="keep the first N layers of each layer group (a quicker check of "
                   "DMAs and aliasing; staging grows with the layers; default: all)")
    p.add_argument("--json", action="store_true", help="one JSON object per program")
    p.set_defaults(func=_cmd_aot)
