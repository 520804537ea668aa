"""One tensor-parallel rank of the two-process ``HostCache`` tests (run by test_ranks.py).

Usage: python rank_worker.py RANK PORT SCENARIO:STORE_DIR
  SCENARIO: faults (a one-rank bit flip, a one-rank delivery fault, lookups out of
  step, then rank 0 closes first) | mismatch (the ranks load different requests
  through the manager) | prefetch (after a restart, rank 0 prefetches a prefix from
  the store and rank 1 does not; both look it up) | stuck (rank 1 stops answering
  while rank 0 looks up, loads and closes)
The caches are global arrays sharded over KV heads across the two processes, and
the cache writes through to a disk store both ranks share. Prints one JSON line.
"""

import json
import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
rank, port, spec = int(sys.argv[1]), sys.argv[2], sys.argv[3]
scenario, store_dir = spec.split(":", 1)
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=rank, initialization_timeout=60)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import kvxfer  # noqa: E402
from kvxfer import testing  # noqa: E402
from kvxfer.store import DiskStore  # noqa: E402

mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices())
sharding = NamedSharding(mesh, P(None, "tensor", None))
rng = np.random.default_rng(7)  # the same global values on both ranks
values = [rng.integers(0, 2**16, (16, 4, 128), dtype=np.uint16) for _ in range(3)]
caches = [jax.make_array_from_callback(v.shape, sharding,
                                       lambda idx, v=v: v[idx].view(jax.numpy.bfloat16))
          for v in values]


def local_bits(array: jax.Array, blocks: list[int]) -> np.ndarray:
    """This rank's shard of ``blocks`` of a layer, as uint16."""
    shard, = array.addressable_shards
    return np.asarray(shard.data).view(np.uint16)[blocks]


def expected(layer: int, blocks: list[int]) -> np.ndarray:
    heads = slice(2 * rank, 2 * rank + 2)
    return values[layer][blocks][:, heads]


out: dict = {"rank": rank}
mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, agreement_timeout=20)
store = DiskStore(store_dir)
cache = kvxfer.HostCache(mgr, store, write_through=True, namespace="test-model")
chain = [101, 102, 103, 104]  # one request's page keys
src = [0, 1, 2, 3]


def request(name: str, keys: list[int], dst: list[int]) -> None:
    """One request: lookup, load what hit, record what came of it."""
    global caches
    got: dict = {}
    try:
        hit = cache.lookup(keys)
    except kvxfer.TransferError as e:
        out[name] = {"lookup_error": type(e).__name__, "error": str(e)}
        return
    got["hit"] = hit.num_pages
    if hit.num_pages:
        caches, load = cache.load(caches, hit, dst[:hit.num_pages])
        try:
            result = load.result(30)
        except kvxfer.TransferError as e:
            got["error"] = f"{type(e).__name__}: {e}"
        else:
            n = result.verified_prefix
            got.update(prefix=n, freed=list(result.freed_pages),
                       reasons={str(k): v for k, v in result.reasons.items()},
                       exact=all(np.array_equal(local_bits(caches[i], dst[:n]),
                                                expected(i, src[:n])) for i in range(3)))
    out[name] = got


if scenario == "faults":
    cache.put(caches, src, chain, wait=True)
    cache.flush()
    # 1. A host bit flips on rank 1 only: both ranks use 2 pages and free page 3.
    if rank == 1:
        testing.flip_bit(mgr, cache.page_of(103), layer=1)
    request("bitflip", chain, [8, 9, 10, 11])
    out["after_bitflip"] = {"host": sorted(cache.keys()),
                            "store": [k for k in chain if store.contains(cache.store_key(k))]}
    # 2. The next lookup: the same 2-page hit on both ranks (rank 0 still had page 3
    #    before pages proven bad were freed everywhere).
    request("after", chain, [8, 9, 10, 11])
    # 3. Put the missing pages back; a delivery fault on rank 1 (zeros land in page
    #    2's block of layer 0): a miss at page 2 on both, the page kept everywhere.
    cache.put(caches, src[2:], chain[2:], wait=True)
    cache.flush()
    if rank == 1:
        testing.zero_dma(mgr, layer=0, block=13)
    request("zero_dma", chain, [11, 12, 13, 14])
    out["after_zero_dma"] = {"host": sorted(cache.keys()),
                             "store": [k for k in chain if store.contains(cache.store_key(k))]}
    request("healed", chain, [11, 12, 13, 14])
    # 4. Out of step: the ranks look up different requests in the same turn.
    request("out_of_step", chain if rank == 0 else chain[:2] + [999], [8, 9, 10, 11])
    request("in_step_again", chain[:2], [8, 9])
    out["stats"] = {"cache": {k: cache.stats()[k] for k in ("bad_pages", "transfer_faults")},
                    "mgr": {k: mgr.stats()[k] for k in ("pages_freed", "transfer_faults")}}
    # 5. Rank 0 finishes first; rank 1 still works for a while before it closes.
    if rank == 1:
        time.sleep(2)
    start = time.monotonic()
    cache.close()
    mgr.close()
    out["close_s"] = time.monotonic() - start
elif scenario == "mismatch":
    pages = mgr.offload(caches, src, chain).wait()
    mine = pages if rank == 0 else pages[:2]
    caches, handle = mgr.load(caches, mine, [8, 9, 10, 11][:len(mine)])
    try:
        handle.result(30)
        out["error"] = None
    except kvxfer.AgreementError as e:
        out["error"] = str(e)
    caches, handle = mgr.load(caches, pages, [8, 9, 10, 11])
    out["next"] = handle.result(30).verified_prefix
    cache.close()
    mgr.close()
elif scenario == "prefetch":
    cache.put(caches, src, chain, wait=True)  # written through to the store
    cache.close()
    mgr.close()
    # A restart: cold host memory on both ranks, every page in the store.
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, agreement_timeout=20)
    counted = testing.CountingStore(store)
    cache = kvxfer.HostCache(mgr, counted, namespace="test-model")
    if rank == 0:  # a prefetch is one rank's own: no agreement, nothing on rank 1
        out["prefetched"] = cache.prefetch(chain).result(30)
    counted.calls.clear()
    hit = cache.lookup(chain + [999])
    out["calls"] = dict(counted.calls)
    out["tiers"] = list(hit.tiers)
    caches, load = cache.load(caches, hit, [8, 9, 10, 11][:hit.num_pages])
    n = load.result(30).verified_prefix
    out["prefix"] = n
    out["exact"] = all(np.array_equal(local_bits(caches[i], [8, 9, 10, 11][:n]),
                                      expected(i, src[:n])) for i in range(3))
    cache.close()
    mgr.close()
elif scenario == "stuck":
    # tpu-sync #888: one stuck peer starved the others. Rank 1 stops answering (a
    # long stall in the engine) while rank 0 looks up, loads and closes: each costs
    # rank 0 its agreement_timeout, names rank 1, and leaves nothing pinned.
    from jax._src import distributed

    client = distributed.global_state.client
    cache.close()
    mgr.close()
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, agreement_timeout=2)
    cache = kvxfer.HostCache(mgr, store, namespace="test-model")
    cache.put(caches, src, chain, wait=True)
    pages = mgr.offload(caches, src[:2], [901, 902]).wait()
    client.wait_at_barrier("kvxfer-test-stuck-ready", 60_000)
    if rank == 1:
        time.sleep(12)  # stuck: no lookup, no load, no close meanwhile
    else:
        t = time.monotonic()
        try:
            out["lookup"] = cache.lookup(chain).num_pages
        except kvxfer.TransferError as e:
            out["lookup"] = str(e)
        out["lookup_s"] = time.monotonic() - t
        t = time.monotonic()
        caches, handle = mgr.load(caches, pages, [8, 9])
        try:
            out["load"] = handle.result(30).verified_prefix
        except kvxfer.TransferError as e:
            out["load"] = str(e)
        out["load_s"] = time.monotonic() - t
        out["pinned"] = cache.stats()["pinned_pages"]
        mgr.free(pages)
        out["free_pages"] = mgr.num_free_pages  # 8 less the cache's 4: no pin left
        out["cached"] = len(cache.keys())
    t = time.monotonic()
    cache.close()
    mgr.close()
    out["close_s"] = time.monotonic() - t
    client.wait_at_barrier("kvxfer-test-stuck-done", 120_000)
else:
    raise SystemExit(f"unknown scenario {scenario!r}")
print(json.dumps(out), flush=True)
jax.distributed.shutdown()
