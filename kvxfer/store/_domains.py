"""``Domains``: a store's accounting domains (``kvxfer/store/_keyspace.py``) over one
Redis client (one domain for a ``RedisStore``, many for a ``RedisClusterStore``): which
domain a key is in, where it lives, one round trip to the servers of many, what a
failure means, and the calls on the whole store. Its blob calls are ``KeyspaceStore``
(``kvxfer/store/_keyspace_store.py``).

Every call, a batch or one key (a batch of one), goes out as blocks of commands, one
round trip per server (``kvxfer/store/_pipeline.py``, which never gives back a
connection that owes replies), and every reply is checked before it is believed. What
a server does wrong reaches the caller only as the store's own answers: a
``StoreError`` (a write; a read of a standalone server, which ``HostCache`` counts as a
miss), a miss (a read of a cluster node that is down) and counters in ``stats()``
(``bad_replies``: keys whose reply broke the protocol; ``oversized``: blobs over the
cap of ``cap_blob_bytes``, never fetched whole), never an exception of redis-py.
"""

from __future__ import annotations

import logging
import os
import threading
import zlib
from collections.abc import Iterable
from typing import Any

from kvxfer.store._base import Store, StoreError
from kvxfer.store._keyspace import Keyspace
from kvxfer.store._pipeline import BadReply, Block, BlockReply, exchange, lost_errors

__all__ = ["Domains", "Views"]

log = logging.getLogger("kvxfer")

#: The most keys, and blob bytes, one transaction of a batch holds (a larger batch is
#: several transactions, still in the same round trip): a server queues a transaction
#: whole before it runs it.
_CHUNK_KEYS = 256
_CHUNK_BYTES = 64 << 20

Views = list[tuple[str, memoryview]]


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class Domains(Store):
    """A ``Store`` over accounting domains of one Redis client; a key's domain is
    ``crc32(key) % len(domains)``, and the capacity is split evenly over the domains
    (so the store holds at most ``capacity_bytes`` in all, each domain its share).

    Subclasses connect, then call ``_setup``; they choose what an unreachable domain
    means for reads (``_unreachable``: here a ``StoreError``).
    """

    _COUNTERS: tuple[str, ...] = ("puts", "gets", "hits", "evictions", "oversized",
                                  "bad_replies")

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
        try:
            raw = key.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"Expected a key that UTF-8 can encode. Got {key!r} (a lone "
                             "surrogate)") from None
        n = len(self._spaces)
        return 0 if n == 1 else zlib.crc32(raw) % n

    def _fail(self, what: str, e: BaseException) -> StoreError:
        err = StoreError(f"{self._where}: {what}: {e}")
        err.__cause__ = e
        return err

    def _bad(self, e: BaseException) -> bool:
        """Whether ``e`` says a reply broke the protocol (junk, a wrong kind or shape),
        as opposed to a server that is out of reach or refused a command."""
        from redis.exceptions import InvalidResponse

        return isinstance(e, (BadReply, InvalidResponse)) or not isinstance(e, self._errors)

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

    # -- what failed, and what that means ---------------------------------------------

    def _read_error(self, d: int, what: str, e: BaseException, n: int = 1) -> None:
        """A read of ``n`` keys of domain ``d`` failed with ``e``: raises its
        ``StoreError``, or returns: misses (a cluster node down, counted)."""
        if self._bad(e):
            self._count(bad_replies=n)
            raise self._fail(f"{what}: {self._junk(e)}", e) from e
        self._unreachable(d, what, e, n)

    def _read_failed(self, d: int, keys: list[str], e: BaseException,
                     errors: dict[str, StoreError]) -> None:
        """A read of ``keys`` (domain ``d``) failed: misses or each key's error."""
        try:
            self._read_error(d, f"cannot read {self._names(keys)}", e, len(keys))
        except StoreError as err:
            errors.update(dict.fromkeys(keys, err))

    def _write_failed(self, d: int, keys: list[str], e: BaseException,
                      verb: str = "write") -> StoreError:
        """The error of a write of ``keys`` (domain ``d``) that failed with ``e``."""
        what = f"cannot {verb} {self._names(keys)}"
        if self._bad(e):
            self._count(bad_replies=len(keys))
            return self._fail(f"{what}: {self._junk(e)}", e)
        return self._unwritable(d, what, e)

    @staticmethod
    def _junk(e: BaseException) -> str:
        """What a reply that broke the protocol is called in an error: redis-py's parse
        errors and ours say so; another exception raised on the way is named too."""
        from redis.exceptions import InvalidResponse

        return "the server's reply broke the protocol" + \
            ("" if isinstance(e, (BadReply, InvalidResponse)) else f" ({type(e).__name__})")

    def _oversized(self, keys: list[str]) -> None:
        if keys:
            self._count(oversized=len(keys))
            log.warning("%s: the blob of %s is over the cap of %d bytes: a miss (not "
                        "fetched)", self._where, self._names(keys), self.blob_cap)

    def _blob(self, key: str, blob: Any) -> tuple[int, memoryview]:
        """``key``'s domain and ``blob`` as bytes, checked against the domain's share
        and the blob cap."""
        d = self._domain(key)
        try:
            view = memoryview(blob).cast("B")
        except TypeError:
            raise TypeError(f"Expected a bytes-like blob. Got {type(blob).__name__}") from None
        cap, limit = self._caps[d], self.blob_cap
        if cap is not None and view.nbytes > cap:
            if len(self._spaces) == 1:
                raise ValueError(f"blob of {view.nbytes} bytes for key {key!r} is more than "
                                 f"capacity_bytes={cap}")
            raise ValueError(f"blob of {view.nbytes} bytes for key {key!r} is more than "
                             f"its domain's share of the capacity ({cap} bytes: "
                             f"capacity_bytes={sum(self._caps)} over "
                             f"{len(self._spaces)} domains)")
        if limit is not None and view.nbytes > limit:
            raise ValueError(f"blob of {view.nbytes} bytes for key {key!r} is more than the "
                             f"blob cap of {limit} bytes (cap_blob_bytes): it would never "
                             "be read back")
        return d, view

    # -- round trips ----------------------------------------------------------------

    def _run(self, plan: dict[int, list[Block]]
             ) -> dict[int, list[BlockReply] | BaseException]:
        """Each domain's blocks, every server's in one round trip: per domain, its
        blocks' replies or the error that kept them from running (no route to its
        server, a connection lost, a reply of junk)."""
        out: dict[int, list[BlockReply] | BaseException] = {}
        servers: dict[str, tuple[Any, list[int]]] = {}
        for d in plan:
            try:
                name, client = self._route(d)
            except Exception as e:  # (no route: a slot map that is missing or junk)
                out[d] = e
                continue
            servers.setdefault(name, (client, []))[1].append(d)
        work = [(client, [b for d in ds for b in plan[d]]) for client, ds in servers.values()]
        replies = exchange(work)
        lost = next((r for r in replies if isinstance(r, lost_errors())), None)
        if lost is not None:
            self._lost(lost)
        for (_, ds), got in zip(servers.values(), replies):
            at = 0
            for d in ds:
                n = len(plan[d])
                out[d] = got if isinstance(got, BaseException) else got[at:at + n]
                at += n
        return out

    def _redirected(self, replies: list[BlockReply] | BaseException) -> bool:
        return not isinstance(replies, BaseException) and \
            any(isinstance(r.error, self._redirects) for r in replies)

    @staticmethod
    def _replied(reply: BlockReply) -> list[Any]:
        if reply.error is not None:
            raise reply.error
        return reply.replies  # type: ignore[return-value]

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
        return f"key {keys[0]!r}" if len(keys) == 1 else \
            f"keys {keys[0]!r} and {len(keys) - 1} more"

    # -- the whole store ------------------------------------------------------------

    def keys(self) -> list[str]:
        """The keys of the store, least recently used first (domain by domain, when
        there are several: recency is kept within each)."""
        self._check_open()
        return [k for ks in self._each_domain("cannot list keys", Keyspace.keys_block)
                for k in ks]

    def _each_domain(self, what: str, block: Any) -> list[Any]:
        """What ``block(space)`` gave on each domain that is not held, in domain order;
        a domain that failed raises its ``StoreError`` or is left out (a cluster node
        down)."""
        plan = {d: [block(space)] for d, space in enumerate(self._spaces)
                if not self._held(d)}
        out = []
        for d, replies in sorted(self._run(plan).items()):
            try:
                if isinstance(replies, BaseException):
                    raise replies
                out.append(self._replied(replies[0]))
            except Exception as e:
                self._read_error(d, what, e)
                continue
            self._reached(d)
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
        except Exception as e:
            raise self._fail("cannot clear", e) from e
        return blobs

    def _usage(self) -> tuple[int, int, int]:
        """Blobs and bytes of the reachable domains, and how many were not."""
        got = self._each_domain("cannot read stats", Keyspace.usage_block)
        return sum(b for b, _ in got), sum(u for _, u in got), len(self._spaces) - len(got)

    def close(self) -> None:
        """Closes this client's connections (the blobs stay on the server)."""
        if not self._closed:
            self._closed = True
            self._client.close()
