"""kvxfer against the real XLA:TPU compiler (libtpu, deviceless): the configs' and
catalogues' layouts are what it chooses, and ``--target`` asks it.

libtpu is the ``tpu`` extra; ``.ci/run`` installs it and sets KVXFER_REQUIRE_TPU=1, so
in CI these tests fail rather than skip without it.
"""

import json
import warnings
import os
import sys

import pytest

import kvxfer
from kvxfer import catalog, cli, config, tpu

if not tpu.available():
    if os.environ.get("KVXFER_REQUIRE_TPU") == "1":
        raise RuntimeError("KVXFER_REQUIRE_TPU=1 but libtpu is not installed: "
                           "pip install 'kvxfer[tpu]'")
    pytest.skip("libtpu is not installed (pip install 'kvxfer[tpu]')",
                allow_module_level=True)

GENERATIONS = tpu.GENERATIONS


def _ranges():
    """(config, group, shards, first, last, layout) for every compiled range."""
    for name in config.builtin_names():
        for g in config.load(name).groups:
            for shards, first, last, layout in g.tpu_compiled:
                yield name, g, shards, first, last, layout


def _compile(g, n, shards, target):
    return str(tpu.compiled_layout((n, *g.block_shape), g.dtype, target, num_devices=shards,
                                   shard_dim=g.shard_dim if shards > 1 else None).layout)


def test_every_config_group_has_compiled_choices_for_every_shard_count():
    for name in config.builtin_names():
        for g in config.load(name).groups:
            shards = {c[0] for c in g.tpu_compiled}
            want = {1} | ({d for d in (2, 4, 8) if g.num_shards(d) == d}
                          if g.shard_dim else set())
            assert shards == want, (name, g.name)
            for s in shards:  # ranges from 1 block up to engine sizes, no gaps
                rs = [c for c in g.tpu_compiled if c[0] == s]
                assert rs[0][1] == 1 and rs[-1][2] >= 12000, (name, g.name, s)
                assert all(b[1] == a[2] + 1 for a, b in zip(rs, rs[1:])), (name, g.name)


@pytest.mark.parametrize("target", GENERATIONS)
def test_configs_hold_the_compilers_choice_at_each_end_of_each_range(target):
    """The largest count of each range on every generation; the smallest on one (where
    a choice flips, the first count of the next range is the flip)."""
    wrong, unfit = [], []
    for name, g, shards, first, last, layout in _ranges():
        counts = (first, last) if target == "v6e" else (last,)
        for n in counts:
            try:
                got = _compile(g, n, shards, target)
            except ValueError as e:
                # Another libtpu may fit a range end no longer (three v4 ends under
                # 0.0.52, by 772 KiB): reported, not failed; a layout that changed fails.
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                unfit.append(f"{name}/{g.name} x{shards} at {n} on {target}")
                continue
            if got != layout:
                wrong.append(f"{name}/{g.name} x{shards} at {n}: config {layout}, "
                             f"compiler {got}")
    if unfit:
        warnings.warn(f"libtpu {tpu.libtpu_version()}: range ends that no longer fit HBM "
                      f"(regenerate with tools/tpu_catalog.py): {unfit}")
    assert not wrong, wrong


def test_tpu_layout_is_the_engine_size_choice_or_says_why_not():
    for name in config.builtin_names():
        for g in config.load(name).groups:
            one = [c for c in g.tpu_compiled if c[0] == 1]
            if g.tpu_layout_note is None:
                assert g.tpu_layout == one[-1][3], (name, g.name)
            else:
                assert g.tpu_layout != one[-1][3], (name, g.name, "note without reason")


def test_layouts_follow_the_block_count_and_the_shard_count():
    mla = config.load("deepseek-mla")
    g = mla.groups[0]
    # A DeepSeek MLA latent is addressable up to 115 blocks, not from 116.
    assert g.geometry(115).addressable and not g.geometry(116).addressable
    assert "changes with the block count" in g.compiled_note(4096)
    llama = config.load("llama3-8b")
    specs = {d: llama.layer_specs(1024, num_devices=d)[0] for d in (1, 2, 4, 8)}
    assert [specs[d].shard_geometry.bytes_per_block for d in (1, 2, 4, 8)] \
        == [64 << 10, 32 << 10, 16 << 10, 8 << 10]
    assert str(llama.tpu_layouts(1024, num_devices=4)[0]) == "{4,3,2,1,0:T(2,128)(2,1)}"
    # A layout kept on purpose holds at every count.
    tiny = config.load("tiny").groups[0]
    assert tiny.layout_for(4096, 2) == tiny.layout and "kept on purpose" in \
        tiny.compiled_note(4096)


@pytest.mark.parametrize("name", ["seeds", "tpu_kv_derived", "engines_derived"])
def test_derived_catalogues_say_which_layouts_the_compiler_picks(name):
    cat = catalog.load(name)
    assert all(r.agrees for r in cat.check())
    for e in cat.entries:
        got = {t: str(tpu.compiled_layout(e.shape, e.dtype, t).layout) for t in GENERATIONS}
        assert len(set(got.values())) == 1, (e.name, got)
        assert e.tpu_default is (got["v6e"] == e.layout), (e.name, got["v6e"])
        assert e.tpu_default or e.tpu_default_note, e.name


def test_the_upstream_reports_failure_is_the_compilers_own_choice():
    for target in GENERATIONS:
        c = tpu.compiled_layout((512, 3, 2048), "bfloat16", target)
        assert str(c.layout) == "{2,0,1:T(8,128)(2,1)}"
        g = c.geometry()
        assert not g.addressable and g.granularity == 512 and c.libtpu == tpu.libtpu_version()


def test_the_compiled_catalogue_agrees_with_the_configs_and_the_inspector():
    cat = catalog.load("tpu_compiled")
    assert all(r.agrees for r in cat.check())
    raw = json.loads(open(catalog._resources.find("layouts", "tpu_compiled"),
                          encoding="utf-8").read())
    # Made by some libtpu (a newer one may be installed: no version is pinned here).
    assert isinstance(raw["provenance"]["libtpu"], str) and raw["provenance"]["libtpu"]
    assert set(raw["provenance"]["topologies"]) == set(GENERATIONS)
    rows = {(a["config"], a["group"], a["shards"], tuple(a["blocks"])): a["layout"]
            for a in raw["arrays"] if "config" in a}
    want = {(name, g.name, s, (first, last)): layout
            for name, g, s, first, last, layout in _ranges()}
    assert rows == want


def _run(capsys, *argv):
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_inspect_target_reports_the_compilers_layout_and_the_nearest_addressable(capsys):
    status, out, err = _run(capsys, "inspect", "--shape", "4096,16,576", "--dtype", "bf16",
                            "--target", "v6e", "--json")
    assert status == 0, err
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert (row["layout"], row["addressable"], row["granularity"]) == \
        ("{0,2,1:T(8,128)(2,1)}", False, 4096)
    assert row["layout_source"] == "compiler" and row["libtpu"] == tpu.libtpu_version()
    assert row["target"] == "v6e:2x2"
    assert row["addressable_alternatives"][0]["shape"] == [4096, 16, 640]
    status, out, _ = _run(capsys, "inspect", "--shape", "4096,16,576", "--dtype", "bf16",
                          "--target", "v6e")
    assert status == 0 and "nearest shape that is: [4096, 16, 640]" in out
    assert "layout from the TPU compiler: v6e:2x2" in out


def test_inspect_target_config_is_per_shard(capsys):
    status, out, err = _run(capsys, "inspect", "--config", "llama3-8b", "--target", "tpu7x",
                            "--devices", "4", "--num-blocks", "2048", "--json")
    assert status == 0, err
    rows = [json.loads(line) for line in out.splitlines()]  # one a layer, as every source
    assert [r["layer"] for r in rows] == list(range(32)) and rows[0] == dict(rows[31], **{
        k: rows[0][k] for k in ("layer", "name")})
    row = rows[0]
    assert row["shape"] == [2048, 16, 2, 8, 128] and row["bytes_per_block"] == 16 << 10
    assert row["shard_shape"] == [2048, 16, 2, 2, 128]
    assert row["layout"] == "{4,3,2,1,0:T(2,128)(2,1)}" and row["devices"] == 4


def test_plan_target_agrees_with_the_config_and_names_the_source(capsys):
    for n, devices in ((64, 1), (4096, 1), (512, 4)):
        for name in ("deepseek-mla", "llama3-8b-fp8"):
            status, out, err = _run(capsys, "plan", "--config", name, "--target", "v5p",
                                    "--num-blocks", str(n), "--devices", str(devices),
                                    "--json", "--budget", str(1 << 40))
            assert status == 0, err
            compiled = json.loads(out)
            status, out, err = _run(capsys, "plan", "--config", name, "--num-blocks",
                                    str(n), "--devices", str(devices), "--json",
                                    "--budget", str(1 << 40))
            from_config = json.loads(out)
            assert compiled["layout_source"] == "compiler" and compiled["libtpu"]
            assert from_config["layout_source"] == "config"
            strip = ("layout_source", "target", "device_kind", "libtpu", "num_blocks",
                     "groups", "addressable_alternatives", "layout_notes", "budget_bytes")
            assert {k: v for k, v in compiled.items() if k not in strip} == \
                {k: v for k, v in from_config.items() if k not in strip}, (name, n)
    status, out, _ = _run(capsys, "plan", "--config", "deepseek-mla", "--target", "v5e",
                          "--num-blocks", "4096")
    assert "nearest shape that is: [4096, 16, 640]" in out and "libtpu" in out


def test_without_libtpu_the_target_is_one_line_naming_the_extra(capsys, monkeypatch):
    monkeypatch.setattr(tpu, "libtpu_version", lambda: None)
    for argv in (["inspect", "--shape", "8,8", "--dtype", "bf16", "--target", "v6e"],
                 ["plan", "--config", "tiny", "--target", "v6e"]):
        status, out, err = _run(capsys, *argv)
        assert status == 2 and not out and len(err.splitlines()) == 1
        assert "kvxfer[tpu]" in err


def test_bad_targets_are_one_line(capsys):
    for argv, want in ((["--target", "v9"], "unknown TPU generation 'v9'"),
                       (["--target", "v6e", "--devices", "64", "--shard-dim", "1"],
                        "num_devices=64"),
                       (["--target", "v6e", "--layout", "{1,0}"], "give one")):
        status, out, err = _run(capsys, "inspect", "--shape", "64,64", "--dtype", "bf16",
                                *argv)
        assert status == 2 and len(err.splitlines()) == 1 and want in err, err


def test_public_names():
    assert kvxfer.tpu is tpu and tpu.topology("v5p", 8) == "v5p:2x2x2"


def _tpu_catalog():
    """``tools/tpu_catalog.py`` (a maintainer's tool, outside the package), imported."""
    import importlib.util
    from pathlib import Path

    if "tpu_catalog" in sys.modules:
        return sys.modules["tpu_catalog"]
    path = Path(__file__).resolve().parent.parent / "tools" / "tpu_catalog.py"
    spec = importlib.util.spec_from_file_location("tpu_catalog", path)
    tpu_catalog = importlib.util.module_from_spec(spec)
    sys.modules["tpu_catalog"] = tpu_catalog  # its dataclasses look it up
    spec.loader.exec_module(tpu_catalog)
    return tpu_catalog


def test_the_generator_writes_back_exactly_the_shipped_configs():
    """`python tools/tpu_catalog.py` rewrites each config from the compiler's choices;
    given the choices the config holds, it must write the file as shipped (so the
    generator and the loader read and write one format, and no hand edit drifted)."""
    from kvxfer import _resources
    tpu_catalog = _tpu_catalog()

    # The libtpu that made the shipped files (an installed one may be newer).
    version = json.loads(catalog._resources.find("layouts", "tpu_compiled").read_text(
        encoding="utf-8"))["provenance"]["libtpu"]
    for name in config.builtin_names():
        path = _resources.find("configs", name)
        text = path.read_text(encoding="utf-8")
        spec = config.load(name)
        choices = {g.name: [tpu_catalog.Choice(*c) for c in g.tpu_compiled]
                   for g in spec.groups}
        assert tpu_catalog.config_text(text, choices, version) == text, name


def test_the_generators_check_says_what_changed():
    """``tools/tpu_catalog.py --check`` under another libtpu: a largest count that no
    longer fits is told apart from a layout that changed."""
    tc = _tpu_catalog()
    g = config.load("deepseek-mla").groups[0]
    shipped = [tc.Choice(*c) for c in g.tpu_compiled]
    assert tc.choice_changes("mla", shipped, shipped) == []
    *head, top = shipped
    moved = head + [tc.Choice(top.shards, top.first, top.last - 7, top.layout)]
    assert tc.choice_changes("mla", shipped, moved) == [
        f"mla x1: fits up to {top.last - 7} blocks, was {top.last} (layouts unchanged)"]
    flipped = [tc.Choice(1, 1, top.last, shipped[0].layout)]
    (line,) = tc.choice_changes("mla", shipped, flipped)
    assert line.startswith("mla x1: layouts changed: 1-115 ") and line.endswith(
        f"-> 1-{top.last} {shipped[0].layout}")
