r"""Which route ``path="auto"`` should take on this machine: the pinned mover in place,
or its pages route, against ``device_put`` of the same bytes.

On every local device (``--devices``, default all) it builds the caches of
``--config`` on that device alone and, for each route of the pinned mover:

* **in place** (``path="pinned"``, the route auto takes on TPU): the class's pool is
  one slot-major ``pinned_host`` array that each transfer donates; the probe checks
  that the pool's buffer is the same after every transfer (the runtime aliased it:
  no whole-pool copy), that nothing was copied on the host (``host_copy_bytes``), that
  the host reads an offloaded page's bytes where the DMA wrote them
  (``read_block_bytes``), and that the first round trip is bit-exact;
* **pages** (each page an array of pinned memory of its own, what auto takes where
  the in-place route is refused): the same round trips;
* **device_put**: the same bytes (``--pages`` pages of every layer) moved to the
  device's ``pinned_host`` memory and back by plain ``jax.device_put``: the link as
  JAX reaches it without kvxfer.

Each is measured per chip (one device at a time) and per host (every device at once,
one thread each: GB/s of all the bytes over the wall time). Offload and load GB/s
count the pages' bytes, medians of ``--iters`` runs after ``--warmup`` (and after
``mgr.warmup``). The verdict says which route auto should take: in place where it is
aliased, bit-exact, copies nothing on the host and moves at least ``--margin`` times
the pages route's bytes per second, else the pages route. ``--out`` writes the report
as JSON; kvxfer reads nothing from it (auto's rule is in ``kvxfer.manager.AUTO_RULES``).

Usage (from the repository root):

    python tpu_probes/inplace_probe.py --out inplace.json
    python tpu_probes/inplace_probe.py --platform cpu --config tiny --pages 2  # quick

Exit status: 0 when every route that ran was exact, 1 otherwise, 2 on bad flags.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from absl import app, flags, logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402  (also makes kvxfer importable)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kvxfer  # noqa: E402
from kvxfer import testing  # noqa: E402
from kvxfer.bench import timing  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "llama3-8b", "model config: a built-in name or a TOML file")
flags.DEFINE_integer("pages", 16, "pages (blocks of every layer) per transfer", lower_bound=1)
flags.DEFINE_integer("num_blocks", 0, "blocks per cache (0: the config's, at least twice "
                     "--pages)", lower_bound=0)
flags.DEFINE_integer("devices", 0, "devices to measure (0: every local device)",
                     lower_bound=0)
flags.DEFINE_integer("iters", 3, "timed runs (the median is reported)", lower_bound=1)
flags.DEFINE_integer("warmup", 1, "untimed runs before them", lower_bound=0)
flags.DEFINE_float("margin", 0.9, "in place is preferred unless it moves less than this "
                   "share of the pages route's GB/s", lower_bound=0.0)
flags.DEFINE_string("platform", "", "JAX platform to run on (cpu, tpu; default: JAX's)")
flags.DEFINE_string("out", "", "write the report here as JSON")
flags.DEFINE_integer("seed", 0, "random seed")
flags.DEFINE_bool("json", False, "print one JSON object instead of the tables")

ROUTES = ("in-place", "pages")


def _pool_buffers(mgr: kvxfer.KVCacheManager) -> list[int | None]:
    """The address of each class pool's buffer (None for a pool of page arrays)."""
    out = []
    for pool in mgr.host_pool.pools:
        array = getattr(pool.pages, "array", None) if pool.pages is not None else pool.array
        out.append(None if array is None else array.unsafe_buffer_pointer())
    return out


def host_view_checked(mgr: kvxfer.KVCacheManager, caches: list[jax.Array]) -> None:
    """One page offloaded and read back on the host through the pool's own bytes
    (``read_block_bytes``: what stores and exports read) must be the device's block.

    Raises:
      RuntimeError: a layer's host bytes differ (the host does not see what the DMA
        wrote where it looks).
    """
    refs = mgr.offload(caches, [0], keys=[0]).wait()
    try:
        for i, c in enumerate(caches):
            if mgr.read_block_bytes(refs[0], i) != testing.bits(c)[0].tobytes():
                raise RuntimeError(f"layer {i}: the host's view of the pool differs from "
                                   "the device block offloaded into it")
    finally:
        mgr.free(refs)


def manager_run(route: str, caches: dict[Any, list[jax.Array]], device: Any, pages: int,
                iters: int, warmup: int, seed: int) -> dict[str, Any]:
    """One route on ``device``'s caches (``caches[device]``, replaced by the loaded ones):
    its movers, aliasing, host copies, GB/s."""
    mgr = kvxfer.KVCacheManager(caches[device], num_host_blocks=pages, path="pinned",
                                pinned_route=route)
    with mgr:
        reasons = sorted({p.reason for p in mgr.paths})
        if route == "in-place" and not all(r.endswith("in place") for r in reasons):
            return {"status": "refused", "reason": "; ".join(reasons)}
        nbytes = pages * sum(c.page_bytes for c in mgr.plan.classes)
        mgr.warmup(pages)
        before = _pool_buffers(mgr)
        host_view_checked(mgr, caches[device])
        caches[device], times = common.round_trips(mgr, caches[device], pages, iters,
                                                   warmup, np.random.default_rng(seed),
                                                   check=True)
        aliased = _pool_buffers(mgr) == before if route == "in-place" else None
        copied = mgr.stats()["host_copy_bytes"]
    return {"status": "measured", "reason": "; ".join(reasons), "bytes": nbytes,
            "aliased": aliased, "host_copy_bytes": copied, "exact": True,
            "offload_s": times["offload_s"], "load_s": times["load_s"],
            "offload_gbps": timing.gbps(nbytes, times["offload_s"]),
            "load_gbps": timing.gbps(nbytes, times["load_s"])}


def device_put_run(device: Any, nbytes: int, iters: int, warmup: int) -> dict[str, Any]:
    """``jax.device_put`` of ``nbytes`` to the device's pinned_host memory and back."""
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    dev = jax.sharding.SingleDeviceSharding(device)
    x = jax.device_put(np.arange(max(1, nbytes // 4), dtype=np.uint32), dev)
    d2h, h2d = [], []
    for it in range(warmup + iters):
        t0 = time.perf_counter()
        h = jax.block_until_ready(jax.device_put(x, host))
        t1 = time.perf_counter()
        y = jax.block_until_ready(jax.device_put(h, dev))
        t2 = time.perf_counter()
        if it == 0 and not np.array_equal(np.asarray(y), np.asarray(x)):
            raise RuntimeError(f"device_put round trip on {device} changed the bytes")
        if it >= warmup:
            d2h.append(t1 - t0)
            h2d.append(t2 - t1)
    off, on = statistics.median(d2h), statistics.median(h2d)
    return {"status": "measured", "bytes": nbytes, "offload_s": off, "load_s": on,
            "offload_gbps": timing.gbps(nbytes, off), "load_gbps": timing.gbps(nbytes, on)}


def _per_host(runs: list[Any]) -> dict[str, Any]:
    """Every device's run at once, one thread each: bytes of all over the wall time."""
    out: list[Any] = [None] * len(runs)
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            out[i] = runs[i]()
        except Exception as e:  # noqa: BLE001 - reported with the rest
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(runs))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        return {"status": "failed", "reason": errors[0]}
    if any(r["status"] != "measured" for r in out):
        return {"status": "refused", "reason": out[0].get("reason")}
    nbytes = sum(r["bytes"] for r in out)
    off = max(r["offload_s"] for r in out)
    on = max(r["load_s"] for r in out)
    return {"status": "measured", "bytes": nbytes, "wall_s": wall,
            "offload_gbps": timing.gbps(nbytes, off), "load_gbps": timing.gbps(nbytes, on)}


def verdict(chips: dict[str, Any], margin: float) -> dict[str, Any]:
    """Which route auto should take, and why, from the per-chip runs."""
    inplace, pages = chips["in-place"], chips["pages"]
    if inplace["status"] != "measured":
        return {"auto": "pages", "why": f"in place: {inplace['status']}: {inplace['reason']}"}
    if not inplace["aliased"]:
        return {"auto": "pages", "why": "in place: the pool's buffer changed across a "
                "transfer (not aliased: a whole-pool copy each time)"}
    if inplace["host_copy_bytes"]:
        return {"auto": "pages", "why": f"in place copied {inplace['host_copy_bytes']} "
                "bytes on the host"}
    if pages["status"] == "measured":
        mine = inplace["offload_gbps"] + inplace["load_gbps"]
        theirs = pages["offload_gbps"] + pages["load_gbps"]
        if mine < margin * theirs:
            return {"auto": "pages", "why": f"in place moves {mine:.2f} GB/s (offload + "
                    f"load) against the pages route's {theirs:.2f}"}
    return {"auto": "in-place", "why": "aliased, bit-exact, no host copy, and as fast as "
            "the pages route or faster"}


def run(*, config_name: str, pages: int, num_blocks: int, devices: int, iters: int,
        warmup: int, margin: float, seed: int) -> dict[str, Any]:
    spec = common.load_config(config_name)
    n = num_blocks or max(spec.num_device_blocks, 2 * pages)
    if n < pages:
        raise ValueError(f"--num_blocks {n} is smaller than --pages {pages}")
    local = jax.local_devices()
    if devices > len(local):
        raise ValueError(f"--devices {devices}: this host has {len(local)}")
    local = local[:devices or len(local)]
    caches = {d: spec.build_caches(n, devices=[d], seed=seed) for d in local}
    report: dict[str, Any] = {"per_chip": {}, "per_host": {}, "failures": []}
    for route in ROUTES:
        rows = {}
        for d in local:
            try:
                rows[str(d)] = manager_run(route, caches, d, pages, iters, warmup, seed)
            except Exception as e:  # noqa: BLE001 - record, go on
                msg = f"{route} on {d}: {type(e).__name__}: {e}"
                logging.error("%s", msg)
                report["failures"].append(msg)
                rows[str(d)] = {"status": "failed", "reason": msg}
                caches[d] = spec.build_caches(n, devices=[d], seed=seed)
        report["per_chip"][route] = rows
        report["per_host"][route] = _per_host(
            [lambda d=d: manager_run(route, caches, d, pages, iters, warmup, seed)
             for d in local])
    nbytes = next((r["bytes"] for r in report["per_chip"]["pages"].values()
                   if r["status"] == "measured"), pages * spec.num_layers)
    report["per_chip"]["device_put"] = {str(d): device_put_run(d, nbytes, iters, warmup)
                                        for d in local}
    report["per_host"]["device_put"] = _per_host(
        [lambda d=d: device_put_run(d, nbytes, iters, warmup) for d in local])
    first = str(local[0])
    chips = {route: report["per_chip"][route][first] for route in ROUTES}
    dev = common.device()
    report.update(provenance=common.provenance(), backend=dev.platform,
                  device_kind=getattr(dev, "device_kind", ""), config=spec.name,
                  num_blocks=n, pages=pages, devices=len(local), iters=iters,
                  verdict=verdict(chips, margin),
                  ok=not report["failures"] and
                  all(r["status"] != "failed" for r in report["per_host"].values()))
    return report


def print_table(report: dict[str, Any]) -> None:
    print(f"{report['backend']} ({report['device_kind']}), {report['config']}: "
          f"{report['pages']} pages a transfer, {report['devices']} device(s), median of "
          f"{report['iters']}")
    rows = []
    for scope in ("per_chip", "per_host"):
        for route, r in report[scope].items():
            for where, x in (r.items() if scope == "per_chip" else [("all", r)]):
                if x["status"] != "measured":
                    rows.append([scope, route, where, x["status"], "", "", x.get("reason")])
                    continue
                rows.append([scope, route, where, "measured", f"{x['offload_gbps']:.3f}",
                             f"{x['load_gbps']:.3f}",
                             "" if x.get("aliased") is None else f"aliased={x['aliased']}"])
    print(common.table(rows, ["scope", "route", "device", "status", "offload GB/s",
                              "load GB/s", "note"]))
    v = report["verdict"]
    print(f"auto should take: {v['auto']} ({v['why']})")
    for f in report["failures"]:
        print(f"FAILED: {f}")


def main(argv: list[str]) -> int:
    del argv
    if FLAGS.platform:
        jax.config.update("jax_platforms", FLAGS.platform)
    try:
        report = run(config_name=FLAGS.config, pages=FLAGS.pages, num_blocks=FLAGS.num_blocks,
                     devices=FLAGS.devices, iters=FLAGS.iters, warmup=FLAGS.warmup,
                     margin=FLAGS.margin, seed=FLAGS.seed)
    except (ValueError, kvxfer.config.ConfigError) as e:
        print(f"inplace_probe: {e}", file=sys.stderr)
        return 2
    if FLAGS.out:
        Path(FLAGS.out).write_text(common.dumps(report) + "\n", encoding="utf-8")
    common.show(report, FLAGS.json, print_table)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    app.run(main, flags_parser=common.parse_flags)
