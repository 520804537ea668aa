"""Two real JAX processes on loopback agree on the verified prefix (gloo collectives)."""

import json
import pathlib
import socket
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("two_process_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(fault: str) -> list[dict]:
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), port, fault],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outs = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank hung")
        assert p.returncode == 0, stderr[-2000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


def test_corruption_on_one_process_gives_both_the_same_prefix():
    a, b = run_pair("one-process")
    assert a["processes"] == b["processes"] == 2
    assert a["prefix"] == b["prefix"] == 2
    assert "digest mismatch in layer 1" in b["reasons"]["2"]
    assert a["reasons"]["2"] == "invalid on another process"
    assert a["exact"] and b["exact"]
    assert b["consumed"]  # layer 0 was released with all 4 pages before layer 1 failed


def test_clean_pair_agrees_on_everything():
    a, b = run_pair("none")
    assert a["prefix"] == b["prefix"] == 4 and a["exact"] and b["exact"]


def test_transfer_failure_on_one_process_fails_both():
    a, b = run_pair("transfer")
    assert "injected device transfer failure" in a["error"]
    assert "a transfer failed on another process" in b["error"]
