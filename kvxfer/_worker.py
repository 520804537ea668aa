"""Calls run in a worker process of their own, so what they load and how they end stay
out of the caller's process.

The deviceless TPU compiler (libtpu) is loaded by the process that compiles, takes a
machine-wide lock there, prints start-up errors on a machine without a TPU, and can
abort the whole process on a program it cannot handle (a Pallas DMA with a host
endpoint it does not know, in libtpu 0.0.42.1 and 0.0.52). ``kvxfer aot`` therefore
compiles in a ``Worker``: the command's own process never loads libtpu, and a compile
that aborts ends the worker, which is reported, not the command.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

__all__ = ["Worker", "WorkerDied"]


class WorkerDied(RuntimeError):
    """The worker process ended during a call (an abort, a signal, out of memory)."""


class Worker:
    """One spawned worker process that runs calls in turn (a fresh one after a death).

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
        """``setup(*args)`` runs in each worker process before its first call (to set
        what the process, and only it, needs: its environment, say)."""
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._setup = (setup, args)

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            # Spawned, not forked: the worker starts clean (no copy of this process's
            # JAX runtime or threads) and imports what each call needs.
            setup, args = self._setup
            self._pool = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"), initializer=setup,
                initargs=args)
        return self._pool

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in the worker; its exceptions are raised here.

        Raises:
          WorkerDied: the worker process ended before it returned (it is replaced for
            the next call).
        """
        try:
            return self._executor().submit(fn, *args, **kwargs).result()
        except BrokenProcessPool:
            self.close()
            raise WorkerDied(f"the worker process died running "
                             f"{getattr(fn, '__name__', fn)}") from None

    def close(self) -> None:
        """Ends the worker process (waiting for it)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
