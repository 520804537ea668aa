"""The tests' own hygiene: a redis-server a test run starts does not outlive it, even
when the run is killed (SIGKILL: no cleanup of its own runs)."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

HERE = pathlib.Path(__file__).parent


def _in(work):
    """Processes whose working directory is ``work`` (redis-server's --dir)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == work:
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("fixture", ["redis_server()", "redis_cluster()"])
def test_a_killed_test_run_leaves_no_redis_server_nor_its_directory(fixture):
    import redis_rig

    redis_rig.require("redis-cli")
    # Starts the servers, says where they work (its children's directories), waits.
    runner = ("import os, time, redis_rig\n"
              f"with redis_rig.{fixture}:\n"
              "    kids = [int(p) for t in os.listdir('/proc/self/task') for p in\n"
              "            open(f'/proc/self/task/{t}/children').read().split()]\n"
              "    print(' '.join(os.readlink(f'/proc/{k}/cwd') for k in kids), flush=True)\n"
              "    time.sleep(600)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        cwds = set(proc.stdout.readline().split())
        (work,) = {c for c in cwds if "kvxfer-redis" in c}  # the servers', not the dog's
        servers = _in(work)
        assert servers, "no redis-server works there"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20
        while (_in(work) or os.path.exists(work)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _in(work) == [] and not os.path.exists(work)
    finally:
        if proc.poll() is None:
            proc.kill()
