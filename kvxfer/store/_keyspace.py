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

A batch (``get_many``, ``put_many``, ``contains_many``) is one round trip per server
(``kvxfer/store/_pipeline.py``): per domain, one transaction holds every key's commands
(a put's script and ``SET NX`` in turn; for reads one ``MGET`` and one script that marks
the keys used, in the batch's order), every domain of a server goes out in one write,
and every server's at once. A transaction of several puts runs as the same puts one
after another would, so every guarantee above holds key by key.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import zlib
from typing import Any

from collections.abc import Iterable, Mapping

from kvxfer.store._base import (Store, StoreError, _gather, _gather_puts, _writes,
                                batch_items, batch_keys)
from kvxfer.store._pipeline import Block, BlockReply, exchange

__all__ = ["Keyspace", "KeyspaceStore", "MARKER"]

#: The most keys, and blob bytes, one transaction of a batch holds (a larger batch is
#: several transactions, still in the same round trip): a server queues a transaction
#: whole before it runs it.
_CHUNK_KEYS = 256
_CHUNK_BYTES = 64 << 20

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
#: What a put whose accounting failed leaves in its blob's place until its writer
#: removes it: a miss to every reader.
MARKER = "kvxfer: a put whose accounting failed; never a blob"
_MARKER_BYTES = MARKER.encode()


def _is_marker(blob: bytes | None) -> bool:
    return blob is not None and len(blob) == len(_MARKER_BYTES) and blob == _MARKER_BYTES


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

# KEYS: lru, sizes, bytes, clock, then the blob of each key. ARGV: the keys. _TOUCH of
# each key in turn (so a batch's keys are marked used in its order).
_TOUCH_MANY = """
local lru, sizes, total, clock = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
for i, key in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[4 + i]) == 1 then
    if redis.call('ZSCORE', lru, key) then
      redis.call('ZADD', lru, 'XX', redis.call('INCR', clock), key)
    end
  else
    local s = redis.call('HGET', sizes, key)
    if s then
      redis.call('HDEL', sizes, key)
      redis.call('DECRBY', total, tonumber(s))
    end
    redis.call('ZREM', lru, key)
  end
end
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
                                 int(replace), cap, self.blobs, MARKER)
            pipe.set(bkey, view, nx=True)
            evicted, stored = pipe.execute()
        if int(evicted) == -2:  # the failure path only: the common put stays two commands
            client.execute_command("EVAL", _UNMARK, 1, bkey, MARKER)
        return int(evicted), bool(stored)

    def get(self, client: Any, key: str) -> bytes | None:
        bkey = self.blobs + key
        with client.pipeline(transaction=True) as pipe:
            pipe.get(bkey)
            pipe.execute_command("EVAL", _TOUCH, 5, bkey, *self.meta, key)
            blob, _ = pipe.execute()
        return None if _is_marker(blob) else blob  # (a failed put's, not yet removed)

    def contains(self, client: Any, key: str) -> bool:
        return bool(client.exists(self.blobs + key))

    # -- batches: the commands of one transaction (or block), and what they replied --

    def get_block(self, keys: list[str]) -> Block:
        """``MGET`` of the blobs, then ``_TOUCH_MANY``, in one transaction."""
        bkeys = [self.blobs + k for k in keys]
        return Block([("MGET", *bkeys),
                      ("EVAL", _TOUCH_MANY, 4 + len(keys), *self.meta, *bkeys, *keys)],
                     atomic=True)

    @staticmethod
    def got(replies: list[Any]) -> list[bytes | None]:
        """The blobs a ``get_block`` read (a failed put's marker is a miss).

        Raises:
          ResponseError: a command of the block failed (the touch script, say).
        """
        blobs, touched = replies
        for r in (blobs, touched):
            if isinstance(r, BaseException):
                raise r
        return [None if _is_marker(b) else b for b in blobs]

    def contains_block(self, keys: list[str]) -> Block:
        return Block([("EXISTS", self.blobs + k) for k in keys])

    def put_block(self, items: list[tuple[str, memoryview]], replace: bool,
                  capacity: int | None) -> Block:
        """Each key's ``_PUT`` and ``SET NX`` in turn, in one transaction."""
        cap = -1 if capacity is None else capacity
        commands: list[tuple[Any, ...]] = []
        for key, view in items:
            bkey = self.blobs + key
            commands.append(("EVAL", _PUT, 5, bkey, *self.meta, key, view.nbytes,
                             int(replace), cap, self.blobs, MARKER))
            commands.append(("SET", bkey, view, "NX"))
        return Block(commands, atomic=True)

    def unmark(self, client: Any, key: str) -> None:
        """Removes the marker a put whose accounting failed left under ``key``."""
        client.execute_command("EVAL", _UNMARK, 1, self.blobs + key, MARKER)

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

    def _unreachable(self, domain: int, what: str, e: BaseException, n: int = 1) -> None:
        """A read of ``n`` keys of ``domain`` failed with ``e``: raises, or returns for
        misses."""
        raise self._fail(what, e) from e

    def _unwritable(self, domain: int, what: str, e: BaseException) -> StoreError:
        """A write to ``domain`` failed with ``e``: the error to raise."""
        return self._fail(what, e)

    def _held(self, domain: int) -> bool:
        """Whether ``domain`` is known to be down and not to be tried again yet."""
        return False

    def _reached(self, domain: int) -> None:
        """A command on ``domain`` succeeded."""

    def _refuse(self, domain: int, what: str) -> StoreError:
        """The error of a write to ``domain`` while it is held (``_held``)."""
        return StoreError(f"{self._where}: {what}: domain {domain} is down")

    def _route(self, domain: int) -> tuple[str, Any]:
        """The server ``domain`` lives on: its name and a ``redis.Redis`` client of it
        (one server here; a cluster store looks the domain's slot up)."""
        return "", self._client

    def _lost(self, e: BaseException) -> None:
        """A batch's round trip to a server failed with ``e`` (a connection error)."""

    #: Errors of a block that mean "ask the client's own routing" (a cluster's MOVED).
    _redirects: tuple[type[BaseException], ...] = ()

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
        d, view = self._blob(key, blob)
        cap = self._caps[d]
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
        d, error, blob = self._on_domain(key, "get")
        if error is not None:
            self._unreachable(d, f"cannot read key {key!r}", error)
        self._count(gets=1, hits=blob is not None)
        return blob

    def contains(self, key: str) -> bool:
        """Whether a blob is stored under ``key`` (not marking it used)."""
        d, error, found = self._on_domain(key, "contains")
        if error is not None:
            self._unreachable(d, f"cannot read key {key!r}", error)
            return False
        return found

    def delete(self, key: str) -> bool:
        """Removes ``key``; returns whether it was there."""
        d, error, found = self._on_domain(key, "delete")
        if error is not None:
            raise self._unwritable(d, f"cannot delete key {key!r}", error) from error
        return found

    def _on_domain(self, key: str, op: str) -> tuple[int, BaseException | None, Any]:
        """``op`` of ``key`` on its domain's space: ``(domain, None, result)``, or
        ``(domain, the connection error, None)`` when the domain's server is out of
        reach (the caller says what that means for its call)."""
        d = self._domain(key)
        self._check_open()
        try:
            out = getattr(self._spaces[d], op)(self._client, key)
        except self._errors as e:
            return d, e, None
        self._reached(d)
        return d, None, out

    # -- batches --------------------------------------------------------------------

    def _blob(self, key: str, blob: Any) -> tuple[int, memoryview]:
        """``key``'s domain and ``blob`` as bytes, checked against the domain's share."""
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
        return d, view

    def _run(self, plan: dict[int, list[Block]]
             ) -> dict[int, list[BlockReply] | BaseException]:
        """Each domain's blocks, every server's in one round trip: per domain, its
        blocks' replies or the error that kept them from running (no route to its
        server, a connection lost)."""
        out: dict[int, list[BlockReply] | BaseException] = {}
        servers: dict[str, tuple[Any, list[int]]] = {}
        for d in plan:
            try:
                name, client = self._route(d)
            except self._errors as e:
                out[d] = e
                continue
            servers.setdefault(name, (client, []))[1].append(d)
        work = [(client, [b for d in ds for b in plan[d]]) for client, ds in servers.values()]
        replies = exchange(work)
        lost = next((r for r in replies if isinstance(r, BaseException)), None)
        if lost is not None:
            self._lost(lost)
        for (_, ds), got in zip(servers.values(), replies):
            at = 0
            for d in ds:
                n = len(plan[d])
                out[d] = got if isinstance(got, BaseException) else got[at:at + n]
                at += n
        return out

    def _by_domain(self, keys: Iterable[str]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for k in keys:
            out.setdefault(self._domain(k), []).append(k)
        return out

    @staticmethod
    def _chunks(keys: list[str]) -> list[list[str]]:
        return [keys[i:i + _CHUNK_KEYS] for i in range(0, len(keys), _CHUNK_KEYS)]

    @staticmethod
    def _names(keys: list[str]) -> str:
        return repr(keys[0]) if len(keys) == 1 else f"{keys[0]!r} and {len(keys) - 1} more"

    def _read_failed(self, d: int, keys: list[str], e: BaseException,
                     errors: dict[str, StoreError]) -> None:
        """A batch's read of ``keys`` (domain ``d``) failed: misses (an outage of a
        cluster node, counted and logged) or each key's ``StoreError``."""
        try:
            self._unreachable(d, f"cannot read keys {self._names(keys)}", e, len(keys))
        except StoreError as err:
            errors.update(dict.fromkeys(keys, err))

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        """The blob (or None) of each key, in order, each marked recently used (see
        ``Store.get_many``): one transaction per domain, one round trip per server.

        A key given twice is read once. Keys of a domain that cannot be read are
        ``StoreBatchError``s here (misses in ``RedisClusterStore`` when their node is
        down), never an error that loses the other keys.
        """
        keys = batch_keys(keys)
        self._check_open()
        domains = self._by_domain(dict.fromkeys(keys))
        got: dict[str, bytes | None] = {}
        errors: dict[str, StoreError] = {}
        plan: dict[int, list[Block]] = {}
        for d, ks in domains.items():
            if self._held(d):  # (only a cluster store holds domains: it counts read_errors)
                self._count(gets=len(ks), read_errors=len(ks))
                continue
            plan[d] = [self._spaces[d].get_block(c) for c in self._chunks(ks)]
        for d, replies in self._run(plan).items():
            ks = domains[d]
            if isinstance(replies, BaseException):
                self._read_failed(d, ks, replies, errors)
                self._count(gets=len(ks) - sum(k in errors for k in ks))
                continue
            if any(isinstance(r.error, self._redirects) for r in replies):
                self._one_by_one(ks, self.get, got, errors)  # the client's routing
                continue
            try:
                blobs = [b for r in replies for b in self._replied(r, self._spaces[d].got)]
            except self._errors as e:
                self._read_failed(d, ks, e, errors)
                self._count(gets=len(ks) - sum(k in errors for k in ks))
                continue
            self._reached(d)
            got.update(zip(ks, blobs))
            self._count(gets=len(ks), hits=sum(b is not None for b in blobs))
        return _gather("get_many", keys, got, errors)

    @staticmethod
    def _replied(reply: BlockReply, parse: Any) -> Any:
        if reply.error is not None:
            raise reply.error
        return parse(reply.replies)

    @staticmethod
    def _one_by_one(keys: list[str], call: Any, got: dict[str, Any],
                    errors: dict[str, StoreError]) -> None:
        for k in keys:
            try:
                got[k] = call(k)
            except StoreError as e:
                errors[k] = e

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        """Whether a blob is stored under each key, in order (not marking them used):
        one round trip per server."""
        keys = batch_keys(keys)
        self._check_open()
        domains = self._by_domain(dict.fromkeys(keys))
        got: dict[str, bool] = {}
        errors: dict[str, StoreError] = {}
        plan: dict[int, list[Block]] = {}
        for d, ks in domains.items():
            if self._held(d):
                self._count(read_errors=len(ks))
                got.update(dict.fromkeys(ks, False))
                continue
            plan[d] = [self._spaces[d].contains_block(c) for c in self._chunks(ks)]
        for d, replies in self._run(plan).items():
            ks = domains[d]
            if not isinstance(replies, BaseException) and \
                    any(isinstance(r.error, self._redirects) for r in replies):
                self._one_by_one(ks, self.contains, got, errors)
                continue
            try:
                if isinstance(replies, BaseException):
                    raise replies
                found = [r for b in replies for r in self._replied(b, list)]
                for r in found:
                    if isinstance(r, BaseException):
                        raise r
            except self._errors as e:
                self._read_failed(d, ks, e, errors)
                got.update((k, False) for k in ks if k not in errors)
                continue
            self._reached(d)
            got.update((k, bool(r)) for k, r in zip(ks, found))
        return _gather("contains_many", keys, got, errors)

    def put_many(self, items: Iterable[tuple[str, bytes]] | Mapping[str, bytes], *,
                 replace: bool = False) -> list[bool]:
        """``put`` of each ``(key, blob)``, with its semantics per key (see
        ``Store.put_many``): one transaction per domain, one round trip per server.

        Every key and blob is checked (and every blob against its domain's share of
        the capacity) before any is written.

        Raises:
          ValueError: a blob is larger than the capacity (its domain's share).
          StoreBatchError: the keys of some domain could not be written (``results``
            holds the others').
        """
        pairs = batch_items(items)
        order = _writes(pairs, replace)
        domains: dict[int, list[tuple[str, memoryview]]] = {}
        for k, blob in order.items():
            d, view = self._blob(k, blob)
            domains.setdefault(d, []).append((k, view))
        self._check_open()
        done: dict[str, bool] = {}
        errors: dict[str, StoreError] = {}
        plan: dict[int, list[Block]] = {}
        for d, kv in domains.items():
            if self._held(d):
                err = self._refuse(d, f"cannot write keys {self._names([k for k, _ in kv])}")
                errors.update((k, err) for k, _ in kv)
                continue
            plan[d] = [self._spaces[d].put_block(c, replace, self._caps[d])
                       for c in _put_chunks(kv)]
        for d, replies in self._run(plan).items():
            kv = domains[d]
            ks = [k for k, _ in kv]
            if isinstance(replies, BaseException):
                err = self._unwritable(d, f"cannot write keys {self._names(ks)}", replies)
                errors.update(dict.fromkeys(ks, err))
                continue
            if any(isinstance(r.error, self._redirects) for r in replies):
                views = dict(kv)
                self._one_by_one(ks, lambda k: self.put(k, views[k], replace=replace),
                                 done, errors)
                continue
            self._put_replies(d, kv, replies, done, errors)
        return _gather_puts(pairs, done, errors, replace)

    def _put_replies(self, d: int, kv: list[tuple[str, memoryview]],
                     replies: list[BlockReply], done: dict[str, bool],
                     errors: dict[str, StoreError]) -> None:
        """What each put of domain ``d`` did, from its transactions' replies."""
        space = self._spaces[d]
        flat: list[Any] = []
        chunks = _put_chunks(kv)
        for chunk, r in zip(chunks, replies):
            flat += [r.error] * (2 * len(chunk)) if r.error is not None else r.replies
        evictions, written, reached = 0, 0, False
        for i, (key, _) in enumerate(kv):
            evicted, stored = flat[2 * i], flat[2 * i + 1]
            failed = next((r for r in (evicted, stored) if isinstance(r, BaseException)), None)
            if failed is not None:
                errors[key] = self._unwritable(d, f"cannot write key {key!r}", failed)
                continue
            reached = True
            if int(evicted) == -2:
                try:
                    space.unmark(self._client, key)
                except self._errors:
                    pass  # a marker is a miss to every reader; the next put replaces it
                errors[key] = StoreError(
                    f"{self._where}: cannot write key {key!r}: its byte counter "
                    f"{space.meta[2]!r} is not an integer (another client overwrote it); "
                    "nothing was written")
                continue
            done[key] = stored is not None and not isinstance(stored, BaseException)
            evictions += max(0, int(evicted))
            written += 1
        if reached:
            self._reached(d)
        self._count(puts=written, evictions=evictions)

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


def _put_chunks(kv: list[tuple[str, memoryview]]) -> list[list[tuple[str, memoryview]]]:
    """``kv`` in transactions of at most ``_CHUNK_KEYS`` keys and about ``_CHUNK_BYTES``."""
    out: list[list[tuple[str, memoryview]]] = []
    size = 0
    for item in kv:
        if not out or len(out[-1]) == _CHUNK_KEYS or size + item[1].nbytes > _CHUNK_BYTES:
            out.append([])
            size = 0
        out[-1].append(item)
        size += item[1].nbytes
    return out
