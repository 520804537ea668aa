"""What a cache writes into a store and under which name: keys of any length used whole,
key ids in store keys (rotation, fleets with other keys), write errors of any kind
counted, the pages a close loses named, and a store capped at one page's frame."""

import hashlib
import logging
import threading

import jax.numpy as jnp
import numpy as np
import pytest

import kvxfer
from kvxfer import store, testing
from kvxfer._counters import Counters
from kvxfer.cache._events import EventHub
from kvxfer.cache._store_tier import StoreTier
from kvxfer.manager import blob_bytes
from kvxfer.store import Sealer, SealError, Store
from test_store_hardening import sparse_frame

KEYS = [10, 11, 12]
KEY_A, KEY_B = bytes(range(32)), bytes(range(100, 132))


def _caches(seed=0, dtype="float32"):
    return testing.random_caches(2, 8, (4, 32), dtype, seed=seed)


class Fleet:
    """One serving process: a manager and a cache over ``disk``."""

    def __init__(self, disk, blocks=4, dtype="float32", **options):
        self.caches = [jnp.zeros_like(c) for c in _caches(dtype=dtype)]
        self.mgr = kvxfer.KVCacheManager(self.caches, num_host_blocks=blocks)
        self.cache = kvxfer.HostCache(self.mgr, disk, **{"namespace": "test-model", **options})

    def write(self, keys=KEYS, seed=0):
        """Offloads pages of ``_caches(seed)`` under ``keys`` and stores them."""
        caches = _caches(seed)
        self.cache.put(caches, list(range(len(keys))), keys, wait=True)
        assert self.cache.flush() == len(keys)
        return [testing.bits(c)[:len(keys)] for c in caches]

    def read(self, keys=KEYS):
        """The verified prefix of ``keys`` loaded, and the bytes it loaded."""
        hit = self.cache.lookup(keys)
        self.caches, load = self.cache.load(self.caches, hit, list(range(hit.num_pages)))
        n = load.result().verified_prefix
        return n, [testing.bits(c)[:n] for c in self.caches]

    def close(self):
        self.cache.close(), self.mgr.close()


# -- keys of any length are used whole ----------------------------------------------


@pytest.mark.parametrize("encrypt", [False, True])
def test_long_keys_that_share_their_first_64_bytes_are_different_keys(encrypt):
    a = bytes(range(90))
    b = a[:64] + bytes(26)  # the same first 64 bytes: BLAKE2b's key size
    short = hashlib.blake2b(a, digest_size=64, person=b"kvxfer-longkey").digest()
    sealers = [Sealer(k, encrypt=encrypt) for k in (a, b, short)]
    assert len({s.key_id for s in sealers}) == 3
    sealed = sealers[0].seal("page", b"blob")
    assert sealers[0].open("page", sealed) == b"blob"
    for other in sealers[1:]:  # neither the other long key nor a short key of its hash
        with pytest.raises(SealError, match="under 'page' fails its"):
            other.open("page", sealed)


# -- key ids: rotation and fleets with other keys -------------------------------------


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_rotated_cache_reads_old_key_pages_and_writes_them_under_its_key(tmp_path,
                                                                           encrypt):
    disk = store.DiskStore(tmp_path / "pages")
    old = Fleet(disk, auth_key=KEY_A, encrypt=encrypt)
    want = old.write()
    old_keys = [old.cache.store_key(k) for k in KEYS]
    old.close()
    # A cache with the new key only: misses, writes and deletes nothing of the old key's.
    new = Fleet(disk, auth_key=KEY_B, encrypt=encrypt)
    assert new.cache.lookup(KEYS).num_pages == 0
    assert all(disk.contains(k) for k in old_keys)
    new_keys = [new.cache.store_key(k) for k in KEYS]
    assert not any(map(disk.contains, new_keys)) and set(new_keys).isdisjoint(old_keys)
    new.close()
    # The rotated cache: the old pages load verified, and are written under the new key.
    rotated = Fleet(disk, auth_key=Sealer(KEY_B, encrypt=encrypt, previous_keys=[KEY_A]))
    assert rotated.cache.store_key(10) == new_keys[0]
    n, got = rotated.read()
    assert n == 3 and all(np.array_equal(g, w) for g, w in zip(got, want))
    rotated.cache.flush()
    st = rotated.cache.stats()
    assert st["store_rekeyed"] == 3 and st["store_hits"] == 3
    assert st["store_auth_failures"] == st["bad_pages"] == 0
    assert all(map(disk.contains, new_keys + old_keys))  # the old blobs stay
    rotated.close()
    # Now a cache with the new key alone finds them, with nothing to rewrite.
    new = Fleet(disk, auth_key=KEY_B, encrypt=encrypt)
    n, got = new.read()
    assert n == 3 and new.cache.stats()["store_rekeyed"] == 0
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    new.close(), disk.close()


def test_two_fleets_with_other_keys_never_delete_each_others_pages(tmp_path):
    disk = store.DiskStore(tmp_path / "pages")
    a, b = Fleet(disk, auth_key=KEY_A), Fleet(disk, auth_key=KEY_B)
    want_a, want_b = a.write(seed=1), b.write(seed=2)  # put-if-absent: both written
    stored = [f.cache.store_key(k) for f in (a, b) for k in KEYS]
    assert len(set(stored)) == 6 and all(map(disk.contains, stored))
    for fleet, want in ((a, want_a), (b, want_b)):
        fleet.mgr.free([fleet.cache.page_of(k) for k in KEYS])
        n, got = fleet.read()
        assert n == 3 and all(np.array_equal(g, w) for g, w in zip(got, want))
        assert fleet.cache.stats()["store_auth_failures"] == 0
    assert all(map(disk.contains, stored))
    a.close(), b.close(), disk.close()


def test_a_rotated_tier_counts_old_key_pages_as_held(tmp_path):
    # What a multi-process lookup measures before the ranks agree (``has_many``).
    disk = store.DiskStore(tmp_path / "pages")
    old = Fleet(disk, auth_key=KEY_A)
    old.write()
    old.close()
    mgr = kvxfer.KVCacheManager(_caches(), num_host_blocks=4)
    stats, lock = Counters(), threading.RLock()
    tiers = [StoreTier(mgr, disk, lock, stats, namespace="test-model", write_through="never",
                       sealer=sealer, events=EventHub(stats))
             for sealer in (Sealer(KEY_B), Sealer(KEY_B, previous_keys=[KEY_A]))]
    for tier, held in zip(tiers, ([False] * 3, [True] * 3)):
        with lock:
            batch = tier.has_many(KEYS + [13])
            assert [tier.holds(k, batch) for k in KEYS + [13]] == held + [False]
        tier.close([], 0, None)
    mgr.close(), disk.close()


# -- write errors of any kind are counted, never raised -------------------------------


class ClientError(Exception):
    """What a third-party store client raises (not a StoreError, not an OSError)."""


class Unwritable(Store):
    """A store whose client fails every write with its own exception type."""

    name = "unwritable"

    def __init__(self, inner):
        self.inner = inner

    def put(self, key, blob, *, replace=False):
        raise ClientError("503 SlowDown")

    def delete(self, key):
        raise ClientError("503 SlowDown")

    def get(self, key):
        return self.inner.get(key)

    def contains(self, key):
        return self.inner.contains(key)

    def stats(self):
        return self.inner.stats()


def test_a_store_client_error_on_write_is_a_counted_write_error(tmp_path, caplog):
    disk = store.DiskStore(tmp_path / "pages")
    fleet = Fleet(disk, blocks=2)
    fleet.cache.close()
    fleet.cache = kvxfer.HostCache(fleet.mgr, Unwritable(disk), namespace="test-model")
    fleet.cache.put(_caches(), [0, 1], [10, 11], wait=True)
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        assert fleet.cache.flush() == 0
    assert fleet.cache.stats()["store_write_errors"] == 2
    assert f"page {10:#x} was not written to the unwritable store: ClientError: 503 " \
           "SlowDown" in caplog.text
    # A bad blob is dropped from the store: the delete's error does not escape either.
    disk.put(fleet.cache.store_key(12), b"not a page")
    assert fleet.cache.lookup([12]).num_pages == 0
    assert fleet.cache.stats()["bad_pages"] == 1
    fleet.close(), disk.close()


# -- close names the pages its dropped writes lose ------------------------------------


class Stalled(Store):
    """A store whose writes wait until ``release`` is set."""

    name = "stalled"

    def __init__(self, inner):
        self.inner, self.release = inner, threading.Event()

    def put(self, key, blob, *, replace=False):
        self.release.wait(60)
        return self.inner.put(key, blob, replace=replace)

    def get(self, key):
        return self.inner.get(key)

    def contains(self, key):
        return self.inner.contains(key)

    def delete(self, key):
        return self.inner.delete(key)

    def stats(self):
        return self.inner.stats()


def test_close_names_the_evicted_pages_its_dropped_writes_lose(tmp_path, caplog):
    disk = store.DiskStore(tmp_path / "pages")
    stalled = Stalled(disk)
    mgr = kvxfer.KVCacheManager(_caches(), num_host_blocks=2)
    cache = kvxfer.HostCache(mgr, stalled, write_through="always", namespace="test-model")
    cache.put(_caches(), [0, 1], [1, 2], wait=True)
    cache.lookup([])  # indexes them: their writes are queued (and stalled)
    cache.put(_caches(), [2], [3], wait=True)  # evicts page 2 (the tail), write queued
    assert 2 not in cache
    try:
        with caplog.at_level(logging.WARNING, logger="kvxfer"):
            cache.close(0.2)
    finally:
        stalled.release.set()
    assert "3 store writes did not finish within 0.2 s of close(); dropped: lost from " \
           "every tier (freed from host memory when evicted; recomputed when asked for " \
           "again): page 0x2; kept in host memory until the manager frees them: pages " \
           "0x1, 0x3" in caplog.text
    assert "stay in host memory" not in caplog.text
    mgr.close(), disk.close()


# -- the store is capped at one page's frame ----------------------------------------------


@pytest.mark.parametrize("seal", [{}, {"auth_key": KEY_A},
                                  {"auth_key": KEY_A, "encrypt": True}])
def test_the_store_is_capped_at_exactly_one_pages_frame(tmp_path, seal):
    disk = store.DiskStore(tmp_path / "pages")
    fleet = Fleet(disk, **seal)
    fleet.write()
    frame = len(disk.get(fleet.cache.store_key(10)))
    assert disk.max_blob_bytes == frame
    page = fleet.cache.page_of(10)
    assert len(fleet.mgr.export_page(page)) == blob_bytes(fleet.mgr.plan) <= frame
    fleet.close(), disk.close()


def test_a_sparse_2gib_file_under_a_page_key_is_a_miss_never_read(tmp_path):
    disk = store.DiskStore(tmp_path / "pages")
    fleet = Fleet(disk, auth_key=KEY_A)
    assert disk.max_blob_bytes is not None and disk.max_blob_bytes < 1 << 20  # first
    sparse_frame(tmp_path / "pages", fleet.cache.store_key(10), 2 << 30)
    assert fleet.cache.lookup([10]).num_pages == 0
    assert disk.stats()["oversized"] == 1 and fleet.cache.stats()["bad_pages"] == 0
    fleet.close(), disk.close()


def test_caches_of_two_page_sizes_share_a_store_and_its_own_limit_holds(tmp_path):
    disk = store.DiskStore(tmp_path / "pages")
    small = Fleet(disk, dtype="bfloat16", namespace="small:")
    large = Fleet(disk, namespace="large:")
    assert disk.max_blob_bytes == blob_bytes(large.mgr.plan) > blob_bytes(small.mgr.plan)
    large.write()
    large.mgr.free([large.cache.page_of(k) for k in KEYS])
    assert large.read()[0] == 3
    small.close(), large.close(), disk.close()
    with store.DiskStore(tmp_path / "other", max_blob_bytes=100) as limited:
        fleet = Fleet(limited)
        assert limited.max_blob_bytes == 100
        fleet.close()
