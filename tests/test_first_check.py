"""The device check's first step (``kvxfer.bench.first_check``) on XLA:CPU: every step
runs and reports, each record is on disk as soon as its step ends, a failing step
does not stop the others, and the checks inside can fail."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from jax.experimental.buffer_callback import buffer_callback

from kvxfer.bench import first_check


def records(path):
    return [json.loads(line) for line in (path / "first.jsonl").read_text().splitlines()]


def test_every_step_runs_and_reports(tmp_path):
    lines = []
    assert first_check.run(tmp_path, first_check.CheckConfig.small(), say=lines.append)
    got = records(tmp_path)
    assert [r["step"] for r in got] == [name for name, _ in first_check.STEPS]
    assert [json.loads(line) for line in lines] == got
    by = {r["step"]: r for r in got}
    assert all(r["ok"] for r in got), [r for r in got if not r["ok"]]
    assert by["versions"]["dma"] == "available" and by["versions"]["engine"] == "host"
    spy = by["callback_spy"]
    assert spy["callbacks"] == 2 and spy["directions"] == ["load", "offload"] and spy["found"]
    assert set(by["round_trips"]) >= {"bfloat16-never", "bfloat16-always",
                                       "float8_e4m3fn-never", "float8_e4m3fn-always"}
    for case in ("never", "always"):
        assert by["no_cache_copy"][case]["cache_copies"] == 0
    rows = by["copy_sizes"]["rows"]
    assert [r["copy_bytes"] for r in rows] == list(first_check.CheckConfig.small().copy_sizes)
    assert all(0 < r["offload_of_limit"] and 0 < r["load_of_limit"] for r in rows)
    assert by["caller_time"]["offload_call_ms"] > 0 and by["caller_time"]["load_call_ms"] > 0
    overlap = by["overlap"]
    assert overlap["alone_ms"] > 0 and overlap["ratio"] == overlap["after_offload_ms"] / \
        overlap["alone_ms"]
    assert overlap["ratio_xla_stream"] == overlap["after_offload_xla_stream_ms"] / \
        overlap["alone_ms"]
    loads = by["load_overlap"]
    assert loads["last_layer_ms"] > 0 and loads["copy_ms"] > 0 and loads["layers"] == 2
    assert loads["prefetch_ratio"] == loads["matmul_after_prefetch_ms"] / \
        loads["matmul_alone_ms"]


def test_each_record_is_on_disk_when_its_step_ends(tmp_path):
    """A run cut short reports what it finished: a step sees the records of the steps
    before it in the file; a failing step is recorded and the next one runs."""
    seen = {}

    def ok(cfg):
        return True, {"value": 1}

    def look(cfg):
        seen["before"] = [r["step"] for r in records(tmp_path)]
        return True, {}

    def broken(cfg):
        raise RuntimeError("no device")

    steps = [("first", ok), ("broken", broken), ("look", look)]
    assert not first_check.run(tmp_path, first_check.CheckConfig.small(), steps,
                               say=lambda line: None)
    assert seen["before"] == ["first", "broken"]
    got = records(tmp_path)
    assert got[1]["ok"] is False and got[1]["error"] == "RuntimeError: no device"
    assert got[0]["value"] == 1 and [r["step"] for r in got] == ["first", "broken", "look"]


def test_the_copy_check_finds_a_program_that_copies_a_cache():
    """What a load would compile to if XLA could not write the caches in place: a
    callback that updates a cache it was not given (no donation) copies it first."""
    cache = jax.ShapeDtypeStruct((64, 8, 128), jnp.bfloat16)
    spec = jax.ShapeDtypeStruct(cache.shape, cache.dtype)

    def update(c):
        return buffer_callback(lambda ctx, out, x: None, spec,
                               input_output_aliases={0: 0})(c)

    copying = jax.jit(update).lower(cache).compile()
    found = first_check.cache_copies(copying, [jnp.zeros(cache.shape, cache.dtype)])
    assert found["cache_copies"] >= 1 and found["alias_bytes"] == 0
    in_place = jax.jit(update, donate_argnums=0).lower(cache).compile()
    found = first_check.cache_copies(in_place, [jnp.zeros(cache.shape, cache.dtype)])
    assert found["cache_copies"] == 0 and found["alias_bytes"] == found["cache_bytes"]
