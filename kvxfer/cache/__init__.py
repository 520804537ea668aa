"""``HostCache``: a prefix cache over a manager's host pool, with an optional store tier.

Pages are named by chained keys (a page's key names its whole prefix, e.g.
``kvxfer.demo.page_keys``). The cache keeps one host page per key, evicted as its
policy picks (``CachePolicy``: ``LRUPolicy``, the default, ``S3FIFOPolicy``,
``ARCPolicy``), finds the longest cached prefix of a request, pins what a load reads
so eviction never takes it, and drops pages a load proves bad. Below host memory an optional
``kvxfer.store.Store`` (local disk, Redis) receives evicted pages (or every page,
``write_through=True``), and at ``close()`` the host pages it lacks, as blobs
carrying the digests made on the device at the first offload; a page promoted back goes store -> host -> device and is checked on
the device against those digests. Store keys carry the manager's geometry
fingerprint, so two models or two dtypes never share a page.

Example:
    >>> import jax.numpy as jnp, kvxfer
    >>> caches = [jnp.ones((8, 4, 128), jnp.float32) * i for i in range(2)]
    >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    >>> cache = kvxfer.HostCache(mgr)
    >>> cache.put(caches, [0, 1], keys=[11, 12], wait=True)
    [11, 12]
    >>> cache.put(caches, [2, 1], keys=[13, 12])  # 12 is cached; 11, least recent, goes
    [13]
    >>> hit = cache.lookup([12, 13, 14])
    >>> hit.num_pages, hit.tiers
    (2, ('host', 'host'))
    >>> caches, load = cache.load(caches, hit, [5, 6])
    >>> load.result().verified_prefix
    2
    >>> cache.lookup([11]).num_pages, cache.stats()["evictions"]
    (0, 1)
    >>> cache.close(); mgr.close()

Prefetch. ``cache.prefetch(keys)`` finds the prefix of ``keys`` as a lookup would,
on a background thread, and returns a ``concurrent.futures.Future`` of its length in
host memory; it pins nothing and marks no page used, so a later lookup finds host pages
unless eviction took them first. A lookup that needs pages a prefetch is still
promoting waits for it (no lock held), so each page is read once and takes one slot;
prefetches run one at a time, in order. A prefetch never makes a lookup fail: store
errors and bad pages are counted and logged as a lookup's are, anything else in
``prefetch_errors`` and its future. ``stats()`` counts ``prefetches`` and
``pages_prefetched``; a lookup counts those pages as host hits. ``close()`` cancels
the prefetches not started and gives the running one until its own deadline (then
that future fails, and the prefetch imports nothing): every prefetch is done by the
time ``close()`` returns.

    >>> import tempfile
    >>> from kvxfer import store
    >>> tmp = tempfile.TemporaryDirectory()
    >>> disk = store.DiskStore(tmp.name)
    >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    >>> cache = kvxfer.HostCache(mgr, disk, namespace="doc-model@r1:f32")
    >>> cache.put(caches, [0, 1], keys=[11, 12], wait=True)
    [11, 12]
    >>> cache.flush()
    2
    >>> cache.close(); mgr.close()  # a restart: host memory starts cold
    >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    >>> cache = kvxfer.HostCache(mgr, disk, namespace="doc-model@r1:f32")
    >>> cache.prefetch([11, 12, 13]).result()  # 13 was never stored
    2
    >>> reads = disk.stats()["gets"]
    >>> cache.lookup([11, 12]).tiers, disk.stats()["gets"] - reads  # no store read
    (('host', 'host'), 0)
    >>> cache.close(); mgr.close(); disk.close(); tmp.cleanup()

Several ranks. In a multi-process job (tensor-parallel ranks, each holding its
shards of every page) every rank creates its managers and caches in the same order
and calls ``put``, ``lookup``, ``load`` and ``release`` for the same requests in the
same order, then ``close``. Then:

* ``lookup`` agrees on the hit length across ranks (the minimum, as SGLang's
  HiCache all-reduces its prefix length) before anything is pinned, so every rank
  loads the same pages or misses alike;
* a load agrees on its verified prefix, and a page proven bad on any rank is freed
  on every rank (each deletes its own store copy, once);
* a delivery fault (the device got wrong bytes from an intact host copy) is a miss
  for that load only, on every rank; the page stays in host and store;
* rounds of different requests never pair silently: each carries the keys it is
  about, and mismatched ones raise ``AgreementError`` on every rank;
* ``close`` waits (up to the manager's ``agreement_timeout``) for every rank;
* a ``prefetch`` is the calling rank's own: it takes part in no agreement and moves
  pages into this rank's host memory only, and the next lookup still agrees on the
  minimum (call it on every rank for the same keys to keep the host tiers alike).

A rank that dies is named in a ``TransferError`` by the others' next agreement,
after ``agreement_timeout``; ``jax.distributed`` itself aborts the surviving
processes once the dead rank misses its heartbeats (100 s by default), and at once
if the dead rank is rank 0, which hosts the coordination service.

Deadlines. Every call that can block takes ``timeout`` (seconds, one deadline for the
whole call; None waits as long as it takes): ``lookup``, ``find`` and ``prefetch``
(10 s by default) make a page the store does not hand over in time a miss, logged and
counted in ``store_read_errors`` (a stalled store costs a lookup its deadline, not the
store's socket timeout); ``put(wait=True)`` and ``flush`` (30 s) raise
``TimeoutError`` naming the pages not done; ``close`` (30 s) drops what is not done
by then, logged. A lookup of a page whose store write is still queued imports the
blob the queue holds, without waiting for the writes ahead of it. The ranks'
agreement keeps its own ``agreement_timeout``.

Modules, one idea each: ``_front`` (``HostCache``, one short method per call),
``_ending`` (``flush`` and ``close``), ``_hits`` (``CacheHit``, ``CacheLoad``),
``_host`` (the host tier: index, order, pins, offloads on their way in, eviction),
``_below`` (what the host tier asks of the tier below), ``_store_tier`` (the store
tier: write-behind, promotion, bad store pages), ``_lookup`` (the longest prefix,
agreed across ranks, its store pages read in one batch), ``_prefetch`` (prefetches, on
a thread of their own), ``_settle`` (loads in flight, a load's hits and bad pages),
``_deadline`` (a call's deadline, waits that count cancels, store calls bounded by
one), ``_policy`` (``CachePolicy`` and LRU), ``_guard`` (the policy's calls, checked),
``_s3fifo`` and ``_arc`` (one policy each), ``_events`` (``CacheEvent``s for routers,
``HostCache.subscribe``), ``_blocks`` (keys and block ids) and ``_options``
(construction arguments).
"""

from kvxfer.cache._arc import ARCPolicy as ARCPolicy
from kvxfer.cache._events import CacheEvent as CacheEvent
from kvxfer.cache._events import EventKind as EventKind
from kvxfer.cache._events import Subscription as Subscription
from kvxfer.cache._events import Tier as Tier
from kvxfer.cache._front import HostCache as HostCache
from kvxfer.cache._hits import CacheHit as CacheHit
from kvxfer.cache._hits import CacheLoad as CacheLoad
from kvxfer.cache._policy import CachePolicy as CachePolicy
from kvxfer.cache._policy import LRUPolicy as LRUPolicy
from kvxfer.cache._policy import PolicyName as PolicyName
from kvxfer.cache._s3fifo import S3FIFOPolicy as S3FIFOPolicy

__all__ = ["HostCache", "CacheHit", "CacheLoad", "CachePolicy", "LRUPolicy", "S3FIFOPolicy",
           "ARCPolicy", "PolicyName", "CacheEvent", "EventKind", "Tier", "Subscription"]
