r"""Compares the layouts a TPU really gives KV caches with the deviceless compile.

``layouts/tpu_compiled.json`` records what the real XLA:TPU compiler chooses, compiled
without a TPU (``python tools/tpu_catalog.py``), for every layer group of the
built-in configs (one shard each: replicated, and split over 2, 4, 8 devices) over
ranges of block counts, and for every array of the derived catalogues. On a TPU VM
this probe allocates the same arrays the way an engine does (a jitted ``jnp.zeros``
with ``out_shardings`` a ``NamedSharding`` that splits the shard dim over the first N
devices), reads each one's layout from the runtime (``x.format.layout``: one shard's),
and says for each whether it is the compiled one (``same``) or not (``DIFFERS``, with
both layouts). For a config group it checks both ends of each range of block counts
(up to ``--max_blocks``), so the first TPU run confirms where the choice changes too.

Off a TPU the probe runs the same allocations and says it checked nothing
authoritative (XLA:CPU stores every array row-major and untiled).

Usage (from the repository root):

    python tpu_probes/compiled_layouts.py                  # every entry that fits
    python tpu_probes/compiled_layouts.py --json --max_blocks 1024 --max_devices 4

Exit status: 0 when every allocation ran and, on a TPU, every layout is the compiled
one; 1 when an allocation failed or, on a TPU, a layout differs; 2 on bad flags.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from absl import app, flags, logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402  (also makes kvxfer importable)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvxfer import _resources  # noqa: E402
from kvxfer import _text  # noqa: E402
from kvxfer.layout import Layout, dtype_of, shape_text  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("catalog", "tpu_compiled", "the compiled catalogue to check against")
flags.DEFINE_integer("max_blocks", 4096, "largest block count allocated (a range whose "
                     "first count is larger is skipped, and said so)", lower_bound=1)
flags.DEFINE_integer("max_devices", 8, "largest shard count allocated", lower_bound=1)
flags.DEFINE_bool("json", False, "print one JSON object instead of the table")


def _arrays(raw: dict[str, Any], max_blocks: int) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per (entry, block count): both ends of each range, up to ``max_blocks``;
    and the entries skipped because their first count is larger."""
    out, skipped = [], []
    for a in raw["arrays"]:
        shards = a.get("shards", 1)
        first, last = a.get("blocks", [a["shape"][0]] * 2)
        shape = list(a["shape"])  # one shard's, at `last` blocks
        if shards > 1:
            shape[a["shard_dim"]] *= shards
        if first > max_blocks:
            skipped.append(f"{a['name']}: from {first} blocks, over --max_blocks")
            continue
        for n in sorted({first, min(last, max_blocks)}):
            out.append({"name": a["name"], "shape": [n, *shape[1:]], "dtype": a["dtype"],
                        "shards": shards, "shard_dim": a.get("shard_dim"),
                        "compiled": a["layout"]})
    return out, skipped


def allocate(shape: list[int], dtype: str, devices: list[Any], shard_dim: int | None
             ) -> jax.Array:
    """As an engine allocates its cache: jitted zeros, split along ``shard_dim``."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(devices), ("kv",))
    spec = P() if shard_dim is None else P(*([None] * shard_dim), "kv")
    sharding = NamedSharding(mesh, spec)
    return jax.jit(lambda: jnp.zeros(tuple(shape), dtype_of(dtype)),
                   out_shardings=sharding)().block_until_ready()


def check(catalog: str, max_blocks: int, max_devices: int) -> dict[str, Any]:
    """Allocates every array that fits and compares its layout; the report."""
    path = _resources.find("layouts", catalog)
    raw = json.loads(path.read_text(encoding="utf-8"))
    devices = jax.devices()
    authoritative = devices[0].platform == "tpu"
    rows, failures, differs = [], [], []
    todo, skipped = _arrays(raw, max_blocks)
    for row in todo:
        what = f"{row['name']} at {row['shape'][0]} blocks"
        if row["shards"] > min(len(devices), max_devices):
            skipped.append(f"{what}: {row['shards']} shards, {len(devices)} devices here")
            continue
        try:
            x = allocate(row["shape"], row["dtype"], devices[:row["shards"]],
                         row["shard_dim"] if row["shards"] > 1 else None)
            runtime = str(Layout.of(x))
            x.delete()
        except Exception as e:  # noqa: BLE001 - record it and go on with the rest
            msg = f"{what}: {shape_text(row['shape'], row['dtype'])}: {type(e).__name__}: {e}"
            logging.warning("allocation failed: %s", msg)
            failures.append(msg)
            continue
        same = runtime == str(Layout.parse(row["compiled"]))
        result = "not authoritative" if not authoritative else ("same" if same else "DIFFERS")
        if authoritative and not same:
            differs.append(f"{what}: compiled {row['compiled']}, runtime {runtime}")
        rows.append({**row, "runtime": runtime, "result": result})
    if not authoritative:
        summary = (f"on {devices[0].platform}: {len(rows)} arrays allocated, checked "
                   "nothing authoritative (only a TPU lays them out as a TPU does)")
    else:
        summary = (f"{len(rows) - len(differs)} of {len(rows)} layouts are the compiled "
                   f"ones ({raw['provenance'].get('libtpu', '?')})")
    return {**common.provenance(), "catalog": str(path.name),
            "compiled_with": raw.get("provenance", {}), "authoritative": authoritative,
            "rows": rows, "differs": differs, "failures": failures, "skipped": skipped,
            "summary": summary}


def print_table(report: dict[str, Any]) -> None:
    rows = [[r["name"], r["shape"][0], r["shards"], r["compiled"], r["runtime"],
             r["result"]] for r in report["rows"]]
    print(_text.table(rows, ["array", "blocks", "shards", "compiled", "runtime", "result"]))
    for line in report["skipped"]:
        print(f"skipped: {line}")
    print(report["summary"])


def main(argv: list[str]) -> int:
    del argv
    report = check(FLAGS.catalog, FLAGS.max_blocks, FLAGS.max_devices)
    common.show(report, FLAGS.json, print_table)
    return 1 if report["failures"] or report["differs"] else 0


if __name__ == "__main__":
    app.run(main, flags_parser=common.parse_flags)
