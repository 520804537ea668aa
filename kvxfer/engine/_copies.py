"""Copy descriptors, the engines that execute them, and the jobs a program's callback runs.

The DMA mover describes every transfer as *copy descriptors*: three arrays of
destination addresses, source addresses and sizes (``Copies``), adjacent ranges merged
into one copy. A *copy engine* executes them: on a GPU the CUDA driver's copy engines,
enqueued on XLA's own stream or beside it on the engine's own (``kvxfer.engine._cuda``;
``copy_beside_groups``); on XLA:CPU the
``HostCopyEngine`` here, which runs the same descriptors with ``memmove`` inside the
program. Nothing else differs between the two, so CPU tests run every line of the
mover but the driver calls.

A program finds its copies through a *ticket*: a one-word device array per call,
whose buffer address identifies the call while the program runs (``Tickets``). The
caller's thread files a ``CopyJob`` under a ticket before it enqueues the program; the
program's callback takes it by the address of the buffer it is handed. No device value
is read on the host, so the lookup costs nothing on a GPU, and programs may run in any
order. A ticket serves another call only once its program has looked it up or can no
longer run, so an old program never takes a new call's job; a job holds the pool's
memory, so no program copies to or from memory unmapped under it.

Nothing in a callback may raise into XLA (a load's program would fail after XLA
confirmed the donation of the caches): failures are kept on the job, and
``callback_fault`` makes each step fail in turn for tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple, Protocol

import jax
import numpy as np

__all__ = ["Copies", "CopyEngine", "Completion", "HostCopyEngine", "CopyJob", "Tickets",
           "TICKETS", "Direction", "buffer_address", "CALLBACK_STEPS", "callback_fault",
           "step_fault"]

Direction = Literal["offload", "load"]
"""``"offload"``: device blocks to host slots; ``"load"``: host slots to device blocks."""


class Copies(NamedTuple):
    """Copy descriptors: ``size[i]`` bytes from ``src[i]`` to ``dst[i]`` (``uint64``).

    Copies within one set are independent (no range is written twice or read after
    it is written), so an engine may run them in any order.

    Example:
        >>> c = Copies.of([100, 108, 300], [0, 8, 16], 8)
        >>> m = c.merged()
        >>> m.dst.tolist(), m.src.tolist(), m.size.tolist()
        ([100, 300], [0, 16], [16, 8])
    """

    dst: np.ndarray
    src: np.ndarray
    size: np.ndarray

    @classmethod
    def of(cls, dst: Any, src: Any, size: Any) -> Copies:
        """Descriptors from address sequences and one size or a size per copy."""
        dst = np.asarray(dst, dtype=np.uint64).ravel()
        src = np.asarray(src, dtype=np.uint64).ravel()
        size = np.broadcast_to(np.asarray(size, dtype=np.uint64), dst.shape)
        if src.shape != dst.shape:
            raise ValueError(f"{len(dst)} destinations for {len(src)} sources")
        return cls(dst, src, np.ascontiguousarray(size))

    def __len__(self) -> int:  # noqa: D105 (the number of copies, not of fields)
        return len(self.dst)

    @property
    def nbytes(self) -> int:
        """Bytes the copies move."""
        return int(self.size.sum())

    def merged(self) -> Copies:
        """The same bytes with every run of adjacent copies (each one continuing the
        previous one on both sides) made one copy."""
        n = len(self.dst)
        if n < 2:
            return self
        ends_dst = self.dst[:-1] + self.size[:-1]
        ends_src = self.src[:-1] + self.size[:-1]
        starts = np.flatnonzero((self.dst[1:] != ends_dst) | (self.src[1:] != ends_src)) + 1
        if len(starts) == n - 1:
            return self
        starts = np.concatenate([[0], starts])
        return Copies(self.dst[starts], self.src[starts], np.add.reduceat(self.size, starts))


class CopyEngine(Protocol):
    """Executes copy descriptors between device buffers and host memory.

    ``copy`` enqueues the copies on ``stream`` (XLA's stream of the program calling
    it, None on XLA:CPU), ordered after the work enqueued before it there and before
    the work enqueued after it; an engine without streams runs them before returning.
    """

    name: str
    #: Whether ``copy`` needs the program's stream (``ExecutionContext.stream``).
    uses_stream: bool
    #: Whether ``copy_beside`` is offered: copies on a stream of the engine's own.
    side_stream: bool

    def copy(self, copies: Copies, stream: int | None, direction: Direction = "offload"
             ) -> None: ...

    def copy_beside_groups(self, groups: Sequence[Copies], stream: int | None,
                           direction: Direction, out: list[Completion]) -> None:
        """Enqueues the sets in order on the engine's own stream for ``direction``,
        after the work enqueued on ``stream`` so far (later work there does not wait
        for them), appending a completion per set to ``out``, each after its own
        copies; on a failure after a copy was enqueued, the last of ``out`` still
        comes after every copy enqueued (engines with ``side_stream`` only)."""

    def hold(self, completion: Completion, stream: int | None) -> None:
        """Makes the work enqueued on ``stream`` from now on wait for ``completion``'s
        copies (a stream wait: the caller does not block; engines with
        ``side_stream`` only)."""

    def set_word(self, address: int, value: int, stream: int | None) -> None:
        """Writes the ``uint32`` ``value`` at device ``address``, in ``stream``'s order."""


class Completion(Protocol):
    """The end of copies running beside XLA's stream (``CopyEngine.copy_beside_groups``)."""

    def done(self) -> bool:
        """Whether they have finished (never blocks)."""

    def wait(self) -> None:
        """Blocks until they have finished (idempotent); raises what failed."""

    def pin(self, address: int, nbytes: int) -> Callable[[], None] | None:
        """Page-locks host memory for this engine; returns the call that unlocks it (None:
        nothing to lock)."""

    def numa_node(self) -> int | None:
        """The NUMA node of the host memory nearest the device (None: unknown)."""


class HostCopyEngine:
    """Runs copy descriptors with ``memmove`` on the calling thread (XLA:CPU).

    On XLA:CPU device buffers are host memory, so this engine does what a DMA engine
    does on an accelerator, inside the program that calls it: the program's inputs are
    read and its outputs written in XLA's order. ``copies`` and ``bytes`` count what it
    ran (for tests and stats).

    Example:
        >>> a, b = np.arange(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
        >>> HostCopyEngine().copy(Copies.of([b.ctypes.data], [a.ctypes.data + 4], 4), None)
        >>> b.tolist()
        [4, 5, 6, 7, 0, 0, 0, 0]
    """

    name = "host"
    uses_stream = False
    side_stream = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.copies = 0
        self.bytes = 0

    def pin(self, address: int, nbytes: int) -> None:
        return None  # XLA:CPU's buffers and the pool are the same kind of memory

    def numa_node(self) -> None:
        return None

    def set_word(self, address: int, value: int, stream: int | None) -> None:
        ctypes.c_uint32.from_address(address).value = value

    def copy(self, copies: Copies, stream: int | None, direction: Direction = "offload"
             ) -> None:
        move = ctypes.memmove  # releases the GIL for each copy
        for d, s, n in zip(copies.dst.tolist(), copies.src.tolist(), copies.size.tolist()):
            move(d, s, n)
        with self._lock:
            self.copies += len(copies)
            self.bytes += copies.nbytes


class _DLTensor(ctypes.Structure):
    """The head of DLPack's ``DLTensor`` (``dlpack.h``): the data pointer comes first."""

    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("dtype", ctypes.c_uint32), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]

# Where the ``DLTensor`` sits in what a capsule holds: first in a ``DLManagedTensor``;
# in a ``DLManagedTensorVersioned`` (DLPack 1.x) after its version (two uint32), its
# manager context, its deleter and its flags (8 bytes each).
_TENSOR_AT = {b"dltensor": 0, b"dltensor_versioned": 32}


def buffer_address(buf: Any) -> int:
    """The device address of a buffer a ``buffer_callback`` is handed, for any dtype.

    Read from the buffer's DLPack capsule (a ``DLManagedTensor``, whose ``DLTensor``
    comes first): its data pointer plus byte offset, never its type, so float8 types
    move where ``__cuda_array_interface__`` has no type string for them (XLA refuses
    to build it). A type DLPack lacks (sub-byte integers) falls back to
    ``__cuda_array_interface__`` on a GPU and ``__array__`` on XLA:CPU.

    Raises:
      Exception: the buffer offers no address (the callback records it on its job).
    """
    try:
        capsule = buf.__dlpack__()
    except Exception:  # noqa: BLE001 - a type DLPack has no code for
        if hasattr(buf, "__array__"):
            try:
                return int(np.asarray(buf).__array_interface__["data"][0])
            except Exception:  # noqa: BLE001 - device memory: not a host array
                pass
        return int(buf.__cuda_array_interface__["data"][0])
    # The capsule keeps its name (it is not consumed): its destructor frees the export.
    name = _capsule_name(capsule)
    if name not in _TENSOR_AT:
        raise TypeError(f"a DLPack capsule named {name!r}; expected one of "
                        f"{sorted(_TENSOR_AT)}")
    tensor = _DLTensor.from_address(_capsule_pointer(capsule, name) + _TENSOR_AT[name])
    return int(tensor.data or 0) + int(tensor.byte_offset)


#: The steps of a DMA program's callback, in order (``callback_fault`` names them):
#: reading the ticket's address, finding its job, reading the buffers' addresses,
#: describing the copies, and handing them to the copy engine.
CALLBACK_STEPS: tuple[str, ...] = ("ticket", "lookup", "address", "describe", "copy")

_faults: dict[str, BaseException] = {}


@contextlib.contextmanager
def callback_fault(step: str, error: BaseException | None = None) -> Iterator[None]:
    """Makes step ``step`` of every DMA callback run inside the block raise ``error``.

    For tests of what a failure inside a program's callback leaves behind: the
    callback must record it on its job (or, before the job is found, with the
    tickets) and return, so the program ends normally and its aliased outputs
    still hold the caches.

    Example:
        >>> with callback_fault("copy"):
        ...     step_fault("copy")
        Traceback (most recent call last):
        ...
        RuntimeError: injected failure at the callback's copy step
    """
    if step not in CALLBACK_STEPS:
        raise ValueError(f"step={step!r}; expected one of {CALLBACK_STEPS}")
    _faults[step] = error if error is not None else RuntimeError(
        f"injected failure at the callback's {step} step")
    try:
        yield
    finally:
        _faults.pop(step, None)


def step_fault(step: str) -> None:
    """Raises what ``callback_fault`` set for ``step`` (nothing when none is set)."""
    error = _faults.get(step)
    if error is not None:
        raise error


class CopyJob:
    """The copies of one program: blocks of one shard replica's layers and host slots.

    Made on the caller's thread with everything but the device addresses, which the
    program's callback reads from the buffers XLA hands it (``run``).

    Args:
      engine: what executes the copies.
      direction: ``"offload"`` (device to host) or ``"load"``.
      pool: the class pool's first byte; ``page_bytes``: a slot's size there.
      slots: the host slot of each page (``k``).
      offsets: where each layer's block (of this shard) starts inside a slot.
      block_bytes: one block of one shard.
      ids: the device block of each page (``k``); None where the device side is a
        page-major staging buffer (``run`` then gets its one buffer, each page's
        layers side by side in a row of ``len(offsets) * block_bytes`` bytes).
      memory: what holds the pool's bytes (a ``HostMemory``): the job keeps it, so the
        mapping and its pin outlive every program that may still copy to or from it,
        whatever becomes of the manager.
      beside: run the copies on the engine's own stream (``copy_beside_groups``), after what
        the program enqueued before its callback; ``completion`` then waits for them.
      groups: with ``beside`` and a staging buffer, the layer spans ``[first, stop)``
        copied as sets in order, each with its own completion (``completions``), so
        the work that reads a span waits for that span's copies alone.

    Attributes:
      ran: whether ``run`` executed the copies. error: what ``run`` raised instead.
      copies: how many copies it ran (after merging).
      completion: the end of copies run beside XLA's stream (None otherwise; the
        last group's with ``groups``). completions: each group's end.
    """

    __slots__ = ("engine", "direction", "pool", "page_bytes", "slots", "offsets",
                 "block_bytes", "ids", "memory", "beside", "ran", "error", "copies", "keep",
                 "completion", "groups", "completions", "addresses", "sets")

    def __init__(self, engine: CopyEngine, direction: Direction, pool: int, page_bytes: int,
                 slots: np.ndarray, offsets: Sequence[int], block_bytes: int,
                 ids: np.ndarray | None, memory: Any = None, beside: bool = False,
                 groups: Sequence[tuple[int, int]] | None = None):
        self.engine = engine
        self.direction = direction
        self.pool = pool
        self.page_bytes = page_bytes
        self.slots = np.asarray(slots, dtype=np.uint64)
        self.offsets = np.asarray(offsets, dtype=np.uint64)
        self.block_bytes = block_bytes
        self.ids = None if ids is None else np.asarray(ids, dtype=np.uint64)
        self.memory = memory
        self.beside = beside
        self.groups = None if groups is None else list(groups)
        self.completion: Completion | None = None
        self.completions: list[Completion] = []
        self.ran = False
        self.error: BaseException | None = None
        self.copies = 0
        self.keep: Any = None  # the ticket it is filed under
        self.addresses: list[int] = []  # the device buffers' addresses, once run
        self.sets: list[Copies] = []  # the copies it enqueued (or tried to)

    def describe(self, device: Sequence[int], span: tuple[int, int] | None = None) -> Copies:
        """The copies, given the device buffers' addresses: each layer's cache (blocks
        at ``ids``), or the one staging buffer; with ``span``, of layer positions
        ``[first, stop)`` only (a staging buffer's)."""
        bb = np.uint64(self.block_bytes)
        first, stop = span if span is not None else (0, len(self.offsets))
        host = (np.uint64(self.pool) + self.slots[:, None] * np.uint64(self.page_bytes)
                + self.offsets[None, first:stop])                           # [k, L]
        if self.ids is None:
            # Row j of the staging buffer holds page j's layers side by side: a page is
            # one copy where the pool holds it in one range.
            row = np.uint64(len(self.offsets)) * bb
            dev = (np.uint64(device[0]) + np.arange(len(self.slots), dtype=np.uint64)[:, None]
                   * row + np.arange(first, stop, dtype=np.uint64)[None, :] * bb)
        else:
            # Layer-major: consecutive blocks of one layer merge where their slots do.
            bases = np.asarray(device, dtype=np.uint64)
            dev = bases[:, None] + self.ids[None, :] * bb                      # [L, k]
            host = host.T
        src, dst = (dev, host) if self.direction == "offload" else (host, dev)
        return Copies(dst.ravel(), src.ravel(),
                      np.full(dst.size, self.block_bytes, dtype=np.uint64)).merged()

    def run(self, buffers: Sequence[Any], stream: int | None) -> None:
        """Enqueues the copies between the buffers XLA handed the program's callback
        and the host slots.

        Never raises: a failure (an address XLA cannot give, a driver error) is kept
        in ``error`` for the transfer thread, so XLA's program itself never fails and
        the caches it hands back (aliased in to out) stay usable.
        """
        try:
            step_fault("address")
            device = self.addresses = [buffer_address(b) for b in buffers]
            step_fault("describe")
            sets = [self.describe(device, span) for span in self.groups or [None]]
            step_fault("copy")
            self.sets = sets
            if self.beside:
                try:  # what a failure leaves enqueued is covered by the last completion
                    self.engine.copy_beside_groups(sets, stream, self.direction,
                                                   self.completions)
                finally:
                    self.completion = self.completions[-1] if self.completions else None
            else:
                self.engine.copy(sets[0], stream, self.direction)
            self.copies = sum(map(len, sets))
            self.ran = True
        except BaseException as e:  # noqa: BLE001 - reported by the transfer thread
            self.error = e


#: Called with ``(starts, ends)`` of the memory a job's copies touched once kvxfer
#: lets go of what they touch (``let_go``): ``kvxfer.testing.watch_releases``.
RELEASE_WATCHERS: list[Callable[[np.ndarray, np.ndarray], None]] = []


def let_go(jobs: Sequence[Any]) -> None:
    """Says that no copy of ``jobs`` can run any more: the memory they touch (device
    buffers, host slots) may be reused from now on (for ``RELEASE_WATCHERS``)."""
    if not RELEASE_WATCHERS:
        return
    for job in jobs:
        for copies in getattr(job, "sets", ()):
            for side in (copies.dst, copies.src):
                for watch in list(RELEASE_WATCHERS):
                    watch(side, side + copies.size)


class Tickets:
    """Per-call identities for programs: a one-word device array whose buffer address
    names the ``CopyJob`` filed under it until the program's callback takes it.

    A ticket serves again once its job is taken (the program holding it has looked it
    up) or withdrawn, which callers do only for a program that can no longer run (it
    failed to enqueue, or ended without running its callback): never while a program
    may still look the ticket up, so an old program can never take a new call's job.
    Its buffer is never written. Tickets are made per device as needed (a
    ``device_put`` each) and kept.

    A callback that fails before it finds its job (the ticket's address unreadable,
    no job filed there) records the failure here (``lost``), since no job can hold it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[Any, list[_Ticket]] = {}
        self._jobs: dict[int, tuple[_Ticket, CopyJob]] = {}
        self._lost: list[str] = []

    def issue(self, device: Any, job: CopyJob) -> jax.Array:
        """A ticket on ``device`` with ``job`` filed under it."""
        with self._lock:
            free = self._free.get(device)
            ticket = free.pop() if free else None
        if ticket is None:
            token = jax.device_put(np.zeros(1, dtype=np.uint32), device)
            ticket = _Ticket(token.unsafe_buffer_pointer(), token, device)
        job.keep = ticket
        with self._lock:
            self._jobs[ticket.address] = (ticket, job)
        return ticket.token

    def take(self, address: int) -> CopyJob | None:
        """The job filed under the ticket at ``address`` (its ticket is free again), or
        None where none is (recorded in ``lost``). Never raises."""
        with self._lock:
            filed = self._jobs.pop(address, None)
            if filed is None:
                self._record(f"no job is filed under ticket {address:#x}")
                return None
            ticket, job = filed
            self._free.setdefault(ticket.device, []).append(ticket)
        return job

    def peek(self, address: int) -> CopyJob | None:
        """The job filed under the ticket at ``address``, left filed (a program whose
        callbacks look it up more than once: the last one takes it), or None
        where none is (recorded in ``lost``). Never raises."""
        with self._lock:
            filed = self._jobs.get(address)
            if filed is None:
                self._record(f"no job is filed under ticket {address:#x}")
                return None
            return filed[1]

    def lose(self, error: BaseException) -> None:
        """Records a callback's failure that came before it found its job."""
        with self._lock:
            self._record(f"{type(error).__name__}: {error}")

    def _record(self, what: str) -> None:
        self._lost.append(what)
        del self._lost[:-8]  # the latest few: what a failed transfer's message quotes

    def lost(self) -> list[str]:
        """The latest failures of callbacks that never found their job."""
        with self._lock:
            return list(self._lost)

    def withdraw(self, job: CopyJob) -> None:
        """Takes back a job whose program can no longer run its callback (it failed to
        enqueue, or has ended without running it), so its ticket serves again."""
        ticket = job.keep
        with self._lock:
            filed = self._jobs.get(ticket.address)
            if filed is not None and filed[1] is job:
                del self._jobs[ticket.address]
                self._free.setdefault(ticket.device, []).append(ticket)

    def pending(self) -> int:
        """Jobs filed and not yet taken."""
        with self._lock:
            return len(self._jobs)


class _Ticket(NamedTuple):
    address: int
    token: jax.Array
    device: Any


#: The tickets every DMA program's callback looks its job up in.
TICKETS = Tickets()
