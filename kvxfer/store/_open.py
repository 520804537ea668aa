"""``open_store``: a store from the one-string spec the command line takes."""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Callable
from typing import Literal

from kvxfer.store._base import Store
from kvxfer.store._cluster import (CLUSTER_SCHEME, RedisClusterStore,
                                   check_cluster_spec)
from kvxfer.store._disk import DiskStore
from kvxfer.store._redis import URL_SCHEMES, RedisStore, check_url

__all__ = ["open_store", "parse_spec", "spec_argument", "SPEC_FORMS", "StoreKind"]

#: The kinds of store a spec names.
StoreKind = Literal["disk", "redis", "redis-cluster"]

#: The spec forms ``open_store`` takes, as error messages and ``--help`` print them.
SPEC_FORMS = ("DIR, file://DIR, redis://HOST:PORT[/DB] or "
              "redis+cluster://HOST:PORT[,HOST:PORT...]")


def open_store(spec: str | os.PathLike[str], *, capacity_bytes: int | None = None,
               prefix: str = "kvxfer:") -> Store:
    """The store that ``spec`` names.

    Args:
      spec: a directory (``DIR`` or ``file://DIR``) for a ``DiskStore``; a Redis URL
        (``redis://HOST:PORT[/DB]``, ``rediss://...``, ``unix://PATH``) for a
        ``RedisStore``; ``redis+cluster://HOST:PORT[,HOST:PORT...]`` (some nodes of a
        Redis Cluster) for a ``RedisClusterStore``.
      capacity_bytes: the store's capacity (None: no limit of its own).
      prefix: the key namespace of a Redis store (a ``DiskStore`` has its directory).

    Raises:
      ValueError: an empty spec, an unknown scheme, a malformed Redis URL.
      StoreError: the store cannot be opened or reached.
      ImportError: a Redis URL without redis-py installed.

    Example:
        >>> try:
        ...     open_store("s3://bucket/pages")
        ... except ValueError as e:
        ...     print(str(e).split(". Got ")[1])
        's3://bucket/pages': unknown scheme 's3://'
    """
    kind, where = parse_spec(spec)
    if kind == "disk":
        return DiskStore(where, capacity_bytes=capacity_bytes)
    if kind == "redis-cluster":
        return RedisClusterStore(where, prefix=prefix, capacity_bytes=capacity_bytes)
    return RedisStore(where, prefix=prefix, capacity_bytes=capacity_bytes)


def _directory(path: str, bad: Callable[[str], ValueError]) -> str:
    """``path`` unless something other than a directory is there (a file, a FIFO, a
    device: a disk store is a directory, created if missing)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return path
    if not stat.S_ISDIR(mode):
        what = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if (
            stat.S_ISCHR(mode) or stat.S_ISBLK(mode)) else "not a directory"
        raise bad(f"{path} is {what}; a disk store is a directory")
    return path


def spec_argument(text: str) -> str:
    """An argparse type for ``--store``: ``text`` if ``parse_spec`` accepts it.

    Example:
        >>> spec_argument("redis://127.0.0.1:6379")
        'redis://127.0.0.1:6379'
    """
    try:
        parse_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def parse_spec(spec: str | os.PathLike[str]) -> tuple[StoreKind, str]:
    """The kind of store ``spec`` names and its directory or URL, opening nothing.

    Raises:
      ValueError: an empty spec, an unknown scheme, a malformed Redis URL.

    Example:
        >>> parse_spec("file:///var/cache/kvxfer"), parse_spec("redis://10.0.0.5:6379/2")
        (('disk', '/var/cache/kvxfer'), ('redis', 'redis://10.0.0.5:6379/2'))
        >>> parse_spec("redis+cluster://10.0.0.5:7000,10.0.0.6:7000")
        ('redis-cluster', 'redis+cluster://10.0.0.5:7000,10.0.0.6:7000')
    """
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise TypeError(f"Expected a store spec ({SPEC_FORMS}) as a str. Got {spec!r} of "
                        f"type {type(spec).__name__}")

    def bad(why: str) -> ValueError:
        return ValueError(f"Expected a store spec {SPEC_FORMS}. Got {spec!r}: {why}")

    if not spec.strip():
        raise bad("it is empty")
    if "\0" in spec:
        raise bad("it holds a NUL character")
    scheme, sep, rest = spec.partition("://")
    if not sep:
        return "disk", _directory(spec, bad)
    if scheme == "file":
        if not rest:
            raise bad("no directory after file://")
        return "disk", _directory(rest, bad)
    if scheme == CLUSTER_SCHEME:
        return "redis-cluster", check_cluster_spec(spec)
    if scheme in URL_SCHEMES:
        return "redis", check_url(spec)
    raise bad(f"unknown scheme {scheme + '://'!r}")