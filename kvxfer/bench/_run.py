"""``run_bench``: every section in one run, the targets, and the files it keeps."""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

import jax

from kvxfer import _interrupt
from kvxfer.bench import report as _report
from kvxfer.bench._caller import cases_not_timed, first_call_section, queued_section
from kvxfer.bench._fit import fit_section, warmups_not_timed
from kvxfer.bench._hostrss import peak_bytes, start
from kvxfer.bench._config import BenchConfig, check_run_arguments
from kvxfer.bench._config import Only as Only
from kvxfer.bench._copysizes import copy_size_section
from kvxfer.bench._model import model_section
from kvxfer.bench._policies import policy_section, policy_steps
from kvxfer.bench._sections import (cache_size_section, fit_plan, ordered_cells, plan, prefix_sweep,
                                    throughput_cell)
from kvxfer.bench._store import DEFAULT_STORE, lookup_section, store_section, store_steps
from kvxfer.bench.limits import make_limit
from kvxfer.bench.timing import Progress, frozen_heap, now

__all__ = ["run_bench", "SCHEMA", "Only"]

#: The report's schema (2: ``block_bytes`` per layer, user load baselines, ``direction``;
#: 3: the ``first_call`` and ``queued`` sections; 4: the ``store`` section, the pinned
#: mover's methods and ``pinned_methods`` in throughput and sweep rows, and its
#: caller-thread case); 5: the ``fit`` section (engine-fit calls, 1-page hit, warm-up);
#: 6: the ``store_lookup`` section (a prefix lookup per page and batched, per Redis store),
#: the ``models`` section (a model config's own caches, with ``models=``) and the
#: ``policy`` section (hit rates per eviction policy and tier, store bytes per
#: write-through setting); 7: the ``copy_sizes`` section (the DMA mover by bytes per
#: copy) and the plain-JAX routes (``jax_gather_pinned``, ``jax_put_scatter``) in the
#: throughput and sweep rows; 8: each target line names its ``Targets`` field
#: (``target``) and the hardware it applies to (``hardware``), and a target for other
#: hardware than the run's is a line of status ``"N/A"`` with ``value`` null (before
#: 8 such targets were left out; the report code reads runs of schema 3 and later).
SCHEMA = "kvxfer-bench/8"

def _preset(config: BenchConfig) -> str:
    for name in ("full", "quick", "smoke"):
        if config == getattr(BenchConfig, name)():
            return name
    return "custom"


def run_bench(quick: bool = False, out_dir: str | None = None, *,
              config: BenchConfig | None = None,
              progress: Callable[[str], None] | None = None,
              targets: _report.Targets = _report.Targets(),
              stores: Sequence[str] = (), only: Only | None = None,
              models: Sequence[str] = ()) -> dict[str, Any]:
    """Runs the benchmark; returns the report (also written to ``out_dir``).

    Args:
      quick: the quick preset (``BenchConfig.quick()``: 32 MiB calls, under 2 GB of host
        memory) instead of the full one (about 10 minutes on an idle 2-core CPU).
      out_dir: when given, writes ``bench.json`` there and, when matplotlib is
        importable, ``bench.png`` (throughput vs bytes per call).
      config: explicit sizes (overrides ``quick``); see ``BenchConfig``.
      progress: called with a line per step as the run goes, each with the time
        elapsed and, once a quarter of the steps have finished, an estimate of the
        time left.
      targets: the thresholds the run is checked against (default: kvxfer's).
      stores: the stores the store section measures, as ``kvxfer.store.open_store``
        specs (``DIR``, ``file://DIR``, ``redis://HOST:PORT[/DB]``,
        ``redis+cluster://HOST:PORT[,...]``); none: a disk store in a temporary
        directory. Each Redis store also gets the prefix-lookup case
        (``store_lookup``). The bench writes only under a temporary directory (inside
        ``DIR``) or a prefix of its own, and removes what it wrote.
      only: ``"store"`` runs the store section alone (no JAX work); ``"fit"`` the
        engine-fit section alone (call host time, 1-page hit, warm-up); ``"model"`` the
        models section alone (``models`` must name one config at least); ``"policy"``
        the policy section alone (eviction policies' hit rates, write-through's store
        bytes, on replayed traces).
      models: model configs (``configs/`` names or TOML files) whose own caches the
        models section moves: offload and load of ``batch_bytes`` per call, integrity
        off and page, against the limit in the same run, and the host time per page.

    Returns:
      A JSON-ready dict: ``schema``, ``meta``, ``throughput``, ``sweep``,
      ``concurrency``, ``overhead``, ``integrity_traffic``, ``cache_size``, ``memory``,
      ``first_call``, ``queued``, ``store``, ``store_lookup``, ``policy``, ``targets``,
      ``not_measured`` (and ``files`` when written); with ``only="store"``: ``schema``,
      ``meta``, ``store``, ``store_lookup``, ``targets``, ``not_measured`` (and
      ``files``); with ``only="fit"`` or ``"policy"``: ``schema``, ``meta``, that
      section, ``targets``, ``not_measured`` (and ``files``). With ``models``, also
      ``models`` (one row per config); with ``only="model"``: ``schema``, ``meta``,
      ``models``, ``targets``, ``not_measured`` (and ``files``). A run the command
      line's Ctrl-C stopped (``kvxfer._interrupt``) returns the sections it finished,
      ``meta["interrupted"]`` saying where it stopped and no targets judged.

    Raises:
      ValueError: a bad ``only``, ``only="model"`` without ``models`` or ``models``
        with another ``only``; ``ConfigError`` (a ValueError) for a model config that
        does not load. All before anything is measured.

    Example:
        >>> report = run_bench(config=BenchConfig.smoke())
        >>> report["meta"]["preset"], len(report["sweep"]) == len(BenchConfig.smoke().prefix_pages)
        ('smoke', True)
    """
    cfg = config or (BenchConfig.quick() if quick else BenchConfig.full())
    stores = list(stores)
    models = list(models)
    # Before any section runs: a typo must not cost a whole run.
    check_run_arguments(stores, only, models)
    model_steps = ["model"] * len(models)
    policy_plan = ["policy"] * policy_steps()
    planned = {None: plan(cfg) + model_steps + ["store"] * store_steps(cfg, stores) +
               policy_plan, "fit": fit_plan(cfg), "store": ["store"] * store_steps(cfg, stores),
               "model": model_steps, "policy": policy_plan}[only]
    steps = Progress(planned,
                     progress or (lambda line: None))
    start()  # the peak memory reported is this run's, of this process
    started = now()
    dev = jax.devices()[0]
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "meta": {"date": datetime.date.today().isoformat(), "platform": dev.platform,
                 "device": getattr(dev, "device_kind", str(dev)),
                 "jax_version": jax.__version__, "python": platform.python_version(),
                 "source": _source(), "cpu_count": os.cpu_count() or 1,
                 "preset": _preset(cfg), "config": cfg.as_dict(), "only": only,
                 "models": models,
                 "stores": stores or [DEFAULT_STORE],
                 "stat_note": "throughput from the best repeat; p50/p99 over repeats; "
                              "variants interleaved repeat by repeat"}}
    # What exists before the run (JAX's objects among them) is left out of the
    # collections the sections make before each timed region.
    try:
        with frozen_heap():
            _sections(cfg, report, steps, only, stores, models)
    except _interrupt.Interrupted:
        # Ctrl-C under the command line: the sections measured so far are kept (and
        # written to out_dir); those after, and a section cut short, are not.
        done = len(steps.done)
        report["meta"]["interrupted"] = f"by Ctrl-C in step {done + 1} of {len(steps.plan)}"
        report.setdefault("not_measured", []).append(
            f"interrupted by Ctrl-C in step {done + 1} of {len(steps.plan)}: the steps "
            "from there on were not run")
        report["targets"] = []  # a run cut short is not judged
    else:
        report["targets"] = _report.evaluate_targets(report, targets)
    report["meta"]["wall_s"] = now() - started
    report["meta"]["peak_rss_bytes"] = peak_bytes()
    report["meta"]["load_average"] = _load_average()
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        files = {"json": os.path.join(out_dir, "bench.json")}
        # The plot draws the prefix sweep: only in a run of every section.
        whole = only is None and "interrupted" not in report["meta"]
        png = _report.plot(report, os.path.join(out_dir, "bench.png")) if whole else None
        if png:
            files["plot"] = png
        elif whole:
            report["not_measured"].append("plot: matplotlib is not importable "
                                          "(pip install 'kvxfer[plot]')")
        report["files"] = files
        with open(files["json"], "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return report


def _sections(cfg: BenchConfig, report: dict[str, Any], steps: Progress, only: Only | None,
              stores: list[str], models: list[str]) -> None:
    """Every section ``only`` asks for, into ``report``, each once it is whole."""
    if only is None:
        _transfer_sections(cfg, report, steps)
    else:
        report["not_measured"] = []
    if models and only in (None, "model"):
        report["models"] = model_section(cfg, models, steps)
    if only == "fit":
        report["fit"] = fit_section(cfg, steps)
        report["not_measured"] += warmups_not_timed(cfg)
    elif only in (None, "store"):
        report["store"] = store_section(cfg, stores, steps)
        report["store_lookup"] = lookup_section(cfg, stores, steps)
    if only in (None, "policy"):
        report["policy"] = policy_section(steps, requests=cfg.policy_requests)


def _transfer_sections(cfg: BenchConfig, report: dict[str, Any], steps: Progress) -> None:
    """Every section but the store's, into ``report``."""
    capacity = max([cfg.batch_bytes, cfg.copy_bytes] +
                   [n * cfg.layers * cfg.prefix_block_bytes for n in cfg.prefix_pages])
    with make_limit(capacity) as limit:
        report["meta"]["limit_method"] = limit.method
        report["throughput"] = [
            throughput_cell(cfg, limit, block, dtype, report=report, progress=steps)
            for block, dtype in ordered_cells(cfg)]
        if not cfg.sweep_on_reference:
            report["sweep"] = prefix_sweep(cfg, limit, steps)
        gc.collect()
        report["copy_sizes"], skipped = copy_size_section(cfg, limit, steps)
    gc.collect()
    report["cache_size"] = cache_size_section(cfg, steps)
    gc.collect()
    # First calls before the queued steps: the warm-up there compiles the programs of
    # the queued section's caches (the same shapes), which is then not timed twice.
    report["first_call"] = first_call_section(cfg, steps)
    report["queued"] = queued_section(cfg, steps)
    gc.collect()
    report["fit"] = fit_section(cfg, steps)
    report["not_measured"] = report["memory"].pop("not_measured") + \
        ([skipped] if skipped else []) + cases_not_timed(cfg) + warmups_not_timed(cfg)


def _load_average() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages at the end of the run (how busy it
    was: on a shared machine every figure moves with it)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _source() -> str:
    """The kvxfer source measured: its git commit and whether ``kvxfer/`` is modified."""
    import kvxfer

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvxfer.__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain",
                                "--untracked-files=no", "--", "kvxfer"],
                               capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return f"kvxfer {kvxfer.__version__}"
    return f"kvxfer {kvxfer.__version__}, git {head.stdout.strip()}" + \
        (" with uncommitted changes to kvxfer/" if dirty.stdout.strip() else "")
