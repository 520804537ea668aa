"""A report as text: the tables of each section, then the target lines.

Everything here reads only the report dict (its ``meta.config`` included), so a kept
``bench.json`` can be printed again.

Example:
    >>> _ms(0.0012), _ms(0.25), _gb({"gbps": 7.5, "fraction_of_limit": 0.75})
    ('1.200', '250.0', '7.50 (0.75x)')
"""

from __future__ import annotations

from typing import Any

from kvxfer._text import fit_width, format_bytes, table
from kvxfer.bench._figures import pinned_figures
from kvxfer.bench._judge import MISS_MEANING, NOT_JUDGED, judged, summary
from kvxfer.bench._policies import policy_lines

__all__ = ["format_report", "target_line"]


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


def format_report(report: dict[str, Any], *, width: int | None = None,
                  judge: bool | None = None) -> str:
    """The human-readable report: tables, then the PASS/MISS target lines (a report of
    the store section alone has its table only); a smoke run's says instead that its
    figures are not judged (``NOT_JUDGED``), unless ``judge`` asks.

    A *block* is one layer's block; a *page* is one block index across every
    layer (what one host slot holds). ``integrity`` and ``gate`` name
    ``KVCacheManager``'s options.

    Args:
      report: what ``run_bench`` returned.
      width: when given, no line is wider: wider tables are cut into parts of whole
        columns, each repeating the columns that name a row, and prose is wrapped
        (``kvxfer bench`` prints 100 columns). None: every table whole (``--wide``).
      judge: print the target lines and their summary (None: ``judged(report)``,
        every run but a smoke one; ``kvxfer bench --smoke --check`` passes True).
    """
    text = _format_report(report, judged(report) if judge is None else judge)
    return text if width is None else fit_width(text, width)


def _format_report(report: dict[str, Any], judge: bool) -> str:
    meta = report["meta"]
    preset = f", {meta['preset']}" if meta.get("preset") not in (None, "full") else ""
    only = f", --only {meta['only']}" if meta.get("only") else ""
    lines = [f"kvxfer bench — {meta['date']}, {meta['platform']} ({meta['device']}), "
             f"jax {meta['jax_version']}, {meta['cpu_count']} CPUs{preset}{only}"]
    # The transfer sections print whole or not at all: Ctrl-C may have cut them short
    # (the engine-fit section is their last).
    if "throughput" in report and "fit" in report:
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
        if "throughput" in report:
            lines.append("The transfer sections were cut short: what they measured is in "
                         "--json and --out's bench.json.")
    if "fit" in report:
        lines += _fit_lines(report["fit"])
        if "throughput" not in report and report.get("not_measured"):
            lines += [""] + [f"  not measured: {note}" for note in report["not_measured"]]
    if "models" in report:
        lines += _model_lines(report["models"])
    if "store" in report:
        lines += _store_lines(report["store"])
    if report.get("store_lookup"):
        lines += _lookup_lines(report["store_lookup"])
    if "policy" in report:
        lines += policy_lines(report["policy"])

    if meta.get("interrupted"):
        lines += ["", f"Interrupted {meta['interrupted']}: the steps from there on were "
                  "not run, and no target is judged."]
    elif not judge:
        lines += ["", NOT_JUDGED]
    else:
        lines += ["", "Targets (each one's hardware and reason: kvxfer bench --targets; "
                  "kvxfer bench --check exits 1 on a MISS)"]
        lines += [target_line(t) for t in report["targets"]]
        lines.append(summary(report))
        if any(t["status"] != "N/A" for t in report["targets"]):
            lines.append(MISS_MEANING)
    peak, load = meta.get("peak_rss_bytes"), meta.get("load_average")
    lines.append(f"\n(wall time {meta['wall_s']:.0f} s"
                 + (f", peak host memory {peak / 1e9:.2f} GB" if peak else "")
                 + (f", load average {load[0]:.1f} on {meta['cpu_count']} CPUs"
                    if load else "") + ")")
    return "\n".join(lines)


def target_line(t: dict[str, Any]) -> str:
    """``PASS  name: value (where)``; ``N/A   name (where)`` for other hardware.

    Example:
        >>> target_line({"status": "MISS", "name": "x <= 1 ms", "value": 1.25,
        ...              "where": "p50"})
        'MISS  x <= 1 ms: 1.25 (p50)'
    """
    if t["value"] is None:
        return f"{t['status']:<4}  {t['name']} ({t['where']})"
    return f"{t['status']:<4}  {t['name']}: {t['value']:.3g} ({t['where']})"


_BATCHED = ("user_batched_gather_pinned", "user_batched_put_scatter")


def _fractions(node: Any) -> list[float]:
    """Every ``fraction_of_limit`` in a report (any depth)."""
    if isinstance(node, dict):
        found = [float(node["fraction_of_limit"])] if isinstance(
            node.get("fraction_of_limit"), (int, float)) else []
        return found + [f for v in node.values() for f in _fractions(v)]
    if isinstance(node, list):
        return [f for v in node for f in _fractions(v)]
    return []


def _cell_notes(report: dict[str, Any]) -> list[str]:
    """Once, under the throughput tables: why a cell is ``-``, and what a figure above
    its limit means."""
    cfg = report["meta"]["config"]
    methods = [r["methods"] for r in report["throughput"] + report.get("sweep", [])]
    notes = []
    if any(m.get(k) is None for m in methods for k in _BATCHED):
        where = {"none": "in no cell of this preset", "reference": "on the reference cell "
                 "only in this preset"}.get(cfg.get("batched_baseline"), "in some cells")
        notes.append(f"  -: the batched user baselines are timed {where} (on CPU one sample "
                     "of a batched gather can take seconds); the full run times every cell")
    if any(m.get(k) is None for m in methods for k in ("jax_gather_pinned", "jax_put_scatter")):
        notes.append("  -: plain JAX is not timed for this cell (see 'not measured' below)")
    over = [f for f in _fractions(report) if f > 1.0]
    if over:
        notes.append(f"  above 1.00x (up to {max(over):.2f}x): the limit is measured in the "
                     "same run; on a busy machine its best repeat can come out slower than a "
                     "case's, so read such a figure as at the limit")
    return [""] + notes if notes else []


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
    lines += _cell_notes(report)

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
    lines += ["", f"Host time of one call (p50 ms), device idle and behind {r0['steps']} "
              "queued steps (as a fraction of their time); judged on the engine-fit "
              "section's calls (Targets below)"]
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


