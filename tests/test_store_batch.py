"""Batched store calls (get_many, put_many, contains_many) on real parts: a disk store
on the local file system, a real redis-server and a real three-node Redis Cluster, with
several real processes racing; and the Store interface's defaults for any other store.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
import uuid

import pytest

from kvxfer.store import (DiskStore, RedisClusterStore, RedisStore, Store, StoreBatchError,
                          StoreError)
from kvxfer.store._keyspace import MARKER
from store_worker import blob_version, make_blob
from test_store import file_bytes, finish, workers


@pytest.fixture
def prefix():
    return f"test-{uuid.uuid4().hex[:8]}:"


def _version(key: str, blob: bytes | None) -> int | None:
    return None if blob is None else blob_version(key, blob)


def _open(kind: str, request, tmp_path, prefix: str, name: str = "a", **kw) -> Store:
    if kind == "disk":
        return DiskStore(tmp_path / f"pages-{name}", **kw)
    if kind == "redis":
        return RedisStore(request.getfixturevalue("redis_server"), prefix=f"{prefix}{name}:",
                          **kw)
    return RedisClusterStore(request.getfixturevalue("redis_cluster").spec,
                             prefix=f"{prefix}{name}:", **kw)


def _clear(store: Store) -> None:
    if not isinstance(store, DiskStore):
        store.clear()
    store.close()


KINDS = ["disk", "redis", "cluster"]


# -- batched results are the per-key results -------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_batched_calls_give_what_the_per_key_calls_give(kind, request, tmp_path, prefix):
    """Two stores, one driven by the batched calls and one by a loop of single-key
    calls, through the same puts (some present, some replaced), gets (hits, misses,
    repeats) and evictions, end with the same results, keys, LRU order and bytes."""
    per_key = 6000 if kind != "cluster" else 16 * 1500  # cluster: 16 domains' shares
    batched, looped = (_open(kind, request, tmp_path, prefix, name, capacity_bytes=per_key)
                       for name in ("batched", "looped"))
    rng = random.Random(0)
    try:
        for rnd in range(12):
            keys = [f"k{rng.randrange(40)}" for _ in range(rng.randrange(1, 24))]
            if rnd % 3 == 0:
                replace = rnd % 2 == 1
                items = [(k, make_blob(k, rnd, rng.choice((64, 200, 900)))) for k in keys]
                # The loop put_many documents for repeated keys: each key once, its first
                # blob where it first appears (later positions False), or with replace
                # its last blob where it last appears (every position that put's result).
                if replace:
                    last = {k: i for i, (k, _) in enumerate(items)}
                    wrote = {k: looped.put(k, b, replace=True)
                             for i, (k, b) in enumerate(items) if last[k] == i}
                    want = [wrote[k] for k in keys]
                else:
                    want, seen = [], set()
                    for k, blob in items:
                        want.append(k not in seen and looped.put(k, blob))
                        seen.add(k)
                assert batched.put_many(items, replace=replace) == want
            elif rnd % 3 == 1:
                want = [looped.get(k) for k in dict.fromkeys(keys)]
                got = batched.get_many(keys)
                assert got == [dict(zip(dict.fromkeys(keys), want))[k] for k in keys]
            else:
                assert batched.contains_many(keys) == [looped.contains(k) for k in keys]
            assert batched.keys() == looped.keys()  # LRU order included
            sb, sl = batched.stats(), looped.stats()
            for counter in ("blobs", "bytes", "gets", "hits", "evictions", "puts"):
                assert sb[counter] == sl[counter], counter
        assert sb["evictions"] > 0 and sb["hits"] > 0 and sb["gets"] > sb["hits"]
    finally:
        _clear(batched), _clear(looped)


@pytest.mark.parametrize("kind", KINDS)
def test_order_repeats_empty_batches_and_mappings(kind, request, tmp_path, prefix):
    s = _open(kind, request, tmp_path, prefix)
    try:
        assert s.get_many([]) == [] and s.put_many([]) == [] and s.contains_many([]) == []
        assert s.put_many({"b": b"bee", "a": b"ay"}) == [True, True]
        # Repeated keys without replace: the first blob is written, later ones report
        # False as a second put would.
        assert s.put_many(iter([("c", b"c1"), ("a", b"no"), ("c", b"c2")])) == \
            [True, False, False]
        assert s.get_many(["c", "zz", "a", "c", "b"]) == [b"c1", None, b"ay", b"c1", b"bee"]
        assert s.stats()["gets"] == 4  # a key given twice is read (and counted) once
        # With replace: the last blob of a repeated key is written, every position True.
        assert s.put_many([("c", b"c3"), ("d", b"d1"), ("c", b"c4")], replace=True) == \
            [True, True, True]
        assert s.get_many(("c", "d")) == [b"c4", b"d1"]
        assert s.contains_many(["d", "nope", "d", "a"]) == [True, False, True, True]
        assert s.put_many([("big", bytearray(b"x" * 70000)), ("mv", memoryview(b"yz"))]) == \
            [True, True]
        assert s.get_many(["big", "mv"]) == [b"x" * 70000, b"yz"]
    finally:
        _clear(s)


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_batch_is_refused_by_name_before_anything_is_written(kind, request, tmp_path,
                                                                   prefix):
    cap = 4096 if kind != "cluster" else 16 * 4096
    s = _open(kind, request, tmp_path, prefix, capacity_bytes=cap)
    try:
        with pytest.raises(TypeError, match="Expected a str key at position 2. Got 7"):
            s.put_many([("a", b"1"), ("b", b"2"), (7, b"3")])
        with pytest.raises(ValueError, match="Expected a non-empty key at position 1"):
            s.put_many([("a", b"1"), ("", b"2")])
        with pytest.raises(TypeError, match=r"Expected a bytes-like blob for key 'b' "
                                            r"\(position 1\). Got str"):
            s.put_many([("a", b"1"), ("b", "text")])
        with pytest.raises(TypeError, match="Expected a \\(key, blob\\) pair at position 1"):
            s.put_many([("a", b"1"), "b"])
        with pytest.raises(ValueError, match="for key 'huge' .*(capacity|share)"):
            s.put_many([("a", b"1"), ("huge", bytes(cap + 1))])
        assert s.stats()["blobs"] == 0 and s.get_many(["a", "b"]) == [None, None]
        with pytest.raises(TypeError, match="Got one str 'abc': pass \\[key\\]"):
            s.get_many("abc")
        with pytest.raises(TypeError, match="Expected a str key at position 0. Got b'k'"):
            s.contains_many([b"k"])
    finally:
        _clear(s)


# -- one winner per key across clients ---------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_put_many_race_between_two_processes_has_one_winner(kind, request, tmp_path, prefix):
    n = 600
    if kind == "disk":
        spec, check = str(tmp_path / "shared"), DiskStore(tmp_path / "shared")
    elif kind == "redis":
        url = request.getfixturevalue("redis_server")
        spec, check = f"{url}#{prefix}", RedisStore(url, prefix=prefix)
    else:
        cluster = request.getfixturevalue("redis_cluster").spec
        spec, check = f"{cluster}#{prefix}", RedisClusterStore(cluster, prefix=prefix)
    procs = workers(*[("race_many", spec, who, n, 16) for who in (1, 2)])
    won = [set(json.loads(finish(p))["won"]) for p in procs]
    assert won[0].isdisjoint(won[1]) and won[0] | won[1] == set(range(n))
    assert check.stats()["blobs"] == n
    got = check.get_many([f"race-{i}" for i in range(n)])
    for i, blob in enumerate(got):
        assert blob_version(f"race-{i}", blob) == (1 if i in won[0] else 2)
    _clear(check)


# -- exact accounting, LRU touched by get_many -----------------------------------------


@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_get_many_marks_keys_used_for_every_client(kind, request, tmp_path, prefix):
    if kind == "redis":
        a, b = (_open(kind, request, tmp_path, prefix, capacity_bytes=4000) for _ in (1, 2))
        keys = [f"lru-{i}" for i in range(5)]
    else:
        a, b = (_open(kind, request, tmp_path, prefix, capacity_bytes=16 * 4000)
                for _ in (1, 2))
        keys = [k for k in (f"lru-{i}" for i in range(400)) if a.domain_of(k) == 5][:5]
    try:
        assert a.put_many([(k, make_blob(k, 0, 1000)) for k in keys[:4]]) == [True] * 4
        got = b.get_many([keys[1], keys[0]])  # another client's hits, in this order
        assert [blob_version(k, g) for k, g in zip(keys[1::-1], got)] == [0, 0]
        assert b.put_many([(keys[4], make_blob(keys[4], 0, 1000))]) == [True]
        # keys[2] was the least recently used: evicted; then keys[3], keys[1], keys[0].
        assert a.get_many([keys[2]]) == [None] and b.stats()["evictions"] == 1
        assert [k for k in a.keys() if k in keys] == [keys[3], keys[1], keys[0], keys[4]]
    finally:
        _clear(a), b.close()


def _server_sizes(kind, request, store) -> dict[str, int]:
    """Every blob of ``store`` read off the server(s) directly: key -> size."""
    import redis

    out = {}
    if kind == "redis":
        nodes = [redis.Redis.from_url(store.url)]
        roots = ["{" + store.prefix + "}"]
    else:
        nodes = [redis.Redis(host="127.0.0.1", port=p)
                 for p in request.getfixturevalue("redis_cluster").ports]
        roots = [store.domain_root(d) for d in range(store.domains)]
    for raw in nodes:
        with raw:
            for root in roots:
                glob = "".join("\\" + c if c in "*?[]\\" else c for c in root) + "b:*"
                for k in raw.scan_iter(match=glob, count=1000):
                    out[k.decode()[len(root) + 2:]] = raw.strlen(k)
    return out


@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_accounting_stays_exact_under_two_clients_batching(kind, request, tmp_path, prefix):
    cap = 60000 if kind == "redis" else 16 * 20000
    a, b = (_open(kind, request, tmp_path, prefix, capacity_bytes=cap) for _ in (1, 2))
    bad: list[str] = []

    def hammer(s, seed):  # batched puts (some replacing), gets, deletes over shared keys
        rng = random.Random(seed)
        for i in range(120):
            keys = [f"h-{rng.randrange(48)}" for _ in range(rng.randrange(1, 12))]
            op = rng.random()
            if op < 0.5:
                s.put_many([(k, make_blob(k, seed * 1000 + i, rng.choice((100, 3000, 9000))))
                            for k in keys], replace=rng.random() < 0.5)
            elif op < 0.9:
                for k, blob in zip(keys, s.get_many(keys)):
                    if blob is not None and blob_version(k, blob) is None:
                        bad.append(k)
            else:
                s.delete(keys[0])

    threads = [threading.Thread(target=hammer, args=(s, seed)) for s, seed in ((a, 1), (b, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert bad == []
        sizes = _server_sizes(kind, request, a)
        st = a.stats()
        assert st["bytes"] == sum(sizes.values()) <= cap and st["blobs"] == len(sizes)
        assert sorted(a.keys()) == sorted(sizes)
        assert a.stats()["evictions"] + b.stats()["evictions"] > 0
    finally:
        _clear(a), b.close()


def test_put_many_whose_accounting_fails_writes_nothing(request, tmp_path, prefix):
    import redis

    s = _open("redis", request, tmp_path, prefix)
    root = "{" + s.prefix + "}"
    with s, redis.Redis.from_url(s.url) as raw:
        assert s.put("old", b"kept")
        raw.set(root + "m:bytes", "not a number")  # another client's damage
        with pytest.raises(StoreBatchError, match="2 of 3 keys failed") as e:
            s.put_many([("new", b"x" * 100), ("old", b"y"), ("other", b"z" * 10)])
        assert e.value.results == [None, False, None]  # "old" present: nothing to account
        assert all("is not an integer" in str(err) and "nothing was written" in str(err)
                   for err in e.value.errors.values()) and set(e.value.errors) == {0, 2}
        for key in ("new", "other"):  # no blob, no marker left in its place
            assert not raw.exists(root + "b:" + key)
        assert s.get_many(["old", "new"]) == [b"kept", None]
        raw.set(root + "m:bytes", len(b"kept"))
        assert s.put_many([("new", b"x" * 100)]) == [True]
        s.clear()


# -- a blob that fails its checks is a miss for its key only -----------------------------


def test_disk_damaged_files_in_a_batch_are_misses_for_their_keys_only(tmp_path, caplog):
    d = tmp_path / "pages"
    with DiskStore(d) as s:
        keys = [f"k{i}" for i in range(6)]
        assert s.put_many([(k, make_blob(k, 0, 500)) for k in keys]) == [True] * 6
        with open(d / "k1.kvb", "r+b") as f:  # cut short
            f.truncate(100)
        with open(d / "k3.kvb", "r+b") as f:  # its head overwritten
            f.write(b"garbage!")
        os.replace(d / "k4.kvb", d / "k5.kvb")  # another key's whole file under k5
        with caplog.at_level(logging.WARNING, logger="kvxfer"):
            got = s.get_many(keys)
        assert [_version(k, g) for k, g in zip(keys, got)] == \
            [0, None, 0, None, None, None]
        assert "'k1' in the disk store" in caplog.text and "is damaged" in caplog.text
        st = s.stats()
        assert st["incomplete"] == 2 and st["gets"] == 6 and st["hits"] == 2
    with DiskStore(d, max_blob_bytes=400) as small:  # a blob over the limit: not read
        assert small.put_many([("tiny", b"t")]) == [True]
        assert small.get_many(["k0", "tiny", "k2"]) == [None, b"t", None]
        assert small.stats()["oversized"] == 2


def test_redis_marker_of_a_failed_put_in_a_batch_is_a_miss_for_its_key_only(request,
                                                                          tmp_path, prefix):
    import redis

    s = _open("redis", request, tmp_path, prefix)
    root = "{" + s.prefix + "}"
    with s, redis.Redis.from_url(s.url) as raw:
        assert s.put_many([("a", b"1"), ("c", b"3")]) == [True, True]
        raw.set(root + "b:b", MARKER)  # what a failed put leaves until its writer removes it
        assert s.get_many(["a", "b", "c"]) == [b"1", None, b"3"]
        assert s.stats()["hits"] == 2
        s.clear()


def test_a_server_error_in_one_domain_spares_the_others(redis_cluster, prefix, caplog):
    import redis

    with RedisClusterStore(redis_cluster.spec, prefix=prefix) as s:
        keys = [f"k{i}" for i in range(32)]
        s.put_many([(k, k.encode()) for k in keys])
        d = s.domain_of(keys[0])
        root = s.domain_root(d)
        port = int(s.domain_nodes()[d].rpartition(":")[2])
        with redis.Redis(host="127.0.0.1", port=port) as raw:
            raw.delete(root + "m:lru")
            raw.set(root + "m:lru", b"not a sorted set")  # another client's mistake
            with caplog.at_level(logging.WARNING, logger="kvxfer"), \
                    pytest.raises(StoreBatchError, match="WRONGTYPE") as e:
                s.get_many(keys)
            raw.delete(root + "m:lru")
        bad = {i for i, k in enumerate(keys) if s.domain_of(k) == d}
        assert set(e.value.errors) == bad
        assert e.value.results == [None if i in bad else k.encode()
                                   for i, k in enumerate(keys)]
        assert "unreachable" not in caplog.text and s.stats()["read_errors"] == 0
        s.clear()


# -- a cluster node dies mid-batch --------------------------------------------------------


def test_a_node_killed_under_batches_is_misses_then_serves_again(redis_cluster, prefix,
                                                                caplog):
    s = RedisClusterStore(redis_cluster.spec, prefix=prefix, timeout_s=5)
    keys = [f"k{i}" for i in range(64)]
    assert s.put_many([(k, make_blob(k, 0, 300)) for k in keys]) == [True] * 64
    nodes = s.domain_nodes()
    victim = int(nodes[s.domain_of(keys[0])].rpartition(":")[2])
    dead = {k for k in keys if int(nodes[s.domain_of(k)].rpartition(":")[2]) == victim}
    assert 0 < len(dead) < len(keys)
    seen, problems, stop = [], [], threading.Event()

    def reader():  # batches in flight while the node dies: misses, never wrong, never raise
        while not stop.is_set():
            try:
                got = s.get_many(keys)
            except Exception as e:  # noqa: BLE001 - any error is a failure of the test
                problems.append(repr(e))
                return
            for k, g in zip(keys, got):
                if g is None and k not in dead or g is not None and blob_version(k, g) != 0:
                    problems.append(k)
            seen.append({k for k, g in zip(keys, got) if g is None})

    t = threading.Thread(target=reader)
    with caplog.at_level(logging.WARNING, logger="kvxfer"):
        t.start()
        time.sleep(0.2)
        redis_cluster.kill(victim)
        try:
            while not any(m == dead for m in seen[-3:]):
                assert t.is_alive(), problems
                time.sleep(0.05)
            stop.set()
            t.join()
            assert problems == []
            before = s.stats()["read_errors"]
            got = s.get_many(keys)  # held: misses at once, counted per key
            assert {k for k, g in zip(keys, got) if g is None} == dead
            assert s.stats()["read_errors"] == before + len(dead)
            assert s.contains_many(keys) == [k not in dead for k in keys]
            assert f"node 127.0.0.1:{victim}) is unreachable, its pages are misses" in \
                caplog.text
            assert caplog.text.count("is unreachable") <= s.domains  # once per domain
            # Writes: the live domains' keys are written, the dead ones' fail by name.
            items = [(f"n{i}", make_blob(f"n{i}", 0, 100)) for i in range(32)]
            with pytest.raises(StoreBatchError) as e:
                s.put_many(items)
            down = {i for i, (k, _) in enumerate(items)
                    if int(nodes[s.domain_of(k)].rpartition(":")[2]) == victim}
            assert set(e.value.errors) == down and 0 < len(down) < len(items)
            assert all("is down" in str(err) or "cannot write" in str(err)
                       for err in e.value.errors.values())
            assert [r for i, r in enumerate(e.value.results) if i not in down] == \
                [True] * (len(items) - len(down))
        finally:
            stop.set()
            redis_cluster.restart(victim)
    deadline = time.monotonic() + 30
    while True:  # the same client, not reopened: the node's domains serve again
        try:
            s.put_many([(k, make_blob(k, 1, 300)) for k in sorted(dead)])
            break
        except StoreBatchError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    got = s.get_many(keys)
    assert [blob_version(k, g) for k, g in zip(keys, got)] == \
        [1 if k in dead else 0 for k in keys]
    assert s.stats()["domains_unreachable"] == 0
    redis_cluster.wait_ok()
    s.clear()
    s.close()


def test_a_slot_moved_under_a_batch_is_followed(redis_cluster, prefix):
    """A domain whose slot moved to another node since the client read its slot map
    (MOVED): its keys go through the client, which follows and refreshes the map."""
    import redis
    from redis.crc import key_slot

    s = RedisClusterStore(redis_cluster.spec, prefix=prefix)
    keys = [f"k{i}" for i in range(32)]
    assert s.put_many([(k, k.encode()) for k in keys[:16]]) == [True] * 16
    d = s.domain_of(keys[0])
    slot = key_slot(s.domain_root(d).encode())
    src = int(s.domain_nodes()[d].rpartition(":")[2])
    dst = next(p for p in redis_cluster.ports if p != src)
    raws = {p: redis.Redis(host="127.0.0.1", port=p) for p in redis_cluster.ports}

    def move(slot_from: int, slot_to: int) -> None:  # an emptied slot, reassigned
        for k in raws[slot_from].cluster("getkeysinslot", slot, 1000):
            raws[slot_from].delete(k)
        node_id = raws[slot_to].cluster("myid")
        for raw in raws.values():
            raw.execute_command("CLUSTER", "SETSLOT", slot, "NODE", node_id)

    move(src, dst)
    try:
        moved = [k for k in keys if s.domain_of(k) == d]
        wrote = s.put_many([(k, b"new-" + k.encode()) for k in keys])
        # The moved domain's keys were emptied with their slot: written again.
        assert wrote == [k in moved or i >= 16 for i, k in enumerate(keys)]
        assert s.get_many(keys) == [(b"new-" if k in moved or i >= 16 else b"") + k.encode()
                                    for i, k in enumerate(keys)]
        assert s.domain_nodes()[d] == f"127.0.0.1:{dst}"  # the client's map, refreshed
    finally:
        move(dst, src)
        redis_cluster.wait_ok()
        for raw in raws.values():
            raw.close()
    s.clear()
    s.close()


def test_an_unreachable_redis_server_fails_the_batch_by_name():
    import redis_rig

    redis_rig.require()
    with redis_rig.redis_server() as url:
        s = RedisStore(url, prefix="gone:", timeout_s=2)
        assert s.put_many([("k", b"v")]) == [True]
    with pytest.raises(StoreBatchError, match=r"redis store at redis://127.0.0.1:\d+/0: "
                                              r"cannot read keys 'k' and 1 more") as e:
        s.get_many(["k", "j"])
    assert isinstance(e.value, StoreError) and e.value.results == [None, None]
    with pytest.raises(StoreBatchError, match="cannot write key 'k'"):
        s.put_many([("k", b"v")])
    s.close()


# -- disk: one pass --------------------------------------------------------------------


def test_disk_put_many_syncs_the_directory_once(tmp_path, monkeypatch):
    d = tmp_path / "pages"
    with DiskStore(d, capacity_bytes=file_bytes("k0", 1000) * 6) as s:
        dir_ino = os.stat(d).st_ino
        synced = []
        real = os.fsync

        def fsync(fd):  # counts, then syncs for real
            synced.append(os.fstat(fd).st_ino == dir_ino)
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        keys = [f"k{i}" for i in range(8)]
        assert s.put_many([(k, make_blob(k, 0, 1000)) for k in keys]) == [True] * 8
        assert synced.count(True) == 1 and synced.count(False) == 8  # each file, then dir
        monkeypatch.undo()
        # Eviction as a loop of puts would leave it: the two oldest went.
        assert s.keys() == keys[2:] and s.stats()["evictions"] == 2
    with DiskStore(d) as again:  # durable: a restart finds them, in their order
        assert again.keys() == keys[2:]
        assert [_version(k, b) for k, b in zip(keys, again.get_many(keys))] == \
            [None, None] + [0] * 6


# -- any other store: the interface's defaults ----------------------------------------------


class _DictStore(Store):
    """A third-party store of the plainest kind: only the single-key calls."""

    name = "dict"

    def __init__(self, broken: set[str] = frozenset()):
        self.blobs: dict[str, bytes] = {}
        self.broken = broken
        self.calls: list[tuple[str, str]] = []

    def put(self, key, blob, *, replace=False):
        self.calls.append(("put", key))
        if key in self.broken:
            raise StoreError(f"cannot write {key!r}")
        if key in self.blobs and not replace:
            return False
        self.blobs[key] = bytes(blob)
        return True

    def get(self, key):
        self.calls.append(("get", key))
        if key in self.broken:
            raise StoreError(f"cannot read {key!r}")
        return self.blobs.get(key)

    def contains(self, key):
        return key in self.blobs

    def delete(self, key):
        return self.blobs.pop(key, None) is not None

    def stats(self):
        return {"blobs": len(self.blobs)}


def test_any_store_gets_the_batched_calls_from_its_single_key_calls():
    s = _DictStore(broken={"bad"})
    assert s.put_many([("a", b"1"), ("b", b"2"), ("a", b"3")]) == [True, True, False]
    assert s.calls == [("put", "a"), ("put", "b")]  # a repeated key: one put
    assert s.get_many(["b", "a", "zz", "b"]) == [b"2", b"1", None, b"2"]
    assert s.contains_many(["a", "zz"]) == [True, False]
    with pytest.raises(StoreBatchError, match="1 of 3 keys failed; the first, at position 1: "
                                              "cannot read 'bad'") as e:
        s.get_many(["a", "bad", "b"])
    assert e.value.results == [b"1", None, b"2"] and list(e.value.errors) == [1]
    with pytest.raises(StoreBatchError) as e:
        s.put_many({"c": b"c", "bad": b"x"})
    assert e.value.results == [True, None] and s.blobs["c"] == b"c"
    with pytest.raises(TypeError, match="at position 1"):
        s.put_many([("d", b"d"), (None, b"e")])
    assert "d" not in s.blobs  # checked before anything is written


# -- one round trip per server ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_a_batch_is_one_write_and_one_read_back_per_server(kind, request, tmp_path, prefix,
                                                           monkeypatch):
    from redis.connection import AbstractConnection

    s = _open(kind, request, tmp_path, prefix)
    keys = [f"page-{i}" for i in range(64)]
    servers = 1 if kind == "redis" else len(set(s.domain_nodes().values()))
    assert s.put_many([(k, k.encode()) for k in keys]) == [True] * 64
    sent = []
    real = AbstractConnection.send_packed_command

    def send(self, command, check_health=True):  # counts, then sends for real
        sent.append((self.host, self.port))
        return real(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", send)
    for call, want in ((s.get_many, [k.encode() for k in keys]),
                       (s.contains_many, [True] * 64),
                       (lambda ks: s.put_many([(k, b"x") for k in ks]), [False] * 64)):
        sent.clear()
        assert call(keys) == want
        assert len(sent) == len(set(sent)) == servers
    monkeypatch.undo()
    _clear(s)
