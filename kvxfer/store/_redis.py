"""``RedisStore``: page blobs in Redis or Valkey, shared by serving processes on many hosts.

Under a prefix ``P`` the store keeps (``{P}`` is the prefix in braces, so stores of
different prefixes never share a key, nested prefixes such as ``kv:`` and ``kv:b:``
included, and a store's keys form one Redis Cluster hash slot):

* ``{P}b:KEY``: the blob (a Redis string);
* ``{P}m:lru``: a sorted set of keys by last use, scored from ``{P}m:clock`` (a
  counter every put and hit increments, so recency is one order across every client,
  with no clock skew between hosts);
* ``{P}m:sizes``: a hash of each key's blob size, and ``{P}m:bytes``: their sum.

A put is one ``MULTI``/``EXEC`` transaction: a Lua script that does the accounting
(and, past the capacity, deletes the least recently used blobs) followed by ``SET NX``
(a replacing put's script deletes the old blob once its accounting succeeded). Redis
does not roll a transaction back, so an accounting step that fails (a counter another
client overwrote) leaves a marker in the blob's place that makes the ``SET NX`` write
nothing, and a last script removes the marker: an error, and no blob unaccounted. A hit is one transaction too: ``GET`` and a script
that marks the key used. Redis runs a transaction whole, without interleaving
another client's commands, so under any number of concurrent clients exactly one
put-if-absent of a key wins, the byte count is exact and eviction takes the least
recently used blob of the whole store; the blob never passes through Lua (no extra
copy on the server).

Why not the server's ``maxmemory-policy``: it is sampled, approximate LRU over every
key of the server (other applications' too, and this store's own bookkeeping), and
a shared server's configuration is seldom the application's to set. It is still the
right tool for a server dedicated to kvxfer: ``capacity_bytes=None`` leaves eviction
to the server (``maxmemory`` with ``allkeys-lru``), and a hit on a key the server
evicted removes its bookkeeping. With a capacity, give the server room for it and
``maxmemory-policy noeviction`` (or any ``volatile-*`` policy: kvxfer sets no TTLs).

Keys of the store live in one Redis database and are touched from scripts, so the
store needs a standalone server (or a primary with replicas), not Redis Cluster.
"""

from __future__ import annotations

import threading
import urllib.parse
from typing import Any

from kvxfer._check import check_int
from kvxfer.store._base import Store, StoreError

__all__ = ["RedisStore", "INSTALL_HINT", "URL_SCHEMES"]

#: What to install when redis-py is missing.
INSTALL_HINT = "pip install 'kvxfer[redis]'"
#: The URL schemes redis-py connects to.
URL_SCHEMES = ("redis", "rediss", "unix")

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


def _redact(url: str) -> str:
    """``url`` without its password (it goes into error messages)."""
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rsplit("@", 1)[1]
        user = f"{parts.username}:***@" if parts.username else ":***@"
        return urllib.parse.urlunsplit(parts._replace(netloc=user + netloc))
    except ValueError:
        return url


def check_url(url: str) -> str:
    """``url`` if it is a Redis URL redis-py can connect to (``redis://HOST:PORT[/DB]``,
    ``rediss://``, ``unix://PATH``).

    Raises:
      ValueError: another scheme, a port that is not a number, a database that is not
        an integer.

    Example:
        >>> check_url("redis://127.0.0.1:6379/0")
        'redis://127.0.0.1:6379/0'
        >>> try:
        ...     check_url("redis://host:port")
        ... except ValueError as e:
        ...     print(str(e).split(". Got ")[1])
        'redis://host:port': the port is not a number
    """
    if not isinstance(url, str):
        raise TypeError(f"Expected a Redis URL str. Got {url!r} of type {type(url).__name__}")
    why = None
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in URL_SCHEMES:
        why = f"the scheme must be one of {', '.join(s + '://' for s in URL_SCHEMES)}"
    elif parts.scheme != "unix":
        try:
            parts.port
        except ValueError:
            why = "the port is not a number"
        else:
            db = parts.path.strip("/")
            if not parts.hostname:
                why = "no host"
            elif db and not db.isdigit():
                why = f"the database {db!r} is not an integer"
    elif not parts.path:
        why = "no socket path"
    if why:
        raise ValueError(f"Expected a Redis URL redis://HOST:PORT[/DB]. Got "
                         f"{_redact(url)!r}: {why}")
    return url


class RedisStore(Store):
    """Page blobs in a Redis or Valkey server, shared by every process that opens it.

    Args:
      url: the server (``redis://HOST:PORT[/DB]``, ``rediss://`` for TLS,
        ``unix://PATH``); a password may be given in it.
      prefix: the namespace of this store's keys on the server (stores with different
        prefixes share nothing, nested ones too); no braces.
      capacity_bytes: the most blob bytes the store holds, kept exactly across every
        client with LRU eviction; None leaves eviction to the server's
        ``maxmemory-policy``.
      timeout_s: socket timeout for connecting and for each command.

    Raises:
      ImportError: redis-py is not installed (``pip install 'kvxfer[redis]'``).
      StoreError: the server does not answer (naming the URL, password hidden).

    Example (with a server at ``redis://127.0.0.1:6379``)::

        store = RedisStore("redis://127.0.0.1:6379/0", capacity_bytes=8 << 30)
        store.put("geo/page-1", blob)    # True: this process's put won
        store.get("geo/page-1")          # the blob, from any host
    """

    name = "redis"

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "kvxfer:",
                 capacity_bytes: int | None = None, *, timeout_s: float = 30.0):
        self.url = check_url(url)
        try:
            import redis
        except ImportError as e:
            raise ImportError(f"RedisStore needs the redis package: {INSTALL_HINT}") from e
        if not isinstance(prefix, str):
            raise TypeError(f"Expected a str prefix. Got {prefix!r} of type "
                            f"{type(prefix).__name__}")
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"prefix={prefix!r}: braces are kept for framing the prefix "
                             "(the store's keys are {prefix}...); choose one without them")
        self.prefix = prefix
        root = "{" + prefix + "}"
        self.capacity_bytes = None if capacity_bytes is None else \
            check_int(capacity_bytes, "capacity_bytes", minimum=1)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
                not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be a number of seconds > 0")
        self._errors = (redis.exceptions.RedisError, OSError)
        self._blobs = root + "b:"
        self._meta = [root + "m:" + k for k in ("lru", "sizes", "bytes", "clock")]
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("puts", "gets", "hits", "evictions"), 0)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s)
        self._closed = False
        try:
            self._client.ping()
        except self._errors as e:
            self._client.close()
            raise StoreError(f"redis store at {_redact(url)}: cannot connect: {e}") from e

    def __repr__(self) -> str:
        return (f"RedisStore({_redact(self.url)!r}, prefix={self.prefix!r}, "
                f"capacity_bytes={self.capacity_bytes!r})")

    def _blob_key(self, key: str) -> str:
        if not isinstance(key, str):
            raise TypeError(f"Expected a str key. Got {key!r} of type {type(key).__name__}")
        if not key:
            raise ValueError("Expected a non-empty key. Got ''")
        return self._blobs + key

    def _fail(self, what: str, e: BaseException) -> StoreError:
        return StoreError(f"redis store at {_redact(self.url)}: {what}: {e}")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"redis store at {_redact(self.url)} is closed")

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    # -- the Store interface ------------------------------------------------------

    def put(self, key: str, blob: bytes, *, replace: bool = False) -> bool:
        """Stores ``blob`` under ``key`` (see ``Store.put``); atomic across all clients."""
        bkey = self._blob_key(key)
        try:
            view = memoryview(blob).cast("B")
        except TypeError:
            raise TypeError(f"Expected a bytes-like blob. Got {type(blob).__name__}") from None
        if self.capacity_bytes is not None and view.nbytes > self.capacity_bytes:
            raise ValueError(f"blob of {view.nbytes} bytes for key {key!r} is more than "
                             f"capacity_bytes={self.capacity_bytes}")
        self._check_open()
        cap = -1 if self.capacity_bytes is None else self.capacity_bytes
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.eval(_PUT, 5, bkey, *self._meta, key, view.nbytes, int(replace), cap,
                          self._blobs, _MARK)
                pipe.set(bkey, view, nx=True)
                pipe.eval(_UNMARK, 1, bkey, _MARK)
                evicted, stored, _ = pipe.execute()
        except self._errors as e:
            raise self._fail(f"cannot write key {key!r}", e) from e
        if int(evicted) == -2:
            raise StoreError(f"redis store at {_redact(self.url)}: cannot write key {key!r}: "
                             f"its byte counter {self._meta[2]!r} is not an integer (another "
                             "client overwrote it); nothing was written")
        self._count(puts=1, evictions=max(0, int(evicted)))
        return bool(stored)

    def get(self, key: str) -> bytes | None:
        """The whole blob under ``key`` (and marks it recently used), or None."""
        bkey = self._blob_key(key)
        self._check_open()
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.get(bkey)
                pipe.eval(_TOUCH, 5, bkey, *self._meta, key)
                blob, _ = pipe.execute()
        except self._errors as e:
            raise self._fail(f"cannot read key {key!r}", e) from e
        self._count(gets=1, hits=blob is not None)
        return blob

    def contains(self, key: str) -> bool:
        """Whether a blob is stored under ``key`` (not marking it used)."""
        bkey = self._blob_key(key)
        self._check_open()
        try:
            return bool(self._client.exists(bkey))
        except self._errors as e:
            raise self._fail(f"cannot read key {key!r}", e) from e

    def delete(self, key: str) -> bool:
        """Removes ``key``; returns whether it was there."""
        bkey = self._blob_key(key)
        self._check_open()
        try:
            return bool(self._client.eval(_DELETE, 4, bkey, *self._meta[:3], key))
        except self._errors as e:
            raise self._fail(f"cannot delete key {key!r}", e) from e

    def keys(self) -> list[str]:
        """The keys of the store, least recently used first."""
        self._check_open()
        try:
            return [k.decode("utf-8") for k in self._client.zrange(self._meta[0], 0, -1)]
        except self._errors as e:
            raise self._fail("cannot list keys", e) from e

    def clear(self) -> int:
        """Removes every key under the prefix (blobs and bookkeeping); returns the
        number of blobs removed. Not atomic: clear a store nobody else is using."""
        self._check_open()
        root = self._blobs[:-2]
        glob = "".join("\\" + c if c in "*?[]\\" else c for c in root) + "*"
        blobs = 0
        try:
            batch: list[bytes] = []
            for k in self._client.scan_iter(match=glob, count=1000):
                batch.append(k)
                if len(batch) == 1000:
                    self._client.delete(*batch)
                    batch.clear()
                blobs += k.startswith(self._blobs.encode())
            if batch:
                self._client.delete(*batch)
        except self._errors as e:
            raise self._fail("cannot clear", e) from e
        return blobs

    def stats(self) -> dict[str, Any]:
        """Counters (see ``Store.stats``): ``blobs`` and ``bytes`` of the whole shared
        store; ``puts``, ``gets``, ``hits`` and ``evictions`` of this client."""
        self._check_open()
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.zcard(self._meta[0])
                pipe.get(self._meta[2])
                blobs, used = pipe.execute()
        except self._errors as e:
            raise self._fail("cannot read stats", e) from e
        with self._lock:
            counts = dict(self._counts)
        return {"name": self.name, "url": _redact(self.url), "prefix": self.prefix,
                "blobs": int(blobs), "bytes": int(used or 0),
                "capacity_bytes": self.capacity_bytes, **counts}

    def close(self) -> None:
        """Closes this client's connections (the blobs stay on the server)."""
        if not self._closed:
            self._closed = True
            self._client.close()
