"""The CUDA driver surface of the DMA mover: batched copies on XLA's stream, pinned pools.

Everything kvxfer asks of the CUDA driver is in this module, behind ``Driver``:

* ``cuMemcpyBatchAsync`` (CUDA 12.8+; its CUDA 13 ABI has no ``failIdx``): one call
  per transfer, the descriptors packed as numpy arrays of addresses; where the driver
  lacks it, a loop of ``cuMemcpyAsync``. Both on the stream a program's
  ``buffer_callback`` is handed, so XLA orders the copies after what produced the
  caches and before whatever runs next (donation included);
* beside XLA's stream (``CudaCopyEngine.copy_beside_groups``): an event recorded on XLA's
  stream, the engine's own non-blocking stream made to wait for it, the copies there,
  and an event after them that the transfer thread waits on (``CudaCompletion``), so
  later work on XLA's stream does not wait for the copies; a load's copies in groups
  of layers, an event after each, and XLA's stream made to wait for one group's event
  right before the work that reads it (``hold``), with a word written in its order
  (``cuMemsetD32Async``) that says the copies were enqueued;
* ``cuMemHostRegister`` (portable) for host pools allocated outside XLA, inside the
  device's primary context (XLA's, retained for the call and released after it);
* the device's host NUMA node (``CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID``, else sysfs by PCI
  bus id), so a pool is allocated near the device.

Entry points are found once through ``cuda-bindings`` (``cuGetProcAddress``, the
optional extra ``kvxfer[cuda]``) and called through ``ctypes``: a transfer is one
foreign call, not one Python object per copy. ``Driver`` takes any ``get_proc(name,
version) -> address``, so tests run this module over entry points of their own.
``DmaOptions(copy="loop")`` forces the ``cuMemcpyAsync`` loop (to measure both).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any

from kvxfer.engine._copies import Copies, Direction

__all__ = ["Driver", "CudaCopyEngine", "CudaCompletion", "DriverError", "cuda_engine",
           "cuda_unavailable", "is_cuda"]

_c = ctypes
_u64p = _c.POINTER(_c.c_uint64)
_sizep = _c.POINTER(_c.c_size_t)

# Entry points and their argument types, each asked for with its CUDA 12.0 ABI (the
# prototypes below); every one returns a CUresult (0: success).
_ABI = 12000
_ENTRIES: dict[str, tuple[Any, ...]] = {
    "cuMemcpyAsync": (_c.c_uint64, _c.c_uint64, _c.c_size_t, _c.c_void_p),
    "cuMemHostRegister": (_c.c_void_p, _c.c_size_t, _c.c_uint),
    "cuMemHostUnregister": (_c.c_void_p,),
    "cuDeviceGet": (_c.POINTER(_c.c_int), _c.c_int),
    "cuDevicePrimaryCtxRetain": (_c.POINTER(_c.c_void_p), _c.c_int),
    "cuDevicePrimaryCtxRelease": (_c.c_int,),
    "cuCtxPushCurrent": (_c.c_void_p,),
    "cuCtxPopCurrent": (_c.POINTER(_c.c_void_p),),
    "cuDeviceGetAttribute": (_c.POINTER(_c.c_int), _c.c_int, _c.c_int),
    "cuDeviceGetPCIBusId": (_c.c_char_p, _c.c_int, _c.c_int),
    "cuGetErrorString": (_c.c_int, _c.POINTER(_c.c_char_p)),
    "cuStreamCreate": (_c.POINTER(_c.c_void_p), _c.c_uint),
    "cuEventCreate": (_c.POINTER(_c.c_void_p), _c.c_uint),
    "cuEventRecord": (_c.c_void_p, _c.c_void_p),
    "cuStreamWaitEvent": (_c.c_void_p, _c.c_void_p, _c.c_uint),
    "cuEventQuery": (_c.c_void_p,),
    "cuEventSynchronize": (_c.c_void_p,),
    "cuEventDestroy": (_c.c_void_p,),
    "cuStreamSynchronize": (_c.c_void_p,),
    "cuMemsetD32Async": (_c.c_uint64, _c.c_uint, _c.c_size_t, _c.c_void_p),
}
# cuMemcpyBatchAsync's two ABIs: CUDA 12.8 (with ``size_t* failIdx``) and CUDA 13.
_BATCH_V1 = 12080
_BATCH_V2 = 13000
_BATCH_ARGS = (_u64p, _u64p, _sizep, _c.c_size_t, _c.c_void_p, _sizep, _c.c_size_t)

_CU_MEMHOSTREGISTER_PORTABLE = 0x01
_CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID = 134
_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_LOCATION_TYPE_HOST = 2
_CU_STREAM_NON_BLOCKING = 0x1
_CU_EVENT_BLOCKING_SYNC = 0x1
_CU_EVENT_DISABLE_TIMING = 0x2
#: Events kvxfer waits on: a wait sleeps rather than spins a core, and costs no timing.
_EVENT_FLAGS = _CU_EVENT_BLOCKING_SYNC | _CU_EVENT_DISABLE_TIMING
_CUDA_ERROR_NOT_READY = 600


class DriverError(RuntimeError):
    """A CUDA driver call failed (its name and the driver's error string)."""


class MemLocation(ctypes.Structure):
    """``CUmemLocation``."""

    _fields_ = [("type", _c.c_int), ("id", _c.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (24 bytes: the flags at offset 20)."""

    _fields_ = [("srcAccessOrder", _c.c_int), ("srcLocHint", MemLocation),
                ("dstLocHint", MemLocation), ("flags", _c.c_uint)]


GetProc = Callable[[str, int], int]
"""``get_proc(name, version) -> address`` of a driver entry point (0: absent)."""


class Driver:
    """The driver entry points kvxfer calls, resolved once.

    Args:
      get_proc: resolves an entry point for an ABI version (``cuGetProcAddress``).
      version: the driver's version (``cuDriverGetVersion``: 12080 is 12.8).

    Attributes:
      version: the driver version. batch_abi: the ``cuMemcpyBatchAsync`` ABI in use
        (13000, 12080), or None where the driver has none (copies then loop).
    """

    def __init__(self, get_proc: GetProc, version: int):
        self.version = int(version)
        self._get_proc = get_proc  # what resolved the entry points lives as long as they do
        self._fns: dict[str, Any] = {}
        for name, args in _ENTRIES.items():
            address = get_proc(name, min(self.version, _ABI))
            if not address:
                raise DriverError(f"the CUDA driver ({self.version}) has no {name}")
            self._fns[name] = _c.CFUNCTYPE(_c.c_int, *args)(address)
        self.batch_abi: int | None = None
        self._batch = None
        abi = _BATCH_V2 if self.version >= _BATCH_V2 else _BATCH_V1 \
            if self.version >= _BATCH_V1 else None
        address = get_proc("cuMemcpyBatchAsync", abi) if abi else 0
        if address:
            args = _BATCH_ARGS + ((_sizep,) if abi == _BATCH_V1 else ()) + (_c.c_void_p,)
            self._batch = _c.CFUNCTYPE(_c.c_int, *args)(address)
            self.batch_abi = abi

    def check(self, status: int, what: str) -> None:
        """Raises ``DriverError`` naming ``what`` unless ``status`` is success."""
        if status == 0:
            return
        text = _c.c_char_p()
        self._fns["cuGetErrorString"](status, _c.byref(text))
        raise DriverError(f"{what} failed: CUDA error {status} "
                          f"({(text.value or b'unknown').decode(errors='replace')})")

    def call(self, name: str, *args: Any) -> None:
        """Calls entry point ``name``; raises ``DriverError`` on failure."""
        self.check(self._fns[name](*args), name)

    def new_handle(self, name: str, flags: int) -> int:
        """A new stream or event (``cuStreamCreate``, ``cuEventCreate``) in the current
        context."""
        out = _c.c_void_p()
        self.call(name, _c.byref(out), flags)
        return int(out.value or 0)

    def query(self, event: int) -> bool:
        """Whether the work before ``event`` has finished (``cuEventQuery``)."""
        status = self._fns["cuEventQuery"](_c.c_void_p(event))
        if status == _CUDA_ERROR_NOT_READY:
            return False
        self.check(status, "cuEventQuery")
        return True

    def memcpy_batch(self, copies: Copies, attrs: MemcpyAttributes, stream: int) -> None:
        """One ``cuMemcpyBatchAsync`` of every copy, on ``stream``, one set of attributes."""
        n = len(copies)
        idx = (_c.c_size_t * 1)(0)
        args = [copies.dst.ctypes.data_as(_u64p), copies.src.ctypes.data_as(_u64p),
                copies.size.ctypes.data_as(_sizep), n, _c.byref(attrs), idx, 1]
        if self.batch_abi == _BATCH_V1:
            fail = _c.c_size_t(0)
            args.append(_c.byref(fail))
        status = self._batch(*args, _c.c_void_p(stream))
        self.check(status, f"cuMemcpyBatchAsync of {n} copies ({copies.nbytes} bytes)")

    def memcpy_loop(self, copies: Copies, stream: int) -> None:
        """``cuMemcpyAsync`` per copy, on ``stream``."""
        fn, s = self._fns["cuMemcpyAsync"], _c.c_void_p(stream)
        for j, (d, src, n) in enumerate(zip(copies.dst.tolist(), copies.src.tolist(),
                                            copies.size.tolist())):
            self.check(fn(d, src, n, s), f"cuMemcpyAsync {j} of {len(copies)}")

    def in_primary_context(self, ordinal: int, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` with device ``ordinal``'s primary context (XLA's) current.

        The context is retained for the call and released after it (XLA holds its
        own reference), so kvxfer never keeps a primary context alive on its own.
        """
        dev, ctx = _c.c_int(), _c.c_void_p()
        self.call("cuDeviceGet", _c.byref(dev), ordinal)
        self.call("cuDevicePrimaryCtxRetain", _c.byref(ctx), dev.value)
        try:
            self.call("cuCtxPushCurrent", ctx)
            try:
                return fn()
            finally:
                self.call("cuCtxPopCurrent", _c.byref(_c.c_void_p()))
        finally:
            self.call("cuDevicePrimaryCtxRelease", dev.value)

    def host_numa_node(self, ordinal: int) -> int | None:
        """The NUMA node of the host memory nearest device ``ordinal`` (None: unknown)."""
        dev, value = _c.c_int(), _c.c_int(-1)
        self.call("cuDeviceGet", _c.byref(dev), ordinal)
        if self._fns["cuDeviceGetAttribute"](_c.byref(value), _CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID,
                                              dev.value) == 0 and value.value >= 0:
            return value.value
        bus = _c.create_string_buffer(32)
        if self._fns["cuDeviceGetPCIBusId"](bus, 32, dev.value) != 0:
            return None
        return _sysfs_numa_node(bus.value.decode(errors="replace"))


def _sysfs_numa_node(bus_id: str) -> int | None:
    """The NUMA node sysfs gives a PCI device (None: unknown or no NUMA)."""
    try:
        with open(f"/sys/bus/pci/devices/{bus_id.lower()}/numa_node") as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


class CudaCompletion:
    """The end of copies enqueued on a copy engine's own stream: an event recorded
    after them (``CudaCopyEngine.copy_beside_groups``)."""

    def __init__(self, engine: CudaCopyEngine, event: int):
        self._engine = engine
        self._event: int | None = event
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Whether the copies have finished (never blocks); the event goes once they
        have."""
        with self._lock:
            if self._event is None:
                return True
            driver, event = self._engine.driver, self._event

            def query() -> bool:
                if not driver.query(event):
                    return False
                driver.call("cuEventDestroy", _c.c_void_p(event))
                return True
            finished = driver.in_primary_context(self._engine.ordinal, query)
            if finished:
                self._event = None
        return finished

    def hold(self, stream: int) -> None:
        """Makes later work on ``stream`` wait for the copies (``cuStreamWaitEvent``;
        nothing once they were waited for)."""
        with self._lock:
            if self._event is not None:
                self._engine.driver.call("cuStreamWaitEvent", _c.c_void_p(stream),
                                         _c.c_void_p(self._event), 0)

    def wait(self) -> None:
        """Blocks until the copies have finished (idempotent); raises ``DriverError``."""
        with self._lock:
            if self._event is None:
                return
            event, self._event = self._event, None
            driver = self._engine.driver

            def sync() -> None:
                try:
                    driver.call("cuEventSynchronize", _c.c_void_p(event))
                finally:
                    driver.call("cuEventDestroy", _c.c_void_p(event))
            driver.in_primary_context(self._engine.ordinal, sync)


class CudaCopyEngine:
    """Executes copy descriptors with the CUDA driver's copy engines, on XLA's stream.

    Args:
      driver: the resolved entry points.
      ordinal: the CUDA device ordinal (the JAX device's ``local_hardware_id``).
      mode: ``"batch"`` (``cuMemcpyBatchAsync`` where the driver has it) or ``"loop"``.

    Attributes:
      copies, bytes, calls: what it enqueued (for tests and stats).
    """

    name = "cuda"
    uses_stream = True
    #: Whether ``copy_beside_groups`` runs copies on streams of the engine's own.
    side_stream = True

    def __init__(self, driver: Driver, ordinal: int, mode: str = "batch"):
        if mode not in ("batch", "loop"):
            raise ValueError(f"mode={mode!r}; expected 'batch' or 'loop'")
        self.driver = driver
        self.ordinal = int(ordinal)
        self.mode = mode if driver.batch_abi is not None else "loop"
        self._attrs = {d: _attributes(d, self.ordinal) for d in ("offload", "load")}
        self._lock = threading.Lock()
        self._sides: dict[str, int] = {}
        self.copies = self.bytes = self.calls = 0

    def copy(self, copies: Copies, stream: int | None, direction: Direction = "offload"
             ) -> None:
        if not len(copies):
            return
        if stream is None:
            raise DriverError("CUDA copies need XLA's stream; none was given")
        self._enqueue(copies, stream, direction)

    def copy_beside_groups(self, groups: list[Copies], stream: int | None,
                           direction: Direction, out: list[CudaCompletion]) -> None:
        """Enqueues each set of copies in order on the engine's own stream for
        ``direction``, after the work enqueued on ``stream`` (XLA's) so far and before
        nothing there (later work on XLA's stream does not wait for them; inside a
        program's callback, its context current), appending to ``out`` an event recorded after each set's copies (what ``hold``
        makes a stream wait for), so the work reading one set waits for its copies
        alone.

        A failure after a copy was enqueued still leaves the last of ``out`` after
        every copy enqueued (an event recorded after the failure, else the stream
        synchronized), so nothing they touch is let go while they run.
        """
        if stream is None:
            raise DriverError("CUDA copies need XLA's stream; none was given")
        side = self.side(direction)
        after = self.driver.new_handle("cuEventCreate", _EVENT_FLAGS)
        try:
            self.driver.call("cuEventRecord", _c.c_void_p(after), _c.c_void_p(stream))
            self.driver.call("cuStreamWaitEvent", _c.c_void_p(side), _c.c_void_p(after), 0)
        finally:
            # Destroying a recorded event is allowed: it goes once the wait is met.
            self.driver.call("cuEventDestroy", _c.c_void_p(after))
        enqueued = False
        try:
            for copies in groups:
                if len(copies):
                    enqueued = True  # before the call: a failing batch may have queued some
                    self._enqueue(copies, side, direction)
                out.append(self._record(side))
        except BaseException:
            if enqueued:
                self._cover(side, out)
            raise

    def _record(self, stream: int) -> CudaCompletion:
        """An event recorded on ``stream`` now (destroyed if the record fails)."""
        event = self.driver.new_handle("cuEventCreate", _EVENT_FLAGS)
        try:
            self.driver.call("cuEventRecord", _c.c_void_p(event), _c.c_void_p(stream))
        except BaseException:
            self.driver.call("cuEventDestroy", _c.c_void_p(event))
            raise
        return CudaCompletion(self, event)

    def _cover(self, side: int, out: list[CudaCompletion]) -> None:
        """After a failure: puts in ``out`` what ends after every copy queued on
        ``side``: an event, else (the event failed too) the stream synchronized here.
        A stream that cannot be synchronized has failed for good: none of its copies
        run any more."""
        try:
            out.append(self._record(side))
        except BaseException:  # noqa: BLE001 - the synchronize below covers them
            try:
                self.driver.call("cuStreamSynchronize", _c.c_void_p(side))
            except DriverError:
                pass

    def hold(self, completion: CudaCompletion, stream: int | None) -> None:
        """Makes work enqueued on ``stream`` from now on wait for ``completion``'s
        copies (``cuStreamWaitEvent``; inside a program's callback, its context
        current). Copies already waited for hold nothing."""
        if stream is None:
            raise DriverError("a stream wait needs XLA's stream; none was given")
        completion.hold(stream)

    def set_word(self, address: int, value: int, stream: int | None) -> None:
        """Writes one ``uint32`` at device ``address`` in ``stream``'s order
        (``cuMemsetD32Async``)."""
        if stream is None:
            raise DriverError("a device write needs XLA's stream; none was given")
        self.driver.call("cuMemsetD32Async", _c.c_uint64(address), value, 1,
                         _c.c_void_p(stream))

    def side(self, direction: Direction) -> int:
        """The engine's own stream for ``direction`` (non-blocking; one per direction,
        so a load never queues behind an offload), made once in the device's primary
        context."""
        with self._lock:
            if direction not in self._sides:
                self._sides[direction] = self.driver.in_primary_context(
                    self.ordinal, lambda: self.driver.new_handle("cuStreamCreate",
                                                                 _CU_STREAM_NON_BLOCKING))
            return self._sides[direction]

    def _enqueue(self, copies: Copies, stream: int, direction: Direction) -> None:
        if self.mode == "batch":
            self.driver.memcpy_batch(copies, self._attrs[direction], stream)
        else:
            self.driver.memcpy_loop(copies, stream)
        with self._lock:
            self.copies += len(copies)
            self.bytes += copies.nbytes
            self.calls += 1

    def pin(self, address: int, nbytes: int) -> Callable[[], None]:
        """Page-locks ``[address, address + nbytes)`` for every GPU (portable); returns
        the call that unlocks it."""
        self.driver.in_primary_context(self.ordinal, lambda: self.driver.call(
            "cuMemHostRegister", _c.c_void_p(address), nbytes, _CU_MEMHOSTREGISTER_PORTABLE))

        def unpin() -> None:
            try:
                self.driver.in_primary_context(self.ordinal, lambda: self.driver.call(
                    "cuMemHostUnregister", _c.c_void_p(address)))
            except DriverError:
                pass  # the process is ending (the driver torn down first)
        return unpin

    def numa_node(self) -> int | None:
        return self.driver.host_numa_node(self.ordinal)


def _attributes(direction: Direction, ordinal: int) -> MemcpyAttributes:
    """One attribute set for every copy of a direction: stream-ordered source access
    (the copies read what the program wrote before them), location hints by side."""
    device = MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
    host = MemLocation(_CU_MEM_LOCATION_TYPE_HOST, 0)
    src, dst = (device, host) if direction == "offload" else (host, device)
    return MemcpyAttributes(_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, src, dst, 0)


def is_cuda(device: Any) -> bool:
    """Whether a JAX device is an NVIDIA GPU (``platform`` says only ``gpu``)."""
    if device.platform not in ("gpu", "cuda"):
        return False
    version = str(getattr(device.client, "platform_version", "")).lower()
    return "rocm" not in version and "hip" not in version


def _bindings() -> Any:
    """``cuda-bindings``' driver module (the ``kvxfer[cuda]`` extra)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # cuda-python before 12.6
    return driver


@functools.lru_cache(maxsize=1)
def _load_driver() -> Driver:
    drv = _bindings()
    err, = drv.cuInit(0)
    if int(err):
        raise DriverError(f"cuInit failed: CUDA error {int(err)}")
    err, version = drv.cuDriverGetVersion()
    if int(err):
        raise DriverError(f"cuDriverGetVersion failed: CUDA error {int(err)}")
    default = getattr(getattr(drv, "CUdriverProcAddress_flags", None),
                      "CU_GET_PROC_ADDRESS_DEFAULT", 0)

    def get_proc(name: str, abi: int) -> int:
        out = drv.cuGetProcAddress(name.encode(), abi, default)
        return int(out[1]) if int(out[0]) == 0 else 0

    return Driver(get_proc, version)


@functools.lru_cache(maxsize=1)
def _driver_problem() -> str | None:
    """Why the driver's entry points cannot be had (asked once a process)."""
    try:
        _load_driver()
    except ImportError:
        return "cuda-bindings is not installed (pip install 'kvxfer[cuda]')"
    except Exception as e:  # a driver too old, or one that failed to initialize
        return f"the CUDA driver cannot be used: {e}"
    return None


def cuda_unavailable(device: Any) -> str | None:
    """Why the DMA mover has no CUDA copy engine for ``device`` (None: it has one)."""
    if not is_cuda(device):
        return f"{device} is not an NVIDIA GPU"
    return _driver_problem()


_engines: dict[tuple[int, str], CudaCopyEngine] = {}
_engines_lock = threading.Lock()


def cuda_engine(device: Any, copy: str = "batch") -> CudaCopyEngine:
    """The CUDA copy engine of a JAX GPU device for a ``copy`` mode (``DmaOptions``;
    one per device and mode, made once).

    Raises:
      DriverError, ImportError: see ``cuda_unavailable``.
    """
    ordinal = int(device.local_hardware_id)
    with _engines_lock:
        engine = _engines.get((ordinal, copy))
        if engine is None:
            engine = _engines[ordinal, copy] = CudaCopyEngine(_load_driver(), ordinal, copy)
        return engine

