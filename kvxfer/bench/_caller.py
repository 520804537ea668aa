"""What an ``offload()`` / ``load()`` call costs its caller's thread: behind queued
device work, and on the first call of a size with and without ``warmup``.

Both sections time each of ``CALL_CASES`` (a bfloat16 cache on ``path="staged"``, a
float32 one on ``path="auto"``, the raw path on XLA:CPU, and a float16 one on
``path="pinned"``) that ``BenchConfig.call_cases`` names, with ``integrity="page"``:

* **queued steps**: ``queued_steps`` donating jitted steps (arithmetic over every
  layer, returning the new caches) are dispatched and not waited for; then the
  ``offload()`` call alone is timed, then ``wait()``; likewise ``load()`` and
  ``result()``, on a warmed-up manager. The steps are timed alone too, and each call
  records whether they were done when it returned: a call that returns at once left
  them queued, one that copies on the caller's thread waited for them.
* **first call**: a fresh manager's first offload + wait and first load + result of
  ``call_pages`` pages, without warm-up and after ``mgr.warmup(call_pages)`` (timed
  too), and a second call of the same size for comparison. Programs are compiled
  per cache shape, so the manager without warm-up gets caches of a shape no other
  case of the run builds (``BenchConfig.cold_call_blocks``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from kvxfer._text import format_bytes
from kvxfer.bench._config import CALL_CASE_NAMES, BenchConfig
from kvxfer.bench._rig import Rig, check_loaded, make_caches
from kvxfer.bench.timing import Progress, interleaved, no_gc, now, stats
from kvxfer.manager import PathMode

__all__ = ["CALL_CASES", "call_cases", "cases_not_timed", "first_call_section",
           "queued_section"]

#: The cases of both sections: (name, dtype, the manager's ``path``).
CALL_CASES: tuple[tuple[str, str, PathMode], ...] = (
    ("staged", "bfloat16", "staged"), ("raw", "float32", "auto"),
    ("pinned", "float16", "pinned"))
assert tuple(name for name, _, _ in CALL_CASES) == CALL_CASE_NAMES


def call_cases(cfg: BenchConfig) -> list[tuple[str, str, PathMode]]:
    """The cases ``cfg`` times (``BenchConfig.call_cases``), in ``CALL_CASES`` order."""
    return [case for case in CALL_CASES if case[0] in cfg.call_cases]


def cases_not_timed(cfg: BenchConfig) -> list[str]:
    """A line saying which cases ``cfg`` leaves out of both sections and why (or none)."""
    left = [f"path={path} ({dtype})" for name, dtype, path in CALL_CASES
            if name not in cfg.call_cases]
    if not left:
        return []
    return [f"first call and queued steps of {', '.join(left)}: this run's call_cases are "
            f"{', '.join(cfg.call_cases)} (each case compiles the programs of two managers "
            "of its own, seconds on a CPU; --quick and the full run time every case)"]

# Passes of arithmetic per step at most: tiny caches on a fast device need many to
# reach step_ms, but a step must not grow without bound.
_MAX_PASSES = 1 << 14
_CALIBRATION_ROUNDS = 4


def _arithmetic(caches: tuple[jax.Array, ...], passes: jax.Array
                ) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """``passes`` rounds of a multiply-add over every layer; the new caches and a marker.

    The marker is one element of the last layer: it is ready when the step is done.
    """
    def one(_: Any, cs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return tuple(c * 0.5 + 1.0 for c in cs)  # weak-typed scalars keep each dtype

    out = jax.lax.fori_loop(0, passes, one, caches)
    return out, out[-1].reshape(-1)[0]


# One program per cache shapes (the pass count is an argument, not a constant).
_step = jax.jit(_arithmetic, donate_argnums=0)


class _Steps:
    """``count`` donating steps over ``rig.caches``, calibrated to ``step_ms`` each.

    A step's time is not proportional to its passes (dispatch costs the same for
    one pass or many), so the count of passes is rescaled until a step takes about
    ``step_ms``, a few rounds at most.
    """

    def __init__(self, rig: Rig, count: int, step_ms: float):
        self.rig, self.count, self.passes = rig, count, 1
        self.alone()  # compiles
        for _ in range(_CALIBRATION_ROUNDS):
            per_step = min(self.alone()["s"] for _ in range(2)) / count
            want = int(np.clip(round(self.passes * step_ms / 1e3 / per_step), 1, _MAX_PASSES))
            if abs(want - self.passes) <= self.passes // 4:
                break
            self.passes = want

    def dispatch(self) -> jax.Array:
        """Dispatches the steps, not waiting; the last step's marker."""
        marker = None
        for _ in range(self.count):
            caches, marker = _step(tuple(self.rig.caches), self.passes)
            self.rig.caches = list(caches)
        assert marker is not None
        return marker

    def alone(self) -> dict[str, float]:
        t0 = now()
        marker = self.dispatch()
        t1 = now()
        marker.block_until_ready()
        return {"s": now() - t0, "dispatch_s": t1 - t0}


def _geometry(cfg: BenchConfig, name: str, dtype: str, path: PathMode, rig: Rig
              ) -> dict[str, Any]:
    block, pages = cfg.call_block_bytes, cfg.call_pages
    return {"case": name, "dtype": dtype, "path": path,
            "movers": sorted(set(rig.mgr("page", path).paths)), "integrity": "page",
            "layers": cfg.layers, "block_bytes": block,
            "cache_blocks": int(rig.caches[0].shape[0]), "pages": pages,
            "bytes": pages * cfg.layers * block}


def _rig(cfg: BenchConfig, blocks: int, dtype: str, path: PathMode, host_pages: int) -> Rig:
    caches = make_caches(cfg.layers, blocks, cfg.call_block_bytes, dtype)
    return Rig(caches, host_pages, kinds=(("page", path),))


def _queued_case(cfg: BenchConfig, name: str, dtype: str, path: PathMode) -> dict[str, Any]:
    k = cfg.call_pages
    ids = list(range(k))
    rig = _rig(cfg, cfg.call_blocks, dtype, path, 2 * k)
    try:
        mgr = rig.mgr("page", path)
        mgr.warmup(k)
        held = rig.hold("page", ids, path=path)
        steps = _Steps(rig, cfg.queued_steps, cfg.step_ms)

        def offload(queued: bool = True) -> dict[str, float]:
            keys = rig.keys(k)
            marker = steps.dispatch() if queued else None
            t0 = now()
            handle = mgr.offload(rig.caches, ids, keys)
            t1 = now()
            done = marker is None or marker.is_ready()
            pages = handle.wait()
            t2 = now()
            mgr.free(pages)
            return {"s": t2 - t0, "call_s": t1 - t0, "wait_s": t2 - t1, "done": float(done)}

        def load(gate: str = "all", queued: bool = True) -> dict[str, float]:
            marker = steps.dispatch() if queued else None
            t0 = now()
            rig.caches, handle = mgr.load(rig.caches, held, ids, gate=gate)
            t1 = now()
            done = marker is None or marker.is_ready()
            result = handle.result()
            t2 = now()
            check_loaded(result, k)
            jax.block_until_ready(rig.caches)  # the next variant starts with no work queued
            return {"s": t2 - t0, "call_s": t1 - t0, "result_s": t2 - t1, "done": float(done)}

        t = interleaved({"steps": steps.alone, "offload": offload, "load": load,
                         "load_layer": lambda: load("layer"),
                         "idle_offload": lambda: offload(queued=False),
                         "idle_load": lambda: load(queued=False),
                         "idle_load_layer": lambda: load("layer", queued=False)},
                        cfg.call_repeats)
        row = _geometry(cfg, name, dtype, path, rig)
        row.update({"steps": cfg.queued_steps, "step_passes": steps.passes,
                    "repeats": cfg.call_repeats,
                    "steps_alone": {"total": stats(t["steps"]["s"]),
                                    "dispatch": stats(t["steps"]["dispatch_s"])}})
        queued_s = row["steps_alone"]["total"]["p50_s"]
        for op, rest in (("offload", "wait"), ("load", "result"), ("load_layer", "result")):
            timing = t[op]
            row[op] = {"call": stats(timing["call_s"]), rest: stats(timing[f"{rest}_s"]),
                       "total": stats(timing["s"]),
                       "steps_done_at_return": float(np.mean(timing["done"])),
                       # The call's p50 as a fraction of the queued steps' time (what
                       # Targets.call_queued_fraction bounds in the engine-fit section).
                       "call_fraction": stats(timing["call_s"])["p50_s"] / queued_s}
            # The same call with no device work queued: its host time alone.
            row[f"idle_{op}"] = {"call": stats(t[f"idle_{op}"]["call_s"])}
        return row
    finally:
        rig.close()


def queued_section(cfg: BenchConfig, progress: Progress) -> list[dict[str, Any]]:
    """Caller-thread time of ``offload()`` / ``load()`` behind queued donating steps."""
    rows = []
    for name, dtype, path in call_cases(cfg):
        progress.step("queued steps", f"queued steps: {cfg.queued_steps} donating steps, "
                      f"then offload / load of {cfg.call_pages} pages x {cfg.layers} layers "
                      f"({format_bytes(cfg.call_block_bytes)} {dtype} blocks, path={path})")
        rows.append(_queued_case(cfg, name, dtype, path))
    return rows


def _first_calls(rig: Rig, path: PathMode, k: int) -> dict[str, dict[str, float]]:
    """One offload + wait, then one load + result, of ``k`` pages: their times."""
    mgr = rig.mgr("page", path)
    ids = list(range(k))
    with no_gc():
        t0 = now()
        handle = mgr.offload(rig.caches, ids, rig.keys(k))
        t1 = now()
        pages = handle.wait()
        t2 = now()
        rig.caches, load = mgr.load(rig.caches, pages, ids, gate="all")
        t3 = now()
        result = load.result()
        t4 = now()
    check_loaded(result, k)
    mgr.free(pages)
    return {"offload": {"s": t2 - t0, "call_s": t1 - t0, "wait_s": t2 - t1},
            "load": {"s": t4 - t2, "call_s": t3 - t2, "result_s": t4 - t3}}


def _first_call_case(cfg: BenchConfig, name: str, dtype: str, path: PathMode
                     ) -> dict[str, Any]:
    k = cfg.call_pages
    cold = _rig(cfg, cfg.cold_call_blocks, dtype, path, k)
    try:
        without = _first_calls(cold, path, k)
    finally:
        cold.close()
    # The queued-steps section's caches and pool (2 x k host pages): its warm-up finds
    # the programs compiled here (programs are compiled per cache shape and pool size).
    warm = _rig(cfg, cfg.call_blocks, dtype, path, 2 * k)
    try:
        t0 = now()
        buckets = warm.mgr("page", path).warmup(k)
        warmup_s = now() - t0
        row = _geometry(cfg, name, dtype, path, warm)
        row.update({"cold_cache_blocks": cfg.cold_call_blocks, "warmup_s": warmup_s,
                    "warmup_buckets": list(buckets), "without_warmup": without,
                    "with_warmup": _first_calls(warm, path, k),
                    "second_call": _first_calls(warm, path, k)})
        return row
    finally:
        warm.close()


def first_call_section(cfg: BenchConfig, progress: Progress) -> list[dict[str, Any]]:
    """A fresh manager's first offload and load of a size, without and with warm-up.

    Runs before ``queued_section``, whose caches have the shapes of the warm-up here:
    its own warm-up then finds the programs compiled.
    """
    rows = []
    for name, dtype, path in call_cases(cfg):
        progress.step("first call", f"first call: offload / load of {cfg.call_pages} pages x "
                      f"{cfg.layers} layers ({format_bytes(cfg.call_block_bytes)} {dtype} "
                      f"blocks, path={path}) without and with warm-up")
        rows.append(_first_call_case(cfg, name, dtype, path))
    return rows

