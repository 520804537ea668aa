"""Store tiers on real parts: a disk store on the local file system (crashes made by
SIGKILL and by the files a crash leaves), a Redis store on a real redis-server, and
several real processes sharing each.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from kvxfer.store import DiskStore, RedisStore, Store, StoreError, open_store
from kvxfer.store._disk import FRAME_BYTES, file_name
from store_worker import blob_version, make_blob

WORKER = pathlib.Path(__file__).with_name("store_worker.py")
ODD_KEYS = ["plain", "Upper/Case", "geo:3fa2/page:00ff", "../../escape", ".hidden", "sp ace",
            "ünïcode-页", "nul\x00byte", "%41", "x" * 500]


def file_bytes(key: str, blob_len: int) -> int:
    """What a blob's file takes on disk, and so of a DiskStore's capacity."""
    return FRAME_BYTES + len(key.encode()) + blob_len


def worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def workers(*argvs: tuple) -> list[subprocess.Popen]:
    """Workers that start together: each has opened its store when the first starts."""
    procs = [worker(*argv) for argv in argvs]
    for p in procs:
        line = p.stdout.readline()
        assert line.strip() == "ready", p.communicate(timeout=60)[1]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    return procs


def finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out


@pytest.fixture
def redis_spec(redis_server):
    """A Redis store spec with a namespace of the test's own."""
    return redis_server, f"test-{uuid.uuid4().hex[:8]}:"


@pytest.fixture(params=["disk", "redis"])
def any_store(request, tmp_path):
    """Each kind of store, empty, without a capacity."""
    if request.param == "disk":
        store = DiskStore(tmp_path / "pages")
    else:
        url, prefix = request.getfixturevalue("redis_spec")
        store = RedisStore(url, prefix=prefix)
    yield store
    store.close()


# -- both kinds: the interface ------------------------------------------------------


def test_round_trip_miss_replace_delete(any_store: Store):
    store = any_store
    assert store.get("absent") is None and not store.contains("absent")
    assert not store.delete("absent")
    for i, key in enumerate(ODD_KEYS):
        assert store.put(key, make_blob(key, 0, 40 + i))
    for i, key in enumerate(ODD_KEYS):
        assert store.contains(key)
        assert store.get(key) == make_blob(key, 0, 40 + i)
    assert store.put("empty", b"") and store.get("empty") == b""
    # Without replace an existing blob stays; with it, it is overwritten.
    assert not store.put("plain", make_blob("plain", 1, 99))
    assert blob_version("plain", store.get("plain")) == 0
    assert store.put("plain", make_blob("plain", 1, 99), replace=True)
    assert store.get("plain") == make_blob("plain", 1, 99)
    # bytearray and memoryview blobs are bytes too.
    assert store.put("view", memoryview(bytearray(b"abc")))
    assert store.get("view") == b"abc"
    assert store.delete("plain") and store.get("plain") is None
    assert not store.contains("plain")
    s = store.stats()
    assert s["name"] == store.name and s["blobs"] == len(ODD_KEYS) + 1
    assert s["hits"] == len(ODD_KEYS) + 4 and s["gets"] == s["hits"] + 2
    assert set(store.keys()) == (set(ODD_KEYS) - {"plain"}) | {"empty", "view"}


def test_bad_keys_and_blobs_are_refused_by_name(any_store: Store):
    with pytest.raises(TypeError, match="Expected a str key. Got 3 of type int"):
        any_store.put(3, b"x")
    with pytest.raises(ValueError, match="non-empty key"):
        any_store.get("")
    with pytest.raises(TypeError, match="bytes-like blob. Got str"):
        any_store.put("k", "text")
    for call in (any_store.get, any_store.contains, any_store.delete,
                 lambda k: any_store.put(k, b"x"), lambda k: any_store.get_many(["a", k])):
        with pytest.raises(ValueError, match=r"a key that UTF-8 can encode. Got 'a\\ud800b'"):
            call("a\ud800b")


def test_closed_store_says_so(any_store: Store):
    any_store.put("k", b"v")
    any_store.close()
    with pytest.raises(StoreError, match="closed"):
        any_store.get("k")


# -- disk ---------------------------------------------------------------------------


def test_disk_store_without_directory_sync_shares_the_directory(tmp_path):
    with DiskStore(tmp_path) as durable, DiskStore(tmp_path, durable=False) as fast:
        assert fast.put("k", b"fast") and not durable.put("k", b"slow")
        assert durable.get("k") == b"fast" and repr(fast).endswith("durable=False)")
    with pytest.raises(TypeError, match="bool for durable. Got 1 of type int"):
        DiskStore(tmp_path, durable=1)


def test_disk_files_stay_inside_the_directory_under_safe_names(tmp_path):
    with DiskStore(tmp_path / "d") as store:
        for key in ODD_KEYS:
            store.put(key, b"x")
        names = sorted(os.listdir(tmp_path / "d"))
    assert os.listdir(tmp_path) == ["d"]
    blobs = [n for n in names if not n.startswith(".")]
    assert sorted(blobs) == sorted(file_name(k) for k in ODD_KEYS)
    assert all(len(n) <= 204 and "/" not in n for n in blobs)
    # Names that differ only in case on a case-insensitive file system differ here.
    assert file_name("Ab").lower() != file_name("ab").lower()


def test_disk_reopens_with_its_blobs_and_lru_order(tmp_path):
    d = tmp_path / "d"
    with DiskStore(d) as store:
        for key in "abcd":
            store.put(key, make_blob(key, 0, 1000))
        assert store.get("a") is not None and store.get("c") is not None
        assert store.keys() == ["b", "d", "a", "c"]
    with DiskStore(d) as store:  # after a restart
        assert store.keys() == ["b", "d", "a", "c"]
        assert all(blob_version(k, store.get(k)) == 0 for k in "bd")
        assert store.keys() == ["a", "c", "b", "d"]
    # A smaller capacity on reopen evicts the least recently used first.
    with DiskStore(d, capacity_bytes=2 * file_bytes("a", 1000)) as store:
        assert store.keys() == ["b", "d"]
        s = store.stats()
        assert (s["blobs"], s["bytes"], s["evictions"]) == (2, 2 * file_bytes("a", 1000), 2)


def test_disk_capacity_evicts_least_recently_used(tmp_path):
    one = file_bytes("a", 1000)
    with DiskStore(tmp_path, capacity_bytes=3 * one) as store:
        for key in "abc":
            store.put(key, make_blob(key, 0, 1000))
        store.get("a")
        store.put("d", make_blob("d", 0, 1000))  # b is the least recently used
        assert store.keys() == ["c", "a", "d"]
        store.get("c")
        store.put("e", make_blob("e", 0, 1000))
        assert store.keys() == ["d", "c", "e"]
        assert not store.contains("a") and store.get("b") is None
        # A contains() does not mark a blob used; a put that finds it there neither.
        store.contains("d")
        assert not store.put("d", make_blob("d", 1, 1000))
        store.put("f", make_blob("f", 0, 1000))
        assert store.keys() == ["c", "e", "f"]
        s = store.stats()
        assert (s["blobs"], s["bytes"], s["evictions"]) == (3, 3 * one, 3)
        with pytest.raises(ValueError, match=f"capacity_bytes={3 * one}"):
            store.put("big", bytes(3 * one))
        assert store.keys() == ["c", "e", "f"]


def write_frame_then_cut(store: DiskStore, key: str, blob: bytes, keep: int) -> pathlib.Path:
    """A real file for ``key``, then cut to its first ``keep`` bytes (or its tail zeroed
    when ``keep`` is negative), as a crash the file system did not protect leaves it."""
    assert store.put(key, blob, replace=True)
    path = pathlib.Path(store.path) / file_name(key)
    data = path.read_bytes()
    if keep >= 0:
        path.write_bytes(data[:keep])
    else:
        path.write_bytes(data[:keep] + bytes(-keep))
    return path


@pytest.mark.parametrize("keep", [0, 10, 24, 24 + 3, 24 + 3 + 500, -1, -12, -13])
def test_disk_file_cut_short_is_a_miss_then_replaced_then_cleaned(tmp_path, keep):
    blob = make_blob("key", 0, 4096)
    with DiskStore(tmp_path) as store:
        path = write_frame_then_cut(store, "key", blob, keep)
        assert store.get("key") is None and not store.contains("key")
        assert store.stats()["incomplete"] == 1
        assert "key" not in store.keys()
    with DiskStore(tmp_path) as store:  # reopening removes it
        assert not path.exists() and store.stats()["cleaned"] == 1
    with DiskStore(tmp_path) as store:
        write_frame_then_cut(store, "key", blob, keep)
        # A put-if-absent takes the place of a file that is not whole.
        assert store.put("key", blob) and store.get("key") == blob


def test_disk_corrupt_head_is_a_miss(tmp_path):
    with DiskStore(tmp_path) as store:
        store.put("key", make_blob("key", 0, 100))
        path = tmp_path / file_name("key")
        data = bytearray(path.read_bytes())
        data[9] ^= 1  # the key length: the head's crc32 no longer matches
        path.write_bytes(bytes(data))
        assert store.get("key") is None


def test_disk_open_removes_dead_writers_temp_files_only(tmp_path):
    with DiskStore(tmp_path) as store:
        store.put("a", b"aaaa")
    dead = tmp_path / ".kvxfer-tmp-1-dead"
    dead.write_bytes(b"KVXBLOB1 partial")
    live = tmp_path / ".kvxfer-tmp-2-live"
    fd = os.open(live, os.O_WRONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a writer in another process, still writing
    try:
        with DiskStore(tmp_path) as store:
            assert not dead.exists() and live.exists()
            assert store.stats()["cleaned"] == 1 and store.keys() == ["a"]
    finally:
        os.close(fd)
    with DiskStore(tmp_path) as store:  # its writer died: now it goes
        assert not live.exists() and store.get("a") == b"aaaa"


def temp_size(path: pathlib.Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # it was just put in place
        return -1


def test_disk_put_killed_mid_write_is_never_read(tmp_path):
    size = 32 << 20
    for _ in range(5):
        d = tmp_path / uuid.uuid4().hex
        proc = worker("crash", d, size)
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill it while a temporary file grows
            names = os.listdir(d)
            if any(n.startswith("crash-") for n in names) and \
                    any(0 < temp_size(d / n) < size for n in names if n.startswith(".kvxfer-tmp-")):
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()
        left = [p for p in d.iterdir() if p.name.startswith(".kvxfer-tmp-")]
        if left:
            break
    assert left, "the writer was never killed mid-put"
    finals = sorted(p.name for p in d.iterdir() if p.name.startswith("crash-"))
    assert finals
    with DiskStore(d) as store:
        assert not any(p.name.startswith(".kvxfer-tmp-") for p in d.iterdir())
        assert store.stats()["cleaned"] == len(left)
        keys = store.keys()
        assert sorted(map(file_name, keys)) == finals
        n = len(keys)
        for i in range(n):  # every put that finished is whole; the one cut short is absent
            assert blob_version(f"crash-{i}", store.get(f"crash-{i}")) == 0
        assert store.get(f"crash-{n}") is None and not store.contains(f"crash-{n}")


def test_disk_threads_share_a_store(tmp_path):
    cap = 6 * file_bytes("t-0", 20000)
    store = DiskStore(tmp_path, capacity_bytes=cap)
    bad, errors = [], []

    def run(seed: int) -> None:
        import random

        rng = random.Random(seed)
        try:
            for i in range(150):
                key = f"t-{rng.randrange(10)}"
                if rng.random() < 0.5:
                    store.put(key, make_blob(key, seed * 1000 + i, rng.choice((100, 20000))),
                              replace=rng.random() < 0.5)
                else:
                    blob = store.get(key)
                    if blob is not None and blob_version(key, blob) is None:
                        bad.append(key)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not bad
    s = store.stats()
    assert s["bytes"] <= cap and s["evictions"] > 0 and s["hits"] > 0
    assert sum(p.stat().st_size for p in tmp_path.iterdir() if not p.name.startswith(".")) \
        == s["bytes"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".kvxfer-tmp-")]
    store.close()


def test_disk_two_processes_share_a_directory(tmp_path):
    cap = 8 * file_bytes("hammer-0", 20000)
    procs = workers(*[("hammer", tmp_path, seed, 300, cap) for seed in (1, 2)])
    results = [json.loads(finish(p)) for p in procs]
    assert all(r["bad"] == [] and r["puts"] > 0 for r in results)
    assert sum(r["hits"] for r in results) > 0
    with DiskStore(tmp_path, capacity_bytes=cap) as store:
        assert store.stats()["bytes"] <= cap
        for key in store.keys():
            assert blob_version(key, store.get(key)) is not None


def test_disk_put_if_absent_race_between_processes(tmp_path):
    n = 150
    procs = workers(*[("race", tmp_path, who, n) for who in (1, 2)])
    won = [set(json.loads(finish(p))["won"]) for p in procs]
    assert won[0].isdisjoint(won[1]) and won[0] | won[1] == set(range(n))
    with DiskStore(tmp_path) as store:
        for who, keys in zip((1, 2), won):
            for i in keys:
                assert blob_version(f"race-{i}", store.get(f"race-{i}")) == who


def test_disk_store_errors_name_the_path(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(StoreError, match=f"disk store '{f}'"):
        DiskStore(f)
    with pytest.raises(ValueError, match="capacity_bytes=0 must be >= 1"):
        DiskStore(tmp_path, capacity_bytes=0)
    with pytest.raises(ValueError, match="non-empty directory path"):
        DiskStore("")


# -- redis --------------------------------------------------------------------------


def test_redis_capacity_evicts_least_recently_used_across_clients(redis_spec):
    url, prefix = redis_spec
    a = RedisStore(url, prefix=prefix, capacity_bytes=3000)
    b = RedisStore(url, prefix=prefix, capacity_bytes=3000)
    for key in "abc":
        assert a.put(key, make_blob(key, 0, 1000))
    assert b.get("a") is not None  # another client's hit counts for everyone
    assert b.put("d", make_blob("d", 0, 1000))
    assert a.keys() == ["c", "a", "d"] and a.get("b") is None
    s = a.stats()
    assert (s["blobs"], s["bytes"], s["capacity_bytes"]) == (3, 3000, 3000)
    assert b.stats()["evictions"] == 1 and s["evictions"] == 0
    assert a.put("a", make_blob("a", 1, 100), replace=True)
    assert a.stats()["bytes"] == 2100
    with pytest.raises(ValueError, match="capacity_bytes=3000"):
        a.put("big", bytes(3001))
    a.close()
    b.close()


def test_redis_bookkeeping_follows_blobs_the_server_dropped(redis_spec):
    import redis

    url, prefix = redis_spec
    with RedisStore(url, prefix=prefix) as store, redis.Redis.from_url(url) as raw:
        store.put("k", b"x" * 100)
        store.put("j", b"y" * 50)
        raw.delete("{" + prefix + "}b:k")  # what the server's maxmemory eviction does
        assert store.get("k") is None
        s = store.stats()
        assert (s["blobs"], s["bytes"]) == (1, 50) and store.keys() == ["j"]
        assert store.put("k", b"z") and store.stats()["bytes"] == 51


def test_redis_clear_removes_its_prefix_only(redis_spec):
    import redis

    url, prefix = redis_spec
    with RedisStore(url, prefix=prefix + "a*[x]:") as a, RedisStore(url, prefix=prefix) as b, \
            redis.Redis.from_url(url) as raw:
        for k in ("1", "2"):
            a.put(k, b"v")
        b.put("1", b"w")
        assert a.clear() == 2
        assert not list(raw.scan_iter(match=prefix + "a*"))
        assert a.get("1") is None and a.stats()["blobs"] == 0
        assert b.get("1") == b"w" and b.stats()["blobs"] == 1


def test_redis_one_process_puts_another_gets(redis_spec):
    url, prefix = redis_spec
    spec = f"{url}#{prefix}"
    # Both connected before either starts; the reader starts once the writer is done.
    putter, getter = worker("put", spec, 20, 50000), worker("get", spec, 20, 50000)
    for p in (putter, getter):
        assert p.stdout.readline().strip() == "ready"
    putter.stdin.write("go\n")
    putter.stdin.flush()
    assert finish(putter).strip() == "done"
    getter.stdin.write("go\n")
    getter.stdin.flush()
    assert json.loads(finish(getter)) == {"whole": 20, "missing": []}
    with RedisStore(url, prefix=prefix) as store:
        assert store.stats()["blobs"] == 20
        assert blob_version("shared-3", store.get("shared-3")) == 0


def test_redis_put_if_absent_race_between_processes(redis_spec):
    url, prefix = redis_spec
    n = 1000  # a Redis put takes about 0.1 ms: enough keys that the two runs overlap
    procs = workers(*[("race", f"{url}#{prefix}", who, n) for who in (1, 2)])
    won = [set(json.loads(finish(p))["won"]) for p in procs]
    assert won[0].isdisjoint(won[1]) and won[0] | won[1] == set(range(n))
    with RedisStore(url, prefix=prefix) as store:
        assert store.stats()["blobs"] == n
        for who, keys in zip((1, 2), won):
            for i in keys:
                assert blob_version(f"race-{i}", store.get(f"race-{i}")) == who


def test_redis_two_processes_keep_one_exact_capacity(redis_spec):
    import redis

    url, prefix = redis_spec
    cap = 60000
    procs = workers(*[("hammer", f"{url}#{prefix}", seed, 300, cap) for seed in (1, 2)])
    results = [json.loads(finish(p)) for p in procs]
    assert all(r["bad"] == [] and r["puts"] > 0 for r in results)
    with RedisStore(url, prefix=prefix) as store, redis.Redis.from_url(url) as raw:
        s = store.stats()
        blobs = list(raw.scan_iter(match="{" + prefix + "}b:*"))
        sizes = [raw.strlen(k) for k in blobs]
        assert s["bytes"] == sum(sizes) <= cap and s["blobs"] == len(blobs)
        assert sorted(store.keys()) == sorted(k.decode()[len(prefix) + 4:] for k in blobs)


def test_redis_unreachable_server_is_a_store_error_naming_the_url():
    import redis_rig

    redis_rig.require()
    with redis_rig.redis_server() as url:
        store = RedisStore(url, prefix="gone:")
        store.put("k", b"v")
    # The server is stopped now.
    with pytest.raises(StoreError, match=f"redis store at {url}: cannot read key 'k'"):
        store.get("k")
    with pytest.raises(StoreError, match=f"redis store at {url}: cannot write key 'k'"):
        store.put("k", b"v")
    store.close()
    with pytest.raises(StoreError, match=f"redis store at {url}: cannot connect"):
        RedisStore(url)


def test_redis_errors_hide_the_password():
    import redis_rig

    redis_rig.require()
    port = redis_rig.free_port()
    with pytest.raises(StoreError, match=r"redis://user:\*\*\*@127.0.0.1") as e:
        RedisStore(f"redis://user:secret@127.0.0.1:{port}/0", timeout_s=2)
    assert "secret" not in str(e.value)


def test_without_redis_py_the_store_package_imports_and_redis_store_says_what_to_install():
    code = ("import sys; sys.modules['redis'] = None\n"
            "from kvxfer.store import RedisStore, DiskStore\n"
            "try:\n    RedisStore()\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "RedisStore needs the redis package: pip install 'kvxfer[redis]'"


# -- open_store ---------------------------------------------------------------------


def test_open_store_takes_dirs_file_urls_and_redis_urls(tmp_path, redis_spec):
    with open_store(str(tmp_path / "a"), capacity_bytes=10**6) as s:
        assert isinstance(s, DiskStore) and s.capacity_bytes == 10**6
        assert s.path == str(tmp_path / "a")
    with open_store(tmp_path / "b") as s:
        assert isinstance(s, DiskStore) and s.path == str(tmp_path / "b")
    with open_store(f"file://{tmp_path}/c") as s:
        assert isinstance(s, DiskStore) and s.path == f"{tmp_path}/c"
    url, prefix = redis_spec
    with open_store(url, prefix=prefix, capacity_bytes=5) as s:
        assert isinstance(s, RedisStore) and (s.url, s.prefix, s.capacity_bytes) == \
            (url, prefix, 5)


@pytest.mark.parametrize("spec, match", [
    ("", "it is empty"),
    ("file://", "no directory after file://"),
    ("s3://bucket/pages", "unknown scheme 's3://'"),
    ("redis://host:port", "the port is not a number"),
    ("redis://127.0.0.1:6379/zero", "the database 'zero' is not an integer"),
    ("redis://:6379", "no host"),
])
def test_open_store_refuses_bad_specs_by_name(spec, match):
    with pytest.raises(ValueError, match=match) as e:
        open_store(spec)
    assert f"Got {spec!r}: " in str(e.value)
    with pytest.raises(TypeError, match="Got 3 of type int"):
        open_store(3)


def test_redis_nested_prefixes_share_nothing(redis_spec):
    url, prefix = redis_spec
    with RedisStore(url, prefix=prefix) as a, RedisStore(url, prefix=prefix + "b:") as b:
        assert a.put("m:lru", b"a's page") and b.put("k", b"b's page")
        assert a.get("m:lru") == b"a's page" and b.get("k") == b"b's page"
        assert a.clear() == 1
        assert b.get("k") == b"b's page" and b.keys() == ["k"]
    with pytest.raises(ValueError, match="braces are kept for framing the prefix"):
        RedisStore(url, prefix="kv{1}:")


def test_redis_put_whose_accounting_fails_writes_nothing(redis_spec):
    import redis

    url, prefix = redis_spec
    with RedisStore(url, prefix=prefix) as store, redis.Redis.from_url(url) as raw:
        assert store.put("old", b"kept")
        raw.set("{" + prefix + "}m:bytes", "not a number")  # another client's damage
        for key, replace in (("new", False), ("old", True)):
            with pytest.raises(StoreError, match="is not an integer .*nothing was written"):
                store.put(key, b"x" * 100, replace=replace)
        assert not raw.exists("{" + prefix + "}b:new")
        assert raw.get("{" + prefix + "}b:old") == b"kept"
