"""What an adversary or a long uptime found: each case fails without its fix."""

import gc
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest

import kvxfer
from kvxfer import testing
from kvxfer.hostpool import MAX_GENERATION, PoolError, PoolExhaustedError


@pytest.fixture
def small():
    caches = testing.random_caches(2, 8, (4, 32), "float32")
    with kvxfer.KVCacheManager(caches, num_host_blocks=2) as mgr:
        yield mgr, caches


def test_a_slot_retires_before_its_generation_wraps(small):
    # Digests and blobs carry 32 bits of generation: at 10 k offloads a second a
    # one-page loop reaches 2**32 on slot 0 in five days.
    mgr, caches = small
    pool = mgr.host_pool
    pool._slots[0].generation = MAX_GENERATION - 1  # a slot after 2**32 - 2 reuses
    page, = mgr.offload(caches, [1], keys=[5]).wait()
    assert (page.slot, page.generation) == (0, MAX_GENERATION)
    caches, load = mgr.load(caches, [page], [6])
    assert load.result().verified_prefix == 1  # its last generation still verifies
    blob = mgr.export_page(page)
    mgr.free([page])
    assert pool.num_retired == 1 and mgr.num_free_pages == 1
    again, = mgr.offload(caches, [1], keys=[5]).wait()
    assert again.slot == 1
    with pytest.raises(PoolError, match="host slot 0 has used every generation"):
        mgr.offload(caches, [2], keys=[6], slots=[0])
    with pytest.raises(PoolExhaustedError, match=r"0 of 2 slots free \(1 retired\)"):
        mgr.offload(caches, [2], keys=[6])
    assert mgr.num_free_pages == 0 and mgr.is_valid(again)  # nothing leaked or lost
    mgr.free([again])
    imported = mgr.import_page(blob)  # its digests stay bound to the old generation
    caches, load = mgr.load(caches, [imported], [7])
    assert load.result().verified_prefix == 1


def test_transfers_that_fail_in_the_call_are_counted(small):
    mgr, caches = small
    pages = mgr.offload(caches, [1], keys=[5]).wait()

    def broken(event, layer, array):
        if event in ("start_load", "gather_enqueued"):
            raise OSError("device lost")

    mgr.set_transfer_hook(broken)
    with pytest.raises(kvxfer.TransferError, match="device lost"):
        mgr.load(caches, pages, [6])
    with pytest.raises(kvxfer.TransferError, match="device lost"):
        mgr.offload(caches, [2], keys=[6])
    assert mgr.stats()["transfer_errors"] == 2
    assert mgr.num_free_pages == 1  # the failed offload gave its slot back


def test_a_hit_belongs_to_its_cache(small):
    mgr, caches = small
    a, b = kvxfer.HostCache(mgr), kvxfer.HostCache(mgr)
    a.put(caches, [1, 2], [10, 11], wait=True)
    hit = a.lookup([10, 11])
    for call in (lambda: b.release(hit), lambda: b.load(caches, hit, [4, 5])):
        with pytest.raises(ValueError, match="another HostCache's lookup"):
            call()
    a.release(hit)
    assert a.make_room(2) == 2  # nothing stayed pinned: both pages could go
    a.close()
    b.close()


def test_keys_that_are_not_a_sequence_are_named(small):
    mgr, _ = small
    cache = kvxfer.HostCache(mgr)
    for bad in (5, b"key", "key"):
        with pytest.raises(TypeError, match=r"keys must be a sequence of keys \(ints or "
                                            r"bytes\)\. Got .* of type"):
            cache.lookup(bad)
    cache.close()


def _paused_rig(url, prefix, **options):
    import redis

    from kvxfer.store import RedisStore
    caches = testing.random_caches(2, 8, (4, 32), "float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
    store = RedisStore(url, prefix=prefix, timeout_s=20)
    cache = kvxfer.HostCache(mgr, store, **{"namespace": "test-model", **options})
    return caches, mgr, store, cache, redis.Redis.from_url(url)


def test_a_stalled_store_read_stalls_nothing_else(redis_server):
    # CLIENT PAUSE on a real server: one lookup waits for a page in the store while
    # a lookup of a host page and a scrape of stats() answer at once.
    import threading
    import time
    caches, mgr, store, cache, admin = _paused_rig(redis_server, "pause-read:")
    try:
        cache.put(caches, [0, 1], [10, 11], wait=True)
        cache.flush()
        cache.put(caches, [2, 3], [12, 13], wait=True)  # 10 and 11: store only
        cache.flush()
        assert cache.find(10) == "store" and cache.find(12) == "host"
        cache.stats()
        admin.execute_command("CLIENT", "PAUSE", 2000, "ALL")
        stalled = []
        reader = threading.Thread(target=lambda: stalled.append(cache.lookup([10])))
        reader.start()
        time.sleep(0.3)  # the reader is inside the store's GET
        assert reader.is_alive()
        t0 = time.monotonic()
        hit = cache.lookup([12])
        looked = time.monotonic() - t0
        t0 = time.monotonic()
        stats = cache.stats()
        scraped = time.monotonic() - t0
        assert hit.num_pages == 1 and looked < 0.05, looked
        assert scraped < 0.05 and stats["store"]["stale"], scraped
        cache.release(hit)
        reader.join(10)
        assert stalled[0].num_pages == 1 and stalled[0].tiers == ("store",)
        cache.release(stalled[0])
    finally:
        cache.close()
        store.clear()
        store.close()
        mgr.close()


def test_close_has_one_deadline_for_every_queued_write(redis_server):
    import time
    caches, mgr, store, cache, admin = _paused_rig(redis_server, "pause-close:",
                                                   write_through=True)
    try:
        admin.execute_command("CLIENT", "PAUSE", 2000, "WRITE")
        cache.put(caches, [0, 1], [10, 11], wait=True)  # two writes queue behind the pause
        t0 = time.monotonic()
        cache.close(timeout=0.5)
        assert time.monotonic() - t0 < 1.5
    finally:
        store.clear()  # a write: it waits for the pause to end
        store.close()
        mgr.close()


def test_bool_block_ids_are_refused_on_load_as_on_offload(small):
    mgr, caches = small
    pages = mgr.offload(caches, [1, 2], keys=[5, 6]).wait()
    for call in (lambda: mgr.load(caches, pages, [True, 2]),
                 lambda: mgr.offload(caches, [True], keys=[8])):
        with pytest.raises(ValueError, match=r"device_blocks\[0\] = True is a bool"):
            call()


def test_kv_tuples_as_caches_are_named_briefly():
    import jax.numpy as jnp
    k = v = jnp.zeros((64, 4, 128))
    with pytest.raises(TypeError) as e:
        kvxfer.KVCacheManager([(k, v)], num_host_blocks=2)
    message = str(e.value)
    assert "a tuple of 2 (ArrayImpl float32[64, 4, 128]" in message
    assert "pass K and V as two layers" in message and len(message) < 300


def test_find_and_flush_degrade_while_the_store_is_down(redis_server):
    import redis

    from kvxfer.store import RedisStore
    caches = testing.random_caches(2, 8, (4, 32), "float32")
    with kvxfer.KVCacheManager(caches, num_host_blocks=2) as mgr:
        store = RedisStore(redis_server, prefix="down:", timeout_s=0.3)
        cache = kvxfer.HostCache(mgr, store, namespace="test-model")
        cache.put(caches, [1], [10], wait=True)
        with redis.Redis.from_url(redis_server) as admin:
            admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")
            assert cache.find(11) is None  # the store does not answer: not found
            assert cache.find(10) == "host"
            assert cache.flush() == 0  # a write error, counted, not raised
        assert cache.stats()["store_write_errors"] + cache.stats()["store_read_errors"] >= 1
        cache.close()
        store.close()
        with RedisStore(redis_server, prefix="down:") as patient:
            patient.clear()  # waits for the pause to end


@pytest.fixture
def pages_route(monkeypatch):
    """A manager on the pinned mover's pages route (each page an array of its own)."""
    caches = testing.random_caches(2, 8, (4, 32), "float32")
    with kvxfer.KVCacheManager(caches, num_host_blocks=2, path="pinned",
                               pinned_route="pages") as mgr:
        assert all(p.pages is not None for p in mgr.host_pool.pools)
        yield mgr, caches


def test_a_pages_route_view_keeps_its_array_alive(pages_route):
    # A view made from unsafe_buffer_pointer() alone keeps nothing alive: once the
    # slot took new arrays, writing through an older view wrote freed memory.
    mgr, caches = pages_route
    page, = mgr.offload(caches, [1], keys=[5]).wait()
    pool = mgr.host_pool.pools[0]
    view = pool.shard_view(page.slot, 0, 0)
    old = weakref.ref(pool.pages.get(page.slot)[0])
    mgr.free([page])
    mgr.offload(caches, [2], keys=[6], slots=[page.slot]).wait()
    gc.collect()
    assert old() is not None  # the view still holds the bytes it points at
    del view
    gc.collect()
    assert old() is None  # and nothing else does


@pytest.mark.parametrize("call", ["read", "write"])
def test_a_block_read_or_write_holds_its_page(pages_route, call):
    # A free and an offload into the page's slot, on another thread in the middle of
    # the call: the free waits for it and the offload is refused, so the call never
    # touches a slot that holds another page (or none).
    mgr, caches = pages_route
    page, = mgr.offload(caches, [1], keys=[5]).wait()
    data = mgr.read_block_bytes(page, 1)
    pool = mgr.host_pool.pools[0]
    seen = []

    def meanwhile():
        mgr.free([page])
        try:
            mgr.offload(caches, [2], keys=[6], slots=[page.slot]).wait()
            seen.append("overwritten")
        except kvxfer.PoolError as e:
            seen.append(str(e))

    real = pool.pages.shard_view

    def racing(*args):
        if not seen:
            t = threading.Thread(target=meanwhile)
            t.start()
            t.join()
        return real(*args)

    pool.pages.shard_view = racing
    if call == "read":
        assert mgr.read_block_bytes(page, 1) == data
    else:
        mgr.write_block_bytes(page, 1, bytes(len(data)))
    pool.pages.shard_view = real
    assert "host slot" in seen[0] and "cannot be overwritten" in seen[0]
    assert not mgr.is_valid(page) and mgr.num_free_pages == 2  # freed once it ended
    with pytest.raises(kvxfer.PoolError, match="is not a valid page"):
        mgr.read_block_bytes(page, 1)


def test_block_reads_and_writes_race_free_and_offload_without_a_crash():
    # The reported crash: write_block_bytes and read_block_bytes on one thread, free
    # plus offload(slots=[that slot]) on another, on the pages route. In a process of
    # its own, so a crash fails this test instead of the run.
    script = textwrap.dedent("""
        import threading
        import kvxfer
        from kvxfer import testing
        caches = testing.random_caches(2, 8, (4, 32), "float32")
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2, path="pinned",
                                    pinned_route="pages")
        for _ in range(150):
            page, = mgr.offload(caches, [1], keys=[5]).wait()
            data = mgr.read_block_bytes(page, 0)
            def hammer():
                for _ in range(20):
                    try:
                        mgr.write_block_bytes(page, 0, data)
                        assert len(mgr.read_block_bytes(page, 1)) == len(data)
                    except kvxfer.PoolError:
                        pass
            t = threading.Thread(target=hammer)
            t.start()
            mgr.free([page])
            try:
                mgr.free(mgr.offload(caches, [2], keys=[6], slots=[page.slot]).wait())
            except kvxfer.PoolError:
                pass
            t.join()
        assert mgr.num_free_pages == 2
        mgr.close()
        print("held")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "held" in done.stdout, done.stderr[-2000:]
