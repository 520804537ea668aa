"""What a run tells its reader: the targets it is checked against, the tables, the plot.

A report is the JSON-ready dict ``run_bench`` returns. Everything here reads only that
dict (its ``meta.config`` included), so a kept ``bench.json`` can be re-read, checked
and plotted again.

Example:
    >>> report = {"targets": [
    ...     {"name": "a", "status": "PASS", "value": 0.7, "where": "x"},
    ...     {"name": "b", "status": "MISS", "value": 3.0, "where": "y"}]}
    >>> [t["name"] for t in missed(report)]
    ['b']
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

from kvxfer._text import format_bytes, table
from kvxfer.bench._config import KiB, MiB
from kvxfer.bench._policies import policy_lines

__all__ = ["Targets", "evaluate_targets", "missed", "ZERO_OK", "iter_figures",
           "format_report", "pinned_figures", "Variant", "VARIANTS", "PANELS", "figure",
           "plot"]

#: Figures that may legitimately be zero: differences, the fraction of calls that
#: returned after the queued steps were done, and the policy section's counts (a tier
#: a case never hits, a write-through setting that gates nothing); all others are > 0.
ZERO_OK = frozenset({"host_transient_bytes", "device_persistent_bytes",
                     "device_transient_bytes", "steps_done_at_return", "host_hits",
                     "store_hits", "misses", "host_hit_rate", "store_hit_rate", "hit_rate",
                     "evictions", "store_pages_written", "store_bytes_written",
                     "store_writes_gated", "dropped"})


# ---------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Targets:
    """The thresholds a run is checked against; the defaults are kvxfer's targets.

    Attributes:
      cpu_fraction: on CPU, offload and load of ``batch_bytes`` per call, integrity
        off and page, reach at least this fraction of memcpy (worst cell).
      cache_size_ratio: loading ``cache_load_pages`` pages into the large cache
        takes at most this many times as long as into the small one.
      integrity_ratio_cpu, integrity_ratio_gpu: with ``integrity="page"``, offload and
        load reach at least this fraction of their ``integrity="off"`` throughput at
        the reference block size (worst dtype).
      host_overhead_ms: each ``offload()`` / ``load()`` call of the host-overhead
        section takes at most this long in the caller's thread (p50).
      pool_tolerance: the host pool's bytes are within this fraction of the plan's.
      gpu_fraction_64mib: on GPU, offload and load reach this fraction of the pinned
        copy at 64 MiB per call and more.
      gpu_fraction_8mib: on GPU, the same from 8 MiB up to 64 MiB per call.
      gpu_over_device_get: on GPU, offload is this many times as fast as the
        per-page ``jax.device_get`` loop.
      store_lookup_speedup: a prefix lookup from each Redis store measured (32 pages
        of the reference page size, ``BenchConfig.lookup_reference_bytes``) with one
        ``get_many`` is this many times as fast as with one ``get`` per page (p50 over
        p50; not checked below 32 pages, as ``--smoke`` measures).

    Example:
        >>> Targets().host_overhead_ms, Targets(host_overhead_ms=0.5).host_overhead_ms
        (1.0, 0.5)
    """

    cpu_fraction: float = 0.5
    cache_size_ratio: float = 2.0
    integrity_ratio_cpu: float = 0.6
    integrity_ratio_gpu: float = 0.95
    host_overhead_ms: float = 1.0
    pool_tolerance: float = 0.01
    gpu_fraction_64mib: float = 0.9
    gpu_fraction_8mib: float = 0.7
    gpu_fraction_one_page: float = 0.4
    gpu_fraction_16kib_blocks: float = 0.5
    gpu_over_plain_jax: float = 1.2
    gpu_over_device_get: float = 100.0
    call_idle_ms_cpu: float = 3.0
    call_queued_fraction: float = 0.1
    hit_ms_cpu: float = 1.0
    hit_ms_gpu: float = 1.0
    warmup_s_cpu: float = 10.0
    warmup_cached_s: float = 3.0
    store_lookup_speedup: float = 3.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                    not math.isfinite(v) or v < 0:
                raise ValueError(f"Expected a finite number >= 0 for {f.name}. Got {v!r} of "
                                 f"type {type(v).__name__}")


def _target(name: str, value: float, op: str, threshold: float, where: str
            ) -> dict[str, Any]:
    ok = {">=": value >= threshold, "<=": value <= threshold,
          "within": abs(value - 1) <= threshold}[op]
    return {"name": name, "value": float(value), "op": op, "threshold": float(threshold),
            "status": "PASS" if ok else "MISS", "where": where}


def _cell(row: dict[str, Any]) -> str:
    return f"{format_bytes(row['block_bytes'])} {row['dtype']}"


#: The pinned mover's figures in a row: (name, method when auto is another mover,
#: method when auto is the pinned mover itself).
_PINNED = (("offload off", "offload_pinned_off", "offload_off"),
           ("offload page", "offload_pinned_page", "offload_page"),
           ("load off", "load_pinned_off_all", "load_off_all"),
           ("load page", "load_pinned_page_all", "load_page_all"))


def pinned_figures(row: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The pinned mover's offload and load stats in a throughput or sweep row.

    From its own variants where ``path="auto"`` took another mover, from auto's
    where auto is the pinned mover; None where neither was measured.

    Example:
        >>> row = {"paths": ["pinned"], "pinned_methods": False,
        ...        "methods": {m: {"gbps": 1.0} for _, _, m in _PINNED}}
        >>> sorted(pinned_figures(row))
        ['load off', 'load page', 'offload off', 'offload page']
    """
    if row.get("pinned_methods"):
        return {name: row["methods"][own] for name, own, _ in _PINNED}
    if row.get("paths") == ["pinned"]:
        return {name: row["methods"][auto] for name, _, auto in _PINNED}
    return None


def evaluate_targets(report: dict[str, Any], targets: Targets = Targets()
                     ) -> list[dict[str, Any]]:
    """The target lines of a report (PASS or MISS each), for its platform.

    Args:
      report: a report with its measured sections (``targets`` may be absent).
      targets: the thresholds (a test forces a miss with, say,
        ``Targets(host_overhead_ms=0)``).

    Returns:
      One dict per target: ``name``, ``value``, ``op``, ``threshold``, ``status``,
      ``where`` (the case the value was read from).
    """
    out: list[dict[str, Any]] = []
    if "throughput" in report:
        out += _transfer_targets(report, targets)
    if "fit" in report:
        out += _fit_targets(report, targets)
    for r in report.get("store_lookup", ()):
        # Fewer pages (--smoke) have less to batch: not a target.
        if r["reference"] and r["pages"] >= 32:
            out.append(_target(
                f"{r['store']}: {r['pages']}-page prefix lookup, one get_many >= "
                f"{targets.store_lookup_speedup:g}x as fast as one get per page",
                r["speedup"], ">=", targets.store_lookup_speedup,
                f"p50 over p50, {format_bytes(r['blob_bytes'])} pages, {r['spec']}"))
    return out


def _fit_targets(report: dict[str, Any], targets: Targets) -> list[dict[str, Any]]:
    fit, cpu = report["fit"], report["meta"]["platform"] == "cpu"
    out = []
    calls = {r["path"]: r for r in fit["calls"]}
    r0 = fit["calls"][0]
    shape = f"{r0['pages']} pages x {r0['layers']} layers"
    ops = ("offload", "load", "load_layer")
    if cpu:
        v, where = max((calls[p][f"idle_{op}"]["p50_s"] * 1e3, f"path={p}, {op}")
                       for p in ("pinned", "staged") if p in calls for op in ops)
        out.append(_target(f"cpu: host time of a call, {shape}, device idle (path=pinned, "
                           f"path=staged) <= {targets.call_idle_ms_cpu:g} ms", v, "<=",
                           targets.call_idle_ms_cpu, f"p50, worst: {where}"))
    v, where = max((r[f"queued_{op}"]["fraction"], f"path={r['path']}, {op}")
                   for r in fit["calls"] for op in ops)
    out.append(_target(f"call behind {r0['steps']} queued steps <= "
                       f"{targets.call_queued_fraction:g} of their time (every path)", v,
                       "<=", targets.call_queued_fraction, f"p50, worst: {where}"))
    hit = next((h for h in fit["hits"] if h["path"] == "auto"), fit["hits"][0])
    if cpu:
        out.append(_target(f"cpu: 1-page x {r0['layers']} layers hit, call to last layer "
                           f"verified <= {targets.hit_ms_cpu:g} ms", hit["hit"]["p50_s"] * 1e3,
                           "<=", targets.hit_ms_cpu, f"p50, path={hit['path']}"))
    elif report["meta"]["platform"] == "gpu":
        out.append(_target(f"gpu: 1-page x {r0['layers']} layers hit, call to last layer "
                           f"verified <= {targets.hit_ms_gpu:g} ms", hit["hit"]["p50_s"] * 1e3,
                           "<=", targets.hit_ms_gpu, f"p50, path={hit['path']}"))
    if cpu:
        v, where = max((w["cold"], f"path={w['path']}") for w in fit["warmups"])
        out.append(_target(f"cpu: warmup({fit['warmups'][0]['pages']}) of "
                           f"{r0['layers']} layers in a fresh process <= "
                           f"{targets.warmup_s_cpu:g} s (every path)", v, "<=",
                           targets.warmup_s_cpu, f"worst: {where}"))
    v, where = max((w["persistent_cache"], f"path={w['path']}") for w in fit["warmups"])
    out.append(_target(f"warmup({fit['warmups'][0]['pages']}) over a persistent compilation "
                       f"cache, second process <= {targets.warmup_cached_s:g} s", v, "<=",
                       targets.warmup_cached_s, f"worst: {where}"))
    return out


def _transfer_targets(report: dict[str, Any], targets: Targets) -> list[dict[str, Any]]:
    cfg = report["meta"]["config"]
    gpu = report["meta"]["platform"] == "gpu"
    cells = report["throughput"]
    out = []
    if not gpu:
        batch = format_bytes(cfg["batch_bytes"])
        for op, m in (("offload", "offload_page"), ("load", "load_page_all"),
                      ("offload", "offload_off"), ("load", "load_off_all")):
            v, row = min(((r["methods"][m]["fraction_of_limit"], r) for r in cells),
                         key=lambda x: x[0])
            out.append(_target(f"cpu: {op} of {batch} per call (integrity={m.split('_')[1]}) "
                               f">= {targets.cpu_fraction:g}x memcpy", v, ">=",
                               targets.cpu_fraction, f"worst cell: {_cell(row)}"))
    pinned = [(r, pinned_figures(r)) for r in cells]
    pinned = [(r, f) for r, f in pinned if f is not None]
    if not gpu and pinned:
        batch = format_bytes(cfg["batch_bytes"])
        for name in ("offload page", "load page", "offload off", "load off"):
            v, row = min(((f[name]["fraction_of_limit"], r) for r, f in pinned),
                         key=lambda x: x[0])
            op, integ = name.split()
            out.append(_target(f"cpu: pinned mover {op} of {batch} per call "
                               f"(integrity={integ}) >= {targets.cpu_fraction:g}x memcpy", v,
                               ">=", targets.cpu_fraction, f"worst cell: {_cell(row)}"))
    cs = report["cache_size"]
    out.append(_target(
        f"load {cs['pages']} pages into {format_bytes(cs['large_cache_bytes'])} vs "
        f"{format_bytes(cs['small_cache_bytes'])} cache <= {targets.cache_size_ratio:g}x time",
        cs["variants"]["page_auto"]["ratio"], "<=", targets.cache_size_ratio,
        "integrity=page, gate=all"))
    floor = targets.integrity_ratio_gpu if gpu else targets.integrity_ratio_cpu
    block_ref = cfg["reference"][0]
    ref_cells = [r for r in cells if r["block_bytes"] == block_ref]
    for op, on, off in (("offload", "offload_page", "offload_off"),
                        ("load", "load_page_all", "load_off_all")):
        v, row = min(((r["methods"][on]["gbps"] / r["methods"][off]["gbps"], r)
                      for r in ref_cells), key=lambda x: x[0])
        out.append(_target(f"{'gpu' if gpu else 'cpu'}: {op} integrity=page >= {floor:g}x "
                           f"integrity=off at {format_bytes(block_ref)} blocks", v, ">=",
                           floor, f"worst dtype: {row['dtype']}"))
    for row in report["overhead"]:
        label = f"integrity={row['integrity']}" + \
            (f", gate={row['gate']}" if row["gate"] != "-" else "")
        out.append(_target(f"host overhead per {row['op']}() call, {row['pages']} pages x "
                           f"{row['layers']} layers ({label}) <= "
                           f"{targets.host_overhead_ms:g} ms",
                           row["call"]["p50_s"] * 1e3, "<=", targets.host_overhead_ms,
                           "p50 of the call"))
    out.append(_target(f"host pool bytes within {targets.pool_tolerance:.0%} of the plan",
                       report["memory"]["pool_over_plan"], "within", targets.pool_tolerance,
                       "pool/plan"))
    if gpu:
        for op, m in (("offload", "offload_page"), ("load", "load_page_all")):
            big = [r["methods"][m]["fraction_of_limit"] for r in report["sweep"]
                   if r["bytes"] >= 64 * MiB]
            mid = [r["methods"][m]["fraction_of_limit"] for r in report["sweep"]
                   if 8 * MiB <= r["bytes"] < 64 * MiB]
            if big:
                out.append(_target(f"gpu: {op} >= {targets.gpu_fraction_64mib:g}x pinned copy "
                                   "at >= 64 MiB per call", min(big), ">=",
                                   targets.gpu_fraction_64mib, "worst size >= 64 MiB"))
            if mid:
                out.append(_target(f"gpu: {op} >= {targets.gpu_fraction_8mib:g}x pinned copy "
                                   "at 8 MiB per call", min(mid), ">=",
                                   targets.gpu_fraction_8mib, "worst size in [8, 64) MiB"))
            one = [r["methods"][m]["fraction_of_limit"] for r in report["sweep"]
                   if r["pages"] == 1]
            if one:
                out.append(_target(f"gpu: {op} of one page >= "
                                   f"{targets.gpu_fraction_one_page:g}x pinned copy", min(one),
                                   ">=", targets.gpu_fraction_one_page,
                                   f"{format_bytes(report['sweep'][0]['bytes'])} per call"))
            small = [r["methods"][m]["fraction_of_limit"] for r in cells
                     if r["block_bytes"] == 16 * KiB and r["bytes"] >= 64 * MiB]
            if small:
                out.append(_target(f"gpu: {op} of 16 KiB blocks >= "
                                   f"{targets.gpu_fraction_16kib_blocks:g}x pinned copy at >= "
                                   "64 MiB per call", min(small), ">=",
                                   targets.gpu_fraction_16kib_blocks, "worst 16 KiB cell"))
        out += _over_plain_jax(report, targets)
        ref = next(r for r in cells if [r["block_bytes"], r["dtype"]] ==
                   list(cfg["reference"]))
        v = ref["methods"]["offload_page"]["gbps"] / ref["methods"]["user_device_get"]["gbps"]
        out.append(_target(f"gpu: offload >= {targets.gpu_over_device_get:g}x the per-page "
                           "device_get loop", v, ">=", targets.gpu_over_device_get,
                           f"{format_bytes(ref['bytes'])} per call"))
    return out


def _over_plain_jax(report: dict[str, Any], targets: Targets) -> list[dict[str, Any]]:
    """kvxfer (integrity=page) over the best plain-JAX route, every case from 8 MiB."""
    out = []
    rows = [r for r in report["throughput"] + report["sweep"] if r["bytes"] >= 8 * MiB
            and "jax_gather_pinned" in r["methods"]]
    for op, ours, theirs in (("offload", "offload_page", "jax_gather_pinned"),
                             ("load", "load_page_all", "jax_put_scatter")):
        if not rows:
            continue
        v, row = min(((r["methods"][ours]["gbps"] / r["methods"][theirs]["gbps"], r)
                      for r in rows), key=lambda x: x[0])
        out.append(_target(f"gpu: {op} >= {targets.gpu_over_plain_jax:g}x the plain-JAX "
                           "route (digest on device) from 8 MiB per call", v, ">=",
                           targets.gpu_over_plain_jax,
                           f"worst case: {format_bytes(row['bytes'])} of "
                           f"{format_bytes(row['block_bytes'])} blocks"))
    return out


def missed(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of ``report`` that missed (``status == "MISS"``)."""
    return [t for t in report["targets"] if t["status"] == "MISS"]


def iter_figures(obj: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a report with its path (booleans are flags, not figures).

    Example:
        >>> list(iter_figures({"a": [1, {"b": 2.5}], "ok": True, "name": "x"}))
        [('a[0]', 1), ('a[1].b', 2.5)]
    """
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_figures(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from iter_figures(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------


def _gb(s: dict[str, Any] | None) -> str:
    return "-" if s is None else f"{s['gbps']:.2f} ({s['fraction_of_limit']:.2f}x)"


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f}" if x < 0.01 else f"{x * 1e3:.1f}"


def _p50_p99(s: dict[str, Any]) -> str:
    return f"{_ms(s['p50_s'])}/{_ms(s['p99_s'])}"


_CACHE_SIZE_LABELS = {"off_auto": "kvxfer integrity=off, path=auto",
                      "page_auto": "kvxfer integrity=page, path=auto",
                      "page_staged": "kvxfer integrity=page, path=staged",
                      "user_scatter": "user device_put + donated scatter"}


def format_report(report: dict[str, Any]) -> str:
    """The human-readable report: tables, then the PASS/MISS target lines (a report of
    the store section alone has its table only).

    A *block* is one layer's block; a *page* is one block index across every
    layer (what one host slot holds). ``integrity`` and ``gate`` name
    ``KVCacheManager``'s options.
    """
    meta = report["meta"]
    preset = f", {meta['preset']}" if meta.get("preset") not in (None, "full") else ""
    only = f", --only {meta['only']}" if meta.get("only") else ""
    lines = [f"kvxfer bench — {meta['date']}, {meta['platform']} ({meta['device']}), "
             f"jax {meta['jax_version']}, {meta['cpu_count']} CPUs{preset}{only}"]
    if "throughput" in report:
        lines += [f"source: {meta['source']}; limit: {meta['limit_method']}",
                  "GB/s = 1e9 bytes/s from the best repeat; (x) = fraction of the limit "
                  "measured in the same case; times in ms.",
                  "A block is one layer's block; a page is one block index across every "
                  "layer. kvxfer columns name KVCacheManager's options integrity=off|page "
                  "and gate=all|layer; page/off is integrity=page over integrity=off "
                  "throughput.", ""]
        lines += _transfer_lines(report)
        for note in report["not_measured"]:
            lines.append(f"  not measured: {note}")
    else:
        lines.append(f"source: {meta['source']}")
    if "fit" in report:
        lines += _fit_lines(report["fit"])
    if "models" in report:
        lines += _model_lines(report["models"])
    if "store" in report:
        lines += _store_lines(report["store"])
    if report.get("store_lookup"):
        lines += _lookup_lines(report["store_lookup"])
    if "policy" in report:
        lines += policy_lines(report["policy"])

    lines += ["", "Targets"]
    for t in report["targets"]:
        lines.append(f"{t['status']}  {t['name']}: {t['value']:.3g} ({t['where']})")
    misses = missed(report)
    lines.append(f"{len(report['targets']) - len(misses)} of {len(report['targets'])} "
                 "targets met")
    lines.append(f"\n(wall time {meta['wall_s']:.0f} s)")
    return "\n".join(lines)


def _transfer_lines(report: dict[str, Any]) -> list[str]:
    """The tables of the transfer sections (every section but the store's)."""
    meta = report["meta"]
    cfg = meta["config"]
    gpu = meta["platform"] == "gpu"
    d2h, h2d = ("pinned d2h", "pinned h2d") if gpu else ("memcpy", "memcpy")
    lines: list[str] = []
    lines.append(f"Offload throughput, {format_bytes(cfg['batch_bytes'])} per call, "
                 f"{cfg['layers']} layers")
    rows = []
    for r in report["throughput"]:
        m = r["methods"]
        rows.append([format_bytes(r["block_bytes"]), r["dtype"], r["pages"],
                     f"{r['limit']['d2h']['gbps']:.2f}", _gb(m["user_device_get"]),
                     _gb(m["user_gather_pinned"]), _gb(m.get("user_batched_gather_pinned")),
                     _gb(m.get("jax_gather_pinned")), _gb(m["offload_off"]),
                     _gb(m["offload_page"]),
                     f"{m['offload_page']['gbps'] / m['offload_off']['gbps']:.2f}",
                     f"{m['offload_page']['first_call_s']:.2f}"])
    lines.append(table(rows, ["block", "dtype", "pages", d2h, "user device_get/page",
                              "user gather->pinned/page", "user gather->pinned batched",
                              "plain JAX (digest)", "kvxfer integrity=off",
                              "kvxfer integrity=page",
                              "page/off", "1st call s (integrity=page)"]))

    lines += ["", f"Load throughput, {format_bytes(cfg['batch_bytes'])} per call"]
    rows = []
    for r in report["throughput"]:
        m = r["methods"]
        rows.append([format_bytes(r["block_bytes"]), r["dtype"],
                     f"{r['limit']['h2d']['gbps']:.2f}", _gb(m["user_put_scatter"]),
                     _gb(m.get("user_batched_put_scatter")), _gb(m.get("jax_put_scatter")),
                     _gb(m["load_off_all"]),
                     _gb(m["load_off_layer"]), _gb(m["load_page_all"]),
                     _gb(m["load_page_layer"]),
                     f"{m['load_page_all']['gbps'] / m['load_off_all']['gbps']:.2f}",
                     f"{m['load_page_all']['first_call_s']:.2f}", ",".join(r["paths"])])
    lines.append(table(rows, ["block", "dtype", h2d, "user put+scatter/page",
                              "user put+scatter batched", "plain JAX (digest)",
                              "kvxfer off/all", "off/layer",
                              "page/all", "page/layer", "page/off", "1st call s (integrity=page)",
                              "mover"]))

    lines += _pinned_lines(report, d2h, h2d)

    lines += ["", f"Prefix sweep ({format_bytes(cfg['prefix_block_bytes'])} bfloat16 blocks, "
              f"{cfg['layers']} layers): throughput, and hit latency (load call -> layer "
              "ready) p50/p99 ms"]
    rows = []
    for r in report["sweep"]:
        m = r["methods"]
        lp, la = m["load_page_layer"], m["load_page_all"]
        rows.append([r["pages"], format_bytes(r["bytes"]), f"{r['limit']['d2h']['gbps']:.2f}",
                     _gb(m["user_device_get"]), _gb(m["user_put_scatter"]),
                     _gb(m.get("jax_gather_pinned")), _gb(m.get("jax_put_scatter")),
                     _gb(m["offload_off"]), _gb(m["offload_page"]), _gb(m["load_off_all"]),
                     _gb(la), _p50_p99(lp["first_layer"]), _p50_p99(lp["last_layer"]),
                     _p50_p99(la["last_layer"]),
                     _ms(m["load_off_layer"]["first_layer"]["p50_s"])])
    lines.append(table(rows, ["pages", "bytes", "limit", "user device_get/page",
                              "user put+scatter/page", "plain JAX offload", "plain JAX load",
                              "offload off", "offload page",
                              "load off", "load page", "first layer (page,layer)",
                              "last layer (page,layer)", "last layer (page,all)",
                              "first layer (off,layer) p50"]))

    if report.get("copy_sizes"):
        lines += ["", "Copy sizes: path=dma, one layer, one copy per block in a random order "
                  "(integrity off)"]
        rows = [[format_bytes(r["copy_bytes"]), r["copies"], format_bytes(r["bytes"]),
                 f"{r['limit']['d2h']['gbps']:.2f}", _gb(r["methods"]["offload"]),
                 f"{r['limit']['h2d']['gbps']:.2f}", _gb(r["methods"]["load"])]
                for r in report["copy_sizes"]]
        lines.append(table(rows, ["per copy", "copies", "per call", d2h, "offload", h2d,
                                  "load"]))

    lines += ["", "Concurrency (requests in flight before waiting; gate=all)"]
    rows = [[r["op"], r["integrity"], r["in_flight"], format_bytes(r["request_bytes"]),
             f"{r['aggregate']['gbps']:.2f}", _ms(r["issue_p50_s"]),
             _p50_p99(r["request_latency"])] for r in report["concurrency"]]
    lines.append(table(rows, ["op", "integrity", "in flight", "request", "aggregate GB/s",
                              "issue all p50", "request latency p50/p99"]))

    lines += ["", "Host overhead: time inside the offload()/load() call (ms)"]
    rows = [[r["op"], r["integrity"], r["gate"], f"{r['pages']} x {r['layers']}",
             _ms(r["call"]["best_s"]), _ms(r["call"]["p50_s"]), _ms(r["call"]["p99_s"]),
             _ms(r["total"]["p50_s"])] for r in report["overhead"]]
    lines.append(table(rows, ["op", "integrity", "gate", "pages x layers", "call best",
                              "call p50", "call p99", "call+wait p50"]))

    lines += ["", "Integrity traffic per call (derived from the digest programs' shapes)"]
    rows = [[r["pages"], format_bytes(r["payload_bytes"]),
             format_bytes(r["device_read_bytes_offload"]),
             format_bytes(r["device_read_bytes_load"]), format_bytes(r["host_digest_bytes"]),
             format_bytes(r["identity_bytes"]), f"{r['extra_over_payload']:.3f}"]
            for r in report["integrity_traffic"]]
    lines.append(table(rows, ["pages", "payload", "extra device read (offload)",
                              "extra device read (load)", "host digests", "identities",
                              "extra/payload per direction"]))

    cs = report["cache_size"]
    lines += ["", f"Load {cs['pages']} pages ({format_bytes(cs['bytes'])}) into a "
              f"{format_bytes(cs['large_cache_bytes'])} vs a "
              f"{format_bytes(cs['small_cache_bytes'])} cache (ms; gate=all)"]
    rows = [[_CACHE_SIZE_LABELS.get(name, name),
             f"{_ms(v['small']['best_s'])}/{_ms(v['small']['p50_s'])}",
             f"{_ms(v['large']['best_s'])}/{_ms(v['large']['p50_s'])}", f"{v['ratio']:.2f}"]
            for name, v in cs["variants"].items()]
    lines.append(table(rows, ["variant", "small best/p50", "large best/p50",
                              "large/small (best)"]))
    lines += _first_call_lines(report["first_call"]) + _queued_lines(report["queued"])

    mem = report["memory"]
    lines += ["", "Memory",
              f"  host pool {format_bytes(mem['pool_bytes'])} ({mem['pool_bytes']} B) vs plan "
              f"{format_bytes(mem['plan_bytes'])} ({mem['plan_bytes']} B): "
              f"{mem['pool_over_plan']:.4f}x"]
    if "host_transient_bytes" in mem:
        lines.append(f"  host RSS beyond caches and pools during one offload + load of "
                     f"{format_bytes(mem['payload_bytes'])}: "
                     f"{format_bytes(mem['host_transient_bytes'])}")
    if "device_persistent_bytes" in mem:
        lines.append(f"  device memory beyond caches: "
                     f"{format_bytes(mem['device_persistent_bytes'])} held, peak "
                     f"{format_bytes(mem.get('device_transient_bytes'))}")
    return lines


def _mb(s: dict[str, Any] | None, limit: bool = False) -> str:
    if s is None:
        return "-"
    mb = f"{s['gbps'] * 1e3:.0f}"
    return mb if limit else f"{mb} ({s['fraction_of_limit']:.2f}x)"


def _model_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The models section's table: a config's own caches, GB/s and host time per page."""
    lines = ["", "Model configs' own caches (--model): whole pages per call, GB/s from the "
             "best repeat, (x) = fraction of the limit in the same run; us/page = the best "
             "call's host time (call) and whole time (total) per page, integrity off/page"]
    rows_out = []
    for r in rows:
        m = r["methods"]
        shapes = ", ".join(f"{g['dtype']}{g['block_shape']}" for g in r["groups"])
        rows_out.append([
            r["config"], shapes, r["tokens_per_page"] or "-", r["layers"],
            format_bytes(r["page_bytes"]), r["pages"], "+".join(r["paths"]),
            f"{r['limit']['d2h']['gbps']:.2f}", _gb(m["offload_off"]), _gb(m["offload_page"]),
            _gb(m["load_off_all"]), _gb(m["load_page_all"]),
            "/".join(f"{m[k]['call_us_per_page']:.1f}" for k in ("offload_off", "offload_page")),
            "/".join(f"{m[k]['us_per_page']:.1f}" for k in ("offload_off", "offload_page")),
            "/".join(f"{m[k]['call_us_per_page']:.1f}" for k in ("load_off_all",
                                                                  "load_page_all")),
            "/".join(f"{m[k]['us_per_page']:.1f}" for k in ("load_off_all", "load_page_all"))])
    lines.append(table(rows_out, [
        "config", "block (one layer)", "tokens/page", "layers", "page", "pages/call",
        "mover", "limit", "offload off", "offload page", "load off", "load page",
        "offload call us/page", "offload total us/page", "load call us/page",
        "load total us/page"]))
    return lines


def _store_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The store section's table: MB/s of each store and of its limit, per blob size."""
    kinds = {r["store"] for r in rows}
    lines = ["", "Store tiers: page blobs written and read one by one, MB/s = 1e6 bytes/s "
             "from the best repeat; (x) = fraction of the limit in the same run"]
    if "disk" in kinds:
        lines += ["  disk limit: one file on the same file system, blob-sized writes each "
                  "followed by fsync, then blob-sized reads (cold: after posix_fadvise "
                  "DONTNEED, both sides)",
                  "  put durable=False: a DiskStore that does not fsync the directory after "
                  "each put (against the same write limit)"]
    if "redis" in kinds:
        lines.append("  redis limit: redis-py SET / GET of the same bytes on the same server")
    if "redis-cluster" in kinds:
        lines.append("  redis-cluster limit: redis-py's cluster client SET / GET of the same "
                     "bytes on the same cluster")
    table_rows = []
    for r in rows:
        where = r["spec"] if r["store"] != "disk" else \
            f"{r['spec']} ({r.get('filesystem') or 'file system ?'})"
        lim, m = r["limit"], r["methods"]
        table_rows.append([r["store"], where, format_bytes(r["blob_bytes"]), r["blobs"],
                           _mb(lim["write"], True), _mb(m["write"]),
                           _mb(m.get("write_not_durable")),
                           _mb(lim["read"], True), _mb(m["read"]),
                           _mb(lim.get("read_cold"), True), _mb(m.get("read_cold"))])
    lines.append(table(table_rows, ["store", "where", "blob", "blobs", "limit write",
                                    "store put", "put durable=False", "limit read",
                                    "store get", "limit read cold", "store get cold"]))
    sealing = {r["blob_bytes"]: r["sealing"] for r in rows if r.get("sealing")}
    if sealing:
        lines += ["", "Sealed store blobs (HostCache auth_key=, encrypt=): seal and open of "
                  "one blob, MB/s, (x) = fraction of a copy of the same bytes in the same run"]
        seal_rows = []
        for size, s in sorted(sealing.items()):
            cells = [format_bytes(size), _mb(s["memcpy"], True)]
            for mode in ("auth", "encrypt"):
                m = s.get(mode)
                cells += [_mb(m and m["seal"]), _mb(m and m["open"])]
            seal_rows.append(cells)
        lines.append(table(seal_rows, ["blob", "copy", "auth seal", "auth open",
                                       "encrypt seal", "encrypt open"]))
    return lines


def _lookup_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The prefix-lookup table: one get per page against one get_many, per Redis store."""
    lines = ["", "Prefix lookup from a Redis store: every page of the prefix read with one "
             "get per page (a round trip each) and with one get_many; ms per lookup "
             "(p50/p99 over the repeats), (x) = fraction of the limit's MB/s in the same run",
             "  limits: redis-py GET per key, and redis-py's pipelined GETs, of the same "
             "bytes on the same server or cluster; speed-up = per-page p50 / batched p50 "
             "(best / best); * the reference page size, where the target is checked"]
    table_rows = []
    for r in rows:
        m, lim = r["methods"], r["limit"]
        page = format_bytes(r["blob_bytes"]) + (" *" if r["reference"] else "")
        table_rows.append([r["store"], r["spec"], r["pages"], page,
                           _p50_p99(lim["per_page"]),
                           f"{_p50_p99(m['per_page'])} ({m['per_page']['fraction_of_limit']:.2f}x)",
                           _p50_p99(lim["batched"]),
                           f"{_p50_p99(m['batched'])} ({m['batched']['fraction_of_limit']:.2f}x)",
                           f"{r['speedup']:.1f}x ({r['speedup_best']:.1f}x)"])
    lines.append(table(table_rows, ["store", "where", "pages", "page", "limit GET each",
                                    "get each", "limit pipelined", "get_many", "speed-up"]))
    cached = [r for r in rows if "cache" in r]
    if cached:
        lines += ["", "The same prefix through HostCache.lookup: the pages read, opened and "
                  "imported into host memory, over the per-page path (one get per page) and "
                  "with the cache's one get_many; ms per lookup (p50/p99), store calls per "
                  "lookup; speed-up = per-page p50 / batched p50 (best / best)"]
        cache_rows = []
        for r in cached:
            c = r["cache"]
            cells = [r["store"], r["spec"], r["pages"], format_bytes(c["blob_bytes"])]
            for m in ("per_page", "batched"):
                calls = ", ".join(f"{n:g} {name}" for name, n in c["methods"][m]["calls"].items())
                cells += [_p50_p99(c["methods"][m]), calls]
            cells.append(f"{c['speedup']:.1f}x ({c['speedup_best']:.1f}x)")
            cache_rows.append(cells)
        lines.append(table(cache_rows, ["store", "where", "pages", "page blob",
                                        "lookup per page", "its calls", "lookup batched",
                                        "its calls", "speed-up"]))
    return lines


def _pinned_lines(report: dict[str, Any], d2h: str, h2d: str) -> list[str]:
    """The pinned mover's throughput over the cells and the prefix sweep."""
    rows = []
    for section, label in (("throughput", "cell"), ("sweep", "sweep")):
        for r in report[section]:
            f = pinned_figures(r)
            if f is None:
                continue
            rows.append([label, format_bytes(r["block_bytes"]), r["dtype"], r["pages"],
                         format_bytes(r["bytes"]), f"{r['limit']['d2h']['gbps']:.2f}",
                         _gb(f["offload off"]), _gb(f["offload page"]),
                         f"{r['limit']['h2d']['gbps']:.2f}", _gb(f["load off"]),
                         _gb(f["load page"]),
                         "auto" if not r.get("pinned_methods") else "pinned"])
    if not rows:
        return ["", "Pinned mover: not measured (no pinned_host memory on this backend)"]
    route = ("pages gathered on the device, kept as pinned_host arrays; device_put and "
             "scatter back" if report["meta"]["platform"] != "cpu" else
             "compiled writes into / reads from a pinned host pool, in place")
    lines = ["", f"Pinned mover ({route}; gate=all): GB/s (x limit)"]
    lines.append(table(rows, ["case", "block", "dtype", "pages", "bytes", d2h,
                              "offload off", "offload page", h2d, "load off", "load page",
                              "path"]))
    return lines


def _call_case(row: dict[str, Any]) -> list[Any]:
    """``path=auto -> raw``, dtype, pages x layers, bytes: what a caller-thread row moved."""
    return [f"path={row['path']} -> {','.join(row['movers'])}", row["dtype"],
            f"{row['pages']} x {row['layers']}", format_bytes(row["bytes"])]


def _first_call_lines(rows: list[dict[str, Any]]) -> list[str]:
    r0 = rows[0]
    lines = ["", f"First call of a size on a fresh manager, without and after "
             f"warmup({r0['pages']}) ({format_bytes(r0['block_bytes'])} blocks, "
             f"integrity={r0['integrity']}; ms, one sample each; 2nd = the next call)"]
    table_rows = []
    for r in rows:
        cold, warm, again = r["without_warmup"], r["with_warmup"], r["second_call"]
        table_rows.append(_call_case(r) + [
            f"{r['warmup_s']:.2f} ({len(r['warmup_buckets'])})",
            *(f"{_ms(cold[op]['s'])} / {_ms(warm[op]['s'])} / {_ms(again[op]['s'])}"
              for op in ("offload", "load")),
            f"{_ms(cold['offload']['call_s'])} / {_ms(warm['offload']['call_s'])}",
            f"{_ms(cold['load']['call_s'])} / {_ms(warm['load']['call_s'])}"])
    lines.append(table(table_rows, [
        "path -> mover", "dtype", "pages x layers", "bytes", "warm-up s (buckets)",
        "offload+wait cold/warm/2nd", "load+result cold/warm/2nd",
        "offload() call cold/warm", "load() call cold/warm"]))
    return lines


def _done(x: float) -> str:
    return f"{x:.0%}"


def _fit_lines(fit: dict[str, Any]) -> list[str]:
    r0 = fit["calls"][0]
    lines = ["", f"Engine fit: host time of a call, {r0['pages']} pages x {r0['layers']} "
             f"layers of {format_bytes(r0['block_bytes'])} bfloat16 blocks (p50 ms; queued: "
             f"behind {r0['steps']} donating steps, as a fraction of their time; prefetched: "
             "load(..., prefetched=) once prefetch() put the pages on the device)"]
    rows = []
    for r in fit["calls"]:
        rows.append([f"path={r['path']} -> {','.join(r['movers'])}",
                     _ms(r["steps_alone"]["p50_s"])] +
                    [_ms(r[f"idle_{op}"]["p50_s"]) for op in ("offload", "load", "load_layer")]
                    + [_ms(r["prefetched_load"]["p50_s"])] +
                    [f"{_ms(r[f'queued_{op}']['p50_s'])} ({r[f'queued_{op}']['fraction']:.1%})"
                     for op in ("offload", "load", "load_layer")])
    lines.append(table(rows, ["path -> mover", "steps alone", "idle offload()",
                              "idle load(all)", "idle load(layer)", "prefetched load(all)",
                              "queued offload()", "queued load(all)", "queued load(layer)"]))
    lines += ["", f"1-page x {r0['layers']} layers hit (load call to last layer verified, "
              "gate=layer) and warmup in a fresh process (s; cold, then over the persistent "
              "compilation cache the cold run filled)"]
    warm = {w["path"]: w for w in fit["warmups"]}
    rows = [[f"path={h['path']} -> {','.join(h['movers'])}",
             f"{_ms(h['hit']['p50_s'])}/{_ms(h['hit']['best_s'])}",
             f"{warm[h['path']]['cold']:.2f}" if h["path"] in warm else "-",
             f"{warm[h['path']]['persistent_cache']:.2f}" if h["path"] in warm else "-"]
            for h in fit["hits"]]
    lines.append(table(rows, ["path -> mover", "1-page hit p50/best ms",
                              f"warmup({fit['warmups'][0]['pages']}) cold s",
                              "warmup, persistent cache s"]))
    return lines


def _queued_lines(rows: list[dict[str, Any]]) -> list[str]:
    r0 = rows[0]
    lines = ["", f"Caller's thread behind {r0['steps']} queued steps (donating jitted "
             "arithmetic over every layer, dispatched and not waited for, then the call; "
             f"warmed-up manager, integrity={r0['integrity']}; p50 ms over {r0['repeats']} "
             "repeats; done = calls that returned after the steps were done)"]
    table_rows = []
    for r in rows:
        off, load = r["offload"], r["load"]
        table_rows.append(_call_case(r) + [
            _ms(r["steps_alone"]["total"]["p50_s"]), _ms(r["steps_alone"]["dispatch"]["p50_s"]),
            _ms(off["call"]["p50_s"]), _ms(off["wait"]["p50_s"]),
            _done(off["steps_done_at_return"]), _ms(load["call"]["p50_s"]),
            _ms(load["result"]["p50_s"]), _done(load["steps_done_at_return"])])
    lines.append(table(table_rows, [
        "path -> mover", "dtype", "pages x layers", "bytes",
        f"{r0['steps']} steps alone", "their dispatch", "offload() call", "wait()", "done",
        "load() call", "result()", "done"]))
    if "idle_offload" not in r0:
        return lines
    from kvxfer.bench._caller import CALL_IDLE_MS_CPU, CALL_QUEUED_FRACTION
    lines += ["", f"Host time of one call (p50 ms), device idle and behind {r0['steps']} "
              f"queued steps (as a fraction of their time); targets: idle at most "
              f"{CALL_IDLE_MS_CPU:g} ms on CPU (path=pinned, path=staged), queued at most "
              f"{CALL_QUEUED_FRACTION:.0%} (every path)"]
    table_rows = []
    ops = ("offload", "load", "load_layer")
    for r in rows:
        table_rows.append(_call_case(r) + [_ms(r[f"idle_{op}"]["call"]["p50_s"]) for op in ops]
                          + [f"{_ms(r[op]['call']['p50_s'])} ({r[op]['call_fraction']:.1%})"
                             for op in ops])
    lines.append(table(table_rows, [
        "path -> mover", "dtype", "pages x layers", "bytes", "idle offload()",
        "idle load(all)", "idle load(layer)", "queued offload()", "queued load(all)",
        "queued load(layer)"]))
    return lines


# ---------------------------------------------------------------------------
# The plot
# ---------------------------------------------------------------------------


class Variant(NamedTuple):
    """One line of the plot, drawn alike (colour and style) in every panel it is in."""

    name: str
    colour: str
    linestyle: str
    #: Direction (``"d2h"``, ``"h2d"``) -> (method in a report row's ``methods``, or
    #: ``"limit"``; its legend label).
    methods: dict[str, tuple[str, str]]


#: The plot's variants; colours from the Okabe-Ito palette (readable in colour blindness).
VARIANTS: tuple[Variant, ...] = (
    Variant("limit", "#000000", "-", {"d2h": ("limit", "limit"), "h2d": ("limit", "limit")}),
    Variant("user, per page", "#E69F00", ":", {
        "d2h": ("user_device_get", "user device_get / page"),
        "h2d": ("user_put_scatter", "user device_put + donated scatter / page")}),
    Variant("user, per page, jitted gather", "#CC79A7", "-.", {
        "d2h": ("user_gather_pinned", "user jitted gather -> pinned_host / page")}),
    Variant("user, batched", "#D55E00", "--", {
        "d2h": ("user_batched_gather_pinned", "user jitted gather -> pinned_host, batched"),
        "h2d": ("user_batched_put_scatter", "user device_put + donated scatter, batched")}),
    Variant("kvxfer integrity=off", "#0072B2", "-", {
        "d2h": ("offload_off", "kvxfer integrity=off"),
        "h2d": ("load_off_all", "kvxfer integrity=off, gate=all")}),
    Variant("kvxfer integrity=page", "#009E73", "-", {
        "d2h": ("offload_page", "kvxfer integrity=page"),
        "h2d": ("load_page_all", "kvxfer integrity=page, gate=all")}),
    Variant("kvxfer integrity=page, gate=layer", "#56B4E9", "--", {
        "h2d": ("load_page_layer", "kvxfer integrity=page, gate=layer")}),
    Variant("kvxfer path=pinned, integrity=page", "#F0E442", "-", {
        "d2h": ("offload_pinned_page", "kvxfer path=pinned, integrity=page"),
        "h2d": ("load_pinned_page_all", "kvxfer path=pinned, integrity=page, gate=all")}),
)

#: The panels of the plot: (title, direction).
PANELS = (("offload (device -> host)", "d2h"), ("load (host -> device)", "h2d"))


def figure(report: dict[str, Any]) -> Any:
    """Throughput vs bytes per call, offload and load panels, from the prefix sweep.

    Returns:
      A ``matplotlib.figure.Figure`` (with an Agg canvas).

    Raises:
      ImportError: matplotlib is not installed (``pip install 'kvxfer[plot]'``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    sweep = report["sweep"]
    sizes = [r["bytes"] for r in sweep]
    meta = report["meta"]
    limit_label = ("pinned copy" if meta["platform"] == "gpu" else "memcpy") + " (limit)"
    fig = Figure(figsize=(12, 6.5))
    FigureCanvasAgg(fig)
    for i, (title, direction) in enumerate(PANELS):
        ax = fig.add_subplot(1, 2, i + 1)
        for v in VARIANTS:
            if direction not in v.methods:
                continue
            key, label = v.methods[direction]
            if key == "limit":
                ax.plot(sizes, [r["limit"][direction]["gbps"] for r in sweep], v.linestyle,
                        color=v.colour, lw=2, label=limit_label)
                continue
            pts = [(r["bytes"], r["methods"][key]["gbps"]) for r in sweep if key in r["methods"]]
            if pts:
                ax.plot(*zip(*pts), v.linestyle, color=v.colour, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([format_bytes(n) for n in sizes], rotation=30, ha="right")
        ax.set_xlabel("bytes per call")
        ax.set_ylabel("GB/s (best repeat)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.suptitle(f"kvxfer bench {meta['date']}: {meta['platform']} ({meta['device']}), "
                 f"{sweep[0]['layers']} layers x {format_bytes(sweep[0]['block_bytes'])} "
                 "bfloat16 blocks")
    fig.tight_layout()
    return fig


def plot(report: dict[str, Any], path: str) -> str | None:
    """Writes ``figure(report)`` as a PNG at ``path``; None (nothing written) without matplotlib."""
    try:
        fig = figure(report)
    except ImportError:
        return None
    fig.savefig(path, dpi=110)
    return path
