"""The policy section: each eviction policy's hit rate per tier, and the store bytes each
write-through setting costs, on two replayed traces.

* ``demo``: the demo's workload (``kvxfer.demo.make_workload``): requests sharing three
  long system prompts (6, 8 and 10 pages), each with a short unique suffix that ends
  in a partial page (never cached).
* ``scan``: a scan-heavy trace: half the requests take one of four shared 3-page
  prefixes and add one unique page; the other half are long one-off prompts (8 to 14
  pages) that nobody asks for again.

Every case (trace, policy, write-through) replays its trace against a fresh
``HostCache`` of its own: a manager whose host pool (``HOST_PAGES``: fewer pages than
the trace's working set; two layers of 512-byte blocks a page) sits over a
``DiskStore`` in a temporary directory (on ``/dev/shm`` where there is one: the
section reports counts, not store speed). For each
request the cache looks up the keys of its full pages (``kvxfer.demo.page_keys``),
counts the pages found per tier, releases the hit, and puts the pages it missed.
Policies are deterministic, so the hit rates and bytes are counts of the trace: the
same on any machine and under any load. Only the section's wall time depends on the
machine.

Example:
    >>> rows = policy_section(requests=12, traces=("scan",), policies=("lru",),
    ...                       write_through=("never",))
    >>> r = rows[0]
    >>> r["trace"], r["policy"], r["pages_requested"] == r["host_hits"] + r["store_hits"] + r["misses"]
    ('scan', 'lru', True)
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer._text import format_bytes, table
from kvxfer.bench.timing import Progress, now

__all__ = ["policy_section", "policy_lines", "policy_steps", "TRACES", "POLICIES",
           "WRITE_THROUGH", "HOST_PAGES"]

#: The traces replayed, the policies and write-through settings compared.
TRACES = ("demo", "scan")
POLICIES = ("lru", "s3fifo", "arc")
WRITE_THROUGH: tuple[str | int, ...] = ("never", "always", 2)
#: Host pages of each trace's caches: fewer than its working set (demo: 24 pages of
#: system prompts; scan: 12 shared pages, and one-off prompts of up to 14).
HOST_PAGES = {"demo": 16, "scan": 32}
_BLOCK = (4, 32)  # float32: 512 bytes a layer, two layers a page
_BLOCKS = 32  # device blocks: more than any request's pages
_PAGE_TOKENS = 16


def policy_steps(traces: Sequence[str] = TRACES) -> int:
    """The progress steps of the section (one per trace)."""
    return len(traces)


def _demo_trace(requests: int, seed: int) -> list[list[int]]:
    from kvxfer.demo import make_workload, page_keys
    from kvxfer.demo.model import tiny_llama

    cfg = tiny_llama()
    return [page_keys(r.prompt, cfg.block_size) for r in make_workload(cfg, requests, seed)]


def _scan_trace(requests: int, seed: int) -> list[list[int]]:
    from kvxfer.demo import page_keys

    rng = np.random.default_rng([seed, 21])
    shared = [rng.integers(1, 512, 3 * _PAGE_TOKENS) for _ in range(4)]
    out = []
    for j in range(requests):
        if j % 2 == 0:  # a shared prefix and one page of its own
            prompt = np.concatenate([shared[int(rng.integers(4))],
                                     rng.integers(1, 512, _PAGE_TOKENS)])
        else:  # a long one-off prompt
            prompt = rng.integers(1, 512, int(rng.integers(8, 15)) * _PAGE_TOKENS)
        out.append(page_keys(prompt, _PAGE_TOKENS))
    return out


def trace(name: str, requests: int, seed: int = 0) -> list[list[int]]:
    """The page keys of each request of trace ``name``."""
    if name not in TRACES:
        raise ValueError(f"Expected a trace in {TRACES}. Got {name!r}")
    return (_demo_trace if name == "demo" else _scan_trace)(requests, seed)


def ideal_hit_rate(requests: list[list[int]]) -> float:
    """The hit rate of a cache that never evicts: the pages whose keys (chained, so
    their whole prefix) an earlier request asked for, over the pages requested.

    Example:
        >>> ideal_hit_rate([[1, 2], [1, 2, 3, 4], [5, 6]])
        0.25
    """
    seen: set[int] = set()
    hits = total = 0
    for keys in requests:
        n = next((j for j, k in enumerate(keys) if k not in seen), len(keys))
        hits, total = hits + n, total + len(keys)
        seen.update(keys)
    return hits / max(total, 1)


def _replay(requests: list[list[int]], host_pages: int, policy: str,
            write_through: str | int, caches: list[Any], directory: str) -> dict[str, Any]:
    """One case: the trace against a fresh cache; its counts."""
    import kvxfer
    from kvxfer.store import DiskStore

    counts = {"requests": len(requests), "pages_requested": 0, "host_hits": 0,
              "store_hits": 0, "misses": 0}
    with kvxfer.KVCacheManager(caches, num_host_blocks=host_pages) as mgr:
        disk = DiskStore(directory, durable=False)
        cache = kvxfer.HostCache(mgr, disk, namespace="bench-policies:", policy=policy,
                                 write_through=write_through)
        try:
            for keys in requests:
                hit = cache.lookup(keys)
                cache.release(hit)
                counts["pages_requested"] += len(keys)
                for tier in hit.tiers:
                    counts[f"{tier}_hits"] += 1
                counts["misses"] += len(keys) - hit.num_pages
                missing = keys[hit.num_pages:]
                if missing:
                    cache.put(caches, list(range(len(missing))), missing, wait=True)
        finally:
            # Waits for every store write, so the counts are final; without the
            # write-back of the last host pages, which is no policy's traffic.
            cache.close(write_back=False)
            disk.close()
        st = cache.stats()
    counts.update({k: st[k] for k in ("evictions", "store_pages_written",
                                      "store_bytes_written", "store_writes_gated",
                                      "dropped")})
    return counts


def policy_section(progress: Progress | None = None, *, requests: int = 200,
                   traces: Sequence[str] = TRACES, policies: Sequence[str] = POLICIES,
                   write_through: Sequence[str | int] = WRITE_THROUGH
                   ) -> list[dict[str, Any]]:
    """One row per (trace, policy, write-through): its counts and hit rates.

    Each row: ``trace``, ``policy``, ``write_through``, ``requests``,
    ``host_pages``, ``pages_requested``, ``host_hits``, ``store_hits``, ``misses``,
    ``host_hit_rate``, ``store_hit_rate``, ``hit_rate`` (both tiers),
    ``ideal_hit_rate`` (a cache that never evicts: the limit), ``evictions``,
    ``store_pages_written``, ``store_bytes_written``, ``store_writes_gated``,
    ``dropped`` and ``wall_s``.
    """
    from kvxfer import testing

    caches = testing.random_caches(2, _BLOCKS, _BLOCK, "float32")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else None
    rows = []
    for name in traces:
        reqs, pages = trace(name, requests), HOST_PAGES[name]
        ideal = ideal_hit_rate(reqs)
        if progress is not None:
            progress.step("policy", f"policies: {len(reqs)} requests of the {name} trace "
                          f"x {len(policies)} policies x {len(write_through)} write-through "
                          f"settings, {pages} host pages")
        for policy in policies:
            for wt in write_through:
                t0 = now()
                with tempfile.TemporaryDirectory(prefix="kvxfer-bench-policy-",
                                                 dir=shm) as d:
                    counts = _replay(reqs, pages, policy, wt, caches, d)
                n = max(counts["pages_requested"], 1)
                rows.append({"trace": name, "policy": policy, "write_through": wt,
                             "host_pages": pages,
                             **counts, "host_hit_rate": counts["host_hits"] / n,
                             "store_hit_rate": counts["store_hits"] / n,
                             "hit_rate": (counts["host_hits"] + counts["store_hits"]) / n,
                             "ideal_hit_rate": ideal, "wall_s": now() - t0})
    return rows


def policy_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The section's table: hit rates per tier and store bytes written, per case."""
    if not rows:
        return []
    lines = ["", "Eviction policies and write-through: hit rate per tier over the pages "
             "requested (lookups of each request's full pages), a small host tier over a "
             "disk store; counts of the trace, independent of the machine and its load",
             f"  demo: the demo's workload (three shared system prompts, 24 pages), "
             f"{HOST_PAGES['demo']} host pages; scan: four shared 3-page prefixes between "
             f"long one-off prompts, {HOST_PAGES['scan']} host pages",
             "  write-through: never = written when evicted; always = when on host; "
             "N = once found N times (evicted pages with fewer hits are not written); "
             "never evicts = the hit rate of a cache that never evicts (the limit)"]
    body = [[r["trace"], r["policy"], r["write_through"], r["requests"], r["pages_requested"],
             f"{r['host_hit_rate']:.3f}", f"{r['store_hit_rate']:.3f}",
             f"{r['hit_rate']:.3f}", f"{r['ideal_hit_rate']:.3f}", r["evictions"],
             r["store_pages_written"],
             format_bytes(r["store_bytes_written"]), r["store_writes_gated"]]
            for r in rows]
    lines.append(table(body, ["trace", "policy", "write-through", "requests", "pages",
                              "host hit", "store hit", "hit (both)", "never evicts",
                              "evictions",
                              "store pages", "store bytes", "gated"]))
    return lines
