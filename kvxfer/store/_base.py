"""The one interface every store tier below host memory implements.

A store maps string keys to opaque page blobs (``KVCacheManager.export_page``
makes them; ``import_page`` checks them). A store never interprets a blob: the
identity, geometry fingerprint and device digests inside it are checked by the
manager, and the bytes are checked on the device when the page is loaded.

The batched calls (``get_many``, ``put_many``, ``contains_many``) have defaults here
that loop over the single-key calls, so any ``Store`` has them; the stores of this
package override them with one round trip (Redis: per server) or one pass (disk).
"""

from __future__ import annotations

import abc
import functools
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvxfer._check import check_int

__all__ = ["Store", "StoreError", "StoreBatchError", "batch_keys", "batch_items"]


class StoreError(OSError):
    """A store that cannot be reached or written (never reported as a miss)."""


class StoreBatchError(StoreError):
    """A batched call some of whose keys failed with a ``StoreError`` (a server that
    cannot be reached or written, say); every other key was done.

    Attributes:
      results: what the call would have returned, in order, with ``None`` at each
        position that failed.
      errors: the error of each position that failed (its index in the batch).
    """

    def __init__(self, what: str, results: list[Any], errors: dict[int, StoreError]):
        first = errors[min(errors)]
        super().__init__(f"{what}: {len(errors)} of {len(results)} keys failed; the first, "
                         f"at position {min(errors)}: {first}")
        self.results, self.errors = results, errors


def _check_key(key: Any, where: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"Expected a str key{where}. Got {key!r} of type "
                        f"{type(key).__name__}")
    if not key:
        raise ValueError(f"Expected a non-empty key{where}. Got ''")
    return key


def batch_keys(keys: Iterable[str]) -> list[str]:
    """``keys`` as a list, each checked (a non-empty str) before anything is done.

    Raises:
      TypeError: ``keys`` is a single str (not a batch of them), or a key is no str.
      ValueError: a key is empty.

    Example:
        >>> batch_keys(iter(["a", "b"]))
        ['a', 'b']
        >>> batch_keys(["a", 7])
        Traceback (most recent call last):
        ...
        TypeError: Expected a str key at position 1. Got 7 of type int
    """
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"Expected an iterable of str keys. Got one {type(keys).__name__} "
                        f"{keys!r}: pass [key]")
    out = list(keys)
    for i, k in enumerate(out):
        _check_key(k, f" at position {i}")
    return out


def batch_items(items: Iterable[tuple[str, Any]] | Mapping[str, Any]
                ) -> list[tuple[str, Any]]:
    """``items`` (``(key, blob)`` pairs, or a mapping) as a list of pairs, each key and
    blob checked (a non-empty str, a bytes-like object) before anything is written.

    Raises:
      TypeError: an item that is not a pair, a key that is no str, a blob that is not
        bytes-like.
      ValueError: a key is empty.

    Example:
        >>> batch_items({"a": b"x", "b": bytearray(b"yz")})
        [('a', b'x'), ('b', bytearray(b'yz'))]
    """
    if isinstance(items, Mapping):
        items = items.items()
    elif isinstance(items, (str, bytes)):
        raise TypeError(f"Expected (key, blob) pairs or a mapping. Got a "
                        f"{type(items).__name__}")
    out = []
    for i, item in enumerate(items):
        try:
            key, blob = item
        except (TypeError, ValueError):
            raise TypeError(f"Expected a (key, blob) pair at position {i}. Got "
                            f"{type(item).__name__}") from None
        _check_key(key, f" at position {i}")
        try:
            memoryview(blob)
        except TypeError:
            raise TypeError(f"Expected a bytes-like blob for key {key!r} (position {i}). "
                            f"Got {type(blob).__name__}") from None
        out.append((key, blob))
    return out


class Store(abc.ABC):
    """Page blobs under string keys, with a capacity and LRU eviction.

    Implementations are thread-safe. ``get`` of a key that was never put, was
    evicted, or whose blob is incomplete (a write cut short by a crash) is a miss
    (``None``), never a partial blob.

    A store denies service only by misses, ``StoreError`` and its counters: what its
    server or its files do wrong (a connection lost, a reply of junk, a file that is
    not whole) never reaches a caller as another library's exception.
    """

    #: The tier's name in stats and warnings (``"disk"``, ``"redis"``).
    name: str = "store"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Every store keeps the blob cap on what it returns (``cap_blob_bytes``), its
        # own calls or not: a subclass's get, get_many and stats are wrapped here.
        super().__init_subclass__(**kwargs)
        for attr, wrap in (("get", _capped_get), ("get_many", _capped_get_many),
                           ("stats", _capped_stats)):
            fn = cls.__dict__.get(attr)
            if callable(fn) and not getattr(fn, "_kvxfer_capped", False):
                setattr(cls, attr, wrap(fn))

    @property
    def blob_cap(self) -> int | None:
        """The largest blob this store returns (``cap_blob_bytes``), or None: no cap."""
        return getattr(self, "_blob_cap", None)

    def cap_blob_bytes(self, max_bytes: int) -> None:
        """From now on this store never returns a blob larger than ``max_bytes``: such a
        blob is a miss for its key only, counted in ``stats()["oversized"]``.

        Several callers (caches of other page sizes over one store) get the largest
        cap any of them asked for, never more than a limit the store was built with
        (``DiskStore(max_blob_bytes=...)``). Every store has it: one that does not
        override this still has each blob its ``get`` and ``get_many`` return checked
        here. The stores of this package do better: ``DiskStore`` refuses a file from
        its frame header before reading its blob, the Redis stores fetch at most
        ``max_bytes + 1`` bytes of a blob; and they refuse to write a blob over the cap
        (``ValueError``), which they would never return.

        A cache sets it to the size of one of its pages (``HostCache`` does), so a blob
        that claims gigabytes under a page's key costs nothing.

        Args:
          max_bytes: the largest blob returned, in bytes (>= 0).

        Raises:
          TypeError, ValueError: ``max_bytes`` is not an integer >= 0.

        Example:
            >>> import tempfile
            >>> from kvxfer.store import DiskStore
            >>> with tempfile.TemporaryDirectory() as d, DiskStore(d) as s:
            ...     s.put("small", b"x" * 10), s.put("big", b"x" * 100)
            ...     s.cap_blob_bytes(50)
            ...     s.get_many(["small", "big"]), s.blob_cap, s.stats()["oversized"]
            ...     s.cap_blob_bytes(20)  # a second cache of smaller pages: the larger holds
            ...     s.blob_cap
            (True, True)
            ([b'xxxxxxxxxx', None], 50, 1)
            50
        """
        max_bytes = check_int(max_bytes, "max_bytes", minimum=0)
        with _CAP_LOCK:
            self._blob_asked = max(getattr(self, "_blob_asked", 0), max_bytes)
            self._settle_blob_cap()

    def _limit_blobs(self, max_bytes: int) -> None:
        """Sets the limit a store was built with: no ``cap_blob_bytes`` goes above it."""
        with _CAP_LOCK:
            self._blob_own = max_bytes
            self._settle_blob_cap()

    def _settle_blob_cap(self) -> None:
        asked, own = getattr(self, "_blob_asked", None), getattr(self, "_blob_own", None)
        self._blob_cap = own if asked is None else asked if own is None else min(own, asked)

    @abc.abstractmethod
    def put(self, key: str, blob: bytes, *, replace: bool = False) -> bool:
        """Stores ``blob`` under ``key``; returns False (nothing written) if present.

        With ``replace=True`` an existing blob is overwritten. May evict least
        recently used blobs to stay within the capacity.

        Raises:
          ValueError: ``blob`` alone exceeds the capacity.
          StoreError: the store cannot be written.
        """

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The whole blob under ``key`` (and marks it recently used), or None."""

    @abc.abstractmethod
    def contains(self, key: str) -> bool:
        """Whether a whole blob is stored under ``key`` (not marking it used)."""

    # -- batches: defaults over the single-key calls ----------------------------------

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        """The blob (or None) of each key, in order, each marked recently used, as
        ``get`` gives them; a key given twice is read once (and counted once).

        A blob that fails the store's own checks (a file cut short, say) is a miss for
        its key only. Keys are checked (non-empty str) before any is read.

        Raises:
          StoreBatchError: some keys could not be read (``results`` holds the others'
            blobs).
        """
        keys = batch_keys(keys)
        return _gather("get_many", keys, *_each(self.get, keys))

    def put_many(self, items: Iterable[tuple[str, bytes]] | Mapping[str, bytes], *,
                 replace: bool = False) -> list[bool]:
        """``put`` of each ``(key, blob)`` (or of a mapping's items); whether each was
        written, in order, with ``put``'s semantics per key: put-if-absent with exactly
        one winner across every client (``replace=True`` overwrites).

        A key given twice is written once: without ``replace`` its first blob, where it
        first appears (its later positions report False, as a second ``put`` would);
        with ``replace`` its last, where it last appears (every position reports what
        that put did). Keys and blobs are checked before any is written.

        Raises:
          ValueError: a blob alone exceeds the capacity (this store's ``put`` decides:
            the stores of this package check every blob before writing any).
          StoreBatchError: some keys could not be written (``results`` holds the
            others'; the failed ones may or may not have been written).
        """
        pairs = batch_items(items)
        order = _writes(pairs, replace)
        done: dict[str, bool] = {}
        errors: dict[str, StoreError] = {}
        for k, blob in order.items():
            try:
                done[k] = self.put(k, blob, replace=replace)
            except StoreError as e:
                errors[k] = e
        return _gather_puts(pairs, done, errors, replace)

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        """``contains`` of each key, in order (not marking them used).

        Raises:
          StoreBatchError: some keys could not be asked about (``results`` holds the
            others' answers).
        """
        keys = batch_keys(keys)
        return _gather("contains_many", keys, *_each(self.contains, keys))

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Removes ``key``; returns whether it was there."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: ``blobs``, ``bytes``, ``capacity_bytes``, ``puts``, ``gets``,
        ``hits``, ``evictions``; ``oversized`` (blobs refused by the cap) once
        ``cap_blob_bytes`` was called."""

    def close(self) -> None:
        """Releases connections or files (the stored blobs stay)."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- the blob cap every store keeps -------------------------------------------------

_CAP_LOCK = threading.Lock()  # (rare: a cap set, an oversized blob counted)


def _over(store: Store, blob: Any) -> bool:
    """Whether ``blob`` is over ``store``'s cap (and then counted)."""
    cap = getattr(store, "_blob_cap", None)
    if cap is None or blob is None:
        return False
    try:
        size = memoryview(blob).nbytes
    except TypeError:
        return False  # not a blob at all: not the cap's to judge
    if size <= cap:
        return False
    with _CAP_LOCK:
        store._blob_capped = getattr(store, "_blob_capped", 0) + 1
    return True


def _capped_get(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def get(self: Store, key: str) -> bytes | None:
        blob = fn(self, key)
        return None if _over(self, blob) else blob

    get._kvxfer_capped = True  # type: ignore[attr-defined]
    return get


def _capped_get_many(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def get_many(self: Store, keys: Iterable[str]) -> list[bytes | None]:
        try:
            blobs = fn(self, keys)
        except StoreBatchError as e:
            e.results = [None if _over(self, b) else b for b in e.results]
            raise
        return [None if _over(self, b) else b for b in blobs]

    get_many._kvxfer_capped = True  # type: ignore[attr-defined]
    return get_many


def _capped_stats(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def stats(self: Store) -> dict[str, Any]:
        out = fn(self)
        refused = getattr(self, "_blob_capped", 0)
        if isinstance(out, dict) and (refused or self.blob_cap is not None):
            out = dict(out)
            out["oversized"] = out.get("oversized", 0) + refused
        return out

    stats._kvxfer_capped = True  # type: ignore[attr-defined]
    return stats


# -- what the batched calls share --------------------------------------------------


def _writes(pairs: list[tuple[str, Any]], replace: bool) -> dict[str, Any]:
    """The blob each distinct key of a batch writes, in the order they are written: its
    first (where it first appears), or with ``replace`` its last (where it last
    appears: its recency is that of its last put)."""
    order: dict[str, Any] = {}
    for k, blob in pairs:
        if replace:
            order.pop(k, None)
            order[k] = blob
        elif k not in order:
            order[k] = blob
    return order


def _each(call: Callable[[str], Any], keys: list[str]
          ) -> tuple[dict[str, Any], dict[str, StoreError]]:
    """``call(key)`` once per distinct key: the results and the ``StoreError``s, by key."""
    got: dict[str, Any] = {}
    errors: dict[str, StoreError] = {}
    for k in dict.fromkeys(keys):
        try:
            got[k] = call(k)
        except StoreError as e:
            errors[k] = e
    return got, errors


def _gather(what: str, keys: list[str], got: dict[str, Any],
            errors: dict[str, StoreError]) -> list[Any]:
    """Per position, what its key got; raises ``StoreBatchError`` if some key failed."""
    results = [got.get(k) for k in keys]
    if errors:
        raise StoreBatchError(what, results, {i: errors[k] for i, k in enumerate(keys)
                                              if k in errors})
    return results


def _gather_puts(pairs: list[tuple[str, Any]], done: dict[str, bool],
                 errors: dict[str, StoreError], replace: bool) -> list[bool]:
    """Per position, whether its put wrote (see ``Store.put_many`` for keys given twice)."""
    results: list[Any] = []
    seen: set[str] = set()
    for k, _ in pairs:
        if k in errors:
            results.append(None)
        elif replace:
            results.append(done[k])
        else:
            results.append(done[k] if k not in seen else False)
        seen.add(k)
    if errors:
        raise StoreBatchError("put_many", results,
                              {i: errors[k] for i, (k, _) in enumerate(pairs) if k in errors})
    return results
