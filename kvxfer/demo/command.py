"""The ``kvxfer demo`` command: one run and its summary.

``run_demo`` serves a workload through :class:`PrefixCacheServer`, then compares
every request's tokens with a run of the same requests with no cache at all;
``format_summary`` prints what the run showed. The options (``DemoOptions``) and the
command line (``kvxfer.demo.register_cli``, ``main``) live in modules of their own,
which import nothing heavy.

Example:
    >>> format_summary.__name__, run_demo.__name__
    ('format_summary', 'run_demo')
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, get_args

import jax
import jax.numpy as jnp
import numpy as np

from kvxfer import _interrupt
from kvxfer._version import __version__ as kvxfer_version
from kvxfer._text import format_bytes, table
from kvxfer.demo import model as _model
from kvxfer.demo._options import DemoOptions
from kvxfer.demo._preflight import Prepared, footprint, open_demo_store, options_of, preflight
from kvxfer.demo.inject import FaultInjector
from kvxfer.demo.server import PrefixCacheServer, RequestKind, RequestOutcome
from kvxfer.demo.workload import make_workload, reference_tokens, shard_caches
from kvxfer.store import Store

__all__ = ["DemoOptions", "demo_namespace", "run_demo", "run_prepared", "format_summary",
           "footprint"]

_REQUEST_KINDS: tuple[str, ...] = get_args(RequestKind)


class _Progress:
    """Progress lines on stderr, only once a run has taken a few seconds; a call is a
    safe point for Ctrl-C (``kvxfer._interrupt``)."""

    def __init__(self, enabled: bool, after_s: float = 3.0, every_s: float = 2.0):
        self.enabled = enabled
        self.start = time.perf_counter()
        self.after_s, self.every_s = after_s, every_s
        self.last = -1e9

    def __call__(self, text: str, force: bool = False) -> None:
        # Called between requests: a safe point where the command line's Ctrl-C stops
        # the run (never inside a compile).
        _interrupt.check()
        now = time.perf_counter()
        if not self.enabled or now - self.start < self.after_s:
            return
        if force or now - self.last >= self.every_s:
            self.last = now
            print(f"kvxfer demo [{now - self.start:5.1f} s] {text}", file=sys.stderr, flush=True)


def _ensure_devices(n: int) -> list[Any]:
    """The first ``n`` devices, asking XLA:CPU for more if JAX has not started yet."""
    if n > 1 and jax.config.jax_num_cpu_devices < n:
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # backends already initialized: use what exists
            pass
    devices = jax.devices()
    if len(devices) < n:
        raise ValueError(f"--devices {n}: JAX has {len(devices)} "
                         f"{devices[0].platform} device(s); on CPU start with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    return devices[:n]


def _median_ms(values: Sequence[float]) -> float | None:
    return round(float(np.median(values)) * 1e3, 3) if values else None


def demo_namespace(preset: str, cfg: _model.ModelConfig, seed: int, dtype: str) -> str:
    """The store namespace of a demo run: everything that changes its KV's bytes.

    The store keys carry the KV's geometry already; this names the rest: the whole
    model config (widths, heads, RoPE base, norm epsilon, block size, ...), its
    weights (``init_params``' float32 draw from ``seed``), the cache dtype, the
    tokens (page keys chain token ids, no tokenizer between), and the code that
    computes the KV (kvxfer's demo model, JAX and its backend: another XLA may round
    differently, and the demo checks tokens bit for bit against a run without cache).

    Example:
        >>> cfg = _model.tiny_llama()
        >>> a = demo_namespace("tiny", cfg, 0, "float32")
        >>> a.startswith("demo-tiny-"), a == demo_namespace("tiny", cfg, 1, "float32")
        (True, False)
    """
    what = {"config": repr(cfg), "weights": f"init_params float32, seed {seed}",
            "kv_dtype": str(dtype), "tokens": "token ids (page_keys)",
            "code": f"kvxfer {kvxfer_version}, jax {jax.__version__}, "
                    f"{jax.default_backend()}"}
    digest = hashlib.blake2b(json.dumps(what, sort_keys=True).encode(),
                             digest_size=8).hexdigest()
    return f"demo-{preset}-{digest}:"


def run_demo(options: DemoOptions | argparse.Namespace | None = None, **overrides: Any) -> dict:
    """Runs the serving demo and returns its summary.

    Serves a workload through :class:`PrefixCacheServer`, then compares every
    request's tokens with a run of the same requests with a fresh cache and no
    prefix reuse.

    Args:
        options: A ``DemoOptions``, the ``argparse`` namespace of ``kvxfer demo``,
            or None for the defaults.
        **overrides: ``DemoOptions`` fields to override.

    Returns:
        The summary (the ``--json`` object): ``requests, device_hits, host_hits``
        (pages served from each tier), ``bytes_offloaded, bytes_loaded,
        pages_verified, corruptions_detected, pages_recomputed, ttft_miss_ms,
        ttft_host_hit_ms, ttft_host_hit_speedup`` (median miss TTFT over median
        host-hit TTFT), ``tokens_match``, ``store_hits`` (pages promoted from the
        store and used), ``store_pages_written`` and more (see ``format_summary``).

    Raises:
        ValueError: a bad option (e.g. too few device blocks for a request).
        StoreError: ``store`` cannot be opened or reached (checked before any work).

    Example:
        >>> s = run_demo(requests=4, system_pages=(2, 3), new_tokens=2, device_blocks=5,
        ...              host_blocks=8, inject="bitflip", injections=1, progress=False)
        >>> s["corruptions_detected"], s["tokens_match"]
        (1, True)
    """
    opts = options_of(options, overrides)
    t_start = time.perf_counter()
    # The sizes and the store first: a bad one fails the run before the reference run
    # and the warm-up (seconds of work) start.
    prepared = preflight(opts)
    store = open_demo_store(opts.store)
    try:
        return run_prepared(opts, prepared, store, t_start)
    finally:
        if store is not None:
            store.close()


def run_prepared(opts: DemoOptions, prepared: Prepared, store: Store | None,
                 t_start: float) -> dict:
    """``run_demo`` once its options are checked (``options_of``), its sizes too
    (``preflight``) and its store is open (``open_demo_store``); the command line
    does those before it imports JAX."""
    devices = _ensure_devices(prepared.devices)
    progress = _Progress(opts.progress)
    cfg = prepared.cfg
    requests = make_workload(cfg, opts.requests, opts.seed, system_pages=opts.system_pages,
                             new_tokens=opts.new_tokens)
    model = _model.Model(cfg, seed=opts.seed)
    dtype = jnp.dtype(opts.dtype)

    def fresh_caches() -> list[jax.Array]:
        return shard_caches(model.make_kv_caches(opts.device_blocks, dtype), devices)

    # The reference first: it also compiles the model's programs, so the served
    # requests' time-to-first-token does not include compilation.
    t0 = time.perf_counter()
    reference = reference_tokens(model, requests, fresh_caches,
                                 lambda i: progress(f"reference run {i}/{len(requests)}"))
    reference_s = time.perf_counter() - t0

    injector = FaultInjector(opts.inject, opts.injections) if opts.inject else None
    outcomes: list[RequestOutcome] = []
    namespace = demo_namespace(opts.model, cfg, opts.seed, opts.dtype)
    with PrefixCacheServer(model, fresh_caches(), num_host_blocks=opts.host_blocks,
                           integrity=opts.integrity, gate=opts.gate, injector=injector,
                           store=store, namespace=namespace) as srv:
        progress("warm-up: compiling the transfer programs", force=True)
        t0 = time.perf_counter()
        srv.warm_up(max(opts.system_pages))
        warmup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for r in requests:
            outcomes.append(srv.serve(r))
            st = srv.stats
            progress(f"served {len(outcomes)}/{len(requests)} (pages from device "
                     f"{st.device_hits}, host {st.host_hits}; corruptions "
                     f"{st.corruptions_detected})")
        serve_s = time.perf_counter() - t0
        stats, plan = srv.stats, srv.mgr.plan
        paths = sorted(set(srv.mgr.paths))
        srv.close()  # writes the host pages the store lacks
        cache_stats = srv.cache.stats()
    sharded = sum(len(c.layers) for c in plan.classes if c.num_shards > 1)

    mismatched = [o.rid for o, ref in zip(outcomes, reference) if list(o.tokens) != ref]
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for o in outcomes:
        by_kind[o.kind].append(o.ttft_s)
    ttft_miss, ttft_host = _median_ms(by_kind["miss"]), _median_ms(by_kind["host_hit"])
    progress("done", force=True)
    return {
        "requests": stats.requests,
        "device_hits": stats.device_hits,
        "host_hits": stats.host_hits,
        "computed_pages": stats.computed_pages,
        "requests_by_kind": {k: len(by_kind.get(k, ())) for k in _REQUEST_KINDS},
        "pages_offloaded": stats.pages_offloaded,
        "bytes_offloaded": stats.bytes_offloaded,
        "pages_loaded": stats.pages_loaded,
        "bytes_loaded": stats.bytes_loaded,
        "pages_verified": stats.pages_verified,
        "corruptions_detected": stats.corruptions_detected,
        "pages_recomputed": stats.pages_recomputed,
        "restarts": stats.restarts,
        "device_evictions": stats.device_evictions,
        "host_evictions": cache_stats["evictions"],
        "store": opts.store,
        "store_hits": cache_stats["store_hits"],
        "store_pages_written": cache_stats["store_pages_written"],
        "store_bad_pages": cache_stats["bad_pages_by_tier"].get(
            store.name if store is not None else "", 0),
        "ttft_miss_ms": ttft_miss,
        "ttft_device_hit_ms": _median_ms(by_kind["device_hit"]),
        "ttft_host_hit_ms": ttft_host,
        "ttft_recovered_ms": _median_ms(by_kind["recovered"]),
        "ttft_host_hit_speedup": (round(ttft_miss / ttft_host, 2)
                                  if ttft_miss is not None and ttft_host else None),
        "tokens_match": not mismatched,
        "mismatched_requests": mismatched,
        "integrity": opts.integrity,
        "inject": opts.inject,
        "injections": injector.log if injector else [],
        "detections": stats.detection_reasons,
        "gate": opts.gate,
        "model": opts.model,
        "layers": cfg.num_layers,
        "scale": opts.scale,
        "dtype": opts.dtype,
        "devices": len(devices),
        "sharded_layers": sharded,
        "device_blocks": opts.device_blocks,
        "host_blocks": opts.host_blocks,
        "page_bytes": plan.page_bytes,
        "slice_classes": len(plan.classes),
        "transfer_paths": paths,
        "seed": opts.seed,
        "reference_s": round(reference_s, 3),
        "warmup_s": round(warmup_s, 3),
        "serve_s": round(serve_s, 3),
        "time_s": round(time.perf_counter() - t_start, 3),
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"


def _shown(summary: dict) -> list[str]:
    """The closing lines: what the run showed, and what to try next."""
    kinds = summary["requests_by_kind"]
    lines = []
    if summary["inject"]:
        lines.append(
            f"faults: {len(summary['injections'])} {summary['inject']} injected, "
            f"{summary['corruptions_detected']} detected, {summary['pages_recomputed']} "
            f"pages recomputed, restarts {summary['restarts']}")
    miss, host = summary["ttft_miss_ms"], summary["ttft_host_hit_ms"]
    if miss is None or host is None:
        had = f"{kinds['host_hit']} host hits and {kinds['miss']} misses"
        if kinds["recovered"]:
            had += f" ({kinds['recovered']} hits recovered from damaged cached pages)"
        hint = "" if kinds["recovered"] else \
            " (raise --requests, or lower --device-blocks so pages go to host)"
        lines.append(f"time to first token: no comparison, the run had {had}{hint}")
    else:
        ratio = summary["ttft_host_hit_speedup"]
        verdict = f"{ratio:.1f}x faster" if ratio >= 1 else \
            f"{ratio:.1f}x as fast: slower than computing the prompt"
        lines.append(f"time to first token: host hits {_ms(host)} against {_ms(miss)} for "
                     f"misses (medians of {kinds['host_hit']} and {kinds['miss']} requests): "
                     f"host hits {verdict}")
    if summary["tokens_match"]:
        lines.append(f"tokens: identical to a run with no cache in all {summary['requests']} "
                     "requests")
    else:
        bad = summary["mismatched_requests"]
        why = (" (integrity=off: damaged host pages were used unverified)"
               if summary["integrity"] == "off" else "")
        lines.append(f"tokens: DIFFER FROM A RUN WITH NO CACHE in {len(bad)} of "
                     f"{summary['requests']} requests {bad}{why}")
    if not summary["inject"]:
        lines.append("next: kvxfer demo --inject bitflip (damages host pages after offload, "
                     "to see them detected and recomputed)")
    return lines


def format_summary(summary: dict) -> str:
    """The human-readable summary of a ``run_demo`` result.

    A header, a table of every metric, the injections and detections, and last
    what the run showed: host-hit against miss time to first token, whether the
    tokens equal a run with no cache, and (without ``--inject``) what to try next.

    Example:
        >>> s = run_demo(requests=4, system_pages=(2, 3), new_tokens=2, device_blocks=5,
        ...              host_blocks=8, progress=False)
        >>> format_summary(s).splitlines()[-1].startswith("next: kvxfer demo --inject bitflip")
        True
    """
    kinds = summary["requests_by_kind"]
    rows = [
        ["requests", summary["requests"],
         ", ".join(f"{k} {v}" for k, v in kinds.items())],
        ["device_hits", summary["device_hits"], "prompt pages served from device blocks"],
        ["host_hits", summary["host_hits"], "prompt pages loaded from host memory and used"],
        ["computed_pages", summary["computed_pages"], "prompt pages computed"],
        ["bytes_offloaded", format_bytes(summary["bytes_offloaded"]),
         f"{summary['pages_offloaded']} pages of {format_bytes(summary['page_bytes'])}"],
        ["bytes_loaded", format_bytes(summary["bytes_loaded"]),
         f"{summary['pages_loaded']} pages"],
        ["pages_verified", summary["pages_verified"], f"integrity={summary['integrity']}"],
        *([["store_hits", summary["store_hits"], "of them promoted from the store"],
           ["store_pages_written", summary["store_pages_written"],
            f"store {summary['store']}"]] if summary["store"] else []),
        ["corruptions_detected", summary["corruptions_detected"],
         f"inject={summary['inject'] or 'none'}"],
        ["pages_recomputed", summary["pages_recomputed"],
         f"restarts {summary['restarts']}"],
        ["ttft_miss_ms", _ms(summary["ttft_miss_ms"]), "median"],
        ["ttft_device_hit_ms", _ms(summary["ttft_device_hit_ms"]), "median"],
        ["ttft_host_hit_ms", _ms(summary["ttft_host_hit_ms"]), "median"],
        ["ttft_recovered_ms", _ms(summary["ttft_recovered_ms"]), "median"],
        ["tokens_match", summary["tokens_match"],
         "vs. no cache" + (f"; differ: {summary['mismatched_requests']}"
                           if summary["mismatched_requests"] else "")],
        ["time_s", f"{summary['time_s']:.2f}",
         f"reference {summary['reference_s']:.2f}, warm-up {summary['warmup_s']:.2f}, "
         f"serve {summary['serve_s']:.2f}"],
    ]
    head = [
        f"kvxfer demo: model={summary['model']} layers={summary['layers']} "
        f"scale={summary['scale']} dtype={summary['dtype']} "
        f"slice_classes={summary['slice_classes']} devices={summary['devices']} "
        f"(KV heads split in {summary['sharded_layers']} layers)",
        f"tiers: device_blocks={summary['device_blocks']} "
        f"host_blocks={summary['host_blocks']} store={summary['store'] or 'none'} "
        f"paths={','.join(summary['transfer_paths'])} "
        f"gate={summary['gate']} integrity={summary['integrity']} "
        f"inject={summary['inject'] or 'none'}",
    ]
    lines = head + [table(rows, ["metric", "value", "note"])]
    lines += [f"injected: {t}" for t in summary["injections"]]
    lines += [f"detected: {t}" for t in summary["detections"]]
    return "\n".join(lines + _shown(summary))
