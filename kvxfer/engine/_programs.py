"""The compiled programs movers run: gathers with digests, digests alone, scatters.

One program per (kind, input formats, options), in a bounded cache; ``jax.jit`` then
caches per shapes. The caches' formats are pinned so that a cache in a non-default
layout (a compiler-chosen TPU layout, say) is neither converted on the way in nor
comes back in the default layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvxfer import integrity
from kvxfer.layout import natural_bits

__all__ = ["needs_raw_bits", "gather", "digest_blocks", "scatter", "alias", "compile_ahead",
           "DIGEST_CHUNK"]

# Layers per digest program: compile time grows with the layers in a program, so a
# class of 61 layers compiles two programs of 8 (and one of 5), not one of 61.
DIGEST_CHUNK = 8

# Distinct (kind, formats, options) a process keeps compiled programs for.
_PROGRAM_CACHE_SIZE = 256

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def needs_raw_bits(a: jax.Array) -> bool:
    """Whether moving ``a`` in a program must go through its raw bits.

    XLA:CPU gathers and scatters bf16 and fp8 through f32, which rewrites NaN
    payloads; other backends and dtypes move bits as they are. A bitcast breaks
    buffer aliasing, so it is used only where it is needed for exactness.
    """
    return (any(d.platform == "cpu" for d in a.sharding.device_set)
            and jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4
            and natural_bits(a.dtype) == 8 * a.dtype.itemsize)  # not fp4: no NaNs


def _bits(a: jax.Array, raw: bool) -> jax.Array:
    if raw:
        return jax.lax.bitcast_convert_type(a, _UINT[a.dtype.itemsize])
    return a


def _with_layer(base: jax.Array, layer: jax.Array) -> jax.Array:
    return base.at[:, 2].set(layer)


def _gather_impl(arrays, ids, base, layer_nums, *, raw: bool, with_digest: bool):
    pages = jnp.stack([_bits(a, raw)[ids] for a in arrays])
    if not with_digest:
        return pages, None
    words = integrity.as_words(pages, batch_dims=2)
    identity = jax.vmap(_with_layer, in_axes=(None, 0))(base, layer_nums)
    return pages, integrity.digest(words, identity)


def _digest_impl(arrays, ids, base, layer_nums, *, raw: bool):
    return jnp.stack([integrity.digest(integrity.as_words(_bits(a, raw)[ids], batch_dims=1),
                                       _with_layer(base, layer_nums[i]))
                      for i, a in enumerate(arrays)])


def _scatter_impl(arrays, ids, pages, *, raw: bool):
    out = []
    for i, a in enumerate(arrays):
        b = _bits(a, raw).at[ids].set(pages[i], mode="drop", unique_indices=True)
        out.append(jax.lax.bitcast_convert_type(b, a.dtype) if raw else b)
    return tuple(out)


@functools.lru_cache(maxsize=_PROGRAM_CACHE_SIZE)
def _program(kind: str, formats: tuple, raw: bool, with_digest: bool = False):
    if kind == "gather":
        fn = functools.partial(_gather_impl, raw=raw, with_digest=with_digest)
        return jax.jit(fn, in_shardings=(formats, None, None, None))
    if kind == "digest":
        return jax.jit(functools.partial(_digest_impl, raw=raw),
                       in_shardings=(formats, None, None, None))
    if kind == "alias":
        return jax.jit(tuple, donate_argnums=(0,), in_shardings=(formats,),
                       out_shardings=formats)
    return jax.jit(functools.partial(_scatter_impl, raw=raw), donate_argnums=(0,),
                   in_shardings=(formats, None, None), out_shardings=formats)


def _run(kind: str, arrays: tuple[jax.Array, ...], *args, with_digest: bool = False):
    formats = tuple(a.format for a in arrays)
    return _program(kind, formats, needs_raw_bits(arrays[0]), with_digest)(arrays, *args)


def compile_ahead(kind: str, arrays: tuple, *args, with_digest: bool = False) -> None:
    """Compiles the program ``kind`` for these (abstract) arguments, running nothing.

    A later call with arrays of the same shapes, dtypes, shardings and layouts finds
    the program compiled.
    """
    formats = tuple(a.format for a in arrays)
    _program(kind, formats, needs_raw_bits(arrays[0]), with_digest).lower(
        arrays, *args).compile()


def gather(arrays, ids, base, layer_nums, with_digest: bool):
    """Blocks ``ids`` of every layer stacked ``[L, k, ...]``, and their digests."""
    return _run("gather", arrays, ids, base, layer_nums, with_digest=with_digest)


def digest_blocks(arrays, ids, base, layer_nums):
    """Digests ``uint32[L, k, D]`` of blocks ``ids`` of every layer (no copy out)."""
    return _run("digest", arrays, ids, base, layer_nums)


def alias(arrays):
    """The same buffers as new arrays, handed over in XLA's order (donated).

    The program runs once every computation dispatched earlier that uses the buffers
    is done; the returned arrays then own them alone.
    """
    return _run("alias", arrays)


def scatter(arrays, ids, pages):
    """Writes ``pages[l, j]`` into block ``ids[j]`` of layer ``l``, in place (donated).

    Padding entries of ``ids`` are out of range and dropped.
    """
    return _run("scatter", arrays, ids, pages)


