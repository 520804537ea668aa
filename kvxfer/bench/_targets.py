"""kvxfer's targets: each stated once, with the hardware it applies to and why its number.

``TARGET_TABLE`` is the one source of the thresholds: ``Targets`` takes its defaults
from it, the judging reads each row's hardware from it, and ``targets_table`` prints
it (``kvxfer bench --targets``; BENCHMARKS.md holds the same table). A target for
other hardware than the run's is shown as not applicable, never counted as a miss.

Example:
    >>> row = TARGET_BY_FIELD["call_idle_ms_cpu"]
    >>> row.hardware, row.statement(), row.applies("gpu")
    (('cpu',), 'host time of one call, device idle (p50, paths that enqueue) <= 3 ms', False)
    >>> Targets().call_idle_ms_cpu == row.default
    True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from kvxfer._text import format_bytes
from kvxfer.bench._config import BenchConfig

__all__ = ["Hardware", "Target", "TARGET_TABLE", "TARGET_BY_FIELD", "Targets", "targets_table"]

#: The hardware a target applies to: a JAX platform, or every one.
Hardware = Literal["cpu", "gpu", "tpu", "any"]

#: How a measured value meets its threshold.
Op = Literal[">=", "<=", "within"]


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """One row of the targets table.

    Attributes:
      field: the ``Targets`` field that holds the threshold.
      hardware: the platforms it applies to (``("any",)``: every one).
      op: ``">="``, ``"<="`` or ``"within"`` (``|value - 1| <= threshold``).
      default: kvxfer's threshold.
      unit: printed after the threshold (``"x"``, ``" ms"``, ``" s"``, ``""``).
      sections: the report sections it reads; judged when one of them was measured.
      what: what is measured, ending where the threshold goes.
      tail: words after the threshold (``" of their time"``), if any.
      why: the reason for the number.
      lines: how the target expands into a run's target lines (``"1 line"``,
        ``"2 lines: offload, load"``); a count leads wherever it is fixed.
    """

    field: str
    hardware: tuple[Hardware, ...]
    op: Op
    default: float
    unit: str
    sections: tuple[str, ...]
    what: str
    why: str
    tail: str = ""
    lines: str = "1 line"

    def applies(self, platform: str) -> bool:
        """Whether the target judges a run on ``platform`` (a JAX platform name)."""
        return "any" in self.hardware or platform in self.hardware

    @property
    def hardware_label(self) -> str:
        """``"cpu"``, ``"gpu, tpu"``, ``"any"``."""
        return ", ".join(self.hardware)

    def statement(self, threshold: float | None = None) -> str:
        """The target in words, with ``threshold`` (default: kvxfer's)."""
        t = self.default if threshold is None else threshold
        bound = f"within {t:.0%}" if self.op == "within" else f"{self.op} {t:g}{self.unit}"
        return f"{self.what} {bound}{self.tail}"


def _cpu(field: str, op: Op, default: float, unit: str, sections: tuple[str, ...],
         what: str, why: str, tail: str = "", lines: str = "1 line") -> Target:
    return Target(field, ("cpu",), op, default, unit, sections, what, why, tail, lines)


def _gpu(field: str, op: Op, default: float, unit: str, sections: tuple[str, ...],
         what: str, why: str, tail: str = "", lines: str = "1 line") -> Target:
    return Target(field, ("gpu",), op, default, unit, sections, what, why, tail, lines)


def _any(field: str, op: Op, default: float, unit: str, sections: tuple[str, ...],
         what: str, why: str, tail: str = "", lines: str = "1 line") -> Target:
    return Target(field, ("any",), op, default, unit, sections, what, why, tail, lines)


_FULL, _QUICK = BenchConfig.full(), BenchConfig.quick()
_BATCH = format_bytes(_FULL.batch_bytes)
_WARMUP = f"warmup of {_FULL.fit_pages} pages ({_QUICK.fit_pages} with --quick)"
_REF = format_bytes(_FULL.reference[0])
_TWO = "2 lines: offload, load"

#: Every target, in the order reports list them.
TARGET_TABLE: tuple[Target, ...] = (
    _cpu("cpu_fraction", ">=", 0.5, "x memcpy", ("throughput",),
         f"offload and load of {_BATCH} per call, integrity off and page, worst "
         "throughput cell, path=auto and the pinned mover:",
         "On CPU the limit is a memcpy of the same bytes; half of it leaves room for the "
         "gather or scatter and, with integrity, one more read of every byte (the digest), "
         "and fails a path that copies the payload twice.",
         lines="8 lines: offload/load x integrity off/page, for path=auto and for the "
         "pinned mover (4 where the pinned mover did not run)"),
    _cpu("integrity_ratio_cpu", ">=", 0.6, "x", ("throughput",),
         "integrity=page over integrity=off throughput, offload and load, "
         f"{_REF} blocks, worst dtype:",
         "On CPU the same cores copy and digest; the digest reads every byte once more, "
         "which may cost up to 40 % of the copy's speed.", lines=_TWO),
    _gpu("integrity_ratio_gpu", ">=", 0.95, "x", ("throughput",),
         "integrity=page over integrity=off throughput, offload and load, "
         f"{_REF} blocks, worst dtype:",
         "On a GPU the digest runs on the device beside a copy the link bounds: it may "
         "cost 5 % at most.", lines=_TWO),
    _any("cache_size_ratio", "<=", 2.0, "x the time", ("cache_size",),
         "load of the same pages into the large cache (1 GiB) against the small one "
         "(64 MiB):",
         "A load costs the pages it moves, not the cache's size; a program that touches "
         "the whole cache (a scatter over it, a copy of it) would take up to 16x as long.",
         lines="1 line (integrity=page, path=auto)"),
    _cpu("call_idle_ms_cpu", "<=", 3.0, " ms", ("fit",),
         "host time of one call, device idle (p50, paths that enqueue)",
         "The call runs on an engine's scheduler thread, between its steps. On XLA:CPU "
         "the engine-fit section's path=pinned and path=staged calls dispatch a program "
         "per layer group on the cores that run them (1.5-2.7 ms measured for 64 pages x "
         "32 layers); path=auto is the raw path there, which copies on the caller's "
         "thread by design, so it and the host-overhead section are shown, not judged.",
         lines="1 line: the worst of path=pinned and path=staged over offload(), "
         "load(gate=all) and load(gate=layer)"),
    Target("host_overhead_ms", ("gpu", "tpu"), "<=", 1.0, " ms", ("overhead", "fit"),
           "host time of one call, device idle (p50, every path)",
           "The same call on an accelerator only enqueues device work and hands host "
           "work to kvxfer's thread; nothing copies payload on the caller's thread, so "
           "1 ms of Python and dispatch is its budget (host-overhead and engine-fit "
           "sections).",
           lines="7 lines: one per host-overhead row (offload x integrity off/page, load x "
           "integrity off/page x gate all/layer) and one for the engine-fit section's worst "
           "call (1 line with --only fit)"),
    _any("call_queued_fraction", "<=", 0.1, "", ("fit",),
         "host time of one call behind queued donating steps, every path (p50):",
         "A scheduler thread must never wait for the device work queued before it; a "
         "tenth of the steps' time allows for dispatch and the GIL, not a wait.",
         " of the steps' time", lines="1 line: the worst of every path and call"),
    _cpu("hit_ms_cpu", "<=", 1.0, " ms", ("fit",),
         "1-page hit of every layer, load call to last layer verified (p50):",
         "A short prefix hit is what a user waits for before the next token: a "
         "millisecond keeps a verified hit cheaper than recomputing the page.",
         lines="1 line (path=auto)"),
    _gpu("hit_ms_gpu", "<=", 1.0, " ms", ("fit",),
         "1-page hit of every layer, load call to last layer verified (p50):",
         "As on CPU: a verified hit must stay cheaper than recomputing the page.",
         lines="1 line (path=auto)"),
    _cpu("warmup_s_cpu", "<=", 10.0, " s", ("fit",),
         f"{_WARMUP} in a fresh process, every path:",
         "Warm-up compiles every size bucket before serving: an engine's start can "
         "spend seconds on it, on a 2-core CPU too, not minutes.",
         lines="1 line: the worst path"),
    _any("warmup_cached_s", "<=", 3.0, " s", ("fit",),
         f"{_WARMUP} in a second process over a persistent compilation cache:",
         "A restarted engine with JAX's compilation cache reuses the compiled programs: "
         "what is left is loading them.", lines="1 line: the worst path"),
    _any("pool_tolerance", "within", 0.01, "", ("memory",),
         "host pool bytes against the plan's:",
         "Users size host memory by the plan; the pool allocated must be what it said."),
    _gpu("gpu_fraction_64mib", ">=", 0.9, "x pinned copy", ("sweep",),
         "offload and load (integrity=page) at 64 MiB per call and more:",
         "From 64 MiB a call, per-call costs are small against the bytes: kvxfer must "
         "run at the link (the pinned copy of the same bytes) less 10 %.", lines=_TWO),
    _gpu("gpu_fraction_8mib", ">=", 0.7, "x pinned copy", ("sweep",),
         "offload and load (integrity=page) from 8 MiB up to 64 MiB per call:",
         "At 8 MiB a call per-call costs show; they may take 30 %.", lines=_TWO),
    _gpu("gpu_fraction_one_page", ">=", 0.4, "x pinned copy", ("sweep",),
         "offload and load (integrity=page) of one page:",
         "One page (a short prefix) is mostly per-call cost; 0.4x still bounds it.", lines=_TWO),
    _gpu("gpu_fraction_16kib_blocks", ">=", 0.5, "x pinned copy", ("throughput",),
         "offload and load (integrity=page) of 16 KiB blocks at 64 MiB per call and more:",
         "Small blocks mean many small copies; gathered on the device first they must "
         "keep half the link.", lines=_TWO),
    _gpu("gpu_over_plain_jax", ">=", 1.2, "x", ("throughput", "sweep"),
         "offload and load (integrity=page) against the best plain-JAX route with a "
         "digest on the device, every case from 8 MiB per call:",
         "The plain-JAX routes are what a user writes in ten lines; kvxfer must beat "
         "them by 20 % to be worth adopting.", lines=_TWO),
    _gpu("gpu_over_device_get", ">=", 100.0, "x", ("throughput",),
         f"offload against the per-page jax.device_get loop, {_REF} {_FULL.reference[1]} "
         "blocks:",
         "The per-page device_get loop, what users write first, pays a sync and a "
         "small copy per page; batching must win two orders of magnitude.",
         lines="1 line"),
    _any("store_lookup_speedup", ">=", 3.0, "x", ("store_lookup",),
         "32-page prefix lookup from each Redis store, one get_many against one get per "
         f"page (p50 over p50, {format_bytes(_FULL.lookup_reference_bytes)} pages):",
         "One get per page pays a round trip each; one get_many pays one per node. "
         "Below 32 pages (--smoke) there is too little to batch: not judged.",
         lines="1 line per Redis store measured (--store redis://...); none without one"),
)

#: The table by ``Targets`` field.
TARGET_BY_FIELD: dict[str, Target] = {t.field: t for t in TARGET_TABLE}
_D = {t.field: t.default for t in TARGET_TABLE}


@dataclasses.dataclass(frozen=True, slots=True)
class Targets:
    """The thresholds a run is checked against; the defaults are ``TARGET_TABLE``'s.

    Each field is one row of ``TARGET_TABLE``, which says what it measures, the
    hardware it applies to and why its number (``kvxfer bench --targets`` prints it).

    Example:
        >>> Targets().host_overhead_ms, Targets(host_overhead_ms=0.5).host_overhead_ms
        (1.0, 0.5)
    """

    cpu_fraction: float = _D["cpu_fraction"]
    cache_size_ratio: float = _D["cache_size_ratio"]
    integrity_ratio_cpu: float = _D["integrity_ratio_cpu"]
    integrity_ratio_gpu: float = _D["integrity_ratio_gpu"]
    host_overhead_ms: float = _D["host_overhead_ms"]
    pool_tolerance: float = _D["pool_tolerance"]
    gpu_fraction_64mib: float = _D["gpu_fraction_64mib"]
    gpu_fraction_8mib: float = _D["gpu_fraction_8mib"]
    gpu_fraction_one_page: float = _D["gpu_fraction_one_page"]
    gpu_fraction_16kib_blocks: float = _D["gpu_fraction_16kib_blocks"]
    gpu_over_plain_jax: float = _D["gpu_over_plain_jax"]
    gpu_over_device_get: float = _D["gpu_over_device_get"]
    call_idle_ms_cpu: float = _D["call_idle_ms_cpu"]
    call_queued_fraction: float = _D["call_queued_fraction"]
    hit_ms_cpu: float = _D["hit_ms_cpu"]
    hit_ms_gpu: float = _D["hit_ms_gpu"]
    warmup_s_cpu: float = _D["warmup_s_cpu"]
    warmup_cached_s: float = _D["warmup_cached_s"]
    store_lookup_speedup: float = _D["store_lookup_speedup"]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                    not math.isfinite(v) or v < 0:
                raise ValueError(f"Expected a finite number >= 0 for {f.name}. Got {v!r} of "
                                 f"type {type(v).__name__}")


def targets_table(markdown: bool = False, targets: Targets | None = None) -> str:
    """``TARGET_TABLE`` in words: hardware, target, the run lines it is judged on, why.

    Args:
      markdown: a markdown table of hardware, target and why (BENCHMARKS.md's) rather
        than three lines per target.
      targets: the thresholds to state (default: kvxfer's, the table's own).

    Example:
        >>> print(targets_table(markdown=True).splitlines()[0])
        | hardware | target | why |
        >>> for line in targets_table().splitlines()[2:4]:
        ...     print(line[:65])
        cpu       offload and load of 256 MiB per call, integrity off and
                  judged on 8 lines: offload/load x integrity off/page, f
    """
    if markdown:
        lines = ["| hardware | target | why |", "| --- | --- | --- |"]
        lines += [f"| {t.hardware_label} | {t.statement(_at(targets, t))} | {t.why} |"
                  for t in TARGET_TABLE]
        return "\n".join(lines)
    lines = [f"kvxfer's {len(TARGET_TABLE)} targets: hardware, target, the lines a run "
             "judges it on (for other hardware than the run's: one N/A line), why", ""]
    for t in TARGET_TABLE:
        lines += [f"{t.hardware_label:<9} {t.statement(_at(targets, t))}",
                  f"{'':<9} judged on {t.lines}",
                  f"{'':<9} why: {t.why}"]
    return "\n".join(lines)


def _at(targets: Targets | None, row: Target) -> float | None:
    return None if targets is None else getattr(targets, row.field)
