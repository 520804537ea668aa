"""``DiskStore``: page blobs as files in one directory, each visible only once whole.

One file per blob. A put writes a temporary file in the same directory, stamps it,
fsyncs it and links (or renames) it into place, then fsyncs the directory: a reader
sees either no file or a whole one. Every file is a small frame around the blob,

    magic "KVXBLOB1" | key length u32 | blob length u64 | crc32 | key | blob | crc32 | "KVXBEND1"

(little-endian; the crc32 covers the head and the key), so a file that lost its tail
(a crash the file system did not protect, a copy cut short) is a miss, never a
partial blob. The blob itself is not checksummed here: the device digests inside it
are checked when the page is loaded.

The store reads only regular files and never blocks on an entry: a FIFO, a device, a
socket, a directory or a symbolic link under a blob's name is skipped, and so is a
file this process may not open or may not remove when evicting; each is counted in
``stats()["skipped"]`` and named in a warning, and the store goes on with the rest.
A frame's declared blob size must equal the file's size and, with
``max_blob_bytes`` (or ``cap_blob_bytes``), be within it before a byte of the blob is
read (a file larger than that, or than the capacity, is a miss, counted in
``oversized``). A file no put of the store could have written (larger than the
capacity, or framing a blob over ``max_blob_bytes``) is never charged against the
capacity, so never makes good pages leave: it is skipped (counted in ``skipped``,
named in a warning) and left in place. A directory this process may not write opens
read-only: gets work, puts and deletes raise ``StoreError``.

Recency is the file's modification time, set on put and on every hit, so the LRU
order survives a restart; capacity is kept by evicting the least recently used
files. Several processes may share a directory: links and renames are atomic,
evictions are serialised by a lock file, a temporary file is removed on open only
when its writer no longer holds its lock (a writer killed mid-put), and a reader of
a file another process evicts reads the whole blob or misses.

The file format is ``kvxfer/store/_frame.py``; the directory's index, lock file,
cleaning and eviction are ``kvxfer/store/_directory.py``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from kvxfer._check import check_int
from kvxfer.store._base import (Store, StoreError, _gather, _gather_puts, _writes,
                                batch_items, batch_keys)
from kvxfer.store._directory import _TMP, Directory
from kvxfer.store._frame import (FRAME_BYTES, _GONE, _blob_view, _Frame, _frame,
                                 _frame_of, _key_bytes, _name, _open_regular, _pread_all,
                                 _read_frame, _Unreadable, _write_all, file_name)

log = logging.getLogger("kvxfer")

__all__ = ["DiskStore", "file_name", "FRAME_BYTES"]

_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV}


class DiskStore(Directory, Store):
    """Page blobs as files in one directory, with a capacity and LRU eviction.

    Reopening a directory finds its blobs again (in their LRU order). Opening removes
    what a crash left behind: temporary files no live writer holds, and files that
    are not whole. Thread-safe; several processes may share one directory (on a local
    file system: the lock files rely on ``flock``).

    Entries it cannot read (not regular files, or not this process's to open) are
    skipped, as are files it may not remove when evicting: each is counted once in
    ``stats()["skipped"]`` and named in a warning. A directory this process may not
    write opens read-only (``read_only``): gets work, puts and deletes raise.

    Capacity counts the bytes of the files (blob, key and a 36-byte frame). Each
    process keeps it from its view of the directory: its own puts and deletes, and
    rescans (at most once a second) when the directory changed under it; several
    writers may exceed it by what the others wrote since a writer's last rescan. A
    file larger than the capacity, or framing a blob over ``max_blob_bytes``, is no
    put's: it is skipped, never charged (a sparse file claiming gigabytes evicts
    nothing).

    Args:
      path: the directory (created if missing).
      capacity_bytes: the most bytes the files may hold; None for no limit.
      max_blob_bytes: the largest blob this store reads or writes; None for no limit
        beyond the file's size. A file framing a larger blob is a miss, refused
        before its blob is read (a sparse file may claim gigabytes it does not hold).
      durable: fsync the directory after each put, so a put that returned survives a
        crash. False saves that second sync (about half a put's time on ext4): a
        crash may then lose the latest puts (misses), never expose a partial blob,
        since every file's bytes are synced before its name appears.

    Raises:
      StoreError: the directory cannot be created, opened or listed.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     with DiskStore(d, capacity_bytes=1 << 20) as store:
        ...         store.put("geo/page-1", b"abc"), store.put("geo/page-1", b"xyz")
        ...     with DiskStore(d) as store:  # after a restart
        ...         store.get("geo/page-1"), store.get("geo/page-2")
        (True, False)
        (b'abc', None)
    """

    name = "disk"

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int | None = None, *,
                 max_blob_bytes: int | None = None, durable: bool = True):
        try:
            self.path = os.fspath(path)
        except TypeError:
            raise TypeError(f"Expected a directory path. Got {path!r} of type "
                            f"{type(path).__name__}") from None
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"Expected a non-empty directory path. Got {path!r}")
        self.capacity_bytes = None if capacity_bytes is None else \
            check_int(capacity_bytes, "capacity_bytes", minimum=1)
        self.max_blob_bytes = None if max_blob_bytes is None else \
            check_int(max_blob_bytes, "max_blob_bytes", minimum=0)
        if not isinstance(durable, bool):
            raise TypeError(f"Expected a bool for durable. Got {durable!r} of type "
                            f"{type(durable).__name__}")
        self.durable = durable
        self._hard_links = True
        try:
            self._open_directory()
        except OSError as e:
            raise StoreError(f"disk store {self.path!r}: cannot open: {e}") from e
        if self.max_blob_bytes is not None:
            self._limit_blobs(self.max_blob_bytes)

    def __repr__(self) -> str:
        return (f"DiskStore({self.path!r}, capacity_bytes={self.capacity_bytes!r}, "
                f"max_blob_bytes={self.max_blob_bytes!r}, durable={self.durable!r})")

    # -- the Store interface ------------------------------------------------------

    def _checked(self, key: str, blob: Any) -> tuple[bytes, memoryview, str, int]:
        """``key``'s bytes, ``blob``'s view, its file name and file size, checked
        against ``capacity_bytes`` and ``max_blob_bytes``."""
        kb = _key_bytes(key)
        view = _blob_view(blob)
        size = FRAME_BYTES + len(kb) + view.nbytes
        if self.capacity_bytes is not None and size > self.capacity_bytes:
            raise ValueError(f"blob of {view.nbytes} bytes for key {key!r} takes a file of "
                             f"{size} bytes, more than capacity_bytes={self.capacity_bytes}")
        if self.max_blob_bytes is not None and view.nbytes > self.max_blob_bytes:
            raise ValueError(f"blob of {view.nbytes} bytes for key {key!r} is larger than "
                             f"max_blob_bytes={self.max_blob_bytes}")
        return kb, view, _name(key, kb), size

    def put(self, key: str, blob: bytes, *, replace: bool = False) -> bool:
        """Stores ``blob`` under ``key`` (see ``Store.put``); whole on disk once it
        returns, and (``durable``) its name too."""
        kb, view, name, size = self._checked(key, blob)
        self._check_writable(key)
        with self._lock:
            self._counts["puts"] += 1
        try:
            dir_before = os.fstat(self._dir_fd).st_mtime_ns
            stamp = self._place(name, kb, view, replace)
            if stamp is None:
                return False
            if self.durable:
                os.fsync(self._dir_fd)
            self._placed([(name, size, stamp)], dir_before)
            return True
        except OSError as e:
            raise StoreError(f"disk store {self.path!r}: cannot write key {key!r}: {e}") from e

    def _place(self, name: str, kb: bytes, view: memoryview, replace: bool) -> int | None:
        """Writes one blob's file and puts it in place (its stamp), or None: a whole
        file was there and ``replace`` is False."""
        final = os.path.join(self.path, name)
        if not replace and self._whole(final, kb):
            return None
        for attempt in range(3):
            try:
                return self._write(final, kb, view, replace)
            except FileNotFoundError:
                # Another process's open took our temporary file for a dead
                # writer's between its creation and our lock: write it again.
                if attempt == 2 or not os.path.isdir(self.path):
                    raise
        raise AssertionError("unreachable")

    def _placed(self, files: list[tuple[str, int, int]], dir_before: int) -> None:
        """Indexes the files just placed (name, size, stamp), then evicts past the
        capacity (sparing the last of them, as each put spares its own)."""
        with self._lock:
            self._note_own_change(dir_before)
            for name, size, stamp in files:
                self._remember(name, size, stamp)
            self._maybe_rescan()
            if self.capacity_bytes is not None and self._used > self.capacity_bytes:
                with self._dir_locked():
                    self._evict(keep=files[-1][0])

    def put_many(self, items: Iterable[tuple[str, bytes]] | Mapping[str, bytes], *,
                 replace: bool = False) -> list[bool]:
        """``put`` of each ``(key, blob)``, with its semantics per key (see
        ``Store.put_many``), in one pass: every file written, placed and indexed (and
        the least recently used evicted past the capacity) in turn, then one fsync of
        the directory (``durable``) for the whole batch.

        Every key and blob is checked (against ``capacity_bytes`` and
        ``max_blob_bytes`` too) before any is written.

        Raises:
          ValueError: a blob is too large for the capacity or ``max_blob_bytes``.
          StoreBatchError: some keys could not be written (``results`` holds the
            others').
        """
        pairs = batch_items(items)
        order = {k: self._checked(k, blob) for k, blob in _writes(pairs, replace).items()}
        if not order:
            return []
        self._check_writable(next(iter(order)))
        with self._lock:
            self._counts["puts"] += len(order)
        done: dict[str, bool] = {}
        errors: dict[str, StoreError] = {}
        for key, (kb, view, name, size) in order.items():
            try:
                dir_before = os.fstat(self._dir_fd).st_mtime_ns
                stamp = self._place(name, kb, view, replace)
                done[key] = stamp is not None
                if stamp is not None:
                    # Indexed (and evicting) key by key, as a loop of puts would: a key
                    # the batch's own puts evict is absent when a later one comes.
                    self._placed([(name, size, stamp)], dir_before)
            except OSError as e:
                errors[key] = StoreError(f"disk store {self.path!r}: cannot write key "
                                         f"{key!r}: {e}")
        if self.durable and any(done.values()):
            try:
                os.fsync(self._dir_fd)
            except OSError as e:  # placed, but not known to be durable: not reported done
                err = StoreError(f"disk store {self.path!r}: cannot sync the directory "
                                 f"after writing {sum(done.values())} keys: {e}")
                for key in [k for k, wrote in done.items() if wrote]:
                    errors[key] = err
                    del done[key]
        return _gather_puts(pairs, done, errors, replace)

    def get(self, key: str) -> bytes | None:
        """The whole blob under ``key`` (and marks it recently used), or None."""
        kb = _key_bytes(key)
        self._check_open()
        blob, hit = self._read(key, kb, _name(key, kb))
        if hit is not None:
            self._remember(*hit, gets=1, hits=1)
        return blob

    def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        """The blob (or None) of each key, in order, each marked recently used (see
        ``Store.get_many``), in one pass over their files. A file that fails its checks
        (not whole, another key's, over ``max_blob_bytes``) is a miss for its key only,
        counted as ``get`` counts it; a key given twice is read once.

        Raises:
          StoreBatchError: some files could not be read (``results`` holds the others').
        """
        keys = batch_keys(keys)
        self._check_open()
        got: dict[str, bytes | None] = {}
        errors: dict[str, StoreError] = {}
        hits = []
        for key in dict.fromkeys(keys):
            kb = _key_bytes(key)
            try:
                got[key], hit = self._read(key, kb, _name(key, kb))
            except StoreError as e:
                errors[key] = e
                continue
            if hit is not None:
                hits.append(hit)
        with self._lock:
            for hit in hits:
                self._remember(*hit, gets=1, hits=1)
        return _gather("get_many", keys, got, errors)

    def _read(self, key: str, kb: bytes, name: str
              ) -> tuple[bytes | None, tuple[str, int, int] | None]:
        """The blob of ``key`` (its file marked used) and its index entry (name, size,
        stamp) to remember, or ``(None, None)``: a miss, counted (a get)."""
        try:
            fd = _open_regular(os.path.join(self.path, name))
        except FileNotFoundError:
            self._forget(name, gets=1)
            return None, None
        except _Unreadable as e:
            self._skip(name, str(e))
            self._count(gets=1)
            return None, None
        except OSError as e:
            raise StoreError(f"disk store {self.path!r}: cannot read key {key!r}: {e}") from e
        try:
            frame = _read_frame(fd, kb)
            blob = None
            if frame is not None and frame.key == kb:
                if not self._fits(frame):
                    log.warning("blob under key %r in the disk store %s is %d bytes (a "
                                "file of %d), more than max_blob_bytes=%s or "
                                "capacity_bytes=%s: a miss, not read", key, self.path,
                                frame.blob_len, frame.size, self.max_blob_bytes,
                                self.capacity_bytes)
                    self._count(gets=1, oversized=1)
                    return None, None
                blob = _pread_all(fd, frame.blob_len, frame.blob_offset)
            if blob is None:
                # (A whole file of another key with the same hashed name is a plain miss.)
                damaged = frame is None or frame.key == kb
                if damaged:
                    # Visible files are whole when placed: this one was damaged at rest
                    # (cut short, overwritten). A put of the key replaces it.
                    log.warning("blob under key %r in the disk store %s is damaged (not a "
                                "whole frame): a miss", key, self.path)
                self._forget(name, gets=1, incomplete=int(damaged))
                return None, None
            stamp = self._stamp()
            try:
                os.utime(fd, ns=(stamp, stamp))
            except OSError as e:
                # Another user's file, a read-only directory: readable, but its recency
                # is not ours to set.
                if e.errno not in (errno.EPERM, errno.EACCES, errno.EROFS):
                    raise
        except OSError as e:
            raise StoreError(f"disk store {self.path!r}: cannot read key {key!r}: {e}") from e
        finally:
            os.close(fd)
        return blob, (name, frame.size, stamp)

    def contains(self, key: str) -> bool:
        """Whether a whole blob is stored under ``key`` (not marking it used)."""
        kb = _key_bytes(key)
        self._check_open()
        try:
            frame = self._frame_for(os.path.join(self.path, _name(key, kb)), kb)
            return frame is not None and self._fits(frame)
        except OSError as e:
            raise StoreError(f"disk store {self.path!r}: cannot read key {key!r}: {e}") from e

    def delete(self, key: str) -> bool:
        """Removes ``key``; returns whether it was there."""
        name = file_name(key)
        self._check_writable(key)
        try:
            os.unlink(os.path.join(self.path, name))
        except FileNotFoundError:
            self._forget(name)
            return False
        except OSError as e:
            raise StoreError(f"disk store {self.path!r}: cannot delete key {key!r}: {e}") from e
        self._forget(name)
        return True

    def keys(self) -> list[str]:
        """The keys of the whole blobs in the directory, least recently used first."""
        self._check_open()
        out = []
        try:
            with self._lock:
                self._rescan()
                names = list(self._index)
            for name in names:
                try:
                    frame = _frame_of(os.path.join(self.path, name))
                except _Unreadable as e:
                    self._skip(name, str(e))
                    continue
                if frame is _GONE:
                    continue
                try:
                    key = frame.key.decode("utf-8") if frame and frame.key else None
                except UnicodeDecodeError:  # a whole frame no put of this store wrote
                    key = None
                if key is not None and file_name(key) == name:
                    out.append(key)
        except OSError as e:
            raise StoreError(f"disk store {self.path!r}: cannot list keys: {e}") from e
        return out

    def stats(self) -> dict[str, Any]:
        """Counters (see ``Store.stats``) with ``blobs`` and ``bytes`` read from the
        directory now; also ``incomplete`` (files found not whole on a read), ``cleaned``
        (leftovers removed on open), ``skipped`` (entries it could not read or evict,
        each counted once), ``oversized`` (gets refused by ``max_blob_bytes``),
        ``read_only`` and ``path``."""
        self._check_open()
        with self._lock:
            try:
                self._rescan()
            except OSError as e:
                raise StoreError(f"disk store {self.path!r}: cannot list: {e}") from e
            return {"name": self.name, "path": self.path, "blobs": len(self._index),
                    "bytes": self._used, "capacity_bytes": self.capacity_bytes,
                    "max_blob_bytes": self.max_blob_bytes, "read_only": self.read_only,
                    **self._counts}

    def close(self) -> None:
        """Closes the directory's handles (the blobs stay)."""
        self._close_directory()

    def cap_blob_bytes(self, max_bytes: int) -> None:
        """See ``Store.cap_blob_bytes``: sets ``max_blob_bytes`` to the cap (the largest
        asked for, never above the ``max_blob_bytes`` the store was built with); a
        file framing a larger blob is refused from its frame's head, before a byte of
        its blob is read (a miss, counted in ``oversized``), and so is a put of one
        (``ValueError``)."""
        super().cap_blob_bytes(max_bytes)
        with self._lock:
            self.max_blob_bytes = self.blob_cap
            if self._dir_fd >= 0:
                try:
                    self._rescan()  # files over the cap are no longer charged
                except OSError as e:
                    raise StoreError(f"disk store {self.path!r}: cannot list: {e}") from e

    # -- files --------------------------------------------------------------------

    def _fits(self, frame: _Frame) -> bool:
        return (self.max_blob_bytes is None or frame.blob_len <= self.max_blob_bytes) and \
            (self.capacity_bytes is None or frame.size <= self.capacity_bytes)

    def _frame_for(self, path: str, kb: bytes) -> _Frame | None:
        """The frame of the readable, whole file at ``path`` if it holds ``kb``, or None."""
        try:
            fd = _open_regular(path)
        except FileNotFoundError:
            return None
        except _Unreadable as e:
            self._skip(os.path.basename(path), str(e))
            return None
        try:
            frame = _read_frame(fd, kb)
        finally:
            os.close(fd)
        return frame if frame is not None and frame.key == kb else None

    def _whole(self, path: str, kb: bytes) -> bool:
        return self._frame_for(path, kb) is not None

    def _write(self, final: str, kb: bytes, view: memoryview, replace: bool) -> int | None:
        """Writes a temporary file and puts it in place; returns its modification time,
        or None (nothing written) when a whole file was there and ``replace`` is False.

        Raises:
          FileNotFoundError: the temporary file was taken away before it was in place.
        """
        tmp = os.path.join(self.path, f"{_TMP}{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            # Held until the file is in place: an open in another process removes
            # only temporary files nobody holds (a writer killed mid-put).
            fcntl.flock(fd, fcntl.LOCK_EX)
            head, tail = _frame(kb, view.nbytes)
            _write_all(fd, head)
            _write_all(fd, view)
            _write_all(fd, tail)
            stamp = self._stamp()
            os.utime(fd, ns=(stamp, stamp))
            os.fsync(fd)
            if replace:
                os.replace(tmp, final)
                return stamp
            return stamp if self._place_new(tmp, final, kb) else None
        finally:
            os.close(fd)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def _place_new(self, tmp: str, final: str, kb: bytes) -> bool:
        if self._hard_links:
            try:
                os.link(tmp, final)  # fails if the name exists: an atomic put-if-absent
                return True
            except FileExistsError:
                pass
            except OSError as e:
                if e.errno not in _NO_HARD_LINKS:
                    raise
                self._hard_links = False  # then check and rename: a race may replace
        if self._whole(final, kb):
            return False
        # Absent, or a file a crash cut short: take its place.
        os.replace(tmp, final)
        return True
