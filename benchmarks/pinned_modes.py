"""The pinned mover's two ways to reach its pool, side by side on this backend.

``KVXFER_PINNED_MODE=in-place`` (the pool donated to the offload program and written by
dynamic-update-slices; loads read the pool inside their program) and ``copy`` (pages
gathered into pinned buffers of their own, one host copy into or out of the pool).
``kvxfer.engine._pinned.IN_PLACE_PLATFORMS`` names the backends that use the first; this
script is what decides a backend's entry: for each mode it checks one round trip of
random bits (NaN payloads included) byte for byte, then times offload and load
(``path="pinned"``, integrity off and page, gate all) against the machine's limit
(``kvxfer.bench.limits.make_limit``), variants interleaved, best of the repeats.
A mode that fails is reported with its error; the other still runs.

Usage:  python benchmarks/pinned_modes.py [--sizes-mib 8,256] [--repeats 3] > out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import numpy as np

import kvxfer
from kvxfer import testing
from kvxfer.bench.limits import limit_figures, make_limit
from kvxfer.bench.timing import interleaved, stats
from kvxfer.engine._pinned import pinned_mode

LAYERS, BLOCK_BYTES, DTYPE = 32, 64 << 10, "bfloat16"


def _check_round_trip() -> dict:
    caches = testing.random_caches(4, 16, (64, 128), DTYPE, seed=1)
    before = [testing.bits(c) for c in caches]
    with kvxfer.KVCacheManager(caches, num_host_blocks=8, path="pinned") as mgr:
        src, dst = [3, 9, 0, 14], [7, 1, 12, 5]
        pages = mgr.offload(caches, src, keys=[1, 2, 3, 4]).wait()
        new, load = mgr.load(caches, pages, dst, gate="layer")
        result = load.result()
        exact = all(np.array_equal(testing.bits(a)[dst], b[src]) for a, b in zip(new, before))
        return {"verified_prefix": result.verified_prefix, "byte_exact": bool(exact),
                "paths": sorted(set(mgr.paths))}


def _time_mode(sizes: list[int], repeats: int, limit) -> list[dict]:
    rows = []
    for nbytes in sizes:
        pages = nbytes // (LAYERS * BLOCK_BYTES)
        caches = testing.random_caches(LAYERS, pages, testing.block_shape(BLOCK_BYTES, DTYPE),
                                       DTYPE, seed=2)
        ids = list(range(pages))
        mgrs = {i: kvxfer.KVCacheManager(caches, num_host_blocks=2 * pages, integrity=i,
                                         path="pinned") for i in ("off", "page")}
        held = {i: m.offload(caches, ids, keys=ids).wait() for i, m in mgrs.items()}
        state = {"caches": caches, "key": 10 ** 6}

        def offload(i):
            state["key"] += pages
            t0 = time.perf_counter()
            got = mgrs[i].offload(state["caches"], ids,
                                  keys=list(range(state["key"], state["key"] + pages))).wait()
            t = time.perf_counter() - t0
            mgrs[i].free(got)
            return t

        def load(i):
            t0 = time.perf_counter()
            state["caches"], handle = mgrs[i].load(state["caches"], held[i], ids, gate="all")
            result = handle.result()
            t = time.perf_counter() - t0
            assert result.verified_prefix == pages, result.reasons
            return t

        variants = dict(limit.runners(nbytes))
        for i in ("off", "page"):
            variants[f"offload_{i}"] = lambda i=i: offload(i)
            variants[f"load_{i}"] = lambda i=i: load(i)
        t = interleaved(variants, repeats)
        lim = limit_figures({k: t[k] for k in limit.runners(nbytes)}, nbytes)
        row = {"bytes": nbytes, "pages": pages, "layers": LAYERS, "block_bytes": BLOCK_BYTES,
               "dtype": DTYPE, "limit_gbps": {d: lim[d]["gbps"] for d in ("d2h", "h2d")}}
        for name in ("offload_off", "offload_page", "load_off", "load_page"):
            s = stats(t[name]["s"], nbytes)
            direction = "d2h" if name.startswith("offload") else "h2d"
            row[name] = {"gbps": s["gbps"], "fraction_of_limit":
                         s["gbps"] / lim[direction]["gbps"], "first_s": t[name]["warmup_s"][0]}
        rows.append(row)
        for m in mgrs.values():
            m.close()
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="8,256")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    sizes = [int(x) << 20 for x in args.sizes_mib.split(",")]
    platform = jax.devices()[0].platform
    report = {"platform": platform, "device": str(jax.devices()[0].device_kind),
              "jax": jax.__version__, "default_mode": pinned_mode(platform), "modes": {}}
    with make_limit(max(sizes)) as limit:
        report["limit_method"] = limit.method
        for mode in ("copy", "in-place"):
            os.environ["KVXFER_PINNED_MODE"] = mode
            out = report["modes"][mode] = {}
            try:
                out["round_trip"] = _check_round_trip()
                out["sizes"] = _time_mode(sizes, args.repeats, limit)
            except Exception as e:  # noqa: BLE001 - reported, and the other mode still runs
                out["error"] = f"{type(e).__name__}: {e}"
                out["traceback"] = traceback.format_exc(limit=8)
            print(f"pinned_modes: {mode} done", file=sys.stderr, flush=True)
    del os.environ["KVXFER_PINNED_MODE"]
    print(json.dumps(report, indent=1))
    ok = all("error" not in m and m["round_trip"]["byte_exact"] for m in report["modes"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
