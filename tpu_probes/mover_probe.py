r"""Per-layer throughput of kvxfer's direct movers over a model-like set of layers.

For each path of ``--paths`` (default ``pallas,pinned``: the Pallas DMA kernels and
the pinned-host programs) it builds the caches of ``--config`` (default
``llama3-8b``: 32 bf16 layers of 64 KiB blocks), and measures, with page digests on
(``--integrity page``):

* **total**: one manager over every layer; ``offload`` of ``--pages`` random blocks
  (until the pages are on the host) and ``load`` of them into other blocks with
  ``gate="layer"`` (until every layer is verified), and when each layer became ready
  during that load (``ready_s``: seconds from the ``load()`` call to
  ``layer_ready(i)``);
* **per layer**: a manager over that layer alone, the same offload and load.

GB/s count the bytes the pages hold (every shard of every layer moved), 1e9 bytes a
second, medians of ``--iters`` runs after ``--warmup`` untimed runs (and after
``mgr.warmup``, so compiling is not timed). Every mover's first round trip is checked
byte for byte. A path the manager refuses (no TPU for ``pallas``, a layout it cannot
prove, a path this kvxfer does not have) is skipped, and the reason printed.

Usage (from the repository root):

    python tpu_probes/mover_probe.py
    python tpu_probes/mover_probe.py --config gemma-mixed --pages 32 --devices 4 --json
    python tpu_probes/mover_probe.py --platform cpu --config tiny --pages 4  # quick

Exit status: 0 when every path that ran was byte-exact and verified (and at least one
ran), 1 otherwise, 2 on bad flags or arguments.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from absl import app, flags, logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402  (also makes kvxfer importable)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kvxfer  # noqa: E402
from kvxfer.bench import timing  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("paths", ["pallas", "pinned"], "manager paths to measure")
flags.DEFINE_string("config", "llama3-8b", "model config: a built-in name or a TOML file")
flags.DEFINE_integer("pages", 16, "pages (blocks of every layer) per offload / load",
                     lower_bound=1)
flags.DEFINE_integer("num_blocks", 0, "blocks per cache (0: the config's, at least twice "
                     "--pages)", lower_bound=0)
flags.DEFINE_integer("devices", 1, "devices the layers are sharded or replicated over "
                     "(1: the first device)", lower_bound=1)
flags.DEFINE_integer("iters", 3, "timed runs (the median is reported)", lower_bound=1)
flags.DEFINE_integer("warmup", 1, "untimed runs before them", lower_bound=0)
flags.DEFINE_enum("integrity", "page", ["page", "off"], "page digests")
flags.DEFINE_string("platform", "", "JAX platform to run on (cpu, tpu, gpu; default: "
                    "JAX's choice)")
flags.DEFINE_integer("seed", 0, "random seed")
flags.DEFINE_bool("json", False, "print one JSON object instead of the tables")


def measure_path(path: str, caches: list[jax.Array], *, pages: int, iters: int, warmup: int,
                 integrity: str, rng: np.random.Generator
                 ) -> tuple[list[jax.Array], dict[str, Any]]:
    """One path's report: refused (with the reason), or its total and per-layer numbers."""
    try:
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=pages, integrity=integrity,
                                    path=path)
    except (kvxfer.LayoutError, ValueError) as e:
        logging.warning("%s: refused: %s", path, e)
        return caches, {"status": "refused", "reason": str(e)}
    with mgr:
        movers = mgr.paths
        layer_bytes = [mgr.plan.class_of_layer(i)[0].bytes_per_block * pages
                       for i in range(len(caches))]
        mgr.warmup(pages)
        caches, total = common.round_trips(mgr, caches, pages, iters, warmup, rng, check=True)
    nbytes = sum(layer_bytes)
    total.update(bytes=nbytes, offload_gbps=timing.gbps(nbytes, total["offload_s"]),
                 load_gbps=timing.gbps(nbytes, total["load_s"]))
    logging.info("%s total: offload %.3f GB/s, load %.3f GB/s", path, total["offload_gbps"],
                 total["load_gbps"])
    layers = []
    done = 0
    for i in range(len(caches)):
        with kvxfer.KVCacheManager([caches[i]], num_host_blocks=pages, integrity=integrity,
                                   path=path) as one:
            one.warmup(pages)
            (caches[i],), alone = common.round_trips(one, [caches[i]], pages, iters, warmup, rng,
                                              check=False)
        ready = total["ready_s"][i]
        step = ready - (total["ready_s"][i - 1] if i else 0.0)
        done += layer_bytes[i]
        layers.append({
            "layer": i, "class": mgr.plan.class_of_layer(i)[0].index, "mover": movers[i],
            "bytes": layer_bytes[i],
            "offload_s": alone["offload_s"],
            "offload_gbps": timing.gbps(layer_bytes[i], alone["offload_s"]),
            "load_s": alone["load_s"], "load_gbps": timing.gbps(layer_bytes[i], alone["load_s"]),
            "ready_s": ready, "ready_gbps": timing.gbps(done, ready),
            "ready_step_gbps": timing.gbps(layer_bytes[i], step)})
    note = None
    if "pallas" in movers and any(d.platform != "tpu" for c in caches
                                  for d in c.sharding.device_set):
        note = ("Pallas kernels ran in TPU interpret mode (not on a TPU): the times are "
                "the interpreter's, not DMAs'")
    return caches, {"status": "measured", "reason": None, "movers": sorted(set(movers)),
                    "note": note, "total": total, "layers": layers}


def run(paths: list[str], *, config_name: str, pages: int, num_blocks: int, devices: int,
        iters: int, warmup: int, integrity: str, seed: int) -> dict[str, Any]:
    spec = common.load_config(config_name)
    n = num_blocks or max(spec.num_device_blocks, 2 * pages)
    if n < pages:
        raise ValueError(f"--num_blocks {n} is smaller than --pages {pages}")
    if devices > jax.device_count():
        raise ValueError(f"--devices {devices}: this backend has {jax.device_count()}")
    placed = None if devices == 1 else jax.devices()[:devices]
    caches = spec.build_caches(n, devices=placed, seed=seed)
    rng = np.random.default_rng(seed)
    report: dict[str, Any] = {"paths": {}, "failures": []}
    for path in paths:
        try:
            caches, report["paths"][path] = measure_path(
                path, caches, pages=pages, iters=iters, warmup=warmup, integrity=integrity,
                rng=rng)
        except Exception as e:  # noqa: BLE001 - record, go on with the next path
            msg = f"{path}: {type(e).__name__}: {e}"
            logging.error("%s", msg)
            report["failures"].append(msg)
            report["paths"][path] = {"status": "failed", "reason": msg}
            caches = spec.build_caches(n, devices=placed, seed=seed)  # a load may consume
    dev = common.device()
    measured = [p for p, r in report["paths"].items() if r["status"] == "measured"]
    report.update(provenance=common.provenance(), backend=dev.platform,
                  device_kind=getattr(dev, "device_kind", ""), config=spec.name,
                  num_layers=spec.num_layers, num_blocks=n, pages=pages, devices=devices,
                  iters=iters, warmup=warmup, integrity=integrity,
                  ok=bool(measured) and not report["failures"])
    return report


def print_table(report: dict[str, Any]) -> None:
    print(f"{report['backend']} ({report['device_kind']}), {report['config']}: "
          f"{report['num_layers']} layers, {report['pages']} pages per transfer over "
          f"{report['devices']} device(s), integrity {report['integrity']}, median of "
          f"{report['iters']}")
    for path, r in report["paths"].items():
        if r["status"] != "measured":
            print(f"\n{path}: {r['status']}: {r['reason']}")
            continue
        t = r["total"]
        print(f"\n{path} ({', '.join(r['movers'])}): every layer at once, "
              f"{common.format_bytes(t['bytes'])}: offload {t['offload_gbps']:.3f} GB/s "
              f"({t['offload_s'] * 1e3:.2f} ms), load {t['load_gbps']:.3f} GB/s "
              f"({t['load_s'] * 1e3:.2f} ms)")
        rows = [[x["layer"], x["class"], common.format_bytes(x["bytes"]),
                 f"{x['offload_gbps']:.3f}", f"{x['load_gbps']:.3f}",
                 f"{x['ready_s'] * 1e3:.2f}", f"{x['ready_gbps']:.3f}"]
                for x in r["layers"]]
        print(common.table(rows, ["layer", "class", "bytes", "alone: offload GB/s",
                                  "alone: load GB/s", "all: ready ms", "all: ready GB/s"]))
        if r["note"]:
            print(f"note: {r['note']}")
    for f in report["failures"]:
        print(f"FAILED: {f}")


def main(argv: list[str]) -> int:
    del argv  # flags only: common.parse_flags refuses other arguments
    if FLAGS.platform:
        jax.config.update("jax_platforms", FLAGS.platform)
    paths = [p.strip() for p in FLAGS.paths if p.strip()]
    try:
        if not paths:
            raise ValueError("--paths is empty")
        report = run(paths, config_name=FLAGS.config, pages=FLAGS.pages,
                     num_blocks=FLAGS.num_blocks, devices=FLAGS.devices, iters=FLAGS.iters,
                     warmup=FLAGS.warmup, integrity=FLAGS.integrity, seed=FLAGS.seed)
    except (ValueError, kvxfer.config.ConfigError, RuntimeError) as e:
        print(f"mover_probe: {e}", file=sys.stderr)
        return 2
    common.show(report, FLAGS.json, print_table)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    app.run(main, flags_parser=common.parse_flags)
