"""The DMA mover's programs (kinds of ``kvxfer.engine._programs``). ``dma_offload``:
digests; a callback copies the blocks to the host slots, from the caches or from rows
gathered a page each (relayout; beside XLA's stream the rows come back aliased, held
until the copies end). ``dma_load``: a callback copies the slots into the caches in
place, or into rows then scattered; digests. ``dma_stage``: a callback starts a load's
copies beside XLA's stream into staging. ``dma_load_side``: a layer group at a time,
a callback makes XLA's stream wait for the group's copies, then it is scattered.

Callbacks declare no side effect: their outputs keep them, and JAX's C++ dispatch
keeps the program (an effect costs 60 us a call on XLA:CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from kvxfer.engine._programs import _digest_impl, page_rows, register_kind, scatter_rows
from kvxfer.engine.dma._jobs import callback

__all__: list[str] = []  # importing it registers the kinds

_WORD = jax.ShapeDtypeStruct((1,), np.uint32)


def _digests(arrays, ids, count, digest, raw, loop):
    return (_digest_impl(arrays, ids, *digest, count, raw=raw, loop=loop),) if digest else ()


def _in_place(token, rows):
    """The callback over ``rows``, handed back in place (aliased), and its word."""
    return buffer_callback(callback, (jax.ShapeDtypeStruct(rows.shape, rows.dtype), _WORD),
                           has_side_effect=False, input_output_aliases={1: 0})(token, rows)


def _offload(arrays, token, ids, count, *digest, raw, relayout, loop, unit, side):
    out = _digests(arrays, ids, count, digest, raw, loop)  # before or after the copies
    if side or relayout:
        rows = page_rows(arrays, ids, raw, unit)
    if side:
        staging, done = _in_place(token, rows)
        return (done, staging, *out)
    done = buffer_callback(callback, _WORD, has_side_effect=False)(
        token, *((rows,) if relayout else arrays))
    return (done, *out)


def _load(arrays, token, ids, count, *digest, raw, relayout, loop, unit):
    if relayout:
        staging, done = _in_place(token, page_rows(arrays, ids, raw, unit))
        out = scatter_rows(arrays, staging, ids, count, raw, unit)
    else:
        *out, done = buffer_callback(
            callback, (*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays), _WORD),
            has_side_effect=False,
            input_output_aliases={1 + i: i for i in range(len(arrays))})(token, *arrays)
    return (tuple(out), done, *_digests(out, ids, count, digest, raw, loop))


def _stage(arrays, *, rows, words, dtype, raw):  # uninitialized; a row more (_load_side)
    staging, _ = buffer_callback(callback, (jax.ShapeDtypeStruct((rows + 1, words), dtype),
                                            _WORD), has_side_effect=False)(*arrays)
    return staging


def _load_side(arrays, token, staging, ids, count, *digest, groups, raw, loop, unit, words):
    # The staging is neither aliased nor donated (copies may write it whatever becomes
    # of this program): a group's callback checks it is the buffer its copies write and
    # returns a word; the rows are read at a row computed from it (0 once it is 1), so no
    # read precedes the wait. Each wait follows the scatters of the group before.
    out, after, ok = list(arrays), (), None
    for g, (a, b) in enumerate(groups):
        ok, = buffer_callback(
            functools.partial(callback, group=g, last=g == len(groups) - 1), (_WORD,),
            has_side_effect=False, input_output_aliases={1: 0})(
                token, jnp.zeros((1,), jnp.uint32), staging, *after)
        first = ok[0].astype(jnp.int32) - 1
        rows = jax.lax.dynamic_slice(staging, (first, a * words),
                                     (staging.shape[0] - 1, (b - a) * words))
        out[a:b] = scatter_rows(out[a:b], rows, ids, jnp.where(ok[0] == 1, count, 0), raw,
                                unit)
        after = tuple(out[a:b])
    return (tuple(out), ok, *_digests(out, ids, count, digest, raw, loop))


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


# Each kind: its impl, the names of its options (the tuple ``_programs.run`` is given),
# whether it donates the caches (handing them back), its index arguments.
for _kind, _impl, _names, _donate, _n_args in (
        ("dma_offload", _offload, ("relayout", "loop", "unit", "side"), False, 3),
        ("dma_load", _load, ("relayout", "loop", "unit"), True, 3),
        ("dma_stage", _stage, ("rows", "words", "dtype"), False, 0),
        ("dma_load_side", _load_side, ("groups", "loop", "unit", "words"), True, 4)):
    register_kind(_kind, _parts(_impl, _names, _donate, _n_args, int(_donate)),
                  same_formats=0 if _donate else False)
