"""The device check's first step (``kvxfer.bench.first_check``) on XLA:CPU: every step
runs and reports, each record is on disk as soon as its step ends, a failing step
does not stop the others, and the checks inside can fail."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.buffer_callback import buffer_callback

from kvxfer.bench import _hazards, first_check


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
    # What broke in the DMA mover before: on XLA:CPU its host copy engine.
    groups = by["several_groups"]
    assert {k for k in groups if "integrity" in k} == {
        "8x16KiB-integrity-off", "8x16KiB-integrity-page", "32x4KiB-integrity-off",
        "32x4KiB-integrity-page"}
    for case in (v for k, v in groups.items() if "integrity" in k):
        assert case["exact"] and case["verified"] and len(case["rounds"]) == 2
        assert [r["prefetched"] for r in case["rounds"]] == [False, True]
    assert by["partial_enqueue"]["skipped"].startswith("no CUDA driver")
    reuse = by["allocator_reuse"]
    assert reuse["fresh_intact"] and reuse["loads_exact"] == reuse["cycles"] == 4
    assert reuse["fresh_arrays"] == 6 * reuse["cycles"]
    behind = by["load_behind_offload"]
    assert behind["exact"] and behind["offload_bytes"] == 512 << 10
    assert behind["behind_over_alone"] == behind["load_behind_offload_ms"] / \
        behind["load_alone_ms"]
    busy = by["busy_thread"]
    assert busy["spins"] > 0 and busy["wrong_loads"] == {"alone": 0, "busy": 0}
    assert busy["busy_over_alone_done"] == busy["busy_done_ms"] / busy["alone_done_ms"]


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


def test_the_command_line_runs_some_steps_or_all_but_some(tmp_path, capsys):
    """The device check runs what broke before under a limit of its own, then the rest."""
    assert first_check.main([str(tmp_path), "--small", "--steps", "versions"]) == 0
    assert first_check.main([str(tmp_path), "--small", "--skip",
                             ",".join(name for name, _ in first_check.STEPS[1:])]) == 0
    assert [r["step"] for r in records(tmp_path)] == ["versions", "versions"]
    with pytest.raises(SystemExit):
        first_check.main([str(tmp_path), "--steps", "versions,no_such_step"])
    assert "unknown steps ['no_such_step']" in capsys.readouterr().err


def test_the_byte_checks_find_what_they_look_for():
    """Wrong layers, blocks holding neither their old nor their new bytes, and a fresh
    array overwritten are each found."""
    old = [np.zeros((4, 8), np.uint16) for _ in range(2)]
    new = [np.full((4, 8), 7, np.uint16) for _ in range(2)]
    got = [new[0].copy(), old[1].copy()]
    got[1][2] = new[1][2]
    assert _hazards.wrong_layers(got, new) == [1]
    assert _hazards.foreign_blocks(got, old, new) == []
    got[0][3, 5] = 1  # one element of a block: neither old nor new
    assert _hazards.foreign_blocks(got, old, new) == [(0, 3)]
    fresh = _hazards.fill(1 << 14)
    assert _hazards.intact(fresh) and len({v for _, v in fresh}) == 3
    array, value = fresh[1]
    assert not _hazards.intact(fresh[:1] + [(array.at[0].set(value + 1), value)])


@pytest.mark.cpu("the stand-in CUDA driver's engine runs on XLA:CPU")
def test_the_fault_steps_pass_over_the_stand_in_cuda_engine(monkeypatch):
    """The device check's partial-enqueue, several-group and allocator-reuse steps,
    which XLA:CPU's own engine skips, run over the stand-in CUDA driver (copies beside
    XLA's stream, late) in both copy modes: every driver fault is reached, every step
    passes, and no event is left alive."""
    from cuda_rig import FakeDriver, HostStreamEngine

    from kvxfer.engine import COPY_ENGINES

    drivers = {mode: FakeDriver(delay=0.02) for mode in ("batch", "loop")}
    engines = {mode: HostStreamEngine(d.driver(), ordinal=0, mode=mode)
               for mode, d in drivers.items()}
    monkeypatch.setitem(COPY_ENGINES, "cpu", lambda device, copy="batch": engines[copy])
    monkeypatch.setattr(_hazards, "_on_gpu", lambda: True)
    cfg = first_check.CheckConfig.small()
    ok, figures = _hazards.partial_enqueue(cfg)
    cases = {k: v for k, v in figures.items() if isinstance(v, dict)}
    assert ok and len(cases) == len(_hazards.DRIVER_CASES), figures
    assert all(case["reached"] and case["alive"] and case["fresh_intact"]
               for case in cases.values()), figures
    for step in (_hazards.several_groups, _hazards.allocator_reuse):
        ok, figures = step(cfg)
        assert ok, (step.__name__, figures)
    assert not any(d.events for d in drivers.values())
