r"""Records the layouts XLA really chooses for KV-cache arrays on this backend.

For the KV shape of every layer group of every config in ``configs/`` (or the
``--config`` names) and the six seed shapes of ``layouts/seeds.json``, it records:

* ``device_put``: the default layout of ``jax.device_put(x, device)``;
* ``jit_auto``: the layout of an array made by a jitted function whose output
  layout is left to the compiler (``out_shardings=Format(Layout.AUTO, sharding)``;
  the compiled ``output_formats`` and the produced array must agree);
* ``jit_auto_input``: the layout the compiler asks for when a jitted cache update
  (``dynamic_update_index_in_dim`` of one block, cache donated) leaves the cache's
  input layout to it (``in_shardings=Format(Layout.AUTO, sharding)``).

It writes a layouts catalogue (the ``layouts/*.json`` format of
``kvxfer.catalog``) whose expected verdicts are the inspector's own, so
``kvxfer inspect --catalog <file>`` passes on it; identical (shape, dtype, layout)
captures of one config are merged into one entry named after all of them.

Usage (from the repository root):

    python tpu_probes/capture_layouts.py                      # every config + seeds
    python tpu_probes/capture_layouts.py --config llama3-8b,tiny --num_blocks 64
    python tpu_probes/capture_layouts.py --json --out /tmp/captured.json

Exit status: 0 when every array was captured, 1 when a capture failed (the
catalogue still holds the rest), 2 on bad flags, arguments or input.
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
from kvxfer.layout import dtype_name, shape_text  # noqa: E402

METHODS = ("device_put", "jit_auto", "jit_auto_input")

FLAGS = flags.FLAGS
flags.DEFINE_multi_string(
    "config", None, "configs/ names or TOML paths (repeatable, comma lists allowed); "
    "default: every config in configs/")
flags.DEFINE_string("seeds_catalog", "layouts/seeds.json",
                    "catalogue whose shapes are captured too ('' to skip)")
flags.DEFINE_integer("num_blocks", 64, "blocks per layer for the config shapes", lower_bound=1)
flags.DEFINE_list("methods", list(METHODS), f"what to capture, from {', '.join(METHODS)}")
flags.DEFINE_string("out", "", "catalogue to write; default "
                    "layouts/captured_<backend>_<device kind>.json in the repository")
flags.DEFINE_bool("json", False, "print the catalogue (JSON) instead of the table")


class CaptureError(Exception):
    pass


def _sharding() -> Any:
    return jax.sharding.SingleDeviceSharding(common.device())


def capture_device_put(shape: tuple[int, ...], dtype: str) -> tuple[kvxfer.SliceGeometry, str]:
    """The default layout of a placed array."""
    a = jax.device_put(np.zeros(shape, kvxfer.layout.dtype_of(dtype)), _sharding())
    a.block_until_ready()
    return kvxfer.inspect(a), ""


def capture_jit_auto(shape: tuple[int, ...], dtype: str) -> tuple[kvxfer.SliceGeometry, str]:
    """The layout of a jitted function's output when the compiler picks it."""
    from jax.experimental.layout import Format, Layout as JaxLayout

    dt = kvxfer.layout.dtype_of(dtype)
    compiled = jax.jit(lambda: jnp.zeros(shape, dt),
                       out_shardings=Format(JaxLayout.AUTO, _sharding())).lower().compile()
    declared = kvxfer.Layout.of(compiled.output_formats)
    out = compiled()
    out.block_until_ready()
    g = kvxfer.inspect(out)
    note = ""
    if str(declared) != str(g.layout):
        note = (f"compiled.output_formats says {declared} but the produced array has "
                f"{g.layout}; recorded the array's")
    return g, note


def capture_jit_auto_input(shape: tuple[int, ...], dtype: str
                           ) -> tuple[kvxfer.SliceGeometry, str]:
    """The cache layout the compiler wants for a jitted one-block update."""
    from jax.experimental.layout import Format, Layout as JaxLayout

    dt = kvxfer.layout.dtype_of(dtype)
    s = _sharding()

    def update(cache, block, index):
        return jax.lax.dynamic_update_index_in_dim(cache, block, index, 0)

    compiled = jax.jit(update, in_shardings=(Format(JaxLayout.AUTO, s), s, s),
                       out_shardings=Format(JaxLayout.AUTO, s), donate_argnums=(0,)).lower(
        jax.ShapeDtypeStruct(shape, dt), jax.ShapeDtypeStruct(shape[1:], dt),
        jax.ShapeDtypeStruct((), jnp.int32)).compile()
    args, _ = compiled.input_formats
    layout = kvxfer.Layout.of(args[0])
    return kvxfer.inspect(shape, dtype, layout), ""


CAPTURERS = {"device_put": capture_device_put, "jit_auto": capture_jit_auto,
             "jit_auto_input": capture_jit_auto_input}


def targets(config_names: list[str], seeds_catalog: str, num_blocks: int
            ) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(group, label, shape, dtype): one per layer group of each config, then the seeds."""
    out = []
    for name in config_names:
        spec = common.load_config(name)
        for g in spec.groups:
            out.append((spec.name, f"{g.name}.0", (num_blocks, *g.block_shape), g.dtype))
    if seeds_catalog:
        cat = kv_catalog.load(seeds_catalog)
        for e in cat.entries:
            out.append(("seeds", e.name, tuple(e.shape), e.dtype))
    return out


def capture(config_names: list[str], seeds_catalog: str, num_blocks: int,
            methods: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """Captures every target; returns (catalogue dict, table rows, failures)."""
    dev = common.device()
    source = f"captured on {dev.platform} ({getattr(dev, 'device_kind', '')})"
    merged: dict[tuple[str, tuple[int, ...], str, str], dict[str, Any]] = {}
    failures: list[str] = []
    for group, label, shape, dtype in targets(config_names, seeds_catalog, num_blocks):
        for method in methods:
            what = f"{group}/{label}/{method}"
            try:
                g, note = CAPTURERS[method](shape, dtype)
            except Exception as e:  # noqa: BLE001 - record and go on with the rest
                msg = f"{what}: {shape_text(shape, dtype)}: {type(e).__name__}: {e}"
                logging.warning("capture failed: %s", msg)
                failures.append(msg)
                continue
            if note:
                logging.warning("%s: %s", what, note)
            key = (group, tuple(shape), dtype_name(dtype), str(g.layout))
            if key in merged:
                merged[key]["labels"].append(f"{label}/{method}")
                continue
            merged[key] = {"group": group, "labels": [f"{label}/{method}"], "geometry": g,
                           "notes": [note] if note else []}
            logging.info("%s: %s -> %s", what, shape_text(shape, dtype), g.layout)
    entries, rows = [], []
    for item in merged.values():
        labels = _merge_labels(item["labels"])
        name = f"{item['group']}/{labels}"
        g = item["geometry"]
        entries.append(kv_catalog.entry_from_geometry(name, g, source))
        rows.append({"name": name, "array": shape_text(g.shape, g.dtype),
                     "layout": str(g.layout), "verdict": common.verdict_text(g),
                     "padding": f"{g.padding_factor:.2f}"})
    prov = common.provenance()
    prov["num_blocks"] = num_blocks
    prov["methods"] = list(methods)
    prov["configs"] = list(config_names)
    if failures:
        prov["failures"] = failures
    cat = kv_catalog.Catalog(
        tuple(entries),
        description=(f"KV-cache layouts XLA chose on {dev.platform} "
                     f"({getattr(dev, 'device_kind', '')}), captured by "
                     "tpu_probes/capture_layouts.py: the default layout of jax.device_put "
                     "(device_put), a jitted producer's output layout left to the compiler "
                     "(jit_auto) and the input layout the compiler asks for a jitted "
                     "one-block cache update (jit_auto_input). Expected verdicts are the "
                     "inspector's own."),
        provenance=prov)
    return cat, rows, failures


def _merge_labels(labels: list[str]) -> str:
    """``["attn.0/device_put", "attn.0/jit_auto"]`` -> ``"attn.0/device_put+jit_auto"``."""
    by_label: dict[str, list[str]] = {}
    for text in labels:
        label, _, method = text.rpartition("/")
        by_label.setdefault(label, []).append(method)
    return "+".join(f"{label}/{'+'.join(methods)}" for label, methods in by_label.items())


def default_out() -> Path:
    return common.LAYOUTS_DIR / f"captured_{common.backend_tag()}.json"


def main(argv: list[str]) -> int:
    del argv  # flags only: common.parse_flags refuses other arguments
    methods = common.chosen_methods("capture_layouts", FLAGS.methods, METHODS)
    if methods is None:
        return 2
    names = common.split_names(FLAGS.config) or common.config_names()
    try:
        cat, rows, failures = capture(names, FLAGS.seeds_catalog, FLAGS.num_blocks, methods)
    except (kvxfer.LayoutError, ValueError, OSError) as e:  # bad config or catalogue
        print(f"capture_layouts: {e}", file=sys.stderr)
        return 2
    out = Path(FLAGS.out) if FLAGS.out else default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    text = cat.to_json()
    out.write_text(text, encoding="utf-8")
    # The file must pass `kvxfer inspect --catalog`: check it the same way.
    wrong = [r for r in kv_catalog.load(out).check() if not r.agrees]
    for r in wrong:
        logging.error("%s: %s", r.entry.name, r.disagreement)
    logging.info("wrote %d entries to %s", len(cat.entries), out)
    if FLAGS.json:
        sys.stdout.write(text)
    else:
        print(common.table([[r["name"], r["array"], r["layout"], r["verdict"], r["padding"]]
                            for r in rows],
                           ["name", "array", "layout", "verdict", "padding"]))
        p = cat.provenance
        print(f"\n{len(cat.entries)} distinct layouts on {p['backend']} ({p['device_kind']}), "
              f"jax {p['jax']} / jaxlib {p['jaxlib']}; written to {out}")
        for f in failures:
            print(f"FAILED: {f}")
        print(f"check it: kvxfer inspect --catalog {out}")
    return 1 if (failures or wrong or not cat.entries) else 0


if __name__ == "__main__":
    app.run(main, flags_parser=common.parse_flags)
