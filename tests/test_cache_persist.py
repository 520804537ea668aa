"""What a HostCache's store keeps, and who releases and frees what.

``close()`` writes back the host pages its store lacks (as ``flush()`` would), bounded
by its deadline, unless told not to: a cache opened later over the same store, in this
process or in another one, finds them. The lifecycle of pins, hits, loads and frees
stated in docs/host-tier.md is checked here as the code has it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading

import jax.numpy as jnp
import numpy as np
import pytest

import kvxfer
from kvxfer import store, testing

bits = testing.bits
NAMESPACE = "persist-model@r1:f32:tok1"
KEYS = [701, 702, 703]
SRC = [2, 5, 7]
DST = [0, 1, 3]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kvxfer.__file__)))


def _caches():
    return testing.random_caches(2, 16, (4, 128), "float32", seed=9)


def _digests(arrays, blocks):
    """sha256 of each layer's ``blocks``, in order: what a second process reports."""
    return [hashlib.sha256(np.ascontiguousarray(a[blocks]).tobytes()).hexdigest()
            for a in arrays]


def _filled(tmp_path, **options):
    """A cache over a DiskStore in ``tmp_path`` with ``KEYS`` put and on host, nothing
    flushed; the cache, its manager, the store, the caches' bits."""
    caches = _caches()
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    disk = store.DiskStore(tmp_path / "pages")
    cache = kvxfer.HostCache(mgr, disk, namespace=NAMESPACE, **options)
    assert cache.put(caches, SRC, KEYS, wait=True) == KEYS
    assert disk.keys() == []  # write-back (the default): nothing written yet
    return cache, mgr, disk, [bits(c) for c in caches]


_SECOND_PROCESS = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    import jax.numpy as jnp
    import kvxfer
    from kvxfer import store, testing
    path, namespace, keys, dst = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), \\
        json.loads(sys.argv[4])
    like = testing.random_caches(2, 16, (4, 128), "float32", seed=9)
    caches = [jnp.zeros_like(c) for c in like]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    disk = store.DiskStore(path)
    cache = kvxfer.HostCache(mgr, disk, namespace=namespace)
    hit = cache.lookup(keys)
    caches, load = cache.load(caches, hit, dst)
    verified = load.result().verified_prefix
    sums = [hashlib.sha256(np.ascontiguousarray(testing.bits(c)[dst]).tobytes()).hexdigest()
            for c in caches]
    cache.close(); mgr.close(); disk.close()
    print(json.dumps({"tiers": list(hit.tiers), "verified": verified, "sums": sums}))
""")


def test_close_without_flush_keeps_the_pages_for_a_restart_here_and_in_another_process(
        tmp_path):
    cache, mgr, disk, want = _filled(tmp_path)
    cache.close()  # no flush()
    st = cache.stats()
    assert st["store_pages_written"] == 3 and st["store_writes_dropped"] == 0, st
    mgr.close()
    disk.close()

    # Another process, as after a restart: a real interpreter over the same directory.
    done = subprocess.run(
        [sys.executable, "-c", _SECOND_PROCESS, str(tmp_path / "pages"), NAMESPACE,
         json.dumps(KEYS), json.dumps(DST)],
        env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"), capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"tiers": ["store"] * 3, "verified": 3, "sums": _digests(want, SRC)}

    # This process: new manager, new store object, new cache over the same directory.
    caches = [jnp.zeros_like(c) for c in _caches()]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    disk = store.DiskStore(tmp_path / "pages")
    assert len(disk.keys()) == 3
    cache = kvxfer.HostCache(mgr, disk, namespace=NAMESPACE)
    hit = cache.lookup(KEYS)
    assert hit.tiers == ("store",) * 3
    caches, load = cache.load(caches, hit, DST)
    assert load.result().verified_prefix == 3
    for layer in range(2):
        assert np.array_equal(bits(caches[layer])[DST], want[layer][SRC])
    cache.close()
    assert cache.stats()["store_pages_written"] == 0  # the store held every page
    mgr.close()
    disk.close()


@pytest.mark.parametrize("how", ["constructor", "close"])
def test_write_back_can_be_turned_off(tmp_path, how):
    options = {"write_back_on_close": False} if how == "constructor" else {}
    cache, mgr, disk, _ = _filled(tmp_path, **options)
    if how == "close":
        cache.close(write_back=False)
    else:
        cache.close()
    assert disk.keys() == [] and cache.stats()["store_pages_written"] == 0
    mgr.close()
    disk.close()


def test_write_back_arguments_are_checked(tmp_path):
    caches = _caches()
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    disk = store.DiskStore(tmp_path / "pages")
    with pytest.raises(TypeError, match="write_back_on_close must be a bool. Got 'yes' "
                                        "of type str"):
        kvxfer.HostCache(mgr, disk, namespace=NAMESPACE, write_back_on_close="yes")
    cache = kvxfer.HostCache(mgr, disk, namespace=NAMESPACE)
    with pytest.raises(TypeError, match="write_back must be a bool or None. Got 1 of "
                                        "type int"):
        cache.close(write_back=1)
    cache.put(caches, SRC, KEYS, wait=True)
    cache.close()  # the refused call closed nothing: this one writes back
    assert len(disk.keys()) == 3
    mgr.close()
    disk.close()


def test_selective_write_through_writes_back_only_pages_found_often_enough(tmp_path):
    cache, mgr, disk, _ = _filled(tmp_path, write_through=2)
    for _ in range(2):
        cache.release(cache.lookup(KEYS[:1]))
    cache.close()
    assert disk.keys() == [cache.store_key(KEYS[0])]
    mgr.close()
    disk.close()


class _Stalled(testing.CountingStore):
    """A real store whose call ``stalls`` (``"put"``: a stalled disk; ``"contains_many"``:
    a store that does not say which keys it holds) hangs until ``go`` is set."""

    def __init__(self, inner, stalls):
        super().__init__(inner)
        self.stalls = stalls
        self.go = threading.Event()

    def put(self, key, blob, *, replace=False):
        if self.stalls == "put":
            self.go.wait(60)
        return super().put(key, blob, replace=replace)

    def contains_many(self, keys):
        if self.stalls == "contains_many":
            self.go.wait(60)
        return super().contains_many(keys)


@pytest.mark.parametrize("stalls, logged", [
    ("put", "3 store writes did not finish within 0.5 s of close()"),
    ("contains_many", "close() wrote none of 3 host pages back to the disk store: "
                      "TimeoutError: close() gave up after 0.5 s")])
def test_close_gives_write_back_its_deadline_and_counts_what_it_dropped(tmp_path, caplog,
                                                                        stalls, logged):
    """A stalled disk's writes, or a store that cannot say what it holds (then no
    write starts), cost close() its timeout and no more: what was not written is
    counted and logged."""
    caches = _caches()
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    stalled = _Stalled(store.DiskStore(tmp_path / "pages"), stalls)
    cache = kvxfer.HostCache(mgr, stalled, namespace=NAMESPACE)
    cache.put(caches, SRC, KEYS, wait=True)
    try:
        with caplog.at_level(logging.WARNING, logger="kvxfer"):
            cache.close(timeout=0.5)
        assert cache.stats()["store_writes_dropped"] == 3
        assert logged in caplog.text
        if stalls == "put":
            assert "0x2bd" in caplog.text  # the pages are named (701)
    finally:
        stalled.go.set()
    if stalls == "contains_many":
        assert stalled.calls.get("put", 0) == 0
    mgr.close()
    stalled.close()


# -- pins, hits, loads and frees (the table in docs/host-tier.md) ---------------------


def _cached():
    """Caches, a manager of 4 host blocks, and a storeless cache holding pages KEYS."""
    caches = _caches()
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    cache = kvxfer.HostCache(mgr)
    cache.put(caches, SRC, KEYS, wait=True)
    return caches, mgr, cache


def test_a_load_releases_its_lookups_pins_and_release_after_it_is_a_no_op():
    caches, mgr, cache = _cached()
    hit = cache.lookup(KEYS)
    assert cache.stats()["pinned_pages"] == 3
    caches, load = cache.load(caches, hit, DST)
    assert load.result().verified_prefix == 3
    assert cache.stats()["pinned_pages"] == 0
    cache.release(hit)  # settled already: nothing happens
    assert cache.stats()["pinned_pages"] == 0
    # The pages stay cached: no mgr.free after a load; the cache frees on eviction.
    assert cache.lookup(KEYS[:1]).tiers == ("host",)
    assert mgr.num_free_pages == 1
    cache.close()
    mgr.close()


def test_a_load_that_raises_leaves_the_hit_pinned_until_released():
    caches, mgr, cache = _cached()
    hit = cache.lookup(KEYS[:2])
    with pytest.raises(ValueError, match="3 device_blocks for 2 pages"):
        cache.load(caches, hit, DST)
    assert cache.stats()["pinned_pages"] == 2
    cache.release(hit)
    assert cache.stats()["pinned_pages"] == 0
    cache.close()
    mgr.close()


def test_a_used_manager_keeps_the_pages_its_caller_holds():
    caches = _caches()
    before = [bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    mine = mgr.offload(caches, [0, 1], keys=[1, 2]).wait()
    cache = kvxfer.HostCache(mgr)  # a pool with 2 of its 4 slots taken
    assert cache.put(caches, [2, 3, 4, 5], [11, 12, 13, 14], wait=True) == [11, 12]
    assert cache.stats()["dropped"] == 2  # the cache never evicts the caller's pages
    cache.close()
    assert all(mgr.is_valid(p) for p in mine)
    caches, load = mgr.load(caches, mine, [8, 9])
    assert load.result().verified_prefix == 2
    assert np.array_equal(bits(caches[0])[[8, 9]], before[0][[0, 1]])
    assert mgr.num_free_pages == 0  # a closed cache's pages stay in the pool
    mgr.free(mine)  # a manager's own loads free nothing: the caller frees its pages
    assert mgr.num_free_pages == 2
    mgr.close()


def test_freeing_a_caches_page_behind_its_back_makes_it_a_miss():
    caches, mgr, cache = _cached()
    hit = cache.lookup(KEYS)
    caches, load = cache.load(caches, hit, DST)
    load.result()
    mgr.free([hit.pages[1]])
    assert cache.lookup(KEYS).num_pages == 1  # the prefix ends where the page went
    cache.close()
    mgr.close()
