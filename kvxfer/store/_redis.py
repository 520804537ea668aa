"""``RedisStore``: page blobs in Redis or Valkey, shared by serving processes on many hosts.

Under a prefix ``P`` the store is one accounting domain (``kvxfer/store/_keyspace.py``)
under the hash tag ``{P}``: blobs ``{P}b:KEY``, and ``{P}m:lru``, ``{P}m:sizes``,
``{P}m:bytes`` and ``{P}m:clock`` for an exact LRU of the whole store. ``{P}`` is the
prefix in braces, so stores of different prefixes never share a key, nested prefixes
such as ``kv:`` and ``kv:b:`` included. Puts and hits are ``MULTI``/``EXEC``
transactions around Lua scripts, so under any number of concurrent clients exactly one
put-if-absent of a key wins, the byte count is exact and eviction takes the least
recently used blob of the whole store. A batch (``get_many``, ``put_many``,
``contains_many``) is one round trip: the same transactions, one per batch, packed
into one write.

Why not the server's ``maxmemory-policy``: it is sampled, approximate LRU over every
key of the server (other applications' too, and this store's own bookkeeping), and
a shared server's configuration is seldom the application's to set. It is still the
right tool for a server dedicated to kvxfer: ``capacity_bytes=None`` leaves eviction
to the server (``maxmemory`` with ``allkeys-lru``), and a hit on a key the server
evicted removes its bookkeeping. With a capacity, give the server room for it and
``maxmemory-policy noeviction`` (or any ``volatile-*`` policy: kvxfer sets no TTLs).

Keys of the store live in one Redis database and are touched from scripts, so the
store needs a standalone server (or a primary with replicas); for Redis Cluster see
``RedisClusterStore``.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from kvxfer._check import check_int
from kvxfer.store._base import StoreError
from kvxfer.store._keyspace_store import KeyspaceStore

__all__ = ["RedisStore", "INSTALL_HINT", "URL_SCHEMES"]

#: What to install when redis-py is missing.
INSTALL_HINT = "pip install 'kvxfer[redis]'"
#: The URL schemes redis-py connects to.
URL_SCHEMES = ("redis", "rediss", "unix")

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


def check_prefix(prefix: str) -> str:
    """``prefix`` if it can name a store's keys (a str without braces)."""
    if not isinstance(prefix, str):
        raise TypeError(f"Expected a str prefix. Got {prefix!r} of type "
                        f"{type(prefix).__name__}")
    if "{" in prefix or "}" in prefix:
        raise ValueError(f"prefix={prefix!r}: braces are kept for framing the prefix "
                         "(the store's keys are {prefix}...); choose one without them")
    return prefix


def check_timeout_s(timeout_s: float) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
            not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be a number of seconds > 0")
    return timeout_s



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


class RedisStore(KeyspaceStore):
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
        self.prefix = check_prefix(prefix)
        self.capacity_bytes = None if capacity_bytes is None else \
            check_int(capacity_bytes, "capacity_bytes", minimum=1)
        check_timeout_s(timeout_s)
        errors = (redis.exceptions.RedisError, OSError)
        client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                      socket_connect_timeout=timeout_s)
        try:
            client.ping()
        except Exception as e:  # (a server that answers junk, too)
            client.close()
            raise StoreError(f"redis store at {_redact(url)}: cannot connect: {e}") from e
        self._setup(client, ["{" + prefix + "}"], self.capacity_bytes, errors,
                    f"redis store at {_redact(url)}")

    def __repr__(self) -> str:
        return (f"RedisStore({_redact(self.url)!r}, prefix={self.prefix!r}, "
                f"capacity_bytes={self.capacity_bytes!r})")

    def stats(self) -> dict[str, Any]:
        """Counters (see ``Store.stats``): ``blobs`` and ``bytes`` of the whole shared
        store; ``puts``, ``gets``, ``hits`` and ``evictions`` of this client."""
        self._check_open()
        blobs, used, _ = self._usage()
        with self._lock:
            counts = dict(self._counts)
        return {"name": self.name, "url": _redact(self.url), "prefix": self.prefix,
                "blobs": int(blobs), "bytes": int(used or 0),
                "capacity_bytes": self.capacity_bytes, **counts}
