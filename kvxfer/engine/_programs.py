"""The compiled programs movers run: gathers with digests, digests alone, scatters;
and the cache of programs every kind shares, which movers register kinds of their own
with (``register_kind``: the pinned, DMA and pages programs live beside their movers).

One program per (kind, input formats, options), in a bounded cache; ``jax.jit`` then
caches per shapes. The caches' formats are pinned so that a cache in a non-default
layout (a compiler-chosen TPU layout, say) is neither converted on the way in nor
comes back in the default layout.

Programs that move or digest pages one at a time in a loop (on XLA:CPU: the digests,
and the pinned mover's in-place copies) take the page count as a runtime value and
index arrays of ``_batch.loop_pages`` entries, so one program serves transfers of
every size up to it, where vectorized programs need one per bucket. Compiling is what
``warmup`` costs: the loops cut it by the number of buckets.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvxfer import integrity
from kvxfer.layout import dtype_of, natural_bits

__all__ = ["needs_raw_bits", "run", "register_kind", "lowered_for", "gather", "digest_blocks",
           "scatter", "staged_load", "alias", "page_rows", "scatter_rows", "compile_ahead",
           "compile_job", "compiled", "collected_compiles",
           "deferred_compiles", "page_loops", "DIGEST_CHUNK", "unit_count", "zeros",
           "compile_zeros"]

# Layers per digest program: compile time grows with the layers in a program, so a
# class of 61 layers compiles two programs of 8 (and one of 5), not one of 61.
DIGEST_CHUNK = 8

# Bytes of each layer's blocks one iteration of a digest loop reads at most. Pages of
# smaller blocks are digested several an iteration (a power of two of them): an
# iteration costs microseconds whatever it reads, which sglang-jax's one-token pages
# (4 KiB blocks) would pay per page. 64 KiB, not more: blocks of 64 KiB and up are read
# one an iteration, as before, since grouping them gained nothing and made the digests
# of a 1-page x 32-layer hit (16-block caches, 64 KiB blocks) 0.8 ms slower; one-token
# pages moved as fast at 64 KiB a group as at 1 MiB (4.6/4.2 against 4.7/4.6 GB/s).
DIGEST_LOOP_BYTES = 64 << 10

# Distinct (kind, formats, options) a process keeps compiled programs for.
_PROGRAM_CACHE_SIZE = 256

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def needs_raw_bits(a: jax.Array) -> bool:
    """Whether moving ``a`` in a program must go through its raw bits.

    XLA:CPU gathers and scatters bf16 and fp8 through f32, which rewrites NaN
    payloads; other backends and dtypes move bits as they are. A bitcast breaks
    buffer aliasing, so it is used only where it is needed for exactness.
    """
    return _raw_of(a.dtype, a.sharding)


@functools.lru_cache(maxsize=256)
def _raw_of(dtype: Any, sharding: Any) -> bool:
    """``needs_raw_bits`` of an array of ``dtype`` placed by ``sharding`` (cached: a
    load asks once a program)."""
    dtype = jnp.dtype(dtype)
    return (any(d.platform == "cpu" for d in sharding.device_set)
            and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
            and natural_bits(dtype) == 8 * dtype.itemsize)  # not fp4: no NaNs


def _bits(a: jax.Array, raw: bool) -> jax.Array:
    if raw:
        return jax.lax.bitcast_convert_type(a, _UINT[a.dtype.itemsize])
    return a


def _with_layer(base: jax.Array, layer: jax.Array) -> jax.Array:
    return base.at[:, 2].set(layer)


def page_loops(device: Any) -> bool:
    """Whether programs on ``device`` digest and stage pages in loops (XLA:CPU).

    A loop of one page an iteration runs as fast as a vectorized program on XLA:CPU
    (each iteration moves whole blocks), and its page count is a runtime value, so one
    program serves every transfer size (``_batch.loop_pages``); on a GPU or a TPU
    every iteration would be a kernel launch.
    """
    return device.platform == "cpu"


def _on_blocks(fn: Callable[..., Any], skip: Callable[..., Any], arrays, i: jax.Array,
               raw: bool, *args) -> Any:
    """``fn(blocks, *args)`` over block ``i`` of each array (``[1, *block]``, raw bits
    when ``raw``), in a loop body, reading those blocks alone. ``i`` may also be a
    vector of block ids: the blocks are then ``[len(i), *block]`` (a gather).

    XLA:CPU moves bf16 and fp8 slices through f32 (rewriting NaN payloads), so raw
    bits are read through a bitcast; in a loop body XLA hoists the bitcast of a whole
    cache out of the loop (a copy of every block, on every call), but not out of a
    conditional's branch, where it stays fused with the slice and with ``fn`` (a digest
    of 32 layers x 64 pages of 64 KiB: 11-14 ms, as vectorized; with the blocks
    handed out of the branch, 27-35 ms). The predicate is a runtime value that is
    always true; ``skip(*args)`` (never run) gives the result's structure.
    """
    def read(i, arrays, *args):
        if i.ndim:
            return fn([_bits(a, raw)[i] for a in arrays], *args)
        return fn([jax.lax.dynamic_slice_in_dim(_bits(a, raw), i, 1) for a in arrays], *args)

    if not raw:
        return read(i, arrays, *args)
    return jax.lax.cond((i[0] if i.ndim else i) >= 0, read,
                        lambda i, arrays, *args: skip(*args), i, list(arrays), *args)


def _write_blocks(arrays, i: jax.Array, blocks, raw: bool) -> list[jax.Array]:
    """``arrays`` with block ``i`` of each set to ``blocks[l]`` (``[1, *block]``, raw
    bits when ``raw``), in place (the arrays are a donated loop's carry).

    XLA:CPU updates bf16 and fp8 slices through f32 across the whole buffer, so raw
    bits are written through a bitcast, in the loop body: carried through the loop as
    raw bits, the caches would be bitcast (copied) going in and coming out, while a
    bitcast, update and bitcast back within an iteration writes the block in place.
    """
    out = []
    for a, block in zip(arrays, blocks):
        x = jax.lax.dynamic_update_slice(_bits(a, raw), block, (i,) + (0,) * (a.ndim - 1))
        out.append(jax.lax.bitcast_convert_type(x, a.dtype) if raw else x)
    return out


def _gather_impl(arrays, ids, base, layer_nums, *, raw: bool, with_digest: bool):
    pages = jnp.stack([_bits(a, raw)[ids] for a in arrays])
    if not with_digest:
        return pages, None
    words = integrity.as_words(pages, batch_dims=2)
    identity = jax.vmap(_with_layer, in_axes=(None, 0))(base, layer_nums)
    return pages, integrity.digest(words, identity)


# XLA:TPU gathers blocks of more than 1 MiB by "mini-gathers" that first copy slices
# of the whole operand: a digest of 2 pages of a [512, 32, 32, 640] bf16 cache (1.25
# MiB blocks) staged 386 MiB, a [512, 8, 32, 4096] one 1 GiB; at 1 MiB and under,
# nothing (deviceless compiles, libtpu 0.0.42.1). Larger blocks are digested one a
# loop iteration (a dynamic slice each), where an iteration's cost is small beside
# the block's.
_TPU_GATHER_BYTES = 1 << 20


def _gathers_whole(arrays, device_platform: str) -> bool:
    """Whether a vectorized gather of ``arrays``' blocks would copy whole caches."""
    if device_platform != "tpu":
        return False
    return any(math.prod(a.shape[1:]) * a.dtype.itemsize > _TPU_GATHER_BYTES
               for a in arrays)


def _digest_impl(arrays, ids, base, layer_nums, count, *, raw: bool, loop: bool,
                 platform: str = ""):
    if not loop and _gathers_whole(arrays, platform):
        loop = True
    if not loop:
        # One digest per layer, each fused with its gather: the pages are read once. (A
        # digest over the stacked pages compiles 4-5x faster but materializes the stack
        # and ran 14x slower on XLA:CPU: 1.8 against 24.6 GB/s for 8 layers x 128 pages.)
        return integrity.digest_layers([integrity.as_words(_bits(a, raw)[ids], batch_dims=1)
                                        for a in arrays], base, layer_nums)

    # ``count`` pages, each layer's blocks read once (about as fast as the vectorized
    # digest on XLA:CPU, see ``_on_blocks``): ``g`` pages an iteration
    # (``_digest_group``) while ``g`` are left, then one an iteration, so no page is
    # digested twice and a transfer never costs more iterations than pages. Rows past
    # ``count`` stay zero.
    g = _digest_group(arrays[0], ids.shape[0])

    def page(blocks, ident):
        return integrity.digest_layers([integrity.as_words(x, batch_dims=1) for x in blocks],
                                       ident, layer_nums)

    def step(n):
        def none(ident):
            return jnp.zeros((len(arrays), n, integrity.DIGEST_WORDS), jnp.uint32)

        def body(j, out):
            start = j * n
            rows = ids[start] if n == 1 else jax.lax.dynamic_slice_in_dim(ids, start, n)
            d = _on_blocks(page, none, arrays, rows, raw,
                           jax.lax.dynamic_slice_in_dim(base, start, n))
            return jax.lax.dynamic_update_slice(out, d, (0, start, 0))
        return body

    out = jnp.zeros((len(arrays), ids.shape[0], integrity.DIGEST_WORDS), jnp.uint32)
    if g == 1:
        return jax.lax.fori_loop(0, count, step(1), out)
    groups = count // g
    out = jax.lax.fori_loop(0, groups, step(g), out)
    return jax.lax.fori_loop(groups * g, count, step(1), out)


def _digest_group(a: Any, n: int) -> int:
    """Pages a digest loop reads an iteration: the largest power of two whose blocks of
    ``a`` fit ``DIGEST_LOOP_BYTES`` and that divides the ``n`` index entries (1 for
    blocks of that size or more)."""
    block = a.dtype.itemsize
    for d in a.shape[1:]:
        block *= int(d)
    g = 1
    while 2 * g * block <= DIGEST_LOOP_BYTES and n % (2 * g) == 0:
        g *= 2
    return g


def _scatter_impl(arrays, ids, pages, *, raw: bool):
    out = []
    for i, a in enumerate(arrays):
        b = _bits(a, raw).at[ids].set(pages[i], mode="drop", unique_indices=True)
        out.append(jax.lax.bitcast_convert_type(b, a.dtype) if raw else b)
    return tuple(out)


def _staged_load_impl(arrays, ids, pages, count, *, raw: bool):
    # ``pages`` is page-major, ``[n, L, *block]`` (raw bits where ``raw``): page ``j``
    # of layer ``l`` is written into block ``ids[j]`` for ``j < count``, in place.
    def body(j, caches):
        page = jax.lax.dynamic_index_in_dim(pages, j, 0, keepdims=False)
        return _write_blocks(caches, ids[j], [page[l][None] for l in range(len(arrays))], raw)

    return tuple(jax.lax.fori_loop(0, count, body, list(arrays)))


def _units(x: jax.Array, unit: int) -> jax.Array:
    """``[b, *block]`` -> ``uint{8 * unit}[b, n]``: each block's bytes as numpy holds them.

    Sub-byte types and bool are one byte an element (the bits in the low bits), as
    numpy (ml_dtypes) stores them; whole-byte types are their raw bits.
    """
    b = x.shape[0]
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    elif natural_bits(x.dtype) < 8:
        x = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{natural_bits(x.dtype)}"))
        x = x.astype(jnp.uint8)
    elif x.dtype != _UINT[x.dtype.itemsize]:
        x = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])
    x = x.reshape(b, -1)
    size = x.dtype.itemsize
    if size < unit:
        return jax.lax.bitcast_convert_type(x.reshape(b, -1, unit // size), _UINT[unit])
    if size > unit:
        return jax.lax.bitcast_convert_type(x, _UINT[unit]).reshape(b, -1)
    return x


def _from_units(w: jax.Array, dtype, block: tuple[int, ...]) -> jax.Array:
    """The inverse of ``_units``: ``uint{8 * unit}[b, n]`` -> ``dtype[b, *block]``."""
    b, unit = w.shape[0], w.dtype.itemsize
    dtype = jnp.dtype(dtype)
    small = dtype == jnp.bool_ or natural_bits(dtype) < 8
    target = jnp.uint8 if small else _UINT[dtype.itemsize]
    size = jnp.dtype(target).itemsize
    if unit > size:
        w = jax.lax.bitcast_convert_type(w, target).reshape(b, -1)
    elif unit < size:
        w = jax.lax.bitcast_convert_type(w.reshape(b, -1, size // unit), target)
    x = w.reshape((b,) + tuple(block))
    if dtype == jnp.bool_:
        return x != 0
    if small:
        return jax.lax.bitcast_convert_type(
            x.astype(jnp.dtype(f"uint{natural_bits(dtype)}")), dtype)
    return x if dtype == target else jax.lax.bitcast_convert_type(x, dtype)


def page_rows(arrays, ids, raw: bool, unit: int) -> jax.Array:
    """Blocks ``ids`` of every layer, page-major: row ``j`` holds page ``j``'s layers side
    by side as words of ``unit`` bytes (what a host slot holds of one shard)."""
    return jnp.concatenate([_units(_bits(a, raw)[ids], unit) for a in arrays], axis=1)


def scatter_rows(arrays, rows, ids, count, raw: bool, unit: int) -> list[jax.Array]:
    """``arrays`` with page-major ``rows`` (``page_rows``'s layout) written into blocks
    ``ids``: one scatter per layer, into the donated arrays; rows past ``count`` go out
    of range and are dropped (padding, never written)."""
    where = jnp.where(jnp.arange(rows.shape[0]) < count, ids, arrays[0].shape[0])
    out, at = [], 0
    for a in arrays:
        n = unit_count(a.shape, a.dtype, unit)
        x = _bits(a, raw)
        block = _from_units(rows[:, at:at + n], x.dtype, x.shape[1:])
        x = x.at[where].set(block, mode="drop", unique_indices=True)
        out.append(jax.lax.bitcast_convert_type(x, a.dtype) if raw else x)
        at += n
    return out


def unit_count(shape: tuple[int, ...], dtype, unit: int) -> int:
    """Words of ``unit`` bytes one block of an array of ``shape`` is stored in."""
    n = 1
    for d in shape[1:]:
        n *= int(d)
    return n * dtype_of(dtype).itemsize // unit


# XLA:CPU runs a program whose cost analysis counts fewer than 1000 flops inline, on
# the thread that dispatches it, waiting there for its inputs: a gather, a scatter or a
# copy loop counts almost none, so the caller would wait for every step queued before
# the transfer and then for the copy itself. A few thousand flops on a runtime value
# (nothing the compiler can fold) make such a program asynchronous like any other.
_BALLAST = 2048


_SEED = np.float32(0.5)  # the runtime value the ballast computes on, an argument


def _ballast(seed: jax.Array) -> jax.Array:
    x = jnp.arange(_BALLAST, dtype=jnp.float32) * seed
    return jnp.sum(x * x + x)


def _device(formats: tuple) -> Any:
    return next(iter(formats[0].sharding.device_set))


def _on_cpu(formats: tuple) -> bool:
    return any(d.platform == "cpu" for d in formats[0].sharding.device_set)


Parts = Callable[[tuple, bool, bool, tuple], tuple[Any, dict[str, Any]]]
"""``parts(formats, raw, with_digest, options) -> (function, jax.jit arguments)``."""

# Program kinds other modules define (``register_kind``), and those of them that get
# no ballast.
_KINDS: dict[str, Parts] = {}
_UNBALLASTED: set[str] = set()


def register_kind(kind: str, parts: Parts, same_formats: int | None | bool = False,
                  ballast: bool = False) -> None:
    """Makes program ``kind`` known to ``run``, ``compile_ahead`` and ``compiled``.

    ``same_formats``: where in the output the arrays a program was given come back in
    their formats (an index, None for the whole output), or False. ``ballast``: on
    XLA:CPU, give the program the flops that make it asynchronous when it only moves
    bytes (see ``_BALLAST``); programs that hold host callbacks need none (XLA:CPU runs
    them on the dispatching thread whatever they count).
    """
    _KINDS[kind] = parts
    if not ballast:
        _UNBALLASTED.add(kind)
    if same_formats is not False:
        _SAME_FORMATS[kind] = same_formats


def _parts(kind: str, formats: tuple, raw: bool, with_digest: bool,
           options: tuple) -> tuple[Any, dict[str, Any]]:
    """The function of program ``kind`` and its ``jax.jit`` arguments."""
    if kind in _KINDS:
        return _KINDS[kind](formats, raw, with_digest, options)
    if kind == "gather":
        return (functools.partial(_gather_impl, raw=raw, with_digest=with_digest),
                dict(in_shardings=(formats, None, None, None)))
    if kind == "digest":
        device = _device(formats)
        return (functools.partial(_digest_impl, raw=raw, loop=page_loops(device),
                                  platform=device.platform),
                dict(in_shardings=(formats, None, None, None, None)))
    if kind == "alias":
        return tuple, dict(donate_argnums=(0,), in_shardings=(formats,),
                           out_shardings=formats)
    if kind == "staged_load":
        return (functools.partial(_staged_load_impl, raw=raw),
                dict(donate_argnums=(0,), in_shardings=(formats, None, None, None),
                     out_shardings=formats))
    return (functools.partial(_scatter_impl, raw=raw),
            dict(donate_argnums=(0,), in_shardings=(formats, None, None),
                 out_shardings=formats))


@functools.lru_cache(maxsize=_PROGRAM_CACHE_SIZE)
def _program(kind: str, formats: tuple, raw: bool, with_digest: bool = False,
             options: tuple = ()) -> tuple[Any, bool]:
    """(the jitted program, whether it returns the ballast as one more output)."""
    fn, kwargs = _parts(kind, formats, raw, with_digest, options)
    # Digests count plenty of flops; everything else only moves bytes. A digest loop
    # (XLA:CPU) counts one iteration, one page: few flops for small blocks. The alias
    # program stays inline: the raw mover waits for it on the caller's thread anyway
    # (it copies into the buffers it hands over), and is used on ready caches only.
    light = (kind not in ("digest", "alias", *_UNBALLASTED)
             and not (kind == "gather" and with_digest)) \
        or kind == "digest" and page_loops(_device(formats))
    if not (light and _on_cpu(formats)):
        return jax.jit(fn, **kwargs), False

    def ballasted(arrays, *args):
        return fn(arrays, *args[:-1]), _ballast(args[-1])

    kwargs["in_shardings"] = (*kwargs["in_shardings"], None)
    if "out_shardings" in kwargs:
        kwargs["out_shardings"] = (kwargs["out_shardings"], None)
    return jax.jit(ballasted, **kwargs), True


# A load of 32 layers runs five programs over 64 arrays, and ``Array.format`` builds
# a new ``Format`` on every call (microseconds each), as hashing 32 of them for the
# program cache does again: the format of each array a program is run with, or that a
# program returns, is kept while the array lives, and programs are found by the
# identity of those ``Format`` objects (an array returned by a program has the same
# objects as the arrays it was made from, so a chain of loads computes them once).
# Entries hold their arrays by plain weak references, with no callback: making one
# costs less, an array that dies runs no Python, and the manager's own weak
# references to the same arrays are then the same objects. Entries of dead arrays
# are dropped when the table has grown to twice what was alive at the last sweep.
_formats: dict[int, tuple[weakref.ref, Any]] = {}
_FORMATS_SWEEP = 4096
_sweep_at = _FORMATS_SWEEP
_by_identity: dict[tuple, tuple[tuple, tuple[Any, bool]]] = {}
_BY_IDENTITY_SIZE = 4096

# The programs whose first output is the arrays they were given, in the same formats
# (``out_shardings=formats``), and where that output is in what they return.
_SAME_FORMATS = {"alias": None, "scatter": None, "staged_load": None}


def _sweep() -> None:
    """Drops the format table's entries whose arrays are gone."""
    global _sweep_at
    for key, entry in list(_formats.items()):
        if entry[0]() is None and _formats.get(key) is entry:
            _formats.pop(key, None)
    _sweep_at = max(_FORMATS_SWEEP, 2 * len(_formats))


def _remember(a: jax.Array, fmt: Any) -> None:
    if len(_formats) >= _sweep_at:
        _sweep()
    _formats[id(a)] = (weakref.ref(a), fmt)


def known_format(a: jax.Array, fmt: Any) -> None:
    """Tells the programs ``a.format`` (equal to ``fmt``) so they need not compute it.

    Passing one ``Format`` object for many arrays (those equal to the one a manager
    was built for) lets programs be found by its identity instead of by hashing.
    """
    _remember(a, fmt)


def _format(a: jax.Array) -> Any:
    """``a.format``, computed once per array."""
    entry = _formats.get(id(a))
    if entry is not None and entry[0]() is a:
        return entry[1]
    fmt = a.format
    _remember(a, fmt)
    return fmt


def _program_of(kind: str, formats: tuple, raw: bool, with_digest: bool,
                options: tuple) -> tuple[Any, bool]:
    """``_program``, found by the identity of the ``Format`` objects first."""
    key = (kind, raw, with_digest, options, *map(id, formats))
    hit = _by_identity.get(key)
    if hit is not None and all(map(operator.is_, hit[0], formats)):
        return hit[1]
    found = _program(kind, formats, raw, with_digest, options)
    if len(_by_identity) >= _BY_IDENTITY_SIZE:
        _by_identity.clear()
    _by_identity[key] = (formats, found)
    return found


def run(kind: str, arrays: tuple[jax.Array, ...], *args, with_digest: bool = False,
         options: tuple = (), ballast: list | None = None):
    """Runs program ``kind``; its ballast output (an array ready once the program has
    run), where it has one, is appended to ``ballast``."""
    formats = tuple(map(_format, arrays))
    program, ballasted = _program_of(kind, formats, needs_raw_bits(arrays[0]), with_digest,
                                     options)
    if not ballasted:
        out = program(arrays, *args)
    else:
        out, done = program(arrays, *args, _SEED)
        if ballast is not None:
            ballast.append(done)
    if kind in _SAME_FORMATS:
        where = _SAME_FORMATS[kind]
        for a, fmt in zip(out if where is None else out[where], formats):
            _remember(a, fmt)
    return out


_deferred = threading.local()


@contextlib.contextmanager
def collected_compiles() -> Iterator[list[tuple[Hashable, Callable[[], Any]]]]:
    """Collects the compiles ``compile_ahead`` and ``compile_job`` ask for on this thread,
    instead of running them, as ``(key, job)`` pairs: ``job()`` compiles and returns the
    compiled program (``jax.stages.Compiled``). A key asked for twice is queued once.

    What compiling ahead of time (``kvxfer aot``) and ``deferred_compiles`` build on:
    the movers' own ``warmup`` says which programs a transfer runs.
    """
    jobs: list[tuple[Hashable, Callable[[], Any]]] = []
    previous = getattr(_deferred, "state", None)
    _deferred.state = (jobs, set())
    try:
        yield jobs
    finally:
        _deferred.state = previous


@contextlib.contextmanager
def deferred_compiles() -> Iterator[list[Callable[[], None]]]:
    """Collects the compiles ``compile_ahead`` asks for on this thread, instead of running
    them: the caller runs the jobs it yields (side by side: XLA compiles with the GIL
    released). A program asked for twice (by two buckets that share it) is queued once.
    """
    out: list[Callable[[], None]] = []
    with collected_compiles() as jobs:
        try:
            yield out
        finally:
            out.extend(job for _, job in jobs)


def compile_job(key: Hashable, job: Callable[[], Any]) -> None:
    """Runs ``job`` (a compile), or inside ``collected_compiles`` queues it once per ``key``."""
    state = getattr(_deferred, "state", None)
    if state is None:
        job()
        return
    jobs, keys = state
    if key not in keys:
        keys.add(key)
        jobs.append((key, job))


def _lowered(kind: str, arrays: tuple, args: tuple, with_digest: bool, options: tuple):
    formats = tuple(a.format for a in arrays)
    raw = needs_raw_bits(arrays[0])
    program, ballasted = _program(kind, formats, raw, with_digest, options)
    seed = (jax.ShapeDtypeStruct((), np.float32),) if ballasted else ()
    key = (kind, formats, raw, with_digest, options, tuple(arrays), args)
    return key, lambda: program.lower(arrays, *args, *seed)


def compile_ahead(kind: str, arrays: tuple, *args, with_digest: bool = False,
                  options: tuple = ()) -> None:
    """Compiles the program ``kind`` for these (abstract) arguments, running nothing.

    A later call with arrays of the same shapes, dtypes, shardings and layouts finds
    the program compiled. Inside ``deferred_compiles`` the compile is queued instead.
    """
    key, lower = _lowered(kind, arrays, args, with_digest, options)
    compile_job(key, lambda: lower().compile())


def compiled(kind: str, arrays: tuple, *args, with_digest: bool = False,
             options: tuple = ()) -> jax.stages.Compiled:
    """The program ``kind`` compiled for these (abstract) arguments, as ``compile_ahead``
    makes it (for tests and probes: its ``memory_analysis()``, its HLO)."""
    return _lowered(kind, arrays, args, with_digest, options)[1]().compile()


def lowered_for(platform: str, kind: str, arrays: tuple, *args, with_digest: bool = False,
                options: tuple = ()) -> str:
    """The StableHLO text of program ``kind`` lowered for ``platform`` (``"cuda"``, say),
    whatever backend this process runs: what a test reads to check a program another
    backend runs (which operations touch host memory), with no device of it at hand."""
    formats = tuple(a.format for a in arrays)
    program, ballasted = _program(kind, formats, needs_raw_bits(arrays[0]), with_digest,
                                  options)
    seed = (jax.ShapeDtypeStruct((), np.float32),) if ballasted else ()
    return program.trace(arrays, *args, *seed).lower(
        lowering_platforms=(platform,)).as_text()


def gather(arrays, ids, base, layer_nums, with_digest: bool):
    """Blocks ``ids`` of every layer stacked ``[L, k, ...]``, and their digests."""
    return run("gather", arrays, ids, base, layer_nums, with_digest=with_digest)


def digest_blocks(arrays, ids, base, layer_nums, count):
    """Digests ``uint32[L, len(ids), D]`` of blocks ``ids`` of every layer (no copy out).

    Where digests loop (``page_loops``) only the first ``count`` (an ``int32``
    scalar) are computed, and the rows past them are zero.
    """
    return run("digest", arrays, ids, base, layer_nums, count)


def alias(arrays):
    """The same buffers as new arrays, handed over in XLA's order (donated).

    The program runs once every computation dispatched earlier that uses the buffers
    is done; the returned arrays then own them alone.
    """
    return run("alias", arrays)


def scatter(arrays, ids, pages):
    """Writes ``pages[l, j]`` into block ``ids[j]`` of layer ``l``, in place (donated).

    Padding entries of ``ids`` are out of range and dropped.
    """
    return run("scatter", arrays, ids, pages)




def staged_load(arrays, ids, pages, count, ballast: list | None = None):
    """Writes ``pages[j, l]`` into block ``ids[j]`` of layer ``l`` for ``j < count``, in
    place (donated): one dynamic-update-slice per block (XLA:CPU).

    ``pages`` is page-major ``[n, L, *block]``; entries past ``count`` are never read.
    With ``ballast``, an array that is ready once the program has read ``pages`` is
    appended to it (where the program has one).
    """
    return run("staged_load", arrays, ids, pages, count, ballast=ballast)


@functools.lru_cache(maxsize=_PROGRAM_CACHE_SIZE)
def _zeros_program(shape: tuple[int, ...], dtype: str, sharding: jax.sharding.Sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding).lower().compile()


def zeros(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    """A new zeroed array placed by ``sharding`` (a compiled program, made once per shape)."""
    return _zeros_program(tuple(shape), jnp.dtype(dtype).name, sharding)()


def compile_zeros(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding) -> None:
    """Compiles what ``zeros`` runs for this shape, running nothing."""
    _zeros_program(tuple(shape), jnp.dtype(dtype).name, sharding)
