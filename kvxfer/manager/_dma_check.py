"""The DMA mover's self-check: before a process first moves pages with a copy engine
that has streams of its own, a small round trip of every program form it uses.

What it runs, on one device, with integrity off (bytes compared, not digests): an
offload beside XLA's stream, a load whose layer groups hold several layers (8 layers
of 16 KiB blocks: two groups of four), a prefetched load, an offload whose callback is
made to fail (it must fail with ``TransferError``, the caches alive), and a load after
it. It took 0.5 s on XLA:CPU over the stand-in CUDA driver (tests/cuda_rig.py), most of
it compiling; not yet timed on a GPU. Once a process for each device kind, copy engine
type and ``DmaOptions`` stream and copy mode.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np

from kvxfer.engine import DmaOptions, TransferError, copy_engine

__all__ = ["dma_self_check"]

_verdicts: dict[tuple, str | None] = {}  # by device kind, engine, stream and copy mode
_lock = threading.Lock()
_inside = threading.local()


def dma_self_check(device: Any, options: DmaOptions, manager: type) -> str | None:
    """Why the DMA mover failed its self-check on ``device``'s kind (None: it passed,
    or there is nothing to check: ``options.self_check`` off, or a copy engine without
    streams of its own, whose copies run inside XLA's programs as the CPU tests run
    them). The verdict is kept for the process. ``manager``: the manager type whose
    transfers the check runs (``KVCacheManager``).

    In a job of several processes every rank runs it when its first DMA manager is
    made, as every rank makes that manager; its loads agree across ranks like any, so
    one rank's failure fails the check on every rank.

    Example:
        >>> import jax, kvxfer
        >>> dma_self_check(jax.devices()[0], DmaOptions(), kvxfer.KVCacheManager) is None
        True
    """
    engine = copy_engine(device, options.copy)
    if not options.self_check or not engine.side_stream or getattr(_inside, "on", False):
        return None
    key = (device.platform, device.device_kind, type(engine).__qualname__, options.stream,
           options.copy)
    with _lock:
        if key not in _verdicts:
            _inside.on = True
            try:
                _verdicts[key] = _round_trips(device, options, manager)
            except Exception as e:  # noqa: BLE001 - the verdict names it
                _verdicts[key] = f"{type(e).__name__}: {e}"
            finally:
                _inside.on = False
        return _verdicts[key]


def _round_trips(device: Any, options: DmaOptions, manager: type) -> str | None:
    rng = np.random.default_rng(0)
    caches = [jax.device_put(rng.integers(0, 1 << 16, (8, 8, 1024), dtype=np.uint16), device)
              for _ in range(8)]  # 16 KiB blocks
    before = [np.asarray(c) for c in caches]
    mgr = manager(caches, num_host_blocks=4, path="dma", integrity="off", dma=options)
    try:
        pages = mgr.offload(caches, [5, 2], keys=[0, 1]).wait()
        for dst, prefetch in (([0, 7], False), ([1, 3], True)):
            prefetched = mgr.prefetch(pages) if prefetch else None
            caches, load = mgr.load(caches, pages, dst, prefetched=prefetched)
            load.result()
            if not all(np.array_equal(np.asarray(c)[dst], b[[5, 2]])
                       for c, b in zip(caches, before)):
                return f"a load into blocks {dst} delivered other bytes than were offloaded"
        mgr._movers[0].fault = "copy"
        try:
            mgr.offload(caches, [4], keys=[9]).wait()
            return "an offload whose callback failed was not reported as failed"
        except TransferError:
            pass
        finally:
            mgr._movers[0].fault = None
        if any(c.is_deleted() for c in caches):
            return "a failed offload lost the caches"
        caches, load = mgr.load(caches, pages, [6, 4])
        load.result()
        if not all(np.array_equal(np.asarray(c)[[6, 4]], b[[5, 2]])
                   for c, b in zip(caches, before)):
            return "a load after a failed offload delivered other bytes"
    finally:
        mgr.close()
    return None
