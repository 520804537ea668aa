"""``kvxfer bench``: the command line of the benchmark."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import typing
from typing import TYPE_CHECKING, Any

from kvxfer import _interrupt, _resources
from kvxfer._check import out_dir
from kvxfer._text import fit_width
from kvxfer.bench._config import Only, check_run_arguments
from kvxfer.store import SPEC_FORMS, spec_argument

if TYPE_CHECKING:
    from kvxfer.bench import report as _report

__all__ = ["register_cli", "say_misses"]


#: Columns the bench's terminal output fits: the report (``--wide`` lifts it for the
#: tables), its progress lines and the targets it names on stderr.
WIDTH = 100


def _progress(line: str) -> None:
    # A long step description goes on indented lines under the one with the counter.
    print(fit_width(f"kvxfer bench: {line}", WIDTH), file=sys.stderr, flush=True)


def _cmd_bench(args: argparse.Namespace, targets: _report.Targets | None) -> int:
    # Argument errors first, before JAX is imported (a second or more): a typo is one
    # line at once, never a line after the run.
    check_run_arguments(args.store or (), args.only, args.model or ())
    from kvxfer.bench import report as _report
    from kvxfer.bench._config import BenchConfig
    from kvxfer.bench._run import run_bench

    targets = _report.Targets() if targets is None else targets
    if args.targets:
        text = _report.targets_table(targets=targets)
        print(json.dumps([dataclasses.asdict(t) for t in _report.TARGET_TABLE]) if args.json
              else text if args.wide else fit_width(text, WIDTH))
        return 0
    config = BenchConfig.smoke() if args.smoke else None
    report = run_bench(quick=args.quick, out_dir=args.out, config=config, progress=_progress,
                       targets=targets, stores=args.store or (), only=args.only,
                       models=args.model or ())
    if args.json:
        print(json.dumps(report))
    elif report["meta"].get("interrupted"):
        # What a Ctrl-C left: the sections it finished (the stderr line said so).
        print(_report.format_report(report, width=None if args.wide else WIDTH))
        if "files" in report:
            print("wrote " + ", ".join(report["files"].values()))
    else:
        print(_report.format_report(report, width=None if args.wide else WIDTH,
                                    judge=True if args.check else None))
        if "files" in report:
            print("wrote " + ", ".join(report["files"].values()))
    if report["meta"].get("interrupted"):
        return _interrupt.EXIT_STATUS
    say_misses(report, args.check)
    return _report.exit_status(report, args.check)


def _on_interrupt(args: argparse.Namespace) -> str:
    """The line the first Ctrl-C prints: where the run stops and what it keeps."""
    kept = ("the sections measured so far are printed" + (" as JSON" if args.json else "")
            + (f" and written to {args.out}/bench.json" if args.out else ""))
    return (f"kvxfer bench: interrupted: stopping at the next step; {kept} (Ctrl-C again "
            "stops at once)")


def say_misses(report: dict[str, Any], check: bool) -> None:
    """Names each missed target on stderr; says whether the misses set the exit status.
    A smoke run's figures are judged only when ``--check`` asks: without it, nothing."""
    from kvxfer.bench import report as _report

    if not check and not _report.judged(report):
        return
    misses = _report.missed(report)
    if not misses:
        if check:
            print(f"kvxfer bench --check: {_report.summary(report)}", file=sys.stderr)
        return
    names = "".join(f"\n  {t['name']}: {t['value']:.3g} ({t['where']})" for t in misses)
    how = "--check: exit 1" if check else "reported, not judged: --check exits 1 on a miss"
    print(fit_width(f"kvxfer bench: {_report.summary(report)} ({how}):{names}", WIDTH),
          file=sys.stderr)


def register_cli(subparsers: Any, *, targets: _report.Targets | None = None
                 ) -> argparse.ArgumentParser:
    """Adds ``bench`` to an argparse subparsers object; returns its parser.

    Args:
      subparsers: what ``ArgumentParser.add_subparsers()`` returned.
      targets: the thresholds the command checks the run against (None: kvxfer's).

    Example:
        >>> parser = argparse.ArgumentParser(prog="kvxfer")
        >>> p = register_cli(parser.add_subparsers(dest="command"))
        >>> args = parser.parse_args(["bench", "--quick", "--no-check"])
        >>> args.quick, args.smoke, args.no_check, args.json, args.out, args.store, args.only
        (True, False, True, False, None, None, None)
        >>> parser.parse_args(["bench", "--quick", "--check"]).check
        True
        >>> parser.parse_args(["bench", "--only", "model", "--model", "sglang-llama3-8b-p1",
        ...                    "--model", "sglang-llama3-8b-p64"]).model
        ['sglang-llama3-8b-p1', 'sglang-llama3-8b-p64']
        >>> args = parser.parse_args(["bench", "--only", "store", "--store", "/tmp",
        ...                           "--store", "redis://127.0.0.1:6379"])
        >>> args.only, args.store
        ('store', ['/tmp', 'redis://127.0.0.1:6379'])
    """
    p = subparsers.add_parser(
        "bench", help="measure kvxfer against the physical limit and user baselines",
        description="Measures, side by side in one run: the physical limit (memcpy on "
        "CPU, pinned host<->device copy on GPU), what users write today (per-page "
        "device_get, jitted gather -> pinned_host, device_put + donated scatter) and "
        "KVCacheManager offload/load with integrity off/page and gate all/layer, and the "
        "store tiers' put/get against the same disk, Redis server or Redis Cluster, with "
        "a prefix lookup from each Redis store one get per page against one get_many; "
        "prints tables, then each target with its measured value: PASS, MISS, or N/A "
        "for a target of other hardware (--targets lists them with their reasons). Exits "
        "0 after a complete run whatever the figures; --check exits 1 when a target that "
        "applies to this machine's hardware misses; 2 on bad input; a run that fails "
        "midway does not exit 0.")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--wide", action="store_true",
                   help="print every table whole, however wide (default: no line over 100 "
                   "columns; a wider table is cut into parts of whole columns, each "
                   "repeating the columns that name its rows). --json and --out hold "
                   "every figure either way")
    p.add_argument("--out", metavar="DIR", type=out_dir,
                   help="write bench.json (and bench.png when matplotlib is importable) here")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="every section, fewer cases and repeats, 32 MiB a call (the full "
                      "run: 256 MiB, about 10 minutes on an idle 2-core CPU): 2 min 4 s at "
                      "load average 1.1-1.7 on a 2-core CPU (3 min of CPU time), its peak "
                      "host memory 1.79 GB. Each run's last line says its wall time, "
                      "peak memory and the load average it ran under")
    size.add_argument("--smoke", action="store_true",
                      help="tiny sizes: checks that every section runs, in 25 s of CPU time "
                      "(52 s at load average 6-7 on a 2-core CPU; one case of the sections "
                      "where each case compiles programs of its own or starts processes; "
                      "the report lists the others as not measured). Its figures mean "
                      "little: no target is judged, unless --check asks")
    p.add_argument("--store", action="append", metavar="SPEC", type=spec_argument,
                   help=f"a store the store section measures ({SPEC_FORMS}); repeat for "
                   "several. Default: a disk store in a temporary directory. The bench "
                   "writes only in a new temporary directory inside DIR, or under a key "
                   "prefix of its own, and removes what it wrote")
    p.add_argument("--model", action="append", metavar="CONFIG",
                   type=_resources.argument("configs"),
                   help="also measure a model config's own caches (a built-in config: "
                   f"{', '.join(_resources.builtin_names('configs'))}; or a TOML file): offload and load of whole pages, "
                   "256 MiB per call (--smoke: 256 KiB), integrity off and page, against "
                   "the limit in the same run, "
                   "and the host time per page; repeat for several")
    p.add_argument("--only", choices=typing.get_args(Only),
                   help="run only this section (--only store: the store tiers and the "
                   "Redis prefix lookup, in seconds with --quick; --only fit: the "
                   "engine-fit section, call host time per path, the 1-page hit and "
                   "warm-up in fresh processes; --only model: the --model configs; --only "
                   "policy: the eviction policies' hit rates per tier and the store bytes "
                   "of each write-through setting, on replayed traces, in seconds)")
    judge = p.add_mutually_exclusive_group()
    judge.add_argument("--check", action="store_true",
                       help="judge the run: exit 1 when a target that applies to this "
                       "machine's hardware misses, naming each")
    judge.add_argument("--no-check", action="store_true",
                       help="only report, exit 0 whatever the figures (the default)")
    p.add_argument("--targets", action="store_true",
                   help="print the targets (hardware, threshold, reason) and exit, "
                   "measuring nothing (with --json: as JSON)")
    p.set_defaults(func=functools.partial(_cmd_bench, targets=targets),
                   on_interrupt=_on_interrupt)
    return p
