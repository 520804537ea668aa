"""Deadlines of the cache's blocking calls, and waiting for futures against one.

Every call of ``HostCache`` that can block (``lookup``, ``find``, ``prefetch``,
``flush``, ``close``) takes a ``timeout`` and turns it into one ``Deadline`` for the
whole call: each wait inside it (for a prefetch, an offload, a store read, a queued
write) gets what is left, not a timeout of its own.

``wait_done`` waits for futures until a deadline. Unlike ``concurrent.futures.wait``
it counts a future cancelled by ``cancel()`` as done at once: ``wait`` counts only
futures whose executor also noticed the cancel, and an executor shut down with
``cancel_futures=True`` never does, so a wait on such a future never ends.

Example:
    >>> import concurrent.futures
    >>> queued = concurrent.futures.Future()
    >>> queued.cancel()
    True
    >>> done, late = wait_done([queued], Deadline(5.0))
    >>> len(done), len(late)
    (1, 0)
    >>> Deadline(None).left is None, Deadline(0.0).expired
    (True, True)
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvxfer._check import check_timeout

__all__ = ["Deadline", "wait_done", "Calls", "LOOKUP_TIMEOUT_S", "FLUSH_TIMEOUT_S",
           "CLOSE_TIMEOUT_S"]

#: ``lookup``, ``find`` and ``prefetch``: a lookup is on a request's path, and a page
#: the store does not hand over by then is a miss (recomputed), not a stall.
LOOKUP_TIMEOUT_S = 10.0
#: ``flush``: it waits for every queued store write.
FLUSH_TIMEOUT_S = 30.0
#: ``close``: the running prefetch, queued writes and undelivered events, in all.
CLOSE_TIMEOUT_S = 30.0


class Deadline:
    """The point in time a call gives up at: ``timeout`` seconds from now (None: never).

    Args:
      timeout: seconds, a finite number >= 0, or None.
      name: the argument's name in errors (``"timeout"``).

    Raises:
      TypeError, ValueError: ``timeout`` is not None or a finite number >= 0.
    """

    __slots__ = ("timeout", "_end")

    def __init__(self, timeout: float | None, name: str = "timeout"):
        self.timeout = check_timeout(timeout, name)
        self._end = None if self.timeout is None else time.monotonic() + self.timeout

    @property
    def left(self) -> float | None:
        """Seconds left (0 once passed), or None for no deadline."""
        return None if self._end is None else max(self._end - time.monotonic(), 0.0)

    @property
    def at(self) -> float | None:
        """The deadline in ``time.monotonic()`` seconds, or None."""
        return self._end

    @property
    def expired(self) -> bool:
        return self._end is not None and time.monotonic() >= self._end

    def __str__(self) -> str:
        return "no deadline" if self.timeout is None else f"{self.timeout:g} s"

    def __repr__(self) -> str:
        return f"Deadline({self.timeout!r}, left={self.left!r})"


def wait_done(futures: Iterable[concurrent.futures.Future], deadline: Deadline
              ) -> tuple[set[concurrent.futures.Future], set[concurrent.futures.Future]]:
    """Waits until every future is done or cancelled, or ``deadline`` passes.

    Returns:
      ``(done, not_done)``; a cancelled future is done.
    """
    futures = set(futures)
    pending = {f for f in futures if not f.done()}
    if not pending:
        return futures, set()
    cond = threading.Condition(threading.Lock())

    def woke(_: concurrent.futures.Future) -> None:
        with cond:
            cond.notify_all()

    for f in pending:
        f.add_done_callback(woke)  # cancel() calls it too
    with cond:  # a callback notifies under cond: none is lost between check and wait
        while True:
            pending = {f for f in pending if not f.done()}
            left = deadline.left
            if not pending or left == 0:
                break
            cond.wait(left)
    return futures - pending, pending


class Calls:
    """Runs calls on threads of its own while the caller waits for each until its
    deadline: a call that does not answer costs its caller the deadline, not however
    long the call blocks (it goes on, and its answer is dropped).

    Args:
      name: the threads' name prefix.
      threads: how many calls may run at once (more wait their turn, or their
        deadline).

    Example:
        >>> calls = Calls("doc-calls")
        >>> calls(lambda: 6 * 7, Deadline(5.0))
        42
        >>> calls.close()
    """

    def __init__(self, name: str, threads: int = 4):
        self._pool = concurrent.futures.ThreadPoolExecutor(threads,
                                                           thread_name_prefix=name)

    def __call__(self, call: Callable[[], Any], deadline: Deadline | None) -> Any:
        """``call()``'s answer, waited for until ``deadline`` (made on this thread when
        there is none: None, or ``Deadline(None)``).

        Raises:
          TimeoutError: ``deadline`` passed first, or had passed (then ``call`` was
            never made).
          OSError: closed (``call`` was not made).
          What ``call`` raised.
        """
        if deadline is None or deadline.at is None:
            return call()
        if deadline.expired:
            raise TimeoutError(f"not asked: the call's deadline ({deadline}) had passed")
        try:
            future = self._pool.submit(call)
        except RuntimeError:  # shut down
            raise OSError("not asked: the cache is closed") from None
        done, _ = wait_done([future], deadline)
        if not done:
            future.cancel()  # not started yet: it never will
            raise TimeoutError(f"no answer within the call's deadline ({deadline})")
        return future.result()

    def bound(self, call: Callable[[Any], Any], deadline: Deadline | None
              ) -> Callable[[Any], Any]:
        """``call`` as a function of one argument that this makes, until ``deadline``."""
        return lambda arg: self(lambda: call(arg), deadline)

    def close(self) -> None:
        """No call starts from now on; those running end on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)
