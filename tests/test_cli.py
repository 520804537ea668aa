"""The command line, run as a user would (a subprocess of the installed entry point)."""

import argparse
import json
import pathlib
import subprocess
import sys

import pytest

from test_layout import SEEDS

INSPECT_KEYS = {"shape", "dtype", "layout", "block_dim", "physical_bytes", "logical_bytes",
                "addressable", "bytes_per_block", "granularity", "padding_factor", "reason"}


def kvxfer(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "kvxfer", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


@pytest.mark.parametrize("shape, dtype, text, addressable, bpb, gran, physical", SEEDS)
def test_inspect_json_seed_cases(shape, dtype, text, addressable, bpb, gran, physical):
    r = kvxfer("inspect", "--shape", ",".join(map(str, shape)), "--dtype", dtype,
               "--layout", text, "--json")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    assert set(obj) == INSPECT_KEYS
    assert (obj["addressable"], obj["bytes_per_block"], obj["granularity"],
            obj["physical_bytes"], obj["layout"]) == (addressable, bpb, gran, physical, text)


def test_inspect_human_table_uses_binary_units():
    r = kvxfer("inspect", "--shape", "512,16,2048", "--dtype", "bf16",
               "--layout", "{2,1,0:T(8,128)(2,1)}")
    assert r.returncode == 0
    assert "64 KiB" in r.stdout and "32 MiB" in r.stdout and "addressable" in r.stdout


@pytest.mark.parametrize("args, match", [
    (["--shape", "512,3", "--dtype", "bf16", "--layout", "{2,0,1}"], "rank 3"),
    (["--shape", "512,x", "--dtype", "bf16"], "comma-separated integers"),
    (["--shape", "512,3", "--dtype", "bfloat17"], "Unknown dtype 'bfloat17'"),
    (["--shape", "512,3", "--dtype", "bf16", "--layout", "{1,0:T(8,128"], "braces"),
    (["--shape", "512,3"], "--dtype is required"),
    (["--catalog", "no/such/file.json"], "no such file and no built-in catalogue"),
    (["--config", "no-such-model"], "no such file and no built-in config"),
    (["--shape", "512,3", "--dtype", "bf16", "--block-dim", "x"], "'x' is not an integer"),
])
def test_inspect_bad_input_exits_2_with_one_line(args, match):
    r = kvxfer("inspect", *args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and match in r.stderr


def test_inspect_catalog_json_one_object_per_array(tmp_path):
    r = kvxfer("inspect", "--catalog", "seeds", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    objs = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(objs) == 6
    for o in objs:
        assert set(o) == INSPECT_KEYS | {"name", "source", "expected", "matches",
                                         "disagreement"}
        assert o["matches"] is True and o["disagreement"] is None
    assert objs[0]["name"] == "seed-block-dim-inside-tile"


def test_inspect_catalog_json_says_which_entry_disagrees(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"arrays": [
        {"name": "right", "shape": [512, 6144], "dtype": "bf16",
         "layout": "{1,0:T(8,128)(2,1)}", "source": "derived",
         "expected": {"granularity": 8}},
        {"name": "wrong", "shape": [512, 6144], "dtype": "bf16",
         "layout": "{1,0:T(8,128)(2,1)}", "source": "derived",
         "expected": {"granularity": 16}}]}))
    r = kvxfer("inspect", "--catalog", str(path), "--json")
    assert r.returncode == 1
    objs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(o["name"], o["matches"]) for o in objs] == [("right", True), ("wrong", False)]
    assert objs[1]["disagreement"] == "granularity is 8, expected 16"


def test_inspect_config_groups_identical_layers_by_slice_class(tmp_path):
    r = kvxfer("inspect", "--config", "gemma-mixed", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "26 layers in 2 slice classes" in r.stdout
    rows = [line for line in r.stdout.splitlines() if line.startswith("class ")]
    assert len(rows) == 2 and " 0-19 " in rows[0] and " 20-25 " in rows[1]
    r = kvxfer("inspect", "--config", "gemma-mixed", "--json", cwd=tmp_path)
    objs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [o["layer"] for o in objs] == list(range(26))
    assert {o["slice_class"] for o in objs[:20]} == {0} and objs[20]["slice_class"] == 1
    assert objs[25]["name"] == "global.5"


def test_built_in_names_work_from_any_directory(tmp_path):
    for args in (["plan", "--config", "llama3-8b"], ["inspect", "--config", "gemma-mixed"],
                 ["inspect", "--catalog", "seeds"],
                 ["inspect", "--catalog", "layouts/seeds.json"]):
        r = kvxfer(*args, cwd=tmp_path)
        assert r.returncode == 0, (args, r.stderr)


def test_unknown_names_get_one_message_listing_the_built_ins(tmp_path):
    for command in (["plan"], ["probe"], ["inspect"]):
        r = kvxfer(*command, "--config", "zzzz", cwd=tmp_path)
        assert r.returncode == 2
        assert r.stderr.count("\n") == 1, r.stderr
        assert "zzzz: no such file and no built-in config of that name (built-in " \
               "configs: deepseek-mla, gemma-mixed," in r.stderr


@pytest.mark.parametrize("args, typed, meant", [
    (["plan", "--config"], "lama3-8b", "llama3-8b"),
    (["probe", "--config"], "tinny", "tiny"),
    (["inspect", "--config"], "gemma_mixed", "gemma-mixed"),
    (["bench", "--model"], "sglang-llama3-8b-p46", "sglang-llama3-8b-p64"),
    (["inspect", "--catalog"], "seed", "seeds"),
])
def test_a_mistyped_name_gets_a_did_you_mean(args, typed, meant):
    r = kvxfer(*args, typed)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"{typed}: no such file and no built-in " in r.stderr
    assert f"of that name; did you mean {meant!r}? (built-in " in r.stderr


@pytest.mark.parametrize("command, option", [("plan", "--config"), ("inspect", "--config"),
                                             ("probe", "--config"), ("bench", "--model")])
def test_help_lists_the_built_in_configs(command, option):
    from kvxfer import config

    text = _help(command)
    names = config.builtin_names()
    assert len(names) >= 10
    listed = text.split(option, 2)[2]  # the option's help, after the usage line
    for name in names:
        assert name in listed.replace("- ", "-"), (command, name)


def test_bare_kvxfer_prints_its_help_and_exits_0():
    """A bare ``kvxfer`` asks what there is: the help, as ``kvxfer --help`` prints it
    (nothing was asked that could fail; bad input keeps exit 2 and one line)."""
    r = kvxfer()
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout == kvxfer("--help").stdout
    assert r.stdout.startswith("usage: kvxfer") and "{inspect,plan,probe,bench,demo" in r.stdout


def test_version():
    r = kvxfer("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvxfer {__import__('kvxfer').__version__}"


@pytest.mark.parametrize("args, match", [
    (["plan", "--config", "tiny", "--num-host-blocks", "0"], "--num-host-blocks: 0 must be >= 1"),
    (["probe", "--devices", "0"], "--devices: 0 must be >= 1"),
    (["probe", "--pages", "-3"], "--pages: -3 must be >= 1"),
    (["nosuch"], "invalid choice: 'nosuch'"),
    (["plan"], "the following arguments are required: --config"),
    (["plan", "--config", "two\nlines"], "'two\\nlines': no such file"),
    (["aot", "--target", "v6e", "--config", "nosuch"], "--config: nosuch: no such file"),
    (["inspect", "--target", "v6e", "--shape", "8,128", "--dtype", "bf16", "--num-blocks",
      "4"], "--num-blocks 4 does not go with --shape"),
    (["inspect", "--target", "v6e", "--config", "tiny", "--shard-dim", "1"],
     "--shard-dim 1 does not go with --config"),
    (["inspect", "--target", "v6e", "--catalog", "seeds", "--devices", "2"],
     "--devices 2 does not go with --catalog"),
])
def test_argument_errors_are_one_line(args, match):
    r = kvxfer(*args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and match in r.stderr, r.stderr
    assert r.stderr.startswith("kvxfer")


def test_a_closed_pipe_ends_quietly():
    p = subprocess.Popen([sys.executable, "-m", "kvxfer", "inspect", "--catalog",
                          "tpu_kv_derived"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the first line is written
    assert p.wait(timeout=300) == 0
    assert p.stderr.read() == b""


def test_a_bug_is_not_reported_as_bad_input(monkeypatch):
    from kvxfer import cli

    def broken(args):
        return {}["missing"]

    monkeypatch.setattr(cli, "_cmd_inspect", broken)
    with pytest.raises(KeyError):
        cli.main(["inspect", "--shape", "4,4", "--dtype", "f32"])


def test_inspect_catalog_disagreement_exits_nonzero(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"arrays": [
        {"name": "wrong", "shape": [512, 6144], "dtype": "bf16",
         "layout": "{1,0:T(8,128)(2,1)}", "source": "derived",
         "expected": {"granularity": 16}}]}))
    r = kvxfer("inspect", "--catalog", str(path))
    assert r.returncode == 1
    assert "wrong: granularity is 8, expected 16" in r.stderr


def test_the_probe_and_the_demo_count_the_runtime_of_each_device(monkeypatch):
    """On XLA:CPU a command creates the devices it is asked for, and each holds its own
    programs and buffers: 256 of them are gigabytes, whatever the caches' size."""
    from kvxfer import plan
    from kvxfer.demo import DemoOptions
    from kvxfer.demo.command import footprint
    from kvxfer.demo.model import tiny_llama
    from kvxfer.probe import run_probe

    monkeypatch.setattr(plan, "available_host_memory", lambda: 1 << 30)
    with pytest.raises(plan.BudgetError, match=r"on 64 devices needs about 1\.50 GiB .*"
                       r"runtime 1\.50 GiB\); 1 GiB is available"):
        run_probe("tiny", num_pages=2, num_blocks=4, devices=64)
    assert footprint(tiny_llama(), DemoOptions(devices=64))["runtime"] == \
        64 * plan.RUNTIME_BYTES_PER_DEVICE


def test_probe_cli_inject_json(tmp_path):
    r = kvxfer("probe", "--config", "tiny", "--num-blocks", "16", "--pages", "4", "--inject",
               "bitflip", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["summary"]["injected"]["detected"] and report["integrity"] == "page"


@pytest.mark.parametrize("path, mover", [("auto", "emulated"), ("pinned", "pinned"),
                                         ("staged", "staged"), ("pallas", "pallas")])
def test_probe_cli_inject_zero_dma_on_each_path(tmp_path, path, mover):
    """A load that silently delivers zeros is caught at the page it hit, on every path."""
    # The Pallas kernels move the arrays' real buffers: not the emulated TPU layouts.
    extra = ["--no-tpu-layouts"] if path == "pallas" else []
    r = kvxfer("probe", "--config", "tiny", "--num-blocks", "16", "--pages", "6", "--inject",
               "zero-dma", "--path", path, "--gate", "layer", "--json", *extra, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    injected = report["summary"]["injected"]
    assert injected["fault"] == "zero-dma" and injected["detected"], injected
    assert report["summary"]["verified_prefix"] == injected["page"] == 3
    # The host copy is intact: the transfer is blamed, the page kept.
    assert injected["reason"].startswith(
        f"transfer: digest mismatch in layer {injected['layer']}, while its host copy "
        "matches its digests")
    assert {row["path"] for row in report["layers"]} == {mover}


def test_plan_cli_refuses_seed_raw_path_and_accepts_staged(tmp_path):
    r = kvxfer("plan", "--config", "seed-interleaved", "--path", "raw", "--json",
               "--budget", str(16 << 30), cwd=tmp_path)
    assert r.returncode == 1 and "221.02 GiB" in r.stderr
    assert json.loads(r.stdout)["refused"] is True
    r = kvxfer("plan", "--config", "seed-interleaved", "--json", "--budget", str(16 << 30),
               cwd=tmp_path)
    plan = json.loads(r.stdout)
    assert r.returncode == 0 and plan["classes"][0]["bytes_per_block"] == 12288


@pytest.mark.parametrize("command", ["plan", "probe"])
def test_path_direct_is_refused_naming_raw(command, tmp_path):
    r = kvxfer(command, "--config", "tiny", "--path", "direct", cwd=tmp_path)
    assert r.returncode == 2
    assert "'direct' is now called 'raw'" in r.stderr and "--path raw" in r.stderr


def _help(*command):
    from kvxfer.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(sub.choices[command[0]].format_help().split())


def test_demo_help_says_which_gate_is_the_default():
    text = _help("demo")
    assert "layer: release each layer to the model once it is verified; all: release " \
        "every layer together once all are (default: layer)" in text


def test_bench_help_states_the_run_times():
    text = _help("bench")
    # One figure per fact, with its load and CPU time: README's first-run table's.
    assert "32 MiB a call (the full run: 256 MiB, about 10 minutes on an idle 2-core CPU): " \
        "2 min 4 s at load average 1.1-1.7 on a 2-core CPU (3 min of CPU time), its peak " \
        "host memory 1.79 GB" in text
    assert "checks that every section runs, in 25 s of CPU time (52 s at load average 6-7 " \
        "on a 2-core CPU; one case of the sections where each case compiles programs of " \
        "its own or starts processes; the report lists the others as not measured). Its " \
        "figures mean little: no target is judged, unless --check asks" in text
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "| `kvxfer bench --quick` | 2 min 4 s | 1.1-1.7 | 3 min | peak 1.79 GB;" in readme
    assert "| `kvxfer bench --smoke` | 52 s | 5.9-7.4 | 25 s |" in readme
    assert "2.5 minutes" not in text and "1.62 GB" not in readme
    assert "a minute or so" not in text
    assert "last line says its wall time, peak memory and the load average" in text


def test_probe_without_tpu_layouts_drops_the_tpu_layout_columns(tmp_path):
    from kvxfer.probe import _layer_table, run_probe

    plain = run_probe("tiny", num_pages=2, num_blocks=8, emulate_tpu=False)
    emulated = run_probe("tiny", num_pages=2, num_blocks=8)
    assert (plain["tpu_layouts"], emulated["tpu_layouts"]) == (False, True)
    head = _layer_table(plain).splitlines()[0].split()
    assert head == ["layer", "path", "bytes/block", "byte-exact"]
    assert "verdict (TPU layout)" in _layer_table(emulated).splitlines()[0]
    assert "device bytes/block (TPU layout)" in _layer_table(emulated).splitlines()[0]
    # A report kept before the key existed reads as one with the layouts.
    old = {k: v for k, v in emulated.items() if k != "tpu_layouts"}
    assert _layer_table(old) == _layer_table(emulated)
    r = kvxfer("probe", "--config", "tiny", "--num-blocks", "8", "--pages", "2",
               "--no-tpu-layouts", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.splitlines()[0].split() == head, r.stderr
