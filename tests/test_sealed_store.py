"""Store tiers a writer without the key cannot forge: authenticated and encrypted blobs."""

import logging

import numpy as np
import pytest

import kvxfer
from kvxfer import store, testing
from kvxfer.store._seal import Sealer, SealError

KEY = bytes(range(32))


def _rig(tmp_path, **options):
    caches = testing.random_caches(2, 8, (4, 32), "float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    disk = store.DiskStore(tmp_path / "pages")
    return caches, mgr, disk, kvxfer.HostCache(mgr, disk,
                                               **{"namespace": "test-model", **options})


def _forge(key):
    """What a store writer without the key can make: a well-formed page of the same
    geometry under the victim's key, with other bytes and their own valid digests."""
    other = testing.random_caches(2, 8, (4, 32), "float32", seed=99)
    with kvxfer.KVCacheManager(other, num_host_blocks=1) as forger:
        page, = forger.offload(other, [0], keys=[key]).wait()
        return forger.export_page(page), [testing.bits(c)[0] for c in other]


def _spilled(caches, mgr, cache):
    """Page 10 offloaded and written to the store, then gone from host memory."""
    cache.put(caches, [1], [10], wait=True)
    cache.flush()
    cache.put(caches, [2, 3], [11, 12], wait=True)  # two slots: 10 is evicted
    assert cache.find(10) == "store"


def test_without_a_key_a_forged_page_loads_as_verified(tmp_path):
    # The gap the README states: device digests are not a MAC.
    caches, mgr, disk, cache = _rig(tmp_path)
    _spilled(caches, mgr, cache)
    forged, theirs = _forge(10)
    disk.put(cache.store_key(10), forged, replace=True)
    hit = cache.lookup([10])
    caches, load = cache.load(caches, hit, [6])
    assert load.result().verified_prefix == 1
    assert all(np.array_equal(testing.bits(c)[6], t) for c, t in zip(caches, theirs))
    cache.close(), mgr.close(), disk.close()


@pytest.mark.parametrize("encrypt", [False, True])
def test_with_a_key_a_forged_page_is_refused_and_removed(tmp_path, encrypt, caplog):
    caches, mgr, disk, cache = _rig(tmp_path, auth_key=KEY, encrypt=encrypt)
    want = [testing.bits(c)[1] for c in caches]
    _spilled(caches, mgr, cache)
    skey = cache.store_key(10)
    assert skey.endswith(":000000000000000a") and ("-encrypt" if encrypt else "-auth") in skey
    # A sealed page comes back verified and exact.
    hit = cache.lookup([10])
    assert hit.tiers == ("store",)
    caches, load = cache.load(caches, hit, [6])
    assert load.result().verified_prefix == 1
    assert all(np.array_equal(testing.bits(c)[6], w) for c, w in zip(caches, want))
    sealed = disk.get(skey)
    if encrypt:  # the page bytes are not in the store in the clear
        assert testing.bits(caches[0])[6].tobytes()[:64] not in sealed
    mgr.free([cache.page_of(10)])
    # Forgeries: a well-formed unsealed page, one sealed with another key, one bit.
    flipped = bytearray(sealed)
    flipped[len(flipped) // 2] ^= 1
    forgeries = [_forge(10)[0], Sealer(b"another key, 16+", encrypt=encrypt).seal(
        skey, _forge(10)[0]), bytes(flipped)]
    for n, forged in enumerate(forgeries, 1):
        disk.put(skey, forged, replace=True)
        with caplog.at_level(logging.WARNING, logger="kvxfer"):
            hit = cache.lookup([10])
        assert hit.num_pages == 0  # a miss: recomputed, never loaded
        assert not disk.contains(skey)  # and removed from the store
        assert cache.stats()["store_auth_failures"] == n
        assert "a writer without the key changed it" in caplog.text
    cache.close(), mgr.close(), disk.close()


def test_sealed_and_unsealed_caches_never_share_pages(tmp_path):
    caches, mgr, disk, sealed = _rig(tmp_path, auth_key=KEY)
    plain = kvxfer.HostCache(mgr, disk, namespace="test-model")
    assert sealed.store_key(10) != plain.store_key(10)
    sealed.close(), plain.close(), mgr.close(), disk.close()


def test_bad_keys_and_options_are_named(tmp_path):
    caches, mgr, disk, _ = _rig(tmp_path)
    with pytest.raises(ValueError, match="the store key has 5 bytes; use at least 16"):
        kvxfer.HostCache(mgr, disk, auth_key=b"short", namespace="test-model")
    with pytest.raises(TypeError, match="the store key must be bytes"):
        kvxfer.HostCache(mgr, disk, auth_key="a str key of many chars", namespace="test-model")
    with pytest.raises(ValueError, match="encrypt=True needs auth_key"):
        kvxfer.HostCache(mgr, disk, encrypt=True, namespace="test-model")
    with pytest.raises(ValueError, match="auth_key seals store blobs; it needs a store"):
        kvxfer.HostCache(mgr, auth_key=KEY)
    with pytest.raises(ValueError, match="is not valid UTF-8 text"):
        kvxfer.HostCache(mgr, disk, namespace="bad\udc80")
    sealer = Sealer(KEY)
    assert "00" not in repr(sealer) and repr(sealer) == f"Sealer(auth, key id {sealer.key_id})"
    assert sealer.key_id not in (KEY.hex(), KEY[:8].hex()) and len(sealer.key_id) == 16
    with pytest.raises(ValueError, match="previous key 1 has 3 bytes; use at least 16"):
        Sealer(KEY, previous_keys=[KEY, b"old"])
    with pytest.raises(TypeError, match="previous_keys must be a list of keys"):
        Sealer(KEY, previous_keys=KEY)
    with pytest.raises(ValueError, match="encrypt=True, but auth_key=Sealer.auth"):
        kvxfer.HostCache(mgr, disk, auth_key=sealer, encrypt=True, namespace="test-model")
    with pytest.raises(SealError, match="is not sealed for auth"):
        Sealer(KEY).open("k", Sealer(KEY, encrypt=True).seal("k", b"blob"))
    mgr.close(), disk.close()
