r"""d2h / h2d bandwidth of kvxfer by block size and batch size, against the physical limit.

For every block size (``--block_sizes``, KiB) it builds ``--num_layers`` caches of
``[num_blocks, rows, 128]`` elements (one block = that many KiB) and, for each path
(``staged``; ``raw`` where the backend has one), times ``offload`` (d2h: until
the pages are on the host) and ``load`` (h2d: until the caches are written) of
``--batch_sizes`` pages (a page: the block at one index of every layer) at random
block indices, integrity off. Every number is a median over
``--iters`` runs after ``--warmup`` runs (which compile the programs).

The physical limit is measured in the same run, with ``kvxfer.bench.limits``:

* CPU: a numpy memcpy of the same bytes (per cell), and of one ``--limit_mib``
  buffer;
* GPU / TPU: ``jax.device_put`` of one ``--limit_mib`` buffer to ``pinned_host``
  memory and back (``unpinned_host`` / ``np.asarray`` when pinned memory is not
  offered), plus torch or cupy pinned copies on GPU when either is importable;
  the best of them is the limit.

Usage (from the repository root):

    python tpu_probes/bandwidth_probe.py
    python tpu_probes/bandwidth_probe.py --block_sizes 64,1024 --batch_sizes 32 --json

Exit status: 0 when every measurement ran, 1 when one failed, 2 on bad flags or
arguments.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from absl import app, flags, logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402  (also makes kvxfer importable)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kvxfer  # noqa: E402
from kvxfer import testing  # noqa: E402
from kvxfer.bench import limits, timing  # noqa: E402
from kvxfer.layout import dtype_of  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("block_sizes", ["16", "64", "256", "1024"], "block sizes in KiB")
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "blocks moved per offload / load")
flags.DEFINE_list("paths", ["staged", "raw"], "paths to measure (raw is skipped, "
                  "saying why, where the backend has none)")
flags.DEFINE_integer("num_layers", 4, "caches (layers) moved together", lower_bound=1)
flags.DEFINE_integer("num_blocks", 0, "blocks per cache (0: twice the largest batch, at "
                     "least 16)", lower_bound=0)
flags.DEFINE_string("dtype", "bfloat16", "cache dtype")
flags.DEFINE_integer("iters", 5, "timed runs per cell (the median is reported)", lower_bound=1)
flags.DEFINE_integer("warmup", 1, "untimed runs per cell (compilation)", lower_bound=0)
flags.DEFINE_integer("limit_mib", 256, "buffer size of the large-copy limit measurement",
                     lower_bound=1)
flags.DEFINE_enum("integrity", "off", ["off", "page"], "page digests (off: measure the move)")
flags.DEFINE_integer("seed", 0, "random seed")
flags.DEFINE_bool("json", False, "print one JSON object instead of the table")


# ---------------------------------------------------------------------------
# Physical limits
# ---------------------------------------------------------------------------


def _median(fn: Callable[[], float], iters: int, min_seconds: float = 0.0) -> float:
    """Median seconds of a copy (after one untimed run); see ``timing.sample``."""
    fn()
    return timing.stats(timing.sample(fn, iters, min_seconds=min_seconds))["p50_s"]


def link(limit: limits.Limit, nbytes: int, iters: int) -> dict[str, Any]:
    """d2h / h2d GB/s of one limit's copies of ``nbytes`` (a memcpy counts for both)."""
    runners = limit.runners(nbytes)
    if "memcpy" in runners:  # repeated within a sample: small copies take microseconds
        d2h = h2d = _median(runners["memcpy"], iters, min_seconds=2e-3)
    else:
        d2h, h2d = _median(runners["d2h"], iters), _median(runners["h2d"], iters)
    return {"how": limit.label, "bytes": nbytes, "d2h_gbps": timing.gbps(nbytes, d2h),
            "h2d_gbps": timing.gbps(nbytes, h2d)}


def measure_limits(nbytes: int, iters: int) -> dict[str, Any]:
    """The large-buffer link limit per direction (best of what this backend offers)."""
    dev = common.device()
    found = []
    kinds: list[type[limits.Limit]] = [limits.JaxHostCopy]
    if dev.platform == "cpu":
        kinds.insert(0, limits.Memcpy)
    elif dev.platform == "gpu":
        kinds += [limits.TorchCopy, limits.CupyCopy]
    for kind in kinds:
        try:
            with kind(nbytes) as limit:
                found.append(link(limit, nbytes, iters))
        except ImportError:  # torch or cupy is not installed: nothing to compare
            continue
        except Exception as e:  # noqa: BLE001 - report and use what else there is
            logging.warning("%s measurement failed: %s: %s", kind.__name__,
                            type(e).__name__, e)
    if not found:
        nan = float("nan")
        d2h, h2d, how_d2h, how_h2d = nan, nan, "not measured", "not measured"
    elif dev.platform == "cpu":
        best = found[0]  # the CPU's limit is memcpy, whatever jax's host copies reach
        d2h, h2d = best["d2h_gbps"], best["h2d_gbps"]
        how_d2h = how_h2d = best["how"]
    else:
        bd = max(found, key=lambda r: r["d2h_gbps"])
        bh = max(found, key=lambda r: r["h2d_gbps"])
        d2h, h2d, how_d2h, how_h2d = bd["d2h_gbps"], bh["h2d_gbps"], bd["how"], bh["how"]
    return {"measurements": found, "d2h_gbps": d2h, "h2d_gbps": h2d,
            "d2h_how": how_d2h, "h2d_how": how_h2d, "bytes": nbytes}


# ---------------------------------------------------------------------------
# kvxfer transfers
# ---------------------------------------------------------------------------


def measure_cell(mgr: kvxfer.KVCacheManager, caches: list[jax.Array], batch: int,
                 iters: int, warmup: int, rng: np.random.Generator
                 ) -> tuple[list[jax.Array], float, float]:
    """Median offload and load seconds of ``batch`` random blocks."""
    n = caches[0].shape[0]
    d2h, h2d = [], []
    for i in range(warmup + iters):
        src = rng.permutation(n)[:batch]
        dst = rng.permutation(n)[:batch]
        keys = [int(k) for k in rng.integers(0, 2**63, batch)]
        for c in caches:
            c.block_until_ready()
        t0 = time.perf_counter()
        pages = mgr.offload(caches, src, keys).wait()
        t1 = time.perf_counter()
        caches, handle = mgr.load(caches, pages, dst)
        result = handle.result()
        for c in caches:
            c.block_until_ready()
        t2 = time.perf_counter()
        if result.verified_prefix != batch:
            raise RuntimeError(f"load verified {result.verified_prefix} of {batch} pages: "
                               f"{result.reasons}")
        mgr.free(pages)
        if i >= warmup:
            d2h.append(t1 - t0)
            h2d.append(t2 - t1)
    return caches, statistics.median(d2h), statistics.median(h2d)


def run(block_kib: list[int], batches: list[int], paths: list[str], *, num_layers: int,
        num_blocks: int, dtype: str, iters: int, warmup: int, limit_mib: int,
        integrity: str, seed: int) -> dict[str, Any]:
    dev = common.device()
    rng = np.random.default_rng(seed)
    n = num_blocks or max(16, 2 * max(batches))
    if n < max(batches):
        raise ValueError(f"--num_blocks {n} is smaller than the largest batch {max(batches)}")
    link_limit = measure_limits(limit_mib << 20, iters)
    logging.info("limit: d2h %.2f GB/s (%s), h2d %.2f GB/s (%s)", link_limit["d2h_gbps"],
                 link_limit["d2h_how"], link_limit["h2d_gbps"], link_limit["h2d_how"])
    # On CPU every cell is also measured against a memcpy of its own bytes.
    memcpy = limits.Memcpy(max(batches) * num_layers * (max(block_kib) << 10)) \
        if dev.platform == "cpu" else None
    results, unavailable, failures = [], {}, []
    for kib in block_kib:
        caches = testing.random_caches(num_layers, n, testing.block_shape(kib << 10, dtype),
                                       dtype, seed=seed)
        for path in paths:
            if path in unavailable:
                continue
            try:
                mgr = kvxfer.KVCacheManager(caches, num_host_blocks=max(batches),
                                            integrity=integrity, path=path)
            except kvxfer.LayoutError as e:
                unavailable[path] = (f"this backend has no {path} path" if dev.platform != "cpu"
                                     else f"refused: {e}")
                logging.warning("%s path unavailable: %s", path, e)
                continue
            with mgr:
                movers = sorted(set(mgr.paths))
                for batch in batches:
                    nbytes = batch * num_layers * (kib << 10)
                    try:
                        caches, d2h, h2d = measure_cell(mgr, caches, batch, iters, warmup, rng)
                    except Exception as e:  # noqa: BLE001 - record and go on
                        msg = f"{path} {kib} KiB x {batch}: {type(e).__name__}: {e}"
                        logging.error("%s", msg)
                        failures.append(msg)
                        continue
                    if memcpy is not None:
                        cell = link(memcpy, nbytes, iters)
                        lim_d2h, lim_h2d = cell["d2h_gbps"], cell["h2d_gbps"]
                        lim_how = "numpy memcpy of the same bytes"
                    else:
                        lim_d2h, lim_h2d = link_limit["d2h_gbps"], link_limit["h2d_gbps"]
                        lim_how = f"large-buffer limit ({limit_mib} MiB)"
                    row = {"block_kib": kib, "batch": batch, "path": path, "movers": movers,
                           "layers": num_layers, "bytes": nbytes, "d2h_s": d2h, "h2d_s": h2d,
                           "d2h_gbps": timing.gbps(nbytes, d2h),
                           "h2d_gbps": timing.gbps(nbytes, h2d),
                           "limit_d2h_gbps": lim_d2h, "limit_h2d_gbps": lim_h2d,
                           "limit_how": lim_how}
                    row["d2h_fraction"] = row["d2h_gbps"] / lim_d2h
                    row["h2d_fraction"] = row["h2d_gbps"] / lim_h2d
                    row["d2h_fraction_of_link"] = row["d2h_gbps"] / link_limit["d2h_gbps"]
                    row["h2d_fraction_of_link"] = row["h2d_gbps"] / link_limit["h2d_gbps"]
                    logging.info("%s %d KiB x %d: d2h %.3f GB/s, h2d %.3f GB/s", path, kib,
                                 batch, row["d2h_gbps"], row["h2d_gbps"])
                    results.append(row)
        del caches
    return {"provenance": common.provenance(), "backend": dev.platform,
            "device_kind": getattr(dev, "device_kind", ""), "dtype": dtype_of(dtype).name,
            "num_layers": num_layers, "num_blocks": n, "iters": iters, "warmup": warmup,
            "integrity": integrity, "limits": link_limit, "results": results,
            "unavailable": unavailable, "failures": failures}


def print_table(report: dict[str, Any]) -> None:
    lim = report["limits"]
    print(f"{report['backend']} ({report['device_kind']}), {report['num_layers']} layers of "
          f"{report['dtype']}, integrity {report['integrity']}, median of {report['iters']}")
    print(f"link limit ({common.format_bytes(lim['bytes'])} buffer): d2h "
          f"{lim['d2h_gbps']:.2f} GB/s ({lim['d2h_how']}), h2d {lim['h2d_gbps']:.2f} GB/s "
          f"({lim['h2d_how']})")
    for m in lim["measurements"]:
        print(f"  {m['how']}: d2h {m['d2h_gbps']:.2f} GB/s, h2d {m['h2d_gbps']:.2f} GB/s")
    rows = [[r["block_kib"], r["batch"], r["path"], common.format_bytes(r["bytes"]),
             f"{r['d2h_gbps']:.3f}", f"{r['d2h_fraction']:.1%}", f"{r['h2d_gbps']:.3f}",
             f"{r['h2d_fraction']:.1%}", f"{r['limit_d2h_gbps']:.2f}"]
            for r in report["results"]]
    print(common.table(rows, ["block KiB", "batch", "path", "bytes/op", "d2h GB/s",
                              "d2h of limit", "h2d GB/s", "h2d of limit", "limit GB/s"]))
    if report["results"]:
        print(f"limit per row: {report['results'][0]['limit_how']}")
    for path, why in report["unavailable"].items():
        print(f"{path}: not measured: {why}")
    for f in report["failures"]:
        print(f"FAILED: {f}")


def main(argv: list[str]) -> int:
    del argv  # flags only: common.parse_flags refuses other arguments
    try:
        kib = [int(s) for s in FLAGS.block_sizes]
        batches = [int(s) for s in FLAGS.batch_sizes]
        if not kib or not batches or min(kib + batches) < 1:
            raise ValueError("sizes must be positive integers")
        paths = [p.strip() for p in FLAGS.paths]
        if not paths or any(p not in ("staged", "raw", "auto") for p in paths):
            raise ValueError(f"--paths {','.join(paths)}: choose from staged, raw, auto")
        dtype_of(FLAGS.dtype)
    except (ValueError, kvxfer.LayoutError) as e:
        print(f"bandwidth_probe: {e}", file=sys.stderr)
        return 2
    try:
        report = run(kib, batches, paths, num_layers=FLAGS.num_layers,
                     num_blocks=FLAGS.num_blocks, dtype=FLAGS.dtype, iters=FLAGS.iters,
                     warmup=FLAGS.warmup, limit_mib=FLAGS.limit_mib,
                     integrity=FLAGS.integrity, seed=FLAGS.seed)
    except ValueError as e:
        print(f"bandwidth_probe: {e}", file=sys.stderr)
        return 2
    common.show(report, FLAGS.json, print_table)
    bad = report["failures"] or not report["results"] or any(
        not (math.isfinite(r["d2h_gbps"]) and math.isfinite(r["h2d_gbps"]))
        for r in report["results"])
    return 1 if bad else 0


if __name__ == "__main__":
    app.run(main, flags_parser=common.parse_flags)
