"""The real XLA:TPU compiler as a layout source, on any machine.

A KV cache's layout on a TPU is the compiler's choice: by shape, dtype, shard shape
and even block count (a cache whose minor dim is under 128 gets its block dim moved
minor-most once it has enough blocks). libtpu, the compiler jax's ``tpu`` extra
installs (``pip install 'kvxfer[tpu]'``), compiles for a TPU topology without a TPU
(``jax.experimental.topologies``), with ``JAX_PLATFORMS=cpu`` keeping the runtime on
the CPU. This module asks it: it compiles a donated one-block update of the array,
laid out and sharded as an engine holds it, and reads the layout the compiler chose
for the output (per shard: each device lays out its own shard).

Targets are a TPU generation (``v4``, ``v5e``, ``v5p``, ``v6e``, ``tpu7x``: the
smallest topology a host allows with enough devices) or a topology name
(``"v6e:2x4"``).

Example (with the ``tpu`` extra installed, as CI has it):
    >>> from kvxfer import tpu
    >>> c = tpu.compiled_layout((512, 3, 2048), "bfloat16", "v6e")
    >>> str(c.layout), c.geometry().addressable, c.target
    ('{2,0,1:T(8,128)(2,1)}', False, 'v6e:2x2')
    >>> c = tpu.compiled_layout((4096, 16, 2, 8, 128), "bf16", "tpu7x", num_devices=4,
    ...                         shard_dim=3)
    >>> c.shard_shape, str(c.layout), c.geometry().bytes_per_block
    ((4096, 16, 2, 2, 128), '{4,3,2,1,0:T(2,128)(2,1)}', 16384)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import math
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from kvxfer._check import check_int
from kvxfer._names import GENERATIONS
from kvxfer._worker import Worker
from kvxfer.layout import Layout, SliceGeometry, dtype_name, dtype_of, inspect, shape_text

__all__ = ["GENERATIONS", "CompilerUnavailableError", "CompiledLayout", "available",
           "libtpu_version", "require_compiler", "topology", "target_devices",
           "compiled_layout", "compiled_geometry", "addressable_alternatives",
           "INSTALL_HINT", "LIBTPU_ENVIRONMENT", "libtpu_environment", "compile_worker"]


# Topologies one host's bounds allow, smallest first, with their device counts (v4
# and tpu7x chips hold two TensorCores, each one device).
_TOPOLOGIES: dict[str, tuple[tuple[str, int], ...]] = {
    "v4": (("v4:2x2x1", 8), ("v4:2x2x2", 16)),
    "v5e": (("v5e:2x2", 4), ("v5e:2x4", 8), ("v5e:4x4", 16)),
    "v5p": (("v5p:2x2x1", 4), ("v5p:2x2x2", 8)),
    "v6e": (("v6e:2x2", 4), ("v6e:2x4", 8)),
    "tpu7x": (("tpu7x:2x2x1", 8), ("tpu7x:2x2x2", 16)),
}

INSTALL_HINT = ("the TPU compiler (libtpu) is not installed: pip install 'kvxfer[tpu]' "
                "(jax's own tpu extra at the installed jax version)")


class CompilerUnavailableError(RuntimeError):
    """libtpu is not installed (or does not load): no TPU compile is possible here."""


def available() -> bool:
    """Whether libtpu is installed, so TPU programs can be compiled here.

    Example:
        >>> isinstance(available(), bool)
        True
    """
    return importlib.util.find_spec("libtpu") is not None


def libtpu_version() -> str | None:
    """The installed libtpu's version, or None."""
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_compiler() -> str:
    """The libtpu version; raises ``CompilerUnavailableError`` (naming the extra) if none.

    Example:
        >>> try:
        ...     version = require_compiler()
        ... except CompilerUnavailableError as e:
        ...     version = None
        ...     assert "kvxfer[tpu]" in str(e)
    """
    version = libtpu_version()
    if version is None or not available():
        raise CompilerUnavailableError(INSTALL_HINT)
    return version


def topology(target: str, num_devices: int = 1) -> str:
    """The topology name ``target`` means for ``num_devices`` devices.

    Args:
      target: a generation (``"v6e"``: its smallest topology with enough devices) or
        a topology name (``"v6e:2x4"``, used as given).
      num_devices: devices the caches are spread over.

    Raises:
      ValueError: an unknown generation, or more devices than its topologies hold.

    Example:
        >>> topology("v6e"), topology("v6e", 8), topology("tpu7x:2x2x2")
        ('v6e:2x2', 'v6e:2x4', 'tpu7x:2x2x2')
    """
    num_devices = check_int(num_devices, "num_devices", minimum=1)
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"target={target!r} must name a TPU generation "
                         f"({', '.join(GENERATIONS)}) or a topology such as 'v6e:2x2'")
    target = target.strip()
    generation, _, shape = target.partition(":")
    if generation not in _TOPOLOGIES:
        raise ValueError(f"target={target!r}: unknown TPU generation {generation!r}; "
                         f"expected one of {', '.join(GENERATIONS)}, optionally with a "
                         "topology (e.g. 'v6e:2x4')")
    if shape:
        return target
    for name, count in _TOPOLOGIES[generation]:
        if count >= num_devices:
            return name
    most = _TOPOLOGIES[generation][-1]
    raise ValueError(f"num_devices={num_devices}: the largest {generation} topology "
                     f"compiled for here ({most[0]}) has {most[1]} devices")


_DEVICES_LOCK = threading.Lock()


#: What libtpu reads while it starts for a deviceless compile, set only for that call
#: (``libtpu_environment``): where to find its hosts (it needs none, and without them
#: it prints start-up errors), and leave to share its machine-wide lock file (compiling
#: for a TPU claims no chip, so several processes may compile at once).
LIBTPU_ENVIRONMENT = {"TPU_ACCELERATOR_TYPE": "v6e-4", "TPU_WORKER_HOSTNAMES": "localhost",
                      "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}

_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def libtpu_environment() -> Iterator[None]:
    """Sets ``LIBTPU_ENVIRONMENT``'s variables the caller has not set, for the duration
    of the block only: kvxfer leaves nothing in the caller's environment.

    Example:
        >>> import os
        >>> before = os.environ.get("TPU_WORKER_HOSTNAMES")
        >>> with libtpu_environment():
        ...     inside = os.environ["TPU_WORKER_HOSTNAMES"]
        >>> inside == (before or "localhost"), os.environ.get("TPU_WORKER_HOSTNAMES") == before
        (True, True)
    """
    with _ENV_LOCK:
        added = [k for k in LIBTPU_ENVIRONMENT if k not in os.environ]
        for k in added:
            os.environ[k] = LIBTPU_ENVIRONMENT[k]
    try:
        yield
    finally:
        with _ENV_LOCK:
            for k in added:
                os.environ.pop(k, None)


def _start_compile_worker(environ: dict[str, str]) -> None:
    """Runs first in a compile worker: its own environment, JAX on the CPU (the worker
    compiles for a TPU; it must never claim one the caller's process may hold)."""
    os.environ.update(environ)
    import sys

    if "jax" in sys.modules:  # imported with the spawning script, before this ran
        sys.modules["jax"].config.update("jax_platforms", "cpu")


def compile_worker() -> Worker:
    """A ``kvxfer._worker.Worker`` for deviceless TPU compiles: libtpu loads there, with
    ``LIBTPU_ENVIRONMENT`` (where the caller has not set its own values) and
    ``JAX_PLATFORMS=cpu`` set in the worker's environment only, and a libtpu abort ends
    the worker, not the caller.

    Example:
        >>> import os
        >>> with compile_worker() as w:
        ...     seen = w.call(os.getenv, "JAX_PLATFORMS")
        >>> seen, "TPU_WORKER_HOSTNAMES" in os.environ
        ('cpu', False)
    """
    environ = {**LIBTPU_ENVIRONMENT, **{k: os.environ[k] for k in LIBTPU_ENVIRONMENT
                                        if k in os.environ}, "JAX_PLATFORMS": "cpu"}
    return Worker(_start_compile_worker, environ)


@functools.lru_cache(maxsize=16)
def _topology_devices(name: str) -> tuple[Any, ...]:
    from jax.experimental import topologies

    try:
        with libtpu_environment():  # libtpu reads it as it starts, here
            return tuple(topologies.get_topology_desc(name, "tpu").devices)
    except Exception as e:  # noqa: BLE001 - libtpu's own errors carry no common type
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"target topology {name!r}: libtpu refused it ({text})") from None


def target_devices(target: str, num_devices: int = 1) -> list[Any]:
    """``num_devices`` deviceless TPU devices of ``target`` (for ``jit(...).lower``).

    Raises:
      CompilerUnavailableError: libtpu is not installed.
      ValueError: an unknown target, or too many devices.
    """
    require_compiler()
    name = topology(target, num_devices)
    with _DEVICES_LOCK:
        devices = _topology_devices(name)
    if len(devices) < num_devices:
        raise ValueError(f"num_devices={num_devices}: topology {name!r} has "
                         f"{len(devices)} devices")
    return list(devices[:num_devices])


@dataclasses.dataclass(frozen=True, slots=True)
class CompiledLayout:
    """The layout the TPU compiler chose for one array, per shard.

    Attributes:
      shape: the global array shape, block dim first.
      dtype: dtype name.
      target: the topology compiled for (``"v6e:2x2"``).
      device_kind: what libtpu calls the chip (``"TPU v6 lite"``).
      num_devices: devices the array is spread over.
      shard_dim: the dim split over them (None: replicated).
      shard_shape: one shard's shape (the whole shape when not split).
      layout: the compiler's layout of one shard.
      libtpu: the compiler's version.
    """

    shape: tuple[int, ...]
    dtype: str
    target: str
    device_kind: str
    num_devices: int
    shard_dim: int | None
    shard_shape: tuple[int, ...]
    layout: Layout
    libtpu: str

    def geometry(self) -> SliceGeometry:
        """The inspector's verdict on one shard under the compiler's layout."""
        return inspect(self.shard_shape, self.dtype, self.layout)

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` object: where the layout came from and the verdict."""
        g = self.geometry()
        return {"shape": list(self.shape), "dtype": self.dtype, "devices": self.num_devices,
                "shard_dim": self.shard_dim, "shard_shape": list(self.shard_shape),
                "layout": str(self.layout), "addressable": g.addressable,
                "granularity": g.granularity, "bytes_per_block": g.bytes_per_block,
                "padding_factor": g.padding_factor, "layout_source": "compiler",
                "target": self.target, "device_kind": self.device_kind,
                "libtpu": self.libtpu}


def _check_request(shape: Sequence[int], dtype: Any, num_devices: int,
                   shard_dim: int | None) -> tuple[tuple[int, ...], str, int, int | None]:
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"shape={shape!r} must be a sequence of ints")
    shape = tuple(check_int(d, f"shape[{i}]", minimum=1) for i, d in enumerate(shape))
    if not shape:
        raise ValueError("shape=() has no block dim")
    dtype = dtype_name(dtype)
    num_devices = check_int(num_devices, "num_devices", minimum=1)
    if shard_dim is not None:
        shard_dim = check_int(shard_dim, "shard_dim", minimum=1)
        if shard_dim >= len(shape):
            raise ValueError(f"shard_dim={shard_dim} is out of range for shape "
                             f"{list(shape)}; use 1..{len(shape) - 1} (dim 0 is the "
                             "block dim, never split)")
        if num_devices > 1 and shape[shard_dim] % num_devices:
            raise ValueError(f"shard_dim={shard_dim} of shape {list(shape)} "
                             f"({shape[shard_dim]}) does not divide over "
                             f"{num_devices} devices")
    if num_devices == 1:
        shard_dim = None
    # The compiler itself would take any size; the program kvxfer compiles holds one
    # block, so bound what a request may ask it to reason about (2**40 elements).
    if math.prod(shape) > 2**40:
        raise ValueError(f"shape {list(shape)} has {math.prod(shape)} elements, more than "
                         "any KV cache (at most 2**40)")
    return shape, dtype, num_devices, shard_dim


_COMPILE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4096)
def _compile(shape: tuple[int, ...], dtype: str, name: str, num_devices: int,
             shard_dim: int | None) -> tuple[Layout, str]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = _topology_devices(name)[:num_devices]
    mesh = Mesh(np.array(devices), ("kv",))
    spec = PartitionSpec() if shard_dim is None else \
        PartitionSpec(*([None] * shard_dim), "kv")
    sharding = NamedSharding(mesh, spec)
    dt = dtype_of(dtype)
    block = jax.ShapeDtypeStruct((1, *shape[1:]), dt, sharding=sharding)

    def one_block_update(cache, block):
        return jax.lax.dynamic_update_slice_in_dim(cache, block, 0, axis=0)

    program = jax.jit(one_block_update, donate_argnums=0, out_shardings=sharding)
    compiled = program.lower(jax.ShapeDtypeStruct(shape, dt, sharding=sharding),
                             block).compile()
    return Layout.of(compiled.output_formats), devices[0].device_kind


def compiled_layout(shape: Sequence[int], dtype: Any, target: str, *, num_devices: int = 1,
                    shard_dim: int | None = None) -> CompiledLayout:
    """The layout the TPU compiler gives an array, per shard.

    Compiles (deviceless, once per process for each question) a donated one-block
    update of a ``[blocks, ...]`` array on ``num_devices`` devices of ``target``,
    split along ``shard_dim`` (None: replicated), and reads the output's layout.

    Args:
      shape: the global shape, block dim first.
      dtype: any dtype name kvxfer accepts (bf16, float8_e4m3fn, int8, int4, ...).
      target: a TPU generation or topology (see ``topology``).
      num_devices: devices the array is spread over.
      shard_dim: the dim split over them (kv heads, say); never 0.

    Raises:
      CompilerUnavailableError: libtpu is not installed.
      ValueError, TypeError: a bad argument, naming it; a shape the compiler refuses.
    """
    shape, dtype, num_devices, shard_dim = _check_request(shape, dtype, num_devices,
                                                          shard_dim)
    version = require_compiler()
    name = topology(target, num_devices)
    with _DEVICES_LOCK:
        _topology_devices(name)
    with _COMPILE_LOCK:
        try:
            layout, kind = _compile(shape, dtype, name, num_devices, shard_dim)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - XLA's errors carry no common type
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"the TPU compiler ({name}) refused "
                             f"{shape_text(shape, dtype)}: {text}") from None
    shard_shape = list(shape)
    if shard_dim is not None:
        shard_shape[shard_dim] //= num_devices
    return CompiledLayout(shape, dtype, name, kind, num_devices, shard_dim,
                          tuple(shard_shape), layout, version)


def compiled_geometry(shape: Sequence[int], dtype: Any, target: str, *, num_devices: int = 1,
                      shard_dim: int | None = None) -> SliceGeometry:
    """``compiled_layout(...).geometry()``: the verdict on one shard."""
    return compiled_layout(shape, dtype, target, num_devices=num_devices,
                           shard_dim=shard_dim).geometry()


def addressable_alternatives(shape: Sequence[int], dtype: Any, target: str, *,
                             num_devices: int = 1, shard_dim: int | None = None,
                             ) -> list[tuple[tuple[int, ...], CompiledLayout]]:
    """Nearby shapes whose blocks the compiler lays out addressably, best first.

    For a cache whose blocks are not contiguous under the compiler's choice: the
    minor dim padded to a multiple of 128 (the lane width, so the compiler has no
    padding to avoid by moving the block dim), a unit dim after the block dim (the
    form vLLM TPU gives its MLA cache, ``[N, 1, 16, 640]`` for 16 tokens of 576), and
    both. Each candidate is compiled like the original, at the same block count;
    those whose blocks are addressable are returned, least padding first.

    Raises:
      As ``compiled_layout``.
    """
    shape, dtype, num_devices, shard_dim = _check_request(shape, dtype, num_devices,
                                                          shard_dim)
    padded = (*shape[:-1], -(-shape[-1] // 128) * 128)
    candidates = [padded, (shape[0], 1, *shape[1:]), (padded[0], 1, *padded[1:])]
    out = []
    seen = {shape}
    for cand in candidates:
        if cand in seen or len(cand) < 2:
            continue
        seen.add(cand)
        sd = None if shard_dim is None else shard_dim + (len(cand) - len(shape))
        c = compiled_layout(cand, dtype, target, num_devices=num_devices, shard_dim=sd)
        if c.geometry().addressable:
            out.append((cand, c))
    out.sort(key=lambda item: item[1].geometry().padding_factor)
    return out
