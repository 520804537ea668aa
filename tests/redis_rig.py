"""A real redis-server for tests: started on a free loopback port in a temporary
directory, answering PING before it is handed out, stopped afterwards.

The ``redis_server`` fixture (conftest.py) skips when redis-server or redis-py is
missing, and fails instead when ``KVXFER_REQUIRE_REDIS=1`` (CI sets it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

REQUIRE = "KVXFER_REQUIRE_REDIS"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require() -> None:
    """Skips the test without redis-server on PATH or redis-py, or fails it when
    ``KVXFER_REQUIRE_REDIS=1`` requires the Redis tests to run."""
    why = None
    if shutil.which("redis-server") is None:
        why = "redis-server is not on PATH"
    elif importlib.util.find_spec("redis") is None:
        why = "redis-py is not installed (pip install 'kvxfer[redis]')"
    if why is None:
        return
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{why}, and {REQUIRE}=1 requires the Redis tests to run")
    pytest.skip(why)


@contextlib.contextmanager
def redis_server(timeout_s: float = 20.0) -> Iterator[str]:
    """A running redis-server; yields its URL (``redis://127.0.0.1:PORT/0``).

    Raises:
      RuntimeError: it exited or did not answer PING within ``timeout_s`` (its log
        says why).
    """
    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server is not on PATH")
    with tempfile.TemporaryDirectory(prefix="kvxfer-redis-") as work:
        for _ in range(3):  # another process may take the free port before the server
            port = free_port()
            log = os.path.join(work, f"redis-{port}.log")
            proc = subprocess.Popen(
                [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", work, "--logfile", log],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0,
                                 socket_connect_timeout=1.0)
            deadline = time.monotonic() + timeout_s
            up = False
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    up = client.ping()
                    break
                except redis.exceptions.ConnectionError:
                    time.sleep(0.02)
            client.close()
            if up:
                break
            _stop(proc)
        else:
            text = open(log, encoding="utf-8", errors="replace").read() \
                if os.path.exists(log) else ""
            raise RuntimeError(f"redis-server did not answer PING on port {port}:\n{text}")
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
