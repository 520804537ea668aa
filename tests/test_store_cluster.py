"""RedisClusterStore against a real three-node Redis Cluster on loopback: the Store
interface, put-if-absent and exact accounting across clients, keys over every node, a
node killed and restarted, and HostCache over it."""

import logging
import random
import threading
import time
import uuid

import jax.numpy as jnp
import pytest

import kvxfer
from kvxfer import testing
from kvxfer.store import RedisClusterStore, StoreError, open_store, parse_spec
from store_worker import blob_version, make_blob


@pytest.fixture
def prefix():
    return f"test-{uuid.uuid4().hex[:8]}:"


def _raw(port):
    import redis

    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)


def _port(node: str) -> int:
    return int(node.rpartition(":")[2])


def _blob_sizes(cluster, s: RedisClusterStore) -> dict[str, int]:
    """Every blob of the store, read off each node directly: key -> size."""
    out = {}
    for port in cluster.ports:
        with _raw(port) as raw:
            for d in range(s.domains):
                root = s.domain_root(d)
                glob = "".join("\\" + c if c in "*?[]\\" else c for c in root) + "b:*"
                for k in raw.scan_iter(match=glob, count=1000):
                    out[k.decode()[len(root) + 2:]] = raw.strlen(k)
    return out


# -- specs ---------------------------------------------------------------------------


def test_parse_spec_knows_cluster_specs_and_names_what_is_wrong():
    spec = "redis+cluster://10.0.0.5:7000,10.0.0.6:7001,[::1]:7002"
    assert parse_spec(spec) == ("redis-cluster", spec)
    with pytest.raises(ValueError, match="node '10.0.0.6' is not HOST:PORT"):
        parse_spec("redis+cluster://10.0.0.5:7000,10.0.0.6")
    with pytest.raises(ValueError, match="node 'h:70000': the port is not a number"):
        parse_spec("redis+cluster://h:70000")
    with pytest.raises(ValueError, match=r"u:\*\*\*@h:x") as e:
        parse_spec("redis+cluster://u:secret@h:x")
    assert "secret" not in str(e.value)


def test_unreachable_cluster_is_a_store_error_without_the_password():
    import redis_rig

    redis_rig.require()
    port = redis_rig.free_port()
    with pytest.raises(StoreError, match=rf"redis cluster store at redis\+cluster://"
                                         rf":\*\*\*@127.0.0.1:{port}: cannot connect") as e:
        RedisClusterStore(f"redis+cluster://:secret@127.0.0.1:{port}", timeout_s=2)
    assert "secret" not in str(e.value)


# -- the Store interface -------------------------------------------------------------


def test_round_trip_miss_replace_delete_keys_clear(redis_cluster, prefix):
    with open_store(redis_cluster.spec, prefix=prefix) as s, \
            RedisClusterStore(redis_cluster.spec, prefix=prefix + "x:") as nested:
        assert s.name == "redis-cluster" and isinstance(s, RedisClusterStore)
        keys = [f"k{i}" for i in range(40)]
        for k in keys:
            assert s.put(k, make_blob(k, 0, 100))
        assert nested.put("k0", b"other")  # a nested prefix shares nothing
        assert not s.put("k0", make_blob("k0", 1, 100))  # present: nothing written
        assert blob_version("k0", s.get("k0")) == 0
        assert s.put("k0", make_blob("k0", 2, 300), replace=True)
        assert blob_version("k0", s.get("k0")) == 2
        assert s.get("nope") is None and not s.contains("nope") and s.contains("k1")
        assert s.delete("k1") and not s.delete("k1") and s.get("k1") is None
        assert sorted(s.keys()) == sorted(set(keys) - {"k1"})
        st = s.stats()
        assert (st["blobs"], st["bytes"], st["domains"], st["domains_unreachable"]) == \
            (39, 38 * 100 + 300, 16, 0)
        assert st["hits"] == 2 and st["gets"] == 4 and st["read_errors"] == 0
        assert _blob_sizes(redis_cluster, s) == {k: 300 if k == "k0" else 100
                                                  for k in keys if k != "k1"}
        assert s.clear() == 39 and s.stats()["blobs"] == 0 and s.get("k0") is None
        assert nested.get("k0") == b"other"
        nested.clear()


def test_keys_spread_over_every_node(redis_cluster):
    with RedisClusterStore(redis_cluster.spec, prefix="spread:") as s:
        s.clear()
        keys = [f"page-{i}" for i in range(64)]
        for k in keys:
            s.put(k, k.encode())
        nodes = s.domain_nodes()
        assert {_port(n) for n in nodes.values()} == set(redis_cluster.ports)
        by_port = {}
        for k in keys:  # each blob is on the node its domain's slot names
            port = _port(nodes[s.domain_of(k)])
            by_port.setdefault(port, []).append(k)
            with _raw(port) as raw:
                assert raw.get(s.domain_root(s.domain_of(k)) + "b:" + k) == k.encode()
        assert set(by_port) == set(redis_cluster.ports)
        s.clear()


def test_put_if_absent_race_between_two_clients_has_one_winner(redis_cluster, prefix):
    n = 400
    clients = [RedisClusterStore(redis_cluster.spec, prefix=prefix) for _ in (1, 2)]
    start = threading.Barrier(4)
    won = [set() for _ in range(4)]

    def race(who):  # two threads on each client: a client is shared by threads too
        start.wait()
        for i in range(n):
            if clients[who % 2].put(f"race-{i}", make_blob(f"race-{i}", who, 64)):
                won[who].add(i)

    threads = [threading.Thread(target=race, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(map(len, won)) == n and set().union(*won) == set(range(n))
    assert clients[0].stats()["blobs"] == n
    for who, keys in enumerate(won):
        for i in keys:
            assert blob_version(f"race-{i}", clients[1 - who % 2].get(f"race-{i}")) == who
    clients[0].clear()
    for c in clients:
        c.close()


def test_capacity_is_exact_across_clients_and_lru_within_a_domain(redis_cluster, prefix):
    cap, domains = 16 * 40000, 16
    a, b = (RedisClusterStore(redis_cluster.spec, prefix=prefix, capacity_bytes=cap)
            for _ in (1, 2))
    # Within one domain, eviction is least recently used across clients.
    same = [k for k in (f"lru-{i}" for i in range(400)) if a.domain_of(k) == 3][:5]
    for k in same[:4]:
        assert a.put(k, make_blob(k, 0, 10000))  # the domain's share: 40000 bytes
    assert b.get(same[0]) is not None  # another client's hit counts for everyone
    assert b.put(same[4], make_blob(same[4], 0, 10000))
    assert a.get(same[1]) is None and b.stats()["evictions"] == 1
    assert [k for k in a.keys() if k in same] == [same[2], same[3], same[0], same[4]]
    with pytest.raises(ValueError, match=r"its domain's share of the capacity \(40000 "
                                         rf"bytes: capacity_bytes={cap} over 16 domains\)"):
        a.put("big", bytes(40001))
    a.clear()

    def hammer(s, seed):  # random puts, replaces and deletes over keys of every domain
        rng = random.Random(seed)
        for i in range(300):
            key = f"h-{rng.randrange(64)}"
            if rng.random() < 0.9:
                s.put(key, make_blob(key, seed * 1000 + i, rng.choice((100, 3000, 20000))),
                      replace=rng.random() < 0.5)
            else:
                s.delete(key)

    threads = [threading.Thread(target=hammer, args=(s, seed)) for s, seed in ((a, 1), (b, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sizes = _blob_sizes(redis_cluster, a)
    st = a.stats()
    assert st["bytes"] == sum(sizes.values()) <= cap and st["blobs"] == len(sizes)
    assert sorted(a.keys()) == sorted(sizes)
    for d in range(domains):  # and each domain within its share
        assert sum(v for k, v in sizes.items() if a.domain_of(k) == d) <= cap // domains
    assert a.stats()["evictions"] + b.stats()["evictions"] > 0
    a.clear()
    a.close(), b.close()


def test_a_server_error_on_a_read_is_a_store_error_not_an_outage(redis_cluster, prefix, caplog):
    with RedisClusterStore(redis_cluster.spec, prefix=prefix) as s:
        assert s.put("k", b"v")
        root = s.domain_root(s.domain_of("k"))
        with _raw(_port(s.domain_nodes()[s.domain_of("k")])) as raw:
            raw.set(root + "m:lru", b"not a sorted set")  # another client's mistake
            with caplog.at_level(logging.WARNING, logger="kvxfer"), \
                    pytest.raises(StoreError, match="cannot read key 'k': .*WRONGTYPE"):
                s.get("k")
            raw.delete(root + "m:lru")
        assert "unreachable" not in caplog.text
        assert s.stats()["read_errors"] == 0 and s.get("k") == b"v"  # not held off
        assert s.clear() == 1


# -- a node dies and comes back -------------------------------------------------------


def test_a_dead_node_is_misses_with_a_warning_then_serves_again(redis_cluster, prefix,
                                                               caplog):
    s = RedisClusterStore(redis_cluster.spec, prefix=prefix, timeout_s=5)
    keys = [f"k{i}" for i in range(48)]
    for k in keys:
        s.put(k, make_blob(k, 0, 200))
    nodes = s.domain_nodes()
    victim = _port(nodes[s.domain_of(keys[0])])
    dead = {k for k in keys if _port(nodes[s.domain_of(k)]) == victim}
    assert 0 < len(dead) < len(keys)
    redis_cluster.kill(victim)
    try:
        with caplog.at_level(logging.WARNING, logger="kvxfer"):
            for k in keys:
                got = s.get(k)
                assert (got is None) if k in dead else blob_version(k, got) == 0
                assert s.contains(k) == (k not in dead)
        assert f"node 127.0.0.1:{victim}) is unreachable, its pages are misses" in caplog.text
        (k0, *_) = sorted(dead)
        with pytest.raises(StoreError, match=f"cannot write key '{k0}'"):
            s.put(k0, b"v", replace=True)
        st = s.stats()
        assert st["read_errors"] >= 2 * len(dead) and st["domains_unreachable"] > 0
        assert st["blobs"] == len(keys) - len(dead)  # the live domains, exactly
        live = next(f"new-{i}" for i in range(100)
                    if _port(nodes[s.domain_of(f"new-{i}")]) != victim)
        assert s.put(live, b"x" * 10)  # live domains take writes meanwhile
    finally:
        redis_cluster.restart(victim)
    # The same client, not reopened: redis-py finds the node again.
    deadline = time.monotonic() + 30
    with caplog.at_level(logging.INFO, logger="kvxfer"):
        while True:
            try:
                assert s.put(k0, make_blob(k0, 1, 200))
                break
            except StoreError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    assert f"(node 127.0.0.1:{victim}) is reachable again" in caplog.text
    assert blob_version(k0, s.get(k0)) == 1  # a page written after the restart hits
    for k in set(dead) - {k0}:  # with --save '', earlier pages on it are gone: misses
        assert s.get(k) is None
    for k in set(keys) - dead:
        assert blob_version(k, s.get(k)) == 0
    st = s.stats()
    assert st["domains_unreachable"] == 0 and st["blobs"] == len(keys) - len(dead) + 2
    redis_cluster.wait_ok()
    s.clear()
    s.close()


# -- HostCache over the cluster -------------------------------------------------------


def test_host_cache_evicts_to_the_cluster_and_promotes_back_verified(redis_cluster, prefix):
    import prometheus_client
    from prometheus_client.openmetrics import exposition, parser

    import kvxfer.metrics

    caches = testing.random_caches(2, 8, (4, 32), "bfloat16", seed=0)
    want = [testing.bits(c) for c in caches]
    keys = (10, 11, 12, 13)
    with RedisClusterStore(redis_cluster.spec, prefix=prefix) as s:
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2)
        cache = kvxfer.HostCache(mgr, s, namespace="test-model")
        for j, key in enumerate(keys):  # two slots: each put evicts (and spills) the oldest
            cache.put(caches, [j], [key], wait=True)
        assert cache.flush() == 2
        assert cache.stats()["store_pages_written"] == len(keys)
        cache.close(), mgr.close()
        # A cold host tier over the same cluster: every page comes from the store.
        caches = [jnp.zeros_like(c) for c in caches]
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
        cache = kvxfer.HostCache(mgr, s, namespace="test-model")
        hit = cache.lookup([*keys, 14])
        assert hit.tiers == ("store",) * 4
        caches, load = cache.load(caches, hit, [4, 5, 6, 7], gate="layer")
        assert load.result().verified_prefix == 4
        for layer in range(2):
            got = testing.bits(caches[layer])
            assert all((got[4 + j] == want[layer][j]).all() for j in range(4))
        st = cache.stats()
        assert st["store_hits"] == 4 and st["misses"] == 1
        assert cache.lookup([10]).tiers == ("host",)
        registry = prometheus_client.CollectorRegistry()
        kvxfer.metrics.register(cache, registry=registry)
        text = exposition.generate_latest(registry).decode()
        names = [f.name for f in parser.text_string_to_metric_families(text)]
        assert len(names) == len(set(names))  # the cluster's own stats clash with none
        assert registry.get_sample_value("kvxfer_cache_store_tier_domains") == 16
        assert registry.get_sample_value("kvxfer_cache_store_tier_domains_unreachable") == 0
        assert registry.get_sample_value("kvxfer_cache_store_tier_blobs") == 4
        cache.close(), mgr.close()
        s.clear()


# -- the demo, from the command line ------------------------------------------------------


def test_demo_restarts_on_the_cluster_store(redis_cluster):
    from test_store_tier import _demo

    with RedisClusterStore(redis_cluster.spec) as s:  # the demo's prefix, kvxfer:
        s.clear()
    first, _ = _demo("--store", redis_cluster.spec)
    assert first["store_pages_written"] > 0 and first["tokens_match"]
    second, _ = _demo("--store", redis_cluster.spec)  # cold device and host, warm store
    assert second["store_hits"] > 0 and second["requests_by_kind"]["miss"] == 0
    assert second["tokens_match"]
    with RedisClusterStore(redis_cluster.spec) as s:
        assert s.clear() > 0
