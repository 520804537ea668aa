"""HostCache over real stores (files, a redis-server), counted call by call: a prefix
promoted with one batched read, prefetched ahead of its lookup, and never written back
to a store the cache knows holds it."""

import logging
import pathlib
import threading
import time
import uuid

import numpy as np
import pytest

import kvxfer
from kvxfer import store, testing
from kvxfer.store._seal import Sealer
from test_multiprocess import run_pair

PAGES = 32
KEYS = [1000 + i for i in range(PAGES)]
KEY = bytes(range(32))
WORKER = pathlib.Path(__file__).with_name("rank_worker.py")


def _caches(blank=False):
    caches = testing.random_caches(2, 48, (4, 32), "bfloat16", seed=3)
    return [c * 0 for c in caches] if blank else caches


@pytest.fixture(params=["disk", "redis"])
def inner(request, tmp_path):
    """A real store, empty: a disk directory or a key prefix of its own on redis-server."""
    if request.param == "disk":
        s = store.DiskStore(tmp_path / "pages")
    else:
        s = store.RedisStore(request.getfixturevalue("redis_server"),
                             prefix=f"batch-{uuid.uuid4().hex[:8]}:")
    yield s
    if isinstance(s, store.RedisStore):
        s.clear()
    s.close()


def _stored(inner, keys=KEYS, **options):
    """A first process: offloads ``keys``' pages, writes them all to the store, closes.
    Returns each layer's bits of the device blocks the pages came from (0, 1, ...)."""
    caches = _caches()
    with kvxfer.KVCacheManager(caches, num_host_blocks=len(keys)) as mgr:
        cache = kvxfer.HostCache(mgr, inner, write_through=True,
                                 **{"namespace": "test-model", **options})
        cache.put(caches, list(range(len(keys))), keys, wait=True)
        cache.close()
    assert all(inner.contains(k) for k in _store_keys(inner, keys, **options))
    return [testing.bits(c) for c in caches]


def _store_keys(inner, keys, **options):
    with kvxfer.KVCacheManager(_caches(), num_host_blocks=1) as mgr:
        cache = kvxfer.HostCache(mgr, inner, **{"namespace": "test-model", **options})
        return [cache.store_key(k) for k in keys]


class Cold:
    """A restarted process: a new manager (empty host memory) and a cache over
    ``CountingStore(inner)``."""

    def __init__(self, inner, num_host_blocks=PAGES + 8, batched=True, **options):
        self.caches = _caches(blank=True)
        self.mgr = kvxfer.KVCacheManager(self.caches, num_host_blocks=num_host_blocks)
        self.store = testing.CountingStore(inner, batched=batched)
        self.cache = kvxfer.HostCache(self.mgr, self.store,
                                      **{"namespace": "test-model", **options})

    def load(self, hit, first_block=8):
        blocks = list(range(first_block, first_block + hit.num_pages))
        self.caches, load = self.cache.load(self.caches, hit, blocks)
        return load.result(), [testing.bits(c)[blocks] for c in self.caches]

    def close(self):
        self.cache.close()
        self.mgr.close()


def _check_bytes(got, want, n):
    """The first ``n`` loaded pages hold the bytes of source blocks 0..n-1, every layer."""
    for layer, bits in enumerate(got):
        assert np.array_equal(bits[:n], want[layer][:n]), f"layer {layer}"


def test_a_32_page_prefix_comes_from_the_store_in_one_get_many(inner):
    want = _stored(inner)
    batched, per_page = Cold(inner), Cold(inner, batched=False)
    hit = batched.cache.lookup(KEYS + [5])
    assert batched.store.calls == {"get_many": 1}  # no get, contains or put
    old = per_page.cache.lookup(KEYS + [5])  # the same cache over one get per page
    assert per_page.store.calls["get"] == PAGES + 1
    assert hit.keys == old.keys == tuple(KEYS) and hit.tiers == old.tiers == ("store",) * PAGES
    for cold, h in ((batched, hit), (per_page, old)):
        result, got = cold.load(h)
        assert result.verified_prefix == PAGES
        _check_bytes(got, want, PAGES)
        st = cold.cache.stats()
        assert (st["store_hits"], st["misses"], st["host_hits"]) == (PAGES, 1, 0)
    assert batched.cache.lookup(KEYS).tiers == ("host",) * PAGES
    assert batched.store.calls == {"get_many": 1}  # promoted pages stay on host
    batched.close(), per_page.close()


def test_host_pages_inside_the_prefix_are_not_read_again(inner):
    want = _stored(inner)
    cold = Cold(inner)
    cold.cache.release(cold.cache.lookup(KEYS[4:8]))  # pages 4..7 now on host
    cold.store.calls.clear()
    hit = cold.cache.lookup(KEYS)
    assert cold.store.calls == {"get_many": 1}
    assert hit.tiers == ("store",) * 4 + ("host",) * 4 + ("store",) * (PAGES - 8)
    result, got = cold.load(hit)
    assert result.verified_prefix == PAGES
    _check_bytes(got, want, PAGES)
    assert inner.stats()["gets"] == 4 + PAGES - 4  # each page read once in all
    cold.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "another-key"])
def test_a_bad_page_in_the_middle_cuts_the_prefix_there_and_is_dropped(inner, damage,
                                                                        caplog):
    want = _stored(inner)
    skeys = _store_keys(inner, KEYS)
    victim = skeys[13]
    blob = {"garbage": b"not a page", "truncated": inner.get(victim)[:-64],
            "another-key": inner.get(skeys[3])}[damage]
    inner.put(victim, blob, replace=True)
    cold = Cold(inner)
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        hit = cold.cache.lookup(KEYS)
    assert hit.keys == tuple(KEYS[:13])
    assert cold.store.calls == {"get_many": 1, "delete": 1}
    assert f"page {KEYS[13]:#x} in the {inner.name} store is bad" in caplog.text
    assert not inner.contains(victim)  # dropped; the pages past it stay in the store
    assert all(inner.contains(k) for k in skeys[14:])
    assert cold.cache.find(KEYS[14]) == "store"  # read, but never imported
    assert cold.mgr.num_free_pages == PAGES + 8 - 13
    result, got = cold.load(hit)
    assert result.verified_prefix == 13
    _check_bytes(got, want, 13)
    assert cold.cache.stats()["bad_pages_by_tier"] == {inner.name: 1}
    cold.close()


class _OneKeyUnreadable(testing.CountingStore):
    """A real store one key of which cannot be read in a batch, as a Redis Cluster node
    that is down answers for its keys: ``StoreBatchError`` with the others' blobs."""

    def __init__(self, inner, bad_key):
        super().__init__(inner)
        self.bad_key = bad_key

    def get_many(self, keys):
        keys = list(keys)
        results = super().get_many(keys)
        if self.bad_key not in keys:
            return results
        i = keys.index(self.bad_key)
        results[i] = None
        raise store.StoreBatchError("get_many", results,
                                    {i: store.StoreError("node 127.0.0.1:7002 is down")})


def test_a_store_error_in_the_batch_is_a_miss_at_its_page_counted_once(tmp_path, caplog):
    disk = store.DiskStore(tmp_path / "pages")
    want = _stored(disk)
    victim = _store_keys(disk, KEYS)[20]
    caches = _caches(blank=True)
    with kvxfer.KVCacheManager(caches, num_host_blocks=PAGES) as mgr:
        cache = kvxfer.HostCache(mgr, _OneKeyUnreadable(disk, victim), namespace="test-model")
        with caplog.at_level(logging.WARNING, logger="kvxfer"):
            hit = cache.lookup(KEYS)
        assert hit.num_pages == 20
        assert f"could not be read for page {KEYS[20]:#x}: node 127.0.0.1:7002 is down" \
            in caplog.text
        st = cache.stats()
        assert st["store_read_errors"] == 1 and st["bad_pages"] == 0
        assert disk.contains(victim)  # an error is not a bad page: nothing dropped
        caches, load = cache.load(caches, hit, list(range(8, 28)))
        assert load.result().verified_prefix == 20
        _check_bytes([testing.bits(c)[8:28] for c in caches], want, 20)
        cache.close()
    disk.close()


@pytest.mark.parametrize("encrypt", [False, True])
def test_sealed_pages_are_batched_and_a_forged_one_cuts_the_prefix(tmp_path, encrypt,
                                                                   caplog):
    disk = store.DiskStore(tmp_path / "pages")
    sealed = {"auth_key": KEY, "encrypt": encrypt}
    want = _stored(disk, **sealed)
    cold = Cold(disk, **sealed)
    hit = cold.cache.lookup(KEYS)
    assert cold.store.calls == {"get_many": 1} and hit.num_pages == PAGES
    result, got = cold.load(hit)
    assert result.verified_prefix == PAGES
    _check_bytes(got, want, PAGES)
    cold.close()
    # A blob sealed with another key in the middle: a miss from there, removed.
    skeys = _store_keys(disk, KEYS, **sealed)
    opened = Sealer(KEY, encrypt=encrypt).open(skeys[9], disk.get(skeys[9]))
    disk.put(skeys[9], Sealer(b"another key, 16+", encrypt=encrypt).seal(skeys[9], opened),
             replace=True)
    cold = Cold(disk, **sealed)
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        hit = cold.cache.lookup(KEYS)
    assert hit.num_pages == 9 and cold.store.calls == {"get_many": 1, "delete": 1}
    assert cold.cache.stats()["store_auth_failures"] == 1
    assert "a writer without the key changed it" in caplog.text
    assert not disk.contains(skeys[9]) and disk.contains(skeys[10])
    result, got = cold.load(hit)
    assert result.verified_prefix == 9
    _check_bytes(got, want, 9)
    cold.close(), disk.close()


# -- prefetch ---------------------------------------------------------------------------


def test_prefetch_then_lookup_hits_host_with_no_store_call(inner):
    want = _stored(inner)
    cold = Cold(inner)
    future = cold.cache.prefetch(KEYS)
    assert future.result(60) == PAGES
    assert cold.store.calls == {"get_many": 1}
    assert cold.mgr.num_free_pages == 8 and cold.cache.stats()["pinned_pages"] == 0
    cold.store.calls.clear()
    hit = cold.cache.lookup(KEYS)
    assert cold.store.calls == {} and hit.tiers == ("host",) * PAGES
    result, got = cold.load(hit)
    assert result.verified_prefix == PAGES
    _check_bytes(got, want, PAGES)
    st = cold.cache.stats()
    assert (st["prefetches"], st["pages_prefetched"], st["prefetch_errors"]) == (1, PAGES, 0)
    assert (st["host_hits"], st["store_hits"]) == (PAGES, 0)
    cold.close()


def test_prefetch_of_missing_keys_is_harmless(tmp_path):
    disk = store.DiskStore(tmp_path / "pages")
    _stored(disk, KEYS[:4])
    cold = Cold(disk)
    assert cold.cache.prefetch([7, 8, 9]).result(60) == 0  # none stored
    assert cold.cache.prefetch(KEYS[:4] + [7] + KEYS[4:8]).result(60) == 4  # up to 7
    st = cold.cache.stats()
    assert st["pages_prefetched"] == 4 and st["prefetch_errors"] == 0
    assert st["bad_pages"] == st["store_read_errors"] == 0
    assert sorted(cold.cache.keys()) == KEYS[:4]
    assert cold.cache.lookup([7]).num_pages == 0
    with pytest.raises(TypeError, match="keys must be a sequence of keys"):
        cold.cache.prefetch("abc")
    cold.close()
    with kvxfer.KVCacheManager(_caches(), num_host_blocks=2) as mgr:  # no store at all
        cache = kvxfer.HostCache(mgr)
        cache.put(_caches(), [0], [5], wait=True)
        assert cache.prefetch([5, 6]).result(60) == 1 and len(cache) == 1
        cache.close()
    with pytest.raises(RuntimeError, match="the HostCache is closed"):
        cold.cache.prefetch([1])
    disk.close()


class _Broken(testing.CountingStore):
    """A real store whose first batched read fails: with a ``StoreError`` (unreachable)
    or with something no store should raise (a bug in a store of someone else's)."""

    def __init__(self, inner, error):
        super().__init__(inner)
        self.error = error

    def get_many(self, keys):
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return super().get_many(keys)


@pytest.mark.parametrize("error", [store.StoreError("connection refused"),
                                   RuntimeError("a bug in the store")])
def test_a_failed_prefetch_is_counted_and_never_fails_a_lookup(tmp_path, error, caplog):
    disk = store.DiskStore(tmp_path / "pages")
    want = _stored(disk, KEYS[:4])
    caches = _caches(blank=True)
    with kvxfer.KVCacheManager(caches, num_host_blocks=8) as mgr:
        cache = kvxfer.HostCache(mgr, _Broken(disk, error), namespace="test-model")
        with caplog.at_level(logging.WARNING, logger="kvxfer"):
            future = cache.prefetch(KEYS[:4])
            if isinstance(error, store.StoreError):  # a miss, counted as a lookup's is
                assert future.result(60) == 0
                assert cache.stats()["store_read_errors"] == 1
                assert "connection refused" in caplog.text
            else:
                assert isinstance(future.exception(60), RuntimeError)
                assert cache.stats()["prefetch_errors"] == 1
                assert "prefetch of 4 pages failed: a bug in the store" in caplog.text
        assert cache.stats()["pinned_pages"] == 0 and len(cache) == 0
        hit = cache.lookup(KEYS[:4])  # reads for itself
        assert hit.tiers == ("store",) * 4
        caches, load = cache.load(caches, hit, [8, 9, 10, 11])
        assert load.result().verified_prefix == 4
        _check_bytes([testing.bits(c)[8:12] for c in caches], want, 4)
        cache.close()
    disk.close()


class _Held(testing.CountingStore):
    """A real store whose batched reads wait until ``release`` is set (a slow network),
    saying when one has started."""

    def __init__(self, inner):
        super().__init__(inner)
        self.started, self.release = threading.Event(), threading.Event()

    def get_many(self, keys):
        self.started.set()
        assert self.release.wait(60), "the test never released the store"
        return super().get_many(keys)


def test_a_lookup_during_a_prefetch_waits_for_it_and_reads_nothing(tmp_path):
    disk = store.DiskStore(tmp_path / "pages")
    want = _stored(disk)
    caches = _caches(blank=True)
    with kvxfer.KVCacheManager(caches, num_host_blocks=PAGES + 8) as mgr:
        held = _Held(disk)
        cache = kvxfer.HostCache(mgr, held, namespace="test-model")
        future = cache.prefetch(KEYS)
        assert held.started.wait(60)  # the prefetch is reading, with no lock held...
        assert len(cache) == 0 and cache.find(KEYS[0]) == "store"  # ...so calls go on
        box = {}
        looking = threading.Thread(target=lambda: box.setdefault("hit", cache.lookup(KEYS)))
        looking.start()
        time.sleep(0.3)  # lets the lookup reach the prefetch it needs (it would read too)
        held.release.set()
        looking.join(60)
        hit = box["hit"]
        assert future.result(60) == PAGES
        assert held.calls["get_many"] == 1  # one read of each page, by the prefetch
        assert hit.tiers == ("host",) * PAGES and mgr.num_free_pages == 8  # one slot each
        caches, load = cache.load(caches, hit, list(range(8, 8 + PAGES)))
        assert load.result().verified_prefix == PAGES
        _check_bytes([testing.bits(c)[8:8 + PAGES] for c in caches], want, PAGES)
        cache.close()
    disk.close()


def test_close_during_a_prefetch_cancels_the_queued_and_imports_nothing(tmp_path, caplog):
    disk = store.DiskStore(tmp_path / "pages")
    _stored(disk)
    with kvxfer.KVCacheManager(_caches(), num_host_blocks=PAGES) as mgr:
        held = _Held(disk)
        cache = kvxfer.HostCache(mgr, held, namespace="test-model")
        running = cache.prefetch(KEYS[:16])
        queued = cache.prefetch(KEYS[16:])
        assert held.started.wait(60)
        with caplog.at_level(logging.WARNING, logger="kvxfer"):
            cache.close(timeout=0.1)  # the running one is still held in its read
        assert queued.cancelled() and running.done()  # every prefetch settled
        assert "a prefetch was still reading from the store 0.1 s after close()" in \
            caplog.text
        with pytest.raises(RuntimeError, match="closed while this prefetch was still"):
            running.result(0)
        held.release.set()  # its read comes back after close: not imported
        for _ in range(500):
            if not any(t.name == "kvxfer-prefetch" for t in threading.enumerate()):
                break
            time.sleep(0.01)
        assert mgr.num_free_pages == PAGES and held.calls["get_many"] == 1
        with pytest.raises(RuntimeError, match="the HostCache is closed"):
            cache.lookup(KEYS)
    disk.close()


def test_a_prefetch_on_one_rank_keeps_the_ranks_agreed(tmp_path):
    a, b = run_pair(f"prefetch:{tmp_path}", worker=WORKER)
    assert a["prefetched"] == 4 and "prefetched" not in b
    # Each rank measures its prefix with one contains_many (for the page past it);
    # rank 1, which has to promote, reads its 4 pages with one get_many.
    assert a["calls"] == {"contains_many": 1}
    assert b["calls"] == {"contains_many": 1, "get_many": 1}
    assert a["tiers"] == ["host"] * 4 and b["tiers"] == ["store"] * 4
    assert a["prefix"] == b["prefix"] == 4 and a["exact"] and b["exact"]


# -- pages the store already holds ------------------------------------------------------


@pytest.mark.parametrize("write_through", [False, True])
def test_a_promoted_page_is_never_written_back(inner, write_through):
    _stored(inner)
    cold = Cold(inner, num_host_blocks=PAGES, write_through=write_through)
    cold.cache.release(cold.cache.lookup(KEYS))  # all 32 promoted: the pool is full
    cold.store.calls.clear()
    new = [7000, 7001, 7002, 7003]
    source = _caches()
    cold.cache.put(source, [40, 41, 42, 43], new, wait=True)  # evicts KEYS[28:] (tail)
    cold.cache.put(source, [0, 1, 2, 3], KEYS[28:], wait=True)  # evicts KEYS[24:28]
    cold.cache.close()  # waits for the writes
    # Only the new pages are written (write-through, or close's write-back, which asks
    # the store once which host pages it holds); the promoted ones, evicted or put
    # again, are never written.
    assert cold.store.calls == {"put": 4, "contains_many": 1}
    assert cold.cache.stats()["store_writes_skipped"] == (12 if write_through else 8)
    assert all(inner.contains(k) for k in _store_keys(inner, KEYS))
    cold.mgr.close()


def test_a_written_page_is_not_written_again_when_evicted(tmp_path):
    disk = store.DiskStore(tmp_path / "pages")
    caches = _caches()
    with kvxfer.KVCacheManager(caches, num_host_blocks=4) as mgr:
        counted = testing.CountingStore(disk)
        cache = kvxfer.HostCache(mgr, counted, write_through=True, namespace="test-model")
        cache.put(caches, [0, 1, 2, 3], KEYS[:4], wait=True)
        cache.flush()  # their writes are done (flush asks the store about each)
        counted.calls.clear()
        cache.put(caches, [4, 5, 6, 7], KEYS[4:8], wait=True)  # evicts the first four
        cache.close()
        assert counted.calls == {"put": 4}  # the new pages; the evicted ones are known
        st = cache.stats()
        assert st["store_pages_written"] == 8 and st["store_writes_skipped"] == 4
    disk.close()
