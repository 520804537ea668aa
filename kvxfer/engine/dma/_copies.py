"""Copy descriptors, the host copy engine, device addresses, and the test hooks.

The DMA mover describes every transfer as *copy descriptors*: three arrays of
destination addresses, source addresses and sizes (``Copies``), adjacent ranges merged
into one copy. A *copy engine* executes them: on a GPU the CUDA driver's (``_cuda``),
on XLA:CPU ``HostCopyEngine`` here, which runs the same descriptors with ``memmove``
inside the program, so CPU tests run every line of the mover but the driver calls.

A copy engine offers ``copy(copies, stream, direction)`` (on XLA's stream, or at once
where it has none), ``set_word(address, value, stream)`` and ``pin``/``numa_node``
for the pool; one with ``side_stream`` also ``copy_beside_groups`` (sets of copies on
a stream of its own per direction, a completion after each set) and ``hold`` (makes a
stream wait for a completion). A completion offers ``done()`` (never blocks) and
``wait()``.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Literal, NamedTuple

import numpy as np

__all__ = ["Copies", "Direction", "HostCopyEngine", "buffer_address", "CALLBACK_STEPS",
           "HOOKS", "step_fault", "let_go", "wait_all"]

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
        if src.shape != dst.shape:
            raise ValueError(f"{len(dst)} destinations for {len(src)} sources")
        size = np.broadcast_to(np.asarray(size, dtype=np.uint64), dst.shape)
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
        if len(self) < 2:
            return self
        starts = np.flatnonzero((self.dst[1:] != self.dst[:-1] + self.size[:-1]) |
                                (self.src[1:] != self.src[:-1] + self.size[:-1])) + 1
        if len(starts) == len(self) - 1:
            return self
        starts = np.concatenate([[0], starts])
        return Copies(self.dst[starts], self.src[starts], np.add.reduceat(self.size, starts))


class HostCopyEngine:
    """Runs copy descriptors with ``memmove`` on the calling thread (XLA:CPU).

    On XLA:CPU device buffers are host memory, so this engine does what a DMA engine
    does on an accelerator, inside the program that calls it: the program's inputs are
    read and its outputs written in XLA's order. ``copies`` and ``bytes`` count what
    it ran.

    Example:
        >>> a, b = np.arange(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
        >>> HostCopyEngine().copy(Copies.of([b.ctypes.data], [a.ctypes.data + 4], 4), None)
        >>> b.tolist()
        [4, 5, 6, 7, 0, 0, 0, 0]
    """

    name = "host"
    mode = "batch"
    uses_stream = False  # whether ``copy`` needs the program's stream
    side_stream = False  # whether ``copy_beside_groups`` is offered

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.copies = self.bytes = 0

    def pin(self, address: int, nbytes: int) -> None:
        return None  # XLA:CPU's buffers and the pool are the same kind of memory

    def numa_node(self) -> None:
        return None

    def set_word(self, address: int, value: int, stream: int | None) -> None:
        ctypes.c_uint32.from_address(address).value = value

    def copy(self, copies: Copies, stream: int | None, direction: Direction = "offload"
             ) -> None:
        for d, s, n in zip(copies.dst.tolist(), copies.src.tolist(), copies.size.tolist()):
            ctypes.memmove(d, s, n)  # releases the GIL for each copy
        with self._lock:
            self.copies += len(copies)
            self.bytes += copies.nbytes


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]

# Where the ``DLTensor`` sits in what a capsule holds: first in a ``DLManagedTensor``;
# in a ``DLManagedTensorVersioned`` (DLPack 1.x) after its version (two uint32), its
# manager context, its deleter and its flags (8 bytes each). In the ``DLTensor``
# (``dlpack.h``) the data pointer comes first, its byte offset at byte 40.
_TENSOR_AT = {b"dltensor": 0, b"dltensor_versioned": 32}
_BYTE_OFFSET_AT = 40


def buffer_address(buf: Any) -> int:
    """The device address of a buffer a ``buffer_callback`` is handed, for any dtype.

    Read from the buffer's DLPack capsule: its data pointer plus byte offset, never
    its type, so float8 types move where ``__cuda_array_interface__`` has no type
    string for them (XLA refuses to build it). A type DLPack lacks (sub-byte integers)
    falls back to ``__cuda_array_interface__`` on a GPU and ``__array__`` on XLA:CPU.

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
    tensor = _capsule_pointer(capsule, name) + _TENSOR_AT[name]
    return int(ctypes.c_void_p.from_address(tensor).value or 0) + \
        ctypes.c_uint64.from_address(tensor + _BYTE_OFFSET_AT).value


# -- test hooks: ``kvxfer.testing`` installs them ------------------------------------

#: The steps of a DMA program's callback, in order (``kvxfer.testing.callback_fault``):
#: reading the ticket's address, finding its job, reading the buffers' addresses,
#: describing the copies, and handing them to the copy engine.
CALLBACK_STEPS: tuple[str, ...] = ("ticket", "lookup", "address", "describe", "copy")

#: ``faults``: callback step -> the error it raises; ``driver``: CUDA entry point ->
#: ``[calls so far, the call that fails]``; ``spies``: lists each callback's record is
#: appended to; ``released``: called with ``(starts, ends)`` of the memory a job's
#: copies touch once kvxfer lets go of it (``let_go``).
HOOKS: dict[str, Any] = {"faults": {}, "driver": {}, "spies": [], "released": []}


def step_fault(step: str, job: Any = None) -> None:
    """Raises what ``kvxfer.testing.callback_fault`` set for ``step``, or what ``job``
    was made to fail there (a self-check's, ``CopyJob.fault``)."""
    if job is not None and job.fault == step:
        raise RuntimeError(f"injected failure at the callback's {step} step")
    error = HOOKS["faults"].get(step)
    if error is not None:
        raise error


def wait_all(waits: Any) -> BaseException | None:
    """Calls every wait of ``waits``, whatever one raises (never raising): the first
    error."""
    first = None
    for wait in waits:
        try:
            wait()
        except BaseException as e:  # noqa: BLE001 - every one is waited for first
            first = first or e
    return first


def let_go(jobs: Any) -> None:
    """Says that no copy of ``jobs`` can run any more, so what they let go of may be
    reused from now on (``HOOKS["released"]``): what a load's copies write (staging,
    caches), an offload's copies' both sides (device rows, and the host slots, which
    a failed offload gives back). The host slots a load reads go back with its pins."""
    for watch in list(HOOKS["released"]):
        for job in jobs:
            for copies in job.sets:
                sides = (copies.dst, copies.src) if job.direction == "offload" else (copies.dst,)
                for side in sides:
                    watch(side, side + copies.size)
