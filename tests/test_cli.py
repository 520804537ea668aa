"""The command line, run as a user would (a subprocess of the installed entry point)."""

import json
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
    (["--catalog", "no/such/file.json"], "No such file"),
])
def test_inspect_bad_input_exits_2_with_one_line(args, match):
    r = kvxfer("inspect", *args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and match in r.stderr


def test_inspect_catalog_json_one_object_per_array(repo_root):
    r = kvxfer("inspect", "--catalog", "layouts/seeds.json", "--json", cwd=repo_root)
    assert r.returncode == 0, r.stderr
    objs = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(objs) == 6 and all(set(o) == INSPECT_KEYS for o in objs)


def test_inspect_catalog_disagreement_exits_nonzero(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"arrays": [
        {"name": "wrong", "shape": [512, 6144], "dtype": "bf16",
         "layout": "{1,0:T(8,128)(2,1)}", "source": "derived",
         "expected": {"granularity": 16}}]}))
    r = kvxfer("inspect", "--catalog", str(path))
    assert r.returncode == 1
    assert "wrong: granularity is 8, expected 16" in r.stderr


def test_probe_cli_inject_json(repo_root):
    r = kvxfer("probe", "--config", "tiny", "--num-blocks", "16", "--pages", "4", "--inject",
               "bitflip", "--json", cwd=repo_root)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["summary"]["injected"]["detected"] and report["integrity"] == "page"


def test_plan_cli_refuses_seed_direct_path_and_accepts_staged(repo_root):
    r = kvxfer("plan", "--config", "seed-interleaved", "--path", "direct", "--json",
               "--budget", str(16 << 30), cwd=repo_root)
    assert r.returncode == 1 and "221.02 GiB" in r.stderr
    assert json.loads(r.stdout)["refused"] is True
    r = kvxfer("plan", "--config", "seed-interleaved", "--json", "--budget", str(16 << 30),
               cwd=repo_root)
    plan = json.loads(r.stdout)
    assert r.returncode == 0 and plan["classes"][0]["bytes_per_block"] == 12288
