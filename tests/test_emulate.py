"""Emulated TPU memory: images, their inverse, raw block copies, and real XLA:CPU bytes."""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format

import kvxfer
from kvxfer import emulate
from kvxfer.layout import Layout, LayoutError
from checkers import random_array, random_case, random_padding_case, same_bits


@pytest.mark.parametrize("seed", range(3))
def test_image_round_trips(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(120):
        shape, dtype, text, _ = random_case(rng)
        x = random_array(rng, shape, dtype)
        image = emulate.to_image(x, text)
        assert image.nbytes == kvxfer.inspect(shape, dtype, text).physical_bytes
        assert same_bits(emulate.from_image(image, shape, dtype, text), x), (shape, dtype, text)


def test_image_of_bf16_subtile_interleaves_row_pairs():
    x = np.arange(16 * 128, dtype=np.uint16).reshape(16, 128).view(jnp.bfloat16)
    words = emulate.to_image(x, "{1,0:T(8,128)(2,1)}").view(np.uint16)
    # Within a tile, element (r, c) sits at (r // 2) * 256 + c * 2 + r % 2.
    assert words[:4].tolist() == [0, 128, 1, 129]
    assert words[256] == 2 * 128


def test_int4_packs_low_nibble_first():
    x = np.array([1, 2, 3, 4], dtype=jnp.int4)
    assert emulate.to_image(x, "{0:E(4)}").tolist() == [0x21, 0x43]


def _move_blocks(x, text, block_dim, src, dst, *, bypass_guard):
    """Raw per-block copies src -> host -> dst; returns (result, expected)."""
    g = kvxfer.inspect(x.shape, x.dtype, text, block_dim=block_dim)
    image = emulate.to_image(x, text)
    host = emulate.read_blocks(image, g, src, bypass_guard=bypass_guard)
    emulate.write_blocks(image, g, dst, host, bypass_guard=bypass_guard)
    expected = x.copy()
    np.moveaxis(expected, block_dim, 0)[dst] = np.moveaxis(x, block_dim, 0)[src]
    return emulate.from_image(image, x.shape, x.dtype, text), expected, g


@pytest.mark.parametrize("seed", range(4))
def test_raw_block_copies_exact_iff_accepted(seed):
    """Accepted => permuted raw copies are byte-exact; rejected => they scramble."""
    rng = np.random.default_rng(200 + seed)
    counts = {True: 0, False: 0}
    for _ in range(150):
        shape, dtype, text, block_dim = random_case(rng)
        n = shape[block_dim]
        if n < 2:
            continue
        x = random_array(rng, shape, dtype)
        src, dst = rng.permutation(n), rng.permutation(n)
        while (src == dst).all():
            dst = rng.permutation(n)
        k = int(rng.integers(1, n + 1))
        out, expected, g = _move_blocks(x, text, block_dim, src[:k], dst[:k],
                                        bypass_guard=not kvxfer.inspect(
                                            shape, dtype, text, block_dim=block_dim).addressable)
        if g.addressable:
            assert same_bits(out, expected), (shape, dtype, text, block_dim)
        else:
            # Move every block so that some block lands somewhere else.
            out, expected, _ = _move_blocks(x, text, block_dim, src, dst, bypass_guard=True)
            assert not same_bits(out, expected), (shape, dtype, text, block_dim)
        counts[g.addressable] += 1
    assert min(counts.values()) > 20, counts


@pytest.mark.parametrize("seed", range(3))
def test_padding_family_raw_copies_round_trip(seed):
    """Blocks among padding no block owns: permuted raw copies stay byte-exact."""
    rng = np.random.default_rng(600 + seed)
    accepted = 0
    for _ in range(100):
        shape, dtype, text, block_dim = random_padding_case(rng)
        n = shape[block_dim]
        if n < 2 or not kvxfer.inspect(shape, dtype, text, block_dim=block_dim).addressable:
            continue
        x = random_array(rng, shape, dtype)
        src, dst = rng.permutation(n), rng.permutation(n)
        k = int(rng.integers(1, n + 1))
        out, expected, _ = _move_blocks(x, text, block_dim, src[:k], dst[:k],
                                        bypass_guard=False)
        assert same_bits(out, expected), (shape, dtype, text, block_dim)
        accepted += 1
    assert accepted >= 20, accepted


@pytest.mark.parametrize("shape, dtype, text, data_bytes", [
    ((128, 4), "int8", "{0,1:T(32,128)(4,1)}", 4),
    ((7, 1), "bfloat16", "{0,1:T(16,128)(2,1)}", 2),
])
def test_block_range_holds_the_block_then_its_padding(shape, dtype, text, data_bytes):
    rng = np.random.default_rng(9)
    x = random_array(rng, shape, dtype)
    buf = emulate.EmulatedBuffer.from_array(x, text)
    size = buf.geometry.bytes_per_block
    host = buf.read_blocks(range(shape[0]))
    assert host.shape == (shape[0], size)
    assert np.array_equal(host[:, :data_bytes], x.view(np.uint8).reshape(shape[0], -1))
    assert not host[:, data_bytes:].any()  # to_image zeroes padding
    before = buf.image.copy()
    buf.write_blocks([3], host[[5]])  # one block's range, and nothing else, changes
    changed = np.flatnonzero(before != buf.image)
    assert changed.size and changed.min() >= 3 * size and changed.max() < 4 * size
    expected = x.copy()
    expected[3] = x[5]
    assert same_bits(buf.to_array(), expected)


def test_direct_copy_refuses_unproven_layout():
    x = np.zeros((512, 6144), jnp.bfloat16)
    buf = emulate.EmulatedBuffer.from_array(x[:16, :256], "{1,0:T(8,128)(2,1)}")
    with pytest.raises(LayoutError, match="Direct copy refused: .*rule 'block dim not interleaved'"):
        buf.read_blocks([0])


def test_block_ids_out_of_range():
    buf = emulate.EmulatedBuffer.from_array(np.zeros((4, 8, 128), np.float32), "{2,1,0:T(8,128)}")
    with pytest.raises(LayoutError, match="block id 4 out of range"):
        buf.read_blocks([1, 4])


def test_seed_interleaved_case_scrambles_with_naive_slices():
    rng = np.random.default_rng(7)
    x = random_array(rng, (16, 3, 256), "bfloat16")  # the seed family, smaller
    out, expected, g = _move_blocks(x, "{2,0,1:T(8,128)(2,1)}", 0, [3, 5], [5, 3],
                                    bypass_guard=True)
    assert not g.addressable and not same_bits(out, expected)


# -- real XLA:CPU buffers ---------------------------------------------------------


def _raw_bytes(array, nbytes):
    address = array.unsafe_buffer_pointer()
    return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), np.uint8).copy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8",
                                   "float8_e4m3fn", "int4"])
@pytest.mark.parametrize("seed", range(3))
def test_emulator_matches_xla_cpu_bytes_for_permutations(dtype, seed):
    """XLA:CPU really stores minor-to-major permutations (not tiles): compare bytes."""
    rng = np.random.default_rng(300 + seed)
    rank = int(rng.integers(2, 5))
    shape = tuple(int(s) for s in rng.choice([2, 3, 4, 6, 8], size=rank))
    m2m = tuple(int(d) for d in rng.permutation(rank))
    x = random_array(rng, shape, dtype)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    y = jax.device_put(x, Format(Layout(m2m).to_jax(), sharding))
    y.block_until_ready()
    layout = Layout.of(y)
    assert layout.minor_to_major == m2m
    geo = layout.geometry(shape, x.dtype)
    raw = _raw_bytes(y, geo.physical_bytes)
    assert same_bits(emulate.from_image(raw, shape, x.dtype, layout), x)
    if np.prod(shape) * geo.element_bits % 8 == 0:  # no unspecified padding bits
        assert np.array_equal(raw, emulate.to_image(x, layout))


def test_docstring_examples_hold():
    import doctest

    result = doctest.testmod(emulate, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
