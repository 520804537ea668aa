"""The CPU case the DMA issue names: 1024 blocks x 8 layers of 32 KiB bfloat16 (256 MiB)
per call, offload and load, integrity off and page, per path, against a numpy memcpy of
the same bytes measured in the same run (best of the repeats each).

Every path runs twice, in turn, and the second round is reported: the first path a
process runs moves these 256 MiB about half as fast (whichever path it is), as the
process's memory first fills; the first round pays for that.

Usage:  python benchmarks/cpu_large_load.py [--layers 8] [--blocks 1024] [--block-kib 32]
            [--repeats 4] [PATH ...]        (default paths: auto raw dma pinned)

It uses the public API only, so it also measures an older checkout (``PYTHONPATH=``
that tree) for a before/after.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import kvxfer
from kvxfer import testing
from kvxfer.manager import PATHS

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=1024, help="blocks moved per call")
    parser.add_argument("--block-kib", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("paths", nargs="*")
    args = parser.parse_args()
    paths = args.paths or [p for p in ("auto", "raw", "dma", "pinned") if p in PATHS]
    layers, blocks, block = args.layers, args.blocks, args.block_kib << 10
    caches = testing.random_caches(layers, 2 * blocks, testing.block_shape(block, "bfloat16"),
                                   "bfloat16", seed=1)
    nbytes = layers * blocks * block
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    ids = np.random.default_rng(0).permutation(blocks).tolist()
    rounds = [(p, i, last) for last in (False, True) for p in paths for i in ("off", "page")]
    for path, integrity, last in rounds:
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=blocks, path=path,
                                    integrity=integrity)
        mgr.warmup(blocks)
        best = {"memcpy": 1e9, "offload": 1e9, "load": 1e9}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            best["memcpy"] = min(best["memcpy"], time.perf_counter() - t0)
            t0 = time.perf_counter()
            pages = mgr.offload(caches, ids, keys=list(range(blocks))).wait()
            best["offload"] = min(best["offload"], time.perf_counter() - t0)
            t0 = time.perf_counter()
            caches, load = mgr.load(caches, pages, list(range(blocks, 2 * blocks)))
            assert load.result().verified_prefix == blocks
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
