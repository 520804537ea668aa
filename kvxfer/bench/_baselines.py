"""What users write today to move KV pages without kvxfer, timed like kvxfer is.

The plain-JAX routes (``JaxRoutes``) are what an engine writes with JAX alone and the
same kind of on-device digest: one batched gather to ``pinned_host`` memory, and a
``device_put`` back plus one donated scatter. They run interleaved with kvxfer's
variants, as the figures kvxfer must beat on an accelerator.

Offloads: a per-page ``jax.device_get`` loop; a per-page jitted gather then
``jax.device_put`` to ``pinned_host``; one batched jitted gather then ``device_put``
to ``pinned_host``. Loads: a per-page ``jax.device_put`` of the host blocks then a
jitted donated scatter; one batched ``device_put`` then one donated scatter. A
per-page step moves one page: the block at one index of every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvxfer import integrity
from kvxfer.bench._config import BenchConfig
from kvxfer.bench._rig import Rig
from kvxfer.bench.timing import no_gc, now, per_page_loop, sample, stats

__all__ = ["OFFLOAD_BASELINES", "LOAD_BASELINES", "offload_baselines", "load_baselines",
           "host_pages", "put_scatter", "JAX_ROUTES", "JaxRoutes"]

#: Report names of the user offload baselines (per page, per page, batched).
OFFLOAD_BASELINES = ("user_device_get", "user_gather_pinned", "user_batched_gather_pinned")
#: Report names of the user load baselines (per page, batched).
LOAD_BASELINES = ("user_put_scatter", "user_batched_put_scatter")


def _pinned_sharding() -> jax.sharding.Sharding:
    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    kind = "pinned_host" if "pinned_host" in kinds else None
    return jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)


def _stack_gather(cs: tuple[jax.Array, ...], i: Any) -> jax.Array:
    return jnp.stack([c[i] for c in cs])


def _scatter(cs: tuple[jax.Array, ...], i: Any, us: Sequence[jax.Array]
             ) -> tuple[jax.Array, ...]:
    return tuple(c.at[i].set(u) for c, u in zip(cs, us))


def offload_baselines(rig: Rig, ids: Sequence[int], cfg: BenchConfig, batched: bool
                      ) -> dict[str, dict[str, Any]]:
    """The user offloads of pages ``ids`` of ``rig.caches``: name -> stats."""
    arrays = tuple(rig.caches)
    page_bytes = sum(int(c.nbytes) // c.shape[0] for c in arrays)
    pinned = _pinned_sharding()

    def device_get(b: int) -> list[np.ndarray]:
        return [jax.device_get(c[b]) for c in arrays]

    out = {"user_device_get": per_page_loop(device_get, lambda outs: None, ids, page_bytes,
                                            cfg.baseline_budget_s, cfg.repeats)}
    gather_one = jax.jit(_stack_gather)
    out["user_gather_pinned"] = per_page_loop(
        lambda b: jax.device_put(gather_one(arrays, b), pinned), jax.block_until_ready,
        ids, page_bytes, cfg.baseline_budget_s, cfg.repeats)
    if not batched:
        return out
    ids_d = jnp.asarray(np.asarray(ids, np.int32))
    # Compiled ahead: a warm-up run of this slow gather would cost as much as a sample.
    gather = jax.jit(_stack_gather).lower(arrays, ids_d).compile()

    def batched_run() -> float:
        t0 = now()
        jax.device_put(gather(arrays, ids_d), pinned).block_until_ready()
        return now() - t0

    out["user_batched_gather_pinned"] = _batched(batched_run, len(ids) * page_bytes, cfg)
    return out


def _batched(run: Callable[[], float], nbytes: int, cfg: BenchConfig) -> dict[str, Any]:
    """Stats of a batched baseline: samples until ``repeats`` or the budget, no warm-up."""
    with no_gc():
        return stats(sample(run, cfg.repeats, budget_s=cfg.baseline_budget_s), nbytes)


def host_pages(caches: Sequence[jax.Array], ids: Sequence[int]) -> list[np.ndarray]:
    """Host copies of blocks ``ids`` of every layer (what a user's offload kept)."""
    idx = np.asarray(ids, np.int32)
    return [np.array(c[idx]) for c in caches]


def put_scatter(rig: Rig, host: Sequence[np.ndarray], ids: Sequence[int]
                ) -> Callable[[], float]:
    """A user's batched load into ``rig.caches``: returns a run that gives its seconds.

    Each run puts every layer's host blocks on the device, then writes them into the
    caches with one jitted scatter that donates the caches (compiled ahead).
    """
    ids_np = np.asarray(ids, np.int32)
    updates = [jax.ShapeDtypeStruct(h.shape, h.dtype) for h in host]
    scatter = jax.jit(_scatter, donate_argnums=0).lower(tuple(rig.caches), ids_np,
                                                         updates).compile()

    def run() -> float:
        t0 = now()
        us = [jax.device_put(h) for h in host]
        rig.caches = list(jax.block_until_ready(scatter(tuple(rig.caches), ids_np, us)))
        return now() - t0

    return run


def load_baselines(rig: Rig, ids: Sequence[int], cfg: BenchConfig, batched: bool
                   ) -> dict[str, dict[str, Any]]:
    """The user loads of pages ``ids`` into ``rig.caches`` (replaced): name -> stats."""
    host = host_pages(rig.caches, ids)
    page_bytes = sum(int(h.nbytes) for h in host) // len(ids)
    scatter_one = jax.jit(_scatter, donate_argnums=0)

    def put_one(j: int) -> None:
        us = [jax.device_put(h[j]) for h in host]
        rig.caches = list(scatter_one(tuple(rig.caches), ids[j], us))

    out = {"user_put_scatter": per_page_loop(
        put_one, lambda outs: jax.block_until_ready(rig.caches), range(len(ids)),
        page_bytes, cfg.baseline_budget_s, cfg.repeats)}
    if batched:
        out["user_batched_put_scatter"] = _batched(put_scatter(rig, host, ids),
                                                   len(ids) * page_bytes, cfg)
    return out


#: Report names of the plain-JAX routes (offload, load): what an engine writes with JAX
#: alone, digests on the device as kvxfer makes them.
JAX_ROUTES = ("jax_gather_pinned", "jax_put_scatter")


def _page_rows(cs: tuple[jax.Array, ...], i: jax.Array) -> jax.Array:
    """Pages ``i`` page-major: each page's layers side by side, as raw words."""
    return jnp.concatenate([integrity.as_words(c[i], batch_dims=1) for c in cs], axis=1)


def _digest_rows(rows: jax.Array) -> jax.Array:
    return integrity.digest(rows, jnp.zeros((rows.shape[0], integrity.IDENTITY_WORDS),
                                            jnp.uint32))


def _from_words(w: jax.Array, dtype: Any, shape: tuple[int, ...]) -> jax.Array:
    """``uint32[k, n]`` words back to ``dtype[k, *shape]`` (blocks of whole words)."""
    size, k = jnp.dtype(dtype).itemsize, w.shape[0]
    if size > 4:
        w = w.reshape(k, -1, size // 4)
    return jax.lax.bitcast_convert_type(w, dtype).reshape((k, *shape))


class JaxRoutes:
    """The plain-JAX routes over ``rig.caches`` for pages ``ids``, one program each way.

    * offload: one jit gathers the pages page-major on the device, digests them there
      and returns the gathered buffer in ``pinned_host`` memory (``out_shardings``);
    * load: ``device_put`` of that buffer back to the device, then one jit that
      scatters it into the donated caches and digests the landed blocks.

    Where the backend has no ``pinned_host`` memory kind, the buffer stays on the device.
    The load reads what the last offload wrote; both are compiled ahead.
    """

    def __init__(self, rig: Rig, ids: Sequence[int]):
        self._rig = rig
        self._ids = jnp.asarray(np.asarray(ids, np.int32))
        dev = jax.devices()[0]
        self._pinned = _pinned_sharding()
        self._device = jax.sharding.SingleDeviceSharding(dev)
        arrays = tuple(rig.caches)
        shapes = [c.shape[1:] for c in arrays]
        dtypes = [c.dtype for c in arrays]

        def gather(cs, i):
            rows = _page_rows(cs, i)
            return rows, _digest_rows(rows)

        def scatter(cs, i, rows):
            out, at = [], 0
            for c, shape, dtype in zip(cs, shapes, dtypes):
                n = integrity.as_words(c[:1], batch_dims=1).shape[1]
                out.append(c.at[i].set(_from_words(rows[:, at:at + n], dtype, shape)))
                at += n
            return tuple(out), _digest_rows(_page_rows(tuple(out), i))

        self._gather = jax.jit(gather, out_shardings=(self._pinned, None)).lower(
            arrays, self._ids).compile()
        rows = jax.ShapeDtypeStruct((len(ids), sum(
            integrity.as_words(c[:1], batch_dims=1).shape[1] for c in arrays)), jnp.uint32)
        self._scatter = jax.jit(scatter, donate_argnums=0).lower(arrays, self._ids,
                                                                 rows).compile()
        self._rows: jax.Array | None = None

    def offload(self) -> float:
        t0 = now()
        self._rows, d = self._gather(tuple(self._rig.caches), self._ids)
        jax.block_until_ready((self._rows, d))
        return now() - t0

    def load(self) -> float:
        t0 = now()
        rows = jax.device_put(self._rows, self._device)
        out, d = self._scatter(tuple(self._rig.caches), self._ids, rows)
        self._rig.caches = list(jax.block_until_ready(out))
        d.block_until_ready()
        return now() - t0
