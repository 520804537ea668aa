"""The models section: offload and load of a model config's own caches (``--model``).

The throughput section moves caches of one flat block shape per cell. An engine moves
its own: sglang-jax's ``[pages + dp, page_size, heads*2/packing, packing, head_dim]``
with one token per page, vLLM TPU's 16-token blocks, an MLA latent of 1024 tokens.
For each config named (``configs/`` or a TOML file) this section builds the config's
caches, one call moving ``batch_bytes`` (whole pages, at least one), and times, with
the limit's copies of the same bytes, interleaved repeat by repeat: ``offload`` and
``load`` (``gate="all"``) with integrity ``"off"`` and ``"page"``. Per page it reports
the caller's host time of the call and the whole call's time, the per-page cost that
small pages (page_size 1) pay more often than large ones.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

from kvxfer._text import format_bytes
from kvxfer.bench._config import BenchConfig
from kvxfer.bench._rig import Rig
from kvxfer.bench.limits import limit_figures, make_limit
from kvxfer.bench.timing import Progress, interleaved, stats

__all__ = ["model_section", "model_page_bytes", "MODEL_METHODS"]

#: The kvxfer variants each model row times.
MODEL_METHODS = ("offload_off", "offload_page", "load_off_all", "load_page_all")


def model_page_bytes(spec: Any) -> int:
    """Bytes of one page of ``spec``: its block of every layer (what one host slot holds)."""
    return sum(g.logical_block_bytes * g.count for g in spec.groups)


def _pages(cfg: BenchConfig, spec: Any) -> int:
    return max(1, cfg.batch_bytes // model_page_bytes(spec))


def model_section(cfg: BenchConfig, names: Sequence[str], progress: Progress
                  ) -> list[dict[str, Any]]:
    """One row per config of ``names`` (see the module docstring).

    Raises:
      ConfigError: a name that is neither a built-in config nor a readable file (before
        anything is measured).
    """
    from kvxfer import config as _config

    specs = [_config.load(n) for n in names]  # every name checked before any timing
    if not specs:
        return []
    capacity = max(_pages(cfg, s) * model_page_bytes(s) for s in specs)
    rows = []
    with make_limit(capacity) as limit:
        for spec in specs:
            rows.append(_model_row(cfg, spec, limit, progress))
            gc.collect()
    return rows


def _model_row(cfg: BenchConfig, spec: Any, limit: Any, progress: Progress
               ) -> dict[str, Any]:
    pages = _pages(cfg, spec)
    page_bytes = model_page_bytes(spec)
    nbytes = pages * page_bytes
    groups = [{"name": g.name, "count": g.count, "block_shape": list(g.block_shape),
               "dtype": g.dtype, "block_bytes": g.logical_block_bytes} for g in spec.groups]
    progress.step("model", f"model {spec.name}: {pages} page{'s' if pages != 1 else ''} of "
                  f"{format_bytes(page_bytes)} ({spec.num_layers} layers) = "
                  f"{format_bytes(nbytes)} per call")
    rig = Rig(spec.build_caches(num_blocks=pages), num_host_blocks=2 * pages)
    try:
        ids = list(range(pages))
        held = {integ: rig.hold(integ, ids) for integ in ("off", "page")}  # compiles
        for integ in ("off", "page"):
            rig.load(integ, held[integ], ids, "all")
        runners = limit.runners(nbytes)
        variants: dict[str, Any] = dict(runners)
        for integ in ("off", "page"):
            variants[f"offload_{integ}"] = lambda integ=integ: rig.offload(integ, ids)
            variants[f"load_{integ}_all"] = (
                lambda integ=integ: rig.load(integ, held[integ], ids, "all"))
        t = interleaved(variants, cfg.repeats)
        lim = limit_figures({k: t[k] for k in runners}, nbytes)
        methods: dict[str, Any] = {}
        for name in MODEL_METHODS:
            s = stats(t[name]["s"], nbytes)
            direction = "d2h" if name.startswith("offload") else "h2d"
            s["direction"] = direction
            s["fraction_of_limit"] = s["gbps"] / lim[direction]["gbps"]
            call = stats(t[name]["call_s"])
            s["call_p50_s"] = call["p50_s"]
            s["us_per_page"] = s["best_s"] / pages * 1e6
            s["call_us_per_page"] = call["best_s"] / pages * 1e6
            methods[name] = s
        return {"config": spec.name, "description": spec.description,
                "tokens_per_page": spec.block_size, "layers": spec.num_layers,
                "groups": groups, "page_bytes": page_bytes, "pages": pages, "bytes": nbytes,
                "paths": sorted(set(rig.mgr("page").paths)), "limit": lim,
                "methods": methods}
    finally:
        rig.close()
