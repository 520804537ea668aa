"""``kvxfer bench``: the command line of the benchmark."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvxfer.bench import report as _report
from kvxfer.bench._run import run_bench

__all__ = ["register_cli"]


def _progress(line: str) -> None:
    print(f"kvxfer bench: {line}", file=sys.stderr, flush=True)


def _cmd_bench(args: argparse.Namespace) -> int:
    report = run_bench(quick=args.quick, out_dir=args.out, progress=_progress)
    if args.json:
        print(json.dumps(report))
    else:
        print(_report.format_report(report))
        if "files" in report:
            print("wrote " + ", ".join(report["files"].values()))
    return 0


def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``bench`` to an argparse subparsers object; returns its parser.

    Example:
        >>> parser = argparse.ArgumentParser(prog="kvxfer")
        >>> p = register_cli(parser.add_subparsers(dest="command"))
        >>> args = parser.parse_args(["bench", "--quick"])
        >>> args.quick, args.json, args.out
        (True, False, None)
    """
    p = subparsers.add_parser(
        "bench", help="measure kvxfer against the physical limit and user baselines",
        description="Measures, side by side in one run: the physical limit (memcpy on "
        "CPU, pinned host<->device copy on GPU), what users write today (per-page "
        "device_get, jitted gather -> pinned_host, device_put + donated scatter) and "
        "KVCacheManager offload/load with integrity off/page and gate all/layer; prints "
        "tables and PASS/MISS target lines.")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--out", metavar="DIR",
                   help="write bench.json (and bench.png when matplotlib is importable) here")
    p.add_argument("--quick", action="store_true",
                   help="fewer cases and repeats (under a minute on a 2-core CPU)")
    p.set_defaults(func=_cmd_bench)
    return p
