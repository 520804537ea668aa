"""The bench's parts, without a run: its config's checks, the progress estimate, and
the physical limits it measures against.
"""

import os
import re
import subprocess
import sys

import pytest

from kvxfer import bench
from kvxfer.bench import limits, timing


@pytest.mark.parametrize("kwargs, match", [
    ({"reference": (32 * 1024, "bfloat16")}, "reference"),
    ({"cells": ((16 * 1024 + 1, "bfloat16"),), "reference": (16 * 1024 + 1, "bfloat16")},
     "multiple of 2"),
    ({"batched_baseline": "some"}, "batched_baseline"),
    ({"call_pages": 9}, "call_pages=9"),
    # The throughput cell (16 KiB, bfloat16) has caches of 8 blocks: not new to the run.
    ({"call_block_bytes": 16 * 1024, "call_blocks": 8}, "call_blocks=8: caches of 8 blocks"),
    ({"call_block_bytes": 16 * 1024, "call_blocks": 7}, "call_blocks=7: caches of 8 blocks"),
    ({"call_cases": ()}, r"call_cases to name some of \('staged', 'raw', 'pinned'\)"),
    ({"call_cases": ("raw", "raw")}, r"Got \('raw', 'raw'\) of type tuple"),
    ({"warmup_paths": ("dma",)}, r"warmup_paths to name some of \('auto', 'staged', 'pinned'\)"),
])
def test_config_rejects_bad_sizes(kwargs, match):
    base = bench.BenchConfig.smoke()
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    with pytest.raises(ValueError, match=match):
        bench.BenchConfig(**{**fields, **kwargs})


def test_progress_estimate_uses_the_mean_time_of_each_kind():
    t, said = [0.0], []
    p = timing.Progress(["cell", "cell", "cell", "sweep"], said.append, clock=lambda: t[0])
    p.step("cell", "a")
    assert p.left_s() is None
    t[0] = 10.0
    p.step("cell", "b")
    assert p.left_s() == 30.0  # 3 steps left at the 10 s the first one took
    t[0] = 40.0
    p.step("cell", "c")
    assert p.left_s() == 40.0  # cells average 20 s; the sweep, unseen, the same
    t[0] = 45.0
    p.step("sweep", "d")
    assert p.left_s() == pytest.approx(15.0)
    p.note("e")
    # The estimate shows once two steps (a quarter, at least) have finished: one step
    # is too little to go on. A note within a step carries that step's number.
    assert said == ["[1/4 0:00 elapsed] a", "[2/4 0:10 elapsed] b",
                    "[3/4 0:40 elapsed, about 0:40 left] c",
                    "[4/4 0:45 elapsed, about 0:15 left] d", "[4/4 0:45 elapsed] e"]


def test_progress_estimate_never_rises():
    # Fast steps first, then slow ones of the same kind: the mean rises, the estimate
    # shown holds instead. Every line, notes too, carries a step number.
    t, said = [0.0], []
    p = timing.Progress(["x"] * 8, said.append, clock=lambda: t[0])
    for i, at in enumerate([0, 1, 2, 3, 30, 70, 120, 180]):
        t[0] = float(at)
        p.step("x", f"s{i + 1}")
        p.note("n")
    left = [int(m.group(1)) * 60 + int(m.group(2)) for line in said
            if (m := re.search(r"about (\d+):(\d+) left", line))]
    assert len(left) == 6 and left == sorted(left, reverse=True) and left[0] > left[-1]
    assert all(re.match(r"\[\d+/8 ", line) for line in said)


def test_progress_estimate_waits_for_a_quarter_of_the_steps():
    t, said = [0.0], []
    p = timing.Progress(["x"] * 34, said.append, clock=lambda: t[0])
    for i in range(34):
        t[0] = 10.0 * i
        p.step("x", f"s{i + 1}")
    shown = [i + 1 for i, line in enumerate(said) if "left]" in line]
    assert shown == list(range(10, 35))  # 8.5 steps done (34 / 4) before step 10
    assert said[9] == "[10/34 1:30 elapsed, about 4:10 left] s10"


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host", None])
def test_jax_host_copy_limit_copies_both_ways(kind):
    with limits.JaxHostCopy(1 << 20, host_kind=kind) as limit:
        runners = limit.runners(1 << 16)
        assert set(runners) == {"d2h", "h2d"}
        assert all(fn() > 0 for fn in runners.values())
        assert (kind or "no host memory kinds") in limit.label


def test_limits_refuse_copies_beyond_their_buffers():
    with limits.Memcpy(1024) as limit:
        with pytest.raises(ValueError, match="capacity=1024"):
            limit.runners(2048)
    with pytest.raises(ValueError, match="Got 0 of type int"):
        limits.Memcpy(0)
    with pytest.raises(ValueError, match="Got 'device_host'"):
        limits.JaxHostCopy(1024, host_kind="device_host")


def test_fit_width_cuts_wide_tables_into_whole_columns_and_wraps_the_rest():
    from kvxfer._text import fit_width, table

    wide = table([["a", "1" * 50, "2" * 50], ["b", "3", "4"]], ["key", "first", "second"])
    text = fit_width(wide + "\n  -: a note right under the table, long enough to be wrapped "
                     "at the width asked for", 70)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 70
    # Each part repeats the key column; every cell is still there, whole.
    assert [line.split()[0] for line in lines if line[:1] in ("a", "b")] == ["a", "b", "a", "b"]
    assert "1" * 50 in text and "2" * 50 in text
    # The note is not taken for a row of the table: it is wrapped as prose.
    assert lines[-2] == "  -: a note right under the table, long enough to be wrapped at the"
    assert lines[-1] == "    width asked for"
    assert fit_width(wide, 200) == wide


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmHWM is Linux's")
def test_peak_memory_is_the_bench_process_own_not_its_parents():
    # Linux carries ru_maxrss across fork and exec: a bench started from a large test
    # session would report the session's peak. The bench reports its own (VmHWM).
    ballast = b"x" * (400 << 20)  # resident in this process when the child forks
    code = ("import resource; from kvxfer.bench import _hostrss; _hostrss.start(); "
            "print(_hostrss.peak_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    del ballast
    peak, inherited_kib = int(out[0]), int(out[1])
    assert inherited_kib * 1024 > 400 << 20  # what ru_maxrss would have said
    assert 0 < peak < 200 << 20
