"""The ``kvxfer demo`` command line: ``register_cli`` (for ``kvxfer``) and ``main``
(``python -m kvxfer.demo``). The demo itself is imported when the command runs, so
building the parser does not start JAX.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvxfer.demo._options import add_arguments
from kvxfer.store import StoreError

__all__ = ["register_cli", "build_parser", "main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    import time

    from kvxfer.demo import _preflight

    # Every check that needs no JAX (options, sizes, the store) before JAX is imported:
    # a bad option is one line at once.
    t_start = time.perf_counter()
    opts = _preflight.options_of(args, {})
    prepared = _preflight.preflight(opts)
    store = _preflight.open_demo_store(opts.store)
    try:
        from kvxfer.demo.command import format_summary, run_prepared

        summary = run_prepared(opts, prepared, store, t_start)
    finally:
        if store is not None:
            store.close()
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0 if summary["tokens_match"] else 1


_DESCRIPTION = ("Serves requests that share long system prompts through a two-tier "
                "prefix cache: device blocks, and host pages moved and verified by "
                "kvxfer. Checks every request's tokens against a run with no cache; "
                "exits 1 if any differ.")


def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Adds the ``demo`` subcommand to an ``argparse`` subparsers object.

    The command's handler is ``args.func(args) -> exit status``.

    Example:
        >>> p = argparse.ArgumentParser(prog="kvxfer")
        >>> sub = p.add_subparsers(dest="command")
        >>> _ = register_cli(sub)
        >>> p.parse_args(["demo", "--inject", "bitflip"]).inject
        'bitflip'
    """
    p = subparsers.add_parser("demo", help="serving loop with a verified host-tier prefix cache",
                              description=_DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=_cmd_demo, on_interrupt=_on_interrupt)
    return p


def _on_interrupt(args: argparse.Namespace) -> str:
    """The line the first Ctrl-C prints: the demo stops between requests."""
    store = ", writing its host pages to the store" if args.store else ""
    return (f"kvxfer demo: interrupted: stopping after this request{store} (Ctrl-C again "
            "stops at once)")


class _OneLineParser(argparse.ArgumentParser):
    """Bad options are one line on stderr and exit 2, as in ``kvxfer demo``."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser(prog: str = "python -m kvxfer.demo") -> argparse.ArgumentParser:
    """The parser of the demo command on its own (``main``'s).

    Example:
        >>> build_parser().parse_args([]).requests
        32
    """
    parser = _OneLineParser(prog=prog, description=_DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvxfer.demo [options]``: the ``kvxfer demo`` command on its own.

    Returns:
        The exit status: 0, 1 when tokens differ from a run with no cache, 2 on a
        bad option or a store that cannot be opened or reached.
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        return _cmd_demo(args)
    except (ValueError, MemoryError, StoreError) as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"kvxfer demo: error: {message}", file=sys.stderr)
        return 2
