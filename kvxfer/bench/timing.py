"""How the benchmark times things: samples, regions without GC, statistics, progress.

Everything here is independent of kvxfer: the limit copies, the user baselines and
kvxfer's own calls are all timed with it, and so are the ``tpu_probes``.

Example:
    >>> s = stats(sample(lambda: 0.002, 5), nbytes=10**6)
    >>> s["n"], s["best_s"], round(s["gbps"], 3)
    (5, 0.002, 0.5)
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from kvxfer import _interrupt

__all__ = ["now", "no_gc", "frozen_heap", "gbps", "stats", "sample", "interleaved",
           "per_page_loop", "Progress", "format_duration"]

#: The clock every figure is read from.
now = time.perf_counter


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Runs the body without the cyclic GC (a collection is not a transfer cost).

    Collects once first, so garbage of earlier work is not left to the next region.

    Example:
        >>> import gc
        >>> with no_gc():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Runs the body with the objects that exist before it left out of every collection.

    ``no_gc`` collects before each timed region; a full collection walks every object
    the process holds, JAX's own among them (over 100,000 once it is imported: 80 ms
    a collection on a 2-core CPU, seconds over a run). Objects made in the body are
    collected as before; those from before it, once it ends.

    Example:
        >>> import gc
        >>> with frozen_heap():
        ...     gc.get_freeze_count() > 0
        True
        >>> gc.get_freeze_count()
        0
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (1e9 bytes per second); NaN when ``seconds`` is not positive.

    Example:
        >>> gbps(3 * 10**9, 1.5)
        2.0
        >>> gbps(1, 0.0)
        nan
    """
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan


def stats(samples: Sequence[float], nbytes: int | None = None) -> dict[str, Any]:
    """Best, p50 and p99 of ``samples`` (seconds); with ``nbytes``, the GB/s of best and p50.

    Example:
        >>> s = stats([0.2, 0.1, 0.4], nbytes=10**9)
        >>> s["n"], s["best_s"], s["p50_s"], s["gbps"], s["gbps_p50"]
        (3, 0.1, 0.2, 10.0, 5.0)
    """
    if len(samples) == 0:
        raise ValueError("stats() of no samples")
    s = np.asarray(samples, dtype=np.float64)
    out: dict[str, Any] = {"n": int(s.size), "best_s": float(s.min()),
                           "p50_s": float(np.percentile(s, 50)),
                           "p99_s": float(np.percentile(s, 99))}
    if nbytes:
        out["bytes"] = int(nbytes)
        out["gbps"] = gbps(nbytes, out["best_s"])
        out["gbps_p50"] = gbps(nbytes, out["p50_s"])
    return out


def sample(fn: Callable[[], float], repeats: int, *, min_seconds: float = 0.0,
           budget_s: float | None = None) -> list[float]:
    """Up to ``repeats`` samples of ``fn``, which does one run and returns its seconds.

    Within a sample ``fn`` runs until its seconds add up to ``min_seconds`` (copies of
    a few KiB take microseconds, below the clock's noise); the sample is their mean.
    With ``budget_s``, sampling stops once the samples add up to it (a slow baseline
    gets at least one sample, not ``repeats`` of them).

    Example:
        >>> calls = []
        >>> sample(lambda: calls.append(1) or 0.25, 2, min_seconds=1.0)
        [0.25, 0.25]
        >>> len(calls)
        8
        >>> sample(lambda: 2.0, 5, budget_s=3.0)
        [2.0, 2.0]
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be at least 1")
    out: list[float] = []
    while len(out) < repeats and (budget_s is None or sum(out) < budget_s):
        total, runs = 0.0, 0
        while runs == 0 or total < min_seconds:
            total += fn()
            runs += 1
        out.append(total / runs)
    return out


def interleaved(variants: dict[str, Callable[[], float | dict[str, float]]], repeats: int
                ) -> dict[str, dict[str, list[float]]]:
    """Runs every variant once (warm-up), then ``repeats`` rounds of all variants, no GC.

    Interleaving round by round means a noisy neighbour slows every variant alike. A
    variant returns its elapsed seconds, or a dict of named timings (``"s"`` the
    total). The warm-up's total is kept as ``"warmup_s"``.

    Example:
        >>> order = []
        >>> t = interleaved({"a": lambda: order.append("a") or 1.0,
        ...                  "b": lambda: order.append("b") or {"s": 2.0, "call_s": 0.5}}, 2)
        >>> "".join(order)
        'ababab'
        >>> t["a"], t["b"]["call_s"]
        ({'warmup_s': [1.0], 's': [1.0, 1.0]}, [0.5, 0.5])
    """
    out: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    for name, fn in variants.items():
        r = fn()
        out[name]["warmup_s"] = [float(r["s"] if isinstance(r, dict) else r)]
    with no_gc():
        for _ in range(repeats):
            for name, fn in variants.items():
                r = fn()
                for key, v in (r.items() if isinstance(r, dict) else (("s", r),)):
                    out[name].setdefault(key, []).append(float(v))
    return out


def per_page_loop(step: Callable[[int], Any], finish: Callable[[list[Any]], Any],
                  pages: Sequence[int], page_bytes: int, budget_s: float, repeats: int
                  ) -> dict[str, Any]:
    """Times a loop that moves one page per step; a loop over budget stops early.

    ``step(page)`` moves one page (its block of every layer) and returns what it
    produced; ``finish(outputs)`` waits for them. One warm-up step runs first (it
    compiles). Times are for all of ``pages``, extrapolated from the pages a loop cut
    short moved; ``pages_timed`` says how many that was at the least.

    Example:
        >>> out = per_page_loop(lambda p: p, lambda outs: None, range(4), 1000,
        ...                     budget_s=10.0, repeats=3)
        >>> out["n"], out["pages_timed"], out["bytes"]
        (3, 4, 4000)
    """
    finish([step(pages[0])])
    samples, moved = [], []
    spent = 0.0
    with no_gc():
        for _ in range(max(1, repeats)):
            outs = []
            t0 = now()
            for p in pages:
                outs.append(step(p))
                if now() - t0 > budget_s:
                    break
            finish(outs)
            dt = now() - t0
            samples.append(dt)
            moved.append(len(outs))
            del outs
            spent += dt
            if spent > budget_s:
                break
    whole = [t * len(pages) / m for t, m in zip(samples, moved)]
    out = stats(whole, len(pages) * page_bytes)
    out["pages_timed"] = int(min(moved))
    return out


def format_duration(seconds: float) -> str:
    """``75.4`` -> ``'1:15'``; ``3725`` -> ``'1:02:05'`` (minutes:seconds, hours when due).

    Example:
        >>> format_duration(75.4), format_duration(3725), format_duration(4)
        ('1:15', '1:02:05', '0:04')
    """
    total = int(round(max(0.0, seconds)))
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Progress lines with the time elapsed and an estimate of the time left.

    The run announces its steps up front (``plan``, one kind a step, in order). When a
    step starts, the steps before it are done; each step still to run is estimated
    at the mean time of the finished steps of its kind, or of all finished steps
    while none of its kind has finished. Lines show the estimate only once a quarter
    of the steps (two at least) have finished: before that it rests on too few kinds
    and can be off by several times; and a shown estimate never rises (a step slower
    than its kind's mean holds it where it was). A note within a step carries that
    step's number.

    Args:
      plan: the kind of every step of the run, in order (``"throughput"``, ...).
      say: where the lines go.
      clock: seconds (``time.perf_counter``; a test passes its own).

    Example:
        >>> t = [0.0]
        >>> p = Progress(["cell", "cell", "sweep"], print, clock=lambda: t[0])
        >>> p.step("cell", "first cell")
        [1/3 0:00 elapsed] first cell
        >>> t[0] = 10.0
        >>> p.step("cell", "second cell")
        [2/3 0:10 elapsed] second cell
        >>> p.left_s()
        20.0
        >>> t[0] = 40.0
        >>> p.step("sweep", "the sweep")
        [3/3 0:40 elapsed, about 0:20 left] the sweep
        >>> p.note("a line within the step")
        [3/3 0:40 elapsed] a line within the step
    """

    def __init__(self, plan: Iterable[str], say: Callable[[str], None],
                 clock: Callable[[], float] = now):
        self.plan = list(plan)
        self.say = say
        self.clock = clock
        self.started = clock()
        self.done: list[tuple[str, float]] = []  # (kind, seconds) of finished steps
        self._current: tuple[str, float] | None = None
        self._shown_left: float | None = None  # the last estimate shown: never exceeded

    def _finish_current(self, t: float) -> None:
        if self._current is not None:
            kind, t0 = self._current
            self.done.append((kind, t - t0))
            self._current = None

    def left_s(self) -> float | None:
        """Estimated seconds of the current step and those after it (None: no basis yet)."""
        if not self.done:
            return None
        overall = sum(s for _, s in self.done) / len(self.done)
        by_kind: dict[str, list[float]] = {}
        for kind, s in self.done:
            by_kind.setdefault(kind, []).append(s)
        rest = self.plan[len(self.done):]
        return sum(sum(by_kind[k]) / len(by_kind[k]) if k in by_kind else overall
                   for k in rest)

    def shows_estimate(self) -> bool:
        """Whether step lines carry the estimate: once a quarter of the steps, two at
        least, have finished."""
        return len(self.done) >= max(2, len(self.plan) / 4)

    def step(self, kind: str, line: str) -> None:
        """Starts the next step (of ``kind``) and says ``line`` with the times. A safe
        point: under the command line, a Ctrl-C stops the run here."""
        _interrupt.check()
        t = self.clock()
        self._finish_current(t)
        self._current = (kind, t)
        left = self.left_s() if self.shows_estimate() else None
        if left is not None:
            if self._shown_left is not None:
                left = min(left, self._shown_left)
            self._shown_left = left
        self.say(f"[{len(self.done) + 1}/{len(self.plan)} {format_duration(t - self.started)} "
                 "elapsed" + (f", about {format_duration(left)} left" if left is not None
                              else "") + f"] {line}")

    def note(self, line: str) -> None:
        """Says ``line`` with the current step's number and the elapsed time (a safe
        point too)."""
        _interrupt.check()
        number = len(self.done) + (1 if self._current is not None else 0)
        self.say(f"[{max(number, 1)}/{len(self.plan)} "
                 f"{format_duration(self.clock() - self.started)} elapsed] {line}")

