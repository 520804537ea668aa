"""The bench's targets and how the command judges them, without a run: one table of
targets, each with its hardware and reason, applied by hardware (N/A is never a miss),
the exit status with and without ``--check``, the command's options, and the committed
runs judged again. The smoke runs that exercise the same through the command are in
test_bench.py.
"""

import argparse
import contextlib
import dataclasses
import io
import json
import pathlib

import pytest

from kvxfer import bench
from kvxfer.bench import report as bench_report
from test_bench import run_cli

CHECKOUT = pathlib.Path(__file__).resolve().parents[1]


def test_each_target_is_stated_once_with_its_hardware_and_reason():
    table = bench.TARGET_TABLE
    fields = [f.name for f in dataclasses.fields(bench.Targets)]
    assert sorted(fields) == sorted(t.field for t in table)  # one row per threshold
    assert {f: getattr(bench.Targets(), f) for f in fields} == \
        {t.field: t.default for t in table}
    for t in table:
        assert t.hardware and set(t.hardware) <= {"cpu", "gpu", "tpu", "any"}, t.field
        assert t.why.strip() and t.op in (">=", "<=", "within") and t.sections, t.field
    # The host time of a call, device idle: one threshold on each platform, not two.
    for platform in ("cpu", "gpu", "tpu"):
        rows = [t.field for t in table if "host time of one call, device idle" in t.what
                and t.applies(platform)]
        assert len(rows) == 1, (platform, rows)
    # The printed table carries every row with its hardware, the run lines it is
    # judged on and its reason, in sizes, not the config's field names.
    text = bench.targets_table()
    for t in table:
        assert f"{t.hardware_label:<9} {t.statement()}\n{'':<9} judged on {t.lines}\n" \
            f"{'':<9} why: {t.why}" in text
    assert text.startswith(f"kvxfer's {len(table)} targets: ")
    config_fields = {f.name for f in dataclasses.fields(bench.BenchConfig)}
    assert not [f for f in config_fields if "_" in f and f in text]
    assert "of 256 MiB per call" in text and "warmup of 64 pages (16 with --quick)" in text


def committed_quick_run():
    runs = [p for p in committed_runs() if "quick" in p.parent.name]
    if not runs:
        pytest.skip("benchmarks/ is not beside tests/ (a copy of the tests)")
    return json.loads(runs[-1].read_text())


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_each_target_is_judged_on_the_lines_the_table_says(platform):
    # A kept run of every section, judged as it was (cpu) and as if on a GPU: each
    # target's line count is the one --targets states.
    report = committed_quick_run()
    report = {**report, "meta": {**report["meta"], "platform": platform}}
    lines = bench.evaluate_targets(report)
    for t in bench.TARGET_TABLE:
        mine = [x for x in lines if x["target"] == t.field]
        if not t.applies(platform) or t.field == "store_lookup_speedup":
            assert len(mine) == (0 if t.field == "store_lookup_speedup" else 1), t.field
            continue
        assert len(mine) == int(t.lines.split()[0]), (t.field, [x["name"] for x in mine])
        # Every line names its hardware, as --targets does: the run's, or "any".
        label = "any" if "any" in t.hardware else platform
        assert all(x["name"].startswith(f"{label}: ") for x in mine), t.field


def test_benchmarks_md_states_the_same_targets_table():
    path = CHECKOUT / "BENCHMARKS.md"
    if not path.exists():
        pytest.skip("BENCHMARKS.md is not beside tests/ (a copy of the tests)")
    assert bench.targets_table(markdown=True) in path.read_text(encoding="utf-8")


def synthetic(platform, *statuses):
    return {"meta": {"platform": platform},
            "targets": [{"name": f"t{i}", "status": s, "value": None if s == "N/A" else 1.0,
                         "where": "w"} for i, s in enumerate(statuses)]}


@pytest.mark.parametrize("statuses, plain, checked", [
    (("PASS", "PASS"), 0, 0),
    (("PASS", "MISS", "N/A"), 0, 1),
    (("N/A", "N/A"), 0, 0),  # targets for other hardware are never misses
    ((), 0, 0),
])
def test_exit_status_judges_only_with_check(statuses, plain, checked):
    report = synthetic("cpu", *statuses)
    assert bench_report.exit_status(report, check=False) == plain
    assert bench_report.exit_status(report, check=True) == checked


def test_a_target_for_other_hardware_is_not_applicable_never_missed():
    # The same memory figure judged on each platform: the pool target applies to any.
    memory = {"memory": {"pool_over_plan": 1.5}}
    for platform in ("cpu", "gpu", "tpu"):
        (line,) = bench.evaluate_targets({"meta": {"platform": platform}, **memory})
        assert (line["status"], line["hardware"], line["target"]) == \
            ("MISS", "any", "pool_tolerance")
    # An engine-fit section of a TPU run: the CPU and GPU rows are N/A lines with no
    # value, the accelerator's call time is judged, and nothing N/A is a miss.
    fit = {"calls": [{"path": "auto", "pages": 2, "layers": 2, "steps": 1,
                      **{f"idle_{op}": {"p50_s": 5e-4} for op in ("offload", "load",
                                                                  "load_layer")},
                      **{f"queued_{op}": {"fraction": 0.5} for op in ("offload", "load",
                                                                     "load_layer")}}],
           "hits": [{"path": "auto", "hit": {"p50_s": 9.0}}],
           "warmups": [{"path": "auto", "pages": 2, "cold": 99.0, "persistent_cache": 1.0}]}
    report = {"meta": {"platform": "tpu"}, "fit": fit}
    report["targets"] = bench.evaluate_targets(report)
    by = {t["target"]: t for t in report["targets"]}
    assert {f for f, t in by.items() if t["status"] == "N/A"} == \
        {"call_idle_ms_cpu", "hit_ms_cpu", "hit_ms_gpu", "warmup_s_cpu"}
    assert all(by[f]["value"] is None for f in ("hit_ms_gpu", "warmup_s_cpu"))
    assert by["host_overhead_ms"]["status"] == "PASS"  # 0.5 ms <= 1 ms on tpu
    assert [t["target"] for t in bench.missed(report)] == ["call_queued_fraction"]
    assert bench_report.summary(report) == \
        "2 of 3 targets that apply to tpu met, 1 missed; 4 for other hardware not applicable"
    text = "\n".join(bench_report.target_line(t) for t in report["targets"])
    assert "N/A   cpu: 1-page hit of every layer" in text
    assert "(not applicable to this tpu run)" in text


def test_targets_prints_the_table_and_measures_nothing():
    from kvxfer._text import fit_width

    rc, stdout, stderr = run_cli("bench", "--targets")
    assert rc == 0 and stdout.strip() == fit_width(bench.targets_table(), 100) and not stderr
    assert max(len(line) for line in stdout.splitlines()) <= 100
    rc, stdout, _ = run_cli("bench", "--targets", "--wide")
    assert rc == 0 and stdout.strip() == bench.targets_table()
    _, stdout, _ = run_cli("bench", "--targets", targets=bench.Targets(call_idle_ms_cpu=2))
    assert "device idle (p50, paths that enqueue) <= 2 ms" in stdout
    rc, stdout, _ = run_cli("bench", "--targets", "--json")
    assert rc == 0 and [t["field"] for t in json.loads(stdout)] == \
        [t.field for t in bench.TARGET_TABLE]


def test_a_run_that_fails_midway_does_not_exit_0():
    from kvxfer import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["bench", "--smoke", "--only", "store", "--store", "redis://127.0.0.1:1"])
    assert rc == 2 and "redis://127.0.0.1:1" in err.getvalue() and "Targets" not in out.getvalue()


def committed_runs():
    return sorted((CHECKOUT / "benchmarks").glob("*/bench.json"))


def test_committed_runs_are_judged_and_printed_again():
    runs = committed_runs()
    if not runs:
        pytest.skip("benchmarks/ is not beside tests/ (a copy of the tests)")
    for path in runs:
        report = json.loads(path.read_text())
        # Printed with the target lines it was written with, then judged again.
        assert "targets that apply to cpu met" in bench.format_report(report), path
        again = {**report, "targets": bench.evaluate_targets(report)}
        assert {t["status"] for t in again["targets"]} <= {"PASS", "MISS", "N/A"}
        assert "targets that apply to cpu met" in bench.format_report(again), path


def test_the_lookup_target_is_checked_at_the_reference_page_size_of_32_pages():
    def report(pages, reference, speedup):
        return {"meta": {"platform": "cpu"},
                "store_lookup": [{"store": "redis", "spec": "redis://h:1/0", "pages": pages,
                                  "blob_bytes": 32768, "reference": reference,
                                  "speedup": speedup}]}

    (t,) = bench.evaluate_targets(report(32, True, 3.4))
    assert t["status"] == "PASS" and t["value"] == 3.4 and t["threshold"] == 3.0
    assert t["name"] == ("any: redis: 32-page prefix lookup, one get_many >= 3x as fast as one "
                         "get per page") and "32 KiB pages, redis://h:1/0" in t["where"]
    assert bench.evaluate_targets(report(32, True, 2.9))[0]["status"] == "MISS"
    assert bench.evaluate_targets(report(32, True, 2.9),
                                  bench.Targets(store_lookup_speedup=2.5))[0]["status"] == "PASS"
    assert bench.evaluate_targets(report(32, False, 1.0)) == []  # another page size
    assert bench.evaluate_targets(report(4, True, 1.0)) == []  # --smoke's 4 pages


def test_register_cli_adds_bench_with_its_options():
    parser = argparse.ArgumentParser(prog="kvxfer")
    bench.register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--json", "--out", "d", "--quick", "--no-check"])
    assert (args.json, args.out, args.quick, args.smoke, args.no_check) == \
        (True, "d", True, False, True)
    assert callable(args.func)
    args = parser.parse_args(["bench"])
    assert (args.json, args.out, args.quick, args.smoke, args.no_check, args.store,
            args.only, args.check, args.targets) == \
        (False, None, False, False, False, None, None, False, False)
    assert parser.parse_args(["bench", "--check"]).check
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parser.parse_args(["bench", "--check", "--no-check"])
    args = parser.parse_args(["bench", "--store", "d", "--store", "redis://h:1", "--only",
                              "store"])
    assert (args.store, args.only) == (["d", "redis://h:1"], "store")
    args = parser.parse_args(["bench", "--only", "model", "--model", "tiny", "--model",
                              "llama3-8b.toml"])
    assert (args.model, args.only) == (["tiny", "llama3-8b.toml"], "model")
    assert parser.parse_args(["bench"]).model is None
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parser.parse_args(["bench", "--only", "sweep"])
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parser.parse_args(["bench", "--quick", "--smoke"])
