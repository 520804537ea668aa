"""``kvxfer bench``: a tiny run's report has every section and only sane figures; the
command reports every target and exits 1 on a miss only with ``--check``.

No timing assertions: timings belong to the benchmark itself (BENCHMARKS.md).
"""

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import re

import pytest

from kvxfer import bench
from kvxfer._text import format_bytes
from kvxfer.bench import _cli as bench_cli
from kvxfer.bench import report as bench_report
from kvxfer.store import DiskStore, StoreError

LOAD_METHODS = {"load_off_all", "load_off_layer", "load_page_all", "load_page_layer"}
# The pinned mover's variants: timed where path="auto" takes another mover (raw on CPU).
PINNED_METHODS = {"offload_pinned_off", "offload_pinned_page", "load_pinned_off_all",
                  "load_pinned_page_all"}
KVXFER_METHODS = {"offload_off", "offload_page"} | LOAD_METHODS | PINNED_METHODS
USER_OFFLOADS = {"user_device_get", "user_gather_pinned", "user_batched_gather_pinned"}
USER_LOADS = {"user_put_scatter", "user_batched_put_scatter"}
# The plain-JAX routes (digests on the device), interleaved with kvxfer's variants.
JAX_ROUTES = {"jax_gather_pinned", "jax_put_scatter"}
D2H_METHODS = {"offload_off", "offload_page", "offload_pinned_off", "offload_pinned_page",
               "jax_gather_pinned"} | USER_OFFLOADS
SECTIONS = {"schema", "meta", "throughput", "sweep", "concurrency", "overhead",
            "integrity_traffic", "cache_size", "memory", "first_call", "queued", "fit",
            "store", "store_lookup", "policy", "targets", "not_measured", "files",
            "copy_sizes"}
# The caller-thread sections' cases on XLA:CPU, by name: (path asked for, dtype, movers
# taken).
CALL_CASES = {"staged": ("staged", "bfloat16", ["staged"]), "raw": ("auto", "float32", ["raw"]),
              "pinned": ("pinned", "float16", ["pinned"])}


def timed_cases(cfg):
    """The caller-thread cases a run of ``cfg`` times, in order."""
    return [case for name, case in CALL_CASES.items() if name in cfg.call_cases]
CALL_GEOMETRY = {"case", "dtype", "path", "movers", "integrity", "layers", "block_bytes",
                 "cache_blocks", "pages", "bytes"}
STATS = {"n", "best_s", "p50_s", "p99_s"}
PROGRESS = re.compile(r"^kvxfer bench: \[(\d+)/(\d+) \d+:\d\d elapsed"
                      r"(, about \d+:\d\d left)?\] (.*)$")
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
# A call host time target of 0 ms cannot be met: every call takes some time.
UNMEETABLE = bench.Targets(call_idle_ms_cpu=0.0, host_overhead_ms=0.0)


def run_cli(*argv, targets=bench.Targets()):
    parser = argparse.ArgumentParser(prog="kvxfer")
    bench.register_cli(parser.add_subparsers(dest="command", required=True), targets=targets)
    args = parser.parse_args(list(argv))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = args.func(args)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One smoke run through the command, as a user runs it (no ``--check``), JSON and
    files, against targets one of which cannot be met on CPU."""
    out = tmp_path_factory.mktemp("bench")
    rc, stdout, stderr = run_cli("bench", "--smoke", "--json", "--out", str(out),
                                 targets=UNMEETABLE)
    return json.loads(stdout), out, stderr.splitlines(), rc


@pytest.fixture(scope="module")
def run(cli_run):
    """The smoke run's report, output folder and progress lines."""
    return cli_run[:3]


def test_report_has_every_section(run):
    report, _, lines = run
    cfg = bench.BenchConfig.smoke()
    assert set(report) == SECTIONS and report["schema"] == bench.SCHEMA
    assert report["meta"]["platform"] == "cpu" and report["meta"]["limit_method"]
    assert report["meta"]["preset"] == "smoke" and report["meta"]["config"] == cfg.as_dict()
    assert [(r["block_bytes"], r["dtype"]) for r in report["throughput"]] == \
        sorted(cfg.cells, key=lambda c: c != cfg.reference)
    for row in report["throughput"] + report["sweep"]:
        assert set(row["methods"]) == KVXFER_METHODS | USER_OFFLOADS | USER_LOADS | JAX_ROUTES
        assert set(row["limit"]) == {"d2h", "h2d"}
        assert row["bytes"] == row["pages"] * row["layers"] * row["block_bytes"]
    assert set(bench.PINNED_METHODS) == PINNED_METHODS
    for row in report["throughput"] + report["sweep"]:
        assert row["paths"] == ["raw"]  # XLA:CPU row-major caches take the raw path
        assert row["pinned_methods"] is True  # ... so the pinned mover is timed apart
    assert [r["pages"] for r in report["sweep"]] == list(cfg.prefix_pages)
    for row in report["sweep"]:
        for name in LOAD_METHODS:
            assert {"first_layer", "last_layer"} <= set(row["methods"][name])
    assert {(r["op"], r["integrity"], r["in_flight"]) for r in report["concurrency"]} == \
        {(op, i, c) for op in ("offload", "load") for i in ("off", "page")
         for c in cfg.concurrency}
    assert {(r["op"], r["integrity"], r["gate"]) for r in report["overhead"]} == \
        {("offload", "off", "-"), ("offload", "page", "-")} | \
        {("load", i, g) for i in ("off", "page") for g in ("all", "layer")}
    assert set(report["cache_size"]["variants"]) == \
        {"off_auto", "page_auto", "page_staged", "user_scatter"}
    assert report["memory"]["pool_bytes"] == report["memory"]["plan_bytes"]
    # The DMA mover by bytes per copy (its host copy engine here).
    assert [r["copy_bytes"] for r in report["copy_sizes"]] == list(cfg.copy_sizes)
    for r in report["copy_sizes"]:
        assert set(r["methods"]) == {"offload", "load"}
        assert r["bytes"] == r["copies"] * r["copy_bytes"] and r["copies"] > 1
        assert all(m["fraction_of_limit"] > 0 for m in r["methods"].values())
    said = [m.group(m.lastindex) for line in lines if (m := PROGRESS.match(line))]
    for section in ("throughput", "memory", "concurrency", "host overhead", "prefix sweep",
                    "cache size", "first call", "queued steps", "engine fit", "warm-up",
                    "store", "policies"):
        assert any(line.startswith(section) for line in said), section


def test_fit_section_times_every_path_and_the_warmups(run):
    report, _, _ = run
    cfg = bench.BenchConfig.smoke()
    fit = report["fit"]
    assert [r["path"] for r in fit["calls"]] == ["auto", "staged", "pinned"]
    assert [r["movers"] for r in fit["calls"]] == [["raw"], ["staged"], ["pinned"]]
    for r in fit["calls"]:
        assert (r["pages"], r["layers"], r["block_bytes"], r["steps"]) == \
            (cfg.fit_pages, cfg.layers, cfg.fit_block_bytes, cfg.fit_steps)
        for op in ("offload", "load", "load_layer"):
            assert set(r[f"idle_{op}"]) >= STATS and r[f"idle_{op}"]["p50_s"] > 0
            q = r[f"queued_{op}"]
            assert q["fraction"] == pytest.approx(q["p50_s"] / r["steps_alone"]["p50_s"])
        assert r["prefetched_load"]["n"] == cfg.fit_repeats
    assert [h["path"] for h in fit["hits"]] == ["auto", "staged", "pinned"]
    assert [w["path"] for w in fit["warmups"]] == list(cfg.warmup_paths) == ["pinned"]
    for w in fit["warmups"]:
        assert w["buckets"] == [1, 2] and w["cold"] > 0 and w["persistent_cache"] > 0
    # The paths whose fresh processes --smoke does not start: '-' cells, said once why.
    note = "warm-up in fresh processes of path=auto, path=staged ('-' in the warm-up columns)"
    assert [n for n in report["not_measured"] if n.startswith(note)]
    text = bench.format_report(report, width=None)
    assert text.count(note) == 1
    table = text.split("1-page x ", 1)[1].split("\n\n", 1)[0].splitlines()
    for path in ("auto", "staged"):
        row = next(line for line in table if line.startswith(f"path={path} "))
        assert row.split()[-2:] == ["-", "-"]
    names = [t["name"] for t in bench.evaluate_targets(report)]  # kvxfer's thresholds
    for want in ("device idle (path=pinned, path=staged) <= 3 ms",
                 "queued steps <= 0.1 of their time", "call to last layer verified <= 1 ms",
                 "in a fresh process <= 10 s",
                 "persistent compilation cache, second process <= 3 s"):
        assert any(want in n for n in names), want


@pytest.fixture(scope="module")
def fit_only():
    """The engine-fit section alone through the command with ``--check`` (a full smoke
    run takes twice as long), with every target at 0: the report, the exit code and
    stderr."""
    unmeetable = bench.Targets(call_idle_ms_cpu=0.0, call_queued_fraction=0.0,
                               hit_ms_cpu=0.0, warmup_s_cpu=0.0, warmup_cached_s=0.0,
                               host_overhead_ms=0.0, hit_ms_gpu=0.0)
    rc, stdout, stderr = run_cli("bench", "--smoke", "--json", "--only", "fit", "--check",
                                 targets=unmeetable)
    return json.loads(stdout), rc, stderr


def test_only_fit_runs_that_section_alone(fit_only):
    report, _, _ = fit_only
    assert set(report) == {"schema", "meta", "fit", "targets", "not_measured"}
    assert report["meta"]["only"] == "fit"
    # Five targets judged on CPU; the accelerators' call time and hit are not applicable.
    assert [t["status"] == "N/A" for t in report["targets"]].count(False) == 5
    assert {t["target"] for t in report["targets"] if t["status"] == "N/A"} == \
        {"host_overhead_ms", "hit_ms_gpu"}
    text = bench.format_report(report)
    assert "Engine fit" in text and "--only fit" in text and "Offload throughput" not in text
    # The warm-ups --smoke leaves out are said here too, once.
    (note,) = report["not_measured"]
    assert note.startswith("warm-up in fresh processes of path=auto, path=staged")
    assert bench.format_report(report, width=None).count(f"not measured: {note}") == 1
    # Targets are evaluated again on a report: one that cannot be met is reported as missed.
    missed = bench.evaluate_targets(report, bench.Targets(warmup_cached_s=0.0))
    assert any(t["status"] == "MISS" and "persistent" in t["name"] for t in missed)
    assert len(bench.evaluate_targets(report, bench.Targets())) == 7


def test_only_model_moves_each_configs_own_caches(tmp_path):
    from kvxfer import config

    cfg = bench.BenchConfig.smoke()
    names = ["sglang-llama3-8b-p1", "vllm-tpu-llama3-8b-fp8"]
    lines = []
    report = bench.run_bench(config=cfg, only="model", models=names, progress=lines.append,
                             out_dir=str(tmp_path))
    assert set(report) == {"schema", "meta", "models", "targets", "not_measured", "files"}
    assert report["meta"]["only"] == "model" and report["meta"]["models"] == names
    assert report["targets"] == [] and report["schema"] == "kvxfer-bench/8"
    assert [row["config"] for row in report["models"]] == names
    for row in report["models"]:
        spec = config.load(row["config"])
        page = sum(g.logical_block_bytes * g.count for g in spec.groups)
        assert row["page_bytes"] == page and row["layers"] == spec.num_layers
        assert row["pages"] == max(1, cfg.batch_bytes // page)
        assert row["bytes"] == row["pages"] * page
        assert row["tokens_per_page"] == spec.block_size
        assert row["groups"][0]["block_shape"] == list(spec.groups[0].block_shape)
        assert set(row["methods"]) == {"offload_off", "offload_page", "load_off_all",
                                       "load_page_all"}
        for name, m in row["methods"].items():
            assert m["direction"] == ("d2h" if name.startswith("offload") else "h2d")
            assert m["fraction_of_limit"] == pytest.approx(
                m["gbps"] / row["limit"][m["direction"]]["gbps"])
            assert m["us_per_page"] == pytest.approx(m["best_s"] / row["pages"] * 1e6)
            assert 0 < m["call_us_per_page"] and m["best_s"] <= m["p50_s"]
    bad = [(path, v) for path, v in bench.iter_figures(report)
           if not math.isfinite(v) or v <= 0 and path.rsplit(".", 1)[-1] not in bench.ZERO_OK]
    assert not bad
    assert [line for line in lines if "model sglang-llama3-8b-p1: " in line]
    text = bench.format_report(report)
    assert "--only model" in text and "Model configs' own caches" in text
    assert "sglang-llama3-8b-p1" in text and "Offload throughput" not in text
    assert json.loads((tmp_path / "bench.json").read_text())["models"] == report["models"]


def test_model_configs_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="only='model' needs a config in models="):
        bench.run_bench(config=bench.BenchConfig.smoke(), only="model")
    with pytest.raises(ValueError, match="which only='fit' leaves out"):
        bench.run_bench(config=bench.BenchConfig.smoke(), only="fit", models=["tiny"])
    # A typo in a name is refused before the transfer sections run, not after them.
    with pytest.raises(ValueError, match="llama9: no such file and no built-in config"):
        bench.run_bench(config=bench.BenchConfig.smoke(), models=["llama9"])


def check_call_geometry(row, cfg, cache_blocks):
    assert (row["path"], row["dtype"], row["movers"]) in CALL_CASES.values()
    assert row["integrity"] == "page" and row["layers"] == cfg.layers
    assert (row["block_bytes"], row["pages"]) == (cfg.call_block_bytes, cfg.call_pages)
    assert row["bytes"] == row["pages"] * row["layers"] * row["block_bytes"]
    assert row["cache_blocks"] == cache_blocks


def test_first_call_section_times_each_path_without_and_with_warmup(run):
    report, _, _ = run
    cfg = bench.BenchConfig.smoke()
    rows = report["first_call"]
    assert [(r["path"], r["dtype"], r["movers"]) for r in rows] == timed_cases(cfg)
    # --smoke times one case (each compiles two managers' programs); the report says
    # once which it left out, and why.
    assert len(rows) == len(cfg.call_cases) == 1 < len(CALL_CASES)
    left = ", ".join(f"path={path} ({dtype})" for name, (path, dtype, _) in CALL_CASES.items()
                     if name not in cfg.call_cases)
    note = f"first call and queued steps of {left}: this run's call_cases are"
    assert [n for n in report["not_measured"] if n.startswith(note)]
    assert bench.format_report(report, width=None).count(note) == 1
    for row in rows:
        assert set(row) == CALL_GEOMETRY | {"cold_cache_blocks", "warmup_s", "warmup_buckets",
                                            "without_warmup", "with_warmup", "second_call"}
        check_call_geometry(row, cfg, cfg.call_blocks)
        # Without warm-up the caches have a shape of their own: nothing compiled before.
        assert row["cold_cache_blocks"] == cfg.cold_call_blocks != cfg.call_blocks
        assert row["warmup_buckets"] == [1, 2]  # every bucket up to call_pages=2
        assert row["warmup_s"] > 0
        for when in ("without_warmup", "with_warmup", "second_call"):
            calls = row[when]
            assert set(calls["offload"]) == {"s", "call_s", "wait_s"}
            assert set(calls["load"]) == {"s", "call_s", "result_s"}
            for op, rest in (("offload", "wait_s"), ("load", "result_s")):
                assert 0 < calls[op]["call_s"] <= calls[op]["s"]
                assert calls[op]["s"] == pytest.approx(calls[op]["call_s"] + calls[op][rest])


def test_queued_section_times_the_call_apart_from_the_wait(run):
    report, _, _ = run
    cfg = bench.BenchConfig.smoke()
    rows = report["queued"]
    assert [(r["path"], r["dtype"], r["movers"]) for r in rows] == timed_cases(cfg)
    for row in rows:
        assert set(row) == CALL_GEOMETRY | {"steps", "step_passes", "repeats", "steps_alone",
                                            "offload", "load", "load_layer", "idle_offload",
                                            "idle_load", "idle_load_layer"}
        check_call_geometry(row, cfg, cfg.call_blocks)
        assert (row["steps"], row["repeats"]) == (cfg.queued_steps, cfg.call_repeats)
        assert 1 <= row["step_passes"] and isinstance(row["step_passes"], int)
        assert set(row["steps_alone"]) == {"total", "dispatch"}
        for op, rest in (("offload", "wait"), ("load", "result"), ("load_layer", "result")):
            timing = row[op]
            assert set(timing) == {"call", rest, "total", "steps_done_at_return",
                                   "call_fraction"}
            for part in ("call", rest, "total"):
                assert set(timing[part]) == STATS and timing[part]["n"] == cfg.call_repeats
            assert 0 <= timing["steps_done_at_return"] <= 1
            assert timing["call_fraction"] > 0
            idle = row[f"idle_{op}"]
            assert set(idle) == {"call"} and idle["call"]["n"] == cfg.call_repeats


def check_store_rows(rows, cfg, stores):
    """Each store measured at each blob size, every operation against its own limit."""
    assert [(r["spec"], r["blob_bytes"]) for r in rows] == \
        [(spec, size) for spec in stores for size in cfg.store_blob_bytes]
    for r in rows:
        assert r["blobs"] == max(1, min(cfg.store_bytes // r["blob_bytes"], cfg.store_max_blobs))
        assert r["bytes"] == r["blobs"] * r["blob_bytes"]
        ops = {"disk": {"write", "write_not_durable", "read", "read_cold"},
               "redis": {"write", "read"}, "redis-cluster": {"write", "read"}}[r["store"]]
        assert set(r["methods"]) == ops and set(r["limit"]) == ops - {"write_not_durable"}
        for op, m in r["methods"].items():
            limit = r["limit"]["write" if op == "write_not_durable" else op]
            assert m["n"] == limit["n"] == cfg.store_repeats
            assert m["fraction_of_limit"] == pytest.approx(m["gbps"] / limit["gbps"])
            assert m["best_s"] <= m["p50_s"] <= m["p99_s"]
        # What sealing costs (auth_key=, encrypt=), against a copy of the same bytes.
        sealing = r["sealing"]
        assert {"memcpy", "auth", "encrypt"} <= set(sealing)
        for mode in ("auth", "encrypt"):
            for op in ("seal", "open"):
                m = sealing[mode][op]
                assert m["fraction_of_limit"] == pytest.approx(
                    m["gbps"] / sealing["memcpy"]["gbps"])


def check_lookup_rows(rows, cfg, stores):
    """Each Redis store's prefix lookup at each page size: per page and batched, each
    against its own limit, and the speed-up of one over the other."""
    assert [(r["spec"], r["blob_bytes"]) for r in rows] == \
        [(spec, size) for spec in stores for size in cfg.lookup_blob_bytes]
    for r in rows:
        assert r["pages"] == cfg.lookup_pages and r["bytes"] == r["pages"] * r["blob_bytes"]
        assert r["reference"] == (r["blob_bytes"] == cfg.lookup_reference_bytes)
        assert set(r["methods"]) == set(r["limit"]) == {"per_page", "batched"}
        for op, m in r["methods"].items():
            assert m["n"] == r["limit"][op]["n"] == cfg.lookup_repeats
            assert m["fraction_of_limit"] == pytest.approx(m["gbps"] / r["limit"][op]["gbps"])
        m = r["methods"]
        assert r["speedup"] == pytest.approx(m["per_page"]["p50_s"] / m["batched"]["p50_s"])
        assert r["speedup_best"] == pytest.approx(m["per_page"]["best_s"] /
                                                  m["batched"]["best_s"])
        # The same prefix through HostCache.lookup: one get_many against one get a page.
        c = r["cache"]
        assert c["blob_bytes"] > r["blob_bytes"] // 2
        assert c["methods"]["batched"]["calls"] == {"get_many": 1}
        assert c["methods"]["per_page"]["calls"] == {"get": r["pages"], "get_many": 1}
        for m in c["methods"].values():
            assert m["n"] == cfg.lookup_repeats and m["bytes"] == r["pages"] * c["blob_bytes"]
        assert c["speedup"] == pytest.approx(c["methods"]["per_page"]["p50_s"] /
                                             c["methods"]["batched"]["p50_s"])


def test_store_section_measures_a_temporary_disk_store_by_default(run):
    report, _, _ = run
    cfg = bench.BenchConfig.smoke()
    assert report["meta"]["stores"] == ["temporary directory"]
    assert report["store_lookup"] == []  # a disk store has no round trips to batch
    check_store_rows(report["store"], cfg, ["temporary directory"])
    for r in report["store"]:
        assert r["store"] == "disk" and not os.path.exists(r["path"])  # removed after
    block = bench.format_report(report).split("\nStore tiers", 1)[1].split("\n\n", 1)[0]
    lines = block.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("-----"))
    rows = lines[rule + 1:]
    assert len(rows) == len(report["store"])
    for line, r in zip(rows, report["store"]):
        assert line.split()[:3] == ["disk", "temporary", "directory"]
        mbps = f"{r['methods']['write']['gbps'] * 1e3:.0f} " \
            f"({r['methods']['write']['fraction_of_limit']:.2f}x)"
        assert mbps in line


def test_only_store_runs_the_store_section_on_the_stores_given(tmp_path, redis_server):
    own = tmp_path / "pages"
    with DiskStore(own) as theirs:
        theirs.put("theirs", b"a page of theirs")
    (own / "odd.kvb").write_bytes(b"not a whole blob: an open would remove it")
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in own.iterdir()}
    rc, stdout, stderr = run_cli("bench", "--smoke", "--json", "--only", "store",
                                 "--store", str(own), "--store", redis_server)
    report = json.loads(stdout)
    assert rc == 0 and set(report) == {"schema", "meta", "store", "store_lookup", "targets",
                                       "not_measured"}
    # (--smoke looks up 4 pages: too few for the lookup's target, which wants 32.)
    assert report["meta"]["only"] == "store" and report["targets"] == []
    cfg = bench.BenchConfig.smoke()
    check_store_rows(report["store"], cfg, [str(own), redis_server])
    assert [r["store"] for r in report["store"]] == ["disk"] * 2 + ["redis"] * 2
    check_lookup_rows(report["store_lookup"], cfg, [redis_server])
    # What the directory and the server held before is all they hold after.
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in own.iterdir()} == before
    import redis

    with redis.Redis.from_url(redis_server) as raw:
        assert not list(raw.scan_iter(match="kvxfer-bench-*"))
    text = bench.format_report(report)
    assert "--only store" in text and "Offload throughput" not in text
    assert "0 of 0 targets that apply to cpu met" in bench.format_report(report, judge=True)
    assert "targets that apply" not in text  # a smoke run judges nothing unless asked
    r = report["store_lookup"][0]
    row = next(line for line in text.split("\nPrefix lookup from a Redis store", 1)[1]
               .splitlines() if line.startswith("redis "))
    assert f"{r['speedup']:.1f}x ({r['speedup_best']:.1f}x)" in row and "4 KiB *" in row
    lines = [line for line in stderr.splitlines() if PROGRESS.match(line)]
    assert len(lines) == 5 and all("store: " in line for line in lines)
    last = " ".join(stderr[stderr.rindex("[5/5"):].split())  # with its indented lines
    assert "lookup of a 4-page prefix of 4 KiB pages" in last


def test_only_store_measures_a_redis_cluster_store_and_its_lookup(redis_cluster):
    import redis

    cfg = bench.BenchConfig.smoke()
    report = bench.run_bench(config=cfg, only="store", stores=[redis_cluster.spec])
    check_store_rows(report["store"], cfg, [redis_cluster.spec])
    assert {r["store"] for r in report["store"]} == {"redis-cluster"}
    check_lookup_rows(report["store_lookup"], cfg, [redis_cluster.spec])
    assert "redis-cluster limit: redis-py's cluster client" in bench.format_report(report)
    for port in redis_cluster.ports:  # nothing the bench wrote is left on any node
        with redis.Redis(host="127.0.0.1", port=port) as raw:
            assert not list(raw.scan_iter(match="*kvxfer-bench-*"))


def test_bad_store_specs_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown scheme 's3://'"):
        bench.run_bench(config=bench.BenchConfig.smoke(), only="store", stores=["s3://x"])
    # Refused before the transfer sections run, not after them.
    with pytest.raises(ValueError, match="the port is not a number"):
        bench.run_bench(config=bench.BenchConfig.smoke(), stores=["redis://host:x"])
    with pytest.raises(StoreError, match="store directory '/nonexistent/dir' does not exist"):
        bench.run_bench(config=bench.BenchConfig.smoke(), only="store",
                        stores=["/nonexistent/dir"])
    with pytest.raises(ValueError, match="Expected only in \\('store', 'fit', 'model', "
                       "'policy'\\) or None. Got 'all'"):
        bench.run_bench(config=bench.BenchConfig.smoke(), only="all")


def check_policy_rows(rows, requests):
    """Every (trace, policy, write-through) case, with counts that add up."""
    from kvxfer.bench import _policies

    assert [(r["trace"], r["policy"], r["write_through"]) for r in rows] == [
        (t, p, w) for t in _policies.TRACES for p in _policies.POLICIES
        for w in _policies.WRITE_THROUGH]
    for r in rows:
        assert r["requests"] == requests and r["dropped"] == 0
        assert r["pages_requested"] == r["host_hits"] + r["store_hits"] + r["misses"]
        assert r["hit_rate"] == pytest.approx(r["host_hit_rate"] + r["store_hit_rate"])
        assert 0 < r["hit_rate"] <= r["ideal_hit_rate"] <= 1
        assert (r["store_bytes_written"] > 0) == (r["store_pages_written"] > 0)
        if not isinstance(r["write_through"], int):  # only a hit count gates writes
            assert r["store_writes_gated"] == 0


def test_the_policy_section_replays_every_case(run):
    report, _, _ = run
    check_policy_rows(report["policy"], bench.BenchConfig.smoke().policy_requests)
    text = bench.format_report(report)
    assert "Eviction policies and write-through" in text
    for r in report["policy"]:
        assert re.search(rf"{r['trace']}\s+{r['policy']}\s+{r['write_through']}\s+"
                         rf"{r['requests']}\s+{r['pages_requested']}\s+"
                         rf"{r['host_hit_rate']:.3f}\s+{r['store_hit_rate']:.3f}", text)


def test_on_a_scan_s3fifo_keeps_the_shared_prefixes_and_a_hit_count_saves_store_bytes():
    # Counts of a deterministic replay, not timings: the same on every machine.
    from kvxfer.bench import _policies

    rows = {(r["policy"], r["write_through"]): r for r in _policies.policy_section(
        requests=120, traces=("scan",), policies=("lru", "s3fifo"),
        write_through=("never", 2))}
    lru, s3 = rows[("lru", "never")], rows[("s3fifo", "never")]
    assert s3["host_hit_rate"] > 2 * lru["host_hit_rate"]
    assert s3["host_hit_rate"] > 0.9 * s3["ideal_hit_rate"]
    gated = rows[("s3fifo", 2)]
    assert gated["store_bytes_written"] * 20 < s3["store_bytes_written"]
    assert gated["hit_rate"] > 0.9 * s3["hit_rate"] and gated["store_writes_gated"] > 0


def test_only_policy_runs_that_section_alone():
    rc, stdout, stderr = run_cli("bench", "--smoke", "--json", "--only", "policy")
    report = json.loads(stdout)
    assert set(report) == {"schema", "meta", "policy", "targets", "not_measured"}
    assert rc == 0 and report["meta"]["only"] == "policy" and report["targets"] == []
    check_policy_rows(report["policy"], bench.BenchConfig.smoke().policy_requests)


def test_every_figure_is_positive_and_finite(run):
    report, _, _ = run
    # Judged by kvxfer's thresholds (the run's own are forced to 0 where unmeetable).
    figures = list(bench.iter_figures({**report, "targets": bench.evaluate_targets(report)}))
    assert len(figures) > 300
    bad = [(path, v) for path, v in figures
           if not math.isfinite(v) or v < 0 or
           (v == 0 and path.rsplit(".", 1)[-1] not in bench.ZERO_OK)]
    assert not bad


def test_fractions_are_against_the_limit_of_the_same_case_and_direction(run):
    report, _, _ = run
    for row in report["throughput"] + report["sweep"]:
        for name, m in row["methods"].items():
            assert m["direction"] == ("d2h" if name in D2H_METHODS else "h2d"), name
            assert m["fraction_of_limit"] == pytest.approx(
                m["gbps"] / row["limit"][m["direction"]]["gbps"])
            assert m["best_s"] <= m["p50_s"] <= m["p99_s"]


def test_targets_are_pass_miss_or_not_applicable_lines(run):
    report, _, _ = run
    names = [t["name"] for t in report["targets"]]
    assert len(names) == len(set(names)) >= 10
    for t in report["targets"]:
        assert t["status"] in ("PASS", "MISS", "N/A") and t["op"] in (">=", "<=", "within")
        spec = bench_report.TARGET_BY_FIELD[t["target"]]
        assert t["hardware"] == spec.hardware_label
        assert (t["status"] == "N/A") == (not spec.applies("cpu")) == (t["value"] is None)
    assert report["targets"] == bench.evaluate_targets(report, UNMEETABLE)
    text = bench.format_report(report, judge=True)  # as --smoke --check prints it
    for t in report["targets"]:
        assert f"{t['status']:<4}  {t['name']}" in text
        # Every line names its hardware, the run's or "any", as --targets does.
        assert t["name"].startswith("any: " if t["hardware"] == "any" else
                                    f"{t['hardware']}: "), t["name"]
    judged = [t for t in report["targets"] if t["status"] != "N/A"]
    met = sum(t["status"] == "PASS" for t in judged)
    assert f"{met} of {len(judged)} targets that apply to cpu met" in text
    assert f"{len(report['targets']) - len(judged)} for other hardware not applicable" in text
    # Under the summary, what a MISS means and where today's status is kept.
    summary_at = text.index(bench_report.summary(report))
    assert text[summary_at:].splitlines()[1] == bench_report.MISS_MEANING
    assert "not a correctness failure" in bench_report.MISS_MEANING
    assert "Prefix sweep" in text and "Host overhead" in text


def table_rows(text, title):
    """The rows of the table under the caption that starts with ``title``."""
    lines = text.split(title, 1)[1].split("\n\n", 1)[0].splitlines()
    return lines[3:]  # the rest of the caption, the header, the rule


def test_human_report_prints_the_caller_thread_sections(run):
    report, _, _ = run
    text = bench.format_report(report)
    first = table_rows(text, "First call of a size on a fresh manager")
    queued = table_rows(text, "Caller's thread behind 10 queued steps")
    for lines, rows in ((first, report["first_call"]), (queued, report["queued"])):
        assert [line.split("  ")[0] for line in lines] == \
            [f"path={r['path']} -> {','.join(r['movers'])}" for r in rows]
    for line, row in zip(queued, report["queued"]):
        cells = line.split()  # ... offload() call, wait(), done, load() call, result(), done
        assert (cells[-4], cells[-1]) == tuple(f"{row[op]['steps_done_at_return']:.0%}"
                                               for op in ("offload", "load"))


def test_pinned_mover_table_and_targets(run):
    """The pinned mover's offload and load, both integrity modes, against the limit of
    the same case, in every throughput cell and sweep size; CPU targets on the cells."""
    report, _, _ = run
    text = bench.format_report(report)
    rows = table_rows(text, "Pinned mover (")
    cases = report["throughput"] + report["sweep"]
    assert len(rows) == len(cases)
    for line, r in zip(rows, cases):
        f = bench_report.pinned_figures(r)
        assert set(f) == {"offload off", "offload page", "load off", "load page"}
        assert f["offload page"] is r["methods"]["offload_pinned_page"]
        assert f"{f['load page']['gbps']:.2f} ({f['load page']['fraction_of_limit']:.2f}x)" \
            in line
        assert line.split()[-1] == "pinned"
    names = [t["name"] for t in report["targets"]]
    assert sum(n.startswith("cpu: pinned mover") for n in names) == 4
    # Where auto is the pinned mover (GPU), its own figures are the pinned mover's.
    row = {**report["throughput"][0], "paths": ["pinned"], "pinned_methods": False}
    assert bench_report.pinned_figures(row)["load off"] is row["methods"]["load_off_all"]
    assert bench_report.pinned_figures({**row, "paths": ["raw"]}) is None


def test_words_page_and_staged_keep_one_meaning(run):
    report, _, lines = run
    text = "\n".join([bench.format_report(report), *lines])
    # A page spans every layer; a single layer's unit is a block.
    assert "KiB pages" not in text and "KiB bfloat16 pages" not in text
    assert re.search(r"\d+ KiB (bfloat16|int8) blocks", text)
    # "staged" names the path only.
    assert [line for line in text.splitlines() if "staged" in line] == \
        [line for line in text.splitlines() if "path=staged" in line]


def test_a_smoke_run_is_printed_without_verdicts(run):
    """Smoke figures are too small to mean anything: the report shows them, judges
    none (no PASS or MISS line, no count of targets met) and says so."""
    report, _, _ = run
    text = bench.format_report(report, width=100)
    assert bench_report.NOT_JUDGED.split(".")[0] in text
    assert "targets that apply" not in text and bench_report.MISS_MEANING not in text
    assert not [line for line in text.splitlines()
                if line.startswith(("PASS  ", "MISS  ", "N/A  "))]
    assert "Prefix sweep" in text and "Host overhead" in text  # the figures are there


def test_a_complete_run_reports_its_misses_and_exits_0(cli_run, capsys):
    report, _, lines, rc = cli_run
    misses = bench.missed(report)
    assert rc == 0 and any(t["target"] == "call_idle_ms_cpu" for t in misses)
    # A smoke run without --check names no miss: its figures are not judged.
    assert not [line for line in lines if "targets" in line or "MISS" in line]
    assert not [t for t in misses if any(t["name"] in line for line in lines)]
    # A run of another preset names each miss, and says --check would exit 1 on it.
    quick = {**report, "meta": {**report["meta"], "preset": "quick"}}
    bench_cli.say_misses(quick, check=False)
    lines = capsys.readouterr().err.splitlines()
    assert any("reported, not judged: --check exits 1 on a miss" in line for line in lines)
    for t in misses:
        assert any(t["name"] in line for line in lines)
    # The accelerators' call target at 0 ms is not applicable here: never a miss.
    assert not [t for t in misses if t["target"] == "host_overhead_ms"]


def test_check_exits_1_on_a_miss_and_names_it(fit_only):
    # Every target at 0 that applies to CPU is missed, and the command names each one.
    report, rc, stderr = fit_only
    misses = bench.missed(report)
    assert len(misses) == 5 and rc == 1
    assert max(map(len, stderr.splitlines())) <= 100  # wrapped to fit a terminal
    said = " ".join(stderr.split())
    assert "0 of 5 targets that apply to cpu met, 5 missed; 2 for other hardware not " \
        "applicable (--check: exit 1):" in said
    for t in report["targets"]:
        assert (f" {t['name']}: " in said) == (t["status"] == "MISS")


def test_missed_and_forced_targets_on_a_report(run):
    report, _, _ = run
    forced = {**report, "targets": bench.evaluate_targets(report, bench.Targets(
        cpu_fraction=1e9, host_overhead_ms=0.0, gpu_over_device_get=1e9))}
    names = {t["name"] for t in bench.missed(forced)}
    assert len([n for n in names if n.startswith("cpu: ") and "memcpy" in n]) == 8
    # Targets for other hardware stay N/A whatever their thresholds.
    assert not [n for n in names if "host overhead" in n or "device_get" in n]
    with pytest.raises(ValueError, match="host_overhead_ms"):
        bench.Targets(host_overhead_ms=-1.0)


def test_progress_lines_count_every_step_and_estimate_what_is_left(run):
    _, _, lines = run
    numbered = [PROGRESS.match(line) for line in lines if PROGRESS.match(line)]
    # What the run says on stderr fits a 100-column terminal: a long step's
    # description continues on indented lines under the one with its number.
    assert max(map(len, lines)) <= 100
    assert any(line.startswith("  ") for line in lines)
    # Every progress line carries a step number, notes within a step too.
    assert numbered and len(numbered) == len([line for line in lines if "elapsed" in line])
    steps = [m for i, m in enumerate(numbered)
             if i == 0 or m.group(1) != numbered[i - 1].group(1)]
    notes = [m.group(4) for m in numbered if m not in steps]
    assert any("memory: host pool vs plan" in note for note in notes)
    totals = {int(m.group(2)) for m in numbered}
    assert len(totals) == 1
    numbers = [int(m.group(1)) for m in steps]
    assert numbers == list(range(1, totals.pop() + 1))  # each step number once, in order
    # The estimate shows once a quarter of the steps (two at least) have finished, and
    # never rises.
    total = int(steps[0].group(2))
    assert [bool(m.group(3)) for m in steps] == \
        [n - 1 >= max(2, total / 4) for n in numbers]
    left = [int(a) * 60 + int(b) for m in steps if m.group(3)
            for a, b in [re.search(r"(\d+):(\d\d) left", m.group(3)).groups()]]
    assert left == sorted(left, reverse=True)


def test_the_report_fits_100_columns_and_says_why_a_cell_is_empty(run):
    report, _, _ = run
    wide, narrow = bench.format_report(report), bench.format_report(report, width=100)
    assert max(map(len, wide.splitlines())) > 100  # the smoke run has wide tables
    assert max(map(len, narrow.splitlines())) <= 100
    # The run records what it cost and how busy the machine was.
    meta = report["meta"]
    assert meta["peak_rss_bytes"] > 0 and len(meta["load_average"]) == 3
    assert f"peak host memory {meta['peak_rss_bytes'] / 1e9:.2f} GB" in narrow.splitlines()[-1]
    # Cut into parts of whole columns: every header of the wide report is still there.
    for header in ("user gather->pinned batched", "kvxfer integrity=page", "page/layer"):
        assert header in wide and header in narrow
    skipped = {**report, "throughput": [
        {**r, "methods": {**r["methods"], "user_batched_gather_pinned": None}}
        for r in report["throughput"]],
        "meta": {**report["meta"], "config": {**report["meta"]["config"],
                                              "batched_baseline": "none"}}}
    text = bench.format_report(skipped, width=100)
    assert text.count("-: the batched user baselines are timed in no cell of this preset") == 1


def test_out_dir_holds_the_report_and_a_plot_when_matplotlib_is_there(run):
    report, out, _ = run
    assert json.loads((out / "bench.json").read_text()) == report
    assert (out / "bench.png").exists() == HAS_MPL
    assert ("plot" in report["files"]) == HAS_MPL
    assert any("matplotlib" in note for note in report["not_measured"]) != HAS_MPL


def test_plot_keeps_one_colour_per_variant_and_shows_users_both_ways(run):
    report, _, _ = run
    variants = bench_report.VARIANTS
    assert len({v.colour.lower() for v in variants}) == len(variants)
    assert len({v.name for v in variants}) == len(variants)
    keys = [key for v in variants for key, _ in v.methods.values() if key != "limit"]
    assert len(keys) == len(set(keys))  # a method is drawn as one variant only
    for v in variants:
        for direction, (key, _) in v.methods.items():
            assert key == "limit" or all(
                row["methods"][key]["direction"] == direction for row in report["sweep"]), key
    both = {v.name for v in variants if set(v.methods) == {"d2h", "h2d"}}
    assert {"limit", "user, per page", "user, batched", "kvxfer integrity=off",
            "kvxfer integrity=page"} <= both
    assert [d for _, d in bench_report.PANELS] == ["d2h", "h2d"]


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed (extra 'plot')")
def test_plot_lines_take_their_variants_colour_and_bytes_read_as_bytes(run):
    from matplotlib.colors import to_hex

    report, _, _ = run
    fig = bench_report.figure(report)
    colours = {}
    for ax, (_, direction) in zip(fig.axes, bench_report.PANELS):
        drawn = [v for v in bench_report.VARIANTS if direction in v.methods]
        lines = ax.get_lines()
        assert len(lines) == len(drawn)
        for line, v in zip(lines, drawn):
            assert to_hex(line.get_color()) == v.colour.lower()
            assert line.get_linestyle() == v.linestyle
            colours.setdefault(v.name, set()).add(to_hex(line.get_color()))
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert labels == [format_bytes(r["bytes"]) for r in report["sweep"]]
    assert all(len(c) == 1 for c in colours.values())
    assert {"user, per page", "user, batched"} <= set(colours)


def test_gpu_targets_and_report_from_the_same_figures(run):
    # The GPU branch cannot run here; its targets and tables are read from the same
    # report structure, so check they are built from it without error.
    report, _, _ = run
    # The smoke run's cases, as if they moved 64 MiB a call (the size targets apply).
    big = {k: [{**r, "bytes": 64 << 20} for r in report[k]] for k in ("throughput", "sweep")}
    gpu = {**report, **big, "meta": {**report["meta"], "platform": "gpu"}}
    targets = bench.evaluate_targets(gpu)
    names = [t["name"] for t in targets if t["status"] != "N/A"]
    assert any("0.95x integrity=off" in n for n in names)
    assert any("100x the per-page device_get" in n for n in names)
    assert not any(n.startswith("cpu:") for n in names)
    # The CPU targets are listed as not applicable, one line each, never as misses.
    assert {t["target"] for t in targets if t["status"] == "N/A"} == \
        {s.field for s in bench.TARGET_TABLE if not s.applies("gpu")}
    # On an accelerator the call host time is judged in both sections that time it.
    assert len([n for n in names if n.startswith("gpu: host overhead per")]) == 6
    assert any(n.startswith("gpu: host time of a call") and "(every path) <= 1 ms" in n
               for n in names)
    for want in ("offload >= 0.9x pinned copy at >= 64 MiB", "load of one page >= 0.4x",
                 "offload of 16 KiB blocks >= 0.5x", "load >= 1.2x the plain-JAX route",
                 "gpu: 1-page x 2 layers hit"):
        assert any(want in n for n in names), want
    over = next(t for t in targets if "offload >= 1.2x the plain-JAX" in t["name"])
    assert over["value"] == min(r["methods"]["offload_page"]["gbps"]
                                / r["methods"]["jax_gather_pinned"]["gbps"]
                                for r in big["throughput"] + big["sweep"])
    text = bench.format_report({**gpu, "targets": targets}, judge=True)
    assert "pinned d2h" in text and "pinned h2d" in text and "100x" in text
