"""A round trip and fault check through kvxfer's public API on whatever device JAX has.

What an independent check of an accelerator would do first, in seconds: ``path="auto"``
(the DMA mover on a GPU with ``cuda-bindings``) and, where the backend offers it,
``path="pinned"`` (the pure-JAX pages route), each:

* byte-exact round trips of random bfloat16 blocks in a random order, of 1 and 32
  pages x 32 layers of 64 KiB;
* a host bit flip after the digest was made: caught, the verified prefix stops there;
* a zero-DMA (a load that delivers zeros into one page's block): caught as a transfer
  fault, the host page kept;
* a donating jitted step in a loop with an offload and a load in flight each step:
  every page verified, every byte as a host model says;
* ``host_copy_bytes`` (payload copied on the host besides a copy engine's work).

Prints one JSON object; exits 1 if any check failed.

Usage:  python benchmarks/device_check.py [--layers 32] [--block-kib 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvxfer
from kvxfer import testing


def _bits(a):
    return testing.bits(a)


def _round_trip(path, caches, k, rng):
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2 * k, path=path)
    src = rng.permutation(caches[0].shape[0])[:k].tolist()
    dst = rng.permutation(caches[0].shape[0])[:k].tolist()
    before = [_bits(c) for c in caches]
    t0 = time.perf_counter()
    pages = mgr.offload(caches, src, keys=list(range(k))).wait()
    t1 = time.perf_counter()
    caches, load = mgr.load(caches, pages, dst)
    ok = load.result().verified_prefix == k
    t2 = time.perf_counter()
    exact = all(np.array_equal(_bits(c)[dst], b[src]) for c, b in zip(caches, before))
    out = {"paths": sorted(set(mgr.paths)), "pages": k, "verified": ok, "exact": exact,
           "offload_s": t1 - t0, "load_s": t2 - t1,
           "host_copy_bytes": mgr.stats()["host_copy_bytes"]}
    mgr.close()
    return caches, out


def _faults(path, caches):
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path=path)
    pages = mgr.offload(caches, [1, 2, 3, 4], keys=[1, 2, 3, 4]).wait()
    testing.flip_bit(mgr, pages[2], layer=1)
    caches, load = mgr.load(caches, pages, [8, 9, 10, 11])
    flip = load.result().verified_prefix == 2
    pages = mgr.offload(caches, [5, 6, 7], keys=[5, 6, 7]).wait()
    testing.inject("zero-dma", mgr, caches, pages, 1, 0, device_blocks=[12, 13, 14])
    caches, load = mgr.load(caches, pages, [12, 13, 14])
    r = load.result()
    zero = r.verified_prefix == 1 and r.reasons.get(1, "").startswith("transfer")
    mgr.close()
    return caches, {"bitflip_caught": flip, "zero_dma_caught": zero and mgr.is_valid(pages[1])}


def _loop(path, caches, steps=8):
    """A donating step each iteration, with an offload and a load in flight."""
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=64, path=path)
    step = jax.jit(lambda cs, w: [c.at[w].set(c[0]) for c in cs], donate_argnums=0)
    model = [_bits(c) for c in caches]
    pages = mgr.offload(caches, [1, 2], keys=[100, 101]).wait()
    ok = True
    for i in range(steps):
        handle = mgr.offload(caches, [3, 4], keys=[200 + 2 * i, 201 + 2 * i])
        caches, load = mgr.load(caches, pages, [10 + i % 4, 20 + i % 4])
        model_src = [m[[1, 2]].copy() for m in model]
        caches = step(caches, 30)  # donates what load() returned, at once
        for m, src in zip(model, model_src):
            m[[10 + i % 4, 20 + i % 4]] = src
            m[30] = m[0]
        ok &= load.result().verified_prefix == 2
        mgr.free(handle.wait())
    ok &= all(np.array_equal(_bits(c), m) for c, m in zip(caches, model))
    mgr.close()
    return caches, {"loop_exact": bool(ok)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--block-kib", type=int, default=64)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    report = {"device": str(dev), "platform": dev.platform, "jax": jax.__version__,
              "routes": {}}
    paths = ["auto"] + (["pinned"] if any(m.kind == "pinned_host"
                                          for m in dev.addressable_memories()) else [])
    failed = False
    for path in paths:
        caches = testing.random_caches(args.layers, 128, testing.block_shape(
            args.block_kib << 10, "bfloat16"), "bfloat16", seed=1)
        row = {}
        try:
            for k in (1, 32):
                caches, row[f"round_trip_{k}"] = _round_trip(path, caches, k, rng)
            small = [jnp.asarray(c[:32]) for c in caches[:4]]
            _, row["faults"] = _faults(path, small)
            # float32: XLA:CPU's bfloat16 scatters (the step's) rewrite NaN payloads.
            _, row["loop"] = _loop(path, testing.random_caches(4, 64, (16, 256), "float32",
                                                               seed=2))
        except Exception as e:  # a check that cannot run is a failed check
            row["error"] = f"{type(e).__name__}: {e}"
        flags = [v for r in row.values() if isinstance(r, dict) for k, v in r.items()
                 if isinstance(v, bool)]
        row["ok"] = "error" not in row and all(flags)
        failed |= not row["ok"]
        report["routes"][path] = row
    print(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
