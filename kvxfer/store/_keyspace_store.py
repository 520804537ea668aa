"""``KeyspaceStore``: the blob calls (``get``, ``contains``, ``put``, ``delete`` and
their batches) of a store over accounting domains (``kvxfer/store/_domains.py``), the
base of ``RedisStore`` and ``RedisClusterStore``.

A call on one key is a batch of one. A batch groups its keys by domain, sends each
domain's transactions (of at most ``_CHUNK_KEYS`` keys and about ``_CHUNK_BYTES``) to
its server, every server's in one round trip, and gives each key its own result: a
blob, a miss, or its error (``StoreBatchError`` keeps the others'). A domain whose slot
moved (a cluster's MOVED or ASK) has its keys done one by one through the client's own
routing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvxfer.store._base import (StoreError, _gather, _gather_puts, _writes, batch_items,
                                batch_keys)
from kvxfer.store._domains import _CHUNK_BYTES, _CHUNK_KEYS, Domains, Views
from kvxfer.store._keyspace import Read
from kvxfer.store._pipeline import Block, BlockReply

__all__ = ["KeyspaceStore"]


class KeyspaceStore(Domains):
    """The ``Store`` interface over accounting domains of one Redis client (see
    ``Domains``)."""

    # -- reads ------------------------------------------------------------------------

    def _read(self, keys: list[str]) -> tuple[dict[str, bytes | None], dict[str, StoreError]]:
        """``get`` of distinct, checked ``keys``: the blob (or None) of each key read,
        and the error of each that could not be."""
        domains = self._by_domain(keys)
        cap = self.blob_cap
        got: dict[str, bytes | None] = {}
        errors: dict[str, StoreError] = {}
        plan: dict[int, list[Block]] = {}
        for d, ks in domains.items():
            if self._held(d):  # (only a cluster store holds domains: it counts read_errors)
                self._count(gets=len(ks), read_errors=len(ks))
                continue
            plan[d] = [self._spaces[d].get_block(c, cap) for c in self._chunks(ks)]
        for d, replies in self._run(plan).items():
            ks = domains[d]
            if self._redirected(replies):
                for k in ks:  # the client's routing follows the slot
                    self._read_one(d, k, got, errors)
                continue
            try:
                if isinstance(replies, BaseException):
                    raise replies
                reads = [self._replied(r) for r in replies]
            except Exception as e:
                self._read_failed(d, ks, e, errors)
                self._count(gets=len(ks) - sum(k in errors for k in ks))
                continue
            self._reached(d)
            self._got(ks, reads, got)
        return got, errors

    def _got(self, keys: list[str], reads: list[Read], got: dict[str, bytes | None]) -> None:
        blobs = [b for r in reads for b in r.blobs]
        got.update(zip(keys, blobs))
        self._oversized([keys[i * _CHUNK_KEYS + j] for i, r in enumerate(reads)
                         for j in r.oversized])
        self._count(gets=len(keys), hits=sum(b is not None for b in blobs))

    def _read_one(self, d: int, key: str, got: dict[str, Any],
                  errors: dict[str, StoreError]) -> None:
        """``get`` of ``key`` through the client (which follows a slot that moved)."""
        try:
            read = self._spaces[d].get(self._client, key, self.blob_cap)
        except Exception as e:
            self._read_failed(d, [key], e, errors)
            self._count(gets=int(key not in errors))
            return
        self._reached(d)
        self._got([key], [read], got)

    def get(self, key: str) -> bytes | None:
        """The whole blob under ``key`` (and marks it recently used), or None (also
        for a blob over the cap, and in ``RedisClusterStore`` when its node is down).

        Raises:
          StoreError: the key could not be read (a standalone server down, a reply
            that broke the protocol).
        """
        self._domain(key)
        self._check_open()
        got, errors = self._read([key])
        if key in errors:
            raise errors[key]
        return got.get(key)

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        """The blob (or None) of each key, in order, each marked recently used (see
        ``Store.get_many``): one transaction per domain, one round trip per server.

        A key given twice is read once. Keys of a domain that cannot be read are
        ``StoreBatchError``s here (misses in ``RedisClusterStore`` when their node is
        down), never an error that loses the other keys.
        """
        keys = batch_keys(keys)
        self._check_open()
        got, errors = self._read(list(dict.fromkeys(keys)))
        return _gather("get_many", keys, got, errors)

    def _contains(self, keys: list[str]) -> tuple[dict[str, bool], dict[str, StoreError]]:
        """``contains`` of distinct, checked ``keys`` (see ``_read``)."""
        domains = self._by_domain(keys)
        cap = self.blob_cap
        got: dict[str, bool] = {}
        errors: dict[str, StoreError] = {}
        plan: dict[int, list[Block]] = {}
        for d, ks in domains.items():
            if self._held(d):
                self._count(read_errors=len(ks))
                got.update(dict.fromkeys(ks, False))
                continue
            plan[d] = [self._spaces[d].contains_block(c, cap) for c in self._chunks(ks)]
        for d, replies in self._run(plan).items():
            ks = domains[d]
            try:
                if isinstance(replies, BaseException):
                    raise replies
                if self._redirected(replies):
                    found = [self._spaces[d].contains(self._client, k, cap) for k in ks]
                else:
                    found = [f for r in replies for f in self._replied(r)]
            except Exception as e:
                self._read_failed(d, ks, e, errors)
                got.update((k, False) for k in ks if k not in errors)
                continue
            self._reached(d)
            got.update(zip(ks, found))
        return got, errors

    def contains(self, key: str) -> bool:
        """Whether a blob is stored under ``key`` (not marking it used); False in
        ``RedisClusterStore`` when its node is down.

        Raises:
          StoreError: as ``get``.
        """
        self._domain(key)
        self._check_open()
        got, errors = self._contains([key])
        if key in errors:
            raise errors[key]
        return got[key]

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        """Whether a blob is stored under each key, in order (not marking them used):
        one round trip per server."""
        keys = batch_keys(keys)
        self._check_open()
        got, errors = self._contains(list(dict.fromkeys(keys)))
        return _gather("contains_many", keys, got, errors)

    # -- writes -----------------------------------------------------------------------

    def _put(self, domains: dict[int, Views], replace: bool
             ) -> tuple[dict[str, bool], dict[str, StoreError]]:
        """The puts of each domain's ``(key, blob)`` pairs (distinct keys, checked):
        whether each wrote, and the error of each that failed."""
        done: dict[str, bool] = {}
        errors: dict[str, StoreError] = {}
        plan: dict[int, list[Block]] = {}
        for d, kv in domains.items():
            if self._held(d):
                err = self._refuse(d, f"cannot write {self._names([k for k, _ in kv])}")
                errors.update((k, err) for k, _ in kv)
                continue
            plan[d] = [self._spaces[d].put_block(c, replace, self._caps[d])
                       for c in _put_chunks(kv)]
        for d, replies in self._run(plan).items():
            kv = domains[d]
            if isinstance(replies, BaseException):
                err = self._write_failed(d, [k for k, _ in kv], replies)
                errors.update((k, err) for k, _ in kv)
            elif self._redirected(replies):
                for key, view in kv:
                    self._put_one(d, key, view, replace, done, errors)
            else:
                self._put_replies(d, kv, replies, done, errors)
        return done, errors

    def _put_replies(self, d: int, kv: Views, replies: list[BlockReply],
                     done: dict[str, bool], errors: dict[str, StoreError]) -> None:
        """What each put of domain ``d`` did, from its transactions' replies."""
        outcomes: list[tuple[int, bool] | BaseException] = []
        for chunk, r in zip(_put_chunks(kv), replies, strict=True):
            outcomes += [r.error] * len(chunk) if r.error is not None else r.replies
        self._wrote(d, kv, outcomes, done, errors)

    def _put_one(self, d: int, key: str, view: memoryview, replace: bool,
                 done: dict[str, bool], errors: dict[str, StoreError]) -> None:
        """``put`` of ``key`` through the client (which follows a slot that moved)."""
        try:
            outcome: Any = self._spaces[d].put(self._client, key, view, replace,
                                               self._caps[d])
        except Exception as e:
            outcome = e
        self._wrote(d, [(key, view)], [outcome], done, errors, unmarked=True)

    def _wrote(self, d: int, kv: Views, outcomes: list[tuple[int, bool] | BaseException],
               done: dict[str, bool], errors: dict[str, StoreError],
               unmarked: bool = False) -> None:
        space = self._spaces[d]
        evictions, written, reached = 0, 0, False
        for (key, _), outcome in zip(kv, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                errors[key] = self._write_failed(d, [key], outcome)
                continue
            reached = True
            evicted, stored = outcome
            if evicted == -2:
                if not unmarked:
                    try:
                        space.unmark(self._client, key)
                    except Exception:
                        pass  # a marker is a miss to every reader; the next put replaces it
                errors[key] = StoreError(
                    f"{self._where}: cannot write key {key!r}: its byte counter "
                    f"{space.meta[2]!r} is not an integer (another client overwrote it); "
                    "nothing was written")
                continue
            done[key] = stored
            evictions += max(0, evicted)
            written += 1
        if reached:
            self._reached(d)
        self._count(puts=written, evictions=evictions)

    def put(self, key: str, blob: bytes, *, replace: bool = False) -> bool:
        """Stores ``blob`` under ``key`` (see ``Store.put``); atomic across all clients.

        Raises:
          ValueError: ``blob`` is larger than the capacity (its domain's share) or the
            blob cap.
          StoreError: the key's domain cannot be written (its server is down, or its
            reply broke the protocol).
        """
        d, view = self._blob(key, blob)
        self._check_open()
        done, errors = self._put({d: [(key, view)]}, replace)
        if key in errors:
            raise errors[key]
        return done[key]

    def put_many(self, items: Iterable[tuple[str, bytes]] | Mapping[str, bytes], *,
                 replace: bool = False) -> list[bool]:
        """``put`` of each ``(key, blob)``, with its semantics per key (see
        ``Store.put_many``): one transaction per domain, one round trip per server.

        Every key and blob is checked (and every blob against its domain's share of
        the capacity and the blob cap) before any is written.

        Raises:
          ValueError: a blob is larger than the capacity (its domain's share) or the
            blob cap.
          StoreBatchError: the keys of some domain could not be written (``results``
            holds the others').
        """
        pairs = batch_items(items)
        domains: dict[int, Views] = {}
        for k, blob in _writes(pairs, replace).items():
            d, view = self._blob(k, blob)
            domains.setdefault(d, []).append((k, view))
        self._check_open()
        done, errors = self._put(domains, replace)
        return _gather_puts(pairs, done, errors, replace)

    def delete(self, key: str) -> bool:
        """Removes ``key``; returns whether it was there.

        Raises:
          StoreError: as ``put``.
        """
        d = self._domain(key)
        self._check_open()
        if self._held(d):
            raise self._refuse(d, f"cannot delete key {key!r}")
        space = self._spaces[d]
        replies = self._run({d: [space.delete_block(key)]})[d]
        try:
            if isinstance(replies, BaseException):
                raise replies
            if self._redirected(replies):
                found = space.delete(self._client, key)
            else:
                found = self._replied(replies[0])
        except Exception as e:
            raise self._write_failed(d, [key], e, "delete") from e
        self._reached(d)
        return found


def _put_chunks(kv: Views) -> list[Views]:
    """``kv`` in transactions of at most ``_CHUNK_KEYS`` keys and about ``_CHUNK_BYTES``."""
    out: list[Views] = []
    size = 0
    for item in kv:
        if not out or len(out[-1]) == _CHUNK_KEYS or size + item[1].nbytes > _CHUNK_BYTES:
            out.append([])
            size = 0
        out[-1].append(item)
        size += item[1].nbytes
    return out
