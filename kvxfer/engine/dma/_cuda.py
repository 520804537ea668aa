"""The CUDA driver's copy engine. Everything kvxfer asks of the driver is behind
``Driver``: ``cuMemcpyBatchAsync`` (CUDA 12.8+; its CUDA 13 ABI has no ``failIdx``),
one call a set of copies, else a loop of ``cuMemcpyAsync``; streams and events, so
copies run beside XLA's stream (``CudaCopyEngine.copy_beside_groups``) and a stream
waits for them right before the work that reads them (``hold``); ``cuMemHostRegister``
for host pools allocated outside XLA; the device's host NUMA node.

Entry points are found once through ``cuda-bindings`` (``cuGetProcAddress``, the
extra ``kvxfer[cuda]``) and called through ``ctypes``: a transfer is one foreign call,
not one Python object a copy. ``Driver`` takes any ``get_proc(name, version) ->
address``, so tests run this module over entry points of their own.
"""

from __future__ import annotations

import ctypes as _c
import functools
import threading
from collections.abc import Callable
from typing import Any

from kvxfer.engine.dma._copies import HOOKS, Copies, Direction

__all__ = ["Driver", "DriverError", "CudaCopyEngine", "CudaCompletion", "cuda_engine",
           "cuda_unavailable", "is_cuda"]

_u64p = _c.POINTER(_c.c_uint64)
_sizep = _c.POINTER(_c.c_size_t)
_vp = _c.c_void_p

# Entry points and their argument types, each asked for with its CUDA 12.0 ABI; every
# one returns a CUresult (0: success).
_ABI = 12000
_ENTRIES: dict[str, tuple[Any, ...]] = {
    "cuMemcpyAsync": (_c.c_uint64, _c.c_uint64, _c.c_size_t, _vp),
    "cuMemHostRegister": (_vp, _c.c_size_t, _c.c_uint),
    "cuMemHostUnregister": (_vp,),
    "cuDeviceGet": (_c.POINTER(_c.c_int), _c.c_int),
    "cuDevicePrimaryCtxRetain": (_c.POINTER(_vp), _c.c_int),
    "cuDevicePrimaryCtxRelease": (_c.c_int,),
    "cuCtxPushCurrent": (_vp,),
    "cuCtxPopCurrent": (_c.POINTER(_vp),),
    "cuDeviceGetAttribute": (_c.POINTER(_c.c_int), _c.c_int, _c.c_int),
    "cuDeviceGetPCIBusId": (_c.c_char_p, _c.c_int, _c.c_int),
    "cuGetErrorString": (_c.c_int, _c.POINTER(_c.c_char_p)),
    "cuStreamCreate": (_c.POINTER(_vp), _c.c_uint),
    "cuStreamSynchronize": (_vp,),
    "cuEventCreate": (_c.POINTER(_vp), _c.c_uint),
    "cuEventRecord": (_vp, _vp),
    "cuStreamWaitEvent": (_vp, _vp, _c.c_uint),
    "cuEventQuery": (_vp,),
    "cuEventSynchronize": (_vp,),
    "cuEventDestroy": (_vp,),
    "cuMemsetD32Async": (_c.c_uint64, _c.c_uint, _c.c_size_t, _vp),
}
# cuMemcpyBatchAsync's two ABIs: CUDA 12.8 (with ``size_t* failIdx``) and CUDA 13.
_BATCH_V1, _BATCH_V2 = 12080, 13000
_BATCH_ARGS = (_u64p, _u64p, _sizep, _c.c_size_t, _vp, _sizep, _c.c_size_t)

_HOST_REGISTER_PORTABLE = 0x01
_HOST_NUMA_ID = 134  # CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID
_SRC_ACCESS_ORDER_STREAM, _LOCATION_DEVICE, _LOCATION_HOST = 1, 1, 2
_STREAM_NON_BLOCKING = 0x1
#: Events kvxfer waits on sleep rather than spin a core, and time nothing
#: (CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING).
_EVENT_FLAGS = 0x1 | 0x2
_NOT_READY = 600


class DriverError(RuntimeError):
    """A CUDA driver call failed (its name and the driver's error string)."""


def _injected(name: str) -> None:
    """Fails the call ``kvxfer.testing.driver_fault`` picked for entry point ``name``."""
    rule = HOOKS["driver"].get(name)
    if rule is not None:
        rule[0] += 1
        if rule[0] - 1 == rule[1]:
            raise DriverError(f"{name} failed: injected failure (call {rule[1]})")


class Driver:
    """The driver entry points kvxfer calls, resolved once.

    Args:
      get_proc: ``get_proc(name, version) -> address`` of an entry point (0: absent).
      version: the driver's version (``cuDriverGetVersion``: 12080 is 12.8).

    Attributes:
      batch_abi: the ``cuMemcpyBatchAsync`` ABI in use (13000, 12080), or None where
        the driver has none (copies then loop).
    """

    def __init__(self, get_proc: Callable[[str, int], int], version: int):
        self.version = int(version)
        self._get_proc = get_proc  # what resolved the entry points lives as long as they do
        self._fns: dict[str, Any] = {}
        for name, args in _ENTRIES.items():
            address = get_proc(name, min(self.version, _ABI))
            if not address:
                raise DriverError(f"the CUDA driver ({self.version}) has no {name}")
            self._fns[name] = _c.CFUNCTYPE(_c.c_int, *args)(address)
        abi = _BATCH_V2 if self.version >= _BATCH_V2 else (
            _BATCH_V1 if self.version >= _BATCH_V1 else None)
        address = get_proc("cuMemcpyBatchAsync", abi) if abi else 0
        self.batch_abi = abi if address else None
        self._batch = _c.CFUNCTYPE(_c.c_int, *_BATCH_ARGS, *(
            (_sizep,) if abi == _BATCH_V1 else ()), _vp)(address) if address else None

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
        _injected(name)
        self.check(self._fns[name](*args), name)

    def new_handle(self, name: str, flags: int) -> int:
        """A new stream or event in the current context."""
        out = _vp()
        self.call(name, _c.byref(out), flags)
        return int(out.value or 0)

    def memcpy(self, copies: Copies, attrs: Any, stream: int, loop: bool) -> None:
        """Every copy on ``stream``: one ``cuMemcpyBatchAsync``, or with ``loop`` (or no
        batch call) ``cuMemcpyAsync`` per copy."""
        n, s = len(copies), _vp(stream)
        if loop or self._batch is None:
            fn = self._fns["cuMemcpyAsync"]
            for j, (d, src, size) in enumerate(zip(copies.dst.tolist(), copies.src.tolist(),
                                                   copies.size.tolist())):
                _injected("cuMemcpyAsync")
                self.check(fn(d, src, size, s), f"cuMemcpyAsync {j} of {n}")
            return
        _injected("cuMemcpyBatchAsync")
        idx = (_c.c_size_t * 1)(0)
        fail = (_c.byref(_c.c_size_t(0)),) if self.batch_abi == _BATCH_V1 else ()
        self.check(self._batch(copies.dst.ctypes.data_as(_u64p), copies.src.ctypes.data_as(_u64p),
                               copies.size.ctypes.data_as(_sizep), n, _c.byref(attrs), idx, 1,
                               *fail, s),
                   f"cuMemcpyBatchAsync of {n} copies ({copies.nbytes} bytes)")

    def in_primary_context(self, ordinal: int, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` with device ``ordinal``'s primary context (XLA's) current, retained
        for the call and released after it (kvxfer never keeps one alive itself)."""
        dev, ctx = _c.c_int(), _vp()
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

    def host_numa_node(self, ordinal: int) -> int | None:
        """The NUMA node of the host memory nearest device ``ordinal`` (None: unknown):
        the device's attribute, else sysfs by PCI bus id."""
        dev, value = _c.c_int(), _c.c_int(-1)
        self.call("cuDeviceGet", _c.byref(dev), ordinal)
        if self._fns["cuDeviceGetAttribute"](_c.byref(value), _HOST_NUMA_ID,
                                              dev.value) == 0 and value.value >= 0:
            return value.value
        bus = _c.create_string_buffer(32)
        if self._fns["cuDeviceGetPCIBusId"](bus, 32, dev.value) != 0:
            return None
        try:
            with open(f"/sys/bus/pci/devices/{bus.value.decode().lower()}/numa_node") as f:
                node = int(f.read().strip())
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        return node if node >= 0 else None


class CudaCompletion:
    """The end of copies on a copy engine's own stream: an event recorded after them,
    destroyed once they are known to be done."""

    def __init__(self, engine: CudaCopyEngine, event: int):
        self._engine = engine
        self._event: int | None = event
        self._lock = threading.Lock()

    def _in_context(self, fn: Callable[[Driver, int], Any]) -> Any:
        return self._engine.driver.in_primary_context(
            self._engine.ordinal, lambda: fn(self._engine.driver, self._event))

    def done(self) -> bool:
        """Whether the copies have finished (never blocks)."""
        def query(driver: Driver, event: int) -> None:
            status = driver._fns["cuEventQuery"](_vp(event))
            if status != _NOT_READY:
                driver.check(status, "cuEventQuery")
                self._event = None  # before the destroy: never destroyed twice
                driver.call("cuEventDestroy", _vp(event))
        with self._lock:
            if self._event is not None:
                self._in_context(query)
            return self._event is None

    def hold(self, stream: int) -> None:
        """Makes later work on ``stream`` wait for the copies (nothing once done)."""
        with self._lock:
            if self._event is not None:
                self._engine.driver.call("cuStreamWaitEvent", _vp(stream), _vp(self._event), 0)

    def wait(self) -> None:
        """Blocks until the copies have finished (idempotent); raises ``DriverError``."""
        with self._lock:
            if self._event is None:
                return

            def sync(driver: Driver, event: int) -> None:
                try:
                    driver.call("cuEventSynchronize", _vp(event))
                finally:
                    self._event = None
                    driver.call("cuEventDestroy", _vp(event))
            self._in_context(sync)


class CudaCopyEngine:
    """Executes copy descriptors with the CUDA driver's copy engines.

    Args:
      driver: the resolved entry points.
      ordinal: the CUDA device ordinal (the JAX device's ``local_hardware_id``).
      mode: ``"batch"`` (``cuMemcpyBatchAsync`` where the driver has it) or ``"loop"``.

    Attributes:
      copies, bytes, calls: what it enqueued.
    """

    name = "cuda"
    uses_stream = True
    side_stream = True

    def __init__(self, driver: Driver, ordinal: int, mode: str = "batch"):
        if mode not in ("batch", "loop"):
            raise ValueError(f"mode={mode!r}; expected 'batch' or 'loop'")
        self.driver = driver
        self.ordinal = int(ordinal)
        self.mode = mode if driver.batch_abi is not None else "loop"
        # One attribute set a direction: stream-ordered source access (the copies read
        # what the program wrote before them), location hints by side
        # (``CUmemcpyAttributes``: six 32-bit fields).
        self._attrs = {d: (_c.c_int * 6)(_SRC_ACCESS_ORDER_STREAM, *(
            (_LOCATION_DEVICE, self.ordinal, _LOCATION_HOST, 0) if d == "offload" else
            (_LOCATION_HOST, 0, _LOCATION_DEVICE, self.ordinal)), 0) for d in ("offload", "load")}
        self._lock = threading.Lock()
        self._sides: dict[str, int] = {}
        self.copies = self.bytes = self.calls = 0

    def copy(self, copies: Copies, stream: int | None, direction: Direction = "offload"
             ) -> None:
        """Enqueues the copies on ``stream`` (XLA's), in its order."""
        if len(copies):
            self._enqueue(copies, self._need(stream), direction)

    def copy_beside_groups(self, groups: list[Copies], stream: int | None,
                           direction: Direction, out: list[CudaCompletion]) -> None:
        """Enqueues each set of copies in order on the engine's own stream for
        ``direction``, after the work enqueued on ``stream`` (XLA's) so far and before
        nothing there, appending to ``out`` an event recorded after each set.

        A failure after a copy was enqueued still leaves the last of ``out`` after
        every copy enqueued (an event recorded after the failure, else the stream
        synchronized: a stream that cannot be has failed for good, and runs nothing
        more), so nothing they touch is let go of while they run.
        """
        stream = self._need(stream)
        side = self.side(direction)
        after = self.driver.new_handle("cuEventCreate", _EVENT_FLAGS)
        try:
            self.driver.call("cuEventRecord", _vp(after), _vp(stream))
            self.driver.call("cuStreamWaitEvent", _vp(side), _vp(after), 0)
        finally:  # a recorded event may be destroyed at once: it goes once met
            self.driver.call("cuEventDestroy", _vp(after))
        enqueued = False
        try:
            for copies in groups:
                if len(copies):
                    enqueued = True  # before the call: a failing one may have queued some
                    self._enqueue(copies, side, direction)
                out.append(self._record(side))
        except BaseException:
            if enqueued:
                try:
                    out.append(self._record(side))
                except BaseException:  # noqa: BLE001 - the synchronize covers them
                    try:
                        self.driver.call("cuStreamSynchronize", _vp(side))
                    except DriverError:
                        pass
            raise

    def _record(self, stream: int) -> CudaCompletion:
        event = self.driver.new_handle("cuEventCreate", _EVENT_FLAGS)
        try:
            self.driver.call("cuEventRecord", _vp(event), _vp(stream))
        except BaseException:
            self.driver.call("cuEventDestroy", _vp(event))
            raise
        return CudaCompletion(self, event)

    def hold(self, completion: CudaCompletion, stream: int | None) -> None:
        """Makes the work enqueued on ``stream`` from now on wait for ``completion``."""
        completion.hold(self._need(stream))

    def set_word(self, address: int, value: int, stream: int | None) -> None:
        """Writes one ``uint32`` at device ``address`` in ``stream``'s order."""
        self.driver.call("cuMemsetD32Async", _c.c_uint64(address), value, 1,
                         _vp(self._need(stream)))

    def side(self, direction: Direction) -> int:
        """The engine's own stream for ``direction`` (non-blocking; one a direction, so
        a load never queues behind an offload), made once in the primary context."""
        with self._lock:
            if direction not in self._sides:
                self._sides[direction] = self.driver.in_primary_context(
                    self.ordinal, lambda: self.driver.new_handle("cuStreamCreate",
                                                                 _STREAM_NON_BLOCKING))
            return self._sides[direction]

    @staticmethod
    def _need(stream: int | None) -> int:
        if stream is None:
            raise DriverError("CUDA copies need XLA's stream; none was given")
        return stream

    def _enqueue(self, copies: Copies, stream: int, direction: Direction) -> None:
        self.driver.memcpy(copies, self._attrs[direction], stream, self.mode == "loop")
        with self._lock:
            self.copies += len(copies)
            self.bytes += copies.nbytes
            self.calls += 1

    def pin(self, address: int, nbytes: int) -> Callable[[], None]:
        """Page-locks ``[address, address + nbytes)`` for every GPU (portable); returns
        the call that unlocks it."""
        self.driver.in_primary_context(self.ordinal, lambda: self.driver.call(
            "cuMemHostRegister", _vp(address), nbytes, _HOST_REGISTER_PORTABLE))

        def unpin() -> None:
            try:
                self.driver.in_primary_context(self.ordinal, lambda: self.driver.call(
                    "cuMemHostUnregister", _vp(address)))
            except DriverError:
                pass  # the process is ending (the driver torn down first)
        return unpin

    def numa_node(self) -> int | None:
        return self.driver.host_numa_node(self.ordinal)


def is_cuda(device: Any) -> bool:
    """Whether a JAX device is an NVIDIA GPU (``platform`` says only ``gpu``)."""
    if device.platform not in ("gpu", "cuda"):
        return False
    version = str(getattr(device.client, "platform_version", "")).lower()
    return "rocm" not in version and "hip" not in version


@functools.lru_cache(maxsize=1)
def _load_driver() -> Driver:
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        from cuda import cuda as drv  # cuda-python before 12.6
    for call in (lambda: drv.cuInit(0), drv.cuDriverGetVersion):
        err, *value = call()
        if int(err):
            raise DriverError(f"the CUDA driver failed to start: CUDA error {int(err)}")
    default = getattr(getattr(drv, "CUdriverProcAddress_flags", None),
                      "CU_GET_PROC_ADDRESS_DEFAULT", 0)

    def get_proc(name: str, abi: int) -> int:
        out = drv.cuGetProcAddress(name.encode(), abi, default)
        return int(out[1]) if int(out[0]) == 0 else 0

    return Driver(get_proc, value[0])


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


_engines: dict[tuple[int, str], CudaCopyEngine] = {}  # by device ordinal and copy mode
_engines_lock = threading.Lock()


def cuda_engine(device: Any, copy: str = "batch") -> CudaCopyEngine:
    """The CUDA copy engine of a JAX GPU device for a ``DmaOptions.copy`` mode (made
    once a device and mode).

    Raises:
      DriverError, ImportError: see ``cuda_unavailable``.
    """
    key = (int(device.local_hardware_id), copy)
    with _engines_lock:
        if key not in _engines:
            _engines[key] = CudaCopyEngine(_load_driver(), key[0], copy)
        return _engines[key]
