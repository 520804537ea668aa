"""The measured sections: throughput cells, the prefix sweep, concurrency, host overhead,
integrity traffic, memory and cache size (the caller-thread sections are in ``_caller``).

Each section returns JSON-ready rows. kvxfer's variants of a case run interleaved with
the limit's copies (``timing.interleaved``); the user baselines run after them.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np

from kvxfer._text import format_bytes
from kvxfer.bench._baselines import (JAX_ROUTES, JaxRoutes, host_pages, load_baselines,
                                     offload_baselines, put_scatter)
from kvxfer.bench._caller import call_cases
from kvxfer.bench._config import BenchConfig
from kvxfer.bench._hostrss import reset_peak, rss
from kvxfer.bench._rig import LOAD_VARIANTS, Rig, check_loaded, load_name, make_caches
from kvxfer.bench.limits import Limit, limit_figures
from kvxfer.bench.timing import Progress, interleaved, now, stats
from kvxfer.engine import bucket
from kvxfer.hostpool import DIGEST_SLOTS, PageRef
from kvxfer.integrity import IDENTITY_WORDS
from kvxfer.manager import IntegrityMode, PathMode

__all__ = ["StepKind", "ordered_cells", "plan", "fit_plan", "throughput_cell", "prefix_sweep",
           "cache_size_section", "PINNED_METHODS"]

#: The kinds of step a run's progress counts (each timed alike, for the estimate).
StepKind = Literal["throughput", "concurrency", "overhead", "sweep", "cache size",
                   "first call", "queued steps", "store", "engine fit", "warm-up", "model",
                   "policy", "copy sizes"]

#: Pages held as load sources, by (integrity, path) of their manager.
_Held = dict[tuple[IntegrityMode, PathMode], list[PageRef]]

#: The pinned mover's variants a case times when ``path="auto"`` is another mover
#: here (on GPU auto is the pinned mover, so its figures are the kvxfer columns).
PINNED_METHODS = ("offload_pinned_off", "offload_pinned_page", "load_pinned_off_all",
                  "load_pinned_page_all")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def ordered_cells(cfg: BenchConfig) -> list[tuple[int, str]]:
    """The throughput cells in the order they run: the reference cell first."""
    return sorted(cfg.cells, key=lambda c: c != cfg.reference)


def plan(cfg: BenchConfig) -> list[StepKind]:
    """The kind of every step of a run of ``cfg`` before the store section, in order
    (for ``timing.Progress``)."""
    sweep: list[StepKind] = ["sweep"] * len(cfg.prefix_pages)
    steps: list[StepKind] = []
    for cell in ordered_cells(cfg):
        steps.append("throughput")
        if cell == cfg.reference:
            steps += ["concurrency"] * len(cfg.concurrency) + ["overhead"]
            if cfg.sweep_on_reference:
                steps += sweep
    if not cfg.sweep_on_reference:
        steps += sweep
    steps += ["copy sizes"] * len(cfg.copy_sizes)
    steps.append("cache size")
    cases = len(call_cases(cfg))
    steps += ["first call"] * cases + ["queued steps"] * cases
    return steps + fit_plan(cfg)


def fit_plan(cfg: BenchConfig) -> list[StepKind]:
    """The steps of the engine-fit section (``_fit.fit_section``)."""
    from kvxfer.bench._fit import FIT_PATHS

    return ["engine fit"] * len(FIT_PATHS) + ["warm-up"] * len(cfg.warmup_paths)


def _with_fraction(s: dict[str, Any], limit: dict[str, dict[str, Any]], direction: str
                   ) -> dict[str, Any]:
    s["direction"] = direction
    s["fraction_of_limit"] = s["gbps"] / limit[direction]["gbps"]
    return s


def _measure_case(cfg: BenchConfig, limit: Limit, rig: Rig, held: _Held, ids: list[int],
                  block_bytes: int, batched: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The limit, kvxfer's variants (interleaved) and the user baselines for pages ``ids``.

    Returns:
      ``(limit, methods)``: per direction the limit's stats, and per method its stats
      with ``direction`` and ``fraction_of_limit`` (kvxfer loads add ``first_layer``
      and ``last_layer``).
    """
    nbytes = len(ids) * cfg.layers * block_bytes
    runners = limit.runners(nbytes)
    variants: dict[str, Callable[[], Any]] = dict(runners)
    for integ in ("off", "page"):
        variants[f"offload_{integ}"] = lambda integ=integ: rig.offload(integ, ids)
    for integ, gate in LOAD_VARIANTS:
        variants[load_name(integ, gate)] = (
            lambda integ=integ, gate=gate: rig.load(integ, held[(integ, "auto")][:len(ids)],
                                                    ids, gate))
    if ("page", "pinned") in rig.mgrs:
        for integ in ("off", "page"):
            variants[f"offload_pinned_{integ}"] = (
                lambda integ=integ: rig.offload(integ, ids, "pinned"))
            variants[f"load_pinned_{integ}_all"] = (
                lambda integ=integ: rig.load(integ, held[(integ, "pinned")][:len(ids)], ids,
                                             "all", "pinned"))
    # The plain-JAX routes, interleaved with kvxfer's: what an engine would write
    # (compiled once per rig and pages: a sweep on the reference cell reuses its call's).
    if tuple(ids) not in rig.routes:
        rig.routes[tuple(ids)] = JaxRoutes(rig, ids)
    routes = rig.routes[tuple(ids)]
    variants["jax_gather_pinned"] = routes.offload
    variants["jax_put_scatter"] = routes.load
    t = interleaved(variants, cfg.repeats)
    lim = limit_figures({k: t[k] for k in runners}, nbytes)
    methods: dict[str, Any] = {}
    for name, timing in t.items():
        if name in runners:
            continue
        s = stats(timing["s"], nbytes)
        if "call_s" in timing:
            s["call_p50_s"] = float(np.percentile(timing["call_s"], 50))
        if "first_s" in timing:
            s["first_layer"] = stats(timing["first_s"])
            s["last_layer"] = stats(timing["s"])
        offload = name.startswith("offload") or name == JAX_ROUTES[0]
        methods[name] = _with_fraction(s, lim, "d2h" if offload else "h2d")
    for name, s in offload_baselines(rig, ids, cfg, batched).items():
        methods[name] = _with_fraction(s, lim, "d2h")
    for name, s in load_baselines(rig, ids, cfg, batched).items():
        methods[name] = _with_fraction(s, lim, "h2d")
    return lim, methods


def throughput_cell(cfg: BenchConfig, limit: Limit, block_bytes: int, dtype: str, *,
                    report: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """One throughput row; the reference cell also fills the sections that reuse it."""
    layers = cfg.layers
    reference = (block_bytes, dtype) == cfg.reference
    pages = cfg.batch_bytes // (layers * block_bytes)
    nbytes = pages * layers * block_bytes
    progress.step("throughput", f"throughput: {format_bytes(block_bytes)} {dtype} blocks, "
                  f"{_count(pages, 'page')} x {layers} layers = {format_bytes(nbytes)} per call")
    device_before = _device_bytes_in_use()
    # Twice the pages: the loads' source pages stay held while offloads take new slots.
    rig = Rig(make_caches(layers, pages, block_bytes, dtype), num_host_blocks=2 * pages)
    try:
        ids = list(range(pages))
        held: _Held = {}
        cold: dict[str, float] = {}
        progress.note("first calls: compiling the offload and load programs")
        for integ in ("off", "page"):  # first calls: they compile the class's programs
            t0 = now()
            held[(integ, "auto")] = rig.hold(integ, ids)
            cold[f"offload_{integ}"] = now() - t0
            cold[load_name(integ, "all")] = rig.load(integ, held[(integ, "auto")], ids,
                                                     "all")["s"]
        pinned = _hold_pinned(rig, held, ids)
        if reference:  # before the limit's and the user baselines' buffers exist
            progress.note("memory: host pool vs plan, transient memory of one offload + load")
            report["memory"] = _memory_section(rig, held, ids, device_before)
        batched = cfg.batched_baseline == "all" or (
            reference and cfg.batched_baseline == "reference")
        progress.note(f"timing the limit, the user baselines and kvxfer, {cfg.repeats} "
                      "repeats each, interleaved")
        lim, methods = _measure_case(cfg, limit, rig, held, ids, block_bytes, batched)
        for name, seconds in cold.items():
            methods[name]["first_call_s"] = seconds
        row = {"block_bytes": block_bytes, "dtype": dtype, "layers": layers, "pages": pages,
               "bytes": nbytes, "paths": sorted(set(rig.mgr("page").paths)),
               "pinned_methods": pinned, "limit": lim, "methods": methods}
        if reference:
            report["concurrency"] = _concurrency_section(cfg, rig, held, block_bytes, progress)
            report["overhead"] = _overhead_section(cfg, rig, held, block_bytes, progress)
            report["integrity_traffic"] = _integrity_traffic(rig, pages, block_bytes)
            if cfg.sweep_on_reference:
                report["sweep"] = prefix_sweep(cfg, limit, progress, rig, held)
        return row
    finally:
        rig.close()
        gc.collect()


def _hold_pinned(rig: Rig, held: _Held, ids: list[int]) -> bool:
    """Adds the pinned managers to ``rig`` (see ``Rig.add_pinned``) and their held pages,
    after one load each (their programs compiled); whether they were added."""
    if not rig.add_pinned():
        return False
    for integ in ("off", "page"):
        held[(integ, "pinned")] = rig.hold(integ, ids, path="pinned")
        rig.load(integ, held[(integ, "pinned")], ids, "all", "pinned")
    return True


def prefix_sweep(cfg: BenchConfig, limit: Limit, progress: Progress, rig: Rig | None = None,
                 held: _Held | None = None) -> list[dict[str, Any]]:
    """Throughput vs transfer size and hit latency over prefix lengths.

    Runs on ``rig`` (the reference cell's, whose programs are compiled already)
    when given, else on caches of its own.
    """
    layers, block = cfg.layers, cfg.prefix_block_bytes
    top = max(cfg.prefix_pages)
    own = rig is None
    if rig is None:
        rig = Rig(make_caches(layers, top, block, "bfloat16"), num_host_blocks=2 * top)
    rows = []
    pinned = ("page", "pinned") in rig.mgrs
    try:
        if held is None:
            held = {(i, "auto"): rig.hold(i, list(range(top))) for i in ("off", "page")}
            pinned = _hold_pinned(rig, held, list(range(top)))
        for n in cfg.prefix_pages:
            nbytes = n * layers * block
            progress.step("sweep", f"prefix sweep: {_count(n, 'page')} x {layers} layers x "
                          f"{format_bytes(block)} = {format_bytes(nbytes)}")
            lim, methods = _measure_case(cfg, limit, rig, held, list(range(n)), block,
                                         batched=cfg.batched_baseline == "all")
            rows.append({"pages": n, "block_bytes": block, "layers": layers, "bytes": nbytes,
                         "dtype": "bfloat16", "paths": sorted(set(rig.mgr("page").paths)),
                         "pinned_methods": pinned, "limit": lim, "methods": methods})
    finally:
        if own:
            rig.close()
            gc.collect()
    return rows


def _concurrency_section(cfg: BenchConfig, rig: Rig, held: _Held, block_bytes: int,
                         progress: Progress) -> list[dict[str, Any]]:
    k = cfg.request_pages
    req_bytes = k * cfg.layers * block_bytes
    rows = []
    for c in cfg.concurrency:
        progress.step("concurrency", f"concurrency: {_count(c, 'request')} of "
                      f"{_count(k, 'page')} "
                      f"({format_bytes(req_bytes)}) in flight")
        reqs = [list(range(j * k, (j + 1) * k)) for j in range(c)]

        def offloads(integ: IntegrityMode, reqs: list[list[int]] = reqs) -> dict[str, float]:
            mgr = rig.mgr(integ)
            t0 = now()
            handles = [mgr.offload(rig.caches, ids, rig.keys(len(ids))) for ids in reqs]
            issued = now() - t0
            done, pages = [], []
            for h in handles:
                pages.append(h.wait())
                done.append(now() - t0)
            total = now() - t0
            for p in pages:
                mgr.free(p)
            return {"s": total, "issue_s": issued, **{f"req{j}": d for j, d in enumerate(done)}}

        def loads(integ: IntegrityMode, reqs: list[list[int]] = reqs) -> dict[str, float]:
            mgr = rig.mgr(integ)
            t0 = now()
            handles = []
            for j, ids in enumerate(reqs):
                rig.caches, h = mgr.load(rig.caches, held[(integ, "auto")][j * k:(j + 1) * k],
                                         ids, gate="all")
                handles.append(h)
            issued = now() - t0
            done = []
            for h in handles:
                check_loaded(h.result(), k)
                done.append(now() - t0)
            return {"s": now() - t0, "issue_s": issued,
                    **{f"req{j}": d for j, d in enumerate(done)}}

        variants = {f"{op}_{i}": (lambda op=op, i=i: (offloads if op == "offload" else loads)(i))
                    for op in ("offload", "load") for i in ("off", "page")}
        t = interleaved(variants, cfg.repeats)
        for name, timing in t.items():
            op, integ = name.split("_")
            lat = [v for key, vals in timing.items() if key.startswith("req") for v in vals]
            rows.append({"op": op, "integrity": integ, "in_flight": c, "request_pages": k,
                         "request_bytes": req_bytes,
                         "aggregate": stats(timing["s"], c * req_bytes),
                         "request_latency": stats(lat),
                         "issue_p50_s": float(np.percentile(timing["issue_s"], 50))})
    return rows


def _overhead_section(cfg: BenchConfig, rig: Rig, held: _Held, block_bytes: int,
                      progress: Progress) -> list[dict[str, Any]]:
    k = cfg.overhead_pages
    progress.step("overhead", f"host overhead: {_count(k, 'page')} x {cfg.layers} layers "
                  "per call")
    ids = list(range(k))
    variants: dict[str, Callable[[], Any]] = {
        "offload_off": lambda: rig.offload("off", ids),
        "offload_page": lambda: rig.offload("page", ids)}
    for integ, gate in LOAD_VARIANTS:
        variants[load_name(integ, gate)] = (
            lambda integ=integ, gate=gate: rig.load(integ, held[(integ, "auto")][:k], ids,
                                                    gate))
    t = interleaved(variants, cfg.overhead_repeats)
    rows = []
    for name, timing in t.items():
        parts = name.split("_")
        rows.append({"op": parts[0], "integrity": parts[1],
                     "gate": parts[2] if len(parts) > 2 else "-", "pages": k,
                     "layers": cfg.layers, "bytes": k * cfg.layers * block_bytes,
                     "call": stats(timing["call_s"]), "total": stats(timing["s"])})
    return rows


def _integrity_traffic(rig: Rig, pages: int, block_bytes: int) -> list[dict[str, Any]]:
    """Extra bytes integrity reads per call, derived from the programs the engine runs.

    The digest programs read the padded block list (``bucket(k)`` blocks) of every
    layer once per direction; the host keeps ``DIGEST_SLOTS`` words per page, layer
    and shard, written on offload and read on load; the page identities go to each
    shard's device once per transfer.
    """
    mgr = rig.mgr("page")
    rows = []
    for k in sorted({n for n in (1, 32, pages) if n <= pages}):
        payload = k * mgr.num_layers * block_bytes
        layer_shards = sum(len(c.layers) * c.num_shards for c in mgr.plan.classes)
        device = bucket(k) * mgr.num_layers * block_bytes
        host = k * layer_shards * DIGEST_SLOTS * 4
        ident = bucket(k) * max(c.num_shards for c in mgr.plan.classes) * IDENTITY_WORDS * 4
        rows.append({"pages": k, "payload_bytes": payload,
                     "device_read_bytes_offload": device, "device_read_bytes_load": device,
                     "host_digest_bytes": host, "identity_bytes": ident,
                     "extra_over_payload": (device + host + ident) / payload,
                     "basis": "derived from the digest programs' shapes (engine.bucket "
                              "padding included), not counted by hardware"})
    return rows


def _device_bytes_in_use() -> int | None:
    stats_ = jax.devices()[0].memory_stats()
    return None if not stats_ or "bytes_in_use" not in stats_ else int(stats_["bytes_in_use"])


def _memory_section(rig: Rig, held: _Held, ids: list[int], device_before: int | None
                    ) -> dict[str, Any]:
    mgr = rig.mgr("page")
    out: dict[str, Any] = {"pool_bytes": mgr.host_pool.nbytes,
                           "plan_bytes": mgr.plan.total_host_bytes,
                           "pool_over_plan": mgr.host_pool.nbytes / mgr.plan.total_host_bytes,
                           "not_measured": []}
    cache_bytes = sum(int(c.nbytes) for c in rig.caches)
    out["cache_bytes"] = cache_bytes
    device_after = _device_bytes_in_use()
    rig.offload("page", ids)  # the slots it takes (and frees) are touched before measuring
    at = rss()
    if at is not None and reset_peak():
        gc.collect()
        before = (rss() or at)[0]
        rig.offload("page", ids)
        rig.load("page", held[("page", "auto")], ids, "all")
        peak = (rss() or at)[1]
        out["host_rss_before_bytes"] = before
        out["host_peak_rss_bytes"] = peak
        out["host_transient_bytes"] = max(0, peak - before)
        out["payload_bytes"] = len(ids) * mgr.plan.page_bytes
    else:
        out["not_measured"].append("host transient memory: /proc/self/clear_refs unavailable")
    if device_before is not None and device_after is not None:
        stats_ = jax.devices()[0].memory_stats() or {}
        out["device_bytes_in_use"] = device_after
        out["device_persistent_bytes"] = max(0, device_after - device_before - cache_bytes)
        if "peak_bytes_in_use" in stats_:
            out["device_transient_bytes"] = max(
                0, int(stats_["peak_bytes_in_use"]) - device_before - cache_bytes)
    else:
        out["not_measured"].append(
            f"device memory beyond caches: {jax.devices()[0].platform} device reports no "
            "memory_stats (on CPU, device memory is the host memory above)")
    return out


def cache_size_section(cfg: BenchConfig, progress: Progress) -> dict[str, Any]:
    """Loads the same pages into a small and a large cache: does time grow with the cache?"""
    block, _ = cfg.reference
    layers, k = cfg.layers, cfg.cache_load_pages
    sizes = {"small": cfg.cache_small_bytes, "large": cfg.cache_large_bytes}
    progress.step("cache size", f"cache size: load {_count(k, 'page')} into "
                  f"{format_bytes(sizes['small'])} vs {format_bytes(sizes['large'])} caches "
                  f"({layers} layers, {format_bytes(block)} bfloat16 blocks)")
    kinds: list[tuple[IntegrityMode, PathMode]] = [("off", "auto"), ("page", "auto")]
    if cfg.cache_size_extras:
        kinds.append(("page", "staged"))
    rigs: dict[str, Rig] = {}
    held: dict[str, dict[tuple[IntegrityMode, PathMode], list[PageRef]]] = {}
    dst: dict[str, list[int]] = {}
    out: dict[str, Any] = {"pages": k, "layers": layers, "block_bytes": block,
                           "bytes": k * layers * block, "variants": {}}
    try:
        for name, total in sizes.items():
            nb = total // (layers * block)
            out[f"{name}_cache_bytes"] = nb * layers * block
            rigs[name] = Rig(make_caches(layers, nb, block, "bfloat16"), k, kinds)
            src = list(range(k))
            held[name] = {kind: rigs[name].hold(kind[0], src, path=kind[1]) for kind in kinds}
            dst[name] = np.linspace(0, nb - 1, k).round().astype(int).tolist()
        # The extras rewrite whole caches (XLA:CPU scatters): they are timed apart,
        # so they cannot disturb the kvxfer figures.
        variants: dict[str, Callable[[], Any]] = {}
        extras: dict[str, Callable[[], Any]] = {}
        for integ, path in kinds:
            for name in sizes:
                (variants if path == "auto" else extras)[f"{integ}_{path}_{name}"] = (
                    lambda integ=integ, path=path, name=name:
                    rigs[name].load(integ, held[name][(integ, path)], dst[name], "all", path))
        if cfg.cache_size_extras:
            for name, r in rigs.items():
                extras[f"user_scatter_{name}"] = put_scatter(
                    r, host_pages(r.caches, range(k)), dst[name])
        t = interleaved(variants, cfg.repeats)
        if extras:
            t.update(interleaved(extras, cfg.repeats))
        groups = [f"{i}_{p}" for i, p in kinds] + (["user_scatter"] if cfg.cache_size_extras
                                                   else [])
        for g in groups:
            small = stats(t[f"{g}_small"]["s"], out["bytes"])
            large = stats(t[f"{g}_large"]["s"], out["bytes"])
            out["variants"][g] = {"small": small, "large": large,
                                  "ratio": large["best_s"] / small["best_s"],
                                  "ratio_p50": large["p50_s"] / small["p50_s"]}
    finally:
        for r in rigs.values():
            r.close()
        rigs.clear()
        gc.collect()
    return out
