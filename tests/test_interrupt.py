"""Ctrl-C in the long commands: a real SIGINT sent to ``python -m kvxfer bench --smoke``
and ``kvxfer demo`` once they are working. The first stops the command at its next
safe point with one line on stderr and exit 130 (no traceback, no SIGSEGV from an
exception raised inside a compile); a second exits at once; nothing is left behind:
no child process, no temporary file."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

import kvxfer

SRC = str(pathlib.Path(kvxfer.__file__).resolve().parents[1])
# A line of progress: "kvxfer bench: [3/19 0:04 elapsed] ...", its indented wrapped
# continuation, or "kvxfer demo [  3.1 s] ...".
PROGRESS = ("kvxfer bench: [", "  ", "kvxfer demo [")


def _start(tmp_path, *argv):
    """``kvxfer ARGV`` in a process of its own, its temporary files under a directory of
    the test's, stderr to a file."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH"))
                                          if p))
    err = open(tmp_path / "stderr", "w+", encoding="utf-8")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "kvxfer", *argv], stdout=subprocess.PIPE,
                            stderr=err, text=True, env=env, cwd=tmp_path)
    return proc, tmp


def _wait_for(tmp_path, proc, marker, timeout=240):
    """Waits until ``marker`` is on the command's stderr: it is working."""
    deadline = time.monotonic() + timeout
    while marker not in (tmp_path / "stderr").read_text():
        assert proc.poll() is None, (tmp_path / "stderr").read_text()
        assert time.monotonic() < deadline, f"no {marker!r} after {timeout} s"
        time.sleep(0.1)


def _left_behind(tmp):
    """Processes that still carry the command's temporary directory in their
    environment (its children inherit it), and the files still in it."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if str(tmp).encode() in environ and int(pid) != os.getpid():
            alive.append(pid)
    return alive, sorted(p.name for p in tmp.iterdir())


def _interrupt(tmp_path, proc, times):
    for _ in range(times):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
    t0 = time.monotonic()
    stdout, _ = proc.communicate(timeout=180)
    return stdout, time.monotonic() - t0, (tmp_path / "stderr").read_text()


def _check_one_line(stderr, command):
    said = [line for line in stderr.splitlines() if not line.startswith(PROGRESS)]
    assert len(said) == 1, stderr
    assert said[0].startswith(f"kvxfer {command}: interrupted: stopping at") or \
        said[0].startswith(f"kvxfer {command}: interrupted: stopping after"), said
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr


def test_bench_stops_at_the_next_step_and_keeps_what_it_measured(tmp_path):
    proc, tmp = _start(tmp_path, "bench", "--smoke", "--out", str(tmp_path / "out"))
    _wait_for(tmp_path, proc, "[2/")  # a step done: there is something to keep
    stdout, _, stderr = _interrupt(tmp_path, proc, 1)
    assert proc.returncode == 130, stderr
    _check_one_line(stderr, "bench")
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["meta"]["interrupted"].startswith("by Ctrl-C in step ")
    assert report["targets"] == [] and "Interrupted by Ctrl-C" in stdout
    assert _left_behind(tmp) == ([], [])


@pytest.mark.parametrize("argv,marker", [(["bench", "--smoke"], "[1/"),
                                         (["demo", "--requests", "400"], "kvxfer demo [")])
def test_a_second_ctrl_c_exits_at_once(tmp_path, argv, marker):
    proc, tmp = _start(tmp_path, *argv)
    _wait_for(tmp_path, proc, marker)
    _, took, stderr = _interrupt(tmp_path, proc, 2)
    assert proc.returncode == 130, stderr
    assert took < 10, took  # at once: not after the step under way (generous bound)
    _check_one_line(stderr, argv[0])
    assert _left_behind(tmp) == ([], [])


def test_demo_stops_after_the_request_under_way(tmp_path):
    proc, tmp = _start(tmp_path, "demo", "--requests", "400", "--store",
                       str(tmp_path / "store"))
    _wait_for(tmp_path, proc, "kvxfer demo [")
    stdout, _, stderr = _interrupt(tmp_path, proc, 1)
    assert proc.returncode == 130, stderr
    _check_one_line(stderr, "demo")
    assert "writing its host pages to the store" in stderr and stdout == ""
    assert _left_behind(tmp) == ([], [])


def test_the_command_line_leaves_its_caller_as_it_found_it():
    """Called in-process, ``kvxfer.cli.main`` restores the SIGINT handler, the
    temporary directory and ``TMPDIR`` it set for a long command."""
    import tempfile

    from kvxfer import _interrupt, cli

    before = (signal.getsignal(signal.SIGINT), tempfile.tempdir, os.environ.get("TMPDIR"))
    assert cli.main(["probe", "--config", "tiny", "--pages", "2", "--num-blocks", "4",
                     "--json"]) == 0
    assert (signal.getsignal(signal.SIGINT), tempfile.tempdir,
            os.environ.get("TMPDIR")) == before
    assert not _interrupt.interrupted()
    _interrupt.check()  # outside the command line: never raises
