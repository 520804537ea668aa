"""A stand-in CUDA driver for CPU tests of ``kvxfer.engine.dma._engines``.

``FakeDriver.get_proc`` hands out C function pointers (ctypes callbacks) with the
driver's own prototypes, written here from the CUDA headers independently of the
module under test, so a wrong argument order or type there shows up as wrong bytes or
wrong records here. The copies really move bytes (host memory plays both sides), and
every call is recorded.
"""

from __future__ import annotations

import ctypes as c
import itertools
import queue
import threading
import time
from typing import Any

import numpy as np

from kvxfer import DmaOptions
from kvxfer.engine import DmaMover
from kvxfer.engine.dma._engines import CudaCopyEngine, Driver

#: Options for tests that check one thing over the stand-in engine: its self-check
#: (tested on its own) would add its calls to theirs.
NO_CHECK = DmaOptions(self_check=False)


def dma_mover(mgr: Any, options: DmaOptions = NO_CHECK) -> DmaMover:
    """A DMA mover for the manager's first slice class and pool under ``options``, made
    through public names: what it decides (``relayout``, ``groups``) is what the
    manager's own mover decided with the same options."""
    return DmaMover(mgr.plan.classes[0], mgr.host_pool.pools[0], options)

CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2


class Attributes(c.Structure):
    _fields_ = [("order", c.c_int), ("src_type", c.c_int), ("src_id", c.c_int),
                ("dst_type", c.c_int), ("dst_id", c.c_int), ("flags", c.c_uint)]


_U64P, _SIZEP = c.POINTER(c.c_uint64), c.POINTER(c.c_size_t)
_PROTOTYPES = {
    "cuMemcpyBatchAsync@13000": (_U64P, _U64P, _SIZEP, c.c_size_t, c.c_void_p, _SIZEP,
                                 c.c_size_t, c.c_void_p),
    "cuMemcpyBatchAsync@12080": (_U64P, _U64P, _SIZEP, c.c_size_t, c.c_void_p, _SIZEP,
                                 c.c_size_t, _SIZEP, c.c_void_p),
    "cuMemcpyAsync": (c.c_uint64, c.c_uint64, c.c_size_t, c.c_void_p),
    "cuMemHostRegister": (c.c_void_p, c.c_size_t, c.c_uint),
    "cuMemHostUnregister": (c.c_void_p,),
    "cuDeviceGet": (c.POINTER(c.c_int), c.c_int),
    "cuDevicePrimaryCtxRetain": (c.POINTER(c.c_void_p), c.c_int),
    "cuDevicePrimaryCtxRelease": (c.c_int,),  # CUdevice
    "cuCtxPushCurrent": (c.c_void_p,),
    "cuCtxPopCurrent": (c.POINTER(c.c_void_p),),
    "cuDeviceGetAttribute": (c.POINTER(c.c_int), c.c_int, c.c_int),
    # char* in the driver; a callback given c_char_p would see a copy as bytes.
    "cuDeviceGetPCIBusId": (c.c_void_p, c.c_int, c.c_int),
    "cuGetErrorString": (c.c_int, c.POINTER(c.c_char_p)),
    "cuStreamCreate": (c.POINTER(c.c_void_p), c.c_uint),
    "cuEventCreate": (c.POINTER(c.c_void_p), c.c_uint),
    "cuEventRecord": (c.c_void_p, c.c_void_p),          # CUevent, CUstream
    "cuStreamWaitEvent": (c.c_void_p, c.c_void_p, c.c_uint),  # CUstream, CUevent, flags
    "cuEventQuery": (c.c_void_p,),
    "cuEventSynchronize": (c.c_void_p,),
    "cuEventDestroy": (c.c_void_p,),
    "cuStreamSynchronize": (c.c_void_p,),
    "cuMemsetD32Async": (c.c_uint64, c.c_uint, c.c_size_t, c.c_void_p),  # CUdeviceptr
}
CUDA_ERROR_NOT_READY = 600


class _Stream:
    """A stream of the stand-in driver: a thread running what is enqueued on it in
    order, each copy ``delay`` seconds late, so work that does not wait for it sees the
    bytes from before."""

    def __init__(self, delay: float, driver: Any = None):
        self.delay = delay
        self.driver = driver
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            kind, arg = self.queue.get()
            if kind == "copy":
                copies, tick = arg
                time.sleep(self.delay)
                watch = self.driver.watch if self.driver is not None else None
                if watch is not None:
                    d, s, n = (np.array(x, np.uint64) for x in zip(*copies))
                    for start in (d, s):
                        if watch.freed_since(tick, start, start + n):
                            self.driver.late.append(copies)
                for d, s, n in copies:
                    c.memmove(d, s, n)
            elif kind == "set":
                c.c_uint32.from_address(arg[0]).value = arg[1]
            elif kind == "record":
                arg.set()
            elif kind == "wait":
                arg.wait()


class FakeDriver:
    """Driver entry points over host memory, recording every call.

    Streams it makes (``cuStreamCreate``) are threads that run their copies ``delay``
    seconds late; any other stream handle stands for XLA's stream on XLA:CPU, where a
    program's work before its callback has run by the time the callback does: copies
    there run at once, an event recorded there is complete, a wait there blocks.

    Args:
      version: what ``cuDriverGetVersion`` would say (12080: 12.8; below: no batch call).
      numa: what ``CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID`` gives (-1: no NUMA).
      fail: entry point name -> CUresult it returns instead of working.
      delay: how late a stream of its own runs each copy, in seconds.
    """

    def __init__(self, version: int = 13000, numa: int = -1, fail: dict[str, int] | None = None,
                 delay: float = 0.05, fail_at: tuple[str, int] | None = None,
                 watch: Any = None):
        self.version = version
        self.delay = delay
        # ``fail_at=(name, n)``: the n-th call (from 0) of entry point ``name`` fails.
        self.fail_at = fail_at
        self._counts: dict[str, int] = {}
        # A ``kvxfer.testing.ReleaseWatch``: copies that run into memory kvxfer let go
        # of after they were enqueued are kept in ``late``.
        self.watch = watch
        self.late: list[Any] = []
        self.streams: dict[int, _Stream] = {}
        self.events: dict[int, threading.Event] = {}
        self._handles = itertools.count(0xE000)
        self.numa = numa
        self.fail = dict(fail or {})
        self.calls: list[tuple[str, Any]] = []
        self.context: list[int] = []
        self.registered: dict[int, tuple[int, int, int]] = {}  # address -> (size, flags, ctx)
        self.retained: dict[int, int] = {}  # device -> primary context references held
        self._message = c.c_char_p(b"out of memory")
        self._keep: list[Any] = []

    def get_proc(self, name: str, version: int) -> int:
        if name == "cuMemcpyBatchAsync":
            if self.version < 12080:
                return 0
            key = f"{name}@{13000 if version >= 13000 else 12080}"
        else:
            key = name
        fn = c.CFUNCTYPE(c.c_int, *_PROTOTYPES[key])(getattr(self, "_" + key.split("@")[0]))
        self._keep.append(fn)
        return c.cast(fn, c.c_void_p).value

    def driver(self) -> Driver:
        return Driver(self.get_proc, self.version)

    def _failing(self, name: str) -> int:
        n = self._counts[name] = self._counts.get(name, 0) + 1
        if self.fail_at is not None and self.fail_at == (name, n - 1):
            return CUDA_ERROR_INVALID_VALUE
        return self.fail.get(name, 0)

    def _cuMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, idxs, num, *rest):
        stream = rest[-1]
        failidx = rest[0] if len(rest) == 2 else None
        a = Attributes.from_address(attrs)
        self.calls.append(("batch", dict(count=count, stream=stream, order=a.order,
                                         src=(a.src_type, a.src_id), dst=(a.dst_type, a.dst_id),
                                         flags=a.flags, idx0=idxs[0], num=num,
                                         failidx=failidx is not None)))
        status = self._failing("cuMemcpyBatchAsync")
        if status:
            return status
        self._copy(stream, [(dsts[i], srcs[i], sizes[i]) for i in range(count)])
        return 0

    def _cuMemcpyAsync(self, dst, src, n, stream):
        self.calls.append(("copy", dict(size=n, stream=stream)))
        status = self._failing("cuMemcpyAsync")
        if status:
            return status
        self._copy(stream, [(dst, src, n)])
        return 0

    def _copy(self, stream, copies):
        # The descriptors are read during the call, as the driver reads them.
        if stream in self.streams:
            tick = self.watch.now() if self.watch is not None else None
            self.streams[stream].queue.put(("copy", (copies, tick)))
        else:
            for d, s, n in copies:
                c.memmove(d, s, n)

    def _cuMemsetD32Async(self, dst, value, count, stream):
        self.calls.append(("memset", dict(count=count, stream=stream)))
        status = self._failing("cuMemsetD32Async")
        if status:
            return status
        for i in range(count):
            if stream in self.streams:
                self.streams[stream].queue.put(("set", (dst + 4 * i, value)))
            else:
                c.c_uint32.from_address(dst + 4 * i).value = value
        return 0

    def _cuStreamCreate(self, out, flags):
        status = self._failing("cuStreamCreate")
        if status:
            return status
        handle = next(self._handles)
        self.streams[handle] = _Stream(self.delay, self)
        self.calls.append(("stream", dict(flags=flags)))
        out[0] = handle
        return 0

    def _cuEventCreate(self, out, flags):
        status = self._failing("cuEventCreate")
        if status:
            return status
        handle = next(self._handles)
        self.events[handle] = threading.Event()
        out[0] = handle
        return 0

    def _cuEventRecord(self, event, stream):
        status = self._failing("cuEventRecord")
        if status:
            return status
        if event not in self.events:
            return CUDA_ERROR_INVALID_VALUE
        self.events[event].clear()
        self.calls.append(("record", dict(stream=stream)))
        if stream in self.streams:
            self.streams[stream].queue.put(("record", self.events[event]))
        else:
            self.events[event].set()
        return 0

    def _cuStreamWaitEvent(self, stream, event, flags):
        status = self._failing("cuStreamWaitEvent")
        if status:
            return status
        if event not in self.events:
            return CUDA_ERROR_INVALID_VALUE
        self.calls.append(("wait", dict(stream=stream)))
        if stream in self.streams:
            self.streams[stream].queue.put(("wait", self.events[event]))
        else:
            self.events[event].wait()
        return 0

    def _cuEventQuery(self, event):
        if event not in self.events:
            return CUDA_ERROR_INVALID_VALUE
        return 0 if self.events[event].is_set() else CUDA_ERROR_NOT_READY

    def _cuEventSynchronize(self, event):
        if event not in self.events:
            return CUDA_ERROR_INVALID_VALUE
        self.events[event].wait()
        return 0

    def _cuStreamSynchronize(self, stream):
        self.calls.append(("sync", dict(stream=stream)))
        if stream in self.streams:
            done = threading.Event()
            self.streams[stream].queue.put(("record", done))
            done.wait()
        return self._failing("cuStreamSynchronize")

    def _cuEventDestroy(self, event):
        # A recorded event may be destroyed at once: the stream still sets it.
        return 0 if self.events.pop(event, None) is not None else CUDA_ERROR_INVALID_VALUE

    def _cuMemHostRegister(self, p, size, flags):
        self.calls.append(("register", dict(address=p, size=size, flags=flags)))
        status = self._failing("cuMemHostRegister")
        if status:
            return status
        self.registered[p] = (size, flags, self.context[-1] if self.context else 0)
        return 0

    def _cuMemHostUnregister(self, p):
        self.calls.append(("unregister", dict(address=p)))
        return 0 if self.registered.pop(p, None) else CUDA_ERROR_INVALID_VALUE

    def _cuDeviceGet(self, out, ordinal):
        out[0] = ordinal
        return 0

    def _cuDevicePrimaryCtxRetain(self, out, dev):
        out[0] = 0x1000 + dev
        self.retained[dev] = self.retained.get(dev, 0) + 1
        return 0

    def _cuDevicePrimaryCtxRelease(self, dev):
        if not self.retained.get(dev):
            return CUDA_ERROR_INVALID_VALUE  # released more often than retained
        self.retained[dev] -= 1
        return 0

    def _cuCtxPushCurrent(self, ctx):
        self.context.append(ctx)
        return 0

    def _cuCtxPopCurrent(self, out):
        out[0] = self.context.pop()
        return 0

    def _cuDeviceGetAttribute(self, out, attribute, dev):
        out[0] = self.numa if attribute == 134 else 0
        return 0

    def _cuDeviceGetPCIBusId(self, buf, length, dev):
        name = b"0000:00:00.0-not-a-device\0"
        assert length >= len(name)
        c.memmove(buf, name, len(name))
        return 0

    def _cuGetErrorString(self, status, out):
        out[0] = c.cast(self._message, c.c_void_p).value
        return 0


class HostStreamEngine(CudaCopyEngine):
    """The CUDA engine as the DMA mover uses it, on XLA:CPU: no stream comes with a CPU
    program, so a fixed stand-in handle is passed where XLA's would be."""

    uses_stream = False
    STREAM = 0x5EED

    def copy(self, sets, stream, direction="offload", out=None):
        super().copy(sets, self.STREAM, direction, out)

    def hold(self, completion, stream, word):
        super().hold(completion, self.STREAM, word)
