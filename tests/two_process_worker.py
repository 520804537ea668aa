"""One rank of the two-process agreement test (run by test_multiprocess.py).

Usage: python two_process_worker.py RANK PORT FAULT   (FAULT: none|one-process|transfer)
Prints one JSON line with this rank's load result.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
rank, port, fault = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=rank, initialization_timeout=60)

import numpy as np  # noqa: E402

import kvxfer  # noqa: E402
from kvxfer import testing as faults  # noqa: E402

rng = np.random.default_rng(rank)
device = jax.local_devices()[0]
caches = [jax.device_put(rng.integers(0, 2**16, (8, 64, 128), dtype=np.uint16).view(
    jax.numpy.bfloat16), device) for _ in range(3)]
before = [np.array(c).view(np.uint16) for c in caches]
mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8)
src, dst = [5, 1, 6, 2], [0, 7, 3, 4]
pages = mgr.offload(caches, src, keys=[11, 12, 13, 14]).wait()
out = {"rank": rank, "processes": jax.process_count()}
if fault == "one-process" and rank == 1:
    faults.flip_bit(mgr, pages[2], layer=1)
try:
    if fault == "transfer" and rank == 0:
        with faults.failing_transfer(mgr, after_layers=1):
            new, handle = mgr.load(caches, pages, dst, gate="layer")
            handle.result()
    else:
        new, handle = mgr.load(caches, pages, dst, gate="layer")
    result = handle.result()
    out.update(prefix=result.verified_prefix, reasons={str(k): v for k, v in
                                                       result.reasons.items()},
               consumed=result.consumed_before_failure,
               exact=all(np.array_equal(np.array(a).view(np.uint16)[dst[:result.verified_prefix]],
                                        b[src[:result.verified_prefix]])
                         for a, b in zip(new, before)))
except kvxfer.TransferError as e:
    out.update(error=str(e))
print(json.dumps(out), flush=True)
mgr.close()
jax.distributed.shutdown()
