"""Calls run in a worker process of their own, so what they load and how they end stay
out of the caller's process.

The deviceless TPU compiler (libtpu) is loaded by the process that compiles, takes a
machine-wide lock there, prints start-up errors on a machine without a TPU, and can
abort the whole process on a program it cannot handle (a Pallas DMA with a host
endpoint it does not know, in libtpu 0.0.42.1 and 0.0.52). ``kvxfer aot`` and the
compiler as a layout source (``kvxfer.layout_source.Compiler``) therefore compile in a
``Worker``: the caller's process never loads libtpu, and a compile that aborts ends
the worker, which is reported, not the caller.

The worker is a fresh interpreter (``python -c``) that talks to its caller over two
pipes of its own, never through the caller's ``__main__``: ``multiprocessing``'s spawn
would run the caller's script again in the worker (a script without a ``__main__``
guard, a notebook or stdin could not start one), and a fork would copy the caller's
JAX runtime and threads.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

__all__ = ["Worker", "WorkerDied"]

# The worker's first lines: the caller's import path (so it imports what the caller
# can), then the loop.
_BOOT = ("import os, pickle, sys\n"
         "r = os.fdopen(int(sys.argv[1]), 'rb')\n"
         "sys.path[:] = pickle.load(r)\n"
         "from kvxfer._worker import _serve\n"
         "_serve(r, os.fdopen(int(sys.argv[2]), 'wb'))\n")


class WorkerDied(RuntimeError):
    """The worker process ended during a call (an abort, a signal, out of memory)."""


class Worker:
    """One worker process that runs calls in turn (a fresh one after a death).

    Args:
      setup: run in each worker process before its first call, with ``args`` (to set
        what that process, and only it, needs: its environment, say).

    Example:
        >>> import os
        >>> with Worker() as w:
        ...     other = w.call(os.getpid)
        ...     try:
        ...         w.call(os._exit, 3)
        ...     except WorkerDied as e:
        ...         died = str(e)
        ...     again = w.call(os.getpid)
        >>> other != os.getpid(), died.startswith("the worker process died running _exit"), \
                again != other
        (True, True, True)
    """

    def __init__(self, setup: Callable[..., None] | None = None, *args: Any) -> None:
        self._setup = (setup, args)
        self._proc: subprocess.Popen | None = None
        self._send: BinaryIO | None = None
        self._recv: BinaryIO | None = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        to_child, to_us = os.pipe(), os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(to_child[0]), str(to_us[1])],
                pass_fds=(to_child[0], to_us[1]), stdin=subprocess.DEVNULL)
        finally:
            os.close(to_child[0])
            os.close(to_us[1])
        self._send, self._recv = os.fdopen(to_child[1], "wb"), os.fdopen(to_us[0], "rb")
        self._send.write(pickle.dumps(list(sys.path)) + pickle.dumps(self._setup))
        self._send.flush()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in the worker; its exceptions are raised here.

        Raises:
          WorkerDied: the worker process ended before it returned (it is replaced for
            the next call).
        """
        request = pickle.dumps((fn, args, kwargs))  # an argument that cannot go: here
        with self._lock:
            try:
                if self._proc is None:
                    self._start()
                self._send.write(request)
                self._send.flush()
                ok, value = pickle.load(self._recv)
            except (EOFError, OSError, pickle.UnpicklingError):
                self._end()
                raise WorkerDied(f"the worker process died running "
                                 f"{getattr(fn, '__name__', fn)}") from None
            except BaseException:  # interrupted mid-call: the pipes' state is unknown
                self._end(kill=True)
                raise
        if ok:
            return value
        raise value

    def _end(self, kill: bool = False) -> None:
        for stream in (self._send, self._recv):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        if self._proc is not None:
            if kill:
                self._proc.kill()
            self._proc.wait()  # the worker sees its input end and exits
        self._proc = self._send = self._recv = None

    def close(self) -> None:
        """Ends the worker process (waiting for it)."""
        with self._lock:
            self._end()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _serve(requests: BinaryIO, replies: BinaryIO) -> None:
    """The worker's loop: set up, then run each call and send back what it returned or
    raised, until the caller closes its end."""
    setup, args = pickle.load(requests)
    if setup is not None:
        setup(*args)
    while True:
        try:
            fn, args, kwargs = pickle.load(requests)
        except EOFError:
            return
        try:
            reply = (True, fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - every error goes back to the caller
            reply = (False, e)
        try:
            data = pickle.dumps(reply)
        except Exception as e:  # noqa: BLE001 - a value or error that cannot travel
            data = pickle.dumps((False, RuntimeError(
                f"{getattr(fn, '__name__', fn)} returned or raised what cannot be sent "
                f"back ({type(e).__name__}: {e}): {reply[1]!r}"[:2000])))
        replies.write(data)
        replies.flush()
