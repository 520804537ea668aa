"""One process of the multi-process store tests (run by test_store.py), and the blobs
they write: each blob says which key and version it is, so a reader can tell a whole,
right blob from a partial or misplaced one.

Usage: python store_worker.py SCENARIO SPEC ARGS...
  crash SPEC SIZE         put SIZE-byte blobs under new keys until killed
  hammer SPEC SEED OPS CAPACITY   random puts/gets/deletes over a few keys, every
                          read checked; prints {"bad": [...], "hits": n, "puts": n}
  race SPEC WHO N         put keys race-0..race-N-1 (no replace) with WHO's blobs;
                          prints {"won": [...]}
  race_many SPEC WHO N B  the same keys with put_many, B keys a batch; prints {"won": [...]}
  put SPEC N SIZE         put keys shared-0.. with version-0 blobs; prints "done"
  get SPEC N SIZE         read those keys; prints {"whole": n, "missing": [...]}
SPEC is what kvxfer.store.open_store takes (a Redis URL may end in #PREFIX). Each
scenario but crash opens its store, prints "ready", and starts when a line comes on
stdin, so several workers start at once.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import sys

_HEAD = struct.Struct("<IQ")  # version, size


def make_blob(key: str, version: int, size: int) -> bytes:
    """A blob of ``size`` bytes (at least 12) that only ``key`` at ``version`` has."""
    digest = hashlib.sha256(f"{key}/{version}".encode()).digest()
    body = size - _HEAD.size
    return _HEAD.pack(version, size) + (digest * (body // 32 + 1))[:body]


def blob_version(key: str, blob: bytes) -> int | None:
    """The version of a whole, right blob of ``key``; None for anything else."""
    if len(blob) < _HEAD.size:
        return None
    version, size = _HEAD.unpack_from(blob)
    return version if size == len(blob) and blob == make_blob(key, version, size) else None


def _open(spec: str, capacity: int | None = None, prefix: str | None = None):
    from kvxfer.store import open_store

    if prefix is None:
        return open_store(spec, capacity_bytes=capacity)
    return open_store(spec, capacity_bytes=capacity, prefix=prefix)


def _ready() -> None:
    print("ready", flush=True)
    sys.stdin.readline()


def main(argv: list[str]) -> None:
    scenario, spec, args = argv[0], argv[1], argv[2:]
    prefix = None
    if "#" in spec:  # redis://host:port/0#prefix: the test's own namespace
        spec, prefix = spec.split("#", 1)
    if scenario == "crash":
        size = int(args[0])
        store = _open(spec, prefix=prefix)
        print("ready", flush=True)
        i = 0
        while True:
            store.put(f"crash-{i}", make_blob(f"crash-{i}", 0, size))
            i += 1
    elif scenario == "hammer":
        seed, ops, capacity = int(args[0]), int(args[1]), int(args[2])
        rng = random.Random(seed)
        bad, hits, puts = [], 0, 0
        with _open(spec, capacity, prefix) as store:
            _ready()
            for i in range(ops):
                key = f"hammer-{rng.randrange(12)}"
                op = rng.random()
                if op < 0.45:
                    puts += store.put(key, make_blob(key, seed * ops + i, rng.choice(
                        (100, 3000, 20000))), replace=rng.random() < 0.5)
                elif op < 0.95:
                    blob = store.get(key)
                    if blob is not None:
                        hits += 1
                        if blob_version(key, blob) is None:
                            bad.append(key)
                else:
                    store.delete(key)
        print(json.dumps({"bad": bad, "hits": hits, "puts": puts}))
    elif scenario == "race":
        who, n = int(args[0]), int(args[1])
        with _open(spec, prefix=prefix) as store:
            _ready()
            won = [i for i in range(n) if store.put(f"race-{i}", make_blob(f"race-{i}", who, 64))]
        print(json.dumps({"won": won}))
    elif scenario == "race_many":
        who, n, batch = int(args[0]), int(args[1]), int(args[2])
        won = []
        with _open(spec, prefix=prefix) as store:
            _ready()
            for start in range(0, n, batch):
                ids = range(start, min(n, start + batch))
                wrote = store.put_many([(f"race-{i}", make_blob(f"race-{i}", who, 64))
                                        for i in ids])
                won += [i for i, w in zip(ids, wrote) if w]
        print(json.dumps({"won": won}))
    elif scenario == "put":
        n, size = int(args[0]), int(args[1])
        with _open(spec, prefix=prefix) as store:
            _ready()
            for i in range(n):
                assert store.put(f"shared-{i}", make_blob(f"shared-{i}", 0, size))
        print("done")
    elif scenario == "get":
        n, size = int(args[0]), int(args[1])
        whole, missing = 0, []
        with _open(spec, prefix=prefix) as store:
            _ready()
            for i in range(n):
                blob = store.get(f"shared-{i}")
                if blob is not None and blob_version(f"shared-{i}", blob) == 0 and \
                        len(blob) == size:
                    whole += 1
                else:
                    missing.append(i)
        print(json.dumps({"whole": whole, "missing": missing}))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
