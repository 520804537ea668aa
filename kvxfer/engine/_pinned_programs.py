"""The programs between the caches and a ``pinned_host`` pool in place (XLA:CPU, TPU).

The pinned mover's in-place route writes pages into its pool array (donated) and reads
them from there into the donated caches. A page moves by one dynamic-update-slice
(offload) or one dynamic slice (load) of the pool, in a loop whose page count is a
runtime value, so one program serves every transfer of up to ``_batch.loop_pages``
pages on XLA:CPU, and every transfer of a bucket on TPU. On TPU each compiles to one
DMA a page (``dynamic-update-slice-start/done`` on ``S(5)``) into a slot-major pool
(``_slot_pool.SlotPool``); nothing computes on host memory. The same programs run on
XLA:CPU, with the caches' side read and written a page at a time there, and per layer
(gathered, scattered) on TPU, a chunk of pages at a time (``CHUNK_SLICES``): device
memory staged and compile time are those of a chunk, whatever the bucket.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import with_layout_constraint

from kvxfer import integrity
from kvxfer.engine import _programs
from kvxfer.layout import natural_bits
from kvxfer.engine._programs import (_UINT, _bits, _digest_impl, _from_units, _gathers_whole,
                                     _on_blocks, _units,
                                     _write_blocks, page_loops, page_rows, register_kind,
                                     unit_count)

__all__ = ["pinned_write", "pinned_gather", "pinned_load", "where_of"]


def _pool_words(words: jax.Array, dtype) -> jax.Array:
    """``uint{8 * unit}[b, n]`` -> ``dtype[b, m]``: the same bytes as the pool's words
    (zero-padded to whole words), little-endian.

    Made of strided slices and shifts, not a bitcast of ``[b, m, per]``: XLA:TPU lays
    that trailing dim of 2 or 4 out padded to 128 lanes (a 512 KiB page staged 32 MiB
    on v5p).
    """
    unit, size = words.dtype.itemsize, jnp.dtype(dtype).itemsize
    if unit == size:
        return words
    per = size // unit
    pad = -words.shape[1] % per
    if pad:
        words = jnp.pad(words, ((0, 0), (0, pad)))
    parts = [words[:, k::per].astype(dtype) << (8 * unit * k) for k in range(per)]
    return functools.reduce(jnp.bitwise_or, parts)


def _unit_words(words: jax.Array, unit: int, n: int) -> jax.Array:
    """The inverse of ``_pool_words``: the first ``n`` words of ``unit`` bytes."""
    if words.dtype.itemsize != unit:
        words = jax.lax.bitcast_convert_type(words, _UINT[unit]).reshape(words.shape[0], -1)
    return words[:, :n]


def _word_pairs(dtype, block: tuple[int, ...]) -> int | None:
    """Elements of ``dtype`` a 32-bit word holds, where a block of ``block`` turns into
    words along its last dim alone (whole-byte types, a last dim they divide); None
    where it does not."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_ or natural_bits(dtype) < 8 or dtype.itemsize > 4:
        return None
    per = 4 // dtype.itemsize
    return per if block and block[-1] % per == 0 else None


def _words32(x: jax.Array) -> jax.Array:
    """``[b, *block]`` -> ``uint32[b, n]``, the block's bytes as little-endian words,
    paired along the last dim (``_word_pairs``): pairing a flattened bf16 block into
    words made XLA:TPU copy the whole cache it was sliced from (160 MiB for 2 of vLLM's
    1.25 MiB MLA blocks); along the last dim, nothing."""
    size = x.dtype.itemsize
    per = 4 // size
    x = jax.lax.bitcast_convert_type(x, _UINT[size])
    if per > 1:  # strided slices and shifts (see ``_pool_words``), not a trailing dim
        x = functools.reduce(jnp.bitwise_or, [x[..., k::per].astype(jnp.uint32) << (8 * size * k)
                                              for k in range(per)])
    return x.reshape(x.shape[0], -1)


def _from_words32(w: jax.Array, dtype, block: tuple[int, ...]) -> jax.Array:
    """The inverse of ``_words32``: ``uint32[b, n]`` -> ``dtype[b, *block]``."""
    dtype = jnp.dtype(dtype)
    size = dtype.itemsize
    per = 4 // size
    w = w.reshape(w.shape[0], *block[:-1], block[-1] // per)
    if per > 1:
        # Shifted out and interleaved with the pair dim before the last: a bitcast to
        # ``[..., n, per]`` puts a dim of 2 or 4 minor-most, which XLA:TPU pads to 128
        # lanes (24 MiB staged for 4 pages of 256 KiB on v5p, 8 MiB this way).
        parts = [((w >> (8 * size * k)) & ((1 << (8 * size)) - 1)).astype(_UINT[size])
                 for k in range(per)]
        x = jnp.swapaxes(jnp.stack(parts, axis=-2), -1, -2)
    else:
        x = w
    x = x.reshape(w.shape[0], *block)
    return x if dtype == x.dtype else jax.lax.bitcast_convert_type(x, dtype)


def _codec(arrays, unit: int, pool_dtype) -> tuple[Any, Any, list[int], int]:
    """How a program turns blocks into a page's words and back: ``(to_words(x),
    from_words(w, dtype, block), words of each layer's block, bytes a word)``; 32-bit
    words paired along the last dim for a pool of them where every layer allows it
    (``_words32``), else words of ``unit`` bytes (``_units``)."""
    if jnp.dtype(pool_dtype).itemsize == 4 and \
            all(_word_pairs(a.dtype, tuple(a.shape[1:])) for a in arrays):
        return _words32, _from_words32, [unit_count(a.shape, a.dtype, 4) for a in arrays], 4
    return (lambda x: _units(x, unit)), _from_units, \
        [unit_count(a.shape, a.dtype, unit) for a in arrays], unit


def _element_unit(dtype, unit: int, to_words: Any) -> int:
    """The words a page's blocks are read as before they are stacked: each element's
    own bits where they are paired into 32-bit words after (``_words32``), else
    ``unit``."""
    if to_words is _words32:
        return jnp.dtype(dtype).itemsize
    return unit


def _slot_width(pool_shape: tuple[int, ...], start: int, n_words: int) -> int:
    """Pool words a page's part starting at word ``start`` of its slot is read as."""
    if len(pool_shape) == 2:
        return n_words
    if start:
        raise ValueError(f"a slot-major pool {list(pool_shape)} holds whole pages; a part "
                         f"at word {start} cannot be read alone")
    return pool_shape[1] * pool_shape[2]


def _put_page(pool, words: jax.Array, slot, start: int) -> jax.Array:
    """``pool`` with ``words`` (``[m]`` of its dtype) at word ``start`` of ``slot``: one
    dynamic-update-slice, whose size and offset are the whole slot on a slot-major
    pool (``[slots, rows, 128]``: padding fills the rest of the slot)."""
    if pool.ndim == 2:
        return jax.lax.dynamic_update_slice(pool, words[None], (slot, start))
    _slot_width(pool.shape, start, words.shape[0])
    rows, lanes = pool.shape[1:]
    words = jnp.pad(words, (0, rows * lanes - words.shape[0]))
    return jax.lax.dynamic_update_slice(pool, words.reshape(1, rows, lanes), (slot, 0, 0))


def _get_page(src, row, start: int, m: int, to_device: Any) -> jax.Array:
    """``[1, m]`` words of ``src`` at word ``start`` of ``row``: one dynamic slice (the
    whole slot on a slot-major pool), moved to device memory (``to_device``) before
    anything else reads it: XLA's host offloader takes a slice of host memory feeding
    a move to the device, and would compute a reshape of it on the host."""
    if src.ndim == 2:
        page = jax.lax.dynamic_slice(src, (row, start), (1, m))
    else:
        page = jax.lax.dynamic_slice(src, (row, 0, 0), (1, *src.shape[1:]))
    return jax.device_put(page, to_device).reshape(1, -1)


#: Pages digested at once in the TPU route's programs: the digest of 64 pages of an
#: MLA block at once staged 57 MiB of device memory, 16 at a time under 1 MiB.
_DIGEST_PAGES = 16


def _digest_of(blocks, base, nums) -> jax.Array:
    """``digest_layers`` of ``blocks`` (per layer ``[b, *block]``), ``_DIGEST_PAGES`` pages
    at a time."""
    b = blocks[0].shape[0]
    parts = [integrity.digest_layers([integrity.as_words(x[i:i + _DIGEST_PAGES], batch_dims=1)
                                      for x in blocks], base[i:i + _DIGEST_PAGES], nums)
             for i in range(0, b, _DIGEST_PAGES)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


#: The most block slices (pages x layers) and bytes one iteration of a TPU program's
#: loop over page chunks reads or writes (``_chunk_pages``). Unrolled over a whole
#: bucket, llama3-8b's pages (32 layers x 64 KiB blocks) staged 0.12x what they hold
#: at 16 pages, 1.5x at 32 and 2.9x at 64 (367 MiB, offload; a load 3.3x, 422 MiB):
#: the pages as rows, each layer's words for its digest and each page read for its DMA
#: all alive at once; and 64 pages took 86 s (offload) and 142 s (load) to compile. In
#: chunks of 8 pages, 64 stage 3.8 MiB (offload) and 134 MiB (load: its one buffer of
#: the pages) and compile in 4-8 s and 33 s (deviceless, v6e, libtpu 0.0.42.1).
CHUNK_SLICES = 256
CHUNK_BYTES = 16 << 20


def _chunk_pages(arrays, b: int) -> int:
    """Pages of a ``b``-page bucket of ``arrays``' blocks a gathered program handles an
    iteration: the most (a power of two dividing ``b``) within ``CHUNK_SLICES`` and
    ``CHUNK_BYTES``, and at least one."""
    page = sum(math.prod(a.shape[1:]) * a.dtype.itemsize for a in arrays)
    most = max(1, min(b, CHUNK_SLICES // len(arrays), CHUNK_BYTES // max(page, 1)))
    c = 1 << (most.bit_length() - 1)
    while b % c:
        c //= 2
    return c


def _in_chunks(body, arrays, layouts, b: int, c: int, count, carry):
    """``body(arrays, first, last, carry) -> (arrays, carry)`` for each chunk of ``c`` of
    the first ``count`` pages (``first``: its first page; ``last``: its pages, a runtime
    value), in a loop whose trip count is a runtime value; straight-line code where one
    chunk is the bucket. Returns the last ``(arrays, carry)``.

    The caches go through the loop as its carry, each held to its own layout
    (``layouts``, where known): read from inside a loop, a cache whose block dim is
    inside (DeepSeek MLA's ``{0,2,1}`` at engine sizes) was first copied whole into the
    default layout (870 MiB for two layers; 55 GiB for 61 would not compile); carried
    and held to its layout, nothing is copied (deviceless, libtpu 0.0.42.1).
    """
    if c == b:
        return body(tuple(arrays), 0, jnp.minimum(c, count), carry)

    def step(i, state):
        held = tuple(a if lay is None else with_layout_constraint(a, lay)
                     for a, lay in zip(state[0], layouts))
        first = i * c
        return body(held, first, jnp.minimum(c, count - first), state[1])

    return jax.lax.fori_loop(0, (count + c - 1) // c, step, (tuple(arrays), carry))


def _write_gathered(arrays, pool, ids, slots, count, digest, *, raw: bool, start: int,
                    unit: int, layouts: tuple):
    # Each chunk's pages are read per layer on the device, one dynamic slice a page and
    # layer: not a gather, which XLA:TPU runs by relaying out a whole cache whose block
    # dim is inside (vLLM's MLA cache at engine sizes, ``{0,2,1:T(8,128)(2,1)}``: 483
    # MiB of a 24753-block ``[16, 576]`` bf16 cache for 2 pages, against 95 KiB for
    # slices; deviceless, libtpu 0.0.42.1). They are put together as rows and written
    # into their slots, one dynamic-update-slice a page; then digested.
    to_words, _, _, _ = _codec(arrays, unit, pool.dtype)
    b = ids.shape[0]
    c = _chunk_pages(arrays, b)

    def chunk(arrays, first, last, carry):
        pool, n, digests = carry
        ids_c = jax.lax.dynamic_slice_in_dim(ids, first, c)
        slots_c = jax.lax.dynamic_slice_in_dim(slots, first, c)
        # The digests read the blocks' words as the page holds them (the same bytes,
        # so the same digests): digesting the blocks themselves made XLA:TPU relayout
        # a v4 cache whose block dim is inside (3.6 GiB of tiny's at 117964 blocks).
        # Each page's blocks as flat element bits, stacked, then paired into words:
        # pairing before stacking made XLA:TPU copy v4 caches tiled T(2,128) (922 MiB
        # of sglang's p64 cache, 3.6 GiB of an int8 one, for 2 pages); after, nothing.
        elem = [jnp.concatenate([_units(jax.lax.dynamic_slice_in_dim(_bits(a, raw), ids_c[j],
                                                                     1),
                                        _element_unit(a.dtype, unit, to_words))
                                 for j in range(c)]) for a in arrays]
        units = [_pool_words(e, jnp.uint32) if to_words is _words32 else e for e in elem]
        rows = _pool_words(jnp.concatenate(units, axis=1), pool.dtype)
        pool = jax.lax.fori_loop(0, last, lambda j, p: _put_page(p, rows[j], slots_c[j], start),
                                 pool)
        if digest:
            base, nums = digest
            d = _digest_of(units, jax.lax.dynamic_slice_in_dim(base, first, c), nums)
            digests = jax.lax.dynamic_update_slice(digests, d, (0, first, 0))
        return arrays, (pool, n + last, digests)

    digests = jnp.zeros((len(arrays), b, integrity.DIGEST_WORDS) if digest else (),
                        jnp.uint32)
    _, (pool, done, digests) = _in_chunks(chunk, arrays, layouts, b, c, count,
                                          (pool, jnp.int32(0), digests))
    return (pool, done, digests) if digest else (pool, done)


def _write_impl(arrays, pool, ids, slots, count, *digest, raw: bool, start: int, unit: int,
                gathered: bool, loop: bool, platform: str, layouts: tuple = ()):
    # The pool is donated: the first ``count`` pages are written into their slots in
    # place, each page (this shard's blocks of every layer, side by side) by one
    # dynamic-update-slice: on TPU one DMA a page, into host memory that no program
    # computes on. ``gathered`` (TPU): the pages are first read on the device, per
    # layer, a chunk of them at a time (``_write_gathered``), and digested there; else
    # each page's blocks are read in the loop (XLA:CPU, see ``_on_blocks``: nothing tied
    # to the padded page count; and TPU for blocks over 1 MiB, which XLA:TPU slices out
    # of a copy of the whole cache when it reads them outside a loop:
    # ``_programs._gathers_whole``).
    if gathered and not _gathers_whole(arrays, platform):
        return _write_gathered(arrays, pool, ids, slots, count, digest, raw=raw, start=start,
                               unit=unit, layouts=layouts or (None,) * len(arrays))
    to_words, _, _, _ = _codec(arrays, unit, pool.dtype)
    if pool.ndim == 2 and pool.dtype.itemsize == unit:
        # A pool of the blocks' own words (XLA:CPU): each layer's block straight into
        # its range of the slot, with no page put together first (that copy made a
        # 64-page offload of 16 layers 1.5-2x as slow on XLA:CPU).
        offsets = np.cumsum([0] + [unit_count(a.shape, a.dtype, unit) for a in arrays])

        def body(j, carry):
            p, n = carry

            def write(blocks, p):
                for block, off in zip(blocks, offsets):
                    p = jax.lax.dynamic_update_slice(p, _units(block, unit),
                                                     (slots[j], start + int(off)))
                return p

            return _on_blocks(write, lambda p: p, arrays, ids[j], raw, p), n + 1
    else:
        def body(j, carry):
            p, n = carry

            def write(blocks, p):
                words = jnp.concatenate([to_words(b) for b in blocks], axis=1)
                return _put_page(p, _pool_words(words, pool.dtype)[0], slots[j], start)

            return _on_blocks(write, lambda p: p, arrays, ids[j], raw, p), n + 1

    # The second output is what a waiter waits for: the pool array itself may be
    # donated by the next program before anyone waits.
    pool, done = jax.lax.fori_loop(0, count, body, (pool, jnp.int32(0)))
    if not digest:
        return pool, done
    # The digests of the blocks read, in the same program (as ``digest_blocks`` would
    # compute them; on the device copies, never on host memory).
    base, nums = digest
    return pool, done, _digest_impl(arrays, ids, base, nums, count, raw=raw, loop=loop,
                                    platform=platform)


def _gather_impl(arrays, ids, *, raw: bool, unit: int):
    return page_rows(arrays, ids, raw, unit)


def _load_gathered(arrays, src, ids, rows, count, digest, *, raw: bool, start: int,
                   unit: int, to_device: Any, layouts: tuple):
    # Each page is read from its row into a device buffer of the bucket's pages (one
    # dynamic slice, on TPU one DMA a page); then written into the caches a chunk at a
    # time, one dynamic-update-slice a page and layer (a scatter relays out a cache
    # whose block dim is inside, as a gather does: see ``_write_gathered``); then
    # digested from the buffer.
    # Digested inside the loop over chunks, MLA's 32 layers staged 207 MiB at 4 pages a
    # chunk (deviceless, libtpu 0.0.42.1); from the buffer after it, 2 MiB.
    dtypes = [_UINT[a.dtype.itemsize] if raw else a.dtype for a in arrays]
    _, from_words, sizes, unit = _codec(arrays, unit, src.dtype)
    n = sum(sizes)
    m = _slot_width(src.shape, start, -(-n * unit // src.dtype.itemsize))
    ends = np.cumsum([0] + sizes)
    b = ids.shape[0]
    c = _chunk_pages(arrays, b)

    def split(words):
        return [from_words(words[:, lo:hi], dtype, tuple(a.shape[1:]))
                for a, dtype, lo, hi in zip(arrays, dtypes, ends[:-1], ends[1:])]

    def get(j, carry):
        buf, read = carry
        page = _get_page(src, rows[j], start, m, to_device)
        return jax.lax.dynamic_update_slice(buf, page, (j, 0)), read + 1

    buf, read = jax.lax.fori_loop(0, count, get, (jnp.zeros((b, m), src.dtype), jnp.int32(0)))

    def chunk(caches, first, last, carry):
        # Entries past ``last`` write the chunk's first page again, where its block
        # already holds it.
        out = list(caches)
        for j in range(c):
            r = first + jnp.where(j < last, j, 0)
            words = _unit_words(jax.lax.dynamic_slice_in_dim(buf, r, 1), unit, n)
            out = _write_blocks(out, ids[r], split(words), raw)
        return tuple(out), carry

    out, _ = _in_chunks(chunk, arrays, layouts, b, c, count, ())
    # ``done`` (what the caller waits for before the pool's slots are reused) is ready
    # once every page was read and written.
    out, done = jax.lax.optimization_barrier((out, read))
    if not digest:
        return out, done
    # The digests of the pages as they arrived in device memory (the words of the
    # blocks written: the same bytes, the same digests): reading them back from the
    # caches made XLA:TPU copy a cache whose block dim is inside (483 MiB for vLLM's
    # MLA cache). Rows past ``count`` digest zeros, and are ignored.
    base, nums = digest
    g = min(b, _DIGEST_PAGES)

    def digest_pages(i, digests):
        words = _unit_words(jax.lax.dynamic_slice_in_dim(buf, i * g, g), unit, n)
        d = _digest_of([words[:, lo:hi] for lo, hi in zip(ends[:-1], ends[1:])],
                       jax.lax.dynamic_slice_in_dim(base, i * g, g), nums)
        return jax.lax.dynamic_update_slice(digests, d, (0, i * g, 0))

    digests = jnp.zeros((len(arrays), b, integrity.DIGEST_WORDS), jnp.uint32)
    if g == b:
        return out, done, digest_pages(0, digests)
    return out, done, jax.lax.fori_loop(0, (count + g - 1) // g, digest_pages, digests)


def _load_impl(arrays, src, ids, rows, count, *digest, raw: bool, start: int, unit: int,
               gathered: bool, loop: bool, platform: str, to_device: Any,
               layouts: tuple = ()):
    # ``src`` is pinned host memory: the pool itself, or the request's pages. Each page
    # is read from its row by one dynamic slice (on TPU one DMA a page) and written
    # into the donated caches in place. ``gathered``: the pages are collected on the
    # device, a chunk at a time, and written per layer (TPU, ``_load_gathered``); else
    # each page's blocks are written in the loop (XLA:CPU, see ``_write_blocks``: no
    # copy of the caches for raw bits).
    if gathered and not _gathers_whole(arrays, platform):  # as ``_write_impl``
        return _load_gathered(arrays, src, ids, rows, count, digest, raw=raw, start=start,
                              unit=unit, to_device=to_device,
                              layouts=layouts or (None,) * len(arrays))
    dtypes = [_UINT[a.dtype.itemsize] if raw else a.dtype for a in arrays]
    _, from_words, sizes, unit = _codec(arrays, unit, src.dtype)
    n = sum(sizes)
    m = _slot_width(src.shape, start, -(-n * unit // src.dtype.itemsize))
    ends = np.cumsum([0] + sizes)

    def split(words):
        return [from_words(words[:, lo:hi], dtype, tuple(a.shape[1:]))
                for a, dtype, lo, hi in zip(arrays, dtypes, ends[:-1], ends[1:])]

    if src.ndim == 2 and src.dtype.itemsize == unit and platform == "cpu":
        # XLA:CPU reads each block straight from its range of the slot (a page read
        # whole and moved first cost loads about 15 % there).
        def body(j, carry):
            caches, written = carry
            blocks = [_from_units(jax.lax.dynamic_slice(src, (rows[j], start + int(lo)),
                                                        (1, int(hi - lo))), dtype, a.shape[1:])
                      for a, dtype, lo, hi in zip(arrays, dtypes, ends[:-1], ends[1:])]
            return _write_blocks(caches, ids[j], blocks, raw), written + 1
    else:
        def body(j, carry):
            caches, written = carry
            words = _unit_words(_get_page(src, rows[j], start, m, to_device), unit, n)
            return _write_blocks(caches, ids[j], split(words), raw), written + 1

    out, done = jax.lax.fori_loop(0, count, body, (list(arrays), jnp.int32(0)))
    # ``done`` is the load's own output: ready once ``src`` was read, and never handed
    # to the caller (who may donate the caches right away).
    if not digest:
        return tuple(out), done
    # The digests of the blocks written, read back from the caches it returns.
    base, nums = digest
    return tuple(out), done, _digest_impl(out, ids, base, nums, count, raw=raw, loop=loop,
                                          platform=platform)


def _layouts(formats: tuple) -> tuple:
    """The caches' own layouts, where their formats name them (None where not: the
    compiler's default, as abstract caches given without a ``Format`` have)."""
    return tuple(getattr(f, "layout", None) for f in formats)


def _write_parts(formats: tuple, raw: bool, with_digest: bool, options: tuple):
    pool, start, unit, gathered = options
    device = _programs._device(formats)
    return (functools.partial(_write_impl, raw=raw, start=start, unit=unit, gathered=gathered,
                              loop=page_loops(device), platform=device.platform,
                              layouts=_layouts(formats)),
            dict(donate_argnums=(1,),
                 in_shardings=(formats, pool, None, None, None) + (None, None) * with_digest,
                 out_shardings=(pool, None) + (None,) * with_digest))


def _gather_parts(formats: tuple, raw: bool, with_digest: bool, options: tuple):
    out, unit = options
    return (functools.partial(_gather_impl, raw=raw, unit=unit),
            dict(in_shardings=(formats, None), out_shardings=out))


def _load_parts(formats: tuple, raw: bool, with_digest: bool, options: tuple):
    src, start, unit, gathered = options
    device = _programs._device(formats)
    return (functools.partial(_load_impl, raw=raw, start=start, unit=unit, gathered=gathered,
                              loop=page_loops(device), platform=device.platform,
                              layouts=_layouts(formats),
                              to_device=jax.sharding.SingleDeviceSharding(
                                  device, memory_kind="device")),
            dict(donate_argnums=(0,),
                 in_shardings=(formats, src, None, None, None) + (None, None) * with_digest,
                 out_shardings=(formats, None) + (None,) * with_digest))


register_kind("pinned_write", _write_parts, ballast=True)
register_kind("pinned_gather", _gather_parts, ballast=True)
register_kind("pinned_load", _load_parts, same_formats=0, ballast=True)


def where_of(a: Any) -> Any:
    """What a program takes ``a`` (a pool or a buffer of pages) as: its ``Format`` where
    its layout is pinned (a slot-major pool), else its sharding."""
    if a.ndim != 3:  # (``Array.format`` builds a new object on every call)
        return a.sharding
    fmt = getattr(a, "format", None)
    return fmt if fmt is not None and getattr(fmt, "layout", None) is not None else a.sharding


def pinned_write(arrays, pool, ids, slots, count, start: int, unit: int, gathered: bool,
                 digest: tuple[Any, jax.Array] | None = None):
    """Writes blocks ``ids[j]`` of every layer into slot ``slots[j]`` of ``pool`` in place.

    For ``j < count`` (an ``int32`` scalar: the arrays may be padded further).
    ``pool`` (pinned host words, donated: ``[slots, words]``, or a slot-major
    ``SlotPool`` array ``[slots, rows, 128]``) gets the page's blocks side by side, as
    words of ``unit`` bytes, from word ``start`` of the slot (0 on a slot-major pool),
    by one dynamic-update-slice a page. ``gathered``: gather the pages per layer first
    (TPU). ``digest``: ``(identities, layer numbers)`` as ``digest_blocks`` takes them:
    the program also digests the blocks it reads.

    Returns:
      ``(new pool, done)``: ``done`` (a scalar) is ready once the pages are written;
      with ``digest``, the digests ``uint32[L, len(ids), D]`` as a third element.
    """
    extra = () if digest is None else tuple(digest)
    return _programs.run("pinned_write", arrays, pool, ids, slots, count, *extra,
                         with_digest=digest is not None,
                         options=(where_of(pool), int(start), int(unit), bool(gathered)))


def pinned_gather(arrays, ids, out, unit: int):
    """Pages ``uint{8 * unit}[b, L * n]`` of blocks ``ids`` in the memory of ``out``."""
    return _programs.run("pinned_gather", arrays, ids, options=(out, unit))


def pinned_load(arrays, src, ids, rows, count, start: int, unit: int, gathered: bool,
                digest: tuple[jax.Array, jax.Array] | None = None):
    """Writes row ``rows[j]`` of ``src`` (pinned host words) into block ``ids[j]``, for
    ``j < count`` (an ``int32`` scalar).

    The page's blocks are read side by side from word ``start`` of the row (words of
    ``unit`` bytes, as ``pinned_write`` wrote them) by one dynamic slice a page; the
    caches are donated and written in place. ``gathered``: collect the pages on the
    device and scatter them per layer (TPU). ``digest``: ``(identities, layer
    numbers)`` as ``digest_blocks`` takes them: the program also digests the blocks it
    wrote (``ids`` sized as the digests take them).

    Returns:
      ``(new arrays, done)``, and the digests ``uint32[L, len(ids), D]`` as a third
      element with ``digest``: ``done`` is ready once the program has run.
    """
    extra = () if digest is None else tuple(digest)
    return _programs.run("pinned_load", arrays, src, ids, rows, count, *extra,
                         with_digest=digest is not None,
                         options=(where_of(src), int(start), int(unit), bool(gathered)))
