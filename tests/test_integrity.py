"""Tests for kvxfer.integrity: host/device bit identity and the four guarantees.

Run ``python tests/test_integrity.py`` for a throughput benchmark (not a test).
"""

from __future__ import annotations

import functools
import hashlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvxfer import integrity as I
from kvxfer import testing

KIB = 1024
MIB = 1024 * KIB

DTYPES = {
    "f32": np.float32,
    "bf16": ml_dtypes.bfloat16,
    "f16": np.float16,
    "int8": np.int8,
    "uint8": np.uint8,
    "int32": np.int32,
    "f8e4m3fn": ml_dtypes.float8_e4m3fn,
    "f8e5m2": ml_dtypes.float8_e5m2,
    "int4": ml_dtypes.int4,
    "uint4": ml_dtypes.uint4,
    "f4e2m1fn": ml_dtypes.float4_e2m1fn,
    "bool": np.bool_,
}
DIGEST_DTYPES = ["f32", "bf16", "f16", "int8", "f8e4m3fn", "int4"]

IDENT = I.identity_words(0x0123456789ABCDEF, 1, 2, 3)


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    """Uniformly random bit patterns (NaNs, -0, subnormals...), from ``rng``."""
    return testing.random_bits(shape, dtype, rng)


def reference_words(x: np.ndarray, batch_dims: int) -> np.ndarray:
    """Independent reference for as_words: the raw bytes, zero-padded, as <u4."""
    lead = x.shape[:batch_dims]
    rows = np.ascontiguousarray(x).reshape(lead + (-1,))
    flat = rows.reshape(-1, rows.shape[-1]) if lead else rows.reshape(1, -1)
    out = []
    for row in flat:
        b = row.tobytes()
        b += b"\0" * (-len(b) % 4)
        out.append(np.frombuffer(b, "<u4"))
    return np.stack(out).reshape(lead + (-1,))


@functools.cache
def jitted_digest(batch_dims: int):
    return jax.jit(lambda x, ident: I.digest(I.as_words(x, batch_dims), ident))


_jit_digest = jax.jit(I.digest)


def digest_rows(words: np.ndarray, ident=IDENT) -> np.ndarray:
    return np.asarray(_jit_digest(words, ident))


def unique_rows(d: np.ndarray) -> int:
    return len(np.unique(d.reshape(-1, d.shape[-1]), axis=0))


# ---------------------------------------------------------------------------
# as_words
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize(
    "shape,batch_dims",
    [
        ((2, 16, 64), 1),
        ((3, 5, 7), 1),
        ((2, 3, 9), 2),
        ((1, 4097), 1),
        ((13,), 0),
        ((2, 2, 3, 3), 1),
    ],
)
def test_as_words_matches_numpy_view(name, shape, batch_dims):
    x = random_array(np.random.default_rng(len(shape) * 31 + shape[-1]), shape, DTYPES[name])
    ref = reference_words(x, batch_dims)
    host = I.as_words_np(x, batch_dims)
    dev = np.asarray(jax.jit(I.as_words, static_argnums=1)(jnp.asarray(x), batch_dims))
    assert host.dtype == np.uint32 and dev.dtype == np.uint32
    assert host.shape == ref.shape == dev.shape
    np.testing.assert_array_equal(host, ref)
    np.testing.assert_array_equal(dev, ref)


def test_as_words_is_a_bitcast_not_a_value_conversion():
    x = np.array([[1.0, -0.0, np.nan, 2.5]], np.float32)
    np.testing.assert_array_equal(np.asarray(I.as_words(jnp.asarray(x), 1)), x.view(np.uint32))
    expected = [[0x3F800000, 0x80000000, 0x7FC00000, 0x40200000]]
    np.testing.assert_array_equal(I.as_words_np(x, 1), expected)


def test_as_words_np_is_zero_copy_and_handles_byte_order():
    x = random_array(np.random.default_rng(1), (4, 64), np.float32)
    w = I.as_words_np(x, 1)
    assert np.shares_memory(w, x)
    big = x.astype(">f4")
    np.testing.assert_array_equal(I.as_words_np(big, 1), w)
    np.testing.assert_array_equal(I.as_words_np(np.asfortranarray(x), 1), w)


def test_as_words_64_bit_dtypes_under_x64():
    x = random_array(np.random.default_rng(2), (3, 5), np.float64)
    with jax.enable_x64(True):
        dev = np.asarray(I.as_words(jnp.asarray(x), 1))
    np.testing.assert_array_equal(dev, reference_words(x, 1))
    np.testing.assert_array_equal(I.as_words_np(x, 1), reference_words(x, 1))


def test_as_words_rejects_what_it_cannot_bitcast():
    with pytest.raises(TypeError, match="complex"):
        I.as_words(jnp.zeros((2, 2), jnp.complex64), 1)
    with pytest.raises(TypeError, match="complex"):
        I.as_words_np(np.zeros((2, 2), np.complex64), 1)
    if not jax.config.jax_enable_x64:
        with pytest.raises(TypeError, match="value-convert"):
            I.as_words(np.zeros((2, 2), np.float64), 1)
    with pytest.raises(ValueError, match="batch_dims"):
        I.as_words(jnp.zeros((2, 2), jnp.float32), 3)
    with pytest.raises(ValueError, match="batch_dims"):
        I.as_words_np(np.zeros((2, 2), np.float32), -1)


# ---------------------------------------------------------------------------
# host/device bit identity
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", DIGEST_DTYPES)
@pytest.mark.parametrize(
    "page_bytes", [16 * KIB, 64 * KIB, 1 * MIB, 16 * KIB + 1, 64 * KIB + 3, 262_150]
)
def test_digest_numpy_and_jax_bit_identical(name, page_bytes):
    dtype = np.dtype(DTYPES[name])
    elems = page_bytes // max(dtype.itemsize, 1)
    pages = 2 if page_bytes >= MIB else 3
    rng = np.random.default_rng(page_bytes + len(name))
    x = random_array(rng, (pages, elems), dtype)
    keys = [int(rng.integers(0, 2**63)) * 2 + 1 for _ in range(pages)]
    ident = np.stack([I.identity_words(k, i, 7, 1) for i, k in enumerate(keys)])
    host = I.digest_np(I.as_words_np(x, 1), ident)
    dev = np.asarray(jitted_digest(1)(jnp.asarray(x), jnp.asarray(ident)))
    assert host.shape == dev.shape == (pages, I.DIGEST_WORDS)
    assert host.dtype == dev.dtype == np.uint32
    np.testing.assert_array_equal(dev, host)
    assert unique_rows(host) == pages


@pytest.mark.parametrize(
    "x_shape,batch_dims,ident_shape,out_shape",
    [
        ((2, 3, 16, 128), 2, (3, I.IDENTITY_WORDS), (2, 3)),
        ((2, 3, 16, 128), 2, (2, 1, I.IDENTITY_WORDS), (2, 3)),
        ((4, 2048), 1, (I.IDENTITY_WORDS,), (4,)),
        ((1024,), 0, (5, I.IDENTITY_WORDS), (5,)),
        ((2, 3, 3, 7), 3, (3, 1, I.IDENTITY_WORDS), (2, 3, 3)),
    ],
)
def test_digest_batched_leading_dims_broadcast(x_shape, batch_dims, ident_shape, out_shape):
    rng = np.random.default_rng(sum(x_shape))
    x = random_array(rng, x_shape, ml_dtypes.bfloat16)
    ident = rng.integers(0, 2**32, ident_shape, dtype=np.uint32)
    host = I.digest_np(I.as_words_np(x, batch_dims), ident)
    dev = np.asarray(jitted_digest(batch_dims)(jnp.asarray(x), jnp.asarray(ident)))
    assert host.shape == dev.shape == out_shape + (I.DIGEST_WORDS,)
    np.testing.assert_array_equal(dev, host)
    # Every batch element equals the digest of that page alone.
    words = I.as_words_np(x, batch_dims)
    words_b = np.broadcast_to(words, out_shape + words.shape[-1:])
    ident_b = np.broadcast_to(ident, out_shape + (I.IDENTITY_WORDS,))
    for idx in np.ndindex(out_shape):
        np.testing.assert_array_equal(host[idx], I.digest_np(words_b[idx], ident_b[idx]))


@pytest.mark.parametrize("chunk", [1000, 2**16 + 3])
def test_digest_np_chunking_does_not_change_the_result(monkeypatch, chunk):
    rng = np.random.default_rng(chunk)
    words = rng.integers(0, 2**32, (3, 2**17 + 11), dtype=np.uint32)
    whole = I.digest_np(words, IDENT)
    monkeypatch.setattr(I, "_NP_CHUNK_WORDS", chunk)
    np.testing.assert_array_equal(I.digest_np(words, IDENT), whole)
    np.testing.assert_array_equal(np.asarray(I.digest(words, IDENT)), whole)


def test_digest_golden_values():
    """Frozen format: these literals change only if the digest scheme changes."""
    w = np.arange(4096, dtype=np.uint32) * np.uint32(2654435761)
    w_big = np.arange(2**17 + 3, dtype=np.uint32) * np.uint32(2654435761)
    cases = [
        (w, [0x1374928B, 0xFAB49B0C, 0x4AC19E06, 0x5FA58A65]),
        (np.zeros(0, np.uint32), [0x8571A539, 0xC3CAF24D, 0xB6705516, 0x41B1B143]),
        (w_big, [0x2515B590, 0x764BA66C, 0x27C78598, 0x39F2F854]),
    ]
    for words, expected in cases:
        np.testing.assert_array_equal(I.digest_np(words, IDENT), np.array(expected, np.uint32))
        dev = np.asarray(I.digest(words, IDENT))
        np.testing.assert_array_equal(dev, np.array(expected, np.uint32))


@pytest.mark.parametrize("ident_shape", [(3, I.IDENTITY_WORDS), (I.IDENTITY_WORDS,)])
def test_digest_layers_equals_each_layers_digest(ident_shape):
    """Layers of two page lengths (two hashing groups), in a jitted program: entry ``l``
    is the host digest of layer ``l``'s pages under its own layer number."""
    rng = np.random.default_rng(len(ident_shape))
    lengths = [512, 300, 512, 300, 512]
    words = [rng.integers(0, 2**32, (3, n), dtype=np.uint32) for n in lengths]
    ident = rng.integers(0, 2**32, ident_shape, dtype=np.uint32)
    layers = np.array([7, 0, 31, 2, 9], np.uint32)
    got = np.asarray(jax.jit(I.digest_layers)([jnp.asarray(w) for w in words],
                                              jnp.asarray(ident), jnp.asarray(layers)))
    assert got.shape == (5, 3, I.DIGEST_WORDS)
    for l, (w, layer) in enumerate(zip(words, layers)):
        own = ident.copy()
        own[..., 2] = layer
        np.testing.assert_array_equal(got[l], I.digest_np(w, own), err_msg=f"layer {l}")
    assert unique_rows(got.reshape(-1, I.DIGEST_WORDS)) == 15


def test_digest_fuses_into_a_bigger_jit_program():
    rng = np.random.default_rng(5)
    cache = random_array(rng, (2, 8, 16, 4, 64), ml_dtypes.bfloat16)  # [layer, block, ...]
    blocks = np.array([5, 1, 6])
    idents = np.stack([I.identity_words(int(b) + 100, 1, 9, 0) for b in blocks])

    @jax.jit
    def gather_and_digest(cache, blocks, idents):
        pages = cache[1, blocks] * 1  # a gather feeding the digest
        words = I.as_words(pages, 1)
        d = I.digest(words, idents)
        return pages, d, I.verify(words, idents, d)

    pages, d, ok = gather_and_digest(jnp.asarray(cache), jnp.asarray(blocks), jnp.asarray(idents))
    expected = I.digest_np(I.as_words_np(cache[1, blocks], 1), idents)
    np.testing.assert_array_equal(np.asarray(d), expected)
    assert np.asarray(ok).tolist() == [True, True, True]


def test_verify_flags_exactly_the_bad_pages():
    rng = np.random.default_rng(6)
    words = rng.integers(0, 2**32, (4, 4096), dtype=np.uint32)
    idents = np.stack([I.identity_words(k, 0, 0, 0) for k in range(4)])
    d = I.digest_np(words, idents)
    bad = words.copy()
    bad[2, 1000] ^= np.uint32(1 << 20)
    assert np.asarray(I.verify(bad, idents, d)).tolist() == [True, True, False, True]
    wrong_ident = idents.copy()
    wrong_ident[0, 3] += np.uint32(1)
    assert np.asarray(I.verify(words, wrong_ident, d)).tolist() == [False, True, True, True]


def test_digest_rejects_bad_inputs():
    w = np.zeros((2, 16), np.uint32)
    with pytest.raises(TypeError, match="uint32"):
        I.digest(w.astype(np.int32), IDENT)
    with pytest.raises(TypeError, match="uint32"):
        I.digest_np(w, IDENT.astype(np.int64))
    with pytest.raises(ValueError, match="identity"):
        I.digest_np(w, IDENT[:4])
    with pytest.raises(ValueError, match="identity"):
        I.digest(w, IDENT[:4])


# ---------------------------------------------------------------------------
# guarantee 1: single-bit errors
# ---------------------------------------------------------------------------


def test_every_single_bit_flip_of_a_small_page_is_detected():
    rng = np.random.default_rng(11)
    n = 256
    base = rng.integers(0, 2**32, n, dtype=np.uint32)
    bit = np.arange(32 * n)
    pages = np.tile(base, (bit.size, 1))
    pages[bit, bit // 32] ^= (np.uint32(1) << (bit % 32).astype(np.uint32))
    assert (pages != base).sum() == bit.size  # each page differs in exactly one bit
    ref = I.digest_np(base, IDENT)
    dev = digest_rows(pages)
    host = I.digest_np(pages, IDENT)
    np.testing.assert_array_equal(dev, host)
    assert not np.all(dev == ref, axis=-1).any()
    # With every flip detected and the map bijective per page, flips never collide with each other.
    assert unique_rows(dev) == bit.size


def test_random_single_bit_flips_on_a_1mib_page_are_detected():
    rng = np.random.default_rng(12)
    n = MIB // 4
    base = rng.integers(0, 2**32, n, dtype=np.uint32)
    flips = 24
    pos = rng.integers(0, n, flips)
    pos[:4] = [0, n - 1, 2**16, 2**17 + 2**15]
    bits = rng.integers(0, 32, flips).astype(np.uint32)
    bits[:4] = [31, 15, 16, 0]
    pages = np.tile(base, (flips, 1))
    pages[np.arange(flips), pos] ^= np.uint32(1) << bits
    ref = digest_rows(base)
    d = digest_rows(pages)
    assert not np.all(d == ref, axis=-1).any()


def test_any_error_confined_to_one_word_is_detected():
    rng = np.random.default_rng(13)
    base = rng.integers(0, 2**32, 4096, dtype=np.uint32)
    m = 4096
    pos = rng.integers(0, base.size, m)
    err = rng.integers(1, 2**32, m, dtype=np.uint32)
    err[:4] = [0x80000000, 0x00008000, 0x80008000, 0xFFFFFFFF]
    pages = np.tile(base, (m, 1))
    pages[np.arange(m), pos] ^= err
    assert not np.all(digest_rows(pages) == digest_rows(base), axis=-1).any()


# ---------------------------------------------------------------------------
# guarantee 2: swaps of two unequal words
# ---------------------------------------------------------------------------

SWAP_VALUES = [
    (0x00000000, 0x00008000),  # lo halves differ by 2**15, hi equal
    (0x00000000, 0x80000000),  # hi halves differ by 2**15, lo equal
    (0x12345678, 0x12345679),  # lo differs by one
    (0xABCD1111, 0xABCE1111),  # hi differs by one
    (0x0000FFFF, 0xFFFF0000),  # both halves differ
    (0x80000000, 0x00008000),  # both differ by 2**15
]
SWAP_DISTANCES = [1, 2, 3, 2**15, 2**16 - 1, 2**16, 2**16 + 1, 2**17, 3 * 2**16, 2**17 + 2**15]


def _swapped(base: np.ndarray, i: int, j: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    before = base.copy()
    before[i], before[j] = a, b
    after = before.copy()
    after[i], after[j] = b, a
    return before, after


def test_swaps_at_adversarial_distances_are_detected():
    rng = np.random.default_rng(21)
    n = 2**18 + 5  # 1 MiB + 20 bytes: both lane families active
    base = rng.integers(0, 2**32, n, dtype=np.uint32)
    distances = SWAP_DISTANCES + [int(d) for d in rng.integers(1, n, 4)]
    before, after = [], []
    for d in distances:
        for k, (a, b) in enumerate(SWAP_VALUES):
            # Starts with i = 0 mod 2**16 and i = 2**15 mod 2**16 (worst case
            # for distance 2**15), plus a random start.
            starts = [int(rng.integers(0, n - d))]
            if k < 2:
                starts += [0, 2**15]
            for i in starts:
                if i + d >= n:
                    continue
                x, y = _swapped(base, i, i + d, a, b)
                before.append(x)
                after.append(y)
    before, after = np.stack(before), np.stack(after)
    assert (before != after).sum(axis=-1).min() == 2
    d_before, d_after = digest_rows(before), digest_rows(after)
    missed = np.all(d_before == d_after, axis=-1)
    assert not missed.any(), f"{missed.sum()} swaps missed"
    # Swapping equal words is not an error: the harness itself must not invent a difference.
    same_a, same_b = _swapped(base, 10, 10 + 2**16, 0x1234, 0x1234)
    np.testing.assert_array_equal(digest_rows(same_a), digest_rows(same_b))


def test_distance_multiple_of_2_16_is_caught_by_the_b_lanes():
    """White-box: the A lanes cannot see such a swap; the B lanes must."""
    rng = np.random.default_rng(22)
    base = rng.integers(0, 2**32, 2**18, dtype=np.uint32)
    for d in (2**16, 2**17, 3 * 2**16):
        for a, b in SWAP_VALUES:
            x, y = _swapped(base, 7, 7 + d, a, b)
            lx, ly = (np.asarray(I._lanes(jnp.asarray(v))) for v in (x, y))
            assert (lx[:2] == ly[:2]).all()
            assert (lx[2:] != ly[2:]).any()
            np.testing.assert_array_equal(lx, I._lanes_np(x))


def test_swaps_in_a_64mib_page_are_detected():
    rng = np.random.default_rng(23)
    n = 64 * MIB // 4  # 2**24 words
    page = rng.integers(0, 2**32, n, dtype=np.uint32)
    fn = jax.jit(I.digest)
    for i, d, (a, b) in [
        (0, 2**23, SWAP_VALUES[0]),  # t = 128
        (5, n - 2**16 - 5, SWAP_VALUES[1]),  # t = 255
        (2**15, 192 * 2**16, SWAP_VALUES[5]),  # t = 192
        (3, n - 4, SWAP_VALUES[2]),  # first/last word region, not a multiple of 2**16
    ]:
        page[i], page[i + d] = a, b
        before = np.asarray(fn(page, IDENT))
        page[i], page[i + d] = b, a
        after = np.asarray(fn(page, IDENT))
        assert not np.array_equal(before, after), (i, d)
    np.testing.assert_array_equal(after, I.digest_np(page, IDENT))


# ---------------------------------------------------------------------------
# guarantee 3: random corruption
# ---------------------------------------------------------------------------


def test_random_corruptions_are_never_missed():
    rng = np.random.default_rng(31)
    n, m = 256, 20000
    base = rng.integers(0, 2**32, n, dtype=np.uint32)
    pages = np.tile(base, (m, 1))
    as_bytes = pages.view(np.uint8)  # [m, 4n]
    kind = np.arange(m) % 4
    rows = np.arange(m)
    # kind 0: 1..16 random bytes XORed with a random nonzero byte
    # kind 1: a random aligned word overwritten with garbage
    # kind 2: a burst of 2..64 consecutive bytes overwritten with garbage
    # kind 3: a few random bytes in two far-apart words
    for r in rows[kind == 0]:
        k = rng.integers(1, 17)
        as_bytes[r, rng.integers(0, 4 * n, k)] ^= rng.integers(1, 256, k, dtype=np.uint8)
    sel = rows[kind == 1]
    pages[sel, rng.integers(0, n, sel.size)] = rng.integers(0, 2**32, sel.size, dtype=np.uint32)
    for r in rows[kind == 2]:
        length = rng.integers(2, 65)
        start = rng.integers(0, 4 * n - length)
        as_bytes[r, start:start + length] = rng.integers(0, 256, length, dtype=np.uint8)
    for r in rows[kind == 3]:
        w1, w2 = rng.integers(0, n // 2), rng.integers(n // 2, n)
        as_bytes[r, 4 * w1 + rng.integers(0, 4)] ^= rng.integers(1, 256, dtype=np.uint8)
        as_bytes[r, 4 * w2 + rng.integers(0, 4)] ^= rng.integers(1, 256, dtype=np.uint8)
    changed = (pages != base).any(axis=-1)
    assert changed.sum() > 0.99 * m  # garbage can coincide with the old word
    ref = I.digest_np(base, IDENT)
    d = digest_rows(pages)
    missed = np.all(d[changed] == ref, axis=-1)
    assert not missed.any(), f"{missed.sum()} corruptions missed"
    np.testing.assert_array_equal(d[~changed], np.broadcast_to(ref, d[~changed].shape))
    np.testing.assert_array_equal(d[:500], I.digest_np(pages[:500], IDENT))


@pytest.mark.parametrize("half", ["lo", "hi"])
def test_each_half_word_value_gives_its_own_lane_value(half):
    """The step behind guarantee 3: with the rest of the page fixed, the 2**16
    values of one half-word give 2**16 distinct A-lane values (m_j is odd, so
    x -> x * m_j is injective mod 2**32); a uniform word is thus matched with
    probability <= 2**-16 * 2**-16."""
    rng = np.random.default_rng(32)
    base = rng.integers(0, 2**32, 64, dtype=np.uint32)
    j = 45
    pages = np.tile(base, (2**16, 1))
    v = np.arange(2**16, dtype=np.uint32)
    if half == "lo":
        pages[:, j] = (base[j] & np.uint32(0xFFFF0000)) | v
    else:
        pages[:, j] = (base[j] & np.uint32(0xFFFF)) | (v << np.uint32(16))
    lanes = np.asarray(I._lanes(jnp.asarray(pages)))
    lane = 0 if half == "lo" else 1
    assert unique_rows(lanes[:, lane:lane + 1]) == 2**16
    other = 1 - lane
    assert unique_rows(lanes[:, other:other + 1]) == 1  # the other half's lane is untouched
    assert unique_rows(digest_rows(pages)) == 2**16


# ---------------------------------------------------------------------------
# guarantee 4: identity binding
# ---------------------------------------------------------------------------

BASE_ID = dict(key=0x0123456789ABCDEF, layer=5, generation=9, shard=2)
ID_CHANGES = [
    ("key", 0x0123456789ABCDEF ^ 1),  # low word only
    ("key", 0x0123456789ABCDEF ^ (1 << 32)),  # high word only
    ("key", 0x0123456789ABCDEF ^ ((1 << 32) | 1)),  # both words
    ("key", 0x0123456789ABCDEF + 2**32 - 1),
    ("key", 0),
    ("key", 2**64 - 1),
    ("layer", 6),
    ("layer", 0),
    ("layer", 2**32 - 1),
    ("generation", 10),
    ("generation", 9 ^ (1 << 31)),
    ("shard", 3),
    ("shard", 0),
]


@pytest.mark.parametrize("page", ["zeros", "random", "ones"])
def test_changing_any_identity_field_changes_the_digest(page):
    rng = np.random.default_rng(41)
    words = {
        "zeros": np.zeros(4096, np.uint32),
        "random": rng.integers(0, 2**32, 4096, dtype=np.uint32),
        "ones": np.full(4096, 0xFFFFFFFF, np.uint32),
    }[page]
    idents = [I.identity_words(**BASE_ID)]
    for field, value in ID_CHANGES:
        idents.append(I.identity_words(**{**BASE_ID, field: value}))
    idents = np.stack(idents)
    assert unique_rows(idents) == len(idents)
    d = np.asarray(I.digest(words, idents))
    np.testing.assert_array_equal(d, I.digest_np(words, idents))
    assert unique_rows(d) == len(idents)
    # Same bytes, same identity: same digest.
    np.testing.assert_array_equal(d[0], I.digest_np(words, I.identity_words(**BASE_ID)))


def test_identity_binding_over_many_identities():
    rng = np.random.default_rng(42)
    words = rng.integers(0, 2**32, 1024, dtype=np.uint32)
    grid = np.meshgrid(np.arange(64), np.arange(16), np.arange(8), np.arange(4), indexing="ij")
    keys, layers, gens, shards = (g.ravel() for g in grid)
    idents = np.stack(
        [keys * 2654435761 % 2**32, keys >> 3, layers, gens, shards], axis=-1
    ).astype(np.uint32)
    assert unique_rows(idents) == len(idents)
    d = digest_rows(words, idents)
    assert unique_rows(d) == len(idents)


def test_page_length_is_bound_to_the_digest():
    w = np.zeros(4096, np.uint32)
    w[0] = 1
    padded = [np.concatenate([w, np.zeros(n, np.uint32)]) for n in range(4)]
    assert len({tuple(I.digest_np(p, IDENT)) for p in padded}) == 4


def test_identity_words_layout_and_validation():
    np.testing.assert_array_equal(
        I.identity_words(0x0123456789ABCDEF, 1, 2, 3),
        np.array([0x89ABCDEF, 0x01234567, 1, 2, 3], np.uint32),
    )
    assert I.identity_words(2**64 - 1, 2**32 - 1, 0, 0).dtype == np.uint32
    assert I.identity_words(np.uint64(7), np.int32(1), 0, 0).tolist() == [7, 0, 1, 0, 0]
    for kwargs, bad in [
        (dict(key=-1), "-1"),
        (dict(key=2**64), str(2**64)),
        (dict(layer=-3), "-3"),
        (dict(generation=2**32), str(2**32)),
        (dict(shard=-1), "-1"),
    ]:
        with pytest.raises(ValueError, match=bad):
            I.identity_words(**{**BASE_ID, **kwargs})
    with pytest.raises(TypeError):
        I.identity_words(1.5, 0, 0, 0)
    with pytest.raises(TypeError):
        I.identity_words(True, 0, 0, 0)


def test_key_from_bytes_is_stable():
    assert I.key_from_bytes(b"kvxfer") == 0x92922B125ADDD663
    assert I.key_from_bytes(b"") == 0x8D1F1EE6255735E2
    expected = hashlib.blake2b(b"abc", digest_size=8, person=b"kvxfer-key-v1").digest()
    assert I.key_from_bytes(memoryview(b"abc")) == int.from_bytes(expected, "little")
    assert I.key_from_bytes(b"abc") != I.key_from_bytes(b"abd")
    assert 0 <= I.key_from_bytes(bytes(range(256))) < 2**64
    I.identity_words(I.key_from_bytes(b"\xff" * 32), 0, 0, 0)
    with pytest.raises(TypeError):
        I.key_from_bytes("abc")


# ---------------------------------------------------------------------------
# benchmark (not a test): python tests/test_integrity.py
# ---------------------------------------------------------------------------


def _bench(fn, x, reps: int = 7) -> float:
    import time

    jax.block_until_ready(fn(x))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(x))
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9


def main(total_bytes: int = 256 * MIB, page_bytes: int = 64 * KIB) -> None:
    pages = total_bytes // page_bytes
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; "
          f"{total_bytes // MIB} MiB as {pages} pages of {page_bytes // KIB} KiB")
    ident = jnp.asarray(IDENT)
    key = jax.random.key(0)
    for name, dtype in [("uint32", jnp.uint32), ("bf16", jnp.bfloat16), ("int8", jnp.int8)]:
        itemsize = jnp.dtype(dtype).itemsize
        raw_dtype = jnp.dtype(f"uint{8 * itemsize}")
        raw = jax.random.bits(key, (pages, page_bytes // itemsize), raw_dtype)
        x = jax.lax.bitcast_convert_type(raw, dtype)
        digest_fn = jax.jit(lambda x: I.digest(I.as_words(x, 1), ident))
        copy_fn = jax.jit(jnp.copy)
        read_fn = jax.jit(lambda x: jnp.sum(I.as_words(x, 1), axis=-1, dtype=jnp.uint32))
        print(f"{name:>7}: digest {_bench(digest_fn, x):6.2f} GB/s"
              f" | copy {_bench(copy_fn, x):6.2f} GB/s"
              f" | word sum {_bench(read_fn, x):6.2f} GB/s")
    import time

    words = np.asarray(jax.random.bits(key, (1024, page_bytes // 4), jnp.uint32))
    t = time.perf_counter()
    I.digest_np(words, IDENT)
    t_digest = time.perf_counter() - t
    t = time.perf_counter()
    words.copy()
    t_copy = time.perf_counter() - t
    print(f"  numpy: digest_np {words.nbytes / t_digest / 1e9:6.2f} GB/s"
          f" | copy {words.nbytes / t_copy / 1e9:6.2f} GB/s ({words.nbytes // MIB} MiB)")


if __name__ == "__main__":
    main()
