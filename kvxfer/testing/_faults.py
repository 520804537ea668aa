"""Fault injection for the host tier: damage pages the way the field does.

The faults and what each means are listed in ``kvxfer.testing``'s docstring
(``help(kvxfer.testing)``); ``FAULTS`` names them.

Example:
    >>> import jax.numpy as jnp, kvxfer
    >>> from kvxfer import testing
    >>> caches = testing.random_caches(2, 8, (4, 128), "float32")
    >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    >>> pages = mgr.offload(caches, [0, 1, 2], keys=[1, 2, 3]).wait()
    >>> _ = testing.flip_bit(mgr, pages[1], layer=1)
    >>> caches, load = mgr.load(caches, pages, [5, 6, 7])
    >>> load.result().verified_prefix
    1
    >>> mgr.close()
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvxfer._names import FAULTS as FAULTS
from kvxfer._names import Fault as Fault
from kvxfer.engine import local
from kvxfer.hostpool import PageRef
from kvxfer.manager import KVCacheManager, TransferHook

__all__ = ["FAULTS", "Fault", "flip_bit", "wrong_keys", "misfile", "reuse_slot",
           "corrupt_shard", "tear", "failing_transfer", "zero_dma", "inject",
           "InjectedTransferError"]



class InjectedTransferError(OSError):
    """The device error ``failing_transfer`` raises inside a load."""


def _layer_views(mgr: KVCacheManager, page: PageRef, layer: int,
                 shard: int | None = None) -> list[np.ndarray]:
    """Writable views of one layer's host bytes of a page, shard by shard (the one
    shard if given), in the page's byte order."""
    cls, pos = mgr.plan.class_of_layer(layer)
    pool = mgr.host_pool.pools[cls.index]
    shards = range(cls.num_shards) if shard is None else (shard,)
    return [pool.shard_view(page.slot, pos, s) for s in shards]


def flip_bit(mgr: KVCacheManager, page: PageRef, layer: int, bit: int | None = None,
             *, shard: int | None = None, seed: int = 0) -> int:
    """Flips one host bit of a page's layer (after its digest was made).

    Returns:
      The bit index flipped within the layer's (or shard's) bytes.
    """
    views = _layer_views(mgr, page, layer, shard)
    if bit is None:
        bit = int(np.random.default_rng(seed).integers(0, sum(v.size for v in views) * 8))
    at = bit // 8
    for view in views:
        if at < view.size:
            view[at] ^= np.uint8(1 << (bit % 8))
            break
        at -= view.size
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
        pool.write_page(dst.slot, np.array(pool.read_page(src.slot)))
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
    """Flips one bit in one shard's bytes only.

    Raises:
      ValueError: ``shard`` is not a shard of that layer.
    """
    cls, _ = mgr.plan.class_of_layer(layer)
    if not 0 <= shard < cls.num_shards:
        raise ValueError(f"{shard=} is not a shard of layer {layer} ({cls.num_shards} "
                         "shard(s))")
    return flip_bit(mgr, page, layer, shard=shard, seed=seed)


def tear(mgr: KVCacheManager, page: PageRef, other: PageRef, layer: int) -> None:
    """The second half of a page's layer bytes becomes another page's (a torn write)."""
    views = _layer_views(mgr, page, layer)
    theirs = np.concatenate(_layer_views(mgr, other, layer))
    at, half = 0, theirs.size // 2
    for view in views:
        lo = max(half - at, 0)
        if lo < view.size:
            view[lo:] = theirs[at + lo:at + view.size]
        at += view.size


def _failing_hook(after_layers: int, once: bool, mgr: KVCacheManager,
                  previous: TransferHook | None) -> TransferHook:
    moved = {"layers": 0}

    def hook(event: str, layer: int, array: Any) -> Any:
        # What ``previous`` returns (a ``zero_dma`` replacement array) still counts.
        out = previous(event, layer, array) if previous is not None else None
        if event != "load_layer":
            return out
        if moved["layers"] >= after_layers:
            if once:
                mgr.set_transfer_hook(previous)
            raise InjectedTransferError("injected device transfer failure")
        moved["layers"] += 1
        return out

    return hook


@contextlib.contextmanager
def failing_transfer(mgr: KVCacheManager, after_layers: int = 0) -> Iterator[None]:
    """Makes the loads started inside the block fail (a device error) once
    ``after_layers`` layers have moved.

    The count runs over every load started inside the ``with`` block, so a large
    ``after_layers`` lets loads through while counting layers. A load keeps the
    hook of its call, so it fails however late its transfer thread gets to the
    layer, also when the caller waits on it (``result()``, ``layer_ready``) after the
    block; loads started after the block are untouched.

    Example:
        >>> import kvxfer
        >>> from kvxfer import testing
        >>> caches = testing.random_caches(2, 8, (4, 128), "float32")
        >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
        >>> pages = mgr.offload(caches, [0, 1], keys=[1, 2]).wait()
        >>> with testing.failing_transfer(mgr, after_layers=1):
        ...     caches, load = mgr.load(caches, pages, [5, 6], gate="layer")
        >>> load.layer_ready(0), type(load.exception()).__name__
        (2, 'TransferError')
        >>> mgr.close()
    """
    previous = mgr.set_transfer_hook(None)
    mgr.set_transfer_hook(_failing_hook(after_layers, False, mgr, previous))
    try:
        yield
    finally:
        mgr.set_transfer_hook(previous)


@functools.lru_cache(maxsize=64)
def _zeroing(fmt: Any):
    def zero(a: jax.Array, block: jax.Array) -> jax.Array:
        if jnp.issubdtype(a.dtype, jnp.floating):
            # Through the raw bits: XLA:CPU rewrites bf16/fp8 NaN payloads in a float
            # scatter, which would change blocks the fault must leave alone.
            u = jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{a.dtype.itemsize * 8}"))
            return jax.lax.bitcast_convert_type(u.at[block].set(0), a.dtype)
        return a.at[block].set(jnp.zeros((), a.dtype))

    return jax.jit(zero, out_shardings=fmt)


def _zero_block(a: jax.Array, block: int) -> jax.Array:
    """``a`` with ``block`` zeroed, shard by shard (any sharding, Explicit axes too)."""
    parts = []
    for s in a.addressable_shards:
        start = s.index[0].indices(a.shape[0])[0]
        shard = local(s.data)
        if start <= block < start + shard.shape[0]:
            shard = _zeroing(shard.format)(shard, np.int32(block - start))
        parts.append(shard)
    return jax.make_array_from_single_device_arrays(a.shape, a.sharding, parts)


def zero_dma(mgr: KVCacheManager, layer: int, block: int) -> None:
    """The next load that writes ``layer`` delivers zeros into its ``block``, silently.

    A one-shot ``"loaded_layer"`` hook returns the loaded array with that block
    zeroed (every replica, every shard), as a DMA that moved nothing would leave it;
    the load reports no error, so only its digests can tell.

    Example:
        >>> import kvxfer
        >>> from kvxfer import testing
        >>> caches = testing.random_caches(2, 8, (4, 128), "bfloat16")
        >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
        >>> pages = mgr.offload(caches, [0, 1, 2], keys=[1, 2, 3]).wait()
        >>> testing.zero_dma(mgr, layer=1, block=6)
        >>> caches, load = mgr.load(caches, pages, [5, 6, 7])
        >>> load.result().verified_prefix, bool(testing.bits(caches[1])[6].any())
        (1, False)
        >>> mgr.close()
    """
    previous = mgr.set_transfer_hook(None)

    def hook(event: str, at: int, array: Any) -> Any:
        out = previous(event, at, array) if previous is not None else None
        if event != "loaded_layer" or at != layer:
            return out
        mgr.set_transfer_hook(previous)
        loaded = array if out is None else out
        return _zero_block(loaded, block)

    mgr.set_transfer_hook(hook)


def inject(kind: str, mgr: KVCacheManager, caches: Sequence[Any], pages: list[PageRef],
           index: int, layer: int, *, seed: int = 0,
           device_blocks: Sequence[int] | Mapping[int, Sequence[int]] | None = None
           ) -> tuple[list[PageRef], list[int] | None]:
    """Applies one named fault to ``pages[index]``.

    Args:
      kind: one of ``FAULTS``.
      mgr: the manager holding the pages.
      caches: the current caches (``stale-slot`` offloads into the freed slot).
      pages: the refs the load will be given.
      index: the page to damage.
      layer: the layer to damage (``transfer``: the layer at which the next load
        fails, after ``layer`` layers moved).
      seed: picks the bit for ``bitflip`` and ``one-shard``.
      device_blocks: the block ids the next load writes (as given to ``load``);
        ``zero-dma`` zeroes the one page ``index`` goes to.

    Returns:
      ``(pages, keys)`` to pass to ``load`` (keys None unless the fault needs them).

    Raises:
      ValueError: an unknown fault, ``one-shard`` on a layer with one shard, or
        ``zero-dma`` without ``device_blocks``.
    """
    pages = list(pages)
    if kind == "zero-dma":
        if device_blocks is None:
            raise ValueError("zero-dma needs device_blocks: the ids the next load writes")
        if isinstance(device_blocks, Mapping):
            device_blocks = device_blocks[mgr.plan.class_of_layer(layer)[0].index]
        zero_dma(mgr, layer, int(list(device_blocks)[index]))
        return pages, None
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
    elif kind == "transfer":
        # The next load on this manager fails once ``layer`` layers have moved.
        mgr.set_transfer_hook(_failing_hook(layer, True, mgr, mgr.set_transfer_hook(None)))
    else:
        raise ValueError(f"unknown fault {kind!r}; expected one of {FAULTS}")
    return pages, None
