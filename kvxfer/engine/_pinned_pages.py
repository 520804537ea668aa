"""The pinned mover's pure-JAX route: pages leave as arrays of pinned host memory.

For accelerators kvxfer drives no copy engine on (GPUs without ``cuda-bindings``, and
TPU classes the Pallas kernels cannot move), with nothing copied on the host and no
arithmetic on host memory (XLA would turn it into host compute):

* **offload**: one program per shard and bucket gathers the transfer's pages on the
  device, page-major (each page's layers side by side, as a shard-major slot holds
  that shard's part), digests them there, and returns each page as an array in the
  ``pinned_host`` memory of the shard's device. That array becomes the shard's part of
  the page's storage (``PageArrays``): no copy into a pool.
* **load**: the pages' arrays are moved to each replica's device with one batched
  ``device_put`` (staged, so ``prefetch`` can do it from any thread), then one program
  per shard replica and bucket writes them into the donated caches, one scatter per
  layer, and digests the landed blocks on the device.

Every program is enqueued on the caller's thread; several transfers may be in flight.
XLA allocates the pages in its ``pinned_host`` memory, which it caps (64 GB by default
on GPU); the DMA mover's pool is allocated outside XLA instead.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvxfer._pagearrays import PageArrays
from kvxfer.engine._batch import assemble, device_of, layer_nums
from kvxfer.engine._mover import (LoadDone, LoadRequest, Mover, Pending, WaitsOnce,
                                  _args_abstract, _sds)
from kvxfer.engine import _programs
from kvxfer.engine._programs import (_UINT, _digest_impl, compile_ahead, page_loops,
                                     page_rows, register_kind, scatter_rows)
from kvxfer.engine._raw import private_layers
from kvxfer.hostpool import word_bytes

__all__ = ["PinnedPagesMover"]


def _pinned(device: Any) -> jax.sharding.SingleDeviceSharding:
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def _offload_impl(arrays, ids, count, *digest, raw: bool, unit: int, loop: bool):
    # Gathered and digested on the device; each page's row goes out to pinned memory
    # as an output of its own (``out_shardings``): movement only.
    rows = page_rows(arrays, ids, raw, unit)
    pages = tuple(rows[j] for j in range(rows.shape[0]))
    if not digest:
        return pages
    base, nums = digest
    return pages, _digest_impl(arrays, ids, base, nums, count, raw=raw, loop=loop)


def _load_impl(arrays, pages, ids, count, *digest, raw: bool, unit: int, loop: bool):
    # ``pages`` are on the device already (staged): one scatter per layer writes them
    # into the donated caches; entries past ``count`` go out of range and are dropped.
    rows = jnp.stack(pages)
    out = scatter_rows(arrays, rows, ids, count, raw, unit)
    out, done = jax.lax.optimization_barrier((tuple(out), rows[0, 0]))  # after every write
    if not digest:
        return out, done
    base, nums = digest
    return out, done, _digest_impl(out, ids, base, nums, count, raw=raw, loop=loop)


def _offload_parts(formats: tuple, raw: bool, with_digest: bool, options: tuple):
    unit, loop, b, pinned = options
    return (functools.partial(_offload_impl, raw=raw, unit=unit, loop=loop),
            dict(in_shardings=(formats, None, None) + (None, None) * with_digest,
                 out_shardings=((pinned,) * b, None) if with_digest else (pinned,) * b))


def _load_parts(formats: tuple, raw: bool, with_digest: bool, options: tuple):
    unit, loop = options
    return (functools.partial(_load_impl, raw=raw, unit=unit, loop=loop),
            dict(donate_argnums=(0,),
                 in_shardings=(formats, None, None, None) + (None, None) * with_digest,
                 out_shardings=(formats, None) + (None,) * with_digest))


register_kind("pages_offload", _offload_parts, ballast=True)
register_kind("pages_load", _load_parts, same_formats=0, ballast=True)


class PagesOffload(NamedTuple):
    """Per shard, the page arrays an offload's program returns (padded to its bucket),
    and the digests being computed (None with integrity off)."""

    pages: list[tuple[jax.Array, ...]]
    digests: Pending | None


class PagesInputs(NamedTuple):
    """One shard replica's pages, moved to its device: one array per page."""

    shard: int
    replica: int
    rows: list[jax.Array]


class PagesLoad(LoadDone):
    """What the load programs return that the caller never holds."""


class PinnedPagesMover(WaitsOnce, Mover[PagesOffload, list[PagesInputs], PagesLoad]):
    """Pages gathered on the device and kept as arrays of pinned host memory."""

    name = "pinned"
    writes_buffers = True  # its loads donate the caches: shared buffers are copied first

    def __init__(self, cls, pool):
        super().__init__(cls, pool)
        if pool is not None and pool.pages is None and pool.nbytes:
            raise ValueError(f"the pinned mover's pure-JAX route keeps {cls.name}'s pages as "
                             "arrays of their own (PinnedPagesMover.host_backing)")
        self._unit = word_bytes(cls)

    @classmethod
    def host_backing(cls, slice_class, layers):
        devices = [device_of(reps[0]) for reps in layers[0].shards]
        ranges = [[slice_class.shard_range(pos, s) for s in range(slice_class.num_shards)]
                  for pos in range(len(slice_class.layers))]

        def make(num_slots: int) -> PageArrays:
            return PageArrays(slice_class.page_bytes, ranges, num_slots, devices,
                              word_bytes(slice_class))
        return make

    # -- offload ------------------------------------------------------------------

    def start_offload(self, layers, batch, slots, with_digest):
        pages, parts = [], []
        b = len(batch.padded)
        for s in range(self.cls.num_shards):
            arrays = tuple(layer.primary[s] for layer in layers)
            device = device_of(arrays[0])
            ids, base, count = batch.args(device, s)
            digest = (base, layer_nums(device, tuple(self.cls.layers))) if with_digest else ()
            out = _programs.run("pages_offload", arrays, ids, count, *digest,
                                with_digest=with_digest,
                                options=(self._unit, page_loops(device), b, _pinned(device)))
            if with_digest:
                out, d = out
                parts.append([d])
            pages.append(out)
        return PagesOffload(pages, Pending(parts, batch.k) if with_digest else None)

    def finish_offload(self, state: PagesOffload, slots):
        k = len(slots)
        for shard_pages in state.pages:
            jax.block_until_ready(shard_pages[:k])
        for j, slot in enumerate(np.asarray(slots).tolist()):
            self.pool.pages.put(slot, [shard_pages[j] for shard_pages in state.pages])
        if state.digests is not None:
            d = state.digests.get()
            for s in range(self.cls.num_shards):
                self._store_digests(slots, s, d[:, s])

    # -- load ---------------------------------------------------------------------

    def stage_load(self, layers, request: LoadRequest) -> list[PagesInputs]:
        slots = np.asarray(request.slots).tolist()
        arrays = [self.pool.pages.get(slot) for slot in slots]
        out = []
        for s in range(self.cls.num_shards):
            pages = [a[s] for a in arrays]
            for r, replica in enumerate(layers[0].shards[s]):
                device = jax.sharding.SingleDeviceSharding(device_of(replica))
                out.append(PagesInputs(s, r, jax.device_put(pages, device) if pages else []))
        return out

    def start_load(self, arrays, layers, request: LoadRequest, staged: list[PagesInputs]):
        if request.shared:
            layers = private_layers(layers, request.shared)
            arrays = [assemble(a, layer.shards) for a, layer in zip(arrays, layers)]
        single = isinstance(arrays[0].sharding, jax.sharding.SingleDeviceSharding)
        new_shards: list[list[list[jax.Array]]] = [
            [[] for _ in range(self.cls.num_shards)] for _ in arrays]
        batch = request.batch
        b = len(batch.padded)
        fused = request.on_digested is not None
        done = []
        for shard, replica, rows in staged:
            local = tuple(arrays) if single else tuple(layer.shards[shard][replica]
                                                       for layer in layers)
            device = device_of(local[0])
            ids, base, count = batch.args(device, shard)
            rows = tuple(rows) + (rows[0],) * (b - len(rows))  # padding: never written
            digest = (base, layer_nums(device, tuple(self.cls.layers))) if fused else ()
            out, d, *digests = _programs.run("pages_load", local, rows, ids, count, *digest,
                                             with_digest=fused,
                                             options=(self._unit, page_loops(device)))
            done.append(d)
            if fused:
                request.on_digested(shard, replica, digests[0])
            if single:
                return list(out), PagesLoad(done)
            for pos, a in enumerate(out):
                new_shards[pos][shard].append(a)
        new = [assemble(a, shards) for a, shards in zip(arrays, new_shards)]
        return new, PagesLoad(done)

    # -- warm-up ------------------------------------------------------------------

    def warmup(self, arrays, layers, b, with_digest):
        words = len(self.cls.layers) * self.cls.shard_block_bytes // self._unit
        for s in range(self.cls.num_shards):
            for r in range(len(layers[0].shards[s])):
                local = tuple(layer.shards[s][r] for layer in layers)
                device = device_of(local[0])
                ids, base, count = _args_abstract(b, device)
                digest = (base, _sds((len(layers),), np.uint32, device)) if with_digest else ()
                if r == 0:
                    compile_ahead("pages_offload", local, ids, count, *digest,
                                  with_digest=with_digest,
                                  options=(self._unit, page_loops(device), b, _pinned(device)))
                rows = tuple(_sds((words,), _UINT[self._unit], device) for _ in range(b))
                compile_ahead("pages_load", local, rows, ids, count, *digest,
                              with_digest=with_digest, options=(self._unit, page_loops(device)))
