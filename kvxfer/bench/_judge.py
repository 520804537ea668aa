"""Judging a report against ``TARGET_TABLE``: PASS, MISS, or N/A for other hardware.

A target is judged where the run measured one of its sections; on a platform the
target does not apply to it is one ``N/A`` line (no value), never a miss. Everything
here reads only the report dict, so a kept ``bench.json`` can be judged again.

Example:
    >>> report = {"meta": {"platform": "cpu"}, "memory": {"pool_over_plan": 1.004}}
    >>> [(t["status"], t["name"]) for t in evaluate_targets(report)]
    [('PASS', 'any: host pool bytes within 1% of the plan')]
    >>> exit_status({"targets": [{"status": "MISS"}]}, check=False), \\
    ...     exit_status({"targets": [{"status": "MISS"}]}, check=True)
    (0, 1)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from kvxfer._text import format_bytes
from kvxfer.bench._config import KiB, MiB
from kvxfer.bench._figures import pinned_figures
from kvxfer.bench._targets import TARGET_TABLE, Target, Targets

__all__ = ["evaluate_targets", "missed", "Verdict", "verdict", "summary", "exit_status",
           "MISS_MEANING"]

#: What a MISS means, said under the summary of every run that judged a target.
MISS_MEANING = ("A MISS is slower than the target on this machine, not a correctness "
                "failure (correctness is what kvxfer demo and the tests check); "
                "BENCHMARKS.md lists which targets are met today on which hardware; "
                "--check judges (exit 1 on a MISS).")

#: What an evaluator finds: (name without the platform, value, where it was read).
Line = tuple[str, float, str]


def _cell(row: dict[str, Any]) -> str:
    return f"{format_bytes(row['block_bytes'])} {row['dtype']}"


def _worst(pairs: Any) -> tuple[float, Any]:
    return min(pairs, key=lambda x: x[0])


def _cpu_fraction(report: dict[str, Any], t: float) -> list[Line]:
    cells = report["throughput"]
    batch = format_bytes(report["meta"]["config"]["batch_bytes"])
    out = []
    for op, m in (("offload", "offload_page"), ("load", "load_page_all"),
                  ("offload", "offload_off"), ("load", "load_off_all")):
        v, row = _worst((r["methods"][m]["fraction_of_limit"], r) for r in cells)
        out.append((f"{op} of {batch} per call (integrity={m.split('_')[1]}) >= {t:g}x memcpy",
                    v, f"worst cell: {_cell(row)}"))
    pinned = [(r, f) for r in cells if (f := pinned_figures(r)) is not None]
    for name in ("offload page", "load page", "offload off", "load off") if pinned else ():
        v, row = _worst((f[name]["fraction_of_limit"], r) for r, f in pinned)
        op, integ = name.split()
        out.append((f"pinned mover {op} of {batch} per call (integrity={integ}) >= {t:g}x "
                    "memcpy", v, f"worst cell: {_cell(row)}"))
    return out


def _integrity_ratio(report: dict[str, Any], t: float) -> list[Line]:
    block_ref = report["meta"]["config"]["reference"][0]
    ref_cells = [r for r in report["throughput"] if r["block_bytes"] == block_ref]
    out = []
    for op, on, off in (("offload", "offload_page", "offload_off"),
                        ("load", "load_page_all", "load_off_all")):
        v, row = _worst((r["methods"][on]["gbps"] / r["methods"][off]["gbps"], r)
                        for r in ref_cells)
        out.append((f"{op} integrity=page >= {t:g}x integrity=off at "
                    f"{format_bytes(block_ref)} blocks", v, f"worst dtype: {row['dtype']}"))
    return out


def _cache_size(report: dict[str, Any], t: float) -> list[Line]:
    cs = report["cache_size"]
    return [(f"load {cs['pages']} pages into {format_bytes(cs['large_cache_bytes'])} vs "
             f"{format_bytes(cs['small_cache_bytes'])} cache <= {t:g}x time",
             cs["variants"]["page_auto"]["ratio"], "integrity=page, gate=all")]


_OPS = ("offload", "load", "load_layer")


def _shape(fit: dict[str, Any]) -> str:
    r0 = fit["calls"][0]
    return f"{r0['pages']} pages x {r0['layers']} layers"


def _idle_worst(fit: dict[str, Any], paths: tuple[str, ...] | None) -> tuple[float, str]:
    return max((r[f"idle_{op}"]["p50_s"] * 1e3, f"path={r['path']}, {op}")
               for r in fit["calls"] if paths is None or r["path"] in paths for op in _OPS)


def _call_idle_cpu(report: dict[str, Any], t: float) -> list[Line]:
    fit = report["fit"]
    v, where = _idle_worst(fit, ("pinned", "staged"))
    return [(f"host time of a call, {_shape(fit)}, device idle (path=pinned, path=staged) "
             f"<= {t:g} ms", v, f"p50, worst: {where}")]


def _call_idle_accelerator(report: dict[str, Any], t: float) -> list[Line]:
    out = []
    for row in report.get("overhead", ()):
        label = f"integrity={row['integrity']}" + \
            (f", gate={row['gate']}" if row["gate"] != "-" else "")
        out.append((f"host overhead per {row['op']}() call, {row['pages']} pages x "
                    f"{row['layers']} layers ({label}) <= {t:g} ms",
                    row["call"]["p50_s"] * 1e3, "p50 of the call"))
    if "fit" in report:
        v, where = _idle_worst(report["fit"], None)
        out.append((f"host time of a call, {_shape(report['fit'])}, device idle (every "
                    f"path) <= {t:g} ms", v, f"p50, worst: {where}"))
    return out


def _queued(report: dict[str, Any], t: float) -> list[Line]:
    fit = report["fit"]
    v, where = max((r[f"queued_{op}"]["fraction"], f"path={r['path']}, {op}")
                   for r in fit["calls"] for op in _OPS)
    return [(f"call behind {fit['calls'][0]['steps']} queued steps <= {t:g} of their time "
             "(every path)", v, f"p50, worst: {where}")]


def _hit(report: dict[str, Any], t: float) -> list[Line]:
    fit = report["fit"]
    hit = next((h for h in fit["hits"] if h["path"] == "auto"), fit["hits"][0])
    return [(f"1-page x {fit['calls'][0]['layers']} layers hit, call to last layer verified "
             f"<= {t:g} ms", hit["hit"]["p50_s"] * 1e3, f"p50, path={hit['path']}")]


def _warmup(report: dict[str, Any], t: float) -> list[Line]:
    fit = report["fit"]
    v, where = max((w["cold"], f"path={w['path']}") for w in fit["warmups"])
    return [(f"warmup({fit['warmups'][0]['pages']}) of {fit['calls'][0]['layers']} layers "
             f"in a fresh process <= {t:g} s (every path)", v, f"worst: {where}")]


def _warmup_cached(report: dict[str, Any], t: float) -> list[Line]:
    fit = report["fit"]
    v, where = max((w["persistent_cache"], f"path={w['path']}") for w in fit["warmups"])
    return [(f"warmup({fit['warmups'][0]['pages']}) over a persistent compilation cache, "
             f"second process <= {t:g} s", v, f"worst: {where}")]


def _pool(report: dict[str, Any], t: float) -> list[Line]:
    return [(f"host pool bytes within {t:.0%} of the plan", report["memory"]["pool_over_plan"],
             "pool/plan")]


_GPU_OPS = (("offload", "offload_page"), ("load", "load_page_all"))


def _sweep_fraction(keep: Callable[[dict[str, Any]], bool], words: str, where: str
                    ) -> Callable[[dict[str, Any], float], list[Line]]:
    def evaluate(report: dict[str, Any], t: float) -> list[Line]:
        out = []
        for op, m in _GPU_OPS:
            vs = [r["methods"][m]["fraction_of_limit"] for r in report["sweep"] if keep(r)]
            if vs:
                out.append((f"{op} {words.format(t=t)}", min(vs),
                            where.format(bytes=format_bytes(report["sweep"][0]["bytes"]))))
        return out
    return evaluate


def _small_blocks(report: dict[str, Any], t: float) -> list[Line]:
    out = []
    for op, m in _GPU_OPS:
        vs = [r["methods"][m]["fraction_of_limit"] for r in report["throughput"]
              if r["block_bytes"] == 16 * KiB and r["bytes"] >= 64 * MiB]
        if vs:
            out.append((f"{op} of 16 KiB blocks >= {t:g}x pinned copy at >= 64 MiB per call",
                        min(vs), "worst 16 KiB cell"))
    return out


def _over_plain_jax(report: dict[str, Any], t: float) -> list[Line]:
    """kvxfer (integrity=page) over the best plain-JAX route, every case from 8 MiB."""
    rows = [r for r in report.get("throughput", []) + report.get("sweep", [])
            if r["bytes"] >= 8 * MiB and "jax_gather_pinned" in r["methods"]]
    out = []
    for op, ours, theirs in (("offload", "offload_page", "jax_gather_pinned"),
                             ("load", "load_page_all", "jax_put_scatter")) if rows else ():
        v, row = _worst((r["methods"][ours]["gbps"] / r["methods"][theirs]["gbps"], r)
                        for r in rows)
        out.append((f"{op} >= {t:g}x the plain-JAX route (digest on device) from 8 MiB per "
                    "call", v, f"worst case: {format_bytes(row['bytes'])} of "
                    f"{format_bytes(row['block_bytes'])} blocks"))
    return out


def _over_device_get(report: dict[str, Any], t: float) -> list[Line]:
    ref = next(r for r in report["throughput"] if [r["block_bytes"], r["dtype"]] ==
               list(report["meta"]["config"]["reference"]))
    v = ref["methods"]["offload_page"]["gbps"] / ref["methods"]["user_device_get"]["gbps"]
    return [(f"offload >= {t:g}x the per-page device_get loop", v,
             f"{format_bytes(ref['bytes'])} per call")]


def _store_lookup(report: dict[str, Any], t: float) -> list[Line]:
    # Fewer pages (--smoke) have less to batch: not a target.
    return [(f"{r['store']}: {r['pages']}-page prefix lookup, one get_many >= {t:g}x as fast "
             "as one get per page", r["speedup"],
             f"p50 over p50, {format_bytes(r['blob_bytes'])} pages, {r['spec']}")
            for r in report["store_lookup"] if r["reference"] and r["pages"] >= 32]


#: How each row of ``TARGET_TABLE`` reads its values from a report.
_EVALUATORS: dict[str, Callable[[dict[str, Any], float], list[Line]]] = {
    "cpu_fraction": _cpu_fraction,
    "integrity_ratio_cpu": _integrity_ratio,
    "integrity_ratio_gpu": _integrity_ratio,
    "cache_size_ratio": _cache_size,
    "call_idle_ms_cpu": _call_idle_cpu,
    "host_overhead_ms": _call_idle_accelerator,
    "call_queued_fraction": _queued,
    "hit_ms_cpu": _hit,
    "hit_ms_gpu": _hit,
    "warmup_s_cpu": _warmup,
    "warmup_cached_s": _warmup_cached,
    "pool_tolerance": _pool,
    "gpu_fraction_64mib": _sweep_fraction(lambda r: r["bytes"] >= 64 * MiB,
                                          ">= {t:g}x pinned copy at >= 64 MiB per call",
                                          "worst size >= 64 MiB"),
    "gpu_fraction_8mib": _sweep_fraction(lambda r: 8 * MiB <= r["bytes"] < 64 * MiB,
                                         ">= {t:g}x pinned copy at 8 MiB per call",
                                         "worst size in [8, 64) MiB"),
    "gpu_fraction_one_page": _sweep_fraction(lambda r: r["pages"] == 1,
                                             "of one page >= {t:g}x pinned copy",
                                             "{bytes} per call"),
    "gpu_fraction_16kib_blocks": _small_blocks,
    "gpu_over_plain_jax": _over_plain_jax,
    "gpu_over_device_get": _over_device_get,
    "store_lookup_speedup": _store_lookup,
}


def _line(spec: Target, name: str, value: float | None, threshold: float, status: str,
          where: str) -> dict[str, Any]:
    return {"name": name, "value": None if value is None else float(value), "op": spec.op,
            "threshold": float(threshold), "status": status, "where": where,
            "target": spec.field, "hardware": spec.hardware_label}


def _met(op: str, value: float, threshold: float) -> bool:
    return {">=": value >= threshold, "<=": value <= threshold,
            "within": abs(value - 1) <= threshold}[op]


def evaluate_targets(report: dict[str, Any], targets: Targets = Targets()
                     ) -> list[dict[str, Any]]:
    """The target lines of a report: PASS or MISS where a target applies, else N/A.

    Args:
      report: a report with its measured sections (``targets`` may be absent).
      targets: the thresholds (a test forces a miss with, say,
        ``Targets(host_overhead_ms=0)``).

    Returns:
      One dict per line, in ``TARGET_TABLE``'s order, for every target one of whose
      sections the run measured: ``name``, ``value`` (None where N/A), ``op``,
      ``threshold``, ``status`` (``"PASS"``, ``"MISS"`` or ``"N/A"``: for other
      hardware than the run's, one line per target), ``where`` (the case the value
      was read from), ``target`` (the ``Targets`` field), ``hardware``.
    """
    platform = report["meta"]["platform"]
    out: list[dict[str, Any]] = []
    for spec in TARGET_TABLE:
        if not any(s in report for s in spec.sections):
            continue
        threshold = getattr(targets, spec.field)
        if not spec.applies(platform):
            out.append(_line(spec, f"{spec.hardware_label}: {spec.statement(threshold)}",
                             None, threshold, "N/A", f"not applicable to this {platform} run"))
            continue
        prefix = f"{spec.hardware_label if 'any' in spec.hardware else platform}: "
        for name, value, where in _EVALUATORS[spec.field](report, threshold):
            out.append(_line(spec, prefix + name, value, threshold,
                             "PASS" if _met(spec.op, value, threshold) else "MISS", where))
    return out


def missed(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of ``report`` that missed (``status == "MISS"``; never an N/A one).

    Example:
        >>> report = {"targets": [
        ...     {"name": "a", "status": "PASS", "value": 0.7, "where": "x"},
        ...     {"name": "b", "status": "MISS", "value": 3.0, "where": "y"},
        ...     {"name": "c", "status": "N/A", "value": None, "where": "z"}]}
        >>> [t["name"] for t in missed(report)]
        ['b']
    """
    return [t for t in report["targets"] if t["status"] == "MISS"]


class Verdict(NamedTuple):
    """A report's target lines by status."""

    met: list[dict[str, Any]]
    missed: list[dict[str, Any]]
    not_applicable: list[dict[str, Any]]


def verdict(report: dict[str, Any]) -> Verdict:
    """The report's target lines sorted into met, missed and not applicable."""
    lines = report["targets"]
    return Verdict([t for t in lines if t["status"] == "PASS"], missed(report),
                   [t for t in lines if t["status"] == "N/A"])


def summary(report: dict[str, Any]) -> str:
    """One line: how many of the targets that apply to the run's hardware were met.

    Example:
        >>> summary({"meta": {"platform": "cpu"}, "targets": [
        ...     {"status": "PASS"}, {"status": "MISS"}, {"status": "N/A"}]})
        '1 of 2 targets that apply to cpu met, 1 missed; 1 for other hardware not applicable'
    """
    v = verdict(report)
    judged = len(v.met) + len(v.missed)
    line = f"{len(v.met)} of {judged} targets that apply to {report['meta']['platform']} met"
    if v.missed:
        line += f", {len(v.missed)} missed"
    if v.not_applicable:
        line += f"; {len(v.not_applicable)} for other hardware not applicable"
    return line


#: What a run of the smoke preset says in place of its target lines.
NOT_JUDGED = ("Targets: not judged. --smoke runs tiny sizes to check that every section "
              "runs; figures that small mean little (kvxfer bench --quick, or the full "
              "run, judges them; --check judges these anyway).")


def judged(report: dict[str, Any]) -> bool:
    """Whether a run's figures are judged against the targets when it is printed: every
    preset's but the smoke preset's, whose tiny sizes only show that each section runs.

    Example:
        >>> judged({"meta": {"preset": "smoke"}}), judged({"meta": {"preset": "quick"}})
        (False, True)
    """
    return report["meta"].get("preset") != "smoke"


def exit_status(report: dict[str, Any], check: bool) -> int:
    """What ``kvxfer bench`` exits with after a complete run: 0, or 1 when ``check``
    and a target that applies to the run's hardware missed."""
    return 1 if check and missed(report) else 0
