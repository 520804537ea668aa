"""Pallas TPU kernels: per-block DMAs between device caches and host page buffers.

Two kernels, both driven by scalar prefetch (``pltpu.PrefetchScalarGridSpec``: the
page count and the block ids live in SMEM before the body runs, so one compiled kernel
serves every request of its size):

* ``offload``: for every layer ``l`` of the kernel's layers and every page ``j < n``,
  one async copy ``cache_l[ids[j]] -> host[j, l]``, each layer on its own DMA
  semaphore; layer ``l + 1`` is started before layer ``l`` is waited for, so at most
  two layers of copies are in flight.
* ``load``: for one layer, one async copy ``host[j] -> cache[ids[j]]`` per page, into
  the cache in place (the cache is aliased to the output and donated). One call per
  layer, so each layer completes on its own.

``host`` is a page buffer: page ``j`` of the transfer is row ``j``, so the host side
of every DMA is at a static offset on TPU. libtpu (0.0.42.1, the one jax 0.10.2 pins)
refuses a DMA to or from ``pl.HOST`` memory at a *dynamic* offset for every tiling
but int8's ``(32,128)``: ``LLO_CHECK ... multiplier_in_bytes % word_size == 0``, on
v4, v5e, v5p, v6e and tpu7x alike; device-side offsets may be dynamic. A static host
offset must still be a multiple of 4 KiB (``offset_in_bytes % word_size == 0``), so
blocks whose bytes are not a multiple of 4 KiB do not compile past their first page
(``path="auto"`` never takes these kernels: it takes the pinned mover in place). So on
TPU the
kernels unroll their pages (``pages``, the bucket; each DMA guarded by ``j < n``) and
the device-side block id stays a runtime value, while in Pallas interpret mode
(``pages=None``) they loop over the ``n`` pages with the same row for each.
(Measured deviceless, v6e: one layer of 256 unrolled pages compiles in about 1 s,
8 layers x 256 pages in 9 s and 32 x 256 in 42 s, hence one layer per compiled
offload kernel; the kernel of one layer serves every layer of a class.)

Each kernel also returns ``done`` (``int32[1]`` in SMEM, ``n``), which the transfer
thread waits for: the caches may be donated to a later program long before the
copies finish, the token never is.

On TPU the host operand is in ``pl.HOST`` memory (a ``pinned_host`` array). Elsewhere
the same kernels run in Pallas TPU interpret mode (``pltpu.InterpretParams``), which
in jax 0.10.2 has no HOST memory space: the host operand is ``pl.ANY`` there and
lives in the device's default memory (host RAM on CPU). The interpreter simulates
the DMAs and semaphores; it moves bytes as numpy does, so bf16 and fp8 NaN payloads
come through unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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


def _interpret(interpret: bool) -> Any:
    return pltpu.InterpretParams() if interpret else False


def _host_space(interpret: bool) -> Any:
    return pl.ANY if interpret else pl.HOST


def _each_page(pages: int | None, n: Any, body: Callable[[Any], None]) -> None:
    """``body(j)`` for every page ``j < n``: unrolled over ``pages`` static rows (each
    guarded by ``j < n``), or with ``pages=None`` a loop whose ``j`` is a runtime value."""
    if pages is None:
        pl.loop(0, n)(body)
        return
    for j in range(pages):
        pl.when(j < n)(functools.partial(body, j))


def _offload_kernel(num_layers: int, pages: int | None, n_ref, ids_ref, *refs):
    caches = refs[:num_layers]
    host, done, sems = refs[num_layers:]

    def copies(layer: int, start: bool) -> None:
        def one(j):
            c = pltpu.make_async_copy(caches[layer].at[ids_ref[j]], host.at[j, layer],
                                      sems.at[layer])
            c.start() if start else c.wait()
        _each_page(pages, n_ref[0], one)

    copies(0, True)
    for layer in range(1, num_layers):
        copies(layer, True)
        copies(layer - 1, False)
    copies(num_layers - 1, False)
    done[0] = n_ref[0]


def _load_kernel(pages: int | None, n_ref, ids_ref, cache_in, host, cache, done, sems):
    del cache_in  # aliased to ``cache``

    def copies(start: bool) -> None:
        def one(j):
            c = pltpu.make_async_copy(host.at[j], cache.at[ids_ref[j]], sems.at[0])
            c.start() if start else c.wait()
        _each_page(pages, n_ref[0], one)

    copies(True)
    copies(False)
    done[0] = n_ref[0]


_DONE = jax.ShapeDtypeStruct((1,), np.int32)


@functools.lru_cache(maxsize=_PROGRAM_CACHE_SIZE)
def offload_program(formats: tuple, host: jax.ShapeDtypeStruct, device: Any,
                    interpret: bool | None = None, unroll: bool | None = None):
    """``f(n, ids, caches) -> (host, done)`` on ``device``: the page buffer ``host``
    (``[pages, len(formats), *block]``) filled with blocks ``ids[j]`` of every cache,
    for ``j < n``.

    ``n`` (``int32[1]``, pages to move) comes from the host and ``ids`` is the
    batch's device copy, as every caller passes them (a compiled-ahead program is
    found again only for the same argument placement). ``formats``: the caches'
    formats (pinned, so no cache is relaid out on the way in). ``interpret``: run in
    Pallas interpret mode (default: off TPU). ``unroll``: unroll the ``host.shape[0]``
    pages (default: compiled, as the TPU compiler needs) rather than loop over ``n``.
    """
    interpret = not compiled(device) if interpret is None else interpret
    num_layers = len(formats)
    pages = host.shape[0] if (not interpret if unroll is None else unroll) else None
    out = jax.ShapeDtypeStruct(host.shape, host.dtype) if interpret else \
        pl.HOST(host.shape, host.dtype)

    def kvxfer_offload(n, ids, caches):
        return pl.pallas_call(
            functools.partial(_offload_kernel, num_layers, pages),
            out_shape=(out, _DONE),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2, grid=(1,),
                in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * num_layers,
                out_specs=(pl.BlockSpec(memory_space=_host_space(interpret)),
                           pl.BlockSpec(memory_space=pltpu.SMEM)),
                scratch_shapes=[pltpu.SemaphoreType.DMA((num_layers,))]),
            interpret=_interpret(interpret), name="kvxfer_offload",
        )(n, ids, *caches)

    token = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(kvxfer_offload, in_shardings=(None, None, formats),
                   out_shardings=(host_sharding(device), token))


@functools.lru_cache(maxsize=_PROGRAM_CACHE_SIZE)
def load_program(cache_format: Any, device: Any, interpret: bool | None = None,
                 unroll: bool | None = None):
    """``f(n, ids, cache, host) -> (cache, done)``, cache donated: row ``j`` of the page
    buffer ``host`` (``[pages, *block]``) written into block ``ids[j]``, for ``j < n``.

    The cache keeps ``cache_format`` (its layout and sharding) on the way through.
    ``interpret`` and ``unroll`` as for ``offload_program``.
    """
    interpret = not compiled(device) if interpret is None else interpret
    unroll = not interpret if unroll is None else unroll

    def kvxfer_load(n, ids, cache, host):
        pages = host.shape[0] if unroll else None
        return pl.pallas_call(
            functools.partial(_load_kernel, pages),
            out_shape=(jax.ShapeDtypeStruct(cache.shape, cache.dtype), _DONE),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2, grid=(1,),
                in_specs=[pl.BlockSpec(memory_space=pl.ANY),
                          pl.BlockSpec(memory_space=_host_space(interpret))],
                out_specs=(pl.BlockSpec(memory_space=pl.ANY),
                           pl.BlockSpec(memory_space=pltpu.SMEM)),
                scratch_shapes=[pltpu.SemaphoreType.DMA((1,))]),
            input_output_aliases={2: 0},
            interpret=_interpret(interpret), name="kvxfer_load",
        )(n, ids, cache, host)

    token = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(kvxfer_load, donate_argnums=(2,),
                   in_shardings=(None, None, cache_format, None),
                   out_shardings=(cache_format, token))
