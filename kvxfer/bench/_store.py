"""The store section: page blobs written to and read from a store tier, against the
limit of the same medium measured in the same run.

* **disk** (``DiskStore``): the limit is one file on the same file system written
  sequentially in blob-sized writes, each followed by an fsync (the store makes every
  put durable before it returns), and read back in blob-sized reads: from the page
  cache (``read``), and after asking the kernel to drop the files' cached pages
  (``read_cold``, both sides alike: ``posix_fadvise(DONTNEED)``).
* **redis** (``RedisStore``) and **redis-cluster** (``RedisClusterStore``): the limit
  is redis-py's plain ``SET`` / ``GET`` of the same bytes against the same server (the
  same cluster, through redis-py's cluster client), from a client of its own.

For each Redis store, ``lookup_section`` then measures a prefix lookup: the pages of a
``lookup_pages``-page prefix read with one ``get`` per page (a round trip each, as
``HostCache`` promotes them today) against one ``get_many`` of them all, with
redis-py's plain per-key ``GET`` and its pipelined ``GET`` of the same bytes as their
limits, every variant interleaved. In the same rounds it measures what a cache gains end
to end: ``HostCache.lookup`` of the same number of pages, each about the same size,
promoted from the store into host memory (read, opened, imported), with the cache's
batched read against the same cache over the per-page path (``CountingStore(store,
batched=False)``: one ``get`` per page, as lookups read before), with the store calls
each lookup made.

Every put goes to a new key (the previous round's are deleted before the timer
starts); every variant of a size runs interleaved, round by round.

Each size also measures what sealing costs (``HostCache(auth_key=, encrypt=)``):
``Sealer.seal`` and ``Sealer.open`` of one blob, HMAC-SHA-256 and, with the
``cryptography`` package, AES-256-GCM, against a copy of the same bytes in the same
run (the limit: sealing reads every byte once and writes it once).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvxfer import testing
from kvxfer._text import format_bytes
from kvxfer.bench._config import BenchConfig
from kvxfer.bench.timing import Progress, interleaved, now, stats
from kvxfer.cache import HostCache
from kvxfer.manager import KVCacheManager
from kvxfer.store import (DiskStore, RedisClusterStore, RedisStore, Sealer, Store,
                          StoreError, parse_spec)

__all__ = ["store_section", "store_steps", "lookup_section", "OPS", "DEFAULT_STORE"]

#: How the report names the store the section measures when given none: a disk store
#: in a new temporary directory of the system's (removed afterwards).
DEFAULT_STORE = "temporary directory"
#: What each store kind measures, per blob size.
OPS = {"disk": ("write", "write_not_durable", "read", "read_cold"),
       "redis": ("write", "read"), "redis-cluster": ("write", "read")}
#: The limit each operation is measured against (when not its own).
_LIMIT_OF = {"write_not_durable": "write"}


def store_steps(cfg: BenchConfig, stores: Sequence[str]) -> int:
    """How many steps the section takes (one per store and blob size, and one per Redis
    store for its prefix lookup)."""
    lookups = sum(parse_spec(spec)[0] != "disk" for spec in stores)
    return max(1, len(stores)) * len(cfg.store_blob_bytes) + \
        lookups * len(cfg.lookup_blob_bytes)


def _raw_client(store: RedisStore | RedisClusterStore) -> Any:
    """A plain redis-py client of the same server or cluster, for the limits."""
    import redis
    import redis.cluster

    if isinstance(store, RedisStore):
        return redis.Redis.from_url(store.url)
    # redis+cluster://[CRED@]HOST:PORT,...: redis-py's cluster client from its first node.
    cred, at, nodes = store.spec.partition("://")[2].rpartition("@")
    return redis.cluster.RedisCluster.from_url(f"redis://{cred}{at}{nodes.split(',')[0]}")


def _filesystem(path: str) -> str | None:
    """The file system type ``path`` lives on (Linux ``/proc/self/mounts``), or None."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best = max((m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best[1] if best else None


def _drop_cached(paths: Sequence[str]) -> None:
    """Asks the kernel to drop the cached pages of ``paths`` (written back already)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _sync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(directory: str) -> list[str]:
    return [e.path for e in os.scandir(directory) if e.is_file() and not e.name.startswith(".")]


class _Keys:
    """Fresh keys per round for a writer, and the deletion of the previous round's."""

    def __init__(self, tag: str, n: int):
        self.tag, self.n, self.round = tag, n, 0

    def next(self) -> list[str]:
        self.round += 1
        return [f"{self.tag}-{self.round}-{i}" for i in range(self.n)]

    def previous(self) -> list[str]:
        return [f"{self.tag}-{self.round}-{i}" for i in range(self.n)] if self.round else []


def _disk_variants(store: DiskStore, blob: bytes, n: int, tag: str
                   ) -> tuple[dict[str, Callable[[], float]], Callable[[], None]]:
    size = len(blob)
    limit_path = os.path.join(store.path, f"limit-{tag}.bin")
    fd = os.open(limit_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    fast = DiskStore(store.path, durable=False)  # the same directory, no directory fsync
    writes, fast_writes = _Keys(f"{tag}-w", n), _Keys(f"{tag}-f", n)
    reads = [f"{tag}-r-{i}" for i in range(n)]
    for k in reads:
        store.put(k, blob, replace=True)
    os.ftruncate(fd, 0)
    for i in range(n):  # the limit's read file, with the same bytes
        os.pwrite(fd, blob, i * size)
    os.fsync(fd)

    def limit_write() -> float:
        os.ftruncate(fd, 0)  # new blocks each round, as the store's new files get
        os.fsync(fd)
        t0 = now()
        for i in range(n):
            os.pwrite(fd, blob, i * size)
            os.fsync(fd)
        return now() - t0

    def put_all(target: DiskStore, keys: _Keys) -> float:
        for k in keys.previous():
            target.delete(k)
        _sync_dir(store.path)  # the deletions' journal commit (and discards) not timed
        new = keys.next()
        t0 = now()
        for k in new:
            target.put(k, blob)
        return now() - t0

    def limit_read() -> float:
        t0 = now()
        for i in range(n):
            os.pread(fd, size, i * size)
        return now() - t0

    def store_read() -> float:
        t0 = now()
        for k in reads:
            if store.get(k) is None:
                raise RuntimeError(f"bench: the disk store lost key {k!r}")
        return now() - t0

    def limit_read_cold() -> float:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return limit_read()

    def store_read_cold() -> float:
        _drop_cached(_files(store.path))
        return store_read()

    def close() -> None:
        os.close(fd)
        os.unlink(limit_path)
        for k in writes.previous() + fast_writes.previous() + reads:
            store.delete(k)
        fast.close()

    return ({"limit_write": limit_write, "store_write": lambda: put_all(store, writes),
             "store_write_not_durable": lambda: put_all(fast, fast_writes),
             "limit_read": limit_read, "store_read": store_read,
             "limit_read_cold": limit_read_cold, "store_read_cold": store_read_cold}, close)


def _redis_variants(store: RedisStore | RedisClusterStore, blob: bytes, n: int, tag: str
                    ) -> tuple[dict[str, Callable[[], float]], Callable[[], None]]:
    raw = _raw_client(store)
    raw_prefix = f"{store.prefix}limit:{tag}:"
    writes, raw_writes = _Keys(f"{tag}-w", n), _Keys(raw_prefix + "w", n)
    reads = [f"{tag}-r-{i}" for i in range(n)]
    raw_reads = [f"{raw_prefix}r-{i}" for i in range(n)]
    for k, rk in zip(reads, raw_reads):
        store.put(k, blob, replace=True)
        raw.set(rk, blob)

    def limit_write() -> float:
        if raw_writes.round:
            raw.delete(*raw_writes.previous())
        keys = raw_writes.next()
        t0 = now()
        for k in keys:
            raw.set(k, blob)
        return now() - t0

    def store_write() -> float:
        for k in writes.previous():
            store.delete(k)
        keys = writes.next()
        t0 = now()
        for k in keys:
            store.put(k, blob)
        return now() - t0

    def limit_read() -> float:
        t0 = now()
        for k in raw_reads:
            raw.get(k)
        return now() - t0

    def store_read() -> float:
        t0 = now()
        for k in reads:
            if store.get(k) is None:
                raise RuntimeError(f"bench: the redis store lost key {k!r}")
        return now() - t0

    def close() -> None:
        raw.delete(*raw_reads, *raw_writes.previous())
        raw.close()
        for k in writes.previous() + reads:
            store.delete(k)

    return ({"limit_write": limit_write, "store_write": store_write,
             "limit_read": limit_read, "store_read": store_read}, close)


@contextlib.contextmanager
def _opened(spec: str | None) -> Iterator[tuple[Store, dict[str, Any]]]:
    """The store ``spec`` names (None: the default), with what the report says about it.

    The bench never touches what a store held before: a disk store is opened in a new
    temporary directory (under the spec's directory; by default under the system's),
    a Redis store under a prefix of its own; neither has a capacity (so
    nothing is evicted), and both are emptied of the bench's blobs afterwards.
    """
    kind, where = ("disk", None) if spec is None else parse_spec(spec)
    tmp = None
    prefix = f"kvxfer-bench-{uuid.uuid4().hex[:8]}:"
    if kind == "disk":  # never opened as a store itself: that would clean it
        if where is not None and not os.path.isdir(where):
            raise StoreError(f"bench: store directory {where!r} does not exist")
        tmp = tempfile.mkdtemp(prefix="kvxfer-bench-store-", dir=where)
        store: Store = DiskStore(tmp)
    elif kind == "redis-cluster":
        store = RedisClusterStore(where, prefix=prefix)
    else:
        store = RedisStore(where, prefix=prefix)
    try:
        info: dict[str, Any] = {"store": store.name,
                                "spec": DEFAULT_STORE if spec is None else spec}
        if isinstance(store, DiskStore):
            info["path"] = store.path
            info["filesystem"] = _filesystem(store.path)
        else:
            info["spec"] = store.stats()["url"]  # the password hidden
        yield store, info
    finally:
        if isinstance(store, (RedisStore, RedisClusterStore)):
            store.clear()
        store.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def store_section(cfg: BenchConfig, stores: Sequence[str], progress: Progress
                  ) -> list[dict[str, Any]]:
    """Write and read throughput of each store in ``stores`` (specs ``open_store`` takes;
    none: a disk store in a temporary directory), per blob size, against its limit.

    Returns:
      One row per store and blob size: ``store``, ``spec`` (``path`` and
      ``filesystem`` for a disk store), ``blob_bytes``, ``blobs``, ``bytes``, and
      ``limit`` and ``methods``, each per operation (``write``, ``read``, and for
      disk ``read_cold``; disk ``methods`` add ``write_not_durable``, a store opened
      with ``durable=False``, against the ``write`` limit) the stats of the best
      repeat; ``methods`` add ``fraction_of_limit``.
    """
    rng = np.random.default_rng(0)
    rows = []
    sealing: dict[int, dict[str, Any]] = {}
    for spec in stores or [None]:
        with _opened(spec) as (store, where):
            for size in cfg.store_blob_bytes:
                n = max(1, min(cfg.store_bytes // size, cfg.store_max_blobs))
                progress.step("store", f"store: {store.name} ({where['spec']}), "
                              f"{n} x {format_bytes(size)} blobs = {format_bytes(n * size)}")
                blob = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
                tag = f"bench-{size}"
                make = _disk_variants if isinstance(store, DiskStore) else _redis_variants
                variants, close = make(store, blob, n, tag)
                try:
                    t = interleaved(variants, cfg.store_repeats)
                finally:
                    close()
                nbytes = n * size
                ops = OPS[store.name]
                limit = {op: stats(t[f"limit_{op}"]["s"], nbytes) for op in ops
                         if op not in _LIMIT_OF}
                methods = {}
                for op in ops:
                    s = stats(t[f"store_{op}"]["s"], nbytes)
                    s["fraction_of_limit"] = s["gbps"] / limit[_LIMIT_OF.get(op, op)]["gbps"]
                    methods[op] = s
                if size not in sealing:
                    sealing[size] = _sealing(blob, cfg.store_repeats)
                rows.append({**where, "blob_bytes": size, "blobs": n, "bytes": nbytes,
                             "limit": limit, "methods": methods, "sealing": sealing[size]})
    return rows


#: The cache lookup's caches: layers of bf16 blocks of 128 columns.
_CACHE_LAYERS, _CACHE_COLUMNS = 4, 128


class _CacheLookup:
    """``HostCache.lookup`` of a ``pages``-page prefix promoted from ``store``, each page
    about ``page_bytes`` (4 bf16 layers): the pages are written to the store once; each
    run looks the prefix up (timed) then evicts it from host memory again (not timed;
    the cache knows the store holds those pages, so eviction writes nothing).

    ``batched=False`` puts the cache over ``CountingStore(store, batched=False)``: one
    ``get`` per page. ``calls`` counts the store calls of the timed lookups.
    """

    def __init__(self, store: Store, page_bytes: int, pages: int, *, batched: bool):
        rows = max(1, page_bytes // (_CACHE_LAYERS * _CACHE_COLUMNS * 2))
        caches = testing.random_caches(_CACHE_LAYERS, pages, (rows, _CACHE_COLUMNS),
                                       "bfloat16", seed=2)
        self.keys = list(range(1, pages + 1))
        with KVCacheManager(caches, num_host_blocks=pages) as writer:
            cache = HostCache(writer, store, namespace="bench-cache:", write_through=True)
            cache.put(caches, list(range(pages)), self.keys, wait=True)
            cache.flush()
            self.blob_bytes = len(store.get(cache.store_key(self.keys[0])) or b"")
            cache.close()
        self.mgr = KVCacheManager(caches, num_host_blocks=pages)
        self.store = testing.CountingStore(store, batched=batched)
        self.cache = HostCache(self.mgr, self.store, namespace="bench-cache:")
        self.calls: dict[str, int] = {}
        self.runs = 0

    def __call__(self) -> float:
        self.store.calls.clear()
        t0 = now()
        hit = self.cache.lookup(self.keys)
        elapsed = now() - t0
        calls = dict(self.store.calls)
        self.cache.release(hit)
        if hit.tiers != ("store",) * len(self.keys):
            raise RuntimeError(f"bench: the cache lookup found {hit.tiers.count('store')} "
                               f"of {len(self.keys)} pages in the {self.store.name} store")
        self.cache.make_room(len(self.keys))  # every page back out of host memory
        self.runs += 1
        for name, n in calls.items():
            self.calls[name] = self.calls.get(name, 0) + n
        return elapsed

    def calls_per_lookup(self) -> dict[str, float]:
        return {name: n / self.runs for name, n in sorted(self.calls.items())}

    def close(self) -> None:
        self.cache.close()
        self.mgr.close()


def _lookup_variants(store: RedisStore | RedisClusterStore, blob: bytes, pages: int,
                     cached: dict[str, _CacheLookup]
                     ) -> tuple[dict[str, Callable[[], float]], Callable[[], None]]:
    raw = _raw_client(store)
    tag = f"lookup-{len(blob)}"
    keys = [f"{tag}-{i}" for i in range(pages)]
    raw_keys = [f"{store.prefix}limit:{tag}-{i}" for i in range(pages)]
    if store.put_many([(k, blob) for k in keys], replace=True) != [True] * pages:
        raise RuntimeError("bench: the lookup's pages were not all written")
    for k in raw_keys:
        raw.set(k, blob)

    def timed(read: Callable[[], list[Any]], what: str) -> Callable[[], float]:
        def run() -> float:
            t0 = now()
            got = read()
            elapsed = now() - t0
            if sum(b is not None and len(b) == len(blob) for b in got) != pages:
                raise RuntimeError(f"bench: the {what} lookup lost pages of the "
                                   f"{store.name} store")
            return elapsed
        return run

    def raw_pipelined() -> list[Any]:
        pipe = raw.pipeline(transaction=False)
        for k in raw_keys:
            pipe.get(k)
        return pipe.execute()

    cached["per_page"] = _CacheLookup(store, len(blob), pages, batched=False)
    cached["batched"] = _CacheLookup(store, len(blob), pages, batched=True)

    def close() -> None:
        raw.delete(*raw_keys)
        raw.close()
        for k in keys:
            store.delete(k)
        for c in cached.values():
            c.close()

    return ({"limit_per_page": timed(lambda: [raw.get(k) for k in raw_keys], "raw"),
             "store_per_page": timed(lambda: [store.get(k) for k in keys], "per-page"),
             "limit_batched": timed(raw_pipelined, "raw pipelined"),
             "store_batched": timed(lambda: store.get_many(keys), "batched"),
             "cache_per_page": cached["per_page"], "cache_batched": cached["batched"]},
            close)


def lookup_section(cfg: BenchConfig, stores: Sequence[str], progress: Progress
                   ) -> list[dict[str, Any]]:
    """A ``lookup_pages``-page prefix lookup from each Redis store of ``stores`` (disk
    stores are skipped), per page size of ``lookup_blob_bytes``: one ``get`` per page
    against one ``get_many``.

    Returns:
      One row per Redis store and page size: ``store``, ``spec``, ``pages``,
      ``blob_bytes``, ``bytes``, ``reference`` (the size the target is checked at);
      ``methods`` (``per_page``, ``batched``) and ``limit`` (redis-py's per-key
      ``GET`` and its pipelined ``GET``s of the same bytes), the stats of every
      repeat, ``methods`` with ``fraction_of_limit``; ``speedup`` (per-page p50 over
      batched p50) and ``speedup_best`` (over the best repeats); ``cache``: the
      ``HostCache.lookup`` of as many pages (``blob_bytes``: each page's blob),
      ``methods`` ``per_page`` and ``batched`` (stats of every repeat, each with
      ``calls``: its store calls per lookup), ``speedup`` and ``speedup_best``.
    """
    rng = np.random.default_rng(1)
    rows = []
    for spec in stores:
        if parse_spec(spec)[0] == "disk":
            continue
        with _opened(spec) as (store, where):
            for size in cfg.lookup_blob_bytes:
                rows.append(_lookup_row(cfg, store, where, size, rng, progress))
    return rows


def _lookup_row(cfg: BenchConfig, store: RedisStore | RedisClusterStore,
                where: dict[str, Any], size: int, rng: np.random.Generator,
                progress: Progress) -> dict[str, Any]:
    pages = cfg.lookup_pages
    progress.step("store", f"store: {store.name} ({where['spec']}), lookup of a "
                  f"{pages}-page prefix of {format_bytes(size)} pages, per page and batched")
    blob = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    cached: dict[str, _CacheLookup] = {}
    try:
        variants, close = _lookup_variants(store, blob, pages, cached)
    except BaseException:
        for c in cached.values():
            c.close()
        raise
    try:
        t = interleaved(variants, cfg.lookup_repeats)
    finally:
        close()
    nbytes = pages * size
    methods = {m: stats(t[f"store_{m}"]["s"], nbytes) for m in ("per_page", "batched")}
    limit = {m: stats(t[f"limit_{m}"]["s"], nbytes) for m in ("per_page", "batched")}
    for m in methods:
        methods[m]["fraction_of_limit"] = methods[m]["gbps"] / limit[m]["gbps"]
    page_bytes = cached["batched"].blob_bytes
    through = {m: dict(stats(t[f"cache_{m}"]["s"], pages * page_bytes),
                       calls=cached[m].calls_per_lookup()) for m in ("per_page", "batched")}
    cache = {"blob_bytes": page_bytes, "methods": through,
             "speedup": through["per_page"]["p50_s"] / through["batched"]["p50_s"],
             "speedup_best": through["per_page"]["best_s"] / through["batched"]["best_s"]}
    return {**where, "pages": pages, "blob_bytes": size, "bytes": nbytes, "cache": cache,
            "reference": size == cfg.lookup_reference_bytes, "methods": methods,
            "limit": limit,
            "speedup": methods["per_page"]["p50_s"] / methods["batched"]["p50_s"],
            "speedup_best": methods["per_page"]["best_s"] / methods["batched"]["best_s"]}


def _sealing(blob: bytes, repeats: int) -> dict[str, Any]:
    """Seal and open of one blob per mode against a copy of it: ``memcpy`` and, per
    mode (``auth``, ``encrypt`` when ``cryptography`` is installed), ``seal`` and
    ``open`` stats with ``fraction_of_limit``."""
    key = bytes(range(32))
    sealers = {"auth": Sealer(key)}
    try:
        sealers["encrypt"] = Sealer(key, encrypt=True)
    except ImportError:
        pass
    copy = bytearray(len(blob))
    sealed = {mode: sealer.seal("bench", blob) for mode, sealer in sealers.items()}

    def timed(fn: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            t0 = now()
            fn()
            return now() - t0
        return run

    variants = {"memcpy": timed(lambda: copy.__setitem__(slice(None), blob))}
    for mode, sealer in sealers.items():
        variants[f"{mode}_seal"] = timed(lambda s=sealer: s.seal("bench", blob))
        variants[f"{mode}_open"] = timed(lambda s=sealer, m=mode: s.open("bench", sealed[m]))
    t = interleaved(variants, max(repeats, 5))
    limit = stats(t["memcpy"]["s"], len(blob))
    out: dict[str, Any] = {"memcpy": limit}
    for mode in sealers:
        out[mode] = {}
        for op in ("seal", "open"):
            s = stats(t[f"{mode}_{op}"]["s"], len(blob))
            s["fraction_of_limit"] = s["gbps"] / limit["gbps"]
            out[mode][op] = s
    return out
