"""An accounting domain: a Redis hash tag's worth of page blobs with exact LRU
bookkeeping, the commands on it and what their replies may be.

A domain under the hash tag ``R`` (``{P}`` for a ``RedisStore`` of prefix ``P``,
``{P:d}`` for domain ``d`` of a ``RedisClusterStore``) keeps:

* ``Rb:KEY``: the blob (a Redis string);
* ``Rm:lru``: a sorted set of keys by last use, scored from ``Rm:clock`` (a counter
  every put and hit increments, so recency is one order across every client, with no
  clock skew between hosts);
* ``Rm:sizes``: a hash of each key's blob size, and ``Rm:bytes``: their sum.

Every key of a domain shares its hash tag, so a domain is one Redis Cluster hash slot
and its scripts (``kvxfer/store/_scripts.py``, which touch blob keys they are not
given, the evicted ones) and the transactions around them run on one node.

A put is one ``MULTI``/``EXEC`` transaction: a Lua script that does the accounting
(and, past the domain's capacity, deletes its least recently used blobs) followed by
``SET NX`` (a replacing put's script deletes the old blob once its accounting
succeeded). Redis does not roll a transaction back, so an accounting step that fails
(a counter another client overwrote) leaves a marker in the blob's place that makes
the ``SET NX`` write nothing; the writer then removes the marker (a read meanwhile
sees a miss), so a put that fails costs an error, and no blob unaccounted. A read is
one transaction too: ``MGET`` of the blobs (``GETRANGE`` up to the store's blob cap,
when it has one, so an oversized blob is never fetched whole) and a script that marks
the keys used and says which were there. Redis runs a transaction whole, without interleaving another client's
commands, so under any number of concurrent clients exactly one put-if-absent of a key
wins, the byte count is exact and eviction takes the least recently used blob of the
domain; the blob never passes through Lua (no extra copy on the server).

A batch (``get_many``, ``put_many``, ``contains_many``) is one round trip per server
(``kvxfer/store/_pipeline.py``): per domain, one transaction holds every key's commands
(a put's script and ``SET NX`` in turn; a read's, in the batch's order), every domain
of a server goes out in one write, and every server's at once; a single-key call is a
batch of one. A transaction of several puts runs as the same puts one
after another would, so every guarantee above holds key by key.

Every reply is checked for the kind and shape its command gives (``BadReply`` when
not): a server, or a proxy in front of it, that answers junk never has its junk taken
for a blob, a count or another key's answer. The store over domains is
``kvxfer/store/_domains.py``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from kvxfer.store._pipeline import BadReply, Block
from kvxfer.store._scripts import DELETE, MARKER, PUT, TOUCH_MANY, UNMARK, is_marker

__all__ = ["Keyspace", "MARKER", "Read"]


def _raise_error(reply: Any) -> Any:
    """``reply``, unless it is an error reply of the server (raised)."""
    if isinstance(reply, BaseException):
        raise reply
    return reply


def _wrong_type(reply: Any) -> bool:
    """Whether ``reply`` is the server's ``WRONGTYPE`` error: a value of another type
    (a hash, a list) under a blob's key, which holds no blob."""
    return isinstance(reply, BaseException) and str(reply).startswith("WRONGTYPE")


def _array(reply: Any, n: int | None, what: str) -> list[Any]:
    """``reply`` if it is an array (of ``n`` replies, unless None)."""
    if not isinstance(_raise_error(reply), list) or n is not None and len(reply) != n:
        size = f" of {len(reply)}" if isinstance(reply, list) else ""
        raise BadReply(f"{what}: expected an array of {'' if n is None else n} replies. "
                       f"Got {type(reply).__name__}{size}")
    return reply


def _int(reply: Any, what: str, allowed: tuple[int, ...] | None = None) -> int:
    if type(_raise_error(reply)) is not int or (allowed is not None and reply not in allowed):
        raise BadReply(f"{what}: expected an integer reply"
                       f"{'' if allowed is None else ' in ' + str(allowed)}. Got "
                       f"{_show(reply)}")
    return reply


def _bulk(reply: Any, what: str, nil: bool = True) -> bytes | None:
    if not (isinstance(_raise_error(reply), bytes) or (nil and reply is None)):
        raise BadReply(f"{what}: expected a {'blob or nil' if nil else 'blob'} reply. Got "
                       f"{_show(reply)}")
    return reply


def _show(reply: Any) -> str:
    if isinstance(reply, bytes):
        return f"bytes of {len(reply)}"
    if isinstance(reply, list):
        return f"an array of {len(reply)}"
    return f"{type(reply).__name__} {reply!r}"[:80]


@dataclasses.dataclass(frozen=True, slots=True)
class Read:
    """What a read of some keys of one domain found: per key its blob or None (a miss,
    a failed put's marker, a blob over the cap), and which positions were over the cap."""

    blobs: list[bytes | None]
    oversized: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class Keyspace:
    """One accounting domain: the keys under the hash tag ``root``, the commands on
    them, and their replies checked.

    The blocks (``*_block``) go out through ``kvxfer/store/_pipeline.py``, each with
    the method beside it as its ``parse``; the single-key methods that take a
    ``client`` (a ``redis.Redis`` or ``redis.cluster.RedisCluster``) run through
    redis-py itself (a cluster store's way around a slot that moved), its errors
    passing through.
    """

    root: str

    @property
    def blobs(self) -> str:
        return self.root + "b:"

    @property
    def meta(self) -> tuple[str, str, str, str]:
        """The ``lru``, ``sizes``, ``bytes`` and ``clock`` keys."""
        return tuple(self.root + "m:" + k for k in ("lru", "sizes", "bytes", "clock"))

    # -- batches: the commands of one transaction (or block), and what they replied --

    def get_block(self, keys: list[str], cap: int | None) -> Block:
        """The blobs (``MGET``; with a ``cap``, each its first ``cap + 1`` bytes, enough
        to tell a blob over the cap), then ``TOUCH_MANY``, in one transaction."""
        bkeys = [self.blobs + k for k in keys]
        touch = ("EVAL", TOUCH_MANY, 4 + len(keys), *self.meta, *bkeys, *keys)
        parse = functools.partial(self.got, n=len(keys), cap=cap)
        if cap is None:
            return Block([("MGET", *bkeys), touch], atomic=True, parse=parse)
        return Block([("GETRANGE", b, 0, cap) for b in bkeys] + [touch], atomic=True,
                     parse=parse)

    @staticmethod
    def got(replies: list[Any], n: int, cap: int | None) -> Read:
        """What a ``get_block`` of ``n`` keys read (a failed put's marker is a miss).

        Raises:
          ResponseError: a command of the block failed (the touch script, say).
          BadReply: a reply of the wrong kind or shape.
        """
        if cap is None:
            blobs, flags = _array(replies, 2, "a read")
            blobs = _array(blobs, n, "MGET")
        else:
            replies = _array(replies, n + 1, "a read")
            blobs, flags = replies[:n], replies[n]
        flags = _array(flags, n, "the touch script")
        out: list[bytes | None] = []
        over: list[int] = []
        for i, (blob, flag) in enumerate(zip(blobs, flags)):
            there = _int(flag, "the touch script's flag", (0, 1, 2))
            if there == 2 and (blob is None or _wrong_type(blob)):
                out.append(None)  # a hash, a list: no blob, a miss of this key alone
                continue
            blob = _bulk(blob, "a blob", nil=cap is None)
            # One transaction: a blob MGET found is one the script found, and GETRANGE
            # of a key that is not there is empty.
            if cap is None:
                disagree = (blob is not None) != bool(there)
            else:
                disagree = bool(blob) and not there
            if disagree:
                raise BadReply(f"a read: the blob reply ({_show(blob)}) and the touch "
                               f"script ({there}) disagree on whether key {i} is there")
            if not there or is_marker(blob):
                out.append(None)
            elif cap is not None and len(blob) > cap:
                out.append(None)
                over.append(i)
            else:
                out.append(blob)
        return Read(out, over)

    def contains_block(self, keys: list[str], cap: int | None) -> Block:
        """``EXISTS`` and ``STRLEN`` of each key: a blob over the ``cap`` is not one the
        store holds, nor is a value of another type (``STRLEN`` refuses it)."""
        parse = functools.partial(self.found, n=len(keys), cap=cap)
        return Block([c for k in keys for c in (("EXISTS", self.blobs + k),
                                                ("STRLEN", self.blobs + k))], parse=parse)

    @staticmethod
    def found(replies: list[Any], n: int, cap: int | None) -> list[bool]:
        """Whether each key of a ``contains_block`` of ``n`` keys is there.

        Raises:
          ResponseError, BadReply: as ``got``.
        """
        replies = _array(replies, 2 * n, "EXISTS and STRLEN")
        return [Keyspace.holds(replies[2 * i], replies[2 * i + 1], cap) for i in range(n)]

    @staticmethod
    def holds(exists: Any, strlen: Any, cap: int | None) -> bool:
        """Whether one key's ``EXISTS`` and ``STRLEN`` replies say it holds a blob (a
        value of another type holds none: ``STRLEN`` answers it ``WRONGTYPE``)."""
        if _wrong_type(strlen):
            return False
        size = _int(strlen, "STRLEN")
        return bool(_int(exists, "EXISTS", (0, 1))) and (cap is None or size <= cap)

    def put_block(self, items: list[tuple[str, memoryview]], replace: bool,
                  capacity: int | None) -> Block:
        """Each key's ``PUT`` and ``SET NX`` in turn, in one transaction."""
        cap = -1 if capacity is None else capacity
        commands: list[tuple[Any, ...]] = []
        for key, view in items:
            bkey = self.blobs + key
            commands.append(("EVAL", PUT, 5, bkey, *self.meta, key, view.nbytes,
                             int(replace), cap, self.blobs, MARKER))
            commands.append(("SET", bkey, view, "NX"))
        return Block(commands, atomic=True,
                     parse=functools.partial(self.put_outcomes, n=len(items)))

    @staticmethod
    def put_outcomes(replies: list[Any], n: int) -> list[tuple[int, bool] | BaseException]:
        """What each put of a ``put_block`` of ``n`` keys did: the number evicted (-1:
        there and not replaced, -2: the byte counter is not an integer, nothing
        written) and whether the blob was written; or the server's error of that put.

        Raises:
          BadReply: a reply of the wrong kind or shape.
        """
        replies = _array(replies, 2 * n, "a transaction of puts")
        out: list[tuple[int, bool] | BaseException] = []
        for evicted, stored in zip(replies[::2], replies[1::2]):
            failed = next((r for r in (evicted, stored) if isinstance(r, BaseException)),
                          None)
            out.append(failed if failed is not None else
                       Keyspace.put_outcome(evicted, stored))
        return out

    @staticmethod
    def put_outcome(evicted: Any, stored: Any) -> tuple[int, bool]:
        """One put's ``PUT`` and ``SET NX`` replies (see ``put_outcomes``).

        Raises:
          BadReply: a reply of the wrong kind.
        """
        evicted = _int(evicted, "the put script")
        if stored not in (b"OK", None) or evicted < -2:
            raise BadReply(f"a put: expected the script's count and SET NX's OK or nil. "
                           f"Got {_show(evicted)} and {_show(stored)}")
        return evicted, stored is not None

    def delete_block(self, key: str) -> Block:
        return Block([("EVAL", DELETE, 4, self.blobs + key, *self.meta[:3], key)],
                     parse=self.deleted)

    @staticmethod
    def deleted(replies: list[Any]) -> bool:
        """Whether the key of a ``delete_block`` was there.

        Raises:
          ResponseError, BadReply: as ``got``.
        """
        return bool(_int(_array(replies, 1, "a delete")[0], "the delete script", (0, 1)))

    # -- one key, through the client (and its routing) -----------------------------
    # (A cluster store's way around a slot that moved: redis-py's own pipelines.)

    def put(self, client: Any, key: str, view: memoryview, replace: bool,
            capacity: int | None) -> tuple[int, bool]:
        """The number evicted (-2: the byte counter is not an integer, nothing written)
        and whether the blob was written."""
        bkey = self.blobs + key
        cap = -1 if capacity is None else capacity
        with client.pipeline(transaction=True) as pipe:
            # EVAL by name: redis-py's cluster pipeline has no eval(), and routes this.
            pipe.execute_command("EVAL", PUT, 5, bkey, *self.meta, key, view.nbytes,
                                 int(replace), cap, self.blobs, MARKER)
            pipe.set(bkey, view, nx=True)
            evicted, stored = _array(pipe.execute(), 2, "a put")
        evicted = _int(evicted, "the put script")
        if evicted == -2:  # the failure path only: the common put stays two commands
            self.unmark(client, key)
        return evicted, bool(stored)

    def get(self, client: Any, key: str, cap: int | None) -> Read:
        """What a ``get_block`` of ``key`` reads, through the client: the same commands
        (with a ``cap``, at most ``cap + 1`` bytes of the blob) and the same checks."""
        block = self.get_block([key], cap)
        with client.pipeline(transaction=True) as pipe:
            for command in block.commands:
                pipe.execute_command(*command)
            # Error replies in the list, as the batch sees them: a value of another
            # type under the key is a miss, any other error is raised by the parse.
            replies = pipe.execute(raise_on_error=False)
        return block.parse(replies)

    def contains(self, client: Any, key: str, cap: int | None) -> bool:
        from redis.exceptions import ResponseError

        bkey = self.blobs + key
        exists = client.exists(bkey)
        try:
            strlen = client.strlen(bkey)
        except ResponseError as e:
            strlen = e  # WRONGTYPE: not a blob; any other error is raised by holds
        return self.holds(exists, strlen, cap)

    def unmark(self, client: Any, key: str) -> None:
        """Removes the marker a put whose accounting failed left under ``key``."""
        client.execute_command("EVAL", UNMARK, 1, self.blobs + key, MARKER)

    def delete(self, client: Any, key: str) -> bool:
        return bool(_int(client.execute_command("EVAL", DELETE, 4, self.blobs + key,
                                                *self.meta[:3], key),
                         "the delete script", (0, 1)))

    # -- the whole domain -------------------------------------------------------------

    def keys_block(self) -> Block:
        """The keys, least recently used first."""
        return Block([("ZRANGE", self.meta[0], 0, -1)], parse=self._keys)

    @staticmethod
    def _keys(replies: list[Any]) -> list[str]:
        out = []
        for k in _array(_array(replies, 1, "ZRANGE")[0], None, "ZRANGE"):
            try:
                out.append(_bulk(k, "a key", nil=False).decode("utf-8"))
            except UnicodeDecodeError:
                raise BadReply(f"a key that is not UTF-8: {k[:40]!r}") from None
        return out

    def usage_block(self) -> Block:
        """Blobs and bytes, read together."""
        return Block([("ZCARD", self.meta[0]), ("GET", self.meta[2])], atomic=True,
                     parse=self._usage)

    def _usage(self, replies: list[Any]) -> tuple[int, int]:
        blobs, used = _array(replies, 2, "a usage read")
        used = _bulk(used, "the byte counter")
        if used is not None and not used.lstrip(b"-").isdigit():
            raise BadReply(f"the byte counter {self.meta[2]!r} is not an integer: "
                           f"{used[:40]!r}")
        return _int(blobs, "ZCARD"), int(used or 0)
