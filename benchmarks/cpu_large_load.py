"""The CPU case the DMA issue names: 1024 blocks x 8 layers of 32 KiB bfloat16 (256 MiB)
per call, offload and load, integrity off and page, per path, against a numpy memcpy of
the same bytes measured in the same run (best of the repeats each).

Every path runs twice, in turn, and the second round is reported: the first path a
process runs moves these 256 MiB about half as fast (whichever path it is), as the
process's memory first fills; the first round pays for that.

Usage:  python benchmarks/cpu_large_load.py [PATH ...]   (default: auto raw dma pinned)
"""

from __future__ import annotations

import sys
import time

import numpy as np

import kvxfer
from kvxfer import testing
from kvxfer.manager import PATHS

LAYERS, BLOCKS, BLOCK = 8, 1024, 32 << 10
REPEATS = 4


def main() -> None:
    paths = sys.argv[1:] or [p for p in ("auto", "raw", "dma", "pinned") if p in PATHS]
    caches = testing.random_caches(LAYERS, 2 * BLOCKS, testing.block_shape(BLOCK, "bfloat16"),
                                   "bfloat16", seed=1)
    nbytes = LAYERS * BLOCKS * BLOCK
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    ids = np.random.default_rng(0).permutation(BLOCKS).tolist()
    rounds = [(p, i, last) for last in (False, True) for p in paths for i in ("off", "page")]
    for path, integrity, last in rounds:
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=BLOCKS, path=path,
                                    integrity=integrity)
        mgr.warmup(BLOCKS)
        best = {"memcpy": 1e9, "offload": 1e9, "load": 1e9}
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            best["memcpy"] = min(best["memcpy"], time.perf_counter() - t0)
            t0 = time.perf_counter()
            pages = mgr.offload(caches, ids, keys=list(range(BLOCKS))).wait()
            best["offload"] = min(best["offload"], time.perf_counter() - t0)
            t0 = time.perf_counter()
            caches, load = mgr.load(caches, pages, list(range(BLOCKS, 2 * BLOCKS)))
            assert load.result().verified_prefix == BLOCKS
            best["load"] = min(best["load"], time.perf_counter() - t0)
            mgr.free(pages)
        movers = ",".join(sorted(set(mgr.paths)))
        mgr.close()
        if not last:
            continue
        gbps = {k: nbytes / v / 1e9 for k, v in best.items()}
        print(f"{path:6s} {movers:6s} integrity={integrity:4s} "
              f"offload {gbps['offload']:5.2f} GB/s ({gbps['offload'] / gbps['memcpy']:.2f}x)"
              f"  load {gbps['load']:5.2f} GB/s ({gbps['load'] / gbps['memcpy']:.2f}x)"
              f"  memcpy {gbps['memcpy']:.2f}", flush=True)

if __name__ == "__main__":
    main()
