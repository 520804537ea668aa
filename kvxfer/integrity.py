"""Page digests that travel with KV-cache pages between device and host.

A *page* is the byte string of one block index of one layer (one shard). Before
a page leaves the device kvxfer computes :func:`digest` inside the jitted copy
program; after it comes back the digest is recomputed on the device and compared
(:func:`verify`). :func:`digest_np` is a numpy twin that gives bit-identical
digests on the host, and :func:`as_words` / :func:`as_words_np` turn pages of
any dtype into the ``uint32`` words the digest reads.

Example:
    >>> import numpy as np
    >>> import jax.numpy as jnp
    >>> from kvxfer import integrity
    >>> page = jnp.arange(4096, dtype=jnp.float32).astype(jnp.bfloat16)
    >>> ident = integrity.identity_words(key=7, layer=3, generation=1, shard=0)
    >>> words = integrity.as_words(page[None], batch_dims=1)  # uint32[1, 2048]
    >>> d = integrity.digest(words, ident)  # uint32[1, DIGEST_WORDS]
    >>> bool(integrity.verify(words, ident, d)[0])
    True
    >>> host = integrity.as_words_np(np.asarray(page)[None], batch_dims=1)
    >>> bool((integrity.digest_np(host, ident) == np.asarray(d)).all())
    True

Scheme
------
Let a page be the words ``w_0 .. w_{W-1}`` (``uint32``, ``W < 2**32``), split
into 16-bit halves ``lo_k = w_k & 0xFFFF`` and ``hi_k = w_k >> 16``, and weights

* ``m_k  = 2 * (k mod 2**16) + 1``  (odd, ``< 2**17``),
* ``m'_k = 2 * (k >> 16) + 1``      (odd, ``< 2**17``).

Four lanes are computed with ``uint32`` wraparound, i.e. modulo ``2**32``::

    A_lo = sum lo_k m_k      A_hi = sum hi_k m_k
    B_lo = sum lo_k m'_k     B_hi = sum hi_k m'_k

(Implementation detail: the kernel sums ``w_k m_k`` and ``hi_k m_k`` and
recovers ``A_lo = sum w_k m_k - 2**16 A_hi``, which is exact modulo ``2**32``
because ``w_k = lo_k + 2**16 hi_k``; likewise for ``B``. The weights come from
an iota inside the program, the four sums from one variadic reduction, so XLA
reads each page once. Addition modulo ``2**32`` is associative and commutative,
so the device and host summation orders give the same bits.)

The identity ``(key, layer, generation, shard)`` and the page length ``W`` are
mixed into four 32-bit values ``h_0..h_3`` (below) and the digest is
``d_l = fmix32(L_l + h_l)`` for the lanes ``L = (A_lo, A_hi, B_lo, B_hi)``,
where ``fmix32`` is the murmur3 finaliser (xorshifts and odd multiplies, a
bijection of ``uint32``). For a fixed identity and length the map
``L -> d`` is therefore a bijection, so two pages of the same identity have
equal digests **iff** their lane vectors are equal; all detection arguments
below are about ``L``. The all-zero page gets ``L = 0`` and digest
``fmix32(h)``, not ``h`` itself.

Guarantees and proofs
---------------------
Write ``v2(x)`` for the number of trailing zero bits of a nonzero integer
``x``; an integer ``x`` is ``0 mod 2**32`` iff ``x == 0`` or ``v2(x) >= 32``.
A change to a single half is a nonzero integer ``a`` with ``|a| < 2**16``, so
``v2(a) <= 15``.

1. *Every single-bit error is detected; more generally every error confined
   to one 32-bit word.* If word ``k`` changes, its ``lo`` or its ``hi`` half
   changes by some ``a != 0`` with ``v2(a) <= 15``, and the matching ``A`` lane
   changes by ``a * m_k``. ``m_k`` is odd, so ``v2(a m_k) = v2(a) <= 15 < 32``:
   the lane differs. (A single bit flip is the case ``a = +-2**b``, ``b <= 15``.)

2. *Every swap of two unequal words is detected, for any page of up to
   ``2**32 - 1`` words (16 GiB; in particular 64 MiB pages).* Swap words
   ``i < j`` with ``w_i != w_j``; let ``a = lo_j - lo_i`` or ``a = hi_j - hi_i``,
   whichever is nonzero (``v2(a) <= 15``). The lane of that half changes by
   ``a (m_i - m_j)`` in ``A`` and by ``a (m'_i - m'_j)`` in ``B``.

   * If ``i != j mod 2**16``: ``m_i - m_j = 2 d`` with ``0 < |d| < 2**16``,
     so ``v2(a (m_i - m_j)) <= 15 + 1 + 15 = 31``: the ``A`` lane differs.
   * Otherwise ``j - i = t 2**16`` with ``1 <= t < 2**16`` (because
     ``j - i < W < 2**32``), ``m_i = m_j`` and ``m'_i - m'_j = -2 t``, so
     ``v2(a (m'_i - m'_j)) <= 15 + 1 + 15 = 31``: the ``B`` lane differs.

   The worst case is tight: ``a = 2**15`` at distance ``2**15`` moves ``A`` by
   exactly ``2**31``.

3. *Random corruption is missed with probability at most* ``2**-32``. Model:
   in the corrupted page at least one word ``w'_j`` is uniformly distributed
   given the original page and all other corrupted words (a page or any
   aligned 4 bytes overwritten by garbage, a uniformly random page, ...;
   nothing is assumed about the other corrupted words). A miss needs
   ``A_lo' = A_lo`` and ``A_hi' = A_hi``. Conditioned on everything but
   ``w'_j``, ``A_lo' = c + lo'_j m_j (mod 2**32)``; ``m_j`` is odd, hence
   invertible modulo ``2**32``, so at most one of the ``2**16`` values of
   ``lo'_j`` gives the old ``A_lo``: probability ``<= 2**-16``. ``hi'_j`` is
   uniform and independent of ``lo'_j``, so ``A_hi`` adds another factor
   ``2**-16``: total ``<= 2**-32``, whatever the rest of the corruption is.
   (The ``B`` lanes can only lower this; empirically, random byte corruption
   is never missed in the tests.)

4. *Bound to identity.* With ``ctx = (layer, generation, shard, W)`` and the
   key split into ``(key_lo, key_hi)``:

   * ``(u, v) = Feistel(key_lo, key_hi)``, four rounds ``u ^= fmix32(v ^ r_i)``
     then swap: a bijection of the 64-bit key;
   * ``z_0 = u``, ``z_1 = v``, ``z_2 = u ^ fmix32(v ^ s)``,
     ``z_3 = v ^ fmix32(u ^ s')``;
   * ``h_l = C_l(z_l)``: the chain ``x = fmix32(z_l ^ seed_l)`` followed by
     ``x = fmix32(x ^ c)`` for each ``c`` in ``ctx``.

   Every chain step is a bijection of its state and of the word it absorbs.
   For the same page bytes ``L`` is the same, and ``d_l = fmix32(L_l + h_l)``
   is a bijection of ``h_l``, so the digests differ iff the ``h`` differ.
   (a) If only the key changes, ``(h_0, h_1) = (C_0(u), C_1(v))`` is an
   injective function of the key for fixed ``ctx``: the digest always changes.
   (b) If exactly one of layer, generation, shard changes, every ``h_l`` is a
   bijection of that word (others fixed): the digest always changes.
   (c) Any other change gives a 128-bit ``h`` from a full-avalanche mixer;
   a collision then needs a coincidence of about ``2**-128`` (heuristic, not a
   proof). This is an error-detection code, not a MAC: it offers no
   protection against an adversary who chooses the corruption.

Byte order: pages are read as little-endian ``uint32`` words, which is what
``numpy.ndarray.view`` and ``jax.lax.bitcast_convert_type`` produce on the
little-endian CPUs and GPUs kvxfer runs on. The numbers in this module (seeds,
multipliers, lane order) define the digest format; changing any of them
changes every digest.
"""

from __future__ import annotations

import hashlib
import math
import operator
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "DIGEST_WORDS",
    "IDENTITY_WORDS",
    "MAX_PAGE_WORDS",
    "as_words",
    "as_words_np",
    "digest",
    "digest_layers",
    "digest_np",
    "identity_words",
    "key_from_bytes",
    "verify",
]

DIGEST_WORDS: int = 4
"""Number of ``uint32`` words in one digest: the lanes A_lo, A_hi, B_lo, B_hi."""

IDENTITY_WORDS: int = 5
"""Number of ``uint32`` words of an identity: key lo, key hi, layer, generation, shard."""

MAX_PAGE_WORDS: int = 2**32 - 1
"""Largest page, in ``uint32`` words, for which guarantee 2 (swaps) is proven."""

# --- digest format constants (changing any of them changes every digest) ----
_FMIX_C1 = np.uint32(0x85EBCA6B)
_FMIX_C2 = np.uint32(0xC2B2AE35)
_FEISTEL_KEYS = tuple(np.uint32(c) for c in (0x9E3779B9, 0x7F4A7C15, 0xF39CC060, 0x5CEDC834))
_CROSS_SEEDS = (np.uint32(0x2545F491), np.uint32(0x6A09E667))
_LANE_SEEDS = tuple(np.uint32(c) for c in (0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F))
_KEY_PERSON = b"kvxfer-key-v1"

_HALF_MASK = 0xFFFF
_HALF_BITS = 16

_U32_MAX = 2**32 - 1
_U64_LIMIT = 2**64


# ---------------------------------------------------------------------------
# identities
# ---------------------------------------------------------------------------


def _as_index(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        kind = type(value).__name__
        raise TypeError(f"{name} must be an integer, got {kind} {value!r}") from None


def identity_words(key: int, layer: int, generation: int, shard: int) -> np.ndarray:
    """Packs the identity of a page into ``uint32[IDENTITY_WORDS]``.

    Args:
        key: Page key, an integer in ``[0, 2**64)`` (see :func:`key_from_bytes`
            for keys that are byte strings).
        layer: Layer index, in ``[0, 2**32)``.
        generation: Generation counter of the page, in ``[0, 2**32)``.
        shard: Shard index, in ``[0, 2**32)``.

    Returns:
        ``uint32[5]``: key low 32 bits, key high 32 bits, layer, generation, shard.

    Raises:
        ValueError: If a value is out of range (the message names the value).
        TypeError: If a value is not an integer.

    Example:
        >>> identity_words(2**32 + 5, 1, 2, 3).tolist()
        [5, 1, 1, 2, 3]
    """
    key = _as_index("key", key)
    if not 0 <= key < _U64_LIMIT:
        raise ValueError(f"key must be in [0, 2**64), got {key}")
    fields = []
    for name, value in (("layer", layer), ("generation", generation), ("shard", shard)):
        value = _as_index(name, value)
        if not 0 <= value <= _U32_MAX:
            raise ValueError(f"{name} must be in [0, 2**32), got {value}")
        fields.append(value)
    return np.array([key & _U32_MAX, key >> 32, *fields], dtype=np.uint32)


def key_from_bytes(data: bytes) -> int:
    """Derives a stable 64-bit page key from a byte string (e.g. a token hash).

    The key is the little-endian value of an 8-byte BLAKE2b digest of ``data``
    (personalised with ``b"kvxfer-key-v1"``); it does not depend on the Python
    process, platform or hash seed.

    Args:
        data: Any bytes-like object.

    Returns:
        An integer in ``[0, 2**64)``.

    Example:
        >>> key_from_bytes(b"tokens") == key_from_bytes(bytearray(b"tokens"))
        True
    """
    if isinstance(data, str):
        raise TypeError("key_from_bytes needs bytes, got str; encode it first")
    h = hashlib.blake2b(bytes(memoryview(data)), digest_size=8, person=_KEY_PERSON)
    return int.from_bytes(h.digest(), "little")


# ---------------------------------------------------------------------------
# pages as words
# ---------------------------------------------------------------------------


def _split_dims(shape: tuple[int, ...], batch_dims: int) -> tuple[tuple[int, ...], int]:
    batch_dims = _as_index("batch_dims", batch_dims)
    if not 0 <= batch_dims <= len(shape):
        raise ValueError(
            f"batch_dims must be in [0, {len(shape)}] for shape {shape}, got {batch_dims}"
        )
    return tuple(shape[:batch_dims]), math.prod(shape[batch_dims:])


def _check_dtype(dtype: np.dtype) -> int:
    """Returns the bit width of ``dtype``, rejecting dtypes that have no byte view."""
    if dtype.kind == "c":
        raise TypeError(f"complex pages are not supported, got {dtype}")
    if dtype.kind not in "biufV" or dtype.fields is not None or dtype.subdtype is not None:
        raise TypeError(f"pages must have a numeric dtype, got {dtype}")
    bits = jax.dtypes.itemsize_bits(dtype)
    if bits not in (1, 2, 4, 8, 16, 32, 64):
        raise TypeError(f"unsupported element width {bits} bits for dtype {dtype}")
    return bits


def as_words(x: jax.Array, batch_dims: int) -> jax.Array:
    """Reinterprets trailing block data as little-endian ``uint32`` words.

    The dims after the first ``batch_dims`` are flattened; their bytes are
    bit-cast (never value-converted) to ``uint32``, zero-padding the byte count
    up to a multiple of 4. Sub-byte dtypes (``int4``, ``uint4``, ``int2``,
    ``float4_e2m1fn``, ...) count as one byte per element holding the raw bits
    in its low bits (as numpy/ml_dtypes store them); ``bool`` is one byte 0/1.
    Jittable; under ``jax.jit`` it fuses into the consumer.

    Args:
        x: Array of shape ``[*batch, *block_shape]``, any real dtype.
        batch_dims: Number of leading dims to keep.

    Returns:
        ``uint32[*batch, W]`` with ``W = ceil(bytes(block) / 4)``.

    Raises:
        TypeError: For complex dtypes, or a host array whose dtype JAX would
            value-convert (e.g. ``float64`` while x64 is disabled).
        ValueError: If ``batch_dims`` is out of range.

    Example:
        >>> x = jnp.ones((2, 3, 5), jnp.bfloat16)
        >>> as_words(x, batch_dims=1).shape  # 15 bf16 = 30 bytes -> 8 words
        (2, 8)
    """
    if not isinstance(x, jax.Array):
        dt = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
        if jax.dtypes.canonicalize_dtype(dt) != dt:
            raise TypeError(f"JAX would value-convert {dt} to {jax.dtypes.canonicalize_dtype(dt)}; "
                            "enable x64 or pass a jax.Array")
    x = jnp.asarray(x)
    lead, n = _split_dims(x.shape, batch_dims)
    bits = _check_dtype(np.dtype(x.dtype))
    x = x.reshape(lead + (n,))
    if x.dtype == jnp.bool_:
        x, bits = x.astype(jnp.uint8), 8
    elif bits < 8:
        x = lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint8)
        bits = 8
    else:
        x = lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}"))
    if bits == 64:
        # uint64[..., n] -> uint32[..., n, 2] (low word first) -> uint32[..., 2n]
        return lax.bitcast_convert_type(x, jnp.uint32).reshape(lead + (2 * n,))
    if bits == 32:
        return x
    per_word = 32 // bits
    pad = -n % per_word
    if pad:
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)])
    # Little-endian packing by shifts of strided slices, not a bitcast of a
    # ``[..., W, per_word]`` reshape: XLA:TPU lays that minor dim of 2 or 4 out padded
    # to 128 lanes, and a digest of one 1.25 MiB bf16 page staged 160 MiB for it (0.4
    # MiB this way; deviceless compile, libtpu 0.0.42.1).
    x = x.astype(jnp.uint32)
    word = x[..., 0::per_word]
    for i in range(1, per_word):
        word = word | (x[..., i::per_word] << (bits * i))
    return word


def as_words_np(x: np.ndarray, batch_dims: int) -> np.ndarray:
    """Numpy twin of :func:`as_words`: the same words, bit for bit.

    Zero-copy (a ``.view``) when the block is a whole number of words and
    ``x`` is C-contiguous in native byte order.

    Args:
        x: Array of shape ``[*batch, *block_shape]``, any real dtype
            (including ml_dtypes such as ``bfloat16``, ``float8_e4m3fn``, ``int4``).
        batch_dims: Number of leading dims to keep.

    Returns:
        ``uint32[*batch, W]`` with ``W = ceil(bytes(block) / 4)``.

    Raises:
        TypeError: For complex dtypes.
        ValueError: If ``batch_dims`` is out of range.

    Example:
        >>> as_words_np(np.arange(6, dtype=np.uint8)[None], 1).tolist()
        [[50462976, 1284]]
    """
    x = np.asarray(x)
    lead, n = _split_dims(x.shape, batch_dims)
    bits = _check_dtype(x.dtype)
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    x = np.ascontiguousarray(x).reshape(lead + (n,))
    b = x.view(np.uint8)  # [..., n * itemsize]
    if bits < 8 and x.dtype != np.bool_:
        b = b & np.uint8((1 << bits) - 1)
    nbytes = b.shape[-1]
    pad = -nbytes % 4
    if pad:
        b = np.concatenate([b, np.zeros(lead + (pad,), np.uint8)], axis=-1)
    if sys.byteorder != "little":  # pragma: no cover - kvxfer hosts are little-endian
        return b.view("<u4").astype(np.uint32)
    return b.view(np.uint32)


# ---------------------------------------------------------------------------
# digest
# ---------------------------------------------------------------------------


def _fmix32(h: Any) -> Any:
    """murmur3 finaliser on ``uint32`` arrays (numpy or jax): a bijection."""
    h = h ^ (h >> 16)
    h = h * _FMIX_C1
    h = h ^ (h >> 13)
    h = h * _FMIX_C2
    return h ^ (h >> 16)


def _identity_hash(identity: Any, n_words: int, xp: Any) -> Any:
    """``uint32[..., 5]`` identity and page length -> ``uint32[..., 4]`` lane offsets."""
    u, v = identity[..., 0], identity[..., 1]
    for r in _FEISTEL_KEYS:  # bijection of the 64-bit key
        u, v = v, u ^ _fmix32(v ^ r)
    z = (
        u,
        v,
        u ^ _fmix32(v ^ _CROSS_SEEDS[0]),
        v ^ _fmix32(u ^ _CROSS_SEEDS[1]),
    )
    ctx = (identity[..., 2], identity[..., 3], identity[..., 4], np.uint32(n_words))
    lanes = []
    for z_l, seed in zip(z, _LANE_SEEDS):
        x = _fmix32(z_l ^ seed)
        for c in ctx:
            x = _fmix32(x ^ c)
        lanes.append(x)
    return xp.stack(lanes, axis=-1)


def _check_words(words: Any, identity: Any) -> int:
    if words.dtype != np.uint32:
        raise TypeError(f"words must be uint32 (see as_words), got {words.dtype}")
    if identity.dtype != np.uint32:
        raise TypeError(f"identity must be uint32 (see identity_words), got {identity.dtype}")
    if words.ndim < 1:
        raise ValueError("words must have at least one dim (the page words)")
    if identity.ndim < 1 or identity.shape[-1] != IDENTITY_WORDS:
        raise ValueError(f"identity must have shape [..., {IDENTITY_WORDS}], got {identity.shape}")
    n_words = words.shape[-1]
    if n_words > MAX_PAGE_WORDS:
        raise ValueError(f"pages are limited to {MAX_PAGE_WORDS} words, got {n_words}")
    return n_words


def _add4(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Reducer of the four lane sums (``uint32`` addition wraps modulo ``2**32``)."""
    return tuple(x + y for x, y in zip(a, b))


def _lanes(words: jax.Array) -> jax.Array:
    """``uint32[..., W]`` -> lanes ``(A_lo, A_hi, B_lo, B_hi)`` in one fused variadic reduce."""
    return _lanes_of(*_lane_sums(words))


def _lanes_of(sa: jax.Array, a_hi: jax.Array, sb: jax.Array, b_hi: jax.Array) -> jax.Array:
    """The lanes ``[..., 4]`` from the sums ``_lane_sums`` returns."""
    a_lo = sa - (a_hi << _HALF_BITS)
    b_lo = sb - (b_hi << _HALF_BITS)
    return jnp.stack([a_lo, a_hi, b_lo, b_hi], axis=-1)


def _lane_sums(words: jax.Array) -> tuple[jax.Array, ...]:
    """``uint32[..., W]`` -> the sums ``(A, A_hi, B, B_hi)`` (one fused variadic reduce)."""
    n_words = words.shape[-1]
    axis = words.ndim - 1
    k = lax.broadcasted_iota(jnp.uint32, words.shape, axis)
    m = ((k & _HALF_MASK) << 1) | 1
    hi = words >> _HALF_BITS
    if n_words <= 2**_HALF_BITS:  # m'_k == 1 for every k
        ops = (words * m, hi * m, words, hi)
    else:
        mb = ((k >> _HALF_BITS) << 1) | 1
        ops = (words * m, hi * m, words * mb, hi * mb)
    zero = jnp.zeros((), jnp.uint32)
    return tuple(lax.reduce(ops, (zero,) * 4, _add4, (axis,)))


_NP_CHUNK_WORDS = 1 << 20  # words per numpy pass: keeps temporaries ~4 MiB each


def _lanes_np(words: np.ndarray) -> np.ndarray:
    """The lane definitions, written out directly (independent of the jax kernel's algebra)."""
    n_words = words.shape[-1]
    rows = words.reshape(math.prod(words.shape[:-1]), n_words)
    out = np.zeros((rows.shape[0], DIGEST_WORDS), np.uint32)
    cols = min(max(n_words, 1), _NP_CHUNK_WORDS)
    step = max(1, _NP_CHUNK_WORDS // cols)
    for c0 in range(0, n_words, cols):
        k = np.arange(c0, min(c0 + cols, n_words), dtype=np.uint32)
        m = ((k & np.uint32(_HALF_MASK)) << np.uint32(1)) | np.uint32(1)
        mb = ((k >> np.uint32(_HALF_BITS)) << np.uint32(1)) | np.uint32(1)
        ones = bool((mb == 1).all())  # m'_k == 1 for every k < 2**16: skip the multiply
        for r0 in range(0, rows.shape[0], step):
            chunk = rows[r0:r0 + step, c0:c0 + cols]
            lo = chunk & np.uint32(_HALF_MASK)
            hi = chunk >> np.uint32(_HALF_BITS)
            dst = out[r0:r0 + step]  # uint32 += wraps modulo 2**32, like the device sum
            dst[:, 0] += np.sum(lo * m, axis=-1, dtype=np.uint32)
            dst[:, 1] += np.sum(hi * m, axis=-1, dtype=np.uint32)
            dst[:, 2] += np.sum(lo if ones else lo * mb, axis=-1, dtype=np.uint32)
            dst[:, 3] += np.sum(hi if ones else hi * mb, axis=-1, dtype=np.uint32)
    return out.reshape(words.shape[:-1] + (DIGEST_WORDS,))


def digest(words: jax.Array, identity: jax.Array) -> jax.Array:
    """Digests pages of ``uint32`` words under their identities (jittable).

    Pure ``jax.numpy``/``lax`` with ``uint32`` arithmetic only; inside a larger
    ``jax.jit`` program it fuses with the producer of ``words`` (e.g.
    :func:`as_words` of a KV-cache gather) and reads each page once.

    Args:
        words: ``uint32[..., W]`` page words (see :func:`as_words`).
        identity: ``uint32[..., IDENTITY_WORDS]`` (see :func:`identity_words`);
            its leading dims broadcast against those of ``words``.

    Returns:
        ``uint32[..., DIGEST_WORDS]`` over the broadcast leading dims.

    Raises:
        TypeError: If ``words`` or ``identity`` is not ``uint32``.
        ValueError: On a malformed identity shape or a page over
            ``MAX_PAGE_WORDS`` words.

    Example:
        >>> w = jnp.zeros((8, 4096), jnp.uint32)  # 8 pages of 16 KiB
        >>> ids = jnp.stack([jnp.asarray(identity_words(k, 0, 0, 0)) for k in range(8)])
        >>> jax.jit(digest)(w, ids).shape
        (8, 4)
    """
    words = jnp.asarray(words)
    identity = jnp.asarray(identity)
    n_words = _check_words(words, identity)
    return _fmix32(_lanes(words) + _identity_hash(identity, n_words, jnp))


def digest_layers(words: Sequence[jax.Array], identity: jax.Array,
                  layers: jax.Array) -> jax.Array:
    """Digests of the same pages in several layers, stacked (jittable).

    Entry ``l`` is ``digest(words[l], identity)`` with the identity's layer word set
    to ``layers[l]``. The identity hashing runs on all layers at once: traced once,
    not once per layer, it made the programs that digest 32 layers trace 3x faster
    (their warm-up over a persistent compilation cache is mostly tracing).

    Args:
        words: ``uint32[..., W_l]`` page words of each layer, with the same leading
            dims (see :func:`as_words`).
        identity: ``uint32[..., IDENTITY_WORDS]`` identities of the pages, their layer
            word ignored; leading dims broadcast against those of ``words``.
        layers: ``uint32[len(words)]`` the layer numbers.

    Returns:
        ``uint32[len(words), ..., DIGEST_WORDS]``.

    Example:
        >>> w = [jnp.full((2, 1024), l, jnp.uint32) for l in range(3)]
        >>> ident = jnp.asarray(np.stack([identity_words(k, 0, 1, 0) for k in (5, 6)]))
        >>> d = digest_layers(w, ident, jnp.arange(3, dtype=jnp.uint32))
        >>> d.shape, bool((d[2] == digest(w[2], ident.at[:, 2].set(2))).all())
        ((3, 2, 4), True)
    """
    identity = jnp.asarray(identity)
    layers = jnp.asarray(layers)
    by_length: dict[int, list[int]] = {}
    for l, w in enumerate(words):
        by_length.setdefault(_check_words(w, identity), []).append(l)
    out: list[Any] = [None] * len(words)
    for n_words, group in by_length.items():
        nums = layers if len(group) == len(words) else layers[np.asarray(group)]
        ids = jnp.broadcast_to(identity, (len(group),) + identity.shape)
        ids = ids.at[..., 2].set(nums.reshape((-1,) + (1,) * (identity.ndim - 1)))
        offsets = _identity_hash(ids, n_words, jnp)
        # The lane sums of each layer (one reduce each), then one elementwise pass for
        # the whole group: on XLA:CPU a finishing pass per layer was a kernel per layer.
        sums = [_lane_sums(words[l]) for l in group]
        lanes = _lanes_of(*(jnp.stack([s[i] for s in sums]) for i in range(4)))
        # Each layer's lanes and offsets broadcast as ``digest`` broadcasts them:
        # right-aligned, past the leading layer dim.
        ndim = max(lanes.ndim, offsets.ndim)
        lanes, offsets = (_unit_dims_after_first(x, ndim) for x in (lanes, offsets))
        out_group = _fmix32(lanes + offsets)
        for j, l in enumerate(group):
            out[l] = out_group[j]
    return jnp.stack(out)


def _unit_dims_after_first(x: jax.Array, ndim: int) -> jax.Array:
    """``x`` with unit dims inserted after its first, up to ``ndim`` dims."""
    return x.reshape(x.shape[:1] + (1,) * (ndim - x.ndim) + x.shape[1:])


def digest_np(words: np.ndarray, identity: np.ndarray) -> np.ndarray:
    """Numpy twin of :func:`digest`, bit-identical to it.

    Args:
        words: ``uint32[..., W]`` page words (see :func:`as_words_np`).
        identity: ``uint32[..., IDENTITY_WORDS]``, broadcasting like :func:`digest`.

    Returns:
        ``uint32[..., DIGEST_WORDS]``.

    Raises:
        TypeError: If ``words`` or ``identity`` is not ``uint32``.
        ValueError: On a malformed identity shape or an oversized page.

    Example:
        >>> ident = identity_words(1, 2, 3, 4)
        >>> digest_np(np.zeros((4096,), np.uint32), ident).shape
        (4,)
    """
    words = np.asarray(words)
    identity = np.asarray(identity)
    n_words = _check_words(words, identity)
    with np.errstate(over="ignore"):
        out = _fmix32(_lanes_np(words) + _identity_hash(identity, n_words, np))
    return np.asarray(out, dtype=np.uint32)


def verify(words: jax.Array, identity: jax.Array, expected: jax.Array) -> jax.Array:
    """Checks pages against expected digests (jittable).

    Args:
        words: ``uint32[..., W]`` page words as they came back.
        identity: ``uint32[..., IDENTITY_WORDS]`` identity the page should have.
        expected: ``uint32[..., DIGEST_WORDS]`` digest computed before the copy.

    Returns:
        ``bool[...]``: True where the page matches its digest.

    Example:
        >>> w = jnp.ones((2, 4096), jnp.uint32)
        >>> ident = identity_words(9, 0, 0, 0)
        >>> verify(w, ident, digest(w, ident)).tolist()
        [True, True]
    """
    return jnp.all(digest(words, identity) == jnp.asarray(expected), axis=-1)
