"""What a transfer hands back: offload and load handles, and the result of a load."""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import threading
from concurrent.futures._base import CANCELLED as _CANCELLED
from concurrent.futures._base import CANCELLED_AND_NOTIFIED as _CANCELLED_AND_NOTIFIED
from concurrent.futures._base import FINISHED as _FINISHED
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvxfer._names import Gate as Gate
from kvxfer._check import check_timeout
from kvxfer.engine import TransferError
from kvxfer.hostpool import PageRef
from kvxfer.manager._agree import AgreementError

__all__ = ["Gate", "IntegrityError", "LoadResult", "OffloadHandle", "LoadHandle",
           "hooked_call", "current_hook"]



# The transfer hook of the manager call running now (caller's thread) or of the
# transfer whose half runs now (transfer thread): a transfer keeps the hook of the
# call that started it, whenever its transfer-thread half runs.
_HOOK: contextvars.ContextVar[Any] = contextvars.ContextVar("kvxfer_transfer_hook",
                                                           default=None)


@contextlib.contextmanager
def hooked_call(hook: Any) -> Iterator[None]:
    """Runs a manager call with ``hook`` as the hook of the transfers it starts."""
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)


def current_hook() -> Any:
    """The hook of the call or transfer running on this thread (None: none)."""
    return _HOOK.get()


class IntegrityError(RuntimeError):
    """A page was consumed before it was found bad (see ``LoadResult``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    """What a load delivered.

    Attributes:
      verified_prefix: pages ``[0, verified_prefix)`` are loaded and verified in every
        layer and shard; the caller recomputes the rest.
      invalid_pages: request indices this load did not deliver (the first bad page
        and all after it).
      reasons: request index → why that page is bad (only pages found bad themselves).
      consumed_before_failure: a layer was released with a longer prefix than the
        final one; the caller must restart from ``verified_prefix``.
      released_prefixes: the prefix each layer was released with (0: released with
        no page usable); None for a layer never released (a cancelled load of a
        multi-process job).
      freed_pages: request indices kvxfer freed because their own digest proved them
        bad (freeing them again is a no-op). Every other page, also past the
        prefix, is intact and still the caller's: a page the caller expected under
        another key is a miss for this request only.
    """

    verified_prefix: int
    invalid_pages: tuple[int, ...]
    reasons: dict[int, str]
    consumed_before_failure: bool
    released_prefixes: tuple[int | None, ...]
    freed_pages: tuple[int, ...] = ()

    def raise_if_consumed(self) -> None:
        """Raises ``IntegrityError`` when a layer was released with a longer prefix.

        Raises:
          IntegrityError: naming the layers and the prefixes they were released with.
        """
        if self.consumed_before_failure:
            layers = [i for i, p in enumerate(self.released_prefixes)
                      if p is not None and p > self.verified_prefix]
            raise IntegrityError(
                f"layers {layers} were released with prefixes "
                f"{[self.released_prefixes[i] for i in layers]} before page "
                f"{self.verified_prefix} was found bad ({self.reasons}); restart the "
                f"request from page {self.verified_prefix}")


class _Transfer(concurrent.futures.Future):
    """A transfer in flight as a ``concurrent.futures.Future``.

    The device work is enqueued when the handle is made, so the handle is running
    from the start (``running()`` until ``done()``); the transfer thread ends it.
    Done-callbacks run on the transfer thread (at once, on the caller's thread, when
    added to a handle already done), as ``concurrent.futures`` runs them.

    ``cancel()`` asks the transfer thread to stop: it returns True when the handle
    will end cancelled (or already has), False when the transfer has finished or is
    past the point where it can stop. The handle ends cancelled once the device work
    that reads or writes host memory has finished and the transfer's host slots are
    released; only then are ``cancelled()`` and ``done()`` True and ``result()``
    raises ``concurrent.futures.CancelledError``.
    """

    _what = "transfer"

    def __init__(self) -> None:
        super().__init__()
        self._cancel_requested = False
        self._claimed = False
        self._hook = _HOOK.get()  # made during the call that starts the transfer

    # -- transfer-thread side ----------------------------------------------------

    @property
    def cancel_requested(self) -> bool:
        """Whether a ``cancel()`` succeeded: the transfer thread stops what it can."""
        return self._cancel_requested

    def claim(self) -> bool:
        """The transfer thread commits to ending the handle; later ``cancel()``s fail.

        Returns:
          Whether a cancel came first (the handle must then end cancelled).
        """
        with self._condition:
            self._claimed = True
            return self._cancel_requested

    def run(self, finish: Callable[..., None], *args: Any) -> None:
        """Runs ``finish(*args)``, the transfer thread's half, which ends the handle.

        An exception it lets out ends the handle as a ``TransferError`` (if it is
        not done yet), so no caller waits forever on a handle nothing will end.
        It runs with the hook of the call that started the transfer.
        """
        token = _HOOK.set(self._hook)
        try:
            finish(*args)
        except BaseException as e:
            if not self.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    self._abort(e, self.claim())
            raise
        finally:
            _HOOK.reset(token)
            self._hook = None  # a handle kept by the caller keeps no hook alive

    def _abort(self, error: BaseException, cancelled: bool) -> None:
        """Ends the handle after ``error`` escaped the transfer thread's half."""
        failure = TransferError(f"{self._what} failed: {error}")
        failure.__cause__ = error
        self._end(error=failure, cancelled=cancelled)

    def _end(self, value: object = None, error: BaseException | None = None,
             cancelled: bool = False) -> None:
        """Ends the handle with a value, an error, or cancelled (transfer thread)."""
        if cancelled:
            # Pending -> cancelled (callbacks run) -> notified (``wait`` and
            # ``as_completed`` see it): what an executor does with a cancelled call.
            concurrent.futures.Future.cancel(self)
            self.set_running_or_notify_cancel()
        elif error is not None:
            self.set_exception(error)
        else:
            self.set_result(value)

    # -- caller side ----------------------------------------------------------

    def cancel(self) -> bool:
        """Asks the transfer to stop; see the class docs.

        Returns:
          True if the handle ends cancelled (or already has), False if the
          transfer finished or can no longer be stopped.
        """
        with self._condition:
            if self._state in (_CANCELLED, _CANCELLED_AND_NOTIFIED):
                return True
            if self._state == _FINISHED or self._claimed:
                return False
            self._cancel_requested = True
            return True

    def running(self) -> bool:
        """True from the call that started the transfer until the handle is done."""
        return not self.done()

    def result(self, timeout: float | None = None):
        """The transfer's value (see the subclasses).

        Raises:
          TransferError: the transfer failed.
          concurrent.futures.CancelledError: the transfer was cancelled.
          TimeoutError: not done within ``timeout`` seconds (0 polls).
        """
        return self._waited(super().result, timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The ``TransferError`` the transfer failed with, or None.

        Raises:
          concurrent.futures.CancelledError: the transfer was cancelled.
          TimeoutError: not done within ``timeout`` seconds (0 polls).
        """
        return self._waited(super().exception, timeout)

    def _waited(self, get, timeout: float | None):
        """``get(timeout)`` (the base class's result or exception), naming the timeout."""
        timeout = check_timeout(timeout)
        try:
            return get(timeout)
        except TimeoutError:
            if self.done():  # done meanwhile, or it carries a TimeoutError of its own
                return get(0)
            raise TimeoutError(f"{self._what} not done after {timeout} s") from None


class OffloadHandle(_Transfer):
    """An offload in flight: a ``Future`` of the page refs, once the bytes are on host.

    ``result()`` and ``wait()`` give the ``PageRef``s. ``cancel()`` succeeds until
    the pages are committed: the transfer thread then waits for the copies to end,
    releases the slots and returns no pages (``result()`` raises
    ``concurrent.futures.CancelledError``).

    Example:
        >>> import concurrent.futures, jax.numpy as jnp, kvxfer
        >>> caches = [jnp.zeros((8, 128))]
        >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
        >>> handle = mgr.offload(caches, [1], keys=[7])
        >>> _ = concurrent.futures.wait([handle])
        >>> handle.done(), handle.cancel(), [p.key for p in handle.result()]
        (True, False, [7])
        >>> mgr.close()
    """

    _what = "offload"

    def _finish(self, pages: list[PageRef] | None = None, error: BaseException | None = None,
                cancelled: bool = False) -> None:
        """Ends the offload with its pages, its ``TransferError``, or cancelled (transfer
        thread)."""
        self._end(pages, error, cancelled)

    def result(self, timeout: float | None = None) -> list[PageRef]:
        """The page refs, one per block, once the bytes are on the host.

        Raises:
          TransferError: the transfer failed (its slots were freed).
          concurrent.futures.CancelledError: cancelled (its slots were freed).
          TimeoutError: not done within ``timeout`` seconds.
        """
        return super().result(timeout)

    def wait(self, timeout: float | None = None) -> list[PageRef]:
        """Blocks until the pages are on the host; the same as ``result()``."""
        return self.result(timeout)


class LoadHandle(_Transfer):
    """A load in flight: a ``Future`` of its ``LoadResult``, with per-layer readiness
    gated on verification.

    ``cancel()`` (an aborted request) succeeds until the load is settled: the
    transfer thread still waits for the programs that read the host pool, skips the
    digest checks not yet made (in a multi-process job it verifies and agrees as
    usual, so the other processes' loads are unaffected), releases the pages' pins
    and ends the handle cancelled. Layers not released by then never are
    (``is_layer_ready`` stays False, ``layer_ready`` raises ``CancelledError``). The
    caches ``load()`` returned stay valid arrays to continue with: their loaded
    blocks hold the pages' bytes, only unverified.
    """

    _what = "load"

    def __init__(self, num_layers: int, num_pages: int, gate: Gate):
        super().__init__()
        self.gate = gate
        self.num_pages = num_pages
        # One condition for every layer (a handle is made per load call; an Event per
        # layer cost 32 lock pairs per call). None until the layer is released: a layer
        # released with prefix 0 (its first page bad) is released all the same.
        self._layers = threading.Condition(threading.Lock())
        self._released: list[int | None] = [None] * num_layers
        self._over = False  # set when the load ended: no layer is released after it
        self._error: BaseException | None = None
        self._ends_cancelled = False
        # The load's one point of verification, where it has one (``VerifyOnce``):
        # a caller blocking in ``layer_ready`` runs it if the transfer thread has not.
        self._verify_once: Callable[[], bool] | None = None

    # -- transfer-thread side ----------------------------------------------------

    def _release(self, layer: int, prefix: int) -> None:
        """Marks layer ``layer`` verified with pages ``[0, prefix)`` (transfer thread)."""
        self._release_many([(layer, prefix)])

    def _release_all(self, prefix: int) -> None:
        """Marks every layer released with pages ``[0, prefix)`` (transfer thread, or
        the caller verifying in ``layer_ready``), waking the waiters once."""
        with self._layers:
            self._released = [prefix] * len(self._released)
            self._layers.notify_all()

    def _release_many(self, released: Sequence[tuple[int, int]]) -> None:
        """Marks each ``(layer, prefix)`` released, waking the waiters once."""
        with self._layers:
            for layer, prefix in released:
                self._released[layer] = prefix
            self._layers.notify_all()

    def _finish(self, result: LoadResult | None, error: BaseException | None,
                cancelled: bool = False, kv_caches: list[Any] | None = None) -> None:
        """Ends the load with its result, its error, or cancelled (transfer thread).

        The handle carries ``error`` as the ``TransferError`` its methods raise, with
        ``kv_caches`` (the arrays the load returned: the caches to continue with).
        """
        self._error, self._ends_cancelled = error, cancelled
        failure = None
        if error is not None and not cancelled:
            failure = AgreementError(f"load failed: {error}", subjects=error.subjects) \
                if isinstance(error, AgreementError) else TransferError(f"load failed: {error}")
            failure.kv_caches = kv_caches
            failure.__cause__ = error
        self._verify_once = None
        with self._layers:
            self._over = True
            self._layers.notify_all()
        self._end(result, failure, cancelled)

    def _abort(self, error: BaseException, cancelled: bool) -> None:
        self._finish(None, error, cancelled)

    # -- caller side ----------------------------------------------------------

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < len(self._released):
            raise IndexError(f"layer {layer} out of range [0, {len(self._released)})")

    def is_layer_ready(self, layer: int) -> bool:
        """Whether layer ``layer`` is verified and released; never blocks.

        False for a layer not released yet, and for one a failed or cancelled load
        never released.
        """
        self._check_layer(layer)
        return self._released[layer] is not None

    def layer_ready(self, layer: int, timeout: float | None = None) -> int:
        """Blocks until layer ``layer`` is verified and released.

        A blocking call (``timeout=None``) on a load whose every layer one program
        digests (a small load on one device) may verify the load on the calling
        thread, if the transfer thread has not yet: that spares the hand-off between
        the two threads. Settling the load and its done-callbacks stay on the
        transfer thread.

        Returns:
          The verified prefix at release: pages ``[0, prefix)`` of this layer may
          be consumed (0: none may). Once released, every call returns it at once.

        Raises:
          TransferError: the transfer failed before this layer was released (a
            layer released earlier keeps its prefix; ``result()`` raises).
          concurrent.futures.CancelledError: cancelled before this layer was
            released.
          TimeoutError: not released within ``timeout`` seconds (``timeout=0``
            polls).
        """
        self._check_layer(layer)
        timeout = check_timeout(timeout)
        verify = self._verify_once
        if timeout is None and verify is not None and self._released[layer] is None:
            # Blocking anyway: verify here rather than wait for the transfer thread to
            # do it and wake this one. A failure is the transfer thread's to report.
            with contextlib.suppress(Exception):
                verify()
        with self._layers:
            if not self._layers.wait_for(
                    lambda: self._released[layer] is not None or self._over, timeout):
                raise TimeoutError(f"layer {layer} not ready after {timeout} s")
            prefix = self._released[layer]
        if prefix is None:
            if self._ends_cancelled:
                raise concurrent.futures.CancelledError(
                    f"load cancelled before layer {layer} was ready")
            raise TransferError(f"load failed before layer {layer} was ready: "
                                f"{self._error}") from self._error
        return prefix

    def result(self, timeout: float | None = None) -> LoadResult:
        """Blocks until every layer is verified; the verified prefix and what failed.

        Raises:
          TransferError: a device or transfer failure (never reported as a miss).
          concurrent.futures.CancelledError: the load was cancelled.
          TimeoutError: not done within ``timeout`` seconds.
        """
        return super().result(timeout)

    @property
    def released_prefixes(self) -> tuple[int | None, ...]:
        """The prefix each layer was released with so far; None for a layer not
        released (yet, or ever: a failed or cancelled load), so a layer released
        with prefix 0 (its first page bad) reads 0."""
        return tuple(self._released)
