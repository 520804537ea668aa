r"""d2h / h2d bandwidth of kvxfer by block size and batch size, against the physical limit.

For every block size (``--block_sizes``, KiB) it builds ``--num_layers`` caches of
``[num_blocks, rows, 128]`` elements (one block = that many KiB) and, for each path
(``staged``; ``direct`` where the backend has one), times ``offload`` (d2h: until
the pages are on the host) and ``load`` (h2d: until the caches are written) of
``--batch_sizes`` random blocks, integrity off. Every number is a median over
``--iters`` runs after ``--warmup`` runs (which compile the programs).

The physical limit is measured in the same run:

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
from kvxfer.layout import dtype_of  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("block_sizes", ["16", "64", "256", "1024"], "block sizes in KiB")
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "blocks moved per offload / load")
flags.DEFINE_list("paths", ["staged", "direct"], "paths to measure (direct is skipped, "
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


def _median_time(fn: Callable[[], Any], iters: int, min_seconds: float = 0.0) -> float:
    """Median seconds of ``fn()``; repeats inside a sample until ``min_seconds``."""
    samples = []
    for _ in range(iters):
        reps, t0 = 0, time.perf_counter()
        while True:
            fn()
            reps += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_seconds:
                break
        samples.append(elapsed / reps)
    return statistics.median(samples)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


# ---------------------------------------------------------------------------
# Physical limits
# ---------------------------------------------------------------------------


def memcpy_seconds(nbytes: int, iters: int) -> float:
    """Median seconds of a numpy memcpy of ``nbytes`` (buffers touched first)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    return _median_time(lambda: np.copyto(dst, src), iters, min_seconds=2e-3)


def jax_host_link(nbytes: int, iters: int) -> dict[str, Any]:
    """d2h / h2d of one buffer with ``jax.device_put`` between device and host memory."""
    dev = common.device()
    kinds = [m.kind for m in dev.addressable_memories()]
    x = jax.device_put(np.ones(nbytes, np.uint8), dev).block_until_ready()
    host_kind = next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)
    if host_kind is not None:
        host_s = jax.sharding.SingleDeviceSharding(dev, memory_kind=host_kind)
        dev_s = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        h = jax.device_put(x, host_s).block_until_ready()
        d2h = _median_time(lambda: jax.device_put(x, host_s).block_until_ready(), iters)
        h2d = _median_time(lambda: jax.device_put(h, dev_s).block_until_ready(), iters)
        how = f"jax.device_put to/from {host_kind}"
    else:
        host = np.asarray(x)
        d2h = _median_time(lambda: np.asarray(jax.device_put(x, dev)).copy(), iters)
        h2d = _median_time(lambda: jax.device_put(host, dev).block_until_ready(), iters)
        how = "np.asarray / jax.device_put (no host memory kinds offered)"
    return {"how": how, "bytes": nbytes, "d2h_gbps": _gbps(nbytes, d2h),
            "h2d_gbps": _gbps(nbytes, h2d)}


def torch_link(nbytes: int, iters: int) -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    devb = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def h2d():
        devb.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    def d2h():
        host.copy_(devb, non_blocking=True)
        torch.cuda.synchronize()

    h2d()
    d2h()
    return {"how": "torch pinned copies", "bytes": nbytes,
            "d2h_gbps": _gbps(nbytes, _median_time(d2h, iters)),
            "h2d_gbps": _gbps(nbytes, _median_time(h2d, iters))}


def cupy_link(nbytes: int, iters: int) -> dict[str, Any] | None:
    try:
        import cupy
    except ImportError:
        return None
    try:
        mem = cupy.cuda.alloc_pinned_memory(nbytes)
        host = np.frombuffer(mem, np.uint8, nbytes)
        devb = cupy.empty(nbytes, cupy.uint8)
        stream = cupy.cuda.Stream(non_blocking=True)

        def h2d():
            devb.set(host, stream=stream)
            stream.synchronize()

        def d2h():
            devb.get(out=host, stream=stream)
            stream.synchronize()

        h2d()
        d2h()
        return {"how": "cupy pinned copies", "bytes": nbytes,
                "d2h_gbps": _gbps(nbytes, _median_time(d2h, iters)),
                "h2d_gbps": _gbps(nbytes, _median_time(h2d, iters))}
    except Exception as e:  # noqa: BLE001 - an optional extra measurement
        logging.warning("cupy measurement failed: %s", e)
        return None


def measure_limits(nbytes: int, iters: int) -> dict[str, Any]:
    """The large-buffer link limit per direction (best of what this backend offers)."""
    dev = common.device()
    found = []
    if dev.platform == "cpu":
        s = memcpy_seconds(nbytes, iters)
        found.append({"how": "numpy memcpy", "bytes": nbytes, "d2h_gbps": _gbps(nbytes, s),
                      "h2d_gbps": _gbps(nbytes, s)})
    try:
        found.append(jax_host_link(nbytes, iters))
    except Exception as e:  # noqa: BLE001 - report and use what else there is
        logging.warning("jax host-link measurement failed: %s", e)
    if dev.platform == "gpu":
        for fn in (torch_link, cupy_link):
            try:
                r = fn(nbytes, iters)
            except Exception as e:  # noqa: BLE001
                logging.warning("%s failed: %s", fn.__name__, e)
                r = None
            if r is not None:
                found.append(r)
    if not found:
        nan = float("nan")
        d2h, h2d, how_d2h, how_h2d = nan, nan, "not measured", "not measured"
    elif dev.platform == "cpu":
        best = found[0]  # the CPU's limit is memcpy (DESIGN.md), whatever jax reaches
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


def block_shape(block_bytes: int, dtype: Any) -> tuple[int, ...]:
    item = dtype_of(dtype).itemsize
    if block_bytes % item:
        raise ValueError(f"a {block_bytes}-byte block is not a whole number of "
                         f"{dtype_of(dtype).name} elements")
    elems = block_bytes // item
    return (elems // 128, 128) if elems % 128 == 0 else (elems,)


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
    limits = measure_limits(limit_mib << 20, iters)
    logging.info("limit: d2h %.2f GB/s (%s), h2d %.2f GB/s (%s)", limits["d2h_gbps"],
                 limits["d2h_how"], limits["h2d_gbps"], limits["h2d_how"])
    results, unavailable, failures = [], {}, []
    for kib in block_kib:
        shape = (n, *block_shape(kib << 10, dtype))
        caches = [jax.device_put(common.random_array(shape, dtype, seed + i), dev)
                  for i in range(num_layers)]
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
                    if dev.platform == "cpu":
                        s = memcpy_seconds(nbytes, iters)
                        lim_d2h = lim_h2d = _gbps(nbytes, s)
                        lim_how = "numpy memcpy of the same bytes"
                    else:
                        lim_d2h, lim_h2d = limits["d2h_gbps"], limits["h2d_gbps"]
                        lim_how = f"large-buffer limit ({limit_mib} MiB)"
                    row = {"block_kib": kib, "batch": batch, "path": path, "movers": movers,
                           "layers": num_layers, "bytes": nbytes, "d2h_s": d2h, "h2d_s": h2d,
                           "d2h_gbps": _gbps(nbytes, d2h), "h2d_gbps": _gbps(nbytes, h2d),
                           "limit_d2h_gbps": lim_d2h, "limit_h2d_gbps": lim_h2d,
                           "limit_how": lim_how}
                    row["d2h_fraction"] = row["d2h_gbps"] / lim_d2h
                    row["h2d_fraction"] = row["h2d_gbps"] / lim_h2d
                    row["d2h_fraction_of_link"] = row["d2h_gbps"] / limits["d2h_gbps"]
                    row["h2d_fraction_of_link"] = row["h2d_gbps"] / limits["h2d_gbps"]
                    logging.info("%s %d KiB x %d: d2h %.3f GB/s, h2d %.3f GB/s", path, kib,
                                 batch, row["d2h_gbps"], row["h2d_gbps"])
                    results.append(row)
        del caches
    return {"provenance": common.provenance(), "backend": dev.platform,
            "device_kind": getattr(dev, "device_kind", ""), "dtype": dtype_of(dtype).name,
            "num_layers": num_layers, "num_blocks": n, "iters": iters, "warmup": warmup,
            "integrity": integrity, "limits": limits, "results": results,
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
        if not paths or any(p not in ("staged", "direct", "auto") for p in paths):
            raise ValueError(f"--paths {','.join(paths)}: choose from staged, direct, auto")
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
    if FLAGS.json:
        print(common.dumps(report, indent=None))
    else:
        print_table(report)
    bad = report["failures"] or not report["results"] or any(
        not (math.isfinite(r["d2h_gbps"]) and math.isfinite(r["h2d_gbps"]))
        for r in report["results"])
    return 1 if bad else 0


if __name__ == "__main__":
    app.run(main, flags_parser=common.parse_flags)
