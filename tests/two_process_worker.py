"""One rank of the two-process manager tests (run by test_multiprocess.py).

Usage: python two_process_worker.py RANK PORT SCENARIO
  SCENARIO: none | one-process | transfer | sync-then-bad-page | cancel-one | crash
Prints one JSON line with this rank's load results.
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
from jax._src import distributed  # noqa: E402

import kvxfer  # noqa: E402
from kvxfer import testing as faults  # noqa: E402


def report(handle: kvxfer.LoadHandle, new: list, dst: list[int], src: list[int],
           before: list[np.ndarray]) -> dict:
    """A load's result (or its error) as JSON-ready values."""
    try:
        result = handle.result(RESULT_TIMEOUT)
    except kvxfer.TransferError as e:
        return {"error": str(e)}
    except TimeoutError as e:
        return {"error": str(e), "stuck": True}
    n = result.verified_prefix
    return {"prefix": n, "reasons": {str(k): v for k, v in result.reasons.items()},
            "consumed": result.consumed_before_failure, "freed": list(result.freed_pages),
            "exact": all(np.array_equal(np.array(a).view(np.uint16)[dst[:n]], b[src[:n]])
                         for a, b in zip(new, before))}


def finish(mgr: kvxfer.KVCacheManager, clean: bool) -> None:
    """Shuts down cleanly if both ranks can; otherwise exits without waiting.

    A clean shutdown waits for every rank at a barrier, and closing the manager
    waits for its transfer thread: neither may follow a load that never finished.
    """
    client = distributed.global_state.client
    client.key_value_set(f"kvxfer-test/clean/{rank}", "1" if clean else "0")
    try:
        both = client.blocking_key_value_get(f"kvxfer-test/clean/{1 - rank}", 60_000) == "1"
    except Exception:
        both = False
    if not (clean and both):
        os._exit(0)
    mgr.close()
    jax.distributed.shutdown()


# Built by the testing helper on each rank's own device (rank 1 has none of rank 0's).
caches = faults.random_caches(3, 8, (64, 128), "bfloat16", seed=rank)
assert {d for c in caches for d in c.devices()} == {jax.local_devices()[0]}
before = [np.array(c).view(np.uint16) for c in caches]
options = {"agreement_timeout": 10} if fault == "crash" else {}
# A load that never finishes is reported (as "stuck") rather than hanging the test;
# in the crash scenario only after the agreement has had time to give up.
RESULT_TIMEOUT = 25 if fault == "crash" else 15
mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, **options)
src, dst = [5, 1, 6, 2], [0, 7, 3, 4]
pages = mgr.offload(caches, src, keys=[11, 12, 13, 14]).wait()
out = {"rank": rank, "processes": jax.process_count()}

if fault in ("none", "one-process", "transfer"):
    if fault == "one-process" and rank == 1:
        faults.flip_bit(mgr, pages[2], layer=1)
    if fault == "transfer" and rank == 0:
        with faults.failing_transfer(mgr, after_layers=1):
            new, handle = mgr.load(caches, pages, dst, gate="layer")
            out.update(report(handle, new, dst, src, before))
    else:
        new, handle = mgr.load(caches, pages, dst, gate="layer")
        out.update(report(handle, new, dst, src, before))
    print(json.dumps(out), flush=True)
    finish(mgr, not out.get("stuck"))
elif fault == "sync-then-bad-page":
    # Rank 0's first load raises in the call (block 8 of 8); rank 1's is valid.
    if rank == 0:
        try:
            mgr.load(caches, pages, dst[:3] + [8], gate="layer")
            out["first"] = {"raised": None}
        except ValueError as e:
            out["first"] = {"raised": type(e).__name__, "error": str(e)}
    else:
        caches, handle = mgr.load(caches, pages, dst, gate="layer")
        out["first"] = report(handle, caches, dst, src, before)
        faults.flip_bit(mgr, pages[2], layer=1)
    new, handle = mgr.load(caches, pages, dst, gate="layer")
    out["second"] = report(handle, new, dst, src, before)
    print(json.dumps(out), flush=True)
    finish(mgr, not any(out[k].get("stuck") for k in ("first", "second")))
elif fault == "cancel-one":
    # Rank 0 cancels its first load (an aborted request) while rank 1, whose page 2
    # is bad, loads as usual; the second loads then agree.
    import concurrent.futures
    import threading

    if rank == 1:
        faults.flip_bit(mgr, pages[2], layer=1)
    gate, reached = threading.Event(), threading.Event()
    if rank == 0:
        mgr.set_transfer_hook(lambda event, layer, array: event == "load_layer" and (
            reached.set(), gate.wait(30)))
    new, handle = mgr.load(caches, pages, dst, gate="layer")
    if rank == 0:
        reached.wait(30)
        out["cancel"] = handle.cancel()
        gate.set()
        concurrent.futures.wait([handle], RESULT_TIMEOUT)
        mgr.set_transfer_hook(None)
        out["first"] = {"cancelled": handle.cancelled(), "stuck": not handle.done()}
    else:
        out["first"] = report(handle, new, dst, src, before)
    new, handle = mgr.load(new, pages, dst, gate="layer")
    out["second"] = report(handle, new, dst, src, before)
    print(json.dumps(out), flush=True)
    finish(mgr, not any(out[k].get("stuck") for k in ("first", "second")))
elif fault == "crash":
    if rank == 1:
        os._exit(3)  # dies right before its load, without a word
    new, handle = mgr.load(caches, pages, dst, gate="layer")
    out["first"] = report(handle, new, dst, src, before)
    print(json.dumps(out), flush=True)
    os._exit(0)  # a clean shutdown would wait for the dead rank
else:
    raise SystemExit(f"unknown scenario {fault!r}")
