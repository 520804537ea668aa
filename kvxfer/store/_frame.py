"""The file of one ``DiskStore`` blob: its name, its frame, and how it is opened.

Every file is a small frame around the blob,

    magic "KVXBLOB1" | key length u32 | blob length u64 | crc32 | key | blob | crc32 | "KVXBEND1"

(little-endian; the crc32 covers the head and the key), so a file that lost its tail
(a crash the file system did not protect, a copy cut short) is a miss, never a
partial blob. The blob itself is not checksummed here: the device digests inside it
are checked when the page is loaded.

A file is opened only if it is a regular file, without blocking and without following
a link (``_open_regular``); its frame is read from its head before any byte of the
blob, and a key length the file does not hold, or one that is not the key asked for,
is never read whole (a sparse file may claim gigabytes it does not hold).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import struct
import zlib
from typing import Any

__all__ = ["file_name", "FRAME_BYTES"]

_MAGIC, _END = b"KVXBLOB1", b"KVXBEND1"
_HEAD = struct.Struct("<8sIQI")  # magic, key bytes, blob bytes, crc32 of head + key
_TAIL = struct.Struct("<I8s")  # the same crc32, end magic
#: Bytes a file holds beyond its blob and its UTF-8 key (the frame's head and tail).
FRAME_BYTES = _HEAD.size + _TAIL.size
_SUFFIX = ".kvb"
_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789_-")
_PLAIN = re.compile(r"[a-z0-9_-]{1,200}")
_MAX_NAME = 200  # below every common file system's 255-byte limit, suffix included
# The longest key a frame is read for when no key is asked for (listing, cleaning): a
# sparse file may claim a key of gigabytes.
_MAX_KEY_READ = 1 << 20
# O_NONBLOCK: opening a FIFO or a device must not wait (it changes nothing for a
# regular file). O_NOFOLLOW: the store places only regular files, never links.
_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
# What an open of one entry may say of that entry (its kind, who may read it), as
# opposed to errors of the store or the process, which are StoreErrors.
_NOT_OURS = {errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENXIO, errno.ENODEV,
             errno.EOPNOTSUPP, errno.EISDIR, errno.EAGAIN, errno.ETXTBSY}
# Errors of the process, not of one entry: opening the directory must not hide them.
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"))


def file_name(key: str) -> str:
    """The file that holds ``key``'s blob: any string key gives a safe, unique name.

    Lower-case letters, digits, ``_`` and ``-`` are kept, every other UTF-8 byte is
    written ``%XX`` (so names differ on case-insensitive file systems too); a name
    that would be longer than 200 characters is ``=`` and the key's SHA-256 instead.
    The key itself is also stored in the file and checked on every read.

    Example:
        >>> file_name("geo-3fa2/page:00ff")
        'geo-3fa2%2Fpage%3A00ff.kvb'
        >>> file_name("x" * 300)[:9], len(file_name("x" * 300))
        ('=0d4e2ca9', 69)
    """
    return _name(key, _key_bytes(key))


def _name(key: str, raw: bytes) -> str:
    if _PLAIN.fullmatch(key):  # the common case, without a loop over the bytes
        return key + _SUFFIX
    name = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)
    if len(name) > _MAX_NAME:
        name = "=" + hashlib.sha256(raw).hexdigest()
    return name + _SUFFIX


def _key_bytes(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"Expected a str key. Got {key!r} of type {type(key).__name__}")
    if not key:
        raise ValueError("Expected a non-empty key. Got ''")
    try:
        return key.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"Expected a key that UTF-8 can encode. Got {key!r} (a lone "
                         "surrogate)") from None


def _blob_view(blob: Any) -> memoryview:
    try:
        view = memoryview(blob)
    except TypeError:
        raise TypeError(f"Expected a bytes-like blob. Got {type(blob).__name__}") from None
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


def _frame(kb: bytes, blob_len: int) -> tuple[bytes, bytes]:
    """The head (with the key) and the tail of a file holding a blob of ``blob_len``."""
    head = struct.pack("<8sIQ", _MAGIC, len(kb), blob_len)
    crc = zlib.crc32(head + kb)
    return head + struct.pack("<I", crc) + kb, _TAIL.pack(crc, _END)


def _pread_all(fd: int, n: int, offset: int) -> bytes | None:
    data = os.pread(fd, n, offset)
    if len(data) == n:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = os.pread(fd, n - got, offset + got)
        if not more:
            return None
        parts.append(more)
        got += len(more)
    return b"".join(parts)


class _Unreadable(Exception):
    """An entry the store does not read: not a regular file, or not one it may open."""


def _open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at ``path``, opened without blocking.

    Raises:
      FileNotFoundError: nothing is there.
      _Unreadable: what is there is not a regular file this process may open (says why).
    """
    try:
        fd = os.open(path, _READ)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Unreadable("a symbolic link (not followed)") from None
        if e.errno in _NOT_OURS:
            raise _Unreadable(f"cannot open it: {e.strerror}") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _Unreadable(_not_regular(mode))
    return fd


def _not_regular(mode: int) -> str:
    kind = next((name for test, name in _KINDS if test(mode)), f"mode {mode:#o}")
    return f"not a regular file but {kind}"


class _Frame:
    """What a whole file holds: its key, the blob's size and place, its file size."""

    __slots__ = ("key", "blob_len", "blob_offset", "size")

    def __init__(self, key: bytes | None, blob_len: int, blob_offset: int, size: int):
        self.key, self.blob_len, self.blob_offset, self.size = key, blob_len, blob_offset, size


_GONE = object()  # what _frame_of says of a file that is not there (any more)


def _frame_of(path: str) -> _Frame | None | object:
    """The frame of the file at ``path``, None when not one whole file, or ``_GONE``.

    Raises:
      _Unreadable: not a regular file this process may open.
    """
    try:
        fd = _open_regular(path)
    except FileNotFoundError:
        return _GONE
    try:
        return _read_frame(fd)
    finally:
        os.close(fd)


def _read_frame(fd: int, want: bytes | None = None) -> _Frame | None:
    """The frame of the open file ``fd``, or None when it is not one whole file.

    With ``want``, a frame whose key is not ``want``'s length is another key's (its key
    is not read: the frame says ``key=b""``, which no key is); without it, a key longer
    than ``_MAX_KEY_READ`` is not read either (the frame says ``key=None``: not known).
    """
    size = os.fstat(fd).st_size
    first = os.pread(fd, _HEAD.size + 256, 0)
    if len(first) < _HEAD.size:
        return None
    magic, klen, blen, crc = _HEAD.unpack_from(first)
    if magic != _MAGIC or size != _HEAD.size + klen + blen + _TAIL.size:
        return None
    if want is not None and klen != len(want):
        return _Frame(b"", blen, _HEAD.size + klen, size)
    if want is None and klen > _MAX_KEY_READ:
        return _Frame(None, blen, _HEAD.size + klen, size)
    kb = first[_HEAD.size:_HEAD.size + klen]
    if len(kb) < klen:
        kb = _pread_all(fd, klen, _HEAD.size)
        if kb is None:
            return None
    if zlib.crc32(first[:_HEAD.size - 4] + kb) != crc or \
            os.pread(fd, _TAIL.size, size - _TAIL.size) != _TAIL.pack(crc, _END):
        return None
    return _Frame(kb, blen, _HEAD.size + klen, size)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(fd, view):]
