"""Fault injection for the host tier, for tests and ``kvxfer probe --inject``.

Each fault damages host pages the way the field does (SEEDS.md §1), *after* the
page's digest was made, so that only verification can catch it:

* ``bitflip``: one host bit flips.
* ``wrong-key``: a page is presented under another key (``wrong_keys``), or its
  slot holds another page's bytes and digests (``misfile``).
* ``stale-slot``: a page is freed and its slot reused while a ref is still held.
* ``one-shard``: one shard's bytes of a sharded layer are corrupted.
* ``one-process``: corruption on one process of a multi-process job only
  (``bitflip`` applied where ``jax.process_index()`` matches).
* ``torn``: half of a page's bytes are another page's (a torn write).
* ``transfer``: the transfer itself fails (a device error, never a miss).

Example:
    >>> from kvxfer import faults                       # doctest: +SKIP
    >>> faults.flip_bit(mgr, pages[2], layer=1)         # doctest: +SKIP
    >>> caches, h = mgr.load(caches, pages, dst)        # doctest: +SKIP
    >>> h.result().verified_prefix                      # doctest: +SKIP
    2
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvxfer.hostpool import PageRef
from kvxfer.manager import KVCacheManager

__all__ = ["FAULTS", "flip_bit", "wrong_keys", "misfile", "reuse_slot", "corrupt_shard",
           "tear", "failing_transfer", "inject"]

FAULTS = ("bitflip", "wrong-key", "misfile", "stale-slot", "one-shard", "torn", "transfer")
"""The faults ``inject`` and ``kvxfer probe --inject`` know (``one-process`` is a
``bitflip`` on one rank of a multi-process job)."""


def _layer_bytes(mgr: KVCacheManager, page: PageRef, layer: int,
                 shard: int | None = None) -> np.ndarray:
    """A writable view of one layer's host bytes of a page (one shard if given)."""
    cls, pos = mgr.plan.class_of_layer(layer)
    pool = mgr.host_pool.pools[cls.index]
    lo, hi = pool.layer_range(pos) if shard is None else pool.shard_range(pos, shard)
    return pool.data[page.slot, lo:hi]


def flip_bit(mgr: KVCacheManager, page: PageRef, layer: int, bit: int | None = None,
             *, shard: int | None = None, seed: int = 0) -> int:
    """Flips one host bit of a page's layer (after its digest was made).

    Returns:
      The bit index flipped within the layer's (or shard's) bytes.
    """
    view = _layer_bytes(mgr, page, layer, shard)
    if bit is None:
        bit = int(np.random.default_rng(seed).integers(0, view.size * 8))
    view[bit // 8] ^= np.uint8(1 << (bit % 8))
    return bit


def wrong_keys(pages: Sequence[PageRef], index: int) -> list[int]:
    """The keys a caller expects, with ``pages[index]`` expected under another key."""
    keys = [p.key for p in pages]
    keys[index] = (keys[index] + 0x9E3779B97F4A7C15) % (1 << 64)
    return keys


def misfile(mgr: KVCacheManager, dst: PageRef, src: PageRef) -> None:
    """Puts ``src``'s bytes and digests into ``dst``'s slot (metadata says ``dst``).

    The digests are bound to ``src``'s key and generation, so verification under
    ``dst``'s identity fails even though the bytes are a valid page.
    """
    for pool in mgr.host_pool.pools:
        pool.data[dst.slot] = pool.data[src.slot]
        pool.digests[dst.slot] = pool.digests[src.slot]


def reuse_slot(mgr: KVCacheManager, caches: Sequence[Any], page: PageRef,
               block: int, key: int) -> PageRef:
    """Frees ``page`` and offloads ``block`` until the same slot is reused.

    Returns:
      The new page now living in ``page``'s slot (``page`` itself is stale).
    """
    mgr.free([page])
    held = []
    try:
        while True:
            (new,) = mgr.offload(caches, [block], keys=[key]).wait()
            if new.slot == page.slot:
                return new
            held.append(new)
    finally:
        mgr.free(held)


def corrupt_shard(mgr: KVCacheManager, page: PageRef, layer: int, shard: int,
                  seed: int = 0) -> int:
    """Flips one bit in one shard's bytes only."""
    return flip_bit(mgr, page, layer, shard=shard, seed=seed)


def tear(mgr: KVCacheManager, page: PageRef, other: PageRef, layer: int) -> None:
    """The second half of a page's layer bytes becomes another page's (a torn write)."""
    view = _layer_bytes(mgr, page, layer)
    half = view.size // 2
    view[half:] = _layer_bytes(mgr, other, layer)[half:]


@contextlib.contextmanager
def failing_transfer(mgr: KVCacheManager, after_layers: int = 0) -> Iterator[None]:
    """Makes loads fail (a device error) after ``after_layers`` layers have moved."""
    originals = [m.finish_load_layer for m in mgr._movers]
    count = {"n": 0}

    def wrap(fn):
        def failing(state, pos):
            if count["n"] >= after_layers:
                raise OSError("injected device transfer failure")
            count["n"] += 1
            return fn(state, pos)
        return failing

    for m, fn in zip(mgr._movers, originals):
        m.finish_load_layer = wrap(fn)
    try:
        yield
    finally:
        for m, fn in zip(mgr._movers, originals):
            m.finish_load_layer = fn


def inject(kind: str, mgr: KVCacheManager, caches: Sequence[Any], pages: list[PageRef],
           index: int, layer: int, *, seed: int = 0) -> tuple[list[PageRef], list[int] | None]:
    """Applies one named fault to ``pages[index]``.

    Returns:
      ``(pages, keys)`` to pass to ``load`` (keys None unless the fault needs them).
      ``transfer`` is not applied here: wrap the load in ``failing_transfer``.
    """
    pages = list(pages)
    if kind == "bitflip":
        flip_bit(mgr, pages[index], layer, seed=seed)
    elif kind == "wrong-key":
        return pages, wrong_keys(pages, index)
    elif kind == "misfile":
        other = (index + 1) % len(pages)
        misfile(mgr, pages[index], pages[other])
    elif kind == "stale-slot":
        reuse_slot(mgr, caches, pages[index], block=0, key=0xDEAD)
    elif kind == "one-shard":
        cls, _ = mgr.plan.class_of_layer(layer)
        if cls.num_shards < 2:
            raise ValueError(f"one-shard needs a sharded layer; layer {layer} has "
                             f"{cls.num_shards} shard(s)")
        corrupt_shard(mgr, pages[index], layer, shard=cls.num_shards - 1, seed=seed)
    elif kind == "torn":
        tear(mgr, pages[index], pages[(index + 1) % len(pages)], layer)
    else:
        raise ValueError(f"unknown fault {kind!r}; expected one of {FAULTS}")
    return pages, None
