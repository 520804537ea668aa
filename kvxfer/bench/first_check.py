"""The first minutes on a lent accelerator: short checks whose figures are kept as they come.

A device check starts here (``benchmarks/device_check.sh``), so a machine lent for a few
minutes cannot be spent before anything is known. Each step writes one JSON line to
``OUT/first.jsonl`` (flushed and synced) as soon as its figures exist, so a run cut
short still reports every step it finished; a step that fails records its error and
the next one runs. The steps, each on the DMA mover (``path="dma"``):

* ``versions``: python, jax, jaxlib, the device, kvxfer, and the copy engine (driver
  version and ``cuMemcpyBatchAsync`` ABI on CUDA), or why the DMA mover is refused;
* ``callback_spy``: what the programs' callbacks saw: on a GPU the caller's thread at
  dispatch, ``ctx.stream`` an int, the ticket's job found;
* what broke in the mover before (``kvxfer.bench._hazards``): ``several_groups``
  (loads whose layer groups hold several layers, integrity off and on, byte for byte),
  ``partial_enqueue`` (a driver call failing after some copies were enqueued: the
  error, the caches, the next transfer, and fresh device arrays left as written),
  ``allocator_reuse`` (prefetch/release and load cycles with fresh arrays allocated
  between them), ``load_behind_offload`` (a load's last layer while a 1 GiB offload
  is in flight, against the load alone and the link) and ``busy_thread`` (loads while
  a thread spins in Python);
* ``round_trips``: exact round trips of bfloat16 and float8_e4m3fn blocks in a random
  order, relayout never and always, and in place (a load's arrays keep their
  buffers);
* ``callback_faults``: each step of the callback failing in turn: the transfers fail
  with ``TransferError``, the caches stay alive with every byte;
* ``no_cache_copy``: the compiled load program copies no cache (no ``copy`` of a
  cache's shape, temporaries smaller than the caches);
* ``copy_sizes``: throughput per bytes per copy against one large pinned copy of the
  same bytes (``kvxfer.bench.limits``);
* ``caller_time``: the caller's time per ``offload()`` and ``load()`` call;
* ``overlap``: how long a model-sized matmul dispatched right after an ``offload()``
  takes to finish, against the same matmul alone, with the offload's copies beside
  XLA's stream (the default) and on it (``DmaOptions(stream="xla")``).

On XLA:CPU every step runs with ``CheckConfig.small()`` (the tests run it there); the
figures mean something on an accelerator only.

Usage:  python -m kvxfer.bench.first_check OUTDIR [--small] [--steps A,B | --skip A,B]
(``--steps`` runs those steps only, ``--skip`` all others: a device check runs the
first steps under a time limit of their own, so a hang there costs nothing after.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import kvxfer
from kvxfer import testing
from kvxfer.bench._config import BenchConfig
from kvxfer.bench._copysizes import copy_size_section
from kvxfer.bench._hazards import HAZARD_STEPS, fails
from kvxfer.bench.limits import make_limit
from kvxfer.bench.timing import Progress, now, stats
from kvxfer.engine import DmaMover, copy_engine, dma_refusal, layers_of
from kvxfer.testing import CALLBACK_STEPS, callback_fault, spy_callbacks
from kvxfer.layout import short_dtype_name

__all__ = ["CheckConfig", "STEPS", "run", "main", "cache_copies"]

KiB, MiB = 1 << 10, 1 << 20

Figures = dict[str, Any]
Step = Callable[["CheckConfig"], tuple[bool, Figures]]


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    """Sizes of the first check.

    Attributes:
      layers: layers of the round-trip, caller-time and overlap caches.
      block_bytes: bytes of one block of one layer.
      pages: pages per round trip and per timed call.
      offload_bytes: bytes of the offload the overlap step dispatches a matmul behind.
      matmul: the side of the square bfloat16 matmul of the overlap step.
      copy_sizes: bytes per copy of the copy-size step; copy_bytes: bytes per call there.
      repeats: timed repeats of each measured step.
      group_shapes: ``(layers, block bytes)`` of the classes whose layer groups hold
        several layers (blocks under 64 KiB), for the several-group, partial-enqueue
        (the first) and allocator-reuse (the first) steps.
      group_rounds: loads of new pages per class of the several-group step.
      reuse_cycles: prefetch/release and load cycles of the allocator-reuse step.
      behind_bytes: bytes of the offload a load is dispatched behind.
      busy_loads: timed loads, alone and beside a busy Python thread.
    """

    layers: int = 32
    block_bytes: int = 64 * KiB
    pages: int = 32
    offload_bytes: int = 256 * MiB
    matmul: int = 8192
    copy_sizes: tuple[int, ...] = (16 * KiB, 64 * KiB, 2 * MiB)
    copy_bytes: int = 64 * MiB
    repeats: int = 5
    group_shapes: tuple[tuple[int, int], ...] = ((8, 16 * KiB), (32, 4 * KiB))
    group_rounds: int = 4
    reuse_cycles: int = 40
    behind_bytes: int = 1 << 30
    busy_loads: int = 10

    @classmethod
    def small(cls) -> CheckConfig:
        """Tiny sizes: every step in seconds on XLA:CPU (figures mean little)."""
        return cls(layers=2, block_bytes=4 * KiB, pages=4, offload_bytes=256 * KiB,
                   matmul=128, copy_sizes=(4 * KiB, 16 * KiB), copy_bytes=64 * KiB,
                   repeats=2, group_rounds=2, reuse_cycles=4, behind_bytes=512 * KiB,
                   busy_loads=3)


def _caches(cfg: CheckConfig, blocks: int, dtype: str = "bfloat16",
            layers: int | None = None) -> list[jax.Array]:
    return testing.random_caches(layers or cfg.layers, blocks,
                                 testing.block_shape(cfg.block_bytes, dtype), dtype, seed=7)


def _on_gpu() -> bool:
    return jax.devices()[0].platform != "cpu"


# -- the steps --------------------------------------------------------------------

def _versions(cfg: CheckConfig) -> tuple[bool, Figures]:
    """Versions, the device, and the copy engine the DMA mover would use."""
    import jaxlib

    dev = jax.devices()[0]
    out: Figures = {"python": sys.version.split()[0], "jax": jax.__version__,
                    "jaxlib": jaxlib.__version__, "device": str(dev),
                    "platform": dev.platform, "kvxfer": kvxfer.__version__}
    why = dma_refusal(jnp.zeros((8, 128), jnp.bfloat16))
    out["dma"] = "available" if why is None else f"refused: {why}"
    if why is None:
        engine = copy_engine(dev)
        driver = getattr(engine, "driver", None)
        out.update(engine=engine.name, mode=getattr(engine, "mode", None),
                   driver=getattr(driver, "version", None),
                   batch_abi=getattr(driver, "batch_abi", None), numa=engine.numa_node())
    return why is None, out


def _callback_spy(cfg: CheckConfig) -> tuple[bool, Figures]:
    """What the DMA programs' callbacks saw during one offload and one load."""
    caches = _caches(cfg, 2 * cfg.pages)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=cfg.pages, path="dma")
    try:
        me = threading.get_ident()
        with spy_callbacks() as seen:
            pages = mgr.offload(caches, [0, 1], keys=[1, 2]).wait()
            caches, load = mgr.load(caches, pages, [2, 3])
            verified = load.result().verified_prefix == 2
    finally:
        mgr.close()
    out: Figures = {
        "callbacks": len(seen), "directions": sorted({str(r.direction) for r in seen}),
        "found": all(r.found for r in seen), "same_thread": all(r.thread == me for r in seen),
        "stream_types": sorted({type(r.stream).__name__ for r in seen}),
        "verified": verified}
    ok = out["found"] and len(seen) >= 2 and verified
    if _on_gpu():  # facts of the GPU client, not of XLA:CPU's thread pool
        ok = ok and out["same_thread"] and out["stream_types"] == ["int"]
    return ok, out


def _bits(a: jax.Array) -> np.ndarray:
    return testing.bits(a)


def _round_trips(cfg: CheckConfig) -> tuple[bool, Figures]:
    """Exact, in-place round trips: bfloat16 and fp8, relayout never and always (and
    bfloat16 with every copy on XLA's stream)."""
    rng = np.random.default_rng(0)
    out: Figures = {}
    # Offloads copy beside XLA's stream where the engine can (gathered rows, whatever
    # the relayout); the last case copies them on XLA's stream.
    cases = [(dt, mode, "side") for dt in ("bfloat16", "float8_e4m3fn")
             for mode in ("never", "always")] + [("bfloat16", "never", "xla")]
    for dtype, mode, stream in cases:
        blocks = 2 * cfg.pages
        caches = _caches(cfg, blocks, dtype)
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=cfg.pages, path="dma",
                                    dma=kvxfer.DmaOptions(relayout=mode, stream=stream))
        try:
            src = rng.permutation(blocks)[:cfg.pages].tolist()
            dst = rng.permutation(blocks)[:cfg.pages].tolist()
            before = [_bits(c) for c in caches]
            pointers = [c.unsafe_buffer_pointer() for c in caches]
            pages = mgr.offload(caches, src, keys=list(range(cfg.pages))).wait()
            caches, load = mgr.load(caches, pages, dst)
            verified = load.result().verified_prefix == cfg.pages
            exact = all(np.array_equal(_bits(c)[dst], b[src])
                        for c, b in zip(caches, before))
            in_place = [c.unsafe_buffer_pointer() for c in caches] == pointers
        finally:
            mgr.close()
        out[f"{dtype}-{mode}" + ("-xla" if stream == "xla" else "")] = {
            "verified": verified, "exact": exact, "in_place": in_place}
    ok = all(all(v.values()) for v in out.values())
    return ok, out


def _callback_faults(cfg: CheckConfig) -> tuple[bool, Figures]:
    """Each step of the callback failing in turn (``CALLBACK_STEPS``), bfloat16 and
    fp8 classes: the offload and the load fail with ``TransferError``, the failed
    load's caches are alive with every byte they held, and the next load lands."""
    caches = [_caches(cfg, 2 * cfg.pages, dt, layers=1)[0]
              for dt in ("bfloat16", "float8_e4m3fn")]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2 * cfg.pages, path="dma")
    out: Figures = {}
    try:
        n = min(cfg.pages, 4)
        pages = mgr.offload(caches, list(range(n)), keys=list(range(n))).wait()
        dst = list(range(cfg.pages, cfg.pages + n))
        for step in CALLBACK_STEPS:
            before = [_bits(c) for c in caches]
            with callback_fault(step):
                offload_failed = fails(mgr.offload(caches, [n], keys=[100]).wait)
                caches, load = mgr.load(caches, pages, dst)
                load_failed = fails(load.result)
            alive = not any(c.is_deleted() for c in caches) and all(
                np.array_equal(_bits(c), b) for c, b in zip(caches, before))
            caches, load = mgr.load(caches, pages, dst)
            out[step] = {"offload_failed": offload_failed, "load_failed": load_failed,
                         "caches_alive_and_exact": alive,
                         "then_verified": load.result().verified_prefix == n}
    finally:
        mgr.close()
    return all(all(v.values()) for v in out.values()), out


def _no_cache_copy(cfg: CheckConfig) -> tuple[bool, Figures]:
    """The compiled load program (relayout never and always) copies no cache."""
    out: Figures = {}
    for mode in ("never", "always"):
        caches = _caches(cfg, 2 * cfg.pages)
        options = kvxfer.DmaOptions(relayout=mode)
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=cfg.pages, path="dma",
                                    dma=options)
        try:
            mover = DmaMover(mgr.plan.classes[0], mgr.host_pool.pools[0], options)
            program = mover.compiled_load(layers_of(caches), cfg.pages, True)
        finally:
            mgr.close()
        # A load's temporaries hold its pages a few times (the blocks its digests read;
        # with relayout the gathered rows and the staging rows the copies land in),
        # never a whole cache; its outputs are its inputs (aliased).
        pages = (3 if mode == "always" else 1) * cfg.pages * cfg.layers * cfg.block_bytes
        out[mode] = {**cache_copies(program, caches), "pages_bytes": pages}
    return all(v["cache_copies"] == 0 and v["alias_bytes"] >= v["cache_bytes"] and
               v["temp_bytes"] < v["cache_bytes"] // cfg.layers + v["pages_bytes"]
               for v in out.values()), out


def cache_copies(program: Any, caches: Sequence[jax.Array]) -> Figures:
    """How many ``copy`` instructions of a cache's shape a compiled program holds, its
    temporaries, the bytes its outputs alias from its inputs, and the caches' bytes.

    Example:
        >>> cache = jnp.zeros((64, 128), jnp.float32)
        >>> step = jax.jit(lambda c: c.at[0].set(1.0), donate_argnums=0)
        >>> found = cache_copies(step.lower(cache).compile(), [cache])
        >>> found["cache_copies"], found["alias_bytes"] == found["cache_bytes"]
        (0, True)
    """
    text = program.as_text()
    shape = f"{short_dtype_name(caches[0].dtype)}[{','.join(map(str, caches[0].shape))}]"
    copies = len(re.findall(re.escape(shape) + r"(?:\{[^}]*\})?\s+copy(?:-start)?\(", text))
    memory = program.memory_analysis()
    temp = int(getattr(memory, "temp_size_in_bytes", 0)) if memory is not None else 0
    alias = int(getattr(memory, "alias_size_in_bytes", 0)) if memory is not None else 0
    return {"cache_copies": copies, "temp_bytes": temp, "alias_bytes": alias,
            "cache_bytes": sum(int(c.nbytes) for c in caches)}


def _copy_sizes(cfg: CheckConfig) -> tuple[bool, Figures]:
    """Throughput by bytes per copy, against one large pinned copy of the same bytes."""
    bench = dataclasses.replace(BenchConfig.smoke(), copy_sizes=cfg.copy_sizes,
                                copy_bytes=cfg.copy_bytes, repeats=cfg.repeats)
    progress = Progress(["copy sizes"] * len(cfg.copy_sizes), lambda line: None)
    with make_limit(cfg.copy_bytes) as limit:
        rows, why = copy_size_section(bench, limit, progress)
    out: Figures = {"rows": [{
        "copy_bytes": r["copy_bytes"], "copies": r["copies"],
        "limit_d2h_gbps": r["limit"]["d2h"]["gbps"], "limit_h2d_gbps": r["limit"]["h2d"]["gbps"],
        **{f"{m}_gbps": r["methods"][m]["gbps"] for m in ("offload", "load")},
        **{f"{m}_of_limit": r["methods"][m]["fraction_of_limit"] for m in ("offload", "load")}}
        for r in rows]}
    if why is not None:
        out["why"] = why
    return why is None and len(rows) == len(cfg.copy_sizes), out


def _caller_time(cfg: CheckConfig) -> tuple[bool, Figures]:
    """The caller's time per ``offload()`` and ``load()`` call of ``pages`` pages."""
    blocks = 2 * cfg.pages
    caches = _caches(cfg, blocks)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=3 * cfg.pages, path="dma")
    calls: dict[str, list[float]] = {"offload": [], "load": []}
    try:
        mgr.warmup(cfg.pages)
        held = mgr.offload(caches, list(range(cfg.pages)), keys=list(range(cfg.pages))).wait()
        ids = list(range(cfg.pages, blocks))
        for r in range(cfg.repeats + 1):
            keys = list(range(1000 * (r + 1), 1000 * (r + 1) + cfg.pages))
            t0 = now()
            handle = mgr.offload(caches, ids, keys=keys)
            t1 = now()
            caches, load = mgr.load(caches, held, ids)
            t2 = now()
            mgr.free(handle.wait())
            load.result()
            if r:  # the first call of each kind is a warm-up
                calls["offload"].append(t1 - t0)
                calls["load"].append(t2 - t1)
    finally:
        mgr.close()
    out = {f"{k}_call_ms": stats(v)["p50_s"] * 1e3 for k, v in calls.items()}
    out.update(pages=cfg.pages, layers=cfg.layers, target_ms=1.0,
               meets=all(v <= 1.0 for v in out.values()))
    return True, out


def _matmul(n: int) -> Callable[[], float]:
    """A square bfloat16 matmul of side ``n`` on the first device, compiled and run once:
    each call dispatches it and returns the seconds until its result is ready."""
    x = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16),
                       jax.devices()[0])
    matmul = jax.jit(lambda a: a @ a)
    matmul(x).block_until_ready()

    def timed() -> float:
        t0 = now()
        matmul(x).block_until_ready()
        return now() - t0
    return timed


def _overlap(cfg: CheckConfig) -> tuple[bool, Figures]:
    """A matmul dispatched right after an ``offload()`` of ``offload_bytes``, against
    the same matmul alone: wall time from its dispatch until it is ready; with the
    offload's copies beside XLA's stream (the default) and on it."""
    timed = _matmul(cfg.matmul)
    page = cfg.layers * cfg.block_bytes
    k = max(1, cfg.offload_bytes // page)
    caches = _caches(cfg, k)
    out: Figures = {"offload_bytes": k * page, "matmul": cfg.matmul}
    alone: list[float] = []
    for stream in ("side", "xla"):
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=k, path="dma",
                                    integrity="off", dma=kvxfer.DmaOptions(stream=stream))
        after, calls = [], []
        try:
            mgr.free(mgr.offload(caches, list(range(k)), keys=list(range(k))).wait())
            for r in range(cfg.repeats):
                alone.append(timed())
                t0 = now()
                handle = mgr.offload(caches, list(range(k)), keys=list(range(k)))
                calls.append(now() - t0)
                after.append(timed())
                mgr.free(handle.wait())
        finally:
            mgr.close()
        suffix = "" if stream == "side" else "_xla_stream"
        out[f"after_offload{suffix}_ms"] = stats(after)["p50_s"] * 1e3
        out[f"offload_call{suffix}_ms"] = stats(calls)["p50_s"] * 1e3
    a = stats(alone)["p50_s"] * 1e3
    out.update(alone_ms=a, ratio=out["after_offload_ms"] / a,
               ratio_xla_stream=out["after_offload_xla_stream_ms"] / a, target_ratio=1.1)
    out["meets"] = out["ratio"] <= 1.1
    return True, out


def _load_overlap(cfg: CheckConfig) -> tuple[bool, Figures]:
    """A ``gate="layer"`` load of ``offload_bytes`` of pages: from ``load()`` until its
    last layer is released, against one pinned host-to-device copy of the same bytes
    plus one layer's share of it (target 1.1x); and a matmul dispatched right after
    ``prefetch()`` (its copies under way beside XLA's stream) against the same matmul
    alone."""
    timed = _matmul(cfg.matmul)
    page = cfg.layers * cfg.block_bytes
    k = max(1, cfg.offload_bytes // page)
    with make_limit(k * page) as limit:
        runners = limit.runners(k * page)
        link = runners.get("h2d") or runners["memcpy"]
        link()
        copy = stats([link() for _ in range(cfg.repeats)])["p50_s"]
    caches = _caches(cfg, k)
    ids = list(range(k))
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=k, path="dma", integrity="off")
    last, after, alone = [], [], []
    try:
        pages = mgr.offload(caches, ids, keys=ids).wait()
        for r in range(cfg.repeats + 1):
            t0 = now()
            caches, load = mgr.load(caches, pages, ids, gate="layer")
            load.layer_ready(cfg.layers - 1)
            t1 = now()
            load.result()
            by_itself = timed()
            staged = mgr.prefetch(pages)
            behind = timed()
            caches, load = mgr.load(caches, pages, ids, prefetched=staged)
            load.result()
            if r:  # the first round is a warm-up
                last.append(t1 - t0)
                alone.append(by_itself)
                after.append(behind)
        fallbacks = mgr.stats()["dma_fallbacks"]
    finally:
        mgr.close()
    bound = copy * (1 + 1 / cfg.layers)
    out: Figures = {"load_bytes": k * page, "layers": cfg.layers,
                    "last_layer_ms": stats(last)["p50_s"] * 1e3, "copy_ms": copy * 1e3,
                    "matmul_alone_ms": stats(alone)["p50_s"] * 1e3,
                    "matmul_after_prefetch_ms": stats(after)["p50_s"] * 1e3,
                    "dma_fallbacks": fallbacks}
    out.update(ratio=out["last_layer_ms"] / (bound * 1e3),
               prefetch_ratio=out["matmul_after_prefetch_ms"] / out["matmul_alone_ms"],
               target_ratio=1.1)
    out["meets"] = out["ratio"] <= 1.1 and out["prefetch_ratio"] <= 1.1
    return True, out


STEPS: tuple[tuple[str, Step], ...] = (
    ("versions", _versions), ("callback_spy", _callback_spy), *HAZARD_STEPS,
    ("round_trips", _round_trips), ("callback_faults", _callback_faults),
    ("no_cache_copy", _no_cache_copy), ("copy_sizes", _copy_sizes),
    ("caller_time", _caller_time), ("overlap", _overlap), ("load_overlap", _load_overlap))
"""The steps, in the order they run: the versions and what the callbacks see, then what
broke in the DMA mover before (``kvxfer.bench._hazards``), then the rest, what is
cheapest and says the most first."""


def run(out_dir: str | os.PathLike, cfg: CheckConfig,
        steps: Sequence[tuple[str, Step]] = STEPS, say: Callable[[str], None] = print) -> bool:
    """Runs the steps, appending each one's record to ``out_dir/first.jsonl`` as it ends.

    A record is ``{"step", "ok", "seconds", ...figures}``, or ``"error"`` where the
    step raised. Returns whether every step was ok.

    Example:
        >>> import tempfile
        >>> out = tempfile.mkdtemp()
        >>> run(out, CheckConfig.small(), [("one", lambda cfg: (True, {"pages": cfg.pages}))],
        ...     say=lambda line: None)
        True
        >>> json.loads(open(os.path.join(out, "first.jsonl")).read())["pages"]
        4
    """
    path = pathlib.Path(out_dir) / "first.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    all_ok = True
    for name, step in steps:
        t0 = now()
        try:
            ok, figures = step(cfg)
        except Exception as e:  # a step that cannot run is a failed step; the next runs
            ok, figures = False, {"error": f"{type(e).__name__}: {e}"}
        record = {"step": name, "ok": bool(ok), "seconds": round(now() - t0, 3), **figures}
        line = json.dumps(record, default=str)
        with open(path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        say(line)
        all_ok &= bool(ok)
    return all_ok


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m kvxfer.bench.first_check OUTDIR [--small]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for first.jsonl")
    parser.add_argument("--small", action="store_true", help="tiny sizes (CPU dry run)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--steps", type=_names, help="run these steps only (A,B,...)")
    which.add_argument("--skip", type=_names, help="run every step but these (A,B,...)")
    args = parser.parse_args(argv)
    cfg = CheckConfig.small() if args.small else CheckConfig()
    steps = [(name, step) for name, step in STEPS
             if (args.steps is None or name in args.steps)
             and (args.skip is None or name not in args.skip)]
    return 0 if run(args.out, cfg, steps) else 1


def _names(text: str) -> list[str]:
    """Step names, comma-separated, each one of ``STEPS``."""
    names = [n for n in text.split(",") if n]
    known = [name for name, _ in STEPS]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown steps {unknown}: expected some of {known}")
    return names


if __name__ == "__main__":
    sys.exit(main())
