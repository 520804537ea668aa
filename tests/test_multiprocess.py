"""Two real JAX processes on loopback agree on each load's verified prefix."""

import json
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import pytest

WORKER = pathlib.Path(__file__).with_name("two_process_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(scenario: str, *, worker: pathlib.Path = WORKER,
             exit_codes: tuple[int, int] = (0, 0), timeout: float = 120) -> list[dict | None]:
    """Runs ``worker RANK PORT scenario`` as two processes; each one's last JSON line.

    A rank that printed nothing gives None. Output goes to files, not pipes, so a
    rank that logs a lot cannot block while the other is being waited for.
    """
    port = str(_free_port())
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(2)]
    procs = [subprocess.Popen([sys.executable, str(worker), str(rank), port, scenario],
                              stdout=out, stderr=err, text=True)
             for rank, (out, err) in enumerate(logs)]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for rank, p in enumerate(procs):
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} hung in scenario {scenario!r}")
        for rank, (p, (out, err)) in enumerate(zip(procs, logs)):
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
            assert p.returncode == exit_codes[rank], \
                f"rank {rank} exited with {p.returncode}:\n{stderr[-3000:]}"
            lines = stdout.strip().splitlines()
            results.append(json.loads(lines[-1]) if lines else None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for out, err in logs:
            out.close()
            err.close()
    return results


def test_corruption_on_one_process_gives_both_the_same_prefix():
    a, b = run_pair("one-process")
    assert a["processes"] == b["processes"] == 2
    assert a["prefix"] == b["prefix"] == 2
    assert "digest mismatch in layer 1" in b["reasons"]["2"]
    # Proven bad on rank 1 only, freed on both: the ranks' caches stay the same.
    assert a["reasons"]["2"].startswith("proven bad on rank(s) [1]")
    assert a["freed"] == b["freed"] == [2]
    assert a["exact"] and b["exact"]
    assert b["consumed"]  # layer 0 was released with all 4 pages before layer 1 failed


def test_clean_pair_agrees_on_everything():
    a, b = run_pair("none")
    assert a["prefix"] == b["prefix"] == 4 and a["exact"] and b["exact"]


def test_transfer_failure_on_one_process_fails_both():
    a, b = run_pair("transfer")
    assert "injected device transfer failure" in a["error"]
    assert "a transfer failed on another process" in b["error"]


def test_load_that_raises_in_the_call_still_takes_part():
    # Rank 0's first load raises in the call; rank 1's first load must fail with it
    # (not pair with rank 0's second load), and the second loads then agree.
    a, b = run_pair("sync-then-bad-page")
    assert a["first"]["raised"] == "ValueError"
    assert "device_blocks[3] = 8 is out of range" in a["first"]["error"]
    assert "a transfer failed on another process" in b["first"]["error"]
    assert a["second"]["prefix"] == b["second"]["prefix"] == 2
    assert "digest mismatch in layer 1" in b["second"]["reasons"]["2"]
    assert a["second"]["reasons"]["2"].startswith("proven bad on rank(s) [1]")
    assert a["second"]["exact"] and b["second"]["exact"]


def test_a_load_cancelled_on_one_process_still_takes_part():
    # Rank 0 cancels; rank 1's load is not changed by it (its own bad page 2 gives
    # prefix 2), and the next loads pair up as usual.
    a, b = run_pair("cancel-one")
    assert a["cancel"] and a["first"]["cancelled"]
    assert b["first"]["prefix"] == 2 and b["first"]["exact"]
    assert "digest mismatch in layer 1" in b["first"]["reasons"]["2"]
    assert a["second"]["prefix"] == b["second"]["prefix"] == 2
    assert a["second"]["exact"] and b["second"]["exact"]


def test_a_crashed_process_fails_the_load_instead_of_hanging():
    a, b = run_pair("crash", exit_codes=(0, 3))
    assert b is None  # rank 1 died before its load
    assert "did not answer" in a["first"]["error"] and "[1]" in a["first"]["error"]
