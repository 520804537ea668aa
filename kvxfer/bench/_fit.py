"""What a serving engine's scheduler thread pays per call, and what warm-up costs.

The engine-fit section times, per path (``auto``, ``staged``, ``pinned``), with
``integrity="page"``, ``fit_pages`` pages x ``layers`` layers of ``fit_block_bytes``
bfloat16 blocks per call:

* **idle**: the host time of ``offload()``, ``load(gate="all")`` and
  ``load(gate="layer")`` with no device work queued (p50 of the call alone);
* **prefetched**: ``load(..., prefetched=mgr.prefetch(pages))``, the call on the
  KV-owning thread once the pages are staged;
* **queued**: the same calls behind ``fit_steps`` donating steps of about
  ``fit_step_ms`` each, as a fraction of the steps' own time;
* **1-page hit**: ``load`` of 1 page, call to the last layer verified (``gate="layer"``),
  in a warmed process: as many hits as are timed (``hit_samples`` or more) run first,
  untimed (the first few dozen hits of a process run 5-10 % slower, as its caches and
  Python's adaptive interpreter warm; an engine's hits come in a process long warm);
* **warm-up**: ``warmup(fit_pages)`` in a fresh process, cold (filling a persistent
  compilation cache in a new directory), then in a second process over that cache;
  for the paths ``BenchConfig.warmup_paths`` names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any

import jax

from kvxfer._text import format_bytes
from kvxfer.bench._caller import _Steps
from kvxfer.bench._config import FIT_PATH_NAMES, BenchConfig
from kvxfer.bench._rig import Rig, check_loaded, make_caches
from kvxfer.bench.timing import Progress, interleaved, now, stats
from kvxfer.engine import is_cuda

__all__ = ["FIT_PATHS", "HIT_SAMPLES", "fit_section", "warmups_not_timed", "WARMUP_SCRIPT"]

#: The fewest 1-page hits timed in a full or quick run (``BenchConfig.hit_samples``).
HIT_SAMPLES = BenchConfig().hit_samples

#: The paths the section times (``auto`` is the raw-or-pinned mover on XLA:CPU).
FIT_PATHS = FIT_PATH_NAMES

#: Run in a fresh process: ``warmup`` of a manager like the section's, timed; with a
#: directory, JAX's persistent compilation cache there (how an engine turns it on). It
#: imports JAX and builds its caches and manager first, says ``ready``, and times its
#: ``warmup`` only once a line arrives on stdin: the two processes of a path start
#: together (their start-up overlaps), and each times its warm-up with the other idle.
WARMUP_SCRIPT = r"""
import json, sys, time
layers, blocks, block_bytes, pages, path, cache_dir = sys.argv[1:7]
import jax
if cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
import kvxfer
from kvxfer import testing
caches = testing.random_caches(int(layers), int(blocks),
                               testing.block_shape(int(block_bytes), "bfloat16"), "bfloat16")
jax.block_until_ready(caches)
mgr = kvxfer.KVCacheManager(caches, num_host_blocks=int(pages), path=path)
print("ready", flush=True)
if sys.stdin.readline().strip() == "go":
    t0 = time.perf_counter()
    buckets = mgr.warmup(int(pages))
    print(json.dumps({"warmup_s": time.perf_counter() - t0, "buckets": buckets,
                      "paths": sorted(set(mgr.paths))}), flush=True)
mgr.close()
"""

#: Seconds a warm-up process may take to start, and to warm up.
_WARMUP_TIMEOUT_S = 900


def _calls(cfg: BenchConfig, path: str) -> dict[str, Any]:
    k = cfg.fit_pages
    ids, dst = list(range(k)), list(range(k, 2 * k))
    rig = Rig(make_caches(cfg.layers, 2 * k, cfg.fit_block_bytes, "bfloat16"), 2 * k,
              kinds=(("page", path),))
    try:
        mgr = rig.mgr("page", path)
        mgr.warmup(k)
        held = rig.hold("page", ids, path=path)
        steps = _Steps(rig, cfg.fit_steps, cfg.fit_step_ms)

        def offload(queued: bool) -> dict[str, float]:
            if queued:
                steps.dispatch()
            t0 = now()
            handle = mgr.offload(rig.caches, ids, rig.keys(k))
            t1 = now()
            mgr.free(handle.wait())
            jax.block_until_ready(rig.caches)
            return {"s": now() - t0, "call_s": t1 - t0}

        def load(gate: str, queued: bool, prefetch: bool = False) -> dict[str, float]:
            staged = mgr.prefetch(held) if prefetch else None
            if queued:
                steps.dispatch()
            t0 = now()
            rig.caches, handle = mgr.load(rig.caches, held, dst, gate=gate, prefetched=staged)
            t1 = now()
            check_loaded(handle.result(), k)
            jax.block_until_ready(rig.caches)
            return {"s": now() - t0, "call_s": t1 - t0}

        t = interleaved({"steps": steps.alone,
                         "idle_offload": lambda: offload(False),
                         "idle_load": lambda: load("all", False),
                         "idle_load_layer": lambda: load("layer", False),
                         "prefetched_load": lambda: load("all", False, prefetch=True),
                         "queued_offload": lambda: offload(True),
                         "queued_load": lambda: load("all", True),
                         "queued_load_layer": lambda: load("layer", True)}, cfg.fit_repeats)
        queued_s = stats(t["steps"]["s"])["p50_s"]
        row: dict[str, Any] = {"path": path, "movers": sorted(set(mgr.paths)), "pages": k,
                               "layers": cfg.layers, "block_bytes": cfg.fit_block_bytes,
                               "steps": cfg.fit_steps, "steps_alone": stats(t["steps"]["s"])}
        for name in t:
            if name != "steps":
                row[name] = stats(t[name]["call_s"])
                if name.startswith("queued_"):
                    row[name]["fraction"] = row[name]["p50_s"] / queued_s
        return row
    finally:
        rig.close()


def _hit(cfg: BenchConfig, path: str) -> dict[str, Any]:
    rig = Rig(make_caches(cfg.layers, 16, cfg.fit_block_bytes, "bfloat16"), 4,
              kinds=(("page", path),))
    try:
        mgr = rig.mgr("page", path)
        mgr.warmup(1)
        held = rig.hold("page", [3], path=path)

        def hit() -> float:
            t0 = now()
            rig.caches, handle = mgr.load(rig.caches, held, [5], gate="layer")
            handle.layer_ready(cfg.layers - 1)
            s = now() - t0
            check_loaded(handle.result(), 1)
            return s

        repeats = max(cfg.hit_samples, 8 * cfg.fit_repeats)  # cheap: --quick too
        for _ in range(repeats):
            hit()
        return {"path": path, "movers": sorted(set(mgr.paths)),
                "hit": stats(interleaved({"hit": hit}, repeats)["hit"]["s"])}
    finally:
        rig.close()


def platform_name() -> str:
    """What ``JAX_PLATFORMS`` must say for a child process to get this process's backend:
    a GPU's plugin by its own name (``cuda``, ``rocm``), as JAX reads ``gpu`` as both
    and fails on the one that is absent."""
    device = jax.devices()[0]
    if device.platform == "gpu":
        return "cuda" if is_cuda(device) else "rocm"
    return device.platform


def _warmup(cfg: BenchConfig, path: str, cache_dir: str) -> dict[str, Any]:
    """``warmup`` in a fresh process filling ``cache_dir``, then in one reading it.

    Both processes start at once (importing JAX and building their caches overlap);
    each times its ``warmup`` only when told to, one after the other, the other one
    waiting on its stdin: the cold one first, so the second reads what it wrote."""
    out: dict[str, Any] = {"path": path, "pages": cfg.fit_pages, "layers": cfg.layers}
    env = dict(os.environ, JAX_PLATFORMS=platform_name())
    args = [sys.executable, "-c", WARMUP_SCRIPT, str(cfg.layers), str(2 * cfg.fit_pages),
            str(cfg.fit_block_bytes), str(cfg.fit_pages), path, cache_dir]
    names = ("cold", "persistent_cache")
    # A session of their own: a terminal's Ctrl-C reaches this process alone, which
    # stops at its next step and ends them on the way out (kvxfer._interrupt).
    procs = {name: subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env,
                                    start_new_session=True)
             for name in names}
    # Neither may hang the run: both are killed once the limit passes.
    watchdog = threading.Timer(_WARMUP_TIMEOUT_S, lambda: [p.kill() for p in procs.values()])
    watchdog.start()
    try:
        for proc in procs.values():  # both started: nothing is timed before this
            lines = iter(proc.stdout.readline, "") if proc.stdout else iter(())
            if not any(line.strip() == "ready" for line in lines):
                _fail(path, proc)
        for name, proc in procs.items():
            stdout, stderr = proc.communicate("go\n", timeout=_WARMUP_TIMEOUT_S)
            if proc.returncode or not stdout.strip():
                raise RuntimeError(f"bench: warmup of path={path} in a fresh process "
                                   f"failed: {stderr.strip()[-500:]}")
            got = json.loads(stdout.strip().splitlines()[-1])
            out[name] = got["warmup_s"]
            out["buckets"], out["movers"] = got["buckets"], got["paths"]
    finally:
        watchdog.cancel()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    return out


def _fail(path: str, proc: subprocess.Popen[str]) -> None:
    """Raises with the end of a warm-up process's stderr (it ended before it was ready)."""
    proc.kill()
    _, stderr = proc.communicate()
    raise RuntimeError(f"bench: warmup of path={path} in a fresh process failed: "
                       f"{stderr.strip()[-500:]}")


def warmups_not_timed(cfg: BenchConfig) -> list[str]:
    """A line saying which paths' warm-up ``cfg`` does not time, and why (or none)."""
    left = [p for p in FIT_PATHS if p not in cfg.warmup_paths]
    if not left:
        return []
    return [f"warm-up in fresh processes of path={', path='.join(left)} ('-' in the "
            f"warm-up columns): this run's warmup_paths are {', '.join(cfg.warmup_paths)} "
            "(two fresh processes a path, each importing JAX and compiling, seconds each; "
            "--quick and the full run time every path)"]


def fit_section(cfg: BenchConfig, progress: Progress) -> dict[str, Any]:
    """The scheduler thread's cost per call, the 1-page hit, and warm-up per path."""
    shape = (f"{cfg.fit_pages} pages x {cfg.layers} layers of "
             f"{format_bytes(cfg.fit_block_bytes)} bfloat16 blocks")
    calls, hits, warmups = [], [], []
    for path in FIT_PATHS:
        progress.step("engine fit", f"engine fit, path={path}: calls of {shape}, idle, "
                      f"prefetched and behind {cfg.fit_steps} queued steps; a 1-page hit")
        calls.append(_calls(cfg, path))
        hits.append(_hit(cfg, path))
    for path in (p for p in FIT_PATHS if p in cfg.warmup_paths):
        progress.step("warm-up", f"warm-up, path={path}: warmup({cfg.fit_pages}) in a fresh "
                      "process, cold and over a persistent compilation cache")
        with tempfile.TemporaryDirectory(prefix="kvxfer-bench-jaxcache-") as d:
            warmups.append(_warmup(cfg, path, d))
    return {"calls": calls, "hits": hits, "warmups": warmups}
