"""The directory under a ``DiskStore``: which blob files it holds, their sizes and
recency, who may change it, what a crash left in it, and eviction to a capacity.

Recency is a file's modification time, set on put and on every hit, so the LRU order
survives a restart; capacity is kept by evicting the least recently used files.
Several processes may share a directory: evictions and cleaning are serialised by a
lock file (``flock``), a temporary file is removed on open only when its writer no
longer holds its lock (a writer killed mid-put), and each process rescans the
directory (at most once a second) when it changed under it. Entries the store cannot
read or may not remove are skipped, each counted once and named in a warning. A
directory this process may not write opens read-only.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import logging
import os
import stat
import threading
import time

from kvxfer.store._base import StoreError
from kvxfer.store._frame import (_GONE, _SUFFIX, FRAME_BYTES, _frame_of, _Unreadable,
                                 _not_regular, _open_regular, _read_frame)

log = logging.getLogger("kvxfer")

__all__ = ["Directory"]

_TMP = ".kvxfer-tmp-"
_LOCK = ".kvxfer-lock"
_RESCAN_S = 1.0  # at most one directory rescan a second for changes other processes made
# Errors of the process, not of one entry: opening the directory must not hide them.
_PROCESS_LIMITS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM}
_COUNTERS = ("puts", "gets", "hits", "evictions", "incomplete", "cleaned", "skipped",
             "oversized")


@dataclasses.dataclass(slots=True)
class _Entry:
    size: int  # bytes of the file
    stamp: int  # its modification time (ns): the recency



class Directory:
    """The directory of a ``DiskStore`` (its base): the index of its blob files (name
    to size and recency, least recently used first), the lock file, the counters.

    ``_open_directory`` opens it (cleaning and evicting as needed); the methods expect
    ``path`` and ``capacity_bytes`` set.
    """

    path: str
    capacity_bytes: int | None

    def _open_directory(self) -> None:
        """Creates (if missing) and opens the directory, removes what a crash left and
        evicts past the capacity.

        Raises:
          OSError: the directory cannot be created, opened or listed (closed again).
        """
        self._lock = threading.RLock()
        self._index: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._used = 0
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._skipped: set[str] = set()  # names counted in "skipped" (each once)
        self.read_only = False
        self._last_stamp = 0
        self._dir_fd = self._lock_fd = -1
        try:
            os.makedirs(self.path, exist_ok=True)
            self._dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            self._lock_fd = self._open_lock()
            with self._dir_locked():
                self._clean()
                self._rescan()
                self._evict(keep=None)
        except OSError:
            self._close_directory()
            raise

    def _close_directory(self) -> None:
        with self._lock:
            for fd in (self._dir_fd, self._lock_fd):
                if fd >= 0:
                    os.close(fd)
            self._dir_fd = self._lock_fd = -1

    def _check_open(self) -> None:
        if self._dir_fd < 0:
            raise StoreError(f"disk store {self.path!r} is closed")

    def _check_writable(self, key: str) -> None:
        self._check_open()
        if self.read_only:
            raise StoreError(f"disk store {self.path!r} is read-only (this process may not "
                             f"write the directory): cannot change key {key!r}")

    def _open_lock(self) -> int:
        """The lock file's descriptor (-1 if there is none to read); sets ``read_only``."""
        lock = os.path.join(self.path, _LOCK)
        flags = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
        self.read_only = not os.access(self.path, os.W_OK | os.X_OK)
        if not self.read_only:
            try:
                return os.open(lock, os.O_RDWR | os.O_CREAT | flags, 0o644)
            except OSError as e:
                if e.errno == errno.EROFS:
                    self.read_only = True
                elif e.errno not in (errno.EACCES, errno.EPERM):
                    raise
        # Another user's lock file, or a directory this process may only read: flock
        # needs no write access.
        try:
            return os.open(lock, os.O_RDONLY | flags)
        except FileNotFoundError:
            if not self.read_only:
                raise
            return -1  # nobody ever wrote here: there is no writer to serialise with


    def _clean(self) -> None:
        """Removes dead writers' temporary files and files that are not whole; skips
        (and counts) entries it cannot read, so that one of them never stops an open."""
        for entry in os.scandir(self.path):
            name = entry.name
            temporary = name.startswith(_TMP)
            if not temporary and (not name.endswith(_SUFFIX) or name.startswith(".")):
                continue
            try:
                if not entry.is_file(follow_symlinks=False):  # not opened at all
                    raise _Unreadable(_not_regular(entry.stat(follow_symlinks=False).st_mode))
                self._clean_one(entry.path, temporary)
            except FileNotFoundError:
                continue
            except _Unreadable as e:
                self._skip(name, str(e))
            except OSError as e:
                if e.errno in _PROCESS_LIMITS:
                    raise
                self._skip(name, f"cannot read it: {e.strerror}")

    def _clean_one(self, path: str, temporary: bool) -> None:
        fd = _open_regular(path)
        try:
            if temporary:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # a live writer holds it
                self._unlink_quietly(path)
            elif _read_frame(fd) is None:
                self._unlink_quietly(path)
        finally:
            os.close(fd)

    def _unlink_quietly(self, path: str) -> None:
        if self.read_only:
            return  # leftovers stay; reading them is a miss
        try:
            os.unlink(path)
            self._counts["cleaned"] += 1
        except FileNotFoundError:
            pass
        except OSError as e:  # another user's file in a sticky directory
            self._skip(os.path.basename(path), f"cannot remove it: {e.strerror}")

    # -- the index: sizes and recency of the files, least recent first ------------

    def _stamp(self) -> int:
        """A modification time for a put or a hit: now, and later than the last one."""
        with self._lock:
            self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
            return self._last_stamp

    def _skip(self, name: str, why: str) -> None:
        """Counts (once) and names an entry the store passes over."""
        with self._lock:
            if name in self._skipped:
                return
            self._skipped.add(name)
            self._counts["skipped"] += 1
        log.warning("disk store %s: skipping %s: %s", self.path,
                    os.path.join(self.path, name), why)

    def _count(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self._counts[k] += v

    def _remember(self, name: str, size: int, stamp: int, **counts: int) -> None:
        with self._lock:
            self._skipped.discard(name)  # readable now: counted again if it goes bad
            old = self._index.pop(name, None)
            self._used += size - (old.size if old else 0)
            self._index[name] = _Entry(size, stamp)
            for k, v in counts.items():
                self._counts[k] += v

    def _forget(self, name: str, **counts: int) -> None:
        with self._lock:
            old = self._index.pop(name, None)
            if old:
                self._used -= old.size
            for k, v in counts.items():
                self._counts[k] += v

    def _rescan(self) -> None:
        """Rebuilds the index from the directory (the truth) in modification-time order."""
        found = []
        for entry in os.scandir(self.path):
            if entry.name.endswith(_SUFFIX) and not entry.name.startswith("."):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue  # not a blob (skipped where it is read): no capacity of ours
                why = self._unchargeable(entry.path, st.st_size)
                if why is not None:
                    self._skip(entry.name, why)
                    continue
                found.append((st.st_mtime_ns, entry.name, st.st_size))
        found.sort()
        self._index = collections.OrderedDict((n, _Entry(s, t)) for t, n, s in found)
        self._used = sum(s for _, _, s in found)
        self._scanned_at = time.monotonic()
        self._dir_seen = os.fstat(self._dir_fd).st_mtime_ns

    def _unchargeable(self, path: str, size: int) -> str | None:
        """Why the file at ``path`` (of ``size`` bytes) holds no blob a put could have
        written here, or None. Such a file is never charged against the capacity (nor
        evicted): a sparse file claiming gigabytes would otherwise push out every good
        page. Its frame is read only when its size alone leaves room for doubt."""
        if self.capacity_bytes is not None and size > self.capacity_bytes:
            return (f"a file of {size} bytes, more than capacity_bytes="
                    f"{self.capacity_bytes}: no put of this store wrote it")
        limit = getattr(self, "max_blob_bytes", None)
        if limit is None or size <= limit + FRAME_BYTES:
            return None
        try:
            frame = _frame_of(path)
        except _Unreadable as e:
            return str(e)
        if frame is _GONE:
            return None  # (the next rescan does not see it)
        if frame is None:
            return f"a file of {size} bytes that is not one whole frame"
        if frame.blob_len > limit:
            return (f"it frames a blob of {frame.blob_len} bytes, more than "
                    f"max_blob_bytes={limit}")
        return None

    def _note_own_change(self, before: int) -> None:
        # A directory that changed only by our own put needs no rescan; one that
        # had changed before it (another process) keeps its stale mark.
        if before == self._dir_seen:
            self._dir_seen = os.fstat(self._dir_fd).st_mtime_ns

    def _maybe_rescan(self) -> None:
        if time.monotonic() - self._scanned_at >= _RESCAN_S and \
                os.fstat(self._dir_fd).st_mtime_ns != self._dir_seen:
            self._rescan()

    def _dir_locked(self):
        return _Flock(self._lock_fd)

    def _evict(self, keep: str | None) -> None:
        """Removes least recently used files until the bytes fit (caller holds the locks)."""
        if self.capacity_bytes is None or self.read_only:
            return
        skipped = set()
        while self._used > self.capacity_bytes and len(skipped) < len(self._index):
            name, entry = next((n, e) for n, e in self._index.items() if n not in skipped)
            if name == keep:
                skipped.add(name)
                continue
            path = os.path.join(self.path, name)
            try:
                st = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                self._forget(name)
                continue
            if not stat.S_ISREG(st.st_mode):  # replaced by something that is not a blob
                self._forget(name)
                continue
            if st.st_mtime_ns > entry.stamp:  # another process used it since we looked
                why = self._unchargeable(path, st.st_size)
                if why is None:
                    self._remember(name, st.st_size, st.st_mtime_ns)
                else:  # (replaced by a file no put wrote)
                    self._forget(name)
                    self._skip(name, why)
                continue
            try:
                os.unlink(path)
                self._counts["evictions"] += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                # Not ours to remove (another user's, in a sticky directory): it keeps
                # its bytes, and the next least recently used file goes instead.
                self._skip(name, f"cannot evict it: {e.strerror}")
                skipped.add(name)
                continue
            self._forget(name)


class _Flock:
    """The directory's lock file held exclusively (serialises evictions and cleaning)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __enter__(self) -> None:
        if self.fd >= 0:  # (none in a read-only directory nobody wrote)
            fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
