"""A real redis-server for tests: started on a free loopback port in a temporary
directory, answering PING before it is handed out, stopped afterwards; a watchdog
stops it and removes its directory if the test process dies first (``watched``).

The ``redis_server`` fixture (conftest.py) skips when redis-server or redis-py is
missing, and fails instead when ``KVXFER_REQUIRE_REDIS=1`` (CI sets it). The
``redis_cluster`` fixture does the same for a three-node Redis Cluster (``Cluster``),
which also needs redis-cli (the same Debian package as redis-server).

``Proxy`` stands between clients and one server, to make it misbehave on demand:
answer chosen bytes, or hold its replies back; ``redis_cluster(proxied=True)`` puts one
in front of each node (the nodes announce the proxies' ports, so every client of the
cluster goes through them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

REQUIRE = "KVXFER_REQUIRE_REDIS"


# The watchdog of a test's redis-servers: once the test process is gone, however it
# went (killed, SIGKILL included), it kills every process whose working directory is in
# the servers' directory (redis-server changes to its --dir and rewrites its command
# line, so the directory is what names it) and removes that directory.
_WATCHDOG = """
import os, shutil, signal, sys, time
parent, work = int(sys.argv[1]), os.path.realpath(sys.argv[2])
while os.getppid() == parent:
    time.sleep(0.2)
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        continue
    if cwd == work or cwd.startswith(work + os.sep):
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
time.sleep(0.2)
shutil.rmtree(work, ignore_errors=True)
"""


@contextlib.contextmanager
def watched(work: str) -> Iterator[None]:
    """While the block runs, the redis-servers working in ``work`` and ``work`` itself
    do not outlive this process: a watchdog (a session of its own, so a Ctrl-C to the
    tests does not reach it) removes them if it dies. Stopped when the block ends."""
    import sys

    dog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), work],
                           start_new_session=True, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        dog.kill()
        dog.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require(*tools: str) -> None:
    """Skips the test without redis-server (and ``tools``) on PATH or redis-py, or
    fails it when ``KVXFER_REQUIRE_REDIS=1`` requires the Redis tests to run."""
    why = None
    missing = [t for t in ("redis-server", *tools) if shutil.which(t) is None]
    if missing:
        why = f"{missing[0]} is not on PATH"
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
    with tempfile.TemporaryDirectory(prefix="kvxfer-redis-") as work, watched(work):
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


class Proxy:
    """A TCP proxy on loopback in front of the server at ``127.0.0.1:target``: passes
    bytes both ways (``passing``), answers every write of a client with chosen bytes
    without passing it on (``answering``: a server that answers junk; ``answering_once``:
    one write, as a node that redirects once), or holds the server's bytes back for a
    while before passing them on (``delaying``: a slow server). ``down_bytes`` counts
    the bytes passed from the server to clients.
    """

    def __init__(self, target: int, port: int = 0):
        self.target = target
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._mode: tuple = ("pass",)
        self._lock = threading.Lock()
        self.down_bytes = 0
        self.answered_once = 0  # writes ``answering_once`` answered
        self._held = 0  # chunks held back now
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def passing(self) -> None:
        self._mode = ("pass",)

    def answering(self, data: bytes) -> None:
        self._mode = ("answer", data)

    def delaying(self, seconds: float) -> None:
        self._mode = ("delay", seconds)

    def answering_once(self, trigger: bytes, data: bytes) -> None:
        """Answers the next write of a client that holds ``trigger`` with ``data``
        (without passing it on), then passes bytes both ways again."""
        self._mode = ("once", trigger, data)

    def wait_delivered(self, timeout_s: float = 30.0) -> None:
        """Until no chunk is held back (every delayed reply has reached its client)."""
        deadline = time.monotonic() + timeout_s
        while self._held and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target), timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._up, args=(client, server), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while data := client.recv(1 << 16):
                mode = self._mode
                if mode[0] == "answer":
                    client.sendall(mode[1])
                elif mode[0] == "once" and mode[1] in data:
                    with self._lock:
                        mine = self._mode is mode
                        if mine:
                            self._mode = ("pass",)
                    if mine:
                        self.answered_once += 1
                        client.sendall(mode[2])
                    else:
                        server.sendall(data)
                else:
                    server.sendall(data)
        except OSError:
            pass
        finally:
            _close(client, server)

    def _down(self, server: socket.socket, client: socket.socket) -> None:
        try:
            while data := server.recv(1 << 16):
                mode = self._mode
                if mode[0] == "delay":
                    with self._lock:
                        self._held += 1
                    try:
                        time.sleep(mode[1])
                        client.sendall(data)
                    finally:
                        with self._lock:
                            self._held -= 1
                else:
                    client.sendall(data)
                with self._lock:
                    self.down_bytes += len(data)
        except OSError:
            pass
        finally:
            _close(client, server)


def _close(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


class Cluster:
    """A Redis Cluster of primaries on loopback, started by ``redis_cluster``.

    ``spec`` is its ``redis+cluster://`` store spec. ``kill(port)`` and ``restart(port)``
    stop a node hard (``SIGKILL``) and start it again on the same port with its
    ``nodes-PORT.conf``, so it rejoins with its slots (and, with ``--save ''``, none of
    its keys).
    """

    def __init__(self, exe: str, cli: str, work: str, ports: list[int], buses: list[int],
                 proxied: bool = False):
        self.exe, self.cli, self.work = exe, cli, work
        self.ports, self._buses = ports, dict(zip(ports, buses))
        self._procs: dict[int, subprocess.Popen] = {}
        #: With ``proxied``: each node's ``Proxy`` by the node's port.
        self.proxies = {p: Proxy(p) for p in ports} if proxied else {}

    @property
    def spec(self) -> str:
        ports = [self.proxies[p].port for p in self.ports] if self.proxies else self.ports
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)

    def proxy_of(self, node: str) -> Proxy:
        """The proxy a node's clients reach it through, by the ``HOST:PORT`` they know."""
        port = int(node.rpartition(":")[2])
        return next(p for p in self.proxies.values() if p.port == port)

    def log(self, port: int) -> str:
        path = os.path.join(self.work, f"redis-{port}.log")
        return open(path, encoding="utf-8", errors="replace").read() \
            if os.path.exists(path) else ""

    def start(self, port: int) -> None:
        # cluster-require-full-coverage no: the live primaries keep serving their slots
        # while one is down (the default refuses every query of the whole cluster).
        # cluster-port: the default bus port (PORT + 10000) may be past 65535 or taken.
        self._procs[port] = subprocess.Popen(
            [self.exe, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "2000",
             "--cluster-port", str(self._buses[port]),
             "--cluster-require-full-coverage", "no", "--appendonly", "no", "--save", "",
             "--dir", self.work, "--logfile", os.path.join(self.work, f"redis-{port}.log"),
             *(("--cluster-announce-port", str(self.proxies[port].port),
                "--cluster-announce-bus-port", str(self._buses[port]))
               if self.proxies else ())],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def ping(self, port: int) -> bool:
        import redis

        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0,
                             socket_connect_timeout=1.0)
        try:
            return bool(client.ping())
        except redis.exceptions.ConnectionError:
            return False
        finally:
            client.close()

    def info(self, port: int) -> str:
        out = subprocess.run([self.cli, "-p", str(port), "cluster", "info"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every node answers and says ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._procs[p].poll() is None and self.ping(p) and
                   "cluster_state:ok" in self.info(p) for p in self.ports):
                return
            time.sleep(0.1)
        raise RuntimeError("the Redis cluster did not reach cluster_state:ok:\n" +
                           "\n".join(self.log(p)[-2000:] for p in self.ports))

    def kill(self, port: int) -> None:
        proc = self._procs[port]
        proc.kill()
        proc.wait()

    def restart(self, port: int) -> None:
        """Starts a killed node again on its port; returns once it answers PING."""
        self.start(port)
        deadline = time.monotonic() + 20.0
        while not self.ping(port):
            if self._procs[port].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not come back:\n"
                                   f"{self.log(port)[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        for proc in self._procs.values():
            _stop(proc)
        for proxy in self.proxies.values():
            proxy.close()


def _start_cluster(exe: str, cli: str, work: str, nodes: int, timeout_s: float,
                   proxied: bool) -> tuple[Cluster | None, str]:
    """Starts the nodes, each answering PING: ``(cluster, "")``, or ``(None, log)`` when
    one lost a port to another socket (its log says "Address already in use"), after
    stopping them all.

    Raises:
      RuntimeError: a node exited, or did not answer PING within ``timeout_s``.
    """
    socks = [socket.socket() for _ in range(2 * nodes)]
    for s in socks:  # held open together, so the ports differ
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    # The proxies bind ports of their own while the nodes' are still held, so the
    # system never hands them a node's port or cluster bus port.
    cluster = Cluster(exe, cli, work, ports[:nodes], ports[nodes:], proxied)
    for s in socks:
        s.close()
    try:
        for port in cluster.ports:
            cluster.start(port)
        deadline = time.monotonic() + timeout_s
        for port in cluster.ports:
            while not cluster.ping(port):
                if cluster._procs[port].poll() is not None or time.monotonic() > deadline:
                    log = cluster.log(port)
                    if "Address already in use" in log:
                        cluster.stop()
                        return None, log
                    raise RuntimeError(f"redis-server on port {port} did not answer "
                                       f"PING:\n{log}")
                time.sleep(0.02)
    except BaseException:
        cluster.stop()
        raise
    return cluster, ""


@contextlib.contextmanager
def redis_cluster(nodes: int = 3, timeout_s: float = 30.0,
                  proxied: bool = False) -> Iterator[Cluster]:
    """A running Redis Cluster of ``nodes`` primaries, no replicas; yields its ``Cluster``.
    With ``proxied``, each node announces (and clients reach it through) its ``Proxy``.

    Raises:
      RuntimeError: a node did not start, ``redis-cli --cluster create`` failed, or the
        cluster did not reach ``cluster_state:ok`` within ``timeout_s``.
    """
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if exe is None or cli is None:
        raise FileNotFoundError("redis-server or redis-cli is not on PATH")
    with tempfile.TemporaryDirectory(prefix="kvxfer-redis-cluster-") as work, watched(work):
        for _ in range(3):  # another socket may take a chosen port first: again
            cluster, log = _start_cluster(exe, cli, work, nodes, timeout_s, proxied)
            if cluster is not None:
                break
        else:
            raise RuntimeError(f"redis-server could not bind its ports in 3 tries:\n{log}")
        try:
            out = subprocess.run(
                [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in cluster.ports),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=timeout_s)
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}"
                                   f"{out.stderr}")
            cluster.wait_ok(timeout_s)
            yield cluster
        finally:
            cluster.stop()
