"""Ctrl-C at safe points: the command line's long commands stop between steps, never
inside a compile.

Python turns SIGINT into a ``KeyboardInterrupt`` raised at whatever bytecode runs
next; inside jaxlib (a compile calling back into Python) that exception crosses C++
frames, and the process can die of SIGSEGV. Under ``deferred`` (which only the
command line installs, in its own process) the first SIGINT prints one line and sets
a flag; ``check``, called by bench, demo and probe between steps, raises
``Interrupted`` there, so every ``finally`` and ``with`` on the way out runs (worker
processes stopped, temporary directories removed). A second SIGINT exits at once
(status 130) after stopping the child processes this process started and removing
its temporary directory.

Outside ``deferred`` (kvxfer used as a library) ``check`` does nothing: the caller's
signal handling is its own.

Example:
    >>> check()  # no Ctrl-C asked for a stop: nothing happens
    >>> interrupted()
    False
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator

__all__ = ["Interrupted", "EXIT_STATUS", "check", "interrupted", "deferred", "exit_now"]

EXIT_STATUS = 130
"""What a command stopped by Ctrl-C exits with (128 + SIGINT), as shells report it."""

_state = {"pressed": 0}


class Interrupted(BaseException):
    """Ctrl-C asked the command to stop; raised by ``check`` at a safe point. A
    BaseException, as KeyboardInterrupt is: an ``except Exception`` on the way out
    must not swallow it."""


def interrupted() -> bool:
    """Whether Ctrl-C has asked the running command to stop."""
    return _state["pressed"] > 0


def check() -> None:
    """A safe point: raises ``Interrupted`` once Ctrl-C was pressed under ``deferred``.

    Raises:
      Interrupted: the command should stop here.
    """
    if _state["pressed"]:
        raise Interrupted("interrupted by Ctrl-C")


def _stop_children() -> None:
    """Sends SIGTERM to this process's children (bench's warm-up workers, say): a
    second Ctrl-C leaves nothing running behind it."""
    children = []
    # Each thread's children are listed under its own task (a worker thread's Popen).
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/self/task/{task}/children", encoding="ascii") as f:
                    children += [int(p) for p in f.read().split()]
    for pid in children:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)


def exit_now() -> None:
    """Stops this process's children and exits at once, status 130 (no cleanup
    beyond that: what Ctrl-C pressed again asks for)."""
    _stop_children()
    os._exit(EXIT_STATUS)


class _Watcher:
    """Reads the signal numbers CPython's C-level handler writes to its wakeup fd, on a
    thread of its own: the first SIGINT's line is printed, and a second one acted on,
    at once, even while the main thread is inside a compile (Python-level handlers run
    only when the main thread returns to Python)."""

    def __init__(self, line: str, scratch: str):
        self.line, self.scratch = line, scratch
        self.reader, self.writer = socket.socketpair()
        self.writer.setblocking(False)
        self.thread = threading.Thread(target=self._watch, name="kvxfer-ctrl-c", daemon=True)

    def _watch(self) -> None:
        seen = 0
        while True:
            try:
                data = self.reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum != signal.SIGINT:
                    continue
                seen += 1
                if seen == 1:
                    print(self.line, file=sys.stderr, flush=True)
                else:
                    _stop_children()
                    shutil.rmtree(self.scratch, ignore_errors=True)
                    exit_now()

    def close(self) -> None:
        self.writer.close()  # the reader sees the end and the thread returns
        self.thread.join(timeout=5)
        self.reader.close()


@contextlib.contextmanager
def deferred(line: str) -> Iterator[None]:
    """Within: the first SIGINT prints ``line`` on stderr and makes ``check`` raise at
    the next safe point; a second stops this process's children, removes its temporary
    files and exits at once (status 130). Temporary files go to a directory of the
    command's own (``tempfile.tempdir`` and ``TMPDIR``, which its child processes
    inherit), removed at the end. What was there before is restored after. Only the
    main thread can set a handler: elsewhere this does nothing.

    Args:
      line: the one line the first Ctrl-C prints (what stops, and what is kept).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum: int, frame: object) -> None:
        _state["pressed"] += 1  # the watcher speaks and exits; here only the flag

    scratch = tempfile.mkdtemp(prefix="kvxfer-run-")
    saved_tempdir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    watcher = _Watcher(line, scratch)
    _state["pressed"] = 0
    previous = signal.signal(signal.SIGINT, on_sigint)
    previous_fd = signal.set_wakeup_fd(watcher.writer.fileno(), warn_on_full_buffer=False)
    tempfile.tempdir, os.environ["TMPDIR"] = scratch, scratch
    watcher.thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous)
        watcher.close()
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        shutil.rmtree(scratch, ignore_errors=True)
        _state["pressed"] = 0
