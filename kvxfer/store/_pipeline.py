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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["Block", "BlockReply", "exchange"]


@dataclasses.dataclass(slots=True)
class Block:
    """Commands for one server; ``atomic``: run as one ``MULTI``/``EXEC`` transaction."""

    commands: list[tuple[Any, ...]]
    atomic: bool = False


@dataclasses.dataclass(slots=True)
class BlockReply:
    """What a block got: one reply per command, or ``error`` (the block's commands did
    not run: a command refused when queued, a transaction the server aborted)."""

    replies: list[Any] | None
    error: BaseException | None = None


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


def _parse(blocks: Sequence[Block], raw: list[Any]) -> list[BlockReply]:
    from redis.exceptions import ResponseError

    out, at = [], 0
    for b in blocks:
        n = len(b.commands)
        if not b.atomic:
            out.append(BlockReply(raw[at:at + n]))
            at += n
            continue
        queued, done = raw[at + 1:at + 1 + n], raw[at + 1 + n]
        at += n + 2
        # A command refused when queued (MOVED, a wrong number of arguments) is the
        # cause of the EXECABORT that follows: the block's error names it.
        refused = next((r for r in queued if isinstance(r, ResponseError)), None)
        if refused is not None or not isinstance(done, list):
            error = refused or (done if isinstance(done, BaseException) else
                                ResponseError(f"transaction not run: EXEC replied {done!r}"))
            out.append(BlockReply(None, error))
        else:
            out.append(BlockReply(done))
    return out


def exchange(work: Sequence[tuple[Any, Sequence[Block]]]
             ) -> list[list[BlockReply] | BaseException]:
    """Sends each ``(client, blocks)`` pair's blocks to its server (``client`` is a
    ``redis.Redis``), every server's at once, and reads the replies.

    Returns:
      Per pair, in order: its blocks' replies, or the error that cut its server's round
      trip short (a connection refused, closed or timed out: none of its replies was
      read, and any of its commands may have run). A server whose client retries
      (redis-py's ``Retry``) is tried again, alone, as redis-py retries a pipeline.
    """
    from redis.exceptions import ConnectionError, TimeoutError

    lost = (ConnectionError, TimeoutError, OSError)
    conns: list[Any] = [None] * len(work)
    results: list[list[BlockReply] | BaseException | None] = [None] * len(work)
    try:
        for i, (client, blocks) in enumerate(work):  # every write first
            try:
                conn = conns[i] = client.connection_pool.get_connection()  # connects
                conn.send_packed_command(conn.pack_commands(_wire(blocks)))
            except lost as e:
                if conns[i] is not None:
                    conns[i].disconnect()
                results[i] = e
        for i, (client, blocks) in enumerate(work):  # then every server's replies
            if results[i] is not None:
                continue
            conn = conns[i]
            try:
                results[i] = _parse(blocks, [_read(conn) for _ in _wire(blocks)])
            except lost as e:
                conn.disconnect()  # replies may still be on their way: never reuse it
                results[i] = e
            except BaseException:
                conn.disconnect()
                raise
    finally:
        for (client, _), conn in zip(work, conns):
            if conn is not None:
                client.connection_pool.release(conn)
    for i, (client, blocks) in enumerate(work):
        if isinstance(results[i], BaseException):
            results[i] = _again(client, blocks, results[i], lost)
    return results  # type: ignore[return-value]


def _again(client: Any, blocks: Sequence[Block], error: BaseException,
           lost: tuple[type[BaseException], ...]) -> list[BlockReply] | BaseException:
    """The round trip once more under the client's retry policy, when it has one."""
    retry = getattr(client.get_connection_kwargs().get("retry"), "get_retries", None)
    if retry is None or retry() <= 0:
        return error
    try:
        conn = client.connection_pool.get_connection()
    except lost as e:
        return e
    wire = _wire(blocks)

    def once() -> list[BlockReply]:
        conn.send_packed_command(conn.pack_commands(wire))
        return _parse(blocks, [_read(conn) for _ in wire])

    try:
        return conn.retry.call_with_retry(once, lambda e: conn.disconnect())
    except lost as e:
        conn.disconnect()
        return e
    finally:
        client.connection_pool.release(conn)
