"""The DMA mover's jitted programs, one kind each (``kvxfer.engine._programs``):

* ``dma_offload``: digests the blocks; a callback copies them to the host slots, from
  the caches or from the pages gathered into rows (relayout, or beside XLA's stream:
  then the rows come back aliased and are held until the copies end);
* ``dma_load``: a callback copies the host slots into the caches in place (aliased),
  or into rows then scattered; digests;
* ``dma_stage``: a callback starts a load's copies beside XLA's stream into staging
  the program allocates, a row a page;
* ``dma_load_side``: for each layer group, a callback makes XLA's stream wait for the
  group's copies, then the group is scattered from the staging.

Callbacks have no declared side effect: their outputs (the caches, a word) keep them,
and JAX's C++ dispatch keeps the program (an effect costs 60 us a call on XLA:CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from kvxfer.engine._programs import _digest_impl, page_rows, register_kind, scatter_rows
from kvxfer.engine.dma._jobs import callback

__all__ = ["KINDS"]

_WORD = jax.ShapeDtypeStruct((1,), np.uint32)


def _digests(arrays, ids, count, digest, raw, loop):
    base, nums = digest
    return (_digest_impl(arrays, ids, base, nums, count, raw=raw, loop=loop),)


def _offload(arrays, token, ids, count, *digest, raw, relayout, loop, unit, side):
    # The digests and the copies both read the blocks, in either order.
    out = _digests(arrays, ids, count, digest, raw, loop) if digest else ()
    if side or relayout:
        rows = page_rows(arrays, ids, raw, unit)
    if side:
        staging, done = buffer_callback(
            callback, (jax.ShapeDtypeStruct(rows.shape, rows.dtype), _WORD),
            has_side_effect=False, input_output_aliases={1: 0})(token, rows)
        return (done, staging, *out)
    done = buffer_callback(callback, _WORD, has_side_effect=False)(
        token, *((rows,) if relayout else arrays))
    return (done, *out)


def _load(arrays, token, ids, count, *digest, raw, relayout, loop, unit):
    if relayout:
        rows = page_rows(arrays, ids, raw, unit)
        staging, done = buffer_callback(
            callback, (jax.ShapeDtypeStruct(rows.shape, rows.dtype), _WORD),
            has_side_effect=False, input_output_aliases={1: 0})(token, rows)
        out = scatter_rows(arrays, staging, ids, count, raw, unit)
    else:
        *out, done = buffer_callback(
            callback, (*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays), _WORD),
            has_side_effect=False,
            input_output_aliases={1 + i: i for i in range(len(arrays))})(token, *arrays)
    extra = _digests(out, ids, count, digest, raw, loop) if digest else ()
    return (tuple(out), done, *extra)


def _stage(arrays, *, rows, words, dtype, raw):  # uninitialized; a row more (_load_side)
    staging, _ = buffer_callback(callback, (jax.ShapeDtypeStruct((rows + 1, words), dtype),
                                            _WORD), has_side_effect=False)(*arrays)
    return staging


def _load_side(arrays, token, staging, ids, count, *digest, groups, raw, loop, unit, widths):
    # Nothing aliases or donates the staging (copies beside XLA's stream may write it
    # whatever becomes of this program): a group's callback is handed it only to check
    # it is the buffer its copies write, and returns a word. The group's rows are read
    # at a row computed from that word (0 once it is 1; the staging's extra row keeps
    # the read a slice), so no read runs before the wait and XLA has no reason to copy
    # the staging. Each callback after the first also reads every layer the group
    # before wrote: its wait follows those scatters, which run while later groups cross.
    out = list(arrays)
    starts = np.concatenate([[0], np.cumsum(widths)]).tolist()
    after: tuple = ()
    ok = None
    for g, (a, b) in enumerate(groups):
        ok, = buffer_callback(
            functools.partial(callback, group=g, last=g == len(groups) - 1), (_WORD,),
            has_side_effect=False, input_output_aliases={1: 0})(
                token, jnp.zeros((1,), jnp.uint32), staging, *after)
        first = ok[0].astype(jnp.int32) - 1
        rows = jax.lax.dynamic_slice(staging, (first, starts[a]),
                                     (staging.shape[0] - 1, starts[b] - starts[a]))
        out[a:b] = scatter_rows(out[a:b], rows, ids, jnp.where(ok[0] == 1, count, 0), raw,
                                unit)
        after = tuple(out[a:b])
    extra = _digests(out, ids, count, digest, raw, loop) if digest else ()
    return (tuple(out), ok, *extra)


def _parts(impl, names, donate, n_args, out):
    """A kind's ``parts``: the impl with its options by name, its jit arguments."""
    def parts(formats, raw, with_digest, options):
        shardings = (formats,) + (None,) * n_args + (None, None) * with_digest
        jit = dict(in_shardings=shardings)
        if donate:
            jit.update(donate_argnums=(0,), out_shardings=(formats,) + (None,) * out + (
                None,) * with_digest)
        return functools.partial(impl, raw=raw, **dict(zip(names, options))), jit
    return parts


#: Each kind and its options (the tuple ``_programs.run`` is given).
KINDS = {
    "dma_offload": ("relayout", "loop", "unit", "side"),
    "dma_load": ("relayout", "loop", "unit"),
    "dma_stage": ("rows", "words", "dtype"),
    "dma_load_side": ("groups", "loop", "unit", "widths"),
}
register_kind("dma_offload", _parts(_offload, KINDS["dma_offload"], False, 3, 0))
register_kind("dma_load", _parts(_load, KINDS["dma_load"], True, 3, 1), same_formats=0)
register_kind("dma_stage", _parts(_stage, KINDS["dma_stage"], False, 0, 0))
register_kind("dma_load_side", _parts(_load_side, KINDS["dma_load_side"], True, 4, 1),
              same_formats=0)
