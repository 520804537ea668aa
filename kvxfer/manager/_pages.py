"""Pages as blobs: a page's bytes, device digests and identity, for tiers below host.

A blob is what ``KVCacheManager.export_page`` makes and ``import_page`` takes back::

    header  magic "KVXPAGE1" | format u32 | flags u32 | key u64 | seal u32 |
            classes u32 | total length u64 | geometry fingerprint (16 bytes)
    then, per slice class held:
            class index u32 | page bytes u64 | page bytes | digests uint32[L, S, 4]

A class's page bytes are its host slot's, shard-major: shard 0's blocks of every
layer, then shard 1's, ... (``SliceClass.shard_range``).

All integers are little-endian. The digests are the ones made on the device when
the page was first offloaded; they are bound to the page's key and *seal* (the
generation of the slot that made them), so an imported page is checked on the
device at load against exactly what left the first device. Nothing in a blob is
re-digested on the way in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer import integrity
from kvxfer.hostpool import DIGEST_SLOTS
from kvxfer.plan import Plan

__all__ = ["PAGE_FORMAT_VERSION", "PageFormatError", "PageBlob", "fingerprint", "encode",
           "decode", "first_span", "blob_bytes"]

PAGE_FORMAT_VERSION = 2
"""Version of the blob format and of what a page's bytes mean; in every fingerprint.

2: pages are shard-major (``SliceClass.shard_range``: each shard's layers side by
side). 1 was layer-major (each layer's shards side by side): the same bytes in
another order, so a version 1 page is refused (``"format version"``), and its store
keys (which carry the fingerprint) are never looked up.
"""

_MAGIC = b"KVXPAGE1"
_HEADER = struct.Struct("<8sIIQIIQ16s")
_CLASS = struct.Struct("<IQ")
_FLAG_DIGESTS = 1


class PageFormatError(ValueError):
    """A blob that is not a whole page of this manager's geometry (a miss, not a crash).

    Attributes:
      kind: what is wrong, in a few words fit for a metric label: ``"truncated"``
        (cut short, or longer than what it holds), ``"not a page"``, ``"format
        version"``, ``"unknown flags"``, ``"other geometry"``, ``"bad class"``,
        ``"wrong key"``, ``"no digests"``.
    """

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def _host_format(plan: Plan, c: Any) -> str:
    """``"dense"`` (logical blocks, any layout) or ``"device"`` (device bytes)."""
    return "dense" if plan.path == "staged" or not c.addressable else "device"


def _digest_check() -> list[int]:
    """The digest of a fixed page: changes exactly when the digest algorithm does."""
    words = np.arange(8, dtype=np.uint32)[None]
    return integrity.digest_np(words, integrity.identity_words(1, 2, 3, 4)[None])[0].tolist()


def fingerprint(plan: Plan, shard_shapes: Sequence[tuple[int, ...]]) -> bytes:
    """16 bytes naming what a page's bytes mean: KV geometry, host format, page format.

    Two managers share pages only if their fingerprints are equal: the same layers
    in the same order (block shape, dtype, shards and the shape of one shard, so
    what the shard-major host bytes hold), the same host representation (dense
    logical blocks, for which the device layout does not matter, or device bytes
    under a layout), the same page format version and the same digest algorithm.
    The number of blocks per layer is left out: it sizes a deployment, not a page.
    So is everything that is not geometry: two models of one geometry have equal
    fingerprints (a store tier keys pages by a namespace too).

    Args:
      plan: the manager's plan.
      shard_shapes: the shape of one block of one shard of each slice class.
    """
    classes = []
    for c, shard in zip(plan.classes, shard_shapes, strict=True):
        fmt = _host_format(plan, c)
        classes.append({
            "layers": list(c.layers), "dtype": c.dtype, "block": list(c.block_shape),
            "shards": c.num_shards, "shard": list(shard), "bytes": c.bytes_per_block,
            "format": fmt, "layout": str(c.layout) if fmt == "device" else None,
        })
    text = json.dumps({"format": PAGE_FORMAT_VERSION, "layers": plan.num_layers,
                       "digest_slots": DIGEST_SLOTS, "digest": _digest_check(),
                       "classes": classes}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"kvxfer-geom").digest()


@dataclasses.dataclass(frozen=True)
class PageBlob:
    """A decoded blob: identity, and per class its page bytes and digests."""

    key: int
    seal: int
    digested: bool
    data: dict[int, np.ndarray]     # class index -> uint8[page_bytes]
    digests: dict[int, np.ndarray]  # class index -> uint32[L, S, DIGEST_SLOTS]


def encode(plan: Plan, fp: bytes, key: int, seal: int, digested: bool,
           parts: dict[int, tuple[np.ndarray, np.ndarray]]) -> bytes:
    """The blob of one page; ``parts[c] = (page bytes, digests)`` per class held."""
    pieces = []
    for c, (data, dig) in sorted(parts.items()):
        pieces += [_CLASS.pack(c, data.nbytes), data.tobytes(),
                   np.ascontiguousarray(dig, dtype="<u4").tobytes()]
    total = _HEADER.size + sum(len(p) for p in pieces)
    header = _HEADER.pack(_MAGIC, PAGE_FORMAT_VERSION, _FLAG_DIGESTS if digested else 0,
                          key, seal, len(parts), total, fp)
    return b"".join([header] + pieces)


def decode(plan: Plan, fp: bytes, blob: bytes | bytearray | memoryview) -> PageBlob:
    """Checks a blob against this plan and splits it (no copy of the page bytes).

    Raises:
      PageFormatError: naming the first thing wrong (not a page blob, another
        format version, flag bits this version does not define, cut short or too
        long, another geometry, a class or size this plan does not have, bytes after
        the last class).
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"a page blob is bytes. Got {type(blob).__name__}")
    buf = memoryview(blob).cast("B")
    if len(buf) < _HEADER.size:
        raise PageFormatError(f"truncated page blob: {len(buf)} bytes, shorter than the "
                              f"{_HEADER.size}-byte header", "truncated")
    magic, version, flags, key, seal, n, total, their_fp = _HEADER.unpack_from(buf)
    if magic != _MAGIC:
        raise PageFormatError(f"not a kvxfer page blob (starts with {bytes(magic)!r})",
                              "not a page")
    if version != PAGE_FORMAT_VERSION:
        raise PageFormatError(f"page format version {version}; this kvxfer reads "
                              f"version {PAGE_FORMAT_VERSION}", "format version")
    if flags & ~_FLAG_DIGESTS:
        # A writer that set a bit meant something this reader would silently ignore.
        raise PageFormatError(f"page blob has unknown flag bits {flags & ~_FLAG_DIGESTS:#x} "
                              f"(flags {flags:#x}; version {PAGE_FORMAT_VERSION} defines "
                              f"only {_FLAG_DIGESTS:#x})", "unknown flags")
    if total != len(buf):
        raise PageFormatError(f"{'truncated' if len(buf) < total else 'oversized'} page "
                              f"blob: {len(buf)} bytes, its header says {total}", "truncated")
    if their_fp != fp:
        raise PageFormatError(f"page of another KV geometry (fingerprint "
                              f"{their_fp.hex()}, this manager's is {fp.hex()}): another "
                              "model, dtype, layout or page format", "other geometry")
    off = _HEADER.size
    data: dict[int, np.ndarray] = {}
    digests: dict[int, np.ndarray] = {}
    for _ in range(n):
        if off + _CLASS.size > len(buf):
            raise PageFormatError("truncated page blob: a class header is cut short",
                                  "truncated")
        c, nbytes = _CLASS.unpack_from(buf, off)
        off += _CLASS.size
        if c >= len(plan.classes) or c in data:
            raise PageFormatError(f"page blob names slice class {c} "
                                  f"{'twice' if c in data else 'that the plan lacks'}",
                                  "bad class")
        cls = plan.classes[c]
        if nbytes != cls.page_bytes:
            raise PageFormatError(f"page blob holds {nbytes} bytes for {cls.name}; its "
                                  f"pages are {cls.page_bytes}", "bad class")
        dshape = (len(cls.layers), cls.num_shards, DIGEST_SLOTS)
        dbytes = int(np.prod(dshape)) * 4
        if off + nbytes + dbytes > len(buf):
            raise PageFormatError(f"truncated page blob: {cls.name} is cut short", "truncated")
        data[c] = np.frombuffer(buf, np.uint8, nbytes, off)
        digests[c] = np.frombuffer(buf, "<u4", dbytes // 4, off + nbytes).reshape(dshape)
        off += nbytes + dbytes
    if off != len(buf):
        raise PageFormatError(f"oversized page blob: {len(buf) - off} trailing bytes after "
                              f"its {n} slice class(es) ({len(buf)} bytes, they end at {off})",
                              "truncated")
    if not data:
        raise PageFormatError("page blob holds no slice class", "bad class")
    return PageBlob(key, seal, bool(flags & _FLAG_DIGESTS), data, digests)



def first_span(blob: bytes | bytearray | memoryview) -> tuple[int, int]:
    """``(start, end)`` of the first slice class's page bytes inside a blob.

    Reads only the blob's own framing (no plan needed): what a fault that damages a
    page's bytes at rest, past every header, needs.
    """
    buf = memoryview(blob).cast("B")
    _, nbytes = _CLASS.unpack_from(buf, _HEADER.size)
    start = _HEADER.size + _CLASS.size
    return start, start + nbytes


def blob_bytes(plan: Plan) -> int:
    """The bytes of the blob of a whole page of ``plan`` (every slice class held): the
    largest blob ``encode`` makes for it and ``decode`` takes.

    Example:
        >>> import jax.numpy as jnp, kvxfer
        >>> caches = [jnp.ones((8, 128), jnp.float32)]
        >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=1)
        >>> (page,) = mgr.offload(caches, [0], keys=[1]).wait()
        >>> len(mgr.export_page(page)) == blob_bytes(mgr.plan)
        True
        >>> mgr.close()
    """
    return _HEADER.size + sum(
        _CLASS.size + c.page_bytes + len(c.layers) * c.num_shards * DIGEST_SLOTS * 4
        for c in plan.classes)
