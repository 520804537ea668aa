"""A DiskStore against a hostile or damaged directory, and page blobs with bits this
version does not define: real files (FIFOs, sparse files, directories, other users'
files, read-only directories), no mocks. Then Redis stores (one server, a cluster)
with values of another type planted under a page's key.

What needs another user runs in a subprocess of this file that drops root to
``nobody`` (as root) or runs as is (where the test user is already unprivileged).
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import pytest

from kvxfer.store import DiskStore, StoreError
from kvxfer.store._disk import FRAME_BYTES, file_name

ROOT = os.geteuid() == 0
NOBODY = 65534
DEADLINE_S = 10.0


def within(call: Callable[[], Any], fifos: list[pathlib.Path] = ()) -> Any:
    """``call()``'s result, failing (not hanging) if it takes longer than the deadline;
    a reader blocked on one of ``fifos`` is let go by opening it for writing."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: BLE001 - raised below
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    if t.is_alive():
        for fifo in fifos:  # so the thread does not stay blocked after the test
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        pytest.fail(f"blocked for more than {DEADLINE_S} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def file_bytes(key: str, blob_len: int) -> int:
    return FRAME_BYTES + len(key.encode()) + blob_len


def sparse_frame(directory: pathlib.Path, key: str, blob_len: int) -> pathlib.Path:
    """A whole frame (as the module docstring of kvxfer.store._disk draws it) around a
    blob of ``blob_len`` bytes that the file system does not hold: a hole."""
    kb = key.encode()
    head = struct.pack("<8sIQ", b"KVXBLOB1", len(kb), blob_len)
    crc = zlib.crc32(head + kb)
    path = directory / file_name(key)
    with open(path, "wb") as f:
        f.write(head + struct.pack("<I", crc) + kb)
        f.seek(blob_len, os.SEEK_CUR)
        f.write(struct.pack("<I8s", crc, b"KVXBEND1"))
    return path


# -- 1. entries that are not regular files never block ------------------------------


def test_fifos_in_the_directory_never_block_opening(tmp_path):
    with DiskStore(tmp_path) as store:
        store.put("a", b"aaaa")
    fifos = [tmp_path / "x.kvb", tmp_path / ".kvxfer-tmp-1-dead"]
    for fifo in fifos:
        os.mkfifo(fifo)
    store = within(lambda: DiskStore(tmp_path, capacity_bytes=1 << 20), fifos)
    with store:
        s = store.stats()
        assert (s["skipped"], s["blobs"], s["cleaned"]) == (2, 1, 0)
        assert store.keys() == ["a"] and store.get("a") == b"aaaa"
        assert store.put("b", b"bbbb") and store.get("b") == b"bbbb"
    assert all(stat.S_ISFIFO(os.lstat(f).st_mode) for f in fifos)  # not ours to remove


def test_a_fifo_under_a_key_is_a_miss_never_a_hang(tmp_path, caplog):
    with DiskStore(tmp_path) as store:
        fifo = tmp_path / file_name("k")
        os.mkfifo(fifo)
        assert within(lambda: store.get("k"), [fifo]) is None
        assert not within(lambda: store.contains("k"), [fifo])
        assert within(lambda: store.get("k"), [fifo]) is None
        s = store.stats()
        assert (s["skipped"], s["gets"], s["hits"]) == (1, 2, 0)  # counted once
        assert str(fifo) in caplog.text and "a FIFO" in caplog.text
        # A put takes its place, as it takes the place of a file that is not whole.
        assert within(lambda: store.put("k", b"page"), [fifo])
        assert store.get("k") == b"page"


# -- 2. a declared blob size is checked before anything is read ---------------------


def _capped(path: pathlib.Path, how: str, cap: int) -> DiskStore:
    if how == "max_blob_bytes":
        return DiskStore(path, max_blob_bytes=cap)
    store = DiskStore(path)  # uncapped: opening reads no blob
    store.cap_blob_bytes(cap // 2)
    store.cap_blob_bytes(cap)  # a second cache of larger pages: the largest holds
    assert store.blob_cap == store.max_blob_bytes == cap
    return store


@pytest.mark.parametrize("how", ["max_blob_bytes", "cap_blob_bytes"])
def test_a_sparse_file_over_max_blob_bytes_is_a_miss_without_reading_it(tmp_path, how):
    huge = 2 << 30
    path = sparse_frame(tmp_path, "huge", huge)
    assert path.stat().st_size == file_bytes("huge", huge)
    assert path.stat().st_blocks * 512 < 1 << 20  # the file system holds almost nothing
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    t0 = time.monotonic()
    with within(lambda: _capped(tmp_path, how, 1 << 20)) as store:
        assert store.blob_cap == 1 << 20
        assert within(lambda: store.get_many(["huge", "nothing"])) == [None, None]
        assert within(lambda: store.get("huge")) is None
        assert not store.contains("huge")
        s = store.stats()
        assert (s["oversized"], s["gets"], s["hits"], s["cleaned"]) == (2, 3, 0, 0)
        assert s["max_blob_bytes"] == 1 << 20 and "max_blob_bytes=1048576" in repr(store)
        with pytest.raises(ValueError, match="larger than max_blob_bytes=1048576"):
            store.put("big", bytes((1 << 20) + 1))
        assert store.put("fits", bytes(1 << 20)) and len(store.get("fits")) == 1 << 20
    assert time.monotonic() - t0 < 5  # reading 2 GiB takes tens of seconds
    grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grew_kib < 256 << 10, f"peak memory grew by {grew_kib} KiB"
    assert path.exists()  # a whole file: a store with a larger limit may read it
    with pytest.raises(ValueError, match="max_blob_bytes=-1 must be >= 0"):
        DiskStore(tmp_path, max_blob_bytes=-1)


def test_a_sparse_key_is_never_read_and_a_key_of_junk_is_never_listed(tmp_path, caplog):
    """A frame may claim a key of gigabytes (a hole) or hold bytes no str encodes to."""
    page = "geo/page-1"
    huge = (1 << 32) - 1
    head = struct.pack("<8sIQ", b"KVXBLOB1", huge, 4)
    with open(tmp_path / file_name(page), "wb") as f:  # the key's name, a 4 GiB key
        f.write(head + struct.pack("<I", 0))
        f.seek(huge + 4, os.SEEK_CUR)
        f.write(struct.pack("<I8s", 0, b"KVXBEND1"))
    junk = b"\xff\xfe"  # not UTF-8: a whole frame no put wrote
    head = struct.pack("<8sIQ", b"KVXBLOB1", len(junk), 1)
    crc = zlib.crc32(head + junk)
    (tmp_path / "ff.kvb").write_bytes(head + struct.pack("<I", crc) + junk + b"x" +
                                      struct.pack("<I8s", crc, b"KVXBEND1"))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with within(lambda: DiskStore(tmp_path)) as store:
        assert within(lambda: store.get(page)) is None and not store.contains(page)
        assert within(store.keys) == []
        assert store.put(page, b"mine", replace=True) and store.get(page) == b"mine"
        assert store.keys() == [page]
    grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grew_kib < 256 << 10, f"peak memory grew by {grew_kib} KiB"
    assert (tmp_path / "ff.kvb").exists()  # whole: not the store's to clean away


# -- 3. one bad entry never makes a store unopenable --------------------------------


def test_a_directory_and_a_symlink_under_blob_names_are_skipped(tmp_path, caplog):
    one = file_bytes("a", 100)
    with DiskStore(tmp_path) as store:
        store.put("a", bytes(100))
    (tmp_path / "x.kvb").mkdir()
    (tmp_path / "x.kvb" / "inside").write_bytes(b"keep")
    (tmp_path / "y.kvb").symlink_to(tmp_path / file_name("a"))
    with within(lambda: DiskStore(tmp_path, capacity_bytes=2 * one)) as store:
        s = store.stats()
        assert (s["skipped"], s["blobs"], s["bytes"]) == (2, 1, one)
        assert "a directory" in caplog.text and "a symbolic link" in caplog.text
        assert store.keys() == ["a"]
        assert store.get("x") is None and store.get("y") is None
        for key in "bcd":  # evictions pass the directory by
            assert store.put(key, bytes(100))
        assert store.keys() == ["c", "d"] and store.stats()["skipped"] == 2
    assert (tmp_path / "x.kvb" / "inside").read_bytes() == b"keep"
    assert (tmp_path / "y.kvb").is_symlink()


@pytest.fixture
def shared_dir():
    """A directory another user can reach (a test's tmp_path sits in a private one)."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="kvxfer-shared-"))
    d.chmod(0o755)
    yield d
    for root, dirs, _ in os.walk(d):  # as a user, a read-only directory blocks rmtree
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
    d.chmod(0o755)
    shutil.rmtree(d)


def as_other_user(scenario: str, d: pathlib.Path, *args: Any) -> dict:
    """What ``scenario_<scenario>(d, *args)`` returns, run by a user who does not own
    ``d``'s files: ``nobody`` when the tests run as root, the test user otherwise."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, __file__, scenario, str(d), *map(str, args)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def scenario_unreadable(d: pathlib.Path) -> dict:
    with DiskStore(d) as store:
        return {"skipped": store.stats()["skipped"], "a": store.get("a") is None,
                "b": store.get("b") == b"bbbb", "contains_a": store.contains("a"),
                "skipped_after": store.stats()["skipped"]}


def test_a_file_the_process_may_not_open_is_skipped(shared_dir):
    with DiskStore(shared_dir) as store:
        store.put("a", b"aaaa"), store.put("b", b"bbbb")
    (shared_dir / file_name("a")).chmod(0)  # (root reads it anyway: nobody may not)
    shared_dir.chmod(0o777)  # writable, so only the one file stands in the way
    (shared_dir / ".kvxfer-lock").chmod(0o666)
    out = as_other_user("unreadable", shared_dir)
    assert out == {"skipped": 1, "a": True, "b": True, "contains_a": False,
                   "skipped_after": 1}


def scenario_read_only(d: pathlib.Path) -> dict:
    # Two files of 41 bytes over a capacity of 60 (each alone within it, as a put's
    # must be): no eviction read-only.
    with DiskStore(d, capacity_bytes=60) as store:
        out = {"read_only": store.stats()["read_only"], "a": store.get("a") == b"aaaa",
               "keys": store.keys()}
        for name, call in (("put", lambda: store.put("b", b"b")),
                           ("delete", lambda: store.delete("a"))):
            try:
                call()
                out[name] = "no error"
            except StoreError as e:
                out[name] = str(e)
        return out


@pytest.mark.parametrize("lock_file", ["present", "absent"])
def test_a_read_only_directory_opens_read_only(shared_dir, lock_file):
    with DiskStore(shared_dir) as store:
        store.put("a", b"aaaa"), store.put("c", b"cccc")
    if lock_file == "absent":  # a directory copied without the store's dot files
        (shared_dir / ".kvxfer-lock").unlink()
    shared_dir.chmod(0o555)  # (as root, writable to root only: nobody reads it)
    out = as_other_user("read_only", shared_dir)
    assert out["read_only"] and out["a"] and out["keys"] == ["a", "c"]
    for name in ("put", "delete"):
        assert out[name].startswith(f"disk store '{shared_dir}' is read-only"), out[name]
    assert (shared_dir / file_name("a")).read_bytes().endswith(b"KVXBEND1")


# -- 4. a file that cannot be evicted never wedges puts -----------------------------


def scenario_evict(d: pathlib.Path, one: str) -> dict:
    one = int(one)
    with DiskStore(d, capacity_bytes=2 * one) as store:
        puts = [store.put(k, bytes(100)) for k in "abc"]
        s = store.stats()
        out = {"puts": puts, "keys": store.keys(), "skipped": s["skipped"],
               "evictions": s["evictions"], "bytes": s["bytes"]}
    with DiskStore(d, capacity_bytes=one) as store:  # over capacity on open, too
        out["reopened"] = store.keys()
    return out


@pytest.mark.skipif(not ROOT, reason="needs a file of another user in a sticky directory: "
                    "creating one takes root (the test then runs the store as nobody)")
def test_a_file_that_cannot_be_evicted_is_skipped(shared_dir):
    one = file_bytes("a", 100)
    with DiskStore(shared_dir) as store:
        store.put("old", bytes(98))  # a file of one's size, root's: not nobody's to remove
    shared_dir.chmod(0o1777)
    (shared_dir / ".kvxfer-lock").chmod(0o666)  # so only the one file stands in the way
    out = as_other_user("evict", shared_dir, one)
    assert out["puts"] == [True, True, True]
    assert out["keys"] == ["old", "c"] and out["skipped"] == 1
    assert out["evictions"] == 2 and out["bytes"] == 2 * one
    assert out["reopened"] == ["old"]


# -- 5. page blobs: flags this version does not define, bytes after the last class --


@pytest.fixture(scope="module")
def page():
    import kvxfer
    from kvxfer import testing

    caches = testing.random_caches(2, 4, (8, 32), "float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    (ref,) = mgr.offload(caches, [1], keys=[7]).wait()
    blob = mgr.export_page(ref)
    mgr.free([ref])
    yield mgr, blob
    mgr.close()


def with_total(blob: bytes) -> bytes:
    """``blob`` with its header's total length (the u64 at byte 32) made right."""
    return blob[:32] + struct.pack("<Q", len(blob)) + blob[40:]


@pytest.mark.parametrize("damage, kind, words", [
    (lambda b: b[:12] + struct.pack("<I", 1 | 4) + b[16:], "unknown flags",
     r"unknown flag bits 0x4 \(flags 0x5"),
    (lambda b: b[:12] + struct.pack("<I", 1 << 31) + b[16:], "unknown flags",
     "unknown flag bits 0x80000000"),
    (lambda b: with_total(b + bytes(5)), "truncated", "5 trailing bytes after its 1 slice"),
])
def test_a_page_blob_with_what_its_format_does_not_define_is_refused(page, damage, kind,
                                                                     words):
    import kvxfer

    mgr, blob = page
    ref = mgr.import_page(blob, key=7)  # the blob as made is a page
    mgr.free([ref])
    free = mgr.num_free_pages
    refused = dict(mgr.stats()["imports_refused"])
    with pytest.raises(kvxfer.PageFormatError, match=words) as err:
        mgr.import_page(damage(blob))
    assert err.value.kind == kind
    assert mgr.num_free_pages == free
    assert mgr.stats()["imports_refused"].get(kind, 0) == refused.get(kind, 0) + 1


if __name__ == "__main__":  # as_other_user's subprocess: everything is imported first
    name, directory, *rest = sys.argv[1:]
    if ROOT:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    print(json.dumps(globals()[f"scenario_{name}"](pathlib.Path(directory), *rest)))


def test_a_cap_never_goes_above_the_limit_a_store_was_built_with(tmp_path):
    with DiskStore(tmp_path, max_blob_bytes=1000) as store:
        store.cap_blob_bytes(1 << 30)  # a cache of huge pages cannot lift the store's own
        assert store.blob_cap == store.max_blob_bytes == 1000
        store.cap_blob_bytes(10)
        assert store.blob_cap == 1000  # the largest asked, bounded by the store's limit
        with pytest.raises(ValueError, match="max_blob_bytes=1000"):
            store.put("k", b"x" * 1001)


# -- 6. a file no put wrote is never charged against the capacity -------------------


def _forge(directory: pathlib.Path, key: str, kind: str) -> pathlib.Path:
    """A sparse file of gigabytes under ``key``'s name: a whole frame of a 2 GiB blob
    (``blob``), a frame of a 4 GiB key (``key``), or a frame of 10 bytes in a file of
    2 GiB (``size``: the frame and the file disagree)."""
    if kind == "blob":
        return sparse_frame(directory, key, 2 << 30)
    path = directory / file_name(key)
    klen, blen = ((1 << 32) - 1, 4) if kind == "key" else (len(key.encode()), 10)
    with open(path, "wb") as f:
        f.write(struct.pack("<8sIQI", b"KVXBLOB1", klen, blen, 0))
        f.truncate(2 << 30 if kind == "size" else FRAME_BYTES + klen + blen)
    return path


def _good(store: DiskStore, keys: list[str]) -> None:
    for k in keys:
        assert store.put(k, k.encode().ljust(4000, b"x"))


def _all_there(store: DiskStore, keys: list[str]) -> bool:
    return store.get_many(keys) == [k.encode().ljust(4000, b"x") for k in keys]


@pytest.mark.parametrize("kind", ["blob", "key", "size"])
def test_a_file_claiming_more_than_the_capacity_evicts_no_good_page(tmp_path, caplog, kind):
    capacity = 64 << 20
    keys = [f"good-{i}" for i in range(9)]
    with DiskStore(tmp_path, capacity_bytes=capacity) as store:
        _good(store, keys[:8])
    time.sleep(0.01)  # the forged files are the most recently used
    before = _forge(tmp_path, "planted-1", kind)
    with within(lambda: DiskStore(tmp_path, capacity_bytes=capacity)) as store:
        after = _forge(tmp_path, "planted-2", kind)  # another process's, after the open
        st = store.stats()  # a rescan
        assert (st["blobs"], st["bytes"], st["evictions"]) == \
            (8, 8 * file_bytes(keys[0], 4000), 0)
        _good(store, keys[8:])  # a put that evicts past the capacity would empty the store
        assert _all_there(store, keys)
        assert within(lambda: store.get_many(["planted-1", "planted-2"])) == [None, None]
        st = store.stats()
        assert (st["blobs"], st["evictions"]) == (9, 0)
        if kind == "size":  # not one whole file: removed on open; skipped after it
            assert (st["cleaned"], st["skipped"]) == (1, 1) and not before.exists()
        else:
            assert st["skipped"] == 2 and str(before) in caplog.text
        assert str(after) in caplog.text and "more than capacity_bytes=67108864" in caplog.text


@pytest.mark.parametrize("how", ["max_blob_bytes", "cap_blob_bytes"])
def test_a_file_claiming_more_than_the_blob_cap_evicts_no_good_page(tmp_path, caplog, how):
    capacity, cap = 64 << 10, 4096
    keys = [f"good-{i}" for i in range(12)]
    with DiskStore(tmp_path, capacity_bytes=capacity) as store:
        _good(store, keys[:8])
    time.sleep(0.01)
    planted = sparse_frame(tmp_path, "planted", 20 << 10)  # within the capacity, over the cap
    if how == "max_blob_bytes":
        store = DiskStore(tmp_path, capacity_bytes=capacity, max_blob_bytes=cap)
    else:
        store = DiskStore(tmp_path, capacity_bytes=capacity)
        store.cap_blob_bytes(cap)  # as a cache does once it knows its page size
    with store:
        _good(store, keys[8:])  # 12 pages fit; 12 and the forged file would not
        assert _all_there(store, keys) and store.get("planted") is None
        st = store.stats()
        assert (st["blobs"], st["evictions"], st["skipped"], st["oversized"]) == (12, 0, 1, 1)
        assert f"{planted}: it frames a blob of 20480 bytes, more than max_blob_bytes=4096" \
            in caplog.text
    assert planted.exists()  # a store of larger pages may read it


# -- Redis: a value of another type under a page's key ---------------------------------

_PLANT = {"hash": lambda r, k: r.hset(k, "field", "value"),
          "list": lambda r, k: r.rpush(k, "item"),
          "zset": lambda r, k: r.zadd(k, {"member": 1.0})}


def _redis_store(kind, redis_server, redis_cluster, prefix):
    """The store, and ``(redis client of the node holding key, that key's blob key)``."""
    import redis

    from kvxfer.store import RedisClusterStore, RedisStore

    if kind == "redis":
        s = RedisStore(redis_server, prefix=prefix)
        return s, lambda key: (redis.Redis.from_url(redis_server),
                               "{" + prefix + "}b:" + key)
    s = RedisClusterStore(redis_cluster.spec, prefix=prefix)

    def where(key):
        d = s.domain_of(key)
        port = int(s.domain_nodes()[d].rpartition(":")[2])
        return redis.Redis(host="127.0.0.1", port=port), s.domain_root(d) + "b:" + key
    return s, where


@pytest.mark.parametrize("value", sorted(_PLANT))
@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_a_value_of_another_type_is_a_miss_of_its_own_key_only(kind, value, request):
    # WRONGTYPE on one key failed the whole batch: a lookup found 0 of 3 pages for as
    # long as the planted value stayed.
    import uuid

    import kvxfer
    from kvxfer import testing

    redis_server = request.getfixturevalue("redis_server")
    cluster = request.getfixturevalue("redis_cluster") if kind == "cluster" else None
    s, where = _redis_store(kind, redis_server, cluster, f"wrongtype-{uuid.uuid4().hex[:8]}:")
    caches = testing.random_caches(2, 8, (4, 32), "float32")
    keys = [10, 11, 12]
    with kvxfer.KVCacheManager(caches, num_host_blocks=4) as mgr:
        cache = kvxfer.HostCache(mgr, s, write_through="always", namespace="test-model")
        cache.put(caches, [0, 1, 2], keys, wait=True)
        cache.flush()
        cache.close()
        names = [cache.store_key(k) for k in keys]
        raw, bkey = where(names[1])
        with raw:
            raw.delete(bkey)
            _PLANT[value](raw, bkey)
            assert s.get_many(names)[0::2] == s.get_many([names[0], names[2]])
            assert s.get_many(names)[1] is None and s.get(names[1]) is None
            assert s.contains_many(names) == [True, False, True]
            assert not s.contains(names[1])
        with kvxfer.KVCacheManager(caches, num_host_blocks=4) as cold:
            fresh = kvxfer.HostCache(cold, s, namespace="test-model")
            hit = fresh.lookup(keys)
            assert hit.keys == (10,) and hit.tiers == ("store",)  # up to the planted key
            fresh.release(hit)
            assert fresh.find(11) is None and fresh.find(12) == "store"
            fresh.close()
        assert s.put(names[1], b"a blob again")  # a put replaces what is no blob
        assert s.get(names[1]) == b"a blob again"
    s.clear()
    s.close()
