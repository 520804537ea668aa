"""``kvxfer bench``: kvxfer against the physical limit and what users write today.

Everything is measured side by side in one run, on the same machine, with the
variants of each case interleaved repeat by repeat (so a noisy neighbour slows
them all alike) and throughputs taken from the best repeat:

* **limit** — the physical limit for the same bytes: a numpy memcpy between
  preallocated host buffers on CPU; on GPU a pinned host↔device copy (PyTorch or
  CuPy when importable, else ``jax.device_put`` of one large ``pinned_host`` buffer);
* **user** — what users write today: a per-block ``jax.device_get`` loop; a
  jitted per-block gather then ``jax.device_put`` to ``pinned_host``; and one
  batched jitted gather then ``device_put`` to ``pinned_host``;
* **kvxfer** — ``KVCacheManager`` offload and load (``path="auto"``) with
  ``integrity`` ``"off"`` / ``"page"`` and ``gate`` ``"all"`` / ``"layer"``.

Sections: throughput over page sizes and dtypes at a fixed bytes per call; a
prefix-length sweep (throughput vs transfer size, hit latency to the first and
the last layer); concurrency (requests in flight before waiting); per-call host
overhead; integrity traffic; loading into a small vs a large cache; memory. The
targets of DESIGN.md are printed as PASS/MISS lines.

Example:
    >>> from kvxfer import bench
    >>> report = bench.run_bench(config=bench.BenchConfig.smoke())  # doctest: +SKIP
    >>> [t["status"] for t in report["targets"]]                    # doctest: +SKIP
    ['PASS', ...]
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from kvxfer._text import format_bytes, table
from kvxfer.engine import bucket
from kvxfer.hostpool import DIGEST_SLOTS, PageRef
from kvxfer.integrity import IDENTITY_WORDS
from kvxfer.manager import KVCacheManager

__all__ = ["BenchConfig", "run_bench", "register_cli", "format_report", "iter_figures",
           "ZERO_OK"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Figures that are differences and may legitimately be zero (all others are > 0).
ZERO_OK = frozenset({"host_transient_bytes", "device_persistent_bytes",
                     "device_transient_bytes"})

_LOAD_VARIANTS = (("off", "all"), ("off", "layer"), ("page", "all"), ("page", "layer"))


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What ``run_bench`` measures. ``full()`` / ``quick()`` / ``smoke()`` are presets.

    Attributes:
      layers: layers of the benchmark model (every layer one cache array).
      batch_bytes: bytes per offload/load call in the throughput section.
      cells: ``(page_bytes, dtype)`` cases of the throughput section; ``page_bytes``
        is one layer-block.
      reference: the cell the concurrency, overhead, integrity-traffic and memory
        sections reuse, and where the per-page-size targets are read.
      prefix_page_bytes: page size of the prefix-length sweep.
      prefix_pages: prefix lengths (pages per call) of the sweep.
      concurrency: requests in flight (issued before the first wait).
      request_pages: pages per request in the concurrency section.
      overhead_pages: pages per call in the host-overhead section.
      cache_small_bytes, cache_large_bytes: the two caches of the cache-size figure.
      cache_load_blocks: blocks loaded into each of them.
      repeats: timed repeats per variant (after one warm-up).
      overhead_repeats: timed repeats per variant of the host-overhead section.
      baseline_budget_s: seconds each per-block user loop may run per case (cut
        short loops report the throughput of the blocks they moved).
      cache_size_extras: also load into both caches with ``path="staged"`` and
        with a user's jitted donated scatter.
      batched_baseline: where to time the batched user gather: ``"all"`` cases,
        the ``"reference"`` cell only, or ``"none"`` (on CPU it runs below 1 GB/s,
        so one sample of it can cost seconds).
    """

    layers: int = 32
    batch_bytes: int = 256 * MiB
    cells: tuple[tuple[int, str], ...] = (
        (64 * KiB, "bfloat16"), (16 * KiB, "bfloat16"), (256 * KiB, "bfloat16"),
        (2 * MiB, "bfloat16"), (16 * KiB, "int8"), (64 * KiB, "int8"), (2 * MiB, "int8"),
        (64 * KiB, "float8_e4m3fn"), (16 * KiB, "float32"), (64 * KiB, "float32"),
        (2 * MiB, "float32"))
    reference: tuple[int, str] = (64 * KiB, "bfloat16")
    prefix_page_bytes: int = 16 * KiB
    prefix_pages: tuple[int, ...] = (1, 4, 16, 64, 128, 256, 1024)
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    request_pages: int = 16
    overhead_pages: int = 32
    cache_small_bytes: int = 64 * MiB
    cache_large_bytes: int = 1 * GiB
    cache_load_blocks: int = 32
    repeats: int = 15
    overhead_repeats: int = 50
    baseline_budget_s: float = 1.5
    cache_size_extras: bool = True
    batched_baseline: Literal["all", "reference", "none"] = "all"

    def __post_init__(self):
        if self.batched_baseline not in ("all", "reference", "none"):
            raise ValueError(f"batched_baseline={self.batched_baseline!r}; expected 'all', "
                             "'reference' or 'none'")
        if self.reference not in self.cells:
            raise ValueError(f"reference={self.reference!r} must be one of cells={self.cells!r}")
        for page, dtype in self.cells:
            itemsize = jnp.dtype(dtype).itemsize
            if page % itemsize or page < itemsize:
                raise ValueError(f"cell ({page}, {dtype!r}): page_bytes must be a positive "
                                 f"multiple of {itemsize}")
            if self.batch_bytes < self.layers * page:
                raise ValueError(f"batch_bytes={self.batch_bytes} holds no page of "
                                 f"{self.layers} layers x {page} bytes")
        if self.cache_small_bytes < self.layers * self.cache_load_blocks * self.reference[0]:
            raise ValueError(f"cache_small_bytes={self.cache_small_bytes} cannot hold "
                             f"{self.cache_load_blocks} blocks of {self.layers} layers")
        if max(self.concurrency) * self.request_pages > self._ref_pages or \
                self.overhead_pages > self._ref_pages:
            raise ValueError(f"concurrency x request_pages and overhead_pages must fit the "
                             f"reference cell's {self._ref_pages} pages")

    @property
    def _ref_pages(self) -> int:
        return self.batch_bytes // (self.layers * self.reference[0])

    @property
    def sweep_on_reference(self) -> bool:
        """The prefix sweep runs on the reference cell's caches (no programs to compile)."""
        return (self.prefix_page_bytes, "bfloat16") == self.reference and \
            max(self.prefix_pages) <= self._ref_pages

    @classmethod
    def full(cls) -> BenchConfig:
        """The full run (a few minutes on a 2-core CPU)."""
        return cls()

    @classmethod
    def quick(cls) -> BenchConfig:
        """Every section, fewer cases and repeats (under a minute on a 2-core CPU).

        Its prefix sweep reuses the reference cell (64 KiB pages, up to 128 pages) and
        its requests share the sweep's block counts: each new cache shape or
        block-count bucket costs seconds of compilation.
        """
        return cls(cells=((64 * KiB, "bfloat16"), (16 * KiB, "int8"), (2 * MiB, "float32")),
                   prefix_page_bytes=64 * KiB, prefix_pages=(1, 4, 32, 128), request_pages=4,
                   repeats=5, overhead_repeats=20, baseline_budget_s=0.2,
                   cache_size_extras=False, batched_baseline="none")

    @classmethod
    def smoke(cls) -> BenchConfig:
        """Tiny sizes for tests: every section and figure, in seconds."""
        return cls(layers=2, batch_bytes=256 * KiB,
                   cells=((16 * KiB, "bfloat16"), (4 * KiB, "int8")),
                   reference=(16 * KiB, "bfloat16"), prefix_page_bytes=16 * KiB,
                   prefix_pages=(1, 2), concurrency=(1, 2), request_pages=1,
                   overhead_pages=2, cache_small_bytes=128 * KiB, cache_large_bytes=512 * KiB,
                   cache_load_blocks=2, repeats=2, overhead_repeats=3,
                   baseline_budget_s=0.02, cache_size_extras=True)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["cells"] = [list(c) for c in self.cells]
        d["reference"] = list(self.reference)
        for k in ("prefix_pages", "concurrency"):
            d[k] = list(d[k])
        return d


# ---------------------------------------------------------------------------
# Timing helpers
# ---------------------------------------------------------------------------


_now = time.perf_counter


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Timed regions run without the cyclic GC (a collection is not a transfer cost)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _stats(samples: Sequence[float], nbytes: int | None = None) -> dict[str, Any]:
    s = np.asarray(samples, dtype=np.float64)
    out: dict[str, Any] = {"n": int(s.size), "best_s": float(s.min()),
                           "p50_s": float(np.percentile(s, 50)),
                           "p99_s": float(np.percentile(s, 99))}
    if nbytes:
        out["bytes"] = int(nbytes)
        out["gbps"] = nbytes / out["best_s"] / 1e9
        out["gbps_p50"] = nbytes / out["p50_s"] / 1e9
    return out


def _interleaved(variants: dict[str, Callable[[], Any]], repeats: int
                 ) -> dict[str, dict[str, list[float]]]:
    """Runs every variant once (warm-up), then ``repeats`` rounds of all variants.

    A variant returns its elapsed seconds, or a dict of named timings (``"s"`` the
    total). The warm-up's total is kept as ``"warmup_s"``.
    """
    out: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    for name, fn in variants.items():
        r = fn()
        out[name]["warmup_s"] = [float(r["s"] if isinstance(r, dict) else r)]
    with _no_gc():
        for _ in range(repeats):
            for name, fn in variants.items():
                r = fn()
                for key, v in (r.items() if isinstance(r, dict) else (("s", r),)):
                    out[name].setdefault(key, []).append(float(v))
    return out


def _per_block_loop(step: Callable[[int], Any], finish: Callable[[list], Any],
                    blocks: Sequence[int], block_bytes: int, budget_s: float,
                    repeats: int) -> dict[str, Any]:
    """Times a per-block user loop; a loop over budget stops early and counts what it moved.

    ``step(block)`` moves one block (all layers) and returns what it produced;
    ``finish(outputs)`` waits for them. Times are for all of ``blocks``
    (extrapolated when a loop was cut short; ``blocks_timed`` says how many moved).
    """
    finish([step(blocks[0])])  # warm-up (compiles)
    samples, moved = [], []
    spent = 0.0
    with _no_gc():
        for _ in range(max(1, repeats)):
            outs = []
            t0 = _now()
            for b in blocks:
                outs.append(step(b))
                if _now() - t0 > budget_s:
                    break
            finish(outs)
            dt = _now() - t0
            samples.append(dt)
            moved.append(len(outs))
            del outs
            spent += dt
            if spent > budget_s:
                break
    # Seconds for every requested block, extrapolated from the blocks a cut loop moved.
    whole = [t * len(blocks) / m for t, m in zip(samples, moved)]
    out = _stats(whole, len(blocks) * block_bytes)
    out["blocks_timed"] = int(min(moved))
    return out


# ---------------------------------------------------------------------------
# The physical limit
# ---------------------------------------------------------------------------


def _platform() -> str:
    return jax.devices()[0].platform


class _Limit(abc.ABC):
    """Copies at the physical limit, per direction, over buffers allocated once per run.

    ``runners(nbytes)`` gives name -> a function that copies ``nbytes`` once and
    returns its seconds: ``memcpy`` on CPU, ``d2h`` and ``h2d`` on GPU.
    """

    method = "?"

    def __init__(self, capacity: int):
        self.capacity = capacity

    @abc.abstractmethod
    def runners(self, nbytes: int) -> dict[str, Callable[[], float]]:
        """Copy functions for ``nbytes`` (at most ``capacity``)."""

    def close(self) -> None:
        pass


class _Memcpy(_Limit):
    method = "numpy memcpy between preallocated host buffers (np.copyto)"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.src = np.ones(capacity, np.uint8)
        self.dst = np.ones(capacity, np.uint8)  # touched, so no page faults are timed

    def runners(self, nbytes):
        src, dst = self.src[:nbytes], self.dst[:nbytes]

        def copy() -> float:
            t0 = _now()
            np.copyto(dst, src)
            return _now() - t0

        return {"memcpy": copy}


class _TorchCopy(_Limit):
    method = "torch pinned host<->device copy_ (non_blocking, then synchronize)"

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

    def _time(self, dst, src) -> float:
        t0 = _now()
        dst.copy_(src, non_blocking=True)
        self.torch.cuda.synchronize()
        return _now() - t0

    def runners(self, nbytes):
        host, dev = self.host[:nbytes], self.dev[:nbytes]
        return {"d2h": lambda: self._time(host, dev), "h2d": lambda: self._time(dev, host)}

    def close(self):
        del self.host, self.dev
        self.torch.cuda.empty_cache()


class _CupyCopy(_Limit):
    method = "cupy pinned host<->device copy (then synchronize)"

    def __init__(self, capacity: int):
        import cupy
        import cupyx

        super().__init__(capacity)
        self.cp = cupy
        self.host = cupyx.empty_pinned((capacity,), dtype=np.uint8)
        self.host[:] = 1
        self.dev = cupy.ones((capacity,), dtype=cupy.uint8)
        cupy.cuda.Device().synchronize()

    def runners(self, nbytes):
        host, dev, sync = self.host[:nbytes], self.dev[:nbytes], self.cp.cuda.Device().synchronize

        def d2h() -> float:
            t0 = _now()
            dev.get(out=host)
            sync()
            return _now() - t0

        def h2d() -> float:
            t0 = _now()
            dev.set(host)
            sync()
            return _now() - t0

        return {"d2h": d2h, "h2d": h2d}

    def close(self):
        del self.host, self.dev
        self.cp.get_default_memory_pool().free_all_blocks()


class _JaxPinnedCopy(_Limit):
    method = "jax.device_put of one pinned_host buffer (to device memory and back)"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        dev = jax.devices()[0]
        self.on_host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        self.on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        self._arrays: tuple[jax.Array, jax.Array] | None = None

    def _time(self, x, sharding) -> float:
        t0 = _now()
        jax.device_put(x, sharding).block_until_ready()
        return _now() - t0

    def runners(self, nbytes):
        self.close()  # JAX arrays cannot be sliced without a copy: one pair per size
        host = jax.device_put(np.ones(nbytes, np.uint8), self.on_host)
        dev = jax.device_put(host, self.on_dev)
        jax.block_until_ready((host, dev))
        self._arrays = (host, dev)
        return {"d2h": lambda: self._time(dev, self.on_host),
                "h2d": lambda: self._time(host, self.on_dev)}

    def close(self):
        if self._arrays is not None:
            for a in self._arrays:
                a.delete()
            self._arrays = None


def _make_limit(capacity: int) -> _Limit:
    if _platform() != "gpu":
        return _Memcpy(capacity)
    errors = []
    for kind in (_TorchCopy, _CupyCopy, _JaxPinnedCopy):
        try:
            return kind(capacity)
        except Exception as e:  # not importable, or no CUDA in it: the next one
            errors.append(f"{kind.__name__}: {type(e).__name__}: {e}")
    raise RuntimeError("no pinned host<->device copy works here: " + "; ".join(errors))


def _limit_figures(timings: dict[str, dict[str, list[float]]], nbytes: int
                   ) -> dict[str, dict[str, Any]]:
    """``{"d2h": stats, "h2d": stats}`` (on CPU both are the one memcpy)."""
    if "memcpy" in timings:
        s = _stats(timings["memcpy"]["s"], nbytes)
        return {"d2h": s, "h2d": s}
    return {d: _stats(timings[d]["s"], nbytes) for d in ("d2h", "h2d")}


# ---------------------------------------------------------------------------
# Caches and the kvxfer rig
# ---------------------------------------------------------------------------


def _make_caches(layers: int, num_blocks: int, page_bytes: int, dtype: str) -> list[jax.Array]:
    """Caches ``[num_blocks, ...]`` of ``page_bytes`` per block, filled with varied bytes."""
    dt = jnp.dtype(dtype)
    elems = page_bytes // dt.itemsize
    shape = (num_blocks, elems // 128, 128) if elems % 128 == 0 else (num_blocks, elems)
    # A pattern whose length is no multiple of a page: every block holds other bytes.
    pattern = np.random.default_rng(0).integers(0, 256, size=MiB + 4099, dtype=np.uint8)
    out = []
    for i in range(layers):
        raw = np.resize(np.roll(pattern, 7919 * i), num_blocks * page_bytes)
        out.append(jax.device_put(raw.view(dt).reshape(shape), jax.devices()[0]))
    jax.block_until_ready(out)
    return out


class _Rig:
    """Caches and one ``KVCacheManager`` per (integrity, path) over them."""

    def __init__(self, caches: list[jax.Array], num_host_blocks: int,
                 kinds: Sequence[tuple[str, str]] = (("off", "auto"), ("page", "auto"))):
        self.caches = caches
        self.mgrs = {k: KVCacheManager(caches, num_host_blocks=num_host_blocks,
                                       integrity=k[0], path=k[1]) for k in kinds}
        self._key = 0

    def mgr(self, integrity: str, path: str = "auto") -> KVCacheManager:
        return self.mgrs[(integrity, path)]

    def keys(self, n: int) -> list[int]:
        self._key += n
        return list(range(self._key - n, self._key))

    def hold(self, integrity: str, ids: Sequence[int], path: str = "auto") -> list[PageRef]:
        """Offloads ``ids`` and keeps the pages (sources for loads)."""
        return self.mgr(integrity, path).offload(self.caches, ids, self.keys(len(ids))).wait()

    def offload(self, integrity: str, ids: Sequence[int]) -> dict[str, float]:
        mgr = self.mgr(integrity)
        keys = self.keys(len(ids))
        t0 = _now()
        handle = mgr.offload(self.caches, ids, keys)
        t1 = _now()
        pages = handle.wait()
        t2 = _now()
        mgr.free(pages)
        return {"s": t2 - t0, "call_s": t1 - t0}

    def load(self, integrity: str, pages: Sequence[PageRef], ids: Sequence[int],
             gate: str, path: str = "auto") -> dict[str, float]:
        mgr = self.mgr(integrity, path)
        t0 = _now()
        self.caches, handle = mgr.load(self.caches, pages, ids, gate=gate)
        t1 = _now()
        handle.layer_ready(0)
        t2 = _now()
        result = handle.result()
        t3 = _now()
        if result.verified_prefix != len(pages):
            raise RuntimeError(f"bench: a load verified {result.verified_prefix} of "
                               f"{len(pages)} pages: {result.reasons}")
        return {"s": t3 - t0, "call_s": t1 - t0, "first_s": t2 - t0}

    def close(self) -> None:
        for m in self.mgrs.values():
            m.close()
        self.mgrs.clear()
        self.caches = []


def _load_name(integrity: str, gate: str) -> str:
    return f"load_{integrity}_{gate}"


# ---------------------------------------------------------------------------
# What users write today
# ---------------------------------------------------------------------------


def _pinned_sharding() -> jax.sharding.Sharding:
    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    kind = "pinned_host" if "pinned_host" in kinds else None
    return jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)


def _user_baselines(caches: list[jax.Array], ids: Sequence[int], page_bytes: int,
                    cfg: BenchConfig, batched: bool = True) -> dict[str, dict[str, Any]]:
    """The offload loops users write today, each over all layers of ``ids``.

    Per block: ``jax.device_get``; a jitted gather then ``device_put`` to
    ``pinned_host``. With ``batched``: one jitted gather of every block, then
    ``device_put`` to ``pinned_host``.
    """
    layers = len(caches)
    block_bytes = layers * page_bytes
    pinned = _pinned_sharding()
    arrays = tuple(caches)

    def device_get(b: int) -> list[np.ndarray]:
        return [jax.device_get(c[b]) for c in arrays]

    out = {"user_device_get": _per_block_loop(device_get, lambda outs: None, ids,
                                              block_bytes, cfg.baseline_budget_s,
                                              cfg.repeats)}

    gather_one = jax.jit(lambda cs, b: jnp.stack([c[b] for c in cs]))
    out["user_gather_pinned"] = _per_block_loop(
        lambda b: jax.device_put(gather_one(arrays, b), pinned), jax.block_until_ready,
        ids, block_bytes, cfg.baseline_budget_s, cfg.repeats)

    if not batched:
        return out
    ids_d = jnp.asarray(np.asarray(ids, np.int32))
    # Compiled ahead: a warm-up run of this slow loop would cost as much as a sample.
    gather = jax.jit(lambda cs, i: jnp.stack([c[i] for c in cs])).lower(arrays, ids_d).compile()

    def batched_run() -> float:
        t0 = _now()
        jax.device_put(gather(arrays, ids_d), pinned).block_until_ready()
        return _now() - t0

    samples = []
    with _no_gc():
        while not samples or (len(samples) < cfg.repeats and
                              sum(samples) < cfg.baseline_budget_s):
            samples.append(batched_run())
    out["user_batched_gather_pinned"] = _stats(samples, len(ids) * block_bytes)
    return out


def _with_fraction(stats: dict[str, Any], limit: dict[str, Any]) -> dict[str, Any]:
    stats["fraction_of_limit"] = stats["gbps"] / limit["gbps"]
    return stats


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------


def _measure_case(cfg: BenchConfig, limit: _Limit, rig: _Rig, held: dict[str, list[PageRef]],
                  ids: list[int], page_bytes: int, batched: bool
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The limit, kvxfer's variants (interleaved) and the user loops for blocks ``ids``.

    Returns:
      ``(limit, methods)``: per direction the limit's stats, and per method its
      stats with ``fraction_of_limit`` (loads add ``first_layer`` / ``last_layer``).
    """
    nbytes = len(ids) * cfg.layers * page_bytes
    variants: dict[str, Callable[[], Any]] = dict(limit.runners(nbytes))
    for integ in ("off", "page"):
        variants[f"offload_{integ}"] = lambda integ=integ: rig.offload(integ, ids)
    for integ, gate in _LOAD_VARIANTS:
        variants[_load_name(integ, gate)] = (
            lambda integ=integ, gate=gate: rig.load(integ, held[integ][:len(ids)], ids, gate))
    t = _interleaved(variants, cfg.repeats)
    lim = _limit_figures(t, nbytes)
    methods: dict[str, Any] = {}
    for name, timing in t.items():
        if name in lim or name == "memcpy":
            continue
        s = _stats(timing["s"], nbytes)
        s["call_p50_s"] = float(np.percentile(timing["call_s"], 50))
        if "first_s" in timing:
            s["first_layer"] = _stats(timing["first_s"])
            s["last_layer"] = _stats(timing["s"])
        methods[name] = _with_fraction(s, lim["d2h" if name.startswith("offload") else "h2d"])
    for name, s in _user_baselines(rig.caches, ids, page_bytes, cfg, batched).items():
        methods[name] = _with_fraction(s, lim["d2h"])
    return lim, methods


def _throughput_cell(cfg: BenchConfig, limit: _Limit, page_bytes: int, dtype: str, *,
                     reference: bool, report: dict[str, Any], say: Callable[[str], None]
                     ) -> dict[str, Any]:
    layers = cfg.layers
    pages = cfg.batch_bytes // (layers * page_bytes)
    nbytes = pages * layers * page_bytes
    say(f"throughput: {format_bytes(page_bytes)} {dtype} pages, {pages} pages x {layers} "
        f"layers = {format_bytes(nbytes)} per call")
    memory_before = _device_bytes_in_use()
    caches = _make_caches(layers, pages, page_bytes, dtype)
    # Twice the pages: the loads' source pages stay held while offloads take new slots.
    rig = _Rig(caches, num_host_blocks=2 * pages)
    try:
        ids = list(range(pages))
        held, cold = {}, {}
        for integ in ("off", "page"):  # first calls: they compile the class's programs
            t0 = _now()
            held[integ] = rig.hold(integ, ids)
            cold[f"offload_{integ}"] = _now() - t0
            cold[_load_name(integ, "all")] = rig.load(integ, held[integ], ids, "all")["s"]
        if reference:  # before the limit's and the user loops' buffers exist
            report["memory"] = _memory_section(rig, held, ids, memory_before, say)
        lim, methods = _measure_case(cfg, limit, rig, held, ids, page_bytes, batched=(
            cfg.batched_baseline == "all" or (reference and cfg.batched_baseline == "reference")))
        for name, seconds in cold.items():
            methods[name]["first_call_s"] = seconds
        row = {"page_bytes": page_bytes, "dtype": dtype, "layers": layers, "pages": pages,
               "bytes": nbytes, "paths": sorted(set(rig.mgr("page").paths)),
               "limit": lim, "methods": methods}
        if reference:
            report["concurrency"] = _concurrency_section(cfg, rig, held, page_bytes, say)
            report["overhead"] = _overhead_section(cfg, rig, held, page_bytes, say)
            report["integrity_traffic"] = _integrity_traffic(rig, pages, page_bytes)
            if cfg.sweep_on_reference:
                report["sweep"] = _prefix_sweep(cfg, limit, say, rig, held)
        return row
    finally:
        rig.close()
        del caches
        gc.collect()


def _prefix_sweep(cfg: BenchConfig, limit: _Limit, say: Callable[[str], None],
                  rig: _Rig | None = None, held: dict[str, list[PageRef]] | None = None
                  ) -> list[dict[str, Any]]:
    """Throughput vs transfer size and hit latency over prefix lengths.

    Runs on ``rig`` (the reference cell's, whose programs are compiled already)
    when given, else on caches of its own.
    """
    layers, page = cfg.layers, cfg.prefix_page_bytes
    top = max(cfg.prefix_pages)
    own = rig is None
    if own:
        rig = _Rig(_make_caches(layers, top, page, "bfloat16"), num_host_blocks=2 * top)
    assert rig is not None
    rows = []
    try:
        if held is None:
            held = {i: rig.hold(i, list(range(top))) for i in ("off", "page")}
        for n in cfg.prefix_pages:
            nbytes = n * layers * page
            say(f"prefix sweep: {n} pages x {layers} layers x {format_bytes(page)} = "
                f"{format_bytes(nbytes)}")
            lim, methods = _measure_case(cfg, limit, rig, held, list(range(n)), page,
                                         batched=cfg.batched_baseline == "all")
            rows.append({"pages": n, "page_bytes": page, "layers": layers, "bytes": nbytes,
                         "dtype": "bfloat16", "limit": lim, "methods": methods})
    finally:
        if own:
            rig.close()
            gc.collect()
    return rows


def _concurrency_section(cfg: BenchConfig, rig: _Rig, held: dict[str, list[PageRef]],
                         page_bytes: int, say: Callable[[str], None]) -> list[dict[str, Any]]:
    k = cfg.request_pages
    req_bytes = k * cfg.layers * page_bytes
    rows = []
    for c in cfg.concurrency:
        say(f"concurrency: {c} requests of {k} pages ({format_bytes(req_bytes)}) in flight")
        reqs = [list(range(j * k, (j + 1) * k)) for j in range(c)]

        def offloads(integ: str, reqs=reqs) -> dict[str, float]:
            mgr = rig.mgr(integ)
            t0 = _now()
            handles = [mgr.offload(rig.caches, ids, rig.keys(len(ids))) for ids in reqs]
            issued = _now() - t0
            done, pages = [], []
            for h in handles:
                pages.append(h.wait())
                done.append(_now() - t0)
            total = _now() - t0
            for p in pages:
                mgr.free(p)
            return {"s": total, "issue_s": issued, **{f"req{j}": d for j, d in enumerate(done)}}

        def loads(integ: str, reqs=reqs) -> dict[str, float]:
            mgr = rig.mgr(integ)
            t0 = _now()
            handles = []
            for j, ids in enumerate(reqs):
                rig.caches, h = mgr.load(rig.caches, held[integ][j * k:(j + 1) * k], ids,
                                         gate="all")
                handles.append(h)
            issued = _now() - t0
            done = []
            for h in handles:
                r = h.result()
                done.append(_now() - t0)
                if r.verified_prefix != k:
                    raise RuntimeError(f"bench: a load verified {r.verified_prefix} of {k} "
                                       f"pages: {r.reasons}")
            return {"s": _now() - t0, "issue_s": issued,
                    **{f"req{j}": d for j, d in enumerate(done)}}

        variants = {f"{op}_{i}": (lambda op=op, i=i: (offloads if op == "offload" else loads)(i))
                    for op in ("offload", "load") for i in ("off", "page")}
        t = _interleaved(variants, cfg.repeats)
        for name, timing in t.items():
            op, integ = name.split("_")
            lat = [v for key, vals in timing.items() if key.startswith("req") for v in vals]
            s = _stats(timing["s"], c * req_bytes)
            rows.append({"op": op, "integrity": integ, "in_flight": c, "request_pages": k,
                         "request_bytes": req_bytes, "aggregate": s,
                         "request_latency": _stats(lat),
                         "issue_p50_s": float(np.percentile(timing["issue_s"], 50))})
    return rows


def _overhead_section(cfg: BenchConfig, rig: _Rig, held: dict[str, list[PageRef]],
                      page_bytes: int, say: Callable[[str], None]) -> list[dict[str, Any]]:
    k = cfg.overhead_pages
    say(f"host overhead: {k} pages x {cfg.layers} layers per call")
    ids = list(range(k))
    variants: dict[str, Callable[[], Any]] = {
        "offload_off": lambda: rig.offload("off", ids),
        "offload_page": lambda: rig.offload("page", ids)}
    for integ, gate in _LOAD_VARIANTS:
        variants[_load_name(integ, gate)] = (
            lambda integ=integ, gate=gate: rig.load(integ, held[integ][:k], ids, gate))
    t = _interleaved(variants, cfg.overhead_repeats)
    rows = []
    for name, timing in t.items():
        parts = name.split("_")
        rows.append({"op": parts[0], "integrity": parts[1],
                     "gate": parts[2] if len(parts) > 2 else "-", "pages": k,
                     "layers": cfg.layers, "bytes": k * cfg.layers * page_bytes,
                     "call": _stats(timing["call_s"]), "total": _stats(timing["s"])})
    return rows


def _integrity_traffic(rig: _Rig, pages: int, page_bytes: int) -> list[dict[str, Any]]:
    """Extra bytes integrity reads per call, derived from the programs the engine runs.

    The digest programs read the padded block list (``bucket(k)`` blocks) of every
    layer once per direction; the host keeps ``DIGEST_SLOTS`` words per page, layer
    and shard, written on offload and read on load; the page identities go to each
    shard's device once per transfer.
    """
    mgr = rig.mgr("page")
    rows = []
    for k in sorted({n for n in (1, 32, pages) if n <= pages}):
        payload = k * mgr.num_layers * page_bytes
        layer_shards = sum(len(c.layers) * c.num_shards for c in mgr.plan.classes)
        device = bucket(k) * mgr.num_layers * page_bytes
        host = k * layer_shards * DIGEST_SLOTS * 4
        ident = bucket(k) * max(c.num_shards for c in mgr.plan.classes) * IDENTITY_WORDS * 4
        rows.append({"pages": k, "payload_bytes": payload,
                     "device_read_bytes_offload": device, "device_read_bytes_load": device,
                     "host_digest_bytes": host, "identity_bytes": ident,
                     "extra_over_payload": (device + host + ident) / payload,
                     "basis": "derived from the digest programs' shapes (engine.bucket "
                              "padding included), not counted by hardware"})
    return rows


def _rss() -> tuple[int, int] | None:
    """(current, peak) resident bytes of this process, or None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _device_bytes_in_use() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats or "bytes_in_use" not in stats else int(stats["bytes_in_use"])


def _memory_section(rig: _Rig, held: dict[str, list[PageRef]], ids: list[int],
                    device_before: int | None, say: Callable[[str], None]) -> dict[str, Any]:
    say("memory: host pool vs plan, transient memory of one offload + load")
    mgr = rig.mgr("page")
    out: dict[str, Any] = {"pool_bytes": mgr.host_pool.nbytes,
                           "plan_bytes": mgr.plan.total_host_bytes,
                           "pool_over_plan": mgr.host_pool.nbytes / mgr.plan.total_host_bytes,
                           "not_measured": []}
    cache_bytes = sum(int(c.nbytes) for c in rig.caches)
    out["cache_bytes"] = cache_bytes
    device_after = _device_bytes_in_use()
    rig.offload("page", ids)  # the slots it takes (and frees) are touched before measuring
    rss = _rss()
    if rss is not None and _reset_peak_rss():
        gc.collect()
        before = _rss()[0]
        rig.offload("page", ids)
        rig.load("page", held["page"], ids, "all")
        peak = _rss()[1]
        out["host_rss_before_bytes"] = before
        out["host_peak_rss_bytes"] = peak
        out["host_transient_bytes"] = max(0, peak - before)
        out["payload_bytes"] = len(ids) * mgr.plan.page_bytes
    else:
        out["not_measured"].append("host transient memory: /proc/self/clear_refs unavailable")
    if device_before is not None and device_after is not None:
        stats = jax.devices()[0].memory_stats() or {}
        out["device_bytes_in_use"] = device_after
        out["device_persistent_bytes"] = max(0, device_after - device_before - cache_bytes)
        if "peak_bytes_in_use" in stats:
            out["device_transient_bytes"] = max(
                0, int(stats["peak_bytes_in_use"]) - device_before - cache_bytes)
    else:
        out["not_measured"].append(
            f"device memory beyond caches: {jax.devices()[0].platform} device reports no "
            "memory_stats (on CPU, device memory is the host memory above)")
    return out


def _cache_size_section(cfg: BenchConfig, say: Callable[[str], None]) -> dict[str, Any]:
    page, _ = cfg.reference
    layers, k = cfg.layers, cfg.cache_load_blocks
    sizes = {"small": cfg.cache_small_bytes, "large": cfg.cache_large_bytes}
    say(f"cache size: load {k} blocks into {format_bytes(sizes['small'])} vs "
        f"{format_bytes(sizes['large'])} caches ({layers} layers, {format_bytes(page)} "
        "bfloat16 blocks)")
    kinds = [("off", "auto"), ("page", "auto")]
    if cfg.cache_size_extras:
        kinds.append(("page", "staged"))
    rigs, held, dst = {}, {}, {}
    out: dict[str, Any] = {"blocks": k, "layers": layers, "page_bytes": page,
                           "bytes": k * layers * page, "variants": {}}
    try:
        for name, total in sizes.items():
            nb = total // (layers * page)
            out[f"{name}_cache_bytes"] = nb * layers * page
            rigs[name] = _Rig(_make_caches(layers, nb, page, "bfloat16"), k, kinds)
            src = list(range(k))
            held[name] = {kind: rigs[name].hold(*kind[:1], src, path=kind[1]) for kind in kinds}
            dst[name] = np.linspace(0, nb - 1, k).round().astype(int).tolist()
        # The extras rewrite whole caches (XLA:CPU scatters): they are timed apart,
        # so they cannot disturb the kvxfer figures.
        variants: dict[str, Callable[[], Any]] = {}
        extras: dict[str, Callable[[], Any]] = {}
        for integ, path in kinds:
            for name in sizes:
                (variants if path == "auto" else extras)[f"{integ}_{path}_{name}"] = (
                    lambda integ=integ, path=path, name=name:
                    rigs[name].load(integ, held[name][(integ, path)], dst[name], "all", path))
        if cfg.cache_size_extras:
            scatter = jax.jit(lambda cs, i, us: tuple(c.at[i].set(u) for c, u in zip(cs, us)),
                              donate_argnums=0)
            for name in sizes:
                host = [np.asarray(c[:k]) for c in rigs[name].caches]
                ids_np = np.asarray(dst[name], np.int32)

                def user(name=name, host=host, ids_np=ids_np) -> float:
                    t0 = _now()
                    us = [jax.device_put(h) for h in host]
                    r = rigs[name]
                    r.caches = list(jax.block_until_ready(scatter(tuple(r.caches), ids_np, us)))
                    return _now() - t0

                extras[f"user_scatter_{name}"] = user
        t = _interleaved(variants, cfg.repeats)
        if extras:
            t.update(_interleaved(extras, cfg.repeats))
        groups = [f"{i}_{p}" for i, p in kinds] + (["user_scatter"] if cfg.cache_size_extras
                                                   else [])
        for g in groups:
            small = _stats(t[f"{g}_small"]["s"], out["bytes"])
            large = _stats(t[f"{g}_large"]["s"], out["bytes"])
            out["variants"][g] = {"small": small, "large": large,
                                  "ratio": large["best_s"] / small["best_s"],
                                  "ratio_p50": large["p50_s"] / small["p50_s"]}
    finally:
        for r in rigs.values():
            r.close()
        rigs.clear()
        gc.collect()
    return out


# ---------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------


def _target(name: str, value: float, op: str, threshold: float, applies: str,
            where: str) -> dict[str, Any]:
    ok = {">=": value >= threshold, "<=": value <= threshold,
          "within": abs(value - 1) <= threshold}[op]
    return {"name": name, "value": float(value), "op": op, "threshold": float(threshold),
            "status": "PASS" if ok else "MISS", "applies": applies, "where": where}


def _worst(rows: list[dict[str, Any]], method: str, key: str = "fraction_of_limit"
           ) -> tuple[float, str]:
    v, row = min(((r["methods"][method][key], r) for r in rows), key=lambda x: x[0])
    return v, f"{format_bytes(row['page_bytes'])} {row['dtype']}"


def _targets(cfg: BenchConfig, report: dict[str, Any], gpu: bool) -> list[dict[str, Any]]:
    cells = report["throughput"]
    batch = format_bytes(cfg.batch_bytes)
    out = []
    limit_word = "pinned memcpy" if gpu else "memcpy"
    if not gpu:
        for op, m in (("offload", "offload_page"), ("load", "load_page_all"),
                      ("offload", "offload_off"), ("load", "load_off_all")):
            v, where = _worst(cells, m)
            integ = m.split("_")[1]
            out.append(_target(f"cpu: {op} of {batch} batches (integrity {integ}) >= 0.5x "
                               f"{limit_word}", v, ">=", 0.5, "cpu", f"worst cell: {where}"))
    cs = report["cache_size"]["variants"]["page_auto"]
    out.append(_target(
        f"load {cfg.cache_load_blocks} blocks into {format_bytes(cfg.cache_large_bytes)} vs "
        f"{format_bytes(cfg.cache_small_bytes)} cache <= 2x time", cs["ratio"], "<=", 2.0,
        "all", "integrity page, gate all"))
    ratio_floor = 0.97 if gpu else 0.6
    page_ref = cfg.reference[0]
    ref_cells = [r for r in cells if r["page_bytes"] == page_ref]
    for op, on, off in (("offload", "offload_page", "offload_off"),
                        ("load", "load_page_all", "load_off_all")):
        v, r = min(((r["methods"][on]["gbps"] / r["methods"][off]["gbps"], r)
                    for r in ref_cells), key=lambda x: x[0])
        out.append(_target(f"{'gpu' if gpu else 'cpu'}: {op} integrity page >= "
                           f"{ratio_floor}x off at {format_bytes(page_ref)} pages", v, ">=",
                           ratio_floor, "gpu" if gpu else "cpu", f"worst dtype: {r['dtype']}"))
    for row in report["overhead"]:
        label = row["op"] + ", integrity " + row["integrity"] + \
            (f", gate {row['gate']}" if row["gate"] != "-" else "")
        out.append(_target(f"host overhead per {row['op']}() call, {row['pages']} pages x "
                           f"{row['layers']} layers ({label}) <= 1 ms",
                           row["call"]["p50_s"] * 1e3, "<=", 1.0, "all", "p50 of the call"))
    mem = report["memory"]
    out.append(_target("host pool bytes within 1% of the plan", mem["pool_over_plan"],
                       "within", 0.01, "all", "pool/plan"))
    if gpu:
        sweep = report["sweep"]
        for op, m in (("offload", "offload_page"), ("load", "load_page_all")):
            big = [r["methods"][m]["fraction_of_limit"] for r in sweep if r["bytes"] >= 64 * MiB]
            mid = [r["methods"][m]["fraction_of_limit"] for r in sweep
                   if 8 * MiB <= r["bytes"] < 64 * MiB]
            if big:
                out.append(_target(f"gpu: {op} >= 0.9x pinned memcpy at >= 64 MiB/call",
                                   min(big), ">=", 0.9, "gpu", "worst size >= 64 MiB"))
            if mid:
                out.append(_target(f"gpu: {op} >= 0.6x pinned memcpy at 8 MiB/call",
                                   min(mid), ">=", 0.6, "gpu", "worst size in [8, 64) MiB"))
        ref = next(r for r in cells if (r["page_bytes"], r["dtype"]) == cfg.reference)
        v = ref["methods"]["offload_page"]["gbps"] / ref["methods"]["user_device_get"]["gbps"]
        out.append(_target("gpu: offload >= 100x the per-block device_get loop", v, ">=",
                           100.0, "gpu", f"{format_bytes(ref['bytes'])} per call"))
    return out


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def run_bench(quick: bool = False, out_dir: str | None = None, *,
              config: BenchConfig | None = None,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns the report (also written to ``out_dir``).

    Args:
      quick: the quick preset (under a minute on a 2-core CPU) instead of the full one.
      out_dir: when given, writes ``bench.json`` there and, when matplotlib is
        importable, ``bench.png`` (throughput vs transfer size).
      config: explicit sizes (overrides ``quick``); see ``BenchConfig``.
      progress: called with a line per case as the run goes.

    Returns:
      A JSON-ready dict: ``meta``, ``throughput``, ``sweep``, ``concurrency``,
      ``overhead``, ``integrity_traffic``, ``cache_size``, ``memory``, ``targets``,
      ``not_measured`` (and ``files`` when written).
    """
    cfg = config or (BenchConfig.quick() if quick else BenchConfig.full())
    say = progress or (lambda line: None)
    started = _now()
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    report: dict[str, Any] = {
        "schema": "kvxfer-bench/1",
        "meta": {"date": datetime.date.today().isoformat(), "platform": dev.platform,
                 "device": getattr(dev, "device_kind", str(dev)),
                 "jax_version": jax.__version__, "python": platform.python_version(),
                 "source": _source(),
                 "cpu_count": os.cpu_count() or 1, "quick": bool(quick and config is None),
                 "config": cfg.as_dict(),
                 "stat_note": "throughput from the best repeat; p50/p99 over repeats; "
                              "variants interleaved repeat by repeat"}}
    ordered = sorted(cfg.cells, key=lambda c: c != cfg.reference)
    capacity = max([cfg.batch_bytes] + [n * cfg.layers * cfg.prefix_page_bytes
                                         for n in cfg.prefix_pages])
    limit = _make_limit(capacity)
    report["meta"]["limit_method"] = limit.method
    try:
        report["throughput"] = [
            _throughput_cell(cfg, limit, page, dtype,
                             reference=(page, dtype) == cfg.reference, report=report, say=say)
            for page, dtype in ordered]
        if not cfg.sweep_on_reference:
            report["sweep"] = _prefix_sweep(cfg, limit, say)
    finally:
        limit.close()
        del limit
        gc.collect()
    report["cache_size"] = _cache_size_section(cfg, say)
    report["targets"] = _targets(cfg, report, gpu)
    report["not_measured"] = report["memory"].pop("not_measured")
    report["meta"]["wall_s"] = _now() - started
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        files = {"json": os.path.join(out_dir, "bench.json")}
        png = _plot(report, os.path.join(out_dir, "bench.png"))
        if png:
            files["plot"] = png
        else:
            report["not_measured"].append("plot: matplotlib is not importable")
        report["files"] = files
        with open(files["json"], "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return report


def _source() -> str:
    """The kvxfer source measured: its git commit and whether ``kvxfer/`` is modified."""
    import subprocess

    import kvxfer

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvxfer.__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain",
                                "--untracked-files=no", "--", "kvxfer"],
                               capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return f"kvxfer {kvxfer.__version__}"
    return f"kvxfer {kvxfer.__version__}, git {head.stdout.strip()}" + \
        (" with uncommitted changes to kvxfer/" if dirty.stdout.strip() else "")


def iter_figures(obj: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a report with its path (booleans are flags, not figures)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_figures(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from iter_figures(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _gb(s: dict[str, Any] | None) -> str:
    return "-" if s is None else f"{s['gbps']:.2f} ({s['fraction_of_limit']:.2f}x)"


def _ms(x: float) -> str:
    return f"{x * 1e3:.3f}" if x < 0.01 else f"{x * 1e3:.1f}"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable report: tables, then the PASS/MISS target lines."""
    meta = report["meta"]
    cfg = meta["config"]
    gpu = meta["platform"] == "gpu"
    lines = [f"kvxfer bench — {meta['date']}, {meta['platform']} ({meta['device']}), "
             f"jax {meta['jax_version']}, {meta['cpu_count']} CPUs"
             f"{', quick' if meta['quick'] else ''}",
             f"source: {meta['source']}; limit: {meta['limit_method']}",
             "GB/s = 1e9 bytes/s from the best repeat; (x) = fraction of the limit measured "
             "in the same case; times in ms", ""]
    d2h = "pinned d2h" if gpu else "memcpy"
    lines.append(f"Offload throughput, {format_bytes(cfg['batch_bytes'])} per call, "
                 f"{cfg['layers']} layers")
    rows = []
    for r in report["throughput"]:
        m = r["methods"]
        rows.append([format_bytes(r["page_bytes"]), r["dtype"], r["pages"],
                     f"{r['limit']['d2h']['gbps']:.2f}", _gb(m["user_device_get"]),
                     _gb(m["user_gather_pinned"]), _gb(m.get("user_batched_gather_pinned")),
                     _gb(m["offload_off"]), _gb(m["offload_page"]),
                     f"{m['offload_page']['gbps'] / m['offload_off']['gbps']:.2f}",
                     f"{m['offload_page']['first_call_s']:.2f}"])
    lines.append(table(rows, ["page", "dtype", "pages", d2h, "user device_get/block",
                              "user gather->pinned/block", "user gather->pinned batched",
                              "kvxfer off", "kvxfer page", "page/off",
                              "page 1st call s"]))
    lines += ["", f"Load throughput, {format_bytes(cfg['batch_bytes'])} per call"]
    rows = []
    for r in report["throughput"]:
        m = r["methods"]
        rows.append([format_bytes(r["page_bytes"]), r["dtype"],
                     f"{r['limit']['h2d']['gbps']:.2f}", _gb(m["load_off_all"]),
                     _gb(m["load_off_layer"]), _gb(m["load_page_all"]),
                     _gb(m["load_page_layer"]),
                     f"{m['load_page_all']['gbps'] / m['load_off_all']['gbps']:.2f}",
                     f"{m['load_page_all']['first_call_s']:.2f}", ",".join(r["paths"])])
    lines.append(table(rows, ["page", "dtype", "h2d pinned" if gpu else "memcpy",
                              "off/all", "off/layer", "page/all", "page/layer", "page/off",
                              "page 1st call s", "path"]))
    lines += ["", f"Prefix sweep ({format_bytes(cfg['prefix_page_bytes'])} bfloat16 pages, "
              f"{cfg['layers']} layers): throughput and hit latency (load call -> layer "
              "ready) p50/p99 ms"]
    rows = []
    for r in report["sweep"]:
        m = r["methods"]
        lp, la = m["load_page_layer"], m["load_page_all"]
        rows.append([r["pages"], format_bytes(r["bytes"]), f"{r['limit']['d2h']['gbps']:.2f}",
                     f"{m['user_device_get']['gbps']:.3f}",
                     f"{m['user_gather_pinned']['gbps']:.2f}",
                     _gb(m["offload_off"]), _gb(m["offload_page"]), _gb(m["load_off_all"]),
                     _gb(la),
                     f"{_ms(lp['first_layer']['p50_s'])}/{_ms(lp['first_layer']['p99_s'])}",
                     f"{_ms(lp['last_layer']['p50_s'])}/{_ms(lp['last_layer']['p99_s'])}",
                     f"{_ms(la['last_layer']['p50_s'])}/{_ms(la['last_layer']['p99_s'])}",
                     f"{_ms(m['load_off_layer']['first_layer']['p50_s'])}"])
    lines.append(table(rows, ["pages", "bytes", "limit", "user devget", "user gather/blk",
                              "offload off", "offload page", "load off", "load page",
                              "first layer (page,layer)", "last layer (page,layer)",
                              "last (page,all)", "first layer (off,layer) p50"]))
    lines += ["", "Concurrency (requests in flight before waiting; gate all)"]
    rows = [[r["op"], r["integrity"], r["in_flight"], format_bytes(r["request_bytes"]),
             f"{r['aggregate']['gbps']:.2f}", _ms(r["issue_p50_s"]),
             f"{_ms(r['request_latency']['p50_s'])}/{_ms(r['request_latency']['p99_s'])}"]
            for r in report["concurrency"]]
    lines.append(table(rows, ["op", "integrity", "in flight", "request", "aggregate GB/s",
                              "issue all p50", "request latency p50/p99"]))
    lines += ["", "Host overhead: time inside the offload()/load() call (ms)"]
    rows = [[r["op"], r["integrity"], r["gate"], f"{r['pages']} x {r['layers']}",
             _ms(r["call"]["best_s"]), _ms(r["call"]["p50_s"]), _ms(r["call"]["p99_s"]),
             _ms(r["total"]["p50_s"])] for r in report["overhead"]]
    lines.append(table(rows, ["op", "integrity", "gate", "pages x layers", "call best",
                              "call p50", "call p99", "call+wait p50"]))
    lines += ["", "Integrity traffic per call (derived from the digest programs' shapes)"]
    rows = [[r["pages"], format_bytes(r["payload_bytes"]),
             format_bytes(r["device_read_bytes_offload"]),
             format_bytes(r["device_read_bytes_load"]), format_bytes(r["host_digest_bytes"]),
             format_bytes(r["identity_bytes"]), f"{r['extra_over_payload']:.3f}"]
            for r in report["integrity_traffic"]]
    lines.append(table(rows, ["pages", "payload", "extra device read (offload)",
                              "extra device read (load)", "host digests", "identities",
                              "extra/payload per direction"]))
    cs = report["cache_size"]
    lines += ["", f"Load {cs['blocks']} blocks ({format_bytes(cs['bytes'])}) into a "
              f"{format_bytes(cs['large_cache_bytes'])} vs a "
              f"{format_bytes(cs['small_cache_bytes'])} cache (ms; gate all)"]
    rows = [[name, f"{_ms(v['small']['best_s'])}/{_ms(v['small']['p50_s'])}",
             f"{_ms(v['large']['best_s'])}/{_ms(v['large']['p50_s'])}", f"{v['ratio']:.2f}"]
            for name, v in cs["variants"].items()]
    lines.append(table(rows, ["variant", "small best/p50", "large best/p50",
                              "large/small (best)"]))
    mem = report["memory"]
    lines += ["", "Memory",
              f"  host pool {format_bytes(mem['pool_bytes'])} ({mem['pool_bytes']} B) vs plan "
              f"{format_bytes(mem['plan_bytes'])} ({mem['plan_bytes']} B): "
              f"{mem['pool_over_plan']:.4f}x"]
    if "host_transient_bytes" in mem:
        lines.append(f"  host RSS beyond caches and pools during one offload + load of "
                     f"{format_bytes(mem['payload_bytes'])}: "
                     f"{format_bytes(mem['host_transient_bytes'])}")
    if "device_persistent_bytes" in mem:
        lines.append(f"  device memory beyond caches: "
                     f"{format_bytes(mem['device_persistent_bytes'])} held, peak "
                     f"{format_bytes(mem.get('device_transient_bytes'))}")
    for note in report["not_measured"]:
        lines.append(f"  not measured: {note}")
    lines += ["", "Targets"]
    for t in report["targets"]:
        lines.append(f"{t['status']}  {t['name']}: {t['value']:.3g} ({t['where']})")
    lines.append(f"\n(wall time {report['meta']['wall_s']:.0f} s)")
    return "\n".join(lines)


def _plot(report: dict[str, Any], path: str) -> str | None:
    """Throughput vs transfer size (offload and load panels); None without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    sweep = report["sweep"]
    x = [r["bytes"] / MiB for r in sweep]
    fig = Figure(figsize=(12, 6.5))
    FigureCanvasAgg(fig)
    gpu = report["meta"]["platform"] == "gpu"
    panels = (("offload (device -> host)", "d2h",
               (("user device_get / block", "user_device_get", ":"),
                ("user gather -> pinned / block", "user_gather_pinned", "-."),
                ("user gather -> pinned, batched", "user_batched_gather_pinned", "-."),
                ("kvxfer integrity off", "offload_off", "-"),
                ("kvxfer integrity page", "offload_page", "-"))),
              ("load (host -> device)", "h2d",
               (("kvxfer integrity off, gate all", "load_off_all", "-"),
                ("kvxfer integrity page, gate all", "load_page_all", "-"),
                ("kvxfer integrity page, gate layer", "load_page_layer", "--"))))
    for i, (title, direction, series) in enumerate(panels):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.plot(x, [r["limit"][direction]["gbps"] for r in sweep], "k-", lw=2,
                label=("pinned memcpy" if gpu else "memcpy") + " (limit)")
        for label, key, style in series:
            pts = [(r["bytes"] / MiB, r["methods"][key]["gbps"]) for r in sweep
                   if key in r["methods"]]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per call (MiB)")
        ax.set_ylabel("GB/s (best repeat)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    meta = report["meta"]
    fig.suptitle(f"kvxfer bench {meta['date']}: {meta['platform']} ({meta['device']}), "
                 f"{report['sweep'][0]['layers']} layers x "
                 f"{format_bytes(report['sweep'][0]['page_bytes'])} bf16 pages")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _cmd_bench(args: argparse.Namespace) -> int:
    def progress(line: str) -> None:
        print(f"kvxfer bench: {line}", file=sys.stderr, flush=True)

    report = run_bench(quick=args.quick, out_dir=args.out, progress=progress)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
        if "files" in report:
            print("wrote " + ", ".join(report["files"].values()))
    return 0


def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``bench`` to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "bench", help="measure kvxfer against the physical limit and user baselines",
        description="Measures, side by side in one run: the physical limit (memcpy on "
        "CPU, pinned host<->device copy on GPU), what users write today (per-block "
        "device_get, jitted gather -> pinned_host) and KVCacheManager offload/load with "
        "integrity off/page and gate all/layer; prints tables and PASS/MISS target lines.")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--out", metavar="DIR",
                   help="write bench.json (and bench.png when matplotlib is importable) here")
    p.add_argument("--quick", action="store_true",
                   help="fewer cases and repeats (under a minute on a 2-core CPU)")
    p.set_defaults(func=_cmd_bench)
    return p
