"""The DMA mover where it broke: device checks that run first on a lent GPU.

Steps of ``kvxfer.bench.first_check`` (``step(cfg) -> (ok, figures)``), each through the
public API on ``path="dma"``, each comparing bytes rather than trusting a digest:

* ``several_groups``: loads whose layer groups hold several layers (shard blocks under
  64 KiB: 8 layers of 16 KiB, 32 layers of 4 KiB), with ``integrity="off"`` (a group
  scattered from staging its copies had not reached yet would pass unseen) and with
  integrity on; new pages every round, so staging left from a round before holds
  other bytes; every other round through ``prefetch()``;
* ``partial_enqueue``: a CUDA driver call failing after some copies were enqueued
  (``kvxfer.testing.driver_fault``: the second ``cuMemcpyAsync`` of a copy loop, the
  second ``cuMemcpyBatchAsync`` of a several-group load, the second ``cuEventRecord``),
  in each direction: the transfer fails with ``TransferError``, the caches are alive
  and no block holds bytes that are neither its old nor its new ones, the next
  transfer is exact, and device arrays allocated right after the failure still hold
  what they were filled with once every copy is over (nothing was let go of under a
  copy). Skipped without a CUDA driver (XLA:CPU's host copy engine) or without the
  hook;
* ``allocator_reuse``: ``prefetch()``/``release()`` and load cycles with fresh device
  arrays allocated between them (where the allocator hands out staging let go of
  too early): every load's blocks compared on the device right after it, the fresh
  arrays compared at the end;
* ``load_behind_offload``: from ``load()`` to the load's last layer ready while a large
  offload (1 GiB) is in flight, against the load alone and against the link's time
  for the same bytes (with a stream per direction it does not queue behind the
  offload);
* ``busy_thread``: loads while another thread spins in Python (holding the GIL
  whenever it can): still exact, and their times against the same loads without it.

No figure is judged: times are reported beside the link's own time for the same bytes,
measured in the same run (``kvxfer.bench.limits``); ``ok`` is about bytes and errors.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

import kvxfer
from kvxfer import testing
from kvxfer.bench.limits import make_limit
from kvxfer.bench.timing import now, stats

__all__ = ["HAZARD_STEPS", "Sizes", "fails", "wrong_layers", "foreign_blocks", "fill", "intact"]

Figures = dict[str, Any]


class Sizes(Protocol):
    """The sizes these steps read (``kvxfer.bench.first_check.CheckConfig`` has them)."""

    layers: int
    block_bytes: int
    pages: int
    repeats: int
    group_shapes: tuple[tuple[int, int], ...]
    group_rounds: int
    reuse_cycles: int
    behind_bytes: int
    busy_loads: int

#: Seconds any one wait of a step may take before the step fails (a hang is a finding).
WAIT_S = 60.0

#: How long the copies of a transfer that failed may still run before the fresh arrays
#: are compared: many times a late copy's few milliseconds.
SETTLE_S = 0.2


def fails(wait: Callable[[], Any]) -> bool:
    """Whether ``wait()`` raises ``kvxfer.TransferError`` (anything else propagates)."""
    try:
        wait()
    except kvxfer.TransferError:
        return True
    return False


def _on_gpu() -> bool:
    return jax.devices()[0].platform != "cpu"


def _caches(layers: int, blocks: int, block_bytes: int, seed: int) -> list[jax.Array]:
    return testing.random_caches(layers, blocks, testing.block_shape(block_bytes, "bfloat16"),
                                 "bfloat16", seed=seed)


@jax.jit
def _gather_bits(caches: list[jax.Array], ids: jax.Array) -> list[jax.Array]:
    return [jax.lax.bitcast_convert_type(c, jnp.dtype(f"uint{8 * c.dtype.itemsize}"))[ids]
            for c in caches]


def block_bits(caches: Sequence[jax.Array], ids: Sequence[int]) -> list[np.ndarray]:
    """The bits of blocks ``ids`` of every layer, gathered on the device (a cache need
    not cross whole)."""
    got = _gather_bits(list(caches), jnp.asarray(np.asarray(ids, np.int32)))
    return [np.array(g) for g in got]


@jax.jit
def _blocks_match(caches: list[jax.Array], ids: jax.Array, want: list[jax.Array]) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(g == w) for g, w in zip(_gather_bits(caches, ids), want)]))


def wrong_layers(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> list[int]:
    """The layers whose blocks' bits differ from those wanted.

    Example:
        >>> a = [np.zeros((2, 4), np.uint16), np.ones((2, 4), np.uint16)]
        >>> wrong_layers(a, [np.zeros((2, 4), np.uint16)] * 2)
        [1]
    """
    return [i for i, (g, w) in enumerate(zip(got, want)) if not np.array_equal(g, w)]


def foreign_blocks(got: Sequence[np.ndarray], old: Sequence[np.ndarray],
                   new: Sequence[np.ndarray]) -> list[tuple[int, int]]:
    """``(layer, block)`` pairs whose bits are neither the block's old nor its new ones
    (a failed load may leave either, never a third value).

    Example:
        >>> old, new = [np.zeros((3, 2), np.uint8)], [np.ones((3, 2), np.uint8)]
        >>> foreign_blocks([np.array([[0, 0], [1, 1], [0, 7]], np.uint8)], old, new)
        [(0, 2)]
    """
    out = []
    for layer, (g, o, n) in enumerate(zip(got, old, new)):
        flat = g.shape[0], -1
        g, o, n = g.reshape(flat), o.reshape(flat), n.reshape(flat)
        bad = ~((g == o).all(axis=1) | (g == n).all(axis=1))
        out += [(layer, int(b)) for b in np.flatnonzero(bad)]
    return out


_FILL = [0xA5C30000]


def fill(nbytes: int) -> list[tuple[jax.Array, int]]:
    """Fresh device arrays, filled on the device right now, of ``nbytes``, a half and a
    quarter of it (where an allocator would put memory let go of just now), each with
    a value of its own: ``(array, value)``."""
    out = []
    for size in (nbytes, nbytes // 2, nbytes // 4):
        _FILL[0] = (_FILL[0] + 1) & 0xFFFFFFFF
        out.append((jnp.full((max(1, size // 4),), _FILL[0], jnp.uint32), _FILL[0]))
    return out


def intact(filled: Sequence[tuple[jax.Array, int]]) -> bool:
    """Whether every array ``fill`` made still holds only its value.

    Example:
        >>> f = fill(1 << 12)
        >>> intact(f), intact([(f[0][0].at[3].set(0), f[0][1])])
        (True, False)
    """
    checks = [jnp.all(a == jnp.uint32(v)) for a, v in filled]
    return all(bool(c) for c in checks)


def _free(mgr: kvxfer.KVCacheManager, pages: Sequence[kvxfer.PageRef]) -> None:
    """Frees the pages still valid (a load may have freed bad ones itself)."""
    mgr.free([p for p in pages if mgr.is_valid(p)])


def _link(nbytes: int, direction: str, repeats: int) -> float:
    """Seconds of one pinned copy of ``nbytes`` in ``direction`` (``"h2d"``, ``"d2h"``;
    a memcpy off GPU), p50 of ``repeats``: the physical limit in this run."""
    with make_limit(nbytes) as limit:
        runners = limit.runners(nbytes)
        link = runners.get(direction) or runners["memcpy"]
        link()
        return stats([link() for _ in range(max(1, repeats))])["p50_s"]


# -- several layers a group ---------------------------------------------------------

def several_groups(cfg: Sizes) -> tuple[bool, Figures]:
    """Loads of classes whose layer groups hold several layers, integrity off and on,
    compared byte for byte: every loaded block, and every block the load must not
    touch. New pages each round; the first round compiles (its copies may finish
    behind the compile), the later ones load with programs ready, every other one
    through ``prefetch()``."""
    rng = np.random.default_rng(3)
    out: Figures = {}
    for layers, block in cfg.group_shapes:
        for integrity in ("off", "page"):
            key = f"{layers}x{block >> 10}KiB-integrity-{integrity}"
            try:
                out[key] = _group_case(cfg, layers, block, integrity, rng)
            except Exception as e:  # noqa: BLE001 - recorded; the other classes still run
                out[key] = {"error": f"{type(e).__name__}: {e}", "exact": False,
                            "verified": False}
    return all(v["exact"] and v["verified"] for v in out.values()), out


def _group_case(cfg: Sizes, layers: int, block: int, integrity: str,
                rng: np.random.Generator) -> Figures:
    """One class of ``several_groups``: its rounds and whether all were exact."""
    n, blocks = cfg.pages, 3 * cfg.pages
    caches = _caches(layers, blocks, block, seed=layers)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2 * n, path="dma",
                                integrity=integrity)
    rounds = []
    try:
        for r in range(cfg.group_rounds):
            order = rng.permutation(blocks)
            src, dst = order[:n].tolist(), order[n:2 * n].tolist()
            rest = np.setdiff1d(np.arange(blocks), dst)
            before = [testing.bits(c) for c in caches]
            pages = mgr.offload(caches, src, keys=list(range(1000 * r, 1000 * r + n))
                                ).wait(WAIT_S)
            staged = mgr.prefetch(pages) if r % 2 else None
            caches, load = mgr.load(caches, pages, dst, prefetched=staged)
            result = load.result(WAIT_S)
            after = [testing.bits(c) for c in caches]
            rounds.append({
                "prefetched": staged is not None,
                "verified_prefix": result.verified_prefix,
                "wrong_layers": wrong_layers([a[dst] for a in after], [b[src] for b in before]),
                "stray_layers": wrong_layers([a[rest] for a in after],
                                             [b[rest] for b in before]),
                "reasons": {str(k): v for k, v in list(result.reasons.items())[:2]}})
            _free(mgr, pages)
        fallbacks = mgr.stats()["dma_fallbacks"]
    finally:
        mgr.close()
    return {"layers": layers, "block_bytes": block, "pages": n, "rounds": rounds,
            "exact": all(not r["wrong_layers"] and not r["stray_layers"] for r in rounds),
            "verified": all(r["verified_prefix"] == n for r in rounds),
            "dma_fallbacks": fallbacks}


# -- a driver call failing after copies were enqueued -------------------------------

#: (direction, DmaOptions.copy, driver entry point, its call that fails, from 0).
DRIVER_CASES: tuple[tuple[str, str, str, int], ...] = (
    ("load", "loop", "cuMemcpyAsync", 1),
    ("load", "batch", "cuMemcpyBatchAsync", 1),
    ("load", "batch", "cuEventRecord", 1),
    ("offload", "loop", "cuMemcpyAsync", 1),
    ("offload", "batch", "cuEventRecord", 1),
)


def _batch_abi() -> Any:
    """The driver's ``cuMemcpyBatchAsync`` ABI as the copy engine reports it (None:
    none, or not reported)."""
    try:
        from kvxfer.engine import copy_engine
        return getattr(getattr(copy_engine(jax.devices()[0]), "driver", None), "batch_abi", None)
    except Exception:  # noqa: BLE001 - only a figure
        return None


def partial_enqueue(cfg: Sizes) -> tuple[bool, Figures]:
    """A driver call failing after some copies were enqueued, each direction
    (``DRIVER_CASES``): ``TransferError``, caches alive, the next transfer exact, and
    nothing let go of under the copies (fresh device arrays stay as filled)."""
    if not _on_gpu():
        return True, {"skipped": "no CUDA driver (XLA:CPU's host copy engine)"}
    if not hasattr(testing, "driver_fault"):
        return True, {"skipped": "this kvxfer has no kvxfer.testing.driver_fault"}
    layers, block = cfg.group_shapes[0]  # several layers a group: several batches a load
    n = cfg.pages
    staging = n * layers * block
    batch_abi = _batch_abi()
    out: Figures = {"layers": layers, "block_bytes": block, "pages": n,
                    "batch_abi": batch_abi}
    for copy in ("loop", "batch"):
        # Blocks: a, the pages' source; b, the failing loads' target; c, the failing
        # offloads' source; d, the retried offload's (bytes no late copy carries); e,
        # the target of the load after a failed load.
        caches = _caches(layers, 5 * n, block, seed=11)
        a, b, c, d, e = (list(range(i * n, (i + 1) * n)) for i in range(5))
        # Slots in descending order, blocks ascending: no two pages' copies merge, so
        # a transfer is several driver calls even where a group holds every layer.
        low, high = list(range(n))[::-1], list(range(n, 2 * n))[::-1]
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2 * n, path="dma",
                                    dma=kvxfer.DmaOptions(copy=copy))
        try:
            pages = mgr.offload(caches, a, keys=a, slots=low).wait(WAIT_S)
            # Compiled before any fault: a case's copies are not hidden behind a compile.
            caches, load = mgr.load(caches, pages, e)
            load.result(WAIT_S)
            mgr.free(mgr.offload(caches, c, keys=c, slots=high).wait(WAIT_S))
            for direction, mode, name, at in DRIVER_CASES:
                if mode != copy:
                    continue
                key = f"{direction}-{copy}-{name}@{at}"
                try:
                    caches, case = _partial_case(mgr, caches, pages, direction, name, at,
                                                 (a, b, c, d, e), high, staging)
                except Exception as err:  # noqa: BLE001 - recorded; the next mode runs
                    # These caches may be gone: the next copy mode starts afresh.
                    out[key] = {"error": f"{type(err).__name__}: {err}", "ok": False}
                    break
                if not case["reached"] and name == "cuMemcpyBatchAsync" and not batch_abi:
                    case["skipped"] = "the driver has no cuMemcpyBatchAsync"
                case["ok"] = bool(case["ok"] and (case["reached"] or "skipped" in case))
                out[key] = case
        finally:
            mgr.close()
    return all(v["ok"] for v in out.values() if isinstance(v, dict)), out


def _partial_case(mgr: kvxfer.KVCacheManager, caches: list[jax.Array],
                  pages: list[kvxfer.PageRef], direction: str, name: str, at: int,
                  blocks: tuple[list[int], ...], slots: list[int], staging: int
                  ) -> tuple[list[jax.Array], Figures]:
    """One case of ``partial_enqueue``: the caches to go on with, and its figures."""
    a, b, c, d, e = blocks
    n = len(a)
    case: Figures = {"in_call": False}
    before = [testing.bits(x) for x in caches]
    failed = False
    with testing.driver_fault(name, at=at):
        try:
            if direction == "load":
                caches, handle = mgr.load(caches, pages, b)
                failed = fails(lambda: handle.result(WAIT_S))
            else:
                offload = mgr.offload(caches, c, keys=[k + 10**6 for k in c], slots=slots)
                failed = fails(lambda: offload.wait(WAIT_S))
        except kvxfer.TransferError as err:  # failed in the call
            failed, case["in_call"] = True, True
            if err.kv_caches is not None:
                caches = err.kv_caches
    fresh = fill(staging)  # where an allocator puts memory let go of just now
    alive = not any(x.is_deleted() for x in caches)
    case.update(reached=failed, alive=alive)
    if alive:
        now_bits = [testing.bits(x) for x in caches]
        if direction == "load":
            case["foreign_blocks"] = len(foreign_blocks(
                [x[b] for x in now_bits], [x[b] for x in before], [x[a] for x in before]))
            others = np.setdiff1d(np.arange(before[0].shape[0]), b)
            case["stray_layers"] = wrong_layers([x[others] for x in now_bits],
                                                [x[others] for x in before])
        else:
            case["stray_layers"] = wrong_layers(now_bits, before)
    # The next transfer: a load of the pages into other blocks; or an offload of other
    # bytes into the failed offload's slots (back once its copies ended), loaded.
    if direction == "load":
        caches, handle = mgr.load(caches, pages, e)
        prefix = handle.result(WAIT_S).verified_prefix
        then = wrong_layers(block_bits(caches, e), [x[a] for x in before])
    else:
        t0, retry = now(), None
        while retry is None:
            try:
                retry = mgr.offload(caches, d, keys=[k + 10**7 for k in d], slots=slots)
            except kvxfer.PoolError:  # the slots are not back yet
                if now() - t0 > WAIT_S:
                    raise
                time.sleep(0.01)
        case["slots_back_ms"] = (now() - t0) * 1e3
        retried = retry.wait(WAIT_S)
        caches, handle = mgr.load(caches, retried, b)
        prefix = handle.result(WAIT_S).verified_prefix
        then = wrong_layers(block_bits(caches, b), [x[d] for x in before])
        _free(mgr, retried)
    jax.block_until_ready(caches)
    time.sleep(SETTLE_S)  # late copies, if any, land now
    case.update(then_verified=prefix == n, then_wrong_layers=then, fresh_intact=intact(fresh))
    case["ok"] = bool(alive and not case.get("foreign_blocks") and not case.get("stray_layers")
                      and case["then_verified"] and not then and case["fresh_intact"])
    return caches, case


# -- allocator reuse under copies in flight -----------------------------------------

def allocator_reuse(cfg: Sizes) -> tuple[bool, Figures]:
    """``prefetch()``/``release()`` then a load, ``reuse_cycles`` times, with fresh
    device arrays filled between them; two page sets loaded in turn into the same
    blocks, each load's blocks compared on the device right after it (no wait in the
    loop), every fresh array compared at the end."""
    layers, block = cfg.group_shapes[0]
    n = cfg.pages
    staging = n * layers * block
    caches = _caches(layers, 3 * n, block, seed=13)
    sets, dst = (list(range(n)), list(range(n, 2 * n))), list(range(2 * n, 3 * n))
    want = [[jnp.asarray(x) for x in block_bits(caches, s)] for s in sets]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2 * n, path="dma", integrity="off")
    fresh: list[tuple[jax.Array, int]] = []
    matches, loads = [], []
    try:
        pages = [mgr.offload(caches, s, keys=[k + 100 * i for k in s]).wait(WAIT_S)
                 for i, s in enumerate(sets)]
        ids = jnp.asarray(np.asarray(dst, np.int32))
        t0 = now()
        for i in range(cfg.reuse_cycles):
            p = i % 2
            mgr.prefetch(pages[p]).release()  # its copies still crossing
            fresh += fill(staging)
            staged = mgr.prefetch(pages[p]) if i % 3 == 2 else None
            caches, load = mgr.load(caches, pages[p], dst, prefetched=staged)
            fresh += fill(staging)
            matches.append(_blocks_match(caches, ids, want[p]))
            loads.append(load)
        prefixes = [ld.result(WAIT_S).verified_prefix for ld in loads]
        seconds = now() - t0
        jax.block_until_ready(caches)
        time.sleep(SETTLE_S)
        exact = [bool(m) for m in matches]
        fallbacks = mgr.stats()["dma_fallbacks"]
    finally:
        mgr.close()
    out: Figures = {
        "layers": layers, "block_bytes": block, "pages": n, "cycles": cfg.reuse_cycles,
        "fresh_arrays": len(fresh), "fresh_intact": intact(fresh),
        "loads_exact": sum(exact), "loads_verified": sum(p == n for p in prefixes),
        "first_wrong_cycle": exact.index(False) if False in exact else None,
        "cycles_s": seconds, "dma_fallbacks": fallbacks}
    ok = out["fresh_intact"] and all(exact) and out["loads_verified"] == cfg.reuse_cycles
    return ok, out


# -- a load behind a large offload --------------------------------------------------

def load_behind_offload(cfg: Sizes) -> tuple[bool, Figures]:
    """From ``load()`` of ``pages`` pages to its last layer ready, alone and with an
    offload of ``behind_bytes`` dispatched just before it (its copies in flight),
    beside the link's time for the load's and the offload's bytes."""
    layers, block, n = cfg.layers, cfg.block_bytes, cfg.pages
    page = layers * block
    big = max(1, cfg.behind_bytes // page)
    link_load = _link(n * page, "h2d", cfg.repeats)
    link_offload = _link(big * page, "d2h", cfg.repeats)
    caches = _caches(layers, big + 2 * n, block, seed=17)
    src, dst = list(range(big, big + n)), list(range(big + n, big + 2 * n))
    want = block_bits(caches, src)
    # Room for the offload's staging and the load's at once: a load past the budget
    # would copy on XLA's stream, and then it would not be this check.
    mgr = kvxfer.KVCacheManager(
        caches, num_host_blocks=big + n, path="dma", integrity="off",
        dma=kvxfer.DmaOptions(staging_bytes=2 * (big + n) * page))
    alone, behind, offload, in_flight = [], [], [], []
    try:
        pages = mgr.offload(caches, src, keys=src).wait(WAIT_S)
        for r in range(cfg.repeats + 1):
            t0 = now()
            caches, load = mgr.load(caches, pages, dst, gate="layer")
            load.layer_ready(layers - 1, WAIT_S)
            t1 = now()
            load.result(WAIT_S)
            t2 = now()
            mgr.free(mgr.offload(caches, list(range(big)), keys=list(range(big))).wait(WAIT_S))
            t3 = now()
            handle = mgr.offload(caches, list(range(big)), keys=list(range(big)))
            t4 = now()
            caches, load = mgr.load(caches, pages, dst, gate="layer")
            load.layer_ready(layers - 1, WAIT_S)
            t5 = now()
            still = not handle.done()
            load.result(WAIT_S)
            mgr.free(handle.wait(WAIT_S))
            if r:  # the first round compiles
                alone.append(t1 - t0)
                offload.append(t3 - t2)
                behind.append(t5 - t4)
                in_flight.append(still)
        exact = not wrong_layers(block_bits(caches, dst), want)
        fallbacks = mgr.stats()["dma_fallbacks"]
    finally:
        mgr.close()
    a, b, o = (stats(x)["p50_s"] for x in (alone, behind, offload))
    out: Figures = {
        "load_bytes": n * page, "offload_bytes": big * page, "layers": layers,
        "load_alone_ms": a * 1e3, "load_behind_offload_ms": b * 1e3,
        "offload_alone_ms": o * 1e3, "link_h2d_load_ms": link_load * 1e3,
        "link_d2h_offload_ms": link_offload * 1e3,
        "behind_over_alone": b / a, "behind_over_offload": b / o,
        "load_alone_of_link": link_load / a, "load_behind_of_link": link_load / b,
        "offload_of_link": link_offload / o,
        "offload_in_flight_at_last_layer": sum(in_flight), "rounds": len(in_flight),
        "exact": exact, "dma_fallbacks": fallbacks}
    return exact, out


# -- a busy Python thread -----------------------------------------------------------

def busy_thread(cfg: Sizes) -> tuple[bool, Figures]:
    """``busy_loads`` loads of ``pages`` pages (two page sets in turn into the same
    blocks), then the same while another thread spins in Python: each load's bytes
    compared, from ``load()`` to its last layer ready and to its result."""
    layers, block, n = cfg.layers, cfg.block_bytes, cfg.pages
    link = _link(n * layers * block, "h2d", cfg.repeats)
    caches = _caches(layers, 3 * n, block, seed=19)
    sets, dst = (list(range(n)), list(range(n, 2 * n))), list(range(2 * n, 3 * n))
    want = [block_bits(caches, s) for s in sets]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2 * n, path="dma")
    times: dict[str, dict[str, list[float]]] = {}
    wrong: dict[str, int] = {}
    spins = [0]
    stop = [False]

    def spin() -> None:
        while not stop[0]:
            spins[0] += 1

    def loads(label: str) -> None:
        nonlocal caches
        ready, done = [], []
        wrong[label] = 0
        for i in range(cfg.busy_loads + 1):
            t0 = now()
            caches, load = mgr.load(caches, pages[i % 2], dst, gate="layer")
            load.layer_ready(layers - 1, WAIT_S)
            t1 = now()
            prefix = load.result(WAIT_S).verified_prefix
            t2 = now()
            wrong[label] += prefix != n or bool(wrong_layers(block_bits(caches, dst),
                                                             want[i % 2]))
            if i:  # the first load of each run is a warm-up
                ready.append(t1 - t0)
                done.append(t2 - t0)
        times[label] = {"ready": ready, "done": done}

    try:
        pages = [mgr.offload(caches, s, keys=[k + 100 * i for k in s]).wait(WAIT_S)
                 for i, s in enumerate(sets)]
        loads("alone")
        thread = threading.Thread(target=spin, daemon=True)
        thread.start()
        try:
            loads("busy")
        finally:
            stop[0] = True
            thread.join()
    finally:
        mgr.close()
    p50 = {f"{label}_{what}_ms": stats(v)["p50_s"] * 1e3
           for label, t in times.items() for what, v in t.items()}
    out: Figures = {
        "load_bytes": n * layers * block, "layers": layers, "loads": cfg.busy_loads, **p50,
        "link_h2d_ms": link * 1e3,
        "busy_over_alone_ready": p50["busy_ready_ms"] / p50["alone_ready_ms"],
        "busy_over_alone_done": p50["busy_done_ms"] / p50["alone_done_ms"],
        "alone_ready_of_link": link * 1e3 / p50["alone_ready_ms"],
        "busy_ready_of_link": link * 1e3 / p50["busy_ready_ms"],
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "spins": spins[0], "wrong_loads": wrong}
    return not any(wrong.values()), out


HAZARD_STEPS = (("several_groups", several_groups), ("partial_enqueue", partial_enqueue),
                ("allocator_reuse", allocator_reuse),
                ("load_behind_offload", load_behind_offload), ("busy_thread", busy_thread))
"""The steps, in the order they run: the silent corruption first."""
