r"""Proves the layout inspector against the hardware with real per-block round trips.

For every array of the given catalogues (``--catalog``) and configs (``--config``)
it builds a real buffer on the current backend (random bits; for a catalogue
entry or a config's ``tpu_layout`` it asks for that layout with
``jax.device_put(x, Format(Layout(...), sharding))`` and falls back to the default
layout, saying so, when the backend refuses), then:

1. inspects the array's REAL layout (``kvxfer.inspect(array)``); on XLA:CPU it also
   reads the buffer's bytes and checks them against the layout's physical image
   (``kvxfer.emulate.to_image``). XLA:CPU accepts and reports tiles but stores the
   array densely; when the bytes prove that, the array is re-placed with the
   layout the CPU really stores (dim order only) and the note says so;
2. **staged**: ``KVCacheManager([array], path="staged")`` plus
   ``kvxfer.probe.round_trip`` (offload a permutation of blocks, clobber, load
   them elsewhere, compare every byte) must be byte-exact for every layout;
3. **direct**: ``path="raw"`` without ``layouts=``. Arrays the inspector accepts
   must round-trip byte-exact where the backend has a direct path (XLA:CPU:
   row-major, whole-byte arrays); arrays it rejects must be refused with a
   ``LayoutError`` that names the layout. GPU and TPU have no direct path in
   kvxfer today: the probe says so plainly;
4. **emulated direct** (on a CPU device): ``path="raw"`` with
   ``layouts=[the entry's TPU layout]`` moves bytes in emulated TPU memory; it must
   refuse exactly the layouts the inspector rejects (a ``LayoutError`` naming the
   layout) and round-trip the others byte-exact.

It also checks each catalogue entry's expected verdict against the inspector, and
whether a staged load hands the cache back in the layout it was registered with.

Usage (from the repository root):

    python tpu_probes/roundtrip_probe.py                      # the layouts/ catalogues
    python tpu_probes/roundtrip_probe.py --catalog layouts/captured_tpu_v5_lite.json
    python tpu_probes/roundtrip_probe.py --config tiny --config llama3-8b --json

Exit status: 0 when verdicts and hardware agree everywhere, 1 on any disagreement,
2 on bad flags, arguments or input.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from absl import app, flags, logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402  (also makes kvxfer importable)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kvxfer  # noqa: E402
from kvxfer import Layout, LayoutError  # noqa: E402
from kvxfer import catalog as kv_catalog  # noqa: E402
from kvxfer import emulate  # noqa: E402
from kvxfer.layout import dtype_name, shape_text  # noqa: E402
from kvxfer.probe import round_trip  # noqa: E402

DEFAULT_CATALOGS = ("seeds", "tpu_kv_derived", "engines_derived")

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("catalog", None, "layouts catalogue(s) to probe (repeatable); "
                          f"default {', '.join(DEFAULT_CATALOGS)} when no --config")
flags.DEFINE_multi_string("config", None, "configs/ names or TOML paths (repeatable, comma "
                          "lists allowed): one array per layer group")
flags.DEFINE_integer("num_blocks", None, "blocks per config array (default: the config's "
                     "num_device_blocks)", lower_bound=1)
flags.DEFINE_integer("max_blocks", 0, "cap the block dim of catalogue arrays (0: the "
                     "catalogue's shapes; a smaller cap runs faster)", lower_bound=0)
flags.DEFINE_integer("pages", 16, "blocks moved per round trip", lower_bound=1)
flags.DEFINE_enum("integrity", "off", ["off", "page"], "page digests during the round trips")
flags.DEFINE_bool("emulated", True, "also run the emulated-TPU direct check (CPU device)")
flags.DEFINE_integer("seed", 0, "random seed")
flags.DEFINE_bool("json", False, "print one JSON object instead of the table")

_BUDGET = 1 << 40  # the probe sizes its own pools; never refuse on the budget


@dataclasses.dataclass
class Case:
    """One array to probe."""

    name: str
    origin: str
    shape: tuple[int, ...]
    dtype: str
    layout: Layout | None      # requested (catalogue layout / config tpu_layout)
    block_dim: int = 0
    catalogue: str | None = None  # "" agrees, text = disagreement, None = nothing to check
    note: str = ""


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------


def catalogue_cases(path: str, max_blocks: int) -> list[Case]:
    cat = kv_catalog.load(path)
    cases = []
    for r in cat.check():
        e = r.entry
        shape, note = tuple(e.shape), ""
        if max_blocks and e.block_dim == 0 and len(shape) >= 2 and shape[0] > max_blocks:
            note = f"block dim cut from {shape[0]} to {max_blocks} (--max_blocks)"
            shape = (max_blocks, *shape[1:])
        cases.append(Case(e.name, str(path), shape, e.dtype, Layout.parse(e.layout),
                          e.block_dim, r.disagreement if e.expected else None, note))
    return cases


def config_cases(name: str, num_blocks: int | None) -> list[Case]:
    spec = common.load_config(name)
    n = num_blocks or spec.num_device_blocks
    return [Case(f"{spec.name}/{g.name}.0", f"config {spec.name}", (n, *g.block_shape),
                 g.dtype, g.layout, 0, None,
                 f"one array for the {g.count} identical layer(s) of group {g.name}")
            for g in spec.groups]


# ---------------------------------------------------------------------------
# Probing one array
# ---------------------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:400]


def _round_trip(arrays: list[jax.Array], *, pages: int, integrity: str, seed: int,
                **kw: Any) -> tuple[bool, dict[str, Any]]:
    """Registers ``arrays`` and runs ``kvxfer.probe.round_trip``; raises on refusal."""
    mgr = kvxfer.KVCacheManager(arrays, num_host_blocks=pages, integrity=integrity,
                                host_memory_budget=_BUDGET, **kw)
    with mgr:
        new, rows, summary = round_trip(mgr, arrays, pages, seed=seed)
        exact = all(r["byte_exact"] for r in rows) and \
            summary["verified_prefix"] == summary["pages"]
        info = {"paths": mgr.paths, "pages": summary["pages"],
                "verified_prefix": summary["verified_prefix"],
                "seconds": summary["offload_s"] + summary["load_s"],
                "layout_after_load": str(Layout.of(new[0]))}
    return exact, info


def _layout_kept(a: jax.Array, placed: Layout, sharding: Any, integrity: str) -> str:
    """The cache layout after a staged load into a cache that has ``placed``."""
    with kvxfer.KVCacheManager([a], num_host_blocks=1, integrity=integrity, path="staged",
                               host_memory_budget=_BUDGET) as mgr:
        pages = mgr.offload([a], [0], keys=[1]).wait()
        target, _ = common.put_with_layout(np.array(a), placed, sharding)
        new, handle = mgr.load([target], pages, [a.shape[0] - 1])
        handle.result()
        mgr.free(pages)
        return str(Layout.of(new[0]))


def _check_cpu_bytes(a: jax.Array, x: np.ndarray) -> tuple[str, Layout | None, str]:
    """Compares an XLA:CPU buffer with the physical images of its layout.

    Returns:
      ``(stored, dense, why)``: ``stored`` is "as reported" or "MISMATCH ...";
      ``dense`` is the untiled layout to re-place the array with when the buffer
      shows the CPU stores no tiles (None otherwise), and ``why`` says so.
    """
    reported = Layout.of(a)
    dense = common.untiled(reported)
    dense_img = emulate.to_image(x, dense)
    raw = common.cpu_buffer_bytes(a, dense_img.nbytes)
    if not reported.tiles:
        if np.array_equal(raw, dense_img):
            return "as reported", None, ""
        return f"MISMATCH: the buffer does not hold the {reported} image", None, ""
    tiled_img = emulate.to_image(x, reported)
    same = tiled_img.nbytes == dense_img.nbytes and np.array_equal(tiled_img, dense_img)
    if np.array_equal(raw, dense_img):
        why = (f"XLA:CPU accepted {reported}; its tiles move no byte of this shape and "
               f"XLA:CPU stores no tiles: re-placed as {dense}" if same else
               f"XLA:CPU accepted {reported} but stores the array densely (its buffer "
               f"bytes are the {dense} image): re-placed as {dense}, what it really stores")
        return "as reported", dense, why
    if tiled_img.nbytes == dense_img.nbytes and np.array_equal(raw, tiled_img):
        return "as reported", None, ""
    return f"MISMATCH: the buffer matches neither {reported} nor {dense}", None, ""


def _check_reported_tiles(a: jax.Array, out: dict[str, Any]) -> None:
    """Does kvxfer's direct path refuse an array whose REPORTED tiles it rejects?

    XLA:CPU reports tiles it does not store; the DESIGN rule is that the direct
    path refuses anything the inspector has not proven, and the inspector only
    sees the reported layout.
    """
    g = kvxfer.inspect(a)
    if g.addressable:
        return
    try:
        kvxfer.KVCacheManager([a], num_host_blocks=1, integrity="off", path="raw",
                              host_memory_budget=_BUDGET).close()
    except LayoutError:
        return
    except Exception as e:  # noqa: BLE001 - report, do not fail the probe on it
        out["findings"].append(f"registering {g.text} on the direct path raised "
                               f"{_first_line(e)}")
        return
    out["findings"].append(
        f"kvxfer's direct path ACCEPTS {g.text} as XLA:CPU reports it, though the "
        f"inspector rejects that layout (g={g.granularity}): the raw-copy check ignores "
        "reported tiles (safe here only because XLA:CPU stores none)")


def _cpu_emulation_device() -> Any | None:
    dev = common.device()
    if dev.platform == "cpu":
        return dev
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def probe_case(case: Case, *, pages: int, integrity: str, seed: int, emulated: bool
               ) -> dict[str, Any]:
    dev = common.device()
    sharding = jax.sharding.SingleDeviceSharding(dev)
    out: dict[str, Any] = {
        "name": case.name, "origin": case.origin, "shape": list(case.shape),
        "dtype": dtype_name(case.dtype), "block_dim": case.block_dim,
        "requested_layout": None if case.layout is None else str(case.layout),
        "notes": [case.note] if case.note else [], "disagreements": [], "findings": [],
        "limitations": [],
        "catalogue": ("-" if case.catalogue is None else
                      "agrees" if not case.catalogue else f"DISAGREES: {case.catalogue}"),
    }
    if case.catalogue:
        out["disagreements"].append(f"catalogue verdict: {case.catalogue}")
    if len(case.shape) < 2 or case.block_dim != 0:
        why = ("rank 1: the manager needs a block dim and a block" if len(case.shape) < 2
               else f"block_dim {case.block_dim}: the manager moves dim 0 only")
        out["notes"].append(f"skipped: {why}")
        out.update(placed_layout=None, stored="-", verdict=None,
                   staged={"status": "skipped"}, direct={"status": "skipped"},
                   emulated={"status": "skipped"}, skipped=why)
        return out
    x = common.random_array(case.shape, case.dtype, seed)

    # -- place it with the requested layout, see what the backend really holds ----------
    a, refused = common.put_with_layout(x, case.layout, sharding)
    if refused:
        out["notes"].append(refused)
    stored = "not checked (no host view of device memory on this backend)"
    if dev.platform == "cpu":
        stored, dense, why = _check_cpu_bytes(a, x)
        if dense is not None:
            _check_reported_tiles(a, out)
            out["notes"].append(why)
            a, _ = common.put_with_layout(x, dense, sharding)
            stored, _, _ = _check_cpu_bytes(a, x)
        if stored.startswith("MISMATCH"):
            out["disagreements"].append(f"buffer bytes: {stored}")
    out["stored"] = stored
    if not np.array_equal(common.bits(a), common.bits(x)):
        out["disagreements"].append("the placed array does not hold the values put")
    placed = Layout.of(a)
    out["placed_layout"] = str(placed)
    g = kvxfer.inspect(a)
    out["verdict"] = {"addressable": g.addressable, "granularity": g.granularity,
                      "bytes_per_block": g.bytes_per_block,
                      "padding_factor": g.padding_factor, "reason": g.reason}
    text = shape_text(a.shape, a.dtype, placed)

    # -- staged: every layout must round-trip byte-exact ---------------------------------
    try:
        exact, info = _round_trip([a], pages=pages, integrity=integrity, seed=seed,
                                  path="staged")
        out["staged"] = {"status": "byte-exact" if exact else "MISMATCH", **info}
        if not exact:
            out["disagreements"].append(f"staged round trip of {text} is not byte-exact")
    except Exception as e:  # noqa: BLE001 - the staged path must work for every layout
        out["staged"] = {"status": "ERROR", "error": _first_line(e)}
        out["disagreements"].append(f"staged path failed on {text}: {_first_line(e)}")
    else:
        try:
            kept = _layout_kept(a, placed, sharding, integrity)
        except Exception as e:  # noqa: BLE001 - a side check: report, do not fail
            out["findings"].append(f"could not load into a {placed} cache: {_first_line(e)}")
        else:
            out["staged"]["layout_kept"] = kept == str(placed)
            if kept != str(placed):
                out["findings"].append(
                    f"a staged load hands the cache back as {kept}, not its layout {placed} "
                    "(kvxfer's scatter does not pin its output layout)")

    # -- direct on the real buffer --------------------------------------------------------
    out["direct"] = _direct(a, g, placed, text, dev.platform, pages, integrity, seed, out)

    # -- direct over emulated TPU memory with the requested layout ------------------------
    if emulated:
        out["emulated"] = _emulated(case, x, pages, integrity, seed, out)
    else:
        out["emulated"] = {"status": "skipped (--noemulated)"}
    return out


def _direct(a: jax.Array, g: kvxfer.SliceGeometry, placed: Layout, text: str,
            platform: str, pages: int, integrity: str, seed: int, out: dict[str, Any]
            ) -> dict[str, Any]:
    try:
        exact, info = _round_trip([a], pages=pages, integrity=integrity, seed=seed,
                                  path="raw")
    except LayoutError as e:
        msg = str(e)
        names = str(placed) in msg
        if platform != "cpu":
            return {"status": "this backend has no direct path", "error": msg,
                    "names_layout": names}
        if not g.addressable:
            if names:
                return {"status": "refused: not addressable", "error": msg}
            out["disagreements"].append(f"direct path refused {text} without naming its "
                                        f"layout: {msg}")
            return {"status": "REFUSED, layout not named", "error": msg}
        # The inspector accepts it. XLA:CPU's raw copies cover row-major whole-byte
        # arrays only; anything else is a limitation of kvxfer's CPU direct path.
        row_major = placed.minor_to_major == tuple(range(a.ndim - 1, -1, -1)) and \
            not placed.tiles
        if row_major and not common.is_sub_byte(a.dtype):
            out["disagreements"].append(f"direct path refused {text}, which the inspector "
                                        f"accepts: {msg}")
            return {"status": "REFUSED an addressable array", "error": msg}
        why = "sub-byte" if common.is_sub_byte(a.dtype) else "not row-major"
        out["limitations"].append(f"{text} is addressable but kvxfer's CPU direct path "
                                  f"copies row-major whole-byte arrays only ({why})")
        return {"status": f"no direct path for this array ({why})", "error": msg}
    except Exception as e:  # noqa: BLE001
        out["disagreements"].append(f"direct path failed on {text}: {_first_line(e)}")
        return {"status": "ERROR", "error": _first_line(e)}
    if not g.addressable:
        out["disagreements"].append(f"direct path ACCEPTED {text}, which the inspector "
                                    f"rejects ({g.reason})")
        return {"status": "ACCEPTED a rejected layout", "byte_exact": exact, **info}
    if not exact:
        out["disagreements"].append(f"direct round trip of {text} is not byte-exact")
    return {"status": "byte-exact" if exact else "MISMATCH", **info}


def _emulated(case: Case, x: np.ndarray, pages: int, integrity: str, seed: int,
              out: dict[str, Any]) -> dict[str, Any]:
    cpu = _cpu_emulation_device()
    if cpu is None:
        return {"status": "skipped (no CPU device)"}
    layout = case.layout or Layout.row_major(len(case.shape))
    g = kvxfer.inspect(case.shape, case.dtype, layout)
    text = shape_text(case.shape, case.dtype, layout)
    a = jax.device_put(x, jax.sharding.SingleDeviceSharding(cpu)).block_until_ready()
    base = {"layout": str(layout), "addressable": g.addressable,
            "granularity": g.granularity, "bytes_per_block": g.bytes_per_block}
    try:
        exact, info = _round_trip([a], pages=pages, integrity=integrity, seed=seed,
                                  path="raw", layouts=[layout])
    except LayoutError as e:
        msg = str(e)
        if g.addressable:
            out["disagreements"].append(f"emulated direct path refused {text}, which the "
                                        f"inspector accepts: {msg}")
            return {"status": "REFUSED an addressable layout", "error": msg, **base}
        if str(layout) not in msg:
            out["disagreements"].append(f"emulated direct path refused {text} without "
                                        f"naming the layout: {msg}")
            return {"status": "REFUSED, layout not named", "error": msg, **base}
        return {"status": "refused: not addressable", "error": msg, **base}
    except Exception as e:  # noqa: BLE001
        out["disagreements"].append(f"emulated direct path failed on {text}: "
                                    f"{_first_line(e)}")
        return {"status": "ERROR", "error": _first_line(e), **base}
    if not g.addressable:
        out["disagreements"].append(f"emulated direct path ACCEPTED {text}, which the "
                                    f"inspector rejects")
        return {"status": "ACCEPTED a rejected layout", "byte_exact": exact, **info, **base}
    if not exact:
        out["disagreements"].append(f"emulated direct round trip of {text} is not byte-exact")
    return {"status": "byte-exact" if exact else "MISMATCH", **info, **base}


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def _verdict_cell(r: dict[str, Any]) -> str:
    v = r.get("verdict")
    if v is None:
        return "-"
    if v["addressable"]:
        return f"addressable ({common.format_bytes(v['bytes_per_block'])}/block)"
    return f"NOT addressable (g={v['granularity']})"


def _emulated_cell(r: dict[str, Any]) -> str:
    e = r["emulated"]
    if "layout" in e and e["layout"] != r.get("placed_layout"):
        return f"{e['status']} {e['layout']}"
    return e["status"]


def print_table(report: dict[str, Any]) -> None:
    rows = [[r["name"], shape_text(r["shape"], r["dtype"]), r.get("placed_layout") or "-",
             _verdict_cell(r), r["staged"]["status"], r["direct"]["status"], _emulated_cell(r)]
            for r in report["arrays"]]
    print(common.table(rows, ["array", "shape", "layout (real)", "verdict", "staged",
                              "direct", "emulated-direct (TPU layout)"]))
    print()
    dense = [r["name"] for r in report["arrays"]
             if any(n.startswith("XLA:CPU accepted") for n in r["notes"])]
    if dense:
        print(f"note: XLA:CPU accepted the tiled layouts of {len(dense)} arrays but stores "
              "them without tiles (checked against their buffer bytes); the real-buffer "
              "columns use the layout it really stores, the emulated column the TPU layout")
    for r in report["arrays"]:
        for n in r["notes"]:
            if not n.startswith(("one array for", "XLA:CPU accepted")) and \
                    "(--max_blocks)" not in n:
                print(f"note: {r['name']}: {n}")
    for key, title in (("limitations", "limitation"), ("findings", "kvxfer finding"),
                       ("disagreements", "DISAGREEMENT")):
        for item in report[key]:
            print(f"{title}: {item}")
    s = report["summary"]
    print(f"\n{s['arrays']} arrays on {report['backend']} ({report['device_kind']}): "
          f"{s['probed']} probed, {s['skipped']} skipped; staged byte-exact "
          f"{s['staged_exact']}/{s['probed']}; direct byte-exact {s['direct_exact']}, refused "
          f"as not addressable {s['direct_refused']}, no direct path {s['direct_none']}; "
          f"emulated byte-exact {s['emulated_exact']}, refused {s['emulated_refused']}: "
          + ("verdicts and hardware AGREE" if report["ok"] else
             f"{len(report['disagreements'])} DISAGREEMENT(S)"))


def run(catalogs: list[str], configs: list[str], *, num_blocks: int | None,
        max_blocks: int, pages: int, integrity: str, seed: int, emulated: bool
        ) -> dict[str, Any]:
    cases: list[Case] = []
    for path in catalogs:
        cases += catalogue_cases(path, max_blocks)
    for name in configs:
        cases += config_cases(name, num_blocks)
    results = []
    for case in cases:
        t0 = time.perf_counter()
        try:
            r = probe_case(case, pages=pages, integrity=integrity, seed=seed,
                           emulated=emulated)
        except Exception as e:  # noqa: BLE001 - one broken array must not hide the rest
            logging.exception("%s: the probe itself failed", case.name)
            r = {"name": case.name, "origin": case.origin, "shape": list(case.shape),
                 "dtype": dtype_name(case.dtype), "block_dim": case.block_dim,
                 "requested_layout": None if case.layout is None else str(case.layout),
                 "placed_layout": None, "verdict": None, "catalogue": "-", "notes": [],
                 "findings": [], "limitations": [],
                 "disagreements": [f"the probe failed: {_first_line(e)}"],
                 "staged": {"status": "ERROR"}, "direct": {"status": "ERROR"},
                 "emulated": {"status": "ERROR"}}
        r["seconds"] = round(time.perf_counter() - t0, 3)
        logging.info("%s: staged %s, direct %s, emulated %s (%.2f s)", case.name,
                     r["staged"]["status"], r["direct"]["status"], r["emulated"]["status"],
                     r["seconds"])
        results.append(r)
    probed = [r for r in results if "skipped" not in r]

    def count(col: str, status: str) -> int:
        return sum(r[col]["status"] == status for r in probed)

    dev = common.device()
    report = {
        "backend": dev.platform, "device_kind": getattr(dev, "device_kind", ""),
        "provenance": common.provenance(), "catalogs": catalogs, "configs": configs,
        "arrays": results,
        "disagreements": [f"{r['name']}: {d}" for r in results for d in r["disagreements"]],
        "findings": [f"{r['name']}: {d}" for r in results for d in r["findings"]],
        "limitations": [f"{r['name']}: {d}" for r in results for d in r["limitations"]],
        "summary": {
            "arrays": len(results), "probed": len(probed),
            "skipped": len(results) - len(probed),
            "staged_exact": count("staged", "byte-exact"),
            "direct_exact": count("direct", "byte-exact"),
            "direct_refused": count("direct", "refused: not addressable"),
            "direct_none": sum(r["direct"]["status"].startswith(("this backend has no",
                                                                 "no direct path"))
                               for r in probed),
            "emulated_exact": count("emulated", "byte-exact"),
            "emulated_refused": count("emulated", "refused: not addressable"),
        },
    }
    report["ok"] = not report["disagreements"]
    return report


def main(argv: list[str]) -> int:
    del argv  # flags only: common.parse_flags refuses other arguments
    configs = common.split_names(FLAGS.config)
    catalogs = list(FLAGS.catalog or ([] if configs else DEFAULT_CATALOGS))
    try:
        report = run(catalogs, configs, num_blocks=FLAGS.num_blocks,
                     max_blocks=FLAGS.max_blocks, pages=FLAGS.pages,
                     integrity=FLAGS.integrity, seed=FLAGS.seed, emulated=FLAGS.emulated)
    except (LayoutError, ValueError, OSError) as e:  # bad catalogue or config
        print(f"roundtrip_probe: {e}", file=sys.stderr)
        return 2
    common.show(report, FLAGS.json, print_table)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    app.run(main, flags_parser=common.parse_flags)
