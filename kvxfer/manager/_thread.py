"""The transfer thread: one thread that runs each transfer's second half, in order."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["TransferThread"]

log = logging.getLogger("kvxfer")

_STOP = None  # what ``shutdown`` queues: the thread ends once the calls before it ran


def _run(calls: queue.SimpleQueue) -> None:
    while True:
        call = calls.get()
        if call is _STOP:
            return
        fn, args = call
        try:
            fn(*args)
        except BaseException:  # the call's to report: a transfer ends its handle with it
            log.debug("kvxfer: a call on the transfer thread raised", exc_info=True)
        del call, fn, args  # what a call held goes before the thread waits again


class TransferThread:
    """Runs ``submit``-ted calls one at a time, in order, on a thread of its own.

    It does what ``concurrent.futures.ThreadPoolExecutor(1)`` did for a manager,
    without a ``Future`` and the executor's bookkeeping per call: a 1-page load's
    caller paid for them on its thread, and the transfer thread for the rest while
    the load's program ran. The thread starts with the first call. ``shutdown``, the
    interpreter's exit or the object's collection ends it once every call queued
    before has run.

    Example:
        >>> t = TransferThread()
        >>> out = []
        >>> t.submit(out.append, 1); t.submit(out.append, 2)
        >>> t.shutdown(); out
        [1, 2]
    """

    def __init__(self, name: str = "kvxfer"):
        self._name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queues ``fn(*args)``; it runs after every call queued before it.

        Raises:
          RuntimeError: after ``shutdown``.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the transfer thread is shut down; no call can be queued")
            if self._thread is None:
                self._start()
            self._calls.put((fn, args))

    def _start(self) -> None:
        # A daemon thread that the exit hook below ends and joins while daemon threads
        # still run: the calls queued run to their end, as an executor's would.
        self._thread = threading.Thread(target=_run, args=(self._calls,), name=self._name,
                                        daemon=True)
        self._thread.start()
        weakref.finalize(self, self._calls.put, _STOP).atexit = False
        _live.add(self)

    def shutdown(self, wait: bool = True) -> None:
        """Ends the thread once the calls queued have run; ``wait``: until then."""
        with self._lock:
            first, self._closed = not self._closed, True
            thread = self._thread
        if thread is None:
            return
        if first:
            self._calls.put(_STOP)
        if wait and thread is not threading.current_thread():
            thread.join()


_live: weakref.WeakSet[TransferThread] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for t in list(_live):
        t.shutdown(wait=True)
