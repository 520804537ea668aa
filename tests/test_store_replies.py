"""Redis stores whose servers misbehave: junk replies, replies of the wrong kind or
shape, slow replies, a read cut short by ``KeyboardInterrupt``. A real redis-server and
a real three-node Redis Cluster on loopback, each node behind a ``redis_rig.Proxy``
that answers chosen bytes or holds the server's replies back.

What must hold: a store denies service only by misses, ``StoreError`` and counters
(never a redis-py exception), and a connection whose replies were not all read is
never used again, so no call ever gets another call's (or key's) reply.
"""

from __future__ import annotations

import signal
import uuid

import jax.numpy as jnp
import pytest

import kvxfer
import redis_rig
from kvxfer import testing
from kvxfer.store import RedisClusterStore, RedisStore, StoreBatchError, StoreError
from test_store_batch import _DictStore  # a plain third-party store: single-key calls


def _prefix() -> str:
    return f"test-{uuid.uuid4().hex[:8]}:"


@pytest.fixture(scope="module")
def proxied_cluster():
    """A three-node cluster whose nodes clients reach through proxies (module-wide)."""
    redis_rig.require("redis-cli")
    with redis_rig.redis_cluster(proxied=True) as cluster:
        yield cluster


@pytest.fixture
def cluster(proxied_cluster):
    yield proxied_cluster
    for proxy in proxied_cluster.proxies.values():
        proxy.passing()


@pytest.fixture(scope="module")
def proxy(redis_server):
    """A proxy in front of the session's redis-server."""
    port = int(redis_server.rpartition(":")[2].partition("/")[0])
    p = redis_rig.Proxy(port)
    yield p
    p.close()


@pytest.fixture
def store(proxy):
    s = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", prefix=_prefix(), timeout_s=5)
    yield s
    proxy.passing()
    s.clear()
    s.close()


def _pages(s: RedisClusterStore, n: int) -> tuple[list[str], dict[str, bytes],
                                                  dict[str, list[str]]]:
    """``n`` keys with their blobs, put; and the keys by the node that holds them."""
    keys = [f"page-{i}" for i in range(n)]
    blobs = {k: f"the blob of {k};".encode() * 4 for k in keys}
    assert s.put_many(blobs.items()) == [True] * n
    nodes = s.domain_nodes()
    by_node: dict[str, list[str]] = {}
    for k in keys:
        by_node.setdefault(nodes[s.domain_of(k)], []).append(k)
    assert len(by_node) == 3
    return keys, blobs, by_node


# -- the cluster: one node answers junk, another is slow ------------------------------


def test_a_junk_node_beside_a_slow_one_never_shifts_a_later_calls_replies(cluster):
    with RedisClusterStore(cluster.spec, prefix=_prefix(), timeout_s=10) as s:
        keys, blobs, by_node = _pages(s, 48)
        junk, slow, _ = by_node
        # The junk node's keys first: its reply is read (and fails) before the slow
        # node's, which is the order that left the slow node's replies unread.
        keys = by_node[junk] + [k for k in keys if k not in by_node[junk]]
        bad = {i for i, k in enumerate(keys) if k in by_node[junk]}
        cluster.proxy_of(junk).answering(b"?not RESP at all\r\n")
        cluster.proxy_of(slow).delaying(0.3)
        for _ in range(2):  # the second batch on the same (or new) connections
            with pytest.raises(StoreBatchError, match="broke the protocol") as e:
                s.get_many(keys)
            assert set(e.value.errors) == bad
            assert e.value.results == [None if i in bad else blobs[k]
                                       for i, k in enumerate(keys)]
        with pytest.raises(StoreBatchError) as e:  # writes: the junk node's keys fail
            s.put_many([(k, blobs[k] + b"v2") for k in keys], replace=True)
        assert set(e.value.errors) == bad
        with pytest.raises(StoreError, match=f"cannot delete key {keys[0]!r}: the server's "
                                             "reply broke the protocol"):
            s.delete(keys[0])
        cluster.proxy_of(junk).passing()
        cluster.proxy_of(slow).passing()
        want = [blobs[k] if i in bad else blobs[k] + b"v2" for i, k in enumerate(keys)]
        for k, blob in zip(keys, want):  # every later call gets its own key's reply
            assert s.get(k) == blob
        assert s.get_many(["page-14"]) == [want[keys.index("page-14")]]
        assert s.get_many(keys) == want and s.contains_many(keys) == [True] * len(keys)
        st = s.stats()
        assert st["bad_replies"] == 3 * len(bad) + 1 and st["read_errors"] == 0
        assert s.clear() == len(keys)


def test_a_read_cut_short_by_keyboard_interrupt_leaves_no_reply_behind(cluster):
    with RedisClusterStore(cluster.spec, prefix=_prefix(), timeout_s=10) as s:
        keys, blobs, _ = _pages(s, 48)
        for p in cluster.proxies.values():
            p.delaying(3.0)

        def interrupt(*_):
            raise KeyboardInterrupt

        before = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)  # while the first server's reply waits
        try:
            with pytest.raises(KeyboardInterrupt):
                s.get_many(keys)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
            for p in cluster.proxies.values():
                p.passing()
        # At once, while the cut read's replies are still on their way: a connection
        # that owed them would read them as this call's (the same keys, in another order).
        assert s.get_many(keys[::-1]) == [blobs[k] for k in keys[::-1]]
        assert s.delete(keys[0]) and not s.contains(keys[0])
        assert [s.get(k) for k in keys[1:8]] == [blobs[k] for k in keys[1:8]]
        assert s.stats()["bad_replies"] == 0
        s.clear()


def test_host_cache_over_a_junk_node_sees_misses_and_deletes_nothing(cluster):
    caches = testing.random_caches(2, 8, (4, 32), "bfloat16", seed=0)
    keys = list(range(10, 18))
    with RedisClusterStore(cluster.spec, prefix=_prefix(), timeout_s=10) as s:
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8)
        cache = kvxfer.HostCache(mgr, s, write_through="always", namespace="test-model")
        cache.put(caches, list(range(8)), keys, wait=True)
        cache.flush()
        assert cache.stats()["store_pages_written"] == 8
        cache.close(), mgr.close()
        stored = sorted(s.keys())
        assert len(stored) == 8
        nodes = s.domain_nodes()
        junk = nodes[s.domain_of(stored[0])]
        caches = [jnp.zeros_like(c) for c in caches]
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8)
        cache = kvxfer.HostCache(mgr, s, namespace="test-model")
        # A read of one page (one domain) is MULTI, two commands and EXEC: each is
        # answered, and the EXEC with nested arrays.
        cluster.proxy_of(junk).answering(_READ["nested arrays"])
        for key in keys:  # each page alone: misses for the junk node's, never a raise
            hit = cache.lookup([key])
            assert hit.tiers in ((), ("store",))
        st = cache.stats()
        assert st["store_read_errors"] >= 1 and st["bad_pages"] == 0
        cluster.proxy_of(junk).passing()
        assert sorted(s.keys()) == stored  # no good page was dropped from the store
        cache.close(), mgr.close()
        assert s.stats()["bad_replies"] >= st["store_read_errors"]  # (stats reads too)
        s.clear()


# -- one server: every kind of junk, every call ----------------------------------------

_TX = b"+OK\r\n+QUEUED\r\n+QUEUED\r\n"  # MULTI and two commands queued
_READ = {  # what a one-key read (MULTI, MGET, EVAL, EXEC) is answered
    "protocol junk": b"?junk\r\n",
    "a wrong arity": _TX + b"*3\r\n*1\r\n$1\r\nx\r\n*1\r\n:1\r\n:7\r\n",
    "an integer where a blob belongs": _TX + b"*2\r\n*1\r\n:5\r\n*1\r\n:1\r\n",
    "nested arrays": _TX + b"*2\r\n*1\r\n*1\r\n$1\r\nx\r\n*1\r\n:1\r\n",
    "a blob the script says is not there": _TX + b"*2\r\n*1\r\n$1\r\nx\r\n*1\r\n:0\r\n",
    "junk for MULTI": b":1\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n*1\r\n$1\r\nx\r\n*1\r\n:1\r\n",
    "more replies than commands": _TX + b"*2\r\n*1\r\n$1\r\nx\r\n*1\r\n:1\r\n+OK\r\n",
}
_ONE = {  # what one command (the delete script) is answered
    "protocol junk": b"?junk\r\n",
    "a wrong arity": b":1\r\n:1\r\n",
    "a blob where an integer belongs": b"$1\r\n1\r\n",
    "nested arrays": b"*1\r\n:1\r\n",
    "an integer out of range": b":7\r\n",
}
_CONTAINS = {  # what a one-key ask (EXISTS, STRLEN) is answered
    "protocol junk": b"?junk\r\n",
    "a wrong arity": b":1\r\n:1\r\n:1\r\n",
    "a blob where an integer belongs": b"$1\r\n1\r\n:8\r\n",
    "nested arrays": b"*1\r\n:1\r\n:8\r\n",
    "an integer out of range": b":7\r\n:8\r\n",
}
_WRITE = {  # what a one-key put (MULTI, EVAL, SET NX, EXEC) is answered
    "protocol junk": b"?junk\r\n",
    "a wrong arity": _TX + b"*1\r\n:0\r\n",
    "an integer where OK belongs": _TX + b"*2\r\n:0\r\n:1\r\n",
    "nested arrays": _TX + b"*2\r\n*1\r\n:0\r\n+OK\r\n",
    "a blob where a count belongs": _TX + b"*2\r\n$1\r\n0\r\n+OK\r\n",
}
_CALLS = {
    "get": (_READ, lambda s: s.get("k")), "get_many": (_READ, lambda s: s.get_many(["k"])),
    "contains": (_CONTAINS, lambda s: s.contains("k")),
    "contains_many": (_CONTAINS, lambda s: s.contains_many(["k"])),
    "delete": (_ONE, lambda s: s.delete("k")),
    "put": (_WRITE, lambda s: s.put("k", b"new", replace=True)),
    "put_many": (_WRITE, lambda s: s.put_many([("k", b"new")], replace=True)),
}


@pytest.mark.parametrize("call", list(_CALLS))
def test_junk_replies_are_store_errors_counted_and_the_connection_is_dropped(call, store,
                                                                             proxy):
    answers, run = _CALLS[call]
    for kind, answer in answers.items():
        assert store.put("k", b"the blob", replace=True)
        assert store.get_many(["k"]) == [b"the blob"]  # a pooled connection, in step
        before = store.stats()["bad_replies"]
        proxy.answering(answer)
        try:
            with pytest.raises(StoreError, match="broke the protocol") as e:
                run(store)
        finally:
            proxy.passing()
        assert isinstance(e.value, StoreBatchError) == call.endswith("_many"), kind
        assert store.stats()["bad_replies"] == before + 1, kind
        # The next calls, on the pool's connections, each get their own replies.
        assert store.get("k") == b"the blob", kind
        assert store.contains_many(["k", "absent"]) == [True, False], kind


def test_a_reply_slower_than_the_timeout_is_a_store_error_never_read_later(proxy):
    s = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", prefix=_prefix(), timeout_s=1.0)
    assert s.put_many([("k", b"the blob"), ("j", b"jay")]) == [True, True]
    proxy.delaying(3.0)
    try:
        with pytest.raises(StoreError, match="cannot read key 'k'"):
            s.get("k")
    finally:
        proxy.passing()
    # At once, while the late reply is on its way on the connection that timed out.
    assert s.get("j") == b"jay" and s.get_many(["j", "k"]) == [b"jay", b"the blob"]
    assert s.stats()["bad_replies"] == 0
    s.clear()
    s.close()


# -- the blob cap -----------------------------------------------------------------------


def test_the_cap_is_a_miss_and_never_fetches_the_blob(store, proxy):
    assert store.put_many([("small", b"s" * 100), ("big", b"b" * (4 << 20))]) == [True] * 2
    store.cap_blob_bytes(500)
    store.cap_blob_bytes(1000)  # a second cache of larger pages: the largest holds
    store.cap_blob_bytes(700)
    assert store.blob_cap == 1000
    start = proxy.down_bytes
    assert store.get_many(["small", "big", "absent"]) == [b"s" * 100, None, None]
    assert store.get("big") is None and store.get("small") == b"s" * 100
    assert store.contains_many(["small", "big"]) == [True, False]
    assert proxy.down_bytes - start < 20_000  # never the 4 MiB blob
    st = store.stats()
    assert st["oversized"] == 2 and st["hits"] == 2
    with pytest.raises(ValueError, match="more than the blob cap of 1000 bytes"):
        store.put("more", b"m" * 1001)
    assert store.put("empty", b"") and store.get("empty") == b""


def test_the_cap_on_the_cluster_store(cluster):
    with RedisClusterStore(cluster.spec, prefix=_prefix()) as s:
        keys, blobs, _ = _pages(s, 24)
        assert s.put("big", b"b" * 5000)
        s.cap_blob_bytes(max(map(len, blobs.values())))
        assert s.get_many([*keys, "big"]) == [blobs[k] for k in keys] + [None]
        assert not s.contains("big") and s.stats()["oversized"] == 1
        s.clear()


@pytest.mark.parametrize("redirect", ["MOVED", "ASK"])
def test_the_cap_holds_when_a_slot_redirects_a_batch(cluster, redirect):
    """A node that answers a batch with MOVED (a slot that moved) or ASK (one moving)
    sends that domain's keys one by one through the client: with the same capped read
    and the same checks, never a plain GET of the whole blob."""
    from redis.crc import key_slot

    with RedisClusterStore(cluster.spec, prefix=_prefix(), timeout_s=10) as s:
        d = s.domain_of("big")
        small = next(k for k in (f"small-{i}" for i in range(1000)) if s.domain_of(k) == d)
        assert s.put_many([("big", b"b" * (4 << 20)), (small, b"s" * 100)]) == [True] * 2
        s.cap_blob_bytes(1000)
        node = s.domain_nodes()[d]
        proxy = cluster.proxy_of(node)
        refused = f"-{redirect} {key_slot(s.domain_root(d).encode())} {node}\r\n".encode()

        def redirect_once(trigger: bytes, commands: int, atomic: bool = True) -> None:
            replies = refused * commands
            if atomic:
                replies = b"+OK\r\n" + replies + b"-EXECABORT Transaction discarded\r\n"
            proxy.answering_once(trigger, replies)

        start, answered = proxy.down_bytes, proxy.answered_once
        redirect_once(b"MULTI", 3)  # GETRANGE of each key, then the touch script
        assert s.get_many([small, "big"]) == [b"s" * 100, None]
        redirect_once(b"MULTI", 2)
        assert s.get("big") is None
        redirect_once(b"EXISTS", 4, atomic=False)  # EXISTS and STRLEN of each key
        assert s.contains_many([small, "big"]) == [True, False]
        assert proxy.answered_once - answered == 3  # each call was redirected
        assert proxy.down_bytes - start < 20_000  # never the 4 MiB blob
        st = s.stats()
        assert (st["oversized"], st["hits"], st["read_errors"]) == (2, 1, 0)
        s.clear()


def test_a_store_that_knows_nothing_of_caps_is_capped_by_the_base_class():
    s = _DictStore()
    s.put_many({"small": b"s" * 10, "big": b"b" * 100})
    assert "oversized" not in s.stats() and s.blob_cap is None
    s.cap_blob_bytes(50)
    assert s.get("big") is None and s.get("small") == b"s" * 10
    assert s.get_many(["big", "small"]) == [None, b"s" * 10]
    assert s.stats() == {"blobs": 2, "oversized": 2}
    with pytest.raises(ValueError, match="max_bytes=-1 must be >= 0"):
        s.cap_blob_bytes(-1)
    with pytest.raises(TypeError, match="max_bytes"):
        s.cap_blob_bytes("50")
