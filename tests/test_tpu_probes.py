"""The TPU VM probes (``tpu_probes/``), run as a user would, on the CPU backend.

Each script runs as a subprocess (``python tpu_probes/<script>.py ... --json``) from
the repository root with ``JAX_PLATFORMS=cpu``, at small sizes; the tests check
its JSON output, never timings.
"""

import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import kvxfer
from kvxfer import catalog, config

ROOT = Path(__file__).resolve().parent.parent
CATALOGS = ("seeds", "tpu_kv_derived")  # built-in names: found wherever kvxfer is installed


def run_probe(script, *args, timeout=240):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, f"tpu_probes/{script}", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def json_out(r):
    assert r.stdout.strip(), f"no output; stderr:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


# ---------------------------------------------------------------------------
# capture_layouts.py
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    out = tmp_path_factory.mktemp("capture") / "captured.json"
    r = run_probe("capture_layouts.py", "--num_blocks", "16", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, json_out(r)


def test_capture_writes_the_catalogue_it_prints(captured):
    out, printed = captured
    assert json.loads(out.read_text()) == printed
    assert set(printed) == {"description", "provenance", "arrays"}


def test_capture_provenance(captured):
    _, cat = captured
    p = cat["provenance"]
    assert p["backend"] == "cpu" and p["device_kind"] == jax.devices()[0].device_kind
    assert p["jax"] == jax.__version__ and p["jaxlib"]
    date = datetime.datetime.fromisoformat(p["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert "capture_layouts.py" in p["command"] and "--num_blocks 16" in p["command"]


def test_capture_covers_every_config_and_seed_shape(captured):
    _, cat = captured
    shapes = {(tuple(a["shape"]), a["dtype"]) for a in cat["arrays"]}
    for name in config.builtin_names():
        spec = config.load(name)
        for g in spec.groups:
            assert ((16, *g.block_shape), g.dtype) in shapes, (name, g.name)
    for e in catalog.load("seeds").entries:
        assert (tuple(e.shape), e.dtype) in shapes, e.name
    # identical (shape, dtype, layout) captures of one config are merged into one entry
    keys = [(a["name"].split("/")[0], tuple(a["shape"]), a["dtype"], a["layout"])
            for a in cat["arrays"]]
    assert len(keys) == len(set(keys))
    assert any(a["name"] == "llama3-8b/attn.0/device_put+jit_auto+jit_auto_input"
               for a in cat["arrays"])


def test_captured_verdicts_equal_the_inspector(captured):
    out, _ = captured
    cat = catalog.load(out)
    assert cat.entries
    for r in cat.check():
        assert r.agrees, (r.entry.name, r.disagreement)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for e in cat.entries:
        assert e.block_dim == 0 and e.source == "captured on cpu (cpu)"
        assert set(e.expected) == {"addressable", "granularity", "bytes_per_block"}
        if "device_put" in e.name:  # the same array, placed here, inspects the same
            a = jax.device_put(np.zeros(e.shape, kvxfer.layout.dtype_of(e.dtype)), sharding)
            assert str(kvxfer.Layout.of(a)) == e.layout
            g = kvxfer.inspect(a)
            assert (g.addressable, g.granularity, g.bytes_per_block) == (
                e.expected["addressable"], e.expected["granularity"],
                e.expected["bytes_per_block"])


def test_captured_catalogue_passes_kvxfer_inspect(captured):
    out, cat = captured
    r = subprocess.run([sys.executable, "-m", "kvxfer", "inspect", "--catalog", str(out),
                        "--json"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    objs = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    assert len(objs) == len(cat["arrays"])
    for obj, entry in zip(objs, cat["arrays"]):
        assert obj["layout"] == entry["layout"]
        for k in ("addressable", "granularity", "bytes_per_block"):
            assert obj[k] == entry["expected"][k], (entry["name"], k)


def test_backend_tag_and_default_name():
    sys.path.insert(0, str(ROOT / "tpu_probes"))
    try:
        import _common as common
    finally:
        sys.path.remove(str(ROOT / "tpu_probes"))

    class Dev:
        def __init__(self, platform, kind):
            self.platform, self.device_kind = platform, kind

    assert common.backend_tag(Dev("cpu", "cpu")) == "cpu"
    assert common.backend_tag(Dev("tpu", "TPU v5 lite")) == "tpu_v5_lite"
    assert common.backend_tag(Dev("tpu", "TPU7x")) == "tpu7x"
    assert common.backend_tag(Dev("tpu", "v6e")) == "tpu_v6e"
    assert common.backend_tag(Dev("gpu", "NVIDIA H200")) == "gpu_nvidia_h200"
    assert common.sanitize("  a/b  c ") == "a_b_c"


# ---------------------------------------------------------------------------
# roundtrip_probe.py
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def roundtrip():
    args = [a for c in CATALOGS for a in ("--catalog", c)]
    r = run_probe("roundtrip_probe.py", *args, "--config", "tiny", "--max_blocks", "64",
                  "--pages", "8", "--json")
    return r, json_out(r)


def test_roundtrip_agrees_everywhere(roundtrip):
    r, report = roundtrip
    assert r.returncode == 0, (report["disagreements"], r.stderr[-2000:])
    assert report["ok"] and report["disagreements"] == []
    assert report["backend"] == "cpu"
    names = [a["name"] for a in report["arrays"]]
    expected = [e.name for c in CATALOGS for e in catalog.load(c).entries]
    assert names == expected + ["tiny/kv32.0", "tiny/kv16.0"]


def test_roundtrip_staged_is_byte_exact_for_every_array(roundtrip):
    _, report = roundtrip
    probed = [a for a in report["arrays"] if "skipped" not in a]
    assert len(probed) >= 28
    for a in probed:
        assert a["staged"]["status"] == "byte-exact", a["name"]
        assert a["staged"]["verified_prefix"] == a["staged"]["pages"] > 0
        assert a["stored"] == "as reported", a["name"]  # buffer bytes checked on CPU
    skipped = {a["name"] for a in report["arrays"] if "skipped" in a}
    assert skipped == {"layer-major-block-dim-1", "size1-major-block-dim-1",
                       "rank1-f32-T1024"}


def test_roundtrip_emulated_refusals_are_exactly_the_rejected_layouts(roundtrip):
    _, report = roundtrip
    expected = {e.name: e.expected.get("addressable") for c in CATALOGS
                for e in catalog.load(c).entries}
    expected.update({"tiny/kv32.0": True, "tiny/kv16.0": True})
    for a in report["arrays"]:
        if "skipped" in a:
            continue
        emu = a["emulated"]
        assert emu["addressable"] == expected[a["name"]], a["name"]
        if expected[a["name"]]:
            assert emu["status"] == "byte-exact", a["name"]
        else:
            assert emu["status"] == "refused: not addressable", a["name"]
            assert emu["layout"] in emu["error"]  # the refusal names the layout
        if a["catalogue"] != "-":
            assert a["catalogue"] == "agrees", a["name"]
    assert report["summary"]["emulated_refused"] == sum(
        not v for k, v in expected.items()
        if k not in {"layer-major-block-dim-1", "rank1-f32-T1024"})


def test_roundtrip_direct_follows_the_real_verdict(roundtrip):
    _, report = roundtrip
    for a in report["arrays"]:
        if "skipped" in a:
            continue
        direct = a["direct"]["status"]
        if not a["verdict"]["addressable"]:
            assert direct == "refused: not addressable", a["name"]
            assert a["placed_layout"] in a["direct"]["error"]
        elif a["dtype"] == "int4":  # CPU raw copies need whole-byte elements
            assert direct.startswith("no direct path for this array"), a["name"]
        else:
            assert direct == "byte-exact", a["name"]
    by_name = {a["name"]: a for a in report["arrays"]}
    # XLA:CPU keeps the dim order of the seed layout but not its tiles
    seed = by_name["seed-block-dim-inside-tile"]
    assert seed["placed_layout"] == "{2,0,1}" and not seed["verdict"]["addressable"]
    assert any("stores the array densely" in n for n in seed["notes"])


def test_roundtrip_exits_nonzero_on_a_wrong_catalogue_verdict(tmp_path):
    bad = {"description": "a deliberately wrong verdict", "arrays": [
        {"name": "wrong", "shape": [16, 8, 128], "dtype": "bfloat16",
         "layout": "{2,1,0:T(8,128)(2,1)}", "source": "test",
         "expected": {"addressable": False}}]}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    r = run_probe("roundtrip_probe.py", "--catalog", str(path), "--json")
    report = json_out(r)
    assert r.returncode == 1 and not report["ok"]
    assert any("catalogue verdict" in d and "addressable" in d
               for d in report["disagreements"])
    r = run_probe("roundtrip_probe.py", "--catalog", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "missing.json" in r.stderr


def test_roundtrip_of_the_engines_arrays_is_byte_exact():
    r = run_probe("roundtrip_probe.py", "--catalog", "engines_derived", "--max_blocks", "8",
                  "--pages", "4", "--json")
    report = json_out(r)
    assert r.returncode == 0 and report["ok"], (report["disagreements"], r.stderr[-2000:])
    names = [a["name"] for a in report["arrays"]]
    assert names == [e.name for e in catalog.load("engines_derived").entries]
    for a in report["arrays"]:
        assert a["catalogue"] == "agrees", a["name"]
        for col in ("staged", "direct", "emulated"):
            assert a[col]["status"] == "byte-exact", (a["name"], col)


# ---------------------------------------------------------------------------
# engine_layouts.py
# ---------------------------------------------------------------------------


def _engine_layouts_module():
    sys.path.insert(0, str(ROOT / "tpu_probes"))
    try:
        import engine_layouts
    finally:
        sys.path.remove(str(ROOT / "tpu_probes"))
    return engine_layouts


def _layouts_listing() -> list[str]:
    """The files where a probe writes its catalogue by default (none where the probes
    run from a copy without the checkout's layouts/)."""
    layouts = ROOT / "layouts"
    return sorted(p.name for p in layouts.iterdir()) if layouts.is_dir() else []


def test_engine_layouts_on_cpu_say_nothing_authoritative_was_captured():
    before = _layouts_listing()
    r = run_probe("engine_layouts.py", "--max_blocks", "4", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json_out(r)
    assert report["backend"] == "cpu" and report["authoritative"] is False
    assert "captured nothing authoritative" in report["summary"]
    assert report["written"] is None and report["refuted"] == [] and report["confirmed"] == 0
    assert _layouts_listing() == before  # no file
    cat = catalog.load("engines_derived")
    arrays = {(tuple(e.shape[1:]), e.dtype) for e in cat.entries}
    rows = report["rows"]
    assert {r["method"] for r in rows} == {"engine_alloc", "device_put"}
    assert len(rows) == 2 * len(arrays)
    for row in rows:
        assert row["result"] == "not authoritative" and row["matches"] == []
        rank = len(row["derived"][0].split(":")[0].split(","))
        assert row["captured"] == "{" + ",".join(map(str, range(rank - 1, -1, -1))) + "}"
    r = run_probe("engine_layouts.py", "--max_blocks", "4")  # the table says so too
    assert r.returncode == 0 and "captured nothing authoritative" in r.stdout


def test_engine_layouts_out_is_a_catalogue_kvxfer_inspect_passes(tmp_path):
    out = tmp_path / "engines_cpu.json"
    r = run_probe("engine_layouts.py", "--max_blocks", "4", "--methods", "engine_alloc",
                  "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json_out(r)["written"] == str(out)
    cat = catalog.load(out)
    assert cat.entries and all(e.source == "captured on cpu (cpu)" for e in cat.entries)
    assert all(e.name.endswith("/engine_alloc") for e in cat.entries)
    assert cat.provenance["catalog"] == "engines_derived"
    r = subprocess.run([sys.executable, "-m", "kvxfer", "inspect", "--catalog", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_engine_layouts_judge_a_capture_against_its_claims_and_alternatives(tmp_path):
    # A catalogue of arrays whose XLA:CPU layout is known ({2,1,0}), judged as a TPU's.
    arrays = [
        {"name": "a-bf16", "shape": [4, 8, 128], "dtype": "bfloat16", "layout": "{2,1,0}",
         "source": "derived"},
        {"name": "b-bf16", "shape": [4, 16, 128], "dtype": "bfloat16",
         "layout": "{2,1,0:T(8,128)(2,1)}", "source": "derived"},
        {"name": "b-bf16-if-full-tile", "shape": [4, 16, 128], "dtype": "bfloat16",
         "layout": "{2,1,0}", "source": "derived"},
        {"name": "c-f32", "shape": [4, 8, 128], "dtype": "float32",
         "layout": "{2,1,0:T(8,128)}", "source": "derived"}]
    path = tmp_path / "claims.json"
    path.write_text(json.dumps({"arrays": arrays}))
    probe = _engine_layouts_module()
    report = probe.capture(str(path), 0, ["device_put"], authoritative=True)
    results = {row["name"]: row["result"] for row in report["rows"]}
    assert results == {"a-bf16": "confirmed",
                       "b-bf16": "REFUTED (matches b-bf16-if-full-tile)",
                       "c-f32": "REFUTED"}
    assert report["confirmed"] == 1 and len(report["refuted"]) == 2 and not report["ok"]
    assert any("derived {2,1,0:T(8,128)}, captured {2,1,0}" in x for x in report["refuted"])
    assert report["summary"].startswith("1 of 3 captures on cpu")
    assert len(report["captured"].entries) == 3


def test_engine_layouts_refuse_bad_flags():
    r = run_probe("engine_layouts.py", "--methods", "nope")
    assert r.returncode == 2 and "nope" in r.stderr
    r = run_probe("engine_layouts.py", "--catalog", "no-such-catalogue")
    assert r.returncode == 2 and "no-such-catalogue" in r.stderr


# ---------------------------------------------------------------------------
# bandwidth_probe.py
# ---------------------------------------------------------------------------


def test_bandwidth_probe_reports_positive_finite_numbers():
    r = run_probe("bandwidth_probe.py", "--block_sizes", "16,64", "--batch_sizes", "1,4",
                  "--num_layers", "2", "--iters", "2", "--limit_mib", "8", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json_out(r)
    assert report["backend"] == "cpu" and report["unavailable"] == {}
    cells = {(x["path"], x["block_kib"], x["batch"]) for x in report["results"]}
    assert cells == {(p, k, b) for p in ("staged", "raw") for k in (16, 64) for b in (1, 4)}
    for x in report["results"]:
        assert x["bytes"] == x["batch"] * 2 * x["block_kib"] * 1024
        for key in ("d2h_gbps", "h2d_gbps", "limit_d2h_gbps", "limit_h2d_gbps",
                    "d2h_fraction", "h2d_fraction"):
            assert math.isfinite(x[key]) and x[key] > 0, (key, x)
    assert {x["path"]: x["movers"] for x in report["results"]} == {
        "staged": ["staged"], "raw": ["raw"]}
    lim = report["limits"]
    assert lim["d2h_how"] == "numpy memcpy"
    assert all(math.isfinite(m[k]) and m[k] > 0 for m in lim["measurements"]
               for k in ("d2h_gbps", "h2d_gbps"))


# ---------------------------------------------------------------------------
# mover_probe.py
# ---------------------------------------------------------------------------


def test_mover_probe_reports_per_layer_throughput_of_each_path():
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
    r = subprocess.run([sys.executable, "tpu_probes/mover_probe.py", "--platform", "cpu",
                        "--config", "tiny", "--pages", "3", "--num_blocks", "8",
                        "--devices", "2", "--iters", "1", "--warmup", "0", "--json"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json_out(r)
    assert report["ok"] and report["failures"] == []
    assert (report["backend"], report["config"], report["devices"]) == ("cpu", "tiny", 2)
    assert report["integrity"] == "page" and set(report["paths"]) == {"pallas", "pinned"}
    spec = config.load_builtin("tiny")
    plan = kvxfer.make_plan([kvxfer.plan.LayerSpec(f"L{i}", (8, *g.block_shape), g.dtype)
                             for g in spec.groups for i in range(g.count)], 3)
    pallas = report["paths"]["pallas"]
    assert pallas["status"] == "measured" and pallas["movers"] == ["pallas"]
    assert "interpret mode" in pallas["note"]
    layers = pallas["layers"]
    assert [x["layer"] for x in layers] == list(range(spec.num_layers))
    for x in layers:  # every shard of the layer: the bytes of its dense blocks
        assert x["bytes"] == 3 * plan.class_of_layer(x["layer"])[0].bytes_per_block
        for key in ("offload_gbps", "load_gbps", "ready_gbps", "ready_step_gbps"):
            assert math.isfinite(x[key]) and x[key] > 0, (key, x)
    assert [x["ready_s"] for x in layers] == sorted(x["ready_s"] for x in layers)
    total = pallas["total"]
    assert total["bytes"] == sum(x["bytes"] for x in layers)
    assert total["offload_gbps"] > 0 and total["load_gbps"] > 0
    pinned = report["paths"]["pinned"]
    if pinned["status"] == "refused":  # a kvxfer without the pinned mover says so
        assert "pinned" in pinned["reason"]
    else:
        assert pinned["status"] == "measured" and pinned["movers"] == ["pinned"]


def test_mover_probe_refuses_bad_flags():
    r = run_probe("mover_probe.py", "--pages", "0")
    assert r.returncode == 2 and "--pages" in r.stderr
    r = run_probe("mover_probe.py", "--config", "no-such-model")
    assert r.returncode == 2 and "no-such-model" in r.stderr


# ---------------------------------------------------------------------------
# compiled_layouts.py
# ---------------------------------------------------------------------------


def test_compiled_layouts_on_cpu_allocate_every_array_and_claim_nothing():
    r = run_probe("compiled_layouts.py", "--max_blocks", "4", "--max_devices", "2",
                  "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json_out(r)
    assert report["backend"] == "cpu" and report["authoritative"] is False
    assert "checked nothing authoritative" in report["summary"]
    assert report["differs"] == [] and report["failures"] == []
    assert report["compiled_with"]["libtpu"]  # the catalogue says what compiled it
    rows = report["rows"]
    assert rows and all(r["result"] == "not authoritative" for r in rows)
    assert all(r["shape"][0] <= 4 and r["shards"] <= 2 for r in rows)
    # Both ends of a range that starts low: llama3-8b's one-shard range from 1 block.
    ends = {r["shape"][0] for r in rows if r["name"].startswith("llama3-8b/attn/shards1/")}
    assert ends == {1, 4}
    # What could not run here is said, not dropped.
    assert any("shards4" in s for s in report["skipped"])
    assert any("from 116 blocks" in s for s in report["skipped"])
    # XLA:CPU lays every array out row-major.
    assert all(":" not in r["runtime"] for r in rows)


# ---------------------------------------------------------------------------
# inplace_probe.py
# ---------------------------------------------------------------------------


def test_inplace_probe_checks_the_route_and_writes_which_one_auto_should_take(tmp_path):
    out = tmp_path / "inplace.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "tpu_probes/inplace_probe.py", "--platform", "cpu",
                        "--config", "tiny", "--pages", "2", "--iters", "1", "--warmup", "0",
                        "--out", str(out), "--json"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json_out(r)
    assert json.loads(out.read_text()) == report  # what it printed is what it wrote
    assert report["ok"] and report["failures"] == [] and report["backend"] == "cpu"
    chip = report["per_chip"]["in-place"]["cpu:0"]
    assert chip["status"] == "measured" and chip["reason"].endswith("in place")
    assert chip["aliased"] is True and chip["host_copy_bytes"] == 0 and chip["exact"]
    pages = report["per_chip"]["pages"]["cpu:0"]
    assert pages["status"] == "measured" and "pages route" in pages["reason"]
    assert pages["host_copy_bytes"] == 0
    for scope in ("per_chip", "per_host"):
        put = report[scope]["device_put"]
        put = put["cpu:0"] if scope == "per_chip" else put
        assert put["offload_gbps"] > 0 and put["load_gbps"] > 0
    assert report["verdict"]["auto"] in ("in-place", "pages") and report["verdict"]["why"]
