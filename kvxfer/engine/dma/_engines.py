"""Copy descriptors (``Copies``) and the copy engines that run them: ``CudaCopyEngine``
on an NVIDIA GPU, over ``Driver`` (the CUDA entry points kvxfer calls, resolved once
from any ``get_proc(name, version)``: ``cuda-bindings``' or a test's stand-in), and
``HostCopyEngine`` on XLA:CPU (``memmove`` inside the program), so CPU tests run every
line of the mover but the driver calls. Also the hooks ``kvxfer.testing`` installs.
"""

from __future__ import annotations

import contextlib
import ctypes as _c
import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Copies", "HostCopyEngine", "buffer_address", "CALLBACK_STEPS",
           "HOOKS", "step_fault", "let_go", "wait_all", "Driver", "DriverError",
           "CudaCopyEngine", "CudaCompletion", "cuda_engine", "cuda_unavailable", "is_cuda"]


class Copies(NamedTuple):
    """``size[i]`` bytes from ``src[i]`` to ``dst[i]`` (``uint64``), independent of one
    another (an engine may run them in any order).

    Example:
        >>> m = Copies.of([100, 108, 300], [0, 8, 16], 8).merged()
        >>> m.dst.tolist(), m.src.tolist(), m.size.tolist(), len(m), m.nbytes
        ([100, 300], [0, 16], [16, 8], 2, 24)
    """

    dst: np.ndarray
    src: np.ndarray
    size: np.ndarray

    @classmethod
    def of(cls, dst: Any, src: Any, size: Any) -> Copies:
        """Descriptors from address sequences and one size or a size per copy."""
        dst, src = (np.asarray(a, dtype=np.uint64).ravel() for a in (dst, src))
        if src.shape != dst.shape:
            raise ValueError(f"{len(dst)} destinations for {len(src)} sources")
        return cls(dst, src, np.ascontiguousarray(np.broadcast_to(
            np.asarray(size, dtype=np.uint64), dst.shape)))

    def __len__(self) -> int:  # noqa: D105 (copies, not fields)
        return len(self.dst)

    nbytes = property(lambda self: int(self.size.sum()))

    def merged(self) -> Copies:
        """The same bytes, each run of copies adjacent on both sides made one."""
        starts = np.flatnonzero((self.dst[1:] != self.dst[:-1] + self.size[:-1]) |
                                (self.src[1:] != self.src[:-1] + self.size[:-1])) + 1
        if len(starts) == max(len(self) - 1, 0):
            return self
        starts = np.concatenate([[0], starts])
        return Copies(self.dst[starts], self.src[starts], np.add.reduceat(self.size, starts))


class HostCopyEngine:
    """Runs copy descriptors with ``memmove`` on the calling thread (XLA:CPU, where
    device buffers are host memory): inside the program that calls it, so in XLA's
    order. ``copies`` and ``bytes`` count what it ran.

    Example:
        >>> a, b = np.arange(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
        >>> HostCopyEngine().copy([Copies.of([b.ctypes.data], [a.ctypes.data + 4], 4)], None)
        >>> b.tolist()
        [4, 5, 6, 7, 0, 0, 0, 0]
    """

    name, mode = "host", "batch"
    uses_stream = side_stream = False  # needs no stream; offers no copies beside it
    pin = staticmethod(lambda address, nbytes: None)  # the pool is XLA:CPU's kind of memory
    numa_node = staticmethod(lambda: None)

    def __init__(self) -> None:
        self._lock, self.copies, self.bytes = threading.Lock(), 0, 0

    def copy(self, sets: list[Copies], stream: int | None, direction: str = "offload",
             out: Any = None) -> None:  # never beside: no stream of its own
        for copies in sets:
            for d, s, n in zip(copies.dst.tolist(), copies.src.tolist(), copies.size.tolist()):
                _c.memmove(d, s, n)  # releases the GIL for each copy
            with self._lock:
                self.copies, self.bytes = self.copies + len(copies), self.bytes + copies.nbytes


_pointer = _c.pythonapi.PyCapsule_GetPointer
_pointer.restype, _pointer.argtypes = _c.c_void_p, [_c.py_object, _c.c_char_p]
_name = _c.pythonapi.PyCapsule_GetName
_name.restype, _name.argtypes = _c.c_char_p, [_c.py_object]
# A capsule's ``DLTensor``: first in a ``DLManagedTensor``, after a version, context,
# deleter and flags in a ``DLManagedTensorVersioned``; its data pointer first, offset at 40.
_TENSOR_AT = {b"dltensor": 0, b"dltensor_versioned": 32}


def buffer_address(buf: Any) -> int:
    """The device address of a buffer a ``buffer_callback`` is handed, any dtype (float8
    too): its DLPack capsule's data pointer plus offset, else its CUDA array interface's."""
    try:
        capsule = buf.__dlpack__()
    except Exception:  # noqa: BLE001 - a type DLPack has no code for
        return int(buf.__cuda_array_interface__["data"][0])
    name = _name(capsule)  # not consumed: its destructor frees the export
    if name not in _TENSOR_AT:
        raise TypeError(f"a DLPack capsule named {name!r}; expected one of {sorted(_TENSOR_AT)}")
    tensor = _pointer(capsule, name) + _TENSOR_AT[name]
    return int(_c.c_void_p.from_address(tensor).value or 0) + \
        _c.c_uint64.from_address(tensor + 40).value


#: A callback's steps in order (``kvxfer.testing.callback_fault``): the ticket's
#: address, its job, the buffers' addresses, the copies described, then enqueued.
CALLBACK_STEPS: tuple[str, ...] = ("ticket", "lookup", "address", "describe", "copy")

#: What ``kvxfer.testing`` installs. ``faults``: step -> error raised there; ``driver``:
#: entry point -> ``[calls so far, the call that fails]``; ``spies``: lists a record of
#: each callback goes to; ``released``: called with ``(starts, ends)`` let go of.
HOOKS: dict[str, Any] = {"faults": {}, "driver": {}, "spies": [], "released": []}


def step_fault(step: str, job: Any = None) -> None:
    """Raises the failure set for ``step`` by ``kvxfer.testing``, or on ``job`` (a
    self-check's, ``CopyJob.fault``)."""
    if job is not None and job.fault == step:
        raise RuntimeError(f"injected failure at the callback's {step} step")
    if (error := HOOKS["faults"].get(step)) is not None:
        raise error


def let_go(jobs: Any) -> None:
    """Says no copy of ``jobs`` runs any more (``HOOKS["released"]``): what a load's
    copies write, both sides of an offload's (device rows; host slots, which a failed
    offload gives back). The slots a load reads go back with its pins."""
    for watch in list(HOOKS["released"]):
        for job in jobs:
            for c in job.sets:
                for side in (c.dst, c.src) if job.direction == "offload" else (c.dst,):
                    watch(side, side + c.size)


def wait_all(waits: Any) -> BaseException | None:
    """Calls every one of ``waits`` whatever one raises; the first error (never raises)."""
    first = None
    for wait in waits:
        try:
            wait()
        except BaseException as e:  # noqa: BLE001 - every one is waited for first
            first = first or e
    return first


_u64p, _sizep, _vp, _int, _uint = (_c.POINTER(_c.c_uint64), _c.POINTER(_c.c_size_t),
                                   _c.c_void_p, _c.c_int, _c.c_uint)
# Entry points, each with its CUDA 12.0 ABI's arguments, returning a CUresult (0: success).
_ABI = 12000
_ENTRIES: dict[str, tuple[Any, ...]] = {
    "cuMemcpyAsync": (_c.c_uint64, _c.c_uint64, _c.c_size_t, _vp),
    "cuMemsetD32Async": (_c.c_uint64, _uint, _c.c_size_t, _vp),
    "cuMemHostRegister": (_vp, _c.c_size_t, _uint), "cuMemHostUnregister": (_vp,),
    "cuDeviceGet": (_c.POINTER(_int), _int), "cuGetErrorString": (_int, _c.POINTER(_c.c_char_p)),
    "cuDevicePrimaryCtxRetain": (_c.POINTER(_vp), _int), "cuDevicePrimaryCtxRelease": (_int,),
    "cuCtxPushCurrent": (_vp,), "cuCtxPopCurrent": (_c.POINTER(_vp),),
    "cuDeviceGetAttribute": (_c.POINTER(_int), _int, _int),
    "cuStreamCreate": (_c.POINTER(_vp), _uint), "cuStreamSynchronize": (_vp,),
    "cuEventCreate": (_c.POINTER(_vp), _uint), "cuEventRecord": (_vp, _vp),
    "cuStreamWaitEvent": (_vp, _vp, _uint), "cuEventQuery": (_vp,),
    "cuEventSynchronize": (_vp,), "cuEventDestroy": (_vp,),
}
# cuMemcpyBatchAsync's ABIs: CUDA 12.8 (with ``size_t* failIdx``) and CUDA 13.
_BATCH_V1, _BATCH_V2 = 12080, 13000
_BATCH_ARGS = (_u64p, _u64p, _sizep, _c.c_size_t, _vp, _sizep, _c.c_size_t)
_HOST_REGISTER_PORTABLE, _HOST_NUMA_ID, _NOT_READY = 0x01, 134, 600
_SRC_ACCESS_ORDER_STREAM, _LOCATION_DEVICE, _LOCATION_HOST = 1, 1, 2
_STREAM_NON_BLOCKING = 0x1
#: Events sleep rather than spin a core, and time nothing (BLOCKING_SYNC | DISABLE_TIMING).
_EVENT_FLAGS = 0x1 | 0x2


class DriverError(RuntimeError):
    """A CUDA driver call failed (its name and the driver's error string)."""


def _injected(name: str) -> None:
    """Fails the call of ``name`` that ``kvxfer.testing.driver_fault`` picked."""
    if (rule := HOOKS["driver"].get(name)) is not None:
        rule[0] += 1
        if rule[0] - 1 == rule[1]:
            raise DriverError(f"{name} failed: injected failure (call {rule[1]})")


class Driver:
    """The entry points kvxfer calls in a driver of ``version`` (12080: 12.8), resolved
    once from ``get_proc(name, version) -> address`` (0: absent); ``batch_abi``: the
    ``cuMemcpyBatchAsync`` ABI in use (None: none)."""

    def __init__(self, get_proc: Callable[[str, int], int], version: int):
        self.version = int(version)
        self._get_proc = get_proc  # what resolved the entry points lives as long as they do
        self._fns: dict[str, Any] = {}
        for name, args in _ENTRIES.items():
            if not (address := get_proc(name, min(self.version, _ABI))):
                raise DriverError(f"the CUDA driver ({self.version}) has no {name}")
            self._fns[name] = _c.CFUNCTYPE(_int, *args)(address)
        abi = _BATCH_V2 if self.version >= _BATCH_V2 else (
            _BATCH_V1 if self.version >= _BATCH_V1 else None)
        address = get_proc("cuMemcpyBatchAsync", abi) if abi else 0
        self.batch_abi = abi if address else None
        self._batch = _c.CFUNCTYPE(_int, *_BATCH_ARGS, *(
            (_sizep,) if abi == _BATCH_V1 else ()), _vp)(address) if address else None

    def check(self, status: int, what: str) -> None:
        """Raises ``DriverError`` naming ``what`` unless ``status`` is success."""
        if status != 0:
            text = _c.c_char_p()
            self._fns["cuGetErrorString"](status, _c.byref(text))
            raise DriverError(f"{what} failed: CUDA error {status} "
                              f"({(text.value or b'unknown').decode(errors='replace')})")

    def call(self, name: str, *args: Any) -> None:
        _injected(name)
        self.check(self._fns[name](*args), name)

    def new_handle(self, name: str, flags: int) -> int:
        """A new stream or event in the current context."""
        out = _vp()
        self.call(name, _c.byref(out), flags)
        return int(out.value or 0)

    def memcpy(self, copies: Copies, attrs: Any, stream: int, loop: bool) -> None:
        """Every copy on ``stream``: one ``cuMemcpyBatchAsync``, or (``loop``, or no
        batch call) ``cuMemcpyAsync`` each."""
        n, s = len(copies), _vp(stream)
        if loop or self._batch is None:
            fn = self._fns["cuMemcpyAsync"]
            for j, args in enumerate(zip(*(a.tolist() for a in copies))):
                _injected("cuMemcpyAsync")
                self.check(fn(*args, s), f"cuMemcpyAsync {j} of {n}")
            return
        _injected("cuMemcpyBatchAsync")
        fail = (_c.byref(_c.c_size_t(0)),) if self.batch_abi == _BATCH_V1 else ()
        self.check(self._batch(copies.dst.ctypes.data_as(_u64p), copies.src.ctypes.data_as(_u64p),
                               copies.size.ctypes.data_as(_sizep), n, _c.byref(attrs),
                               (_c.c_size_t * 1)(0), 1, *fail, s),
                   f"cuMemcpyBatchAsync of {n} copies ({copies.nbytes} bytes)")

    def in_context(self, ordinal: int, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` with device ``ordinal``'s primary context (XLA's) current, retained
        only for the call."""
        dev, ctx = _int(), _vp()
        self.call("cuDeviceGet", _c.byref(dev), ordinal)
        self.call("cuDevicePrimaryCtxRetain", _c.byref(ctx), dev.value)
        try:
            self.call("cuCtxPushCurrent", ctx)
            try:
                return fn()
            finally:
                self.call("cuCtxPopCurrent", _c.byref(_vp()))
        finally:
            self.call("cuDevicePrimaryCtxRelease", dev.value)


class CudaCompletion:
    """The end of copies on an engine's own stream: an event recorded after them,
    destroyed once ``end`` finds them done (``block``: waits; else never blocks)."""

    def __init__(self, engine: CudaCopyEngine, event: int):
        self._engine, self._event, self._lock = engine, event, threading.Lock()

    def end(self, block: bool) -> bool:
        driver = self._engine.driver

        def end() -> None:
            event = _vp(self._event)
            if not block and (status := driver._fns["cuEventQuery"](event)) != 0:
                if status == _NOT_READY:
                    return
                driver.check(status, "cuEventQuery")
            try:
                if block:
                    driver.call("cuEventSynchronize", event)
            finally:
                self._event = None  # before the destroy: never destroyed twice
                driver.call("cuEventDestroy", event)
        with self._lock:
            if self._event is not None:
                driver.in_context(self._engine.ordinal, end)
            return self._event is None

    def hold(self, stream: int) -> None:
        """Makes later work on ``stream`` wait for the copies (nothing once done)."""
        with self._lock:
            if self._event is not None:
                self._engine.driver.call("cuStreamWaitEvent", _vp(stream), _vp(self._event), 0)


class CudaCopyEngine:
    """Runs copy descriptors on the CUDA copy engines of device ``ordinal`` (JAX's
    ``local_hardware_id``), ``mode`` ``"batch"`` (``cuMemcpyBatchAsync`` where the driver
    has it) or ``"loop"``; ``copies`` and ``bytes`` count what it enqueued."""

    name = "cuda"
    uses_stream = side_stream = True

    def __init__(self, driver: Driver, ordinal: int, mode: str = "batch"):
        if mode not in ("batch", "loop"):
            raise ValueError(f"mode={mode!r}; expected 'batch' or 'loop'")
        self.driver, self.ordinal = driver, int(ordinal)
        self.mode = mode if driver.batch_abi is not None else "loop"
        # ``CUmemcpyAttributes`` a direction: stream-ordered source access (copies read
        # what the program wrote before them), then location hints by side.
        self._attrs = {d: (_int * 6)(_SRC_ACCESS_ORDER_STREAM, *(
            (_LOCATION_DEVICE, self.ordinal, _LOCATION_HOST, 0) if d == "offload" else
            (_LOCATION_HOST, 0, _LOCATION_DEVICE, self.ordinal)), 0) for d in ("offload", "load")}
        self._lock, self._sides = threading.Lock(), {}  # its streams, by direction
        self.copies = self.bytes = 0

    def copy(self, sets: list[Copies], stream: int | None, direction: str = "offload",
             out: list[CudaCompletion] | None = None) -> None:
        """Enqueues each set of copies on ``stream`` (XLA's), in its order; or, given
        ``out``, on the engine's stream for ``direction`` after the work on ``stream`` so
        far, appending to ``out`` a completion after each set. A failure once a copy was
        enqueued there synchronizes that stream before it is raised."""
        if out is None:
            for copies in sets:
                if len(copies):
                    self._enqueue(copies, self._need(stream), direction)
            return
        stream, side = self._need(stream), self.side(direction)
        after = self._event(stream)
        try:
            self.driver.call("cuStreamWaitEvent", _vp(side), _vp(after), 0)
        finally:  # a recorded event may be destroyed at once: it goes once met
            self.driver.call("cuEventDestroy", _vp(after))
        enqueued = False
        try:
            for copies in sets:
                if len(copies):
                    enqueued = True  # before the call: a failing one may have queued some
                    self._enqueue(copies, side, direction)
                out.append(CudaCompletion(self, self._event(side)))
        except BaseException:
            if enqueued:  # nothing enqueued is still running once the error is raised
                with contextlib.suppress(DriverError):
                    self.driver.call("cuStreamSynchronize", _vp(side))
            raise

    def _event(self, stream: int) -> int:
        """An event recorded on ``stream`` after the work enqueued there so far."""
        event = self.driver.new_handle("cuEventCreate", _EVENT_FLAGS)
        try:
            self.driver.call("cuEventRecord", _vp(event), _vp(stream))
        except BaseException:
            self.driver.call("cuEventDestroy", _vp(event))
            raise
        return event

    def hold(self, completion: CudaCompletion, stream: int | None, word: int) -> None:
        """Makes work enqueued on ``stream`` from now on wait for ``completion``, then
        sets the device ``uint32`` at ``word`` to 1 in that order."""
        completion.hold(stream := self._need(stream))
        self.driver.call("cuMemsetD32Async", _c.c_uint64(word), 1, 1, _vp(stream))

    def side(self, direction: str) -> int:
        """The engine's own (non-blocking) stream for ``direction``: a load never queues
        behind an offload."""
        with self._lock:
            if direction not in self._sides:
                self._sides[direction] = self.driver.in_context(self.ordinal, lambda: (
                    self.driver.new_handle("cuStreamCreate", _STREAM_NON_BLOCKING)))
            return self._sides[direction]

    @staticmethod
    def _need(stream: int | None) -> int:
        if stream is None:
            raise DriverError("CUDA copies need XLA's stream; none was given")
        return stream

    def _enqueue(self, copies: Copies, stream: int, direction: str) -> None:
        self.driver.memcpy(copies, self._attrs[direction], stream, self.mode == "loop")
        with self._lock:
            self.copies, self.bytes = self.copies + len(copies), self.bytes + copies.nbytes

    def pin(self, address: int, nbytes: int) -> Callable[[], None]:
        """Page-locks ``[address, address + nbytes)`` for every GPU; returns the unlock."""
        run = functools.partial(self.driver.in_context, self.ordinal)
        run(lambda: self.driver.call("cuMemHostRegister", _vp(address), nbytes,
                                     _HOST_REGISTER_PORTABLE))

        def unpin() -> None:
            with contextlib.suppress(DriverError):  # the process ending: the driver gone
                run(lambda: self.driver.call("cuMemHostUnregister", _vp(address)))
        return unpin

    def numa_node(self) -> int | None:
        """The NUMA node of the host memory nearest the device (None: unknown, or a
        driver before CUDA 12.2, which does not say)."""
        dev, value = _int(), _int(-1)
        self.driver.call("cuDeviceGet", _c.byref(dev), self.ordinal)
        found = self.driver._fns["cuDeviceGetAttribute"](_c.byref(value), _HOST_NUMA_ID,
                                                         dev.value)
        return value.value if found == 0 and value.value >= 0 else None


def is_cuda(device: Any) -> bool:
    """Whether a JAX device is an NVIDIA GPU (``platform`` says only ``gpu``)."""
    return device.platform in ("gpu", "cuda") and not any(
        x in str(getattr(device.client, "platform_version", "")).lower() for x in ("rocm", "hip"))


@functools.lru_cache(maxsize=1)
def _load_driver() -> Driver | str:
    """The driver, or why it cannot be had (asked once a process)."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        return "cuda-bindings is not installed (pip install 'kvxfer[cuda]')"
    try:
        for call in (lambda: drv.cuInit(0), drv.cuDriverGetVersion):
            err, *value = call()
            if int(err):
                raise DriverError(f"the CUDA driver failed to start: CUDA error {int(err)}")

        def get_proc(name: str, abi: int) -> int:  # 0: CU_GET_PROC_ADDRESS_DEFAULT
            out = drv.cuGetProcAddress(name.encode(), abi, 0)
            return int(out[1]) if int(out[0]) == 0 else 0
        return Driver(get_proc, value[0])
    except Exception as e:  # a driver too old, or one that failed to initialize
        return f"the CUDA driver cannot be used: {e}"


def cuda_unavailable(device: Any) -> str | None:
    """Why the DMA mover has no CUDA copy engine for ``device`` (None: it has one)."""
    if not is_cuda(device):
        return f"{device} is not an NVIDIA GPU"
    driver = _load_driver()
    return driver if isinstance(driver, str) else None


def cuda_engine(device: Any, copy: str = "batch") -> CudaCopyEngine:
    """The CUDA copy engine of a JAX GPU device for a ``DmaOptions.copy`` mode, made
    once; raises ``DriverError`` where ``cuda_unavailable`` says why not."""
    if (why := cuda_unavailable(device)) is not None:
        raise DriverError(why)
    key = (int(device.local_hardware_id), copy)
    with _engines_lock:  # one engine (its streams) a device and copy mode
        if key not in _engines:
            _engines[key] = CudaCopyEngine(_load_driver(), *key)
        return _engines[key]


_engines: dict[tuple[int, str], CudaCopyEngine] = {}
_engines_lock = threading.Lock()
