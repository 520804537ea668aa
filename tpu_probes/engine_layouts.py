r"""Captures the layouts XLA gives the serving engines' own KV caches, against the derived ones.

``layouts/engines_derived.json`` holds sglang-jax's and vLLM TPU's KV-cache arrays
with TPU layouts *derived* from XLA's tiling conventions, not captured. This probe
allocates each of those arrays the way the engines do and records the layout XLA
really gives it:

* ``engine_alloc``: a jitted ``jnp.zeros`` with ``out_shardings`` the engine's
  ``NamedSharding`` over a one-device mesh with the engine's axis names (sglang-jax:
  ``_get_kv_zero_allocator`` in ``mem_cache/memory_pool.py``,
  ``P("data", None, "tensor", None, None)``; vLLM TPU: ``_get_kv_cache_allocator``
  in ``runner/kv_cache.py``, ``P("data", None, "model")``, the MLA latent
  ``P("data")``);
* ``device_put``: the default layout of ``jax.device_put(x, device)``.

Entries of one shape are candidates for one capture: a ``-if-full-tile`` entry is the
alternative the catalogue prices (the full 8-row tile), the others are the
derivation's claims. On a TPU each claim is **confirmed** (XLA chose the derived
layout) or **refuted** (it chose another; the row names which, and whether an
alternative matched), and the captures are written as a catalogue, default
``layouts/engines_captured_<backend>_<device kind>.json``, for a pull request that
replaces the derived entries. On any other backend the probe runs the same
allocations and says that it captured nothing authoritative (XLA:CPU stores every
array row-major and untiled): nothing is confirmed or refuted and no file is
written unless ``--out`` names one.

Usage (from the repository root):

    python tpu_probes/engine_layouts.py                    # layouts/engines_derived.json
    python tpu_probes/engine_layouts.py --json --max_blocks 8

Exit status: 0 when every array was captured and no claim was refuted (always 0 off
a TPU when the allocations ran), 1 when a capture failed or, on a TPU, a derived
layout was refuted, 2 on bad flags or input.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from absl import app, flags, logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402  (also makes kvxfer importable)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kvxfer  # noqa: E402
from kvxfer import catalog as kv_catalog  # noqa: E402
from kvxfer.layout import dtype_of, shape_text  # noqa: E402

METHODS = ("engine_alloc", "device_put")
ALTERNATIVE = "-if-full-tile"  # the name suffix of a catalogue's priced alternatives

FLAGS = flags.FLAGS
flags.DEFINE_string("catalog", "engines_derived", "the derived catalogue to capture")
flags.DEFINE_integer("max_blocks", 0, "cap the block dim of the arrays (0: the "
                     "catalogue's shapes; the block dim is outside every tile)",
                     lower_bound=0)
flags.DEFINE_list("methods", list(METHODS), f"how to allocate, from {', '.join(METHODS)}")
flags.DEFINE_string("out", "", "catalogue to write; default on a TPU "
                    "layouts/engines_captured_<backend>_<device kind>.json, elsewhere none")
flags.DEFINE_bool("json", False, "print one JSON object instead of the table")


def engine_sharding(name: str, rank: int) -> jax.sharding.Sharding:
    """The engine's cache sharding over a one-device mesh with the engine's axis names
    (by the catalogue entry's name: ``sglang-jax-*``, ``vllm-tpu-*``; else one device)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    dev = np.array([common.device()]).reshape(1, 1)
    if name.startswith("sglang-jax") and rank >= 3:  # pages over data, heads over tensor
        return NamedSharding(Mesh(dev, ("data", "tensor")),
                             P("data", None, "tensor", *([None] * (rank - 3))))
    if name.startswith("vllm-tpu") and "-mla" in name:  # the latent: replicated over model
        return NamedSharding(Mesh(dev, ("data", "model")), P("data"))
    if name.startswith("vllm-tpu") and rank >= 3:  # blocks over attn_dp, heads over model
        return NamedSharding(Mesh(dev, ("data", "model")), P("data", None, "model"))
    return jax.sharding.SingleDeviceSharding(common.device())


def allocate(method: str, name: str, shape: tuple[int, ...], dtype: str) -> jax.Array:
    dt = dtype_of(dtype)
    if method == "device_put":
        return jax.device_put(np.zeros(shape, dt), common.device()).block_until_ready()
    sharding = engine_sharding(name, len(shape))
    return jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=sharding)().block_until_ready()


def _groups(cat: kv_catalog.Catalog, max_blocks: int
            ) -> list[tuple[tuple[int, ...], str, list[kv_catalog.Entry]]]:
    """(shape, dtype, entries) per distinct array, in catalogue order."""
    out: dict[tuple[tuple[int, ...], str], list[kv_catalog.Entry]] = {}
    for e in cat.entries:
        shape = tuple(e.shape)
        if max_blocks and e.block_dim == 0 and shape[0] > max_blocks:
            shape = (max_blocks, *shape[1:])
        out.setdefault((shape, e.dtype), []).append(e)
    return [(s, d, es) for (s, d), es in out.items()]


def capture(catalog_name: str, max_blocks: int, methods: list[str], *,
            authoritative: bool | None = None) -> dict[str, Any]:
    """Allocates every array of the catalogue with each method; the report.

    Args:
      catalog_name: a built-in catalogue name or a JSON file.
      max_blocks: cap on the block dim (0: the catalogue's shapes).
      methods: from ``METHODS``.
      authoritative: judge the captures as a TPU's (confirmed / refuted); default:
        when this backend is a TPU.
    """
    cat = kv_catalog.load(catalog_name)
    dev = common.device()
    if authoritative is None:
        authoritative = dev.platform == "tpu"
    source = f"captured on {dev.platform} ({getattr(dev, 'device_kind', '')})"
    rows, failures, refuted, entries = [], [], [], []
    for shape, dtype, group in _groups(cat, max_blocks):
        claims = [e for e in group if not e.name.endswith(ALTERNATIVE)] or group
        lead = claims[0].name
        for method in methods:
            what = f"{lead}/{method}"
            try:
                a = allocate(method, lead, shape, dtype)
                g = kvxfer.inspect(a)
            except Exception as e:  # noqa: BLE001 - record it and go on with the rest
                msg = f"{what}: {shape_text(shape, dtype)}: {type(e).__name__}: {e}"
                logging.warning("capture failed: %s", msg)
                failures.append(msg)
                continue
            captured = str(g.layout)
            matches = [e.name for e in group if str(kvxfer.Layout.parse(e.layout)) == captured]
            if not authoritative:
                result = "not authoritative"
            elif all(c.name in matches for c in claims):
                result = "confirmed"
            else:
                result = "REFUTED" + (f" (matches {', '.join(matches)})" if matches else "")
                refuted.append(f"{what}: derived {claims[0].layout}, captured {captured}"
                               + (f", which is {', '.join(matches)}" if matches else ""))
            rows.append({"name": lead, "method": method, "array": shape_text(shape, dtype),
                         "derived": [e.layout for e in group], "captured": captured,
                         "verdict": common.verdict_text(g),
                         "padding": round(g.padding_factor, 4), "result": result,
                         "candidates": [e.name for e in group], "matches": matches})
            entries.append(kv_catalog.entry_from_geometry(f"{lead}/{method}", g, source))
    prov = common.provenance()
    prov.update(catalog=catalog_name, methods=list(methods), max_blocks=max_blocks)
    if failures:
        prov["failures"] = failures
    captured_cat = kv_catalog.Catalog(
        tuple(entries),
        description=(f"The serving engines' KV-cache arrays of {catalog_name} as XLA lays "
                     f"them out on {dev.platform} ({getattr(dev, 'device_kind', '')}), "
                     "captured by tpu_probes/engine_layouts.py: allocated as the engines "
                     "do (engine_alloc: a jitted jnp.zeros with the engine's sharding) and "
                     "by jax.device_put (device_put). Expected verdicts are the "
                     "inspector's own."),
        provenance=prov)
    confirmed = sum(r["result"] == "confirmed" for r in rows)
    if authoritative:
        summary = (f"{confirmed} of {len(rows)} captures on {dev.platform} "
                   f"({getattr(dev, 'device_kind', '')}) confirm the derived layouts; "
                   f"{len(refuted)} refute them")
    else:
        summary = (f"{dev.platform} ({getattr(dev, 'device_kind', '')}) is not a TPU: "
                   "captured nothing authoritative. XLA here gives these arrays its own "
                   "layouts (on XLA:CPU row-major, untiled), which neither confirm nor "
                   "refute a derived TPU layout; run this on a TPU VM")
    return {"backend": dev.platform, "device_kind": getattr(dev, "device_kind", ""),
            "authoritative": authoritative, "catalog": catalog_name, "rows": rows,
            "failures": failures, "refuted": refuted, "confirmed": confirmed,
            "summary": summary, "captured": captured_cat,
            "ok": not failures and not refuted and bool(rows)}


def default_out() -> Path:
    return common.LAYOUTS_DIR / f"engines_captured_{common.backend_tag()}.json"


def print_table(report: dict[str, Any]) -> None:
    print(common.table([[r["name"], r["method"], r["array"], " | ".join(r["derived"]),
                         r["captured"], r["verdict"], f"{r['padding']:.2f}", r["result"]]
                        for r in report["rows"]],
                       ["array of", "method", "shape", "derived", "captured", "verdict",
                        "padding", "result"]))
    print()
    for f in report["failures"]:
        print(f"FAILED: {f}")
    for r in report["refuted"]:
        print(f"REFUTED: {r}")
    print(report["summary"])
    if report.get("written"):
        print(f"written to {report['written']}; check it: kvxfer inspect --catalog "
              f"{report['written']}")


def main(argv: list[str]) -> int:
    del argv  # flags only: common.parse_flags refuses other arguments
    methods = common.chosen_methods("engine_layouts", FLAGS.methods, METHODS)
    if methods is None:
        return 2
    try:
        report = capture(FLAGS.catalog, FLAGS.max_blocks, methods)
    except (kvxfer.LayoutError, ValueError, OSError) as e:  # bad catalogue
        print(f"engine_layouts: {e}", file=sys.stderr)
        return 2
    captured = report.pop("captured")
    out = Path(FLAGS.out) if FLAGS.out else (default_out() if report["authoritative"]
                                             else None)
    report["written"] = None
    if out is not None and captured.entries:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(captured.to_json(), encoding="utf-8")
        report["written"] = str(out)
        logging.info("wrote %d entries to %s", len(captured.entries), out)
    report["provenance"] = captured.provenance
    common.show(report, FLAGS.json, print_table)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    app.run(main, flags_parser=common.parse_flags)
