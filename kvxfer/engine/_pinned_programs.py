"""The programs between the caches and a ``pinned_host`` pool in place (XLA:CPU).

The pinned mover's in-place route writes pages into its pool array (donated) and reads
them from there into the donated caches; the staged mover's loads on XLA:CPU read its
pool the same way. Blocks move by a loop of dynamic-update-slices whose page count is
a runtime value (on XLA:CPU 4-5x as fast as a scatter from gathered pages), so one
program serves every transfer of up to ``_batch.loop_pages`` pages.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from kvxfer.engine import _programs
from kvxfer.engine._programs import (_UINT, _digest_impl, _from_units, _on_blocks, _units,
                                     _write_blocks, page_rows, register_kind, unit_count)

__all__ = ["pinned_write", "pinned_gather", "pinned_load"]


def _write_impl(arrays, pool, ids, slots, count, *digest, raw: bool,
                offsets: tuple[int, ...]):
    # The pool is donated: each block of the first ``count`` pages is written into its
    # slot's words in place, so the pages reach the pinned pool with no copy beside
    # this one. (Raw bits are read a block at a time, see ``_on_blocks``: a gather of
    # every page first would tie the program to the padded page count.)
    unit = pool.dtype.itemsize

    def body(j, carry):
        p, n = carry

        def write(blocks, p):
            for block, off in zip(blocks, offsets):
                p = jax.lax.dynamic_update_slice(p, _units(block, unit), (slots[j], off))
            return p

        return _on_blocks(write, lambda p: p, arrays, ids[j], raw, p), n + 1

    # The second output is what a waiter waits for: the pool array itself may be
    # donated by the next program before anyone waits.
    pool, done = jax.lax.fori_loop(0, count, body, (pool, jnp.int32(0)))
    if not digest:
        return pool, done
    # The digests of the blocks read, in the same program (as ``digest_blocks`` would
    # compute them): an offload then dispatches one program.
    base, nums = digest
    return pool, done, _digest_impl(arrays, ids, base, nums, count, raw=raw, loop=True)


def _gather_impl(arrays, ids, *, raw: bool, unit: int):
    return page_rows(arrays, ids, raw, unit)


def _load_impl(arrays, src, ids, rows, count, *digest, raw: bool, offsets: tuple[int, ...]):
    # ``src`` is pinned host memory: the pool itself, or the request's pages. Each
    # block is read from its row and written into the donated cache in place, by a
    # loop over the first ``count`` pages (see ``_write_blocks``: no copy of the caches
    # for raw bits).
    unit = src.dtype.itemsize
    sizes = [unit_count(a.shape, a.dtype, unit) for a in arrays]
    dtypes = [_UINT[a.dtype.itemsize] if raw else a.dtype for a in arrays]

    def body(j, carry):
        caches, written = carry
        blocks = [_from_units(jax.lax.dynamic_slice(src, (rows[j], off), (1, n)), dtype,
                              a.shape[1:])
                  for a, dtype, off, n in zip(arrays, dtypes, offsets, sizes)]
        return _write_blocks(caches, ids[j], blocks, raw), written + 1

    out, done = jax.lax.fori_loop(0, count, body, (list(arrays), jnp.int32(0)))
    # ``done`` is the load's own output: ready once ``src`` was read, and never handed
    # to the caller (who may donate the caches right away).
    if not digest:
        return tuple(out), done
    # The digests of the blocks written, read back from the caches it returns.
    base, nums = digest
    return tuple(out), done, _digest_impl(out, ids, base, nums, count, raw=raw, loop=True)


def _write_parts(formats: tuple, raw: bool, with_digest: bool, options: tuple):
    pool, offsets = options
    return (functools.partial(_write_impl, raw=raw, offsets=offsets),
            dict(donate_argnums=(1,),
                 in_shardings=(formats, pool, None, None, None) + (None, None) * with_digest,
                 out_shardings=(pool, None) + (None,) * with_digest))


def _gather_parts(formats: tuple, raw: bool, with_digest: bool, options: tuple):
    out, unit = options
    return (functools.partial(_gather_impl, raw=raw, unit=unit),
            dict(in_shardings=(formats, None), out_shardings=out))


def _load_parts(formats: tuple, raw: bool, with_digest: bool, options: tuple):
    src, offsets = options
    return (functools.partial(_load_impl, raw=raw, offsets=offsets),
            dict(donate_argnums=(0,),
                 in_shardings=(formats, src, None, None, None) + (None, None) * with_digest,
                 out_shardings=(formats, None) + (None,) * with_digest))


register_kind("pinned_write", _write_parts, ballast=True)
register_kind("pinned_gather", _gather_parts, ballast=True)
register_kind("pinned_load", _load_parts, same_formats=0, ballast=True)


def pinned_write(arrays, pool, ids, slots, count, offsets: tuple[int, ...],
                 digest: tuple[Any, jax.Array] | None = None):
    """Writes blocks ``ids[j]`` of every layer into row ``slots[j]`` of ``pool`` in place.

    For ``j < count`` (an ``int32`` scalar: the arrays may be padded further).
    ``pool`` (pinned host words, donated) gets layer ``l``'s block at word
    ``offsets[l]`` of the row. ``digest``: ``(identities, layer numbers)`` as
    ``digest_blocks`` takes them: the program also digests the blocks it reads.

    Returns:
      ``(new pool, done)``: ``done`` (a scalar) is ready once the pages are written;
      with ``digest``, the digests ``uint32[L, len(ids), D]`` as a third element.
    """
    extra = () if digest is None else tuple(digest)
    return _programs.run("pinned_write", arrays, pool, ids, slots, count, *extra,
               with_digest=digest is not None, options=(pool.sharding, tuple(offsets)))


def pinned_gather(arrays, ids, out, unit: int):
    """Pages ``uint{8 * unit}[b, L * n]`` of blocks ``ids`` in the memory of ``out``."""
    return _programs.run("pinned_gather", arrays, ids, options=(out, unit))


def pinned_load(arrays, src, ids, rows, count, offsets: tuple[int, ...],
                digest: tuple[jax.Array, jax.Array] | None = None):
    """Writes row ``rows[j]`` of ``src`` (pinned host words) into block ``ids[j]``, for
    ``j < count`` (an ``int32`` scalar).

    Layer ``l``'s block is read at word ``offsets[l]`` of the row; the caches are
    donated and written in place. ``digest``: ``(identities, layer numbers)`` as
    ``digest_blocks`` takes them: the program also digests the blocks it wrote (``ids``
    sized as the digests take them).

    Returns:
      ``(new arrays, done)``, and the digests ``uint32[L, len(ids), D]`` as a third
      element with ``digest``: ``done`` is ready once the program has run.
    """
    extra = () if digest is None else tuple(digest)
    return _programs.run("pinned_load", arrays, src, ids, rows, count, *extra,
               with_digest=digest is not None, options=(src.sharding, tuple(offsets)))
