"""Blocks of Redis commands sent to several servers at once, one round trip each.

A batched store call (``get_many``, ``put_many``, ``contains_many``) turns into a few
*blocks* per server: a block is a list of commands, sent either plainly or wrapped in
``MULTI``/``EXEC`` (a transaction: Redis runs it whole, without another client's
commands in between). Every server's blocks are packed into one write, all the writes
go out before any reply is read, and each server's replies are read back in order: one
round trip per server, whatever the number of blocks.

redis-py's pipelines do not do this: a plain pipeline wraps everything in one
transaction, and a Redis Cluster transaction must keep to one hash slot, while a
cluster store's batch spans many (one per accounting domain).

Replies are redis-py's raw parse (no response callbacks): ``bytes``, ``int``, ``None``,
lists, and error replies as ``ResponseError`` instances (inside an ``EXEC`` reply too).

A connection is given back to its pool only once every reply it was sent for has been
read, and no byte more is waiting, and none broke the protocol (``_Lease``): one whose
round trip stopped short for any reason (a server that answered junk, a timeout,
another server's error, a ``KeyboardInterrupt`` between two reads) is disconnected
first, so a later command on it can never read an earlier command's reply.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["Block", "BlockReply", "BadReply", "exchange", "lost_errors"]


class BadReply(Exception):
    """A server's reply that breaks the protocol its command follows (a reply of the
    wrong kind or shape, more replies than commands): the server, or something between
    it and this client, misbehaves."""


@dataclasses.dataclass(slots=True)
class Block:
    """Commands for one server; ``atomic``: run as one ``MULTI``/``EXEC`` transaction.

    ``parse``, when given, turns the block's replies into what its caller wants, while
    the connection is still held: it raises ``BadReply`` for replies that break the
    protocol (the connection is then dropped, not given back), and may raise the
    server's error replies (``ResponseError``: the block's error, the stream in step).
    """

    commands: list[tuple[Any, ...]]
    atomic: bool = False
    parse: Callable[[list[Any]], Any] | None = None


@dataclasses.dataclass(slots=True)
class BlockReply:
    """What a block got: one reply per command (or what its ``parse`` made of them),
    or ``error`` (the block's commands did not run: a command refused when queued, a
    transaction the server aborted; or its replies broke the protocol)."""

    replies: Any
    error: BaseException | None = None


def lost_errors() -> tuple[type[BaseException], ...]:
    """What a round trip cut short by the network raises (a connection refused, closed
    or timed out)."""
    from redis.exceptions import ConnectionError, TimeoutError

    return ConnectionError, TimeoutError, OSError


def _wire(blocks: Sequence[Block]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for b in blocks:
        if b.atomic:
            out.append(("MULTI",))
            out += b.commands
            out.append(("EXEC",))
        else:
            out += b.commands
    return out


def _read(conn: Any) -> Any:
    from redis.exceptions import ResponseError

    try:
        return conn.read_response()
    except ResponseError as e:  # an error reply: the stream stays in step
        return e


class _Lease:
    """A connection taken from a client's pool for round trips. ``owed`` is true from
    the first byte sent until every reply was read: a lease given back owing replies
    disconnects its connection first (see ``_leased``)."""

    __slots__ = ("conn", "owed")

    def __init__(self, conn: Any):
        self.conn, self.owed = conn, False

    def send(self, wire: list[tuple[Any, ...]]) -> None:
        self.owed = True  # (a write cut short leaves the stream unknown too)
        self.conn.send_packed_command(self.conn.pack_commands(wire))

    def receive(self, blocks: Sequence[Block], n: int) -> list[BlockReply]:
        """The replies of ``blocks`` (``n`` in all), sent; then nothing more may be
        waiting. A connection whose replies broke the protocol stays owed: a server
        that answered junk may still send more."""
        raw = [_read(self.conn) for _ in range(n)]
        if self.conn.can_read(timeout=0):
            raise BadReply(f"the server sent more than the {n} replies of the commands "
                           "sent (or closed the connection after them)")
        replies, bad = _parse(blocks, raw)
        self.owed = bad
        return replies


@contextlib.contextmanager
def _leased(client: Any) -> Iterator[_Lease]:
    """A lease of one of ``client``'s pooled connections (``client`` is a
    ``redis.Redis``): given back on exit, disconnected first if it owes replies."""
    pool = client.connection_pool
    lease = _Lease(pool.get_connection())  # connects
    try:
        yield lease
    finally:
        try:
            if lease.owed:
                lease.conn.disconnect()  # replies may still be on their way
        finally:
            pool.release(lease.conn)


def _parse(blocks: Sequence[Block], raw: list[Any]) -> tuple[list[BlockReply], bool]:
    """Each block's reply, and whether some reply broke the protocol."""
    from redis.exceptions import ResponseError

    out, at, bad = [], 0, False
    for b in blocks:
        n = len(b.commands)
        if not b.atomic:
            reply = BlockReply(raw[at:at + n])
            at += n
        else:
            began, queued, done = raw[at], raw[at + 1:at + 1 + n], raw[at + 1 + n]
            at += n + 2
            # A command refused when queued (MOVED, a wrong number of arguments) is the
            # cause of the EXECABORT that follows: the block's error names it.
            refused = next((r for r in queued if isinstance(r, ResponseError)), None)
            if refused is None and (began != b"OK" or any(r != b"QUEUED" for r in queued)):
                reply = BlockReply(None, BadReply(
                    f"a transaction's MULTI and queued commands were answered {began!r} "
                    f"and {[r for r in queued if r != b'QUEUED'][:1]!r}, not OK and "
                    "QUEUED"))
            elif refused is not None or not isinstance(done, list):
                error = refused or (done if isinstance(done, BaseException) else
                                    ResponseError(f"transaction not run: EXEC replied "
                                                  f"{done!r}"))
                reply = BlockReply(None, error)
            else:
                reply = BlockReply(done)
        if reply.error is None and b.parse is not None:
            try:
                reply.replies = b.parse(reply.replies)
            except Exception as e:
                reply = BlockReply(None, e)
        bad = bad or isinstance(reply.error, BadReply)
        out.append(reply)
    return out, bad


def exchange(work: Sequence[tuple[Any, Sequence[Block]]]
             ) -> list[list[BlockReply] | BaseException]:
    """Sends each ``(client, blocks)`` pair's blocks to its server (``client`` is a
    ``redis.Redis``), every server's at once, and reads the replies.

    Returns:
      Per pair, in order: its blocks' replies, or the error that cut its server's round
      trip short: a connection refused, closed or timed out (``lost_errors``: none of
      its replies was read, and any of its commands may have run), or a reply redis-py
      could not parse or that breaks the protocol (``InvalidResponse``, ``BadReply``).
      A server whose client retries (redis-py's ``Retry``) is tried again, alone, after
      a lost round trip, as redis-py retries a pipeline.

    Raises:
      BaseException: what is not an ``Exception`` (``KeyboardInterrupt``), once every
        connection that still owed replies is disconnected.
    """
    lost = lost_errors()
    results: list[list[BlockReply] | BaseException | None] = [None] * len(work)
    with contextlib.ExitStack() as held:  # every lease given back, whatever happens
        leases: list[_Lease | None] = []
        for i, (client, blocks) in enumerate(work):  # every write first
            lease = None
            try:
                lease = held.enter_context(_leased(client))
                lease.send(_wire(blocks))
            except Exception as e:
                results[i] = e
            leases.append(lease)
        for i, (_, blocks) in enumerate(work):  # then every server's replies
            if results[i] is None:
                try:
                    results[i] = leases[i].receive(blocks, len(_wire(blocks)))
                except Exception as e:
                    results[i] = e
    for i, (client, blocks) in enumerate(work):
        if isinstance(results[i], lost):
            results[i] = _again(client, blocks, results[i])
    return results  # type: ignore[return-value]


def _again(client: Any, blocks: Sequence[Block], error: BaseException
           ) -> list[BlockReply] | BaseException:
    """The round trip once more under the client's retry policy, when it has one."""
    retry = getattr(client.get_connection_kwargs().get("retry"), "get_retries", None)
    if retry is None or retry() <= 0:
        return error
    wire = _wire(blocks)
    try:
        with _leased(client) as lease:

            def once() -> list[BlockReply]:
                lease.send(wire)
                return lease.receive(blocks, len(wire))

            def failed(_: BaseException) -> None:
                lease.conn.disconnect()
                lease.owed = False  # a new connection for the next try

            return lease.conn.retry.call_with_retry(once, failed)
    except Exception as e:
        return e
