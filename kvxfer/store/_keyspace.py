"""Accounting domains: a Redis hash tag's worth of page blobs with exact LRU
bookkeeping, and the ``Store`` over one or many of them.

A domain under the hash tag ``R`` (``{P}`` for a ``RedisStore`` of prefix ``P``,
``{P:d}`` for domain ``d`` of a ``RedisClusterStore``) keeps:

* ``Rb:KEY``: the blob (a Redis string);
* ``Rm:lru``: a sorted set of keys by last use, scored from ``Rm:clock`` (a counter
  every put and hit increments, so recency is one order across every client, with no
  clock skew between hosts);
* ``Rm:sizes``: a hash of each key's blob size, and ``Rm:bytes``: their sum.

Every key of a domain shares its hash tag, so a domain is one Redis Cluster hash slot
and the scripts below (which touch blob keys they are not given, the evicted ones)
and the transactions around them run on one node.

A put is one ``MULTI``/``EXEC`` transaction: a Lua script that does the accounting
(and, past the domain's capacity, deletes its least recently used blobs) followed by
``SET NX`` (a replacing put's script deletes the old blob once its accounting
succeeded). Redis does not roll a transaction back, so an accounting step that fails
(a counter another client overwrote) leaves a marker in the blob's place that makes
the ``SET NX`` write nothing; the writer then removes the marker (a read meanwhile
sees a miss), so a put that fails costs an error, and no
blob unaccounted. A hit is one transaction too: ``GET`` and a script that marks the
key used. Redis runs a transaction whole, without interleaving another client's
commands, so under any number of concurrent clients exactly one put-if-absent of a key
wins, the byte count is exact and eviction takes the least recently used blob of the
domain; the blob never passes through Lua (no extra copy on the server).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import zlib
from typing import Any

from kvxfer.store._base import Store, StoreError

__all__ = ["Keyspace", "KeyspaceStore"]

# KEYS: blob, lru, sizes, bytes, clock. ARGV: key, size, replace (0/1), capacity (-1:
# none), blob-key prefix, marker. Returns -1 when the key is there and not replaced (the
# SET NX that follows in the transaction then writes nothing), -2 when the accounting
# failed (the marker then stands in the blob's place), else the number evicted.
_PUT = """
local blob, lru, sizes, total, clock = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local key, size, cap = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4])
local exists = redis.call('EXISTS', blob) == 1
if ARGV[3] ~= '1' and exists then return -1 end
local old = tonumber(redis.call('HGET', sizes, key) or '0')
local ok, used = pcall(redis.call, 'INCRBY', total, size - old)
if not ok then
  if not exists then redis.call('SET', blob, ARGV[6]) end
  return -2
end
if exists then redis.call('DEL', blob) end
redis.call('HSET', sizes, key, size)
redis.call('ZADD', lru, redis.call('INCR', clock), key)
local evicted = 0
if cap >= 0 then
  while used > cap do
    local oldest = redis.call('ZRANGE', lru, 0, 0)[1]
    if not oldest or oldest == key then break end
    local s = tonumber(redis.call('HGET', sizes, oldest) or '0')
    redis.call('DEL', ARGV[5] .. oldest)
    redis.call('ZREM', lru, oldest)
    redis.call('HDEL', sizes, oldest)
    used = redis.call('DECRBY', total, s)
    evicted = evicted + 1
  end
end
return evicted
"""

# KEYS: blob. ARGV: the marker _PUT leaves when its accounting failed. Removes it.
_UNMARK = """
if redis.call('STRLEN', KEYS[1]) == string.len(ARGV[1]) and
    redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
return 0
"""
_MARK = "kvxfer: a put whose accounting failed; never a blob"
_MARK_BYTES = _MARK.encode()

# KEYS: blob, lru, sizes, bytes, clock. ARGV: key. Marks a present blob used; drops the
# bookkeeping of one that is gone (deleted or evicted by the server).
_TOUCH = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('ZSCORE', KEYS[2], ARGV[1]) then
    redis.call('ZADD', KEYS[2], 'XX', redis.call('INCR', KEYS[5]), ARGV[1])
  end
  return 1
end
local s = redis.call('HGET', KEYS[3], ARGV[1])
if s then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('DECRBY', KEYS[4], tonumber(s))
end
redis.call('ZREM', KEYS[2], ARGV[1])
return 0
"""

# KEYS: blob, lru, sizes, bytes. ARGV: key. Returns whether the blob was there.
_DELETE = """
local n = redis.call('DEL', KEYS[1])
local s = redis.call('HGET', KEYS[3], ARGV[1])
if s then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('DECRBY', KEYS[4], tonumber(s))
end
redis.call('ZREM', KEYS[2], ARGV[1])
return n
"""


@dataclasses.dataclass(frozen=True, slots=True)
class Keyspace:
    """One accounting domain: the keys under the hash tag ``root`` and the
    transactions on them. ``client`` is a ``redis.Redis`` or ``redis.cluster.RedisCluster``;
    its errors pass through."""

    root: str

    @property
    def blobs(self) -> str:
        return self.root + "b:"

    @property
    def meta(self) -> tuple[str, str, str, str]:
        """The ``lru``, ``sizes``, ``bytes`` and ``clock`` keys."""
        return tuple(self.root + "m:" + k for k in ("lru", "sizes", "bytes", "clock"))

    def put(self, client: Any, key: str, view: memoryview, replace: bool,
            capacity: int | None) -> tuple[int, bool]:
        """The number evicted (-2: the byte counter is not an integer, nothing written)
        and whether the blob was written."""
        bkey = self.blobs + key
        cap = -1 if capacity is None else capacity
        with client.pipeline(transaction=True) as pipe:
            # EVAL by name: redis-py's cluster pipeline has no eval(), and routes this.
            pipe.execute_command("EVAL", _PUT, 5, bkey, *self.meta, key, view.nbytes,
                                 int(replace), cap, self.blobs, _MARK)
            pipe.set(bkey, view, nx=True)
            evicted, stored = pipe.execute()
        if int(evicted) == -2:  # the failure path only: the common put stays two commands
            client.execute_command("EVAL", _UNMARK, 1, bkey, _MARK)
        return int(evicted), bool(stored)

    def get(self, client: Any, key: str) -> bytes | None:
        bkey = self.blobs + key
        with client.pipeline(transaction=True) as pipe:
            pipe.get(bkey)
            pipe.execute_command("EVAL", _TOUCH, 5, bkey, *self.meta, key)
            blob, _ = pipe.execute()
        if blob is not None and len(blob) == len(_MARK_BYTES) and blob == _MARK_BYTES:
            return None  # a failed put's marker, before its writer removed it
        return blob

    def contains(self, client: Any, key: str) -> bool:
        return bool(client.exists(self.blobs + key))

    def delete(self, client: Any, key: str) -> bool:
        return bool(client.execute_command("EVAL", _DELETE, 4, self.blobs + key,
                                           *self.meta[:3], key))

    def keys(self, client: Any) -> list[str]:
        """Least recently used first."""
        return [k.decode("utf-8") for k in client.zrange(self.meta[0], 0, -1)]

    def usage(self, client: Any) -> tuple[int, int]:
        """Blobs and bytes, read together."""
        with client.pipeline(transaction=True) as pipe:
            pipe.zcard(self.meta[0])
            pipe.get(self.meta[2])
            blobs, used = pipe.execute()
        return int(blobs), int(used or 0)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class KeyspaceStore(Store):
    """The ``Store`` interface over accounting domains of one Redis client; a key's
    domain is ``crc32(key) % len(domains)``, and the capacity is split evenly over the
    domains (so the store holds at most ``capacity_bytes`` in all, each domain its share).

    Subclasses connect, then call ``_setup``; they choose what an unreachable domain
    means for reads (``_unreachable``: here a ``StoreError``).
    """

    _COUNTERS: tuple[str, ...] = ("puts", "gets", "hits", "evictions")

    def _setup(self, client: Any, roots: list[str], capacity_bytes: int | None,
               errors: tuple[type[BaseException], ...], where: str) -> None:
        self._client, self._errors, self._where = client, errors, where
        self._spaces = tuple(Keyspace(r) for r in roots)
        n = len(roots)
        self._caps: tuple[int | None, ...] = (None,) * n if capacity_bytes is None else \
            tuple(capacity_bytes // n + (i < capacity_bytes % n) for i in range(n))
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self._COUNTERS, 0)
        self._closed = False

    def _domain(self, key: str) -> int:
        """The index of ``key``'s domain (checking the key)."""
        if not isinstance(key, str):
            raise TypeError(f"Expected a str key. Got {key!r} of type {type(key).__name__}")
        if not key:
            raise ValueError("Expected a non-empty key. Got ''")
        n = len(self._spaces)
        return 0 if n == 1 else zlib.crc32(key.encode("utf-8", "surrogatepass")) % n

    def _fail(self, what: str, e: BaseException) -> StoreError:
        return StoreError(f"{self._where}: {what}: {e}")

    def _unreachable(self, domain: int, what: str, e: BaseException) -> None:
        """A read of ``domain`` failed with ``e``: raises, or returns for a miss."""
        raise self._fail(what, e) from e

    def _unwritable(self, domain: int, what: str, e: BaseException) -> StoreError:
        """A write to ``domain`` failed with ``e``: the error to raise."""
        return self._fail(what, e)

    def _held(self, domain: int) -> bool:
        """Whether ``domain`` is known to be down and not to be tried again yet."""
        return False

    def _reached(self, domain: int) -> None:
        """A command on ``domain`` succeeded."""

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self._where} is closed")

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    # -- the Store interface ------------------------------------------------------

    def put(self, key: str, blob: bytes, *, replace: bool = False) -> bool:
        """Stores ``blob`` under ``key`` (see ``Store.put``); atomic across all clients."""
        d = self._domain(key)
        try:
            view = memoryview(blob).cast("B")
        except TypeError:
            raise TypeError(f"Expected a bytes-like blob. Got {type(blob).__name__}") from None
        cap = self._caps[d]
        if cap is not None and view.nbytes > cap:
            if len(self._spaces) == 1:
                raise ValueError(f"blob of {view.nbytes} bytes for key {key!r} is more than "
                                 f"capacity_bytes={cap}")
            raise ValueError(f"blob of {view.nbytes} bytes for key {key!r} is more than "
                             f"its domain's share of the capacity ({cap} bytes: "
                             f"capacity_bytes={sum(self._caps)} over "
                             f"{len(self._spaces)} domains)")
        self._check_open()
        space = self._spaces[d]
        try:
            evicted, stored = space.put(self._client, key, view, replace, cap)
        except self._errors as e:
            raise self._unwritable(d, f"cannot write key {key!r}", e) from e
        if evicted == -2:
            raise StoreError(f"{self._where}: cannot write key {key!r}: its byte counter "
                             f"{space.meta[2]!r} is not an integer (another client "
                             "overwrote it); nothing was written")
        self._reached(d)
        self._count(puts=1, evictions=max(0, evicted))
        return stored

    def get(self, key: str) -> bytes | None:
        """The whole blob under ``key`` (and marks it recently used), or None."""
        d = self._domain(key)
        self._check_open()
        try:
            blob = self._spaces[d].get(self._client, key)
        except self._errors as e:
            self._unreachable(d, f"cannot read key {key!r}", e)
            self._count(gets=1)
            return None
        self._reached(d)
        self._count(gets=1, hits=blob is not None)
        return blob

    def contains(self, key: str) -> bool:
        """Whether a blob is stored under ``key`` (not marking it used)."""
        d = self._domain(key)
        self._check_open()
        try:
            found = self._spaces[d].contains(self._client, key)
        except self._errors as e:
            self._unreachable(d, f"cannot read key {key!r}", e)
            return False
        self._reached(d)
        return found

    def delete(self, key: str) -> bool:
        """Removes ``key``; returns whether it was there."""
        d = self._domain(key)
        self._check_open()
        try:
            found = self._spaces[d].delete(self._client, key)
        except self._errors as e:
            raise self._unwritable(d, f"cannot delete key {key!r}", e) from e
        self._reached(d)
        return found

    def keys(self) -> list[str]:
        """The keys of the store, least recently used first (domain by domain, when
        there are several: recency is kept within each)."""
        self._check_open()
        out: list[str] = []
        for d, space in enumerate(self._spaces):
            if self._held(d):
                continue
            try:
                out += space.keys(self._client)
            except self._errors as e:
                self._unreachable(d, "cannot list keys", e)
        return out

    def clear(self) -> int:
        """Removes every key under the prefix (blobs and bookkeeping); returns the
        number of blobs removed. Not atomic: clear a store nobody else is using."""
        self._check_open()
        roots = {s.root.encode(): s.blobs.encode() for s in self._spaces}
        glob = _glob_escape(os.path.commonprefix([s.root for s in self._spaces])) + "*"
        blobs = 0
        try:
            batches: dict[bytes, list[bytes]] = {}
            for k in self._client.scan_iter(match=glob, count=1000):
                root = k[:k.find(b"}") + 1]
                if root not in roots:  # another store's, whose prefix extends this one's
                    continue
                batch = batches.setdefault(root, [])
                batch.append(k)
                if len(batch) == 1000:  # one domain's keys: one slot, one DEL
                    self._client.delete(*batch)
                    batch.clear()
                blobs += k.startswith(roots[root])
            for batch in batches.values():
                if batch:
                    self._client.delete(*batch)
        except self._errors as e:
            raise self._fail("cannot clear", e) from e
        return blobs

    def _usage(self) -> tuple[int, int, int]:
        """Blobs and bytes of the reachable domains, and how many were not."""
        blobs = used = down = 0
        for d, space in enumerate(self._spaces):
            if self._held(d):
                down += 1
                continue
            try:
                b, u = space.usage(self._client)
            except self._errors as e:
                self._unreachable(d, "cannot read stats", e)
                down += 1
                continue
            blobs, used = blobs + b, used + u
        return blobs, used, down

    def close(self) -> None:
        """Closes this client's connections (the blobs stay on the server)."""
        if not self._closed:
            self._closed = True
            self._client.close()
