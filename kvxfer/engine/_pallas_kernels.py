"""Pallas TPU kernels: per-block DMAs between device caches and host buffers.

Two kernels, both driven by scalar prefetch (``pltpu.PrefetchScalarGridSpec``: the
block ids and host slots live in SMEM before the body runs, so one compiled kernel
serves every request of a bucket):

* ``offload``: for every layer ``l`` of a class on one device and every page ``j <
  n``, one async copy ``cache_l[ids[j]] -> host[slots[j], l]``, each layer on its own
  DMA semaphore; layer ``l + 1`` is started before layer ``l`` is waited for, so at
  most two layers of copies are in flight.
* ``load``: for one layer (``pos``), one async copy ``host[slots[j], pos] ->
  cache[ids[j]]`` per page, into the cache in place (the cache is aliased to the
  output and donated), on that layer's semaphore. One call per layer, so each layer
  completes on its own.

``host`` is either a class's host pool itself (``[slots, L, *block]``, aliased and
donated, so pages land in their slots) or a page buffer ``[b, L, *block]`` (slots
``0..b-1``). Each kernel also returns ``done`` (``int32[1]`` in SMEM, ``n``), which the
transfer thread waits for: the caches and the pool may be donated to a later program
long before the copies finish, the token never is.

On TPU the host operand is in ``pl.HOST`` memory (a ``pinned_host`` array). Elsewhere
the same kernels run in Pallas TPU interpret mode (``pltpu.InterpretParams``), which
in jax 0.10.2 has no HOST memory space: the host operand is ``pl.ANY`` there and
lives in the device's default memory (host RAM on CPU). The interpreter simulates
the DMAs and semaphores; it moves bytes as numpy does, so bf16 and fp8 NaN payloads
come through unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvxfer.engine._programs import _PROGRAM_CACHE_SIZE

__all__ = ["compiled", "host_sharding", "offload_program", "load_program", "reset_interpreter"]


def compiled(device: Any) -> bool:
    """Whether kernels run compiled on ``device`` (TPU), else in TPU interpret mode."""
    return device.platform == "tpu"


def host_sharding(device: Any) -> jax.sharding.SingleDeviceSharding:
    """Where host buffers the kernels read and write live for ``device``.

    TPU: the device's ``pinned_host`` memory, which its DMA engines reach. Interpret
    mode cannot take ``pinned_host`` operands (jax 0.10.2 fails to lower them), so
    there it is the device's default memory: host RAM on CPU.
    """
    if compiled(device):
        return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    return jax.sharding.SingleDeviceSharding(device)


def reset_interpreter() -> None:
    """Clears TPU interpret mode's state after a kernel raised (its documented rule)."""
    pltpu.reset_tpu_interpret_mode_state()


def _interpret(device_compiled: bool) -> Any:
    return False if device_compiled else pltpu.InterpretParams()


def _host_space(device_compiled: bool) -> Any:
    return pl.HOST if device_compiled else pl.ANY


def _offload_kernel(num_layers: int, aliased: bool, n_ref, ids_ref, slots_ref, *refs):
    caches = refs[:num_layers]
    host, done, sems = refs[num_layers + aliased:]

    def copies(layer: int, start: bool) -> None:
        @pl.loop(0, n_ref[0])
        def _(j):
            c = pltpu.make_async_copy(caches[layer].at[ids_ref[j]],
                                      host.at[slots_ref[j], layer], sems.at[layer])
            c.start() if start else c.wait()

    copies(0, True)
    for layer in range(1, num_layers):
        copies(layer, True)
        copies(layer - 1, False)
    copies(num_layers - 1, False)
    done[0] = n_ref[0]


def _load_kernel(meta_ref, ids_ref, slots_ref, cache_in, host, cache, done, sems):
    del cache_in  # aliased to ``cache``
    pos = meta_ref[1]

    def copies(start: bool) -> None:
        @pl.loop(0, meta_ref[0])
        def _(j):
            c = pltpu.make_async_copy(host.at[slots_ref[j], pos], cache.at[ids_ref[j]],
                                      sems.at[0])
            c.start() if start else c.wait()

    copies(True)
    copies(False)
    done[0] = meta_ref[0]


_DONE = jax.ShapeDtypeStruct((1,), np.int32)


@functools.lru_cache(maxsize=_PROGRAM_CACHE_SIZE)
def offload_program(formats: tuple, pool_format: Any, device: Any):
    """``f(n, ids, slots, caches, host) -> (host, done)`` on ``device``.

    ``n`` (``int32[1]``, pages to move) and ``slots`` are host arrays and ``ids`` the
    batch's device copy, as every caller passes them (a compiled-ahead program is
    found again only for the same argument placement).

    ``formats``: the caches' formats (pinned, so no cache is relaid out on the way in).
    ``pool_format``: the pool's format when ``host`` is the pool, written in place
    (donated, and handed back in the same format so it stays the same buffer); None
    when ``host`` is the shape of a page buffer to return (a static
    ``jax.ShapeDtypeStruct``).
    """
    on_tpu = compiled(device)
    space = _host_space(on_tpu)
    num_layers, aliased = len(formats), pool_format is not None

    def kvxfer_offload(n, ids, slots, caches, host):
        shape = jax.ShapeDtypeStruct(host.shape, host.dtype)
        if on_tpu and not aliased:
            shape = pl.HOST(host.shape, host.dtype)
        in_specs = [pl.BlockSpec(memory_space=pl.ANY)] * num_layers
        operands = list(caches)
        if aliased:
            in_specs.append(pl.BlockSpec(memory_space=space))
            operands.append(host)
        return pl.pallas_call(
            functools.partial(_offload_kernel, num_layers, aliased),
            out_shape=(shape, _DONE),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=3, grid=(1,), in_specs=in_specs,
                out_specs=(pl.BlockSpec(memory_space=space),
                           pl.BlockSpec(memory_space=pltpu.SMEM)),
                scratch_shapes=[pltpu.SemaphoreType.DMA((num_layers,))]),
            input_output_aliases={3 + num_layers: 0} if aliased else {},
            interpret=_interpret(on_tpu), name="kvxfer_offload",
        )(n, ids, slots, *operands)

    token = jax.sharding.SingleDeviceSharding(device)
    if aliased:
        return jax.jit(kvxfer_offload, donate_argnums=(4,), in_shardings=(None, None, None, formats,
                                                               pool_format),
                       out_shardings=(pool_format, token))
    return jax.jit(kvxfer_offload, static_argnums=(4,), in_shardings=(None, None, None, formats),
                   out_shardings=(host_sharding(device), token))


@functools.lru_cache(maxsize=_PROGRAM_CACHE_SIZE)
def load_program(cache_format: Any, device: Any):
    """``f(meta=[n, pos], ids, slots, cache, host) -> (cache, done)``, cache donated.

    The cache keeps ``cache_format`` (its layout and sharding) on the way through.
    """
    on_tpu = compiled(device)
    space = _host_space(on_tpu)

    def kvxfer_load(meta, ids, slots, cache, host):
        return pl.pallas_call(
            _load_kernel,
            out_shape=(jax.ShapeDtypeStruct(cache.shape, cache.dtype), _DONE),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=3, grid=(1,),
                in_specs=[pl.BlockSpec(memory_space=pl.ANY),
                          pl.BlockSpec(memory_space=space)],
                out_specs=(pl.BlockSpec(memory_space=pl.ANY),
                           pl.BlockSpec(memory_space=pltpu.SMEM)),
                scratch_shapes=[pltpu.SemaphoreType.DMA((1,))]),
            input_output_aliases={3: 0},
            interpret=_interpret(on_tpu), name="kvxfer_load",
        )(meta, ids, slots, cache, host)

    token = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(kvxfer_load, donate_argnums=(3,),
                   in_shardings=(None, None, None, cache_format, None),
                   out_shardings=(cache_format, token))
