"""The physical limit a transfer is measured against, per direction.

On CPU it is a numpy memcpy between preallocated host buffers. On GPU it is a
pinned host<->device copy: PyTorch or CuPy when importable, else ``jax.device_put``
of one large buffer in ``pinned_host`` memory. Buffers are allocated once per
limit (``capacity`` bytes) and touched, so no page faults are timed.

Example:
    >>> from kvxfer.bench import timing
    >>> with Memcpy(1 << 20) as limit:
    ...     copy = limit.runners(1 << 16)["memcpy"]
    ...     len(timing.sample(copy, 3))
    3
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import jax
import numpy as np

from kvxfer.bench.timing import now, stats

__all__ = ["Limit", "Memcpy", "TorchCopy", "CupyCopy", "JaxHostCopy", "HostKind",
           "make_limit", "limit_figures"]

#: A host memory kind ``jax.device_put`` can copy to.
HostKind = Literal["pinned_host", "unpinned_host"]


class Limit(abc.ABC):
    """Copies at the physical limit over buffers of ``capacity`` bytes, allocated once.

    ``runners(nbytes)`` gives name -> a function that copies ``nbytes`` once and
    returns its seconds: ``memcpy`` on CPU, ``d2h`` and ``h2d`` on GPU. A limit is a
    context manager that frees its buffers on exit.
    """

    #: What is copied, and how (one line, for reports).
    method: ClassVar[str] = "?"
    #: A short name of the copy (``"numpy memcpy"``).
    label: str = "?"

    def __init__(self, capacity: int):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"Expected a positive byte count for capacity. Got {capacity!r} "
                             f"of type {type(capacity).__name__}")
        self.capacity = capacity

    def _check(self, nbytes: int) -> None:
        if not 0 < nbytes <= self.capacity:
            raise ValueError(f"nbytes={nbytes} must be in [1, capacity={self.capacity}]")

    @abc.abstractmethod
    def runners(self, nbytes: int) -> dict[str, Callable[[], float]]:
        """Copy functions for ``nbytes`` (at most ``capacity``), each returning seconds."""

    def close(self) -> None:
        """Frees the buffers."""

    def __enter__(self) -> Limit:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Memcpy(Limit):
    """A numpy memcpy between two preallocated host buffers (the CPU's limit).

    Example:
        >>> with Memcpy(1024) as limit:
        ...     sorted(limit.runners(512)), limit.runners(512)["memcpy"]() > 0
        (['memcpy'], True)
    """

    method = "numpy memcpy between preallocated host buffers (np.copyto)"
    label = "numpy memcpy"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.src = np.ones(capacity, np.uint8)
        self.dst = np.ones(capacity, np.uint8)  # touched, so no page faults are timed

    def runners(self, nbytes: int) -> dict[str, Callable[[], float]]:
        self._check(nbytes)
        src, dst = self.src[:nbytes], self.dst[:nbytes]

        def copy() -> float:
            t0 = now()
            np.copyto(dst, src)
            return now() - t0

        return {"memcpy": copy}


class TorchCopy(Limit):
    """``torch`` pinned host <-> device ``copy_`` (raises where torch has no CUDA)."""

    method = "torch pinned host<->device copy_ (non_blocking, then synchronize)"
    label = "torch pinned copies"

    def __init__(self, capacity: int):
        import torch

        super().__init__(capacity)
        if not torch.cuda.is_available():
            raise RuntimeError("torch has no CUDA")
        self.torch = torch
        index = getattr(jax.devices()[0], "local_hardware_id", None) or 0
        self.host = torch.ones(capacity, dtype=torch.uint8).pin_memory()
        self.dev = torch.ones(capacity, dtype=torch.uint8, device=f"cuda:{index}")
        torch.cuda.synchronize()

    def _time(self, dst: Any, src: Any) -> float:
        t0 = now()
        dst.copy_(src, non_blocking=True)
        self.torch.cuda.synchronize()
        return now() - t0

    def runners(self, nbytes: int) -> dict[str, Callable[[], float]]:
        self._check(nbytes)
        host, dev = self.host[:nbytes], self.dev[:nbytes]
        return {"d2h": lambda: self._time(host, dev), "h2d": lambda: self._time(dev, host)}

    def close(self) -> None:
        if hasattr(self, "host"):
            del self.host, self.dev
            self.torch.cuda.empty_cache()


class CupyCopy(Limit):
    """CuPy pinned host <-> device copies (raises where CuPy is missing or has no GPU)."""

    method = "cupy pinned host<->device copy (then synchronize)"
    label = "cupy pinned copies"

    def __init__(self, capacity: int):
        import cupy
        import cupyx

        super().__init__(capacity)
        self.cp = cupy
        self.host = cupyx.empty_pinned((capacity,), dtype=np.uint8)
        self.host[:] = 1
        self.dev = cupy.ones((capacity,), dtype=cupy.uint8)
        cupy.cuda.Device().synchronize()

    def runners(self, nbytes: int) -> dict[str, Callable[[], float]]:
        self._check(nbytes)
        host, dev, sync = self.host[:nbytes], self.dev[:nbytes], self.cp.cuda.Device().synchronize

        def d2h() -> float:
            t0 = now()
            dev.get(out=host)
            sync()
            return now() - t0

        def h2d() -> float:
            t0 = now()
            dev.set(host)
            sync()
            return now() - t0

        return {"d2h": d2h, "h2d": h2d}

    def close(self) -> None:
        if hasattr(self, "host"):
            del self.host, self.dev
            self.cp.get_default_memory_pool().free_all_blocks()


class JaxHostCopy(Limit):
    """``jax.device_put`` of one buffer between device memory and a host memory kind.

    Args:
      capacity: the largest copy, in bytes.
      host_kind: the host memory kind; by default ``pinned_host`` where the device
        offers it, else ``unpinned_host``. Where it offers neither (``None``), the
        copies are ``np.array`` of a device array and ``jax.device_put`` of a numpy one.

    Example:
        >>> limit = JaxHostCopy(1 << 16, host_kind="pinned_host")
        >>> limit.label
        'jax.device_put to/from pinned_host'
        >>> with limit:
        ...     all(copy() > 0 for copy in limit.runners(1 << 12).values())
        True
    """

    method = "jax.device_put of one host buffer (to device memory and back)"

    def __init__(self, capacity: int, host_kind: HostKind | None | Literal["auto"] = "auto"):
        super().__init__(capacity)
        self.device = jax.devices()[0]
        offered = {m.kind for m in self.device.addressable_memories()}
        if host_kind == "auto":
            host_kind = next((k for k in ("pinned_host", "unpinned_host") if k in offered),
                             None)
        elif host_kind is not None and host_kind not in offered:
            raise ValueError(f"Expected a host memory kind {self.device} offers "
                             f"({', '.join(sorted(offered))}). Got {host_kind!r}")
        self.host_kind: HostKind | None = host_kind
        self.label = (f"jax.device_put to/from {host_kind}" if host_kind is not None else
                      "np.asarray / jax.device_put (no host memory kinds offered)")
        self._arrays: tuple[Any, Any] | None = None

    def runners(self, nbytes: int) -> dict[str, Callable[[], float]]:
        self._check(nbytes)
        self.close()  # JAX arrays cannot be sliced without a copy: one pair per size
        dev = self.device
        if self.host_kind is None:
            host_np = np.ones(nbytes, np.uint8)
            on_dev = jax.device_put(host_np, dev).block_until_ready()
            self._arrays = (host_np, on_dev)

            def d2h() -> float:
                t0 = now()
                np.array(on_dev)  # a copy: on CPU np.asarray may only view the buffer
                return now() - t0

            def h2d() -> float:
                t0 = now()
                jax.device_put(host_np, dev).block_until_ready()
                return now() - t0

            return {"d2h": d2h, "h2d": h2d}
        on_host = jax.sharding.SingleDeviceSharding(dev, memory_kind=self.host_kind)
        on_device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        host = jax.device_put(np.ones(nbytes, np.uint8), on_host)
        device = jax.device_put(host, on_device)
        jax.block_until_ready((host, device))
        self._arrays = (host, device)

        def put(x: jax.Array, sharding: jax.sharding.Sharding) -> float:
            t0 = now()
            jax.device_put(x, sharding).block_until_ready()
            return now() - t0

        return {"d2h": lambda: put(device, on_host), "h2d": lambda: put(host, on_device)}

    def close(self) -> None:
        if self._arrays is not None:
            for a in self._arrays:
                if isinstance(a, jax.Array):
                    a.delete()
            self._arrays = None


def make_limit(capacity: int, platform: str | None = None) -> Limit:
    """The limit of this machine: ``Memcpy`` off GPU; on GPU the first pinned copy that works.

    Args:
      capacity: the largest copy, in bytes.
      platform: the JAX platform (default: that of the first device).

    Raises:
      RuntimeError: on GPU, when no pinned copy works (each reason is named).

    Example:
        >>> with make_limit(1 << 20, "cpu") as limit:
        ...     type(limit).__name__
        'Memcpy'
    """
    platform = platform or jax.devices()[0].platform
    if platform != "gpu":
        return Memcpy(capacity)
    errors = []
    for kind in (TorchCopy, CupyCopy, JaxHostCopy):
        try:
            return kind(capacity)
        except Exception as e:  # not importable, or no CUDA in it: the next one
            errors.append(f"{kind.__name__}: {type(e).__name__}: {e}")
    raise RuntimeError("no pinned host<->device copy works here: " + "; ".join(errors))


def limit_figures(timings: dict[str, dict[str, list[float]]], nbytes: int
                  ) -> dict[str, dict[str, Any]]:
    """``{"d2h": stats, "h2d": stats}`` from the runners' timings (on CPU, one memcpy both).

    Example:
        >>> lim = limit_figures({"memcpy": {"s": [0.5, 0.25]}}, 10**9)
        >>> lim["d2h"]["gbps"], lim["h2d"] is lim["d2h"]
        (4.0, True)
    """
    if "memcpy" in timings:
        s = stats(timings["memcpy"]["s"], nbytes)
        return {"d2h": s, "h2d": s}
    return {d: stats(timings[d]["s"], nbytes) for d in ("d2h", "h2d")}
