"""The DMA mover's copy engine by bytes per copy: one copy per block, blocks scattered.

Copy engines move large copies at the link and small ones at a fraction of it (vLLM
measured 5-7 GB/s below about 28 KiB per copy on an H100). This section moves
``copy_bytes`` per call as blocks of each of ``copy_sizes`` bytes of one layer, in a
random block order (so no two copies merge), with ``path="dma"``, the device-side
relayout off and every copy on XLA's stream, against the limit in the same run: what
one copy of each size costs, which is what decides ``_dma.RELAYOUT_BELOW``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvxfer._text import format_bytes
from kvxfer.bench._config import BenchConfig
from kvxfer.bench._rig import check_loaded, make_caches
from kvxfer.bench.limits import Limit, limit_figures
from kvxfer.bench.timing import Progress, interleaved, now, stats
from kvxfer.engine import DmaOptions, dma_refusal
from kvxfer.manager import KVCacheManager

__all__ = ["copy_size_section"]


def copy_size_section(cfg: BenchConfig, limit: Limit, progress: Progress
                      ) -> tuple[list[dict[str, Any]], str | None]:
    """One row per copy size; or no rows and why (no copy engine on this backend)."""
    rows: list[dict[str, Any]] = []
    for size in cfg.copy_sizes:
        n = max(1, cfg.copy_bytes // size)
        progress.step("copy sizes", f"copy sizes: {n} copies of {format_bytes(size)}, "
                      "path=dma, scattered")
        caches = make_caches(1, n, size, "bfloat16")
        why = dma_refusal(caches[0])
        if why is not None:
            return [], f"copy sizes: the DMA mover cannot run here: {why}"
        rows.append(_row(cfg, limit, caches, n, size))
    return rows, None


def _row(cfg: BenchConfig, limit: Limit, caches: list, n: int, size: int) -> dict[str, Any]:
    nbytes = n * size
    order = np.random.default_rng(n).permutation(n).tolist()
    # Twice the slots: the loads' pages stay held while offloads take the others.
    # Copies of the blocks as they lie: no relayout, and none for offloads beside XLA's
    # stream either (those copy gathered rows).
    mgr = KVCacheManager(caches, num_host_blocks=2 * n, path="dma", integrity="off",
                         dma=DmaOptions(relayout="never", stream="xla"))
    box = {"caches": caches, "key": n}
    try:
        held = mgr.offload(caches, order, keys=list(range(n))).wait()

        def offload() -> float:
            keys = list(range(box["key"], box["key"] + n))
            box["key"] += n
            t0 = now()
            pages = mgr.offload(box["caches"], order, keys=keys).wait()
            t = now() - t0
            mgr.free(pages)
            return t

        def load() -> float:
            t0 = now()
            box["caches"], handle = mgr.load(box["caches"], held, order)
            result = handle.result()
            t = now() - t0
            check_loaded(result, n)
            return t

        runners = limit.runners(nbytes)
        t = interleaved({**runners, "offload": offload, "load": load}, cfg.repeats)
        lim = limit_figures({k: t[k] for k in runners}, nbytes)
        methods = {}
        for name, direction in (("offload", "d2h"), ("load", "h2d")):
            s = stats(t[name]["s"], nbytes)
            s["fraction_of_limit"] = s["gbps"] / lim[direction]["gbps"]
            methods[name] = s
        return {"copy_bytes": size, "copies": n, "bytes": nbytes, "limit": lim,
                "methods": methods}
    finally:
        mgr.close()
