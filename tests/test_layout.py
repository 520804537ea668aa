"""Layout parsing, geometry, and the addressability proof against a brute-force scan."""

import collections
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format

import kvxfer
from kvxfer import catalog
from kvxfer.layout import Layout, LayoutError
from checkers import (
    brute_force_granularity,
    padded_granularity,
    random_case,
    random_padding_case,
)

SEEDS = [
    # shape, dtype, layout, addressable, bytes_per_block, granularity, physical_bytes
    ((512, 3, 2048), "bfloat16", "{2,0,1:T(8,128)(2,1)}", False, None, 512, 6 << 20),
    ((512, 6144), "bfloat16", "{1,0:T(8,128)(2,1)}", False, None, 8, 6 << 20),
    ((512, 12288), "int8", "{1,0:T(32,128)(4,1)}", False, None, 32, 6 << 20),
    ((512, 4, 2048), "bfloat16", "{2,1,0:T(8,128)(2,1)}", True, 32768, 1, 16 << 20),
    ((512, 8, 2048), "bfloat16", "{2,1,0:T(8,128)(2,1)}", True, 32768, 1, 16 << 20),
    ((512, 16, 2048), "bfloat16", "{2,1,0:T(8,128)(2,1)}", True, 65536, 1, 32 << 20),
]


@pytest.mark.parametrize("text", [
    "{2,0,1:T(8,128)(2,1)}", "{1,0:T(8,128)(4,1)S(5)}", "{0:T(1024)}",
    "{1,0:T(8,128)(8,1)E(4)}", "{}", "{1,0}", "{3,2,1,0:T(8,128)(2,1)E(16)S(5)}",
])
def test_parse_round_trips(text):
    layout = Layout.parse(text)
    assert str(layout) == text
    assert Layout.parse(str(layout)) == layout


def test_parse_fields_and_whitespace():
    layout = Layout.parse(" { 1, 0 : T(8,128) (4,1) S(5) } ")
    assert layout.minor_to_major == (1, 0)
    assert layout.tiles == ((8, 128), (4, 1))
    assert layout.memory_space == 5 and layout.element_size_bits == 0
    assert Layout.parse("{1,0:T(8,128)(8,1)E(4)}").element_size_bits == 4


@pytest.mark.parametrize("text, match", [
    ("1,0", "braces"),
    ("{1,0", "braces"),
    ("{1,1}", "not a permutation"),
    ("{0,2}", "not a permutation"),
    ("{1,a}", "'a' is not a non-negative integer"),
    ("{1,0:T(8,128}", r"T must be followed by"),
    ("{1,0:T(8,128)Q}", "cannot parse"),
    ("{1,0:X(3)}", "cannot parse"),
    ("{1,0:T}", r"T must be followed by \(\.\.\.\)"),
    ("{1,0:T(0,128)}", "positive sizes"),
    ("{1,0:E(4,4)}", "takes one integer"),
    ("{1,0:S(5)T(8,128)}", "tiles must be written once"),
    ("{1,0:T(2,*)}", "combined tile dims"),
])
def test_parse_errors_name_text_and_problem(text, match):
    with pytest.raises(LayoutError, match=match) as e:
        Layout.parse(text)
    if text.startswith("{"):
        assert text in str(e.value)


def test_rank_mismatch_names_shape():
    with pytest.raises(LayoutError, match=r"bf16\[512,3\]\{2,0,1\}: layout has rank 3"):
        kvxfer.inspect((512, 3), "bfloat16", "{2,0,1}")


def test_subtile_must_divide_tile():
    with pytest.raises(LayoutError, match="does not divide"):
        kvxfer.inspect((64, 128), "bfloat16", "{1,0:T(8,128)(3,1)}")


@pytest.mark.parametrize("shape, dtype, text, addressable, bpb, gran, physical", SEEDS)
def test_seed_verdicts(shape, dtype, text, addressable, bpb, gran, physical):
    g = kvxfer.inspect(shape, dtype, text)
    assert (g.addressable, g.bytes_per_block, g.granularity, g.physical_bytes) == (
        addressable, bpb, gran, physical)
    if addressable:
        assert kvxfer.require_addressable(shape, dtype, text).bytes_per_block == bpb
    else:
        with pytest.raises(LayoutError, match="rule '") as e:
            kvxfer.require_addressable(shape, dtype, text)
        assert text in str(e.value) and str(shape[0]) in str(e.value)


def test_seed_padding_factor():
    assert kvxfer.inspect((512, 4, 2048), "bf16", "{2,1,0:T(8,128)(2,1)}").padding_factor == 2.0


def test_issue_example_subtile_granularity():
    assert kvxfer.inspect((64, 3), "int8", "{1,0:T(32,128)(4,1)}").granularity == 4


def test_tiled_offsets_match_tiled_layout_formula():
    # bf16 T(8,128)(2,1): rows 2k and 2k+1 share a 32-bit word.
    geo = Layout.parse("{1,0:T(8,128)(2,1)}").geometry((16, 256), jnp.bfloat16)
    assert geo.final_shape == (2, 2, 4, 128, 2, 1)
    idx = np.array([[0, 0], [1, 0], [0, 1], [2, 0], [8, 0], [0, 128]])
    assert geo.byte_offset(idx).tolist() == [0, 2, 4, 512, 4096, 2048]


def test_size_one_major_dims_do_not_break_addressability():
    g = kvxfer.inspect((1, 1, 64, 8, 128), "bf16", "{4,3,2,1,0:T(8,128)(2,1)}", block_dim=2)
    assert g.addressable and g.bytes_per_block == 8 * 128 * 2


@pytest.mark.parametrize("block_dim, match", [(3, "out of range"), (-4, "out of range")])
def test_bad_block_dim(block_dim, match):
    with pytest.raises(LayoutError, match=match):
        kvxfer.inspect((4, 4, 4), "f32", None, block_dim=block_dim)


def test_shape_requires_dtype():
    with pytest.raises(LayoutError, match="dtype is required"):
        kvxfer.inspect((4, 4))


@pytest.mark.parametrize("seed", range(4))
def test_sweep_agrees_with_brute_force(seed):
    """Seeded sweep: rank 1-5, sizes with 1 and non-multiples, TPU tilings, permutations."""
    rng = np.random.default_rng(seed)
    seen = {"addressable": 0, "rejected": 0}
    for _ in range(150):
        shape, dtype, text, block_dim = random_case(rng)
        g = kvxfer.inspect(shape, dtype, text, block_dim=block_dim)
        gran, group_bytes = brute_force_granularity(shape, dtype, text, block_dim)
        assert g.granularity == gran, (shape, dtype, text, block_dim)
        if group_bytes is not None:
            assert g.group_bytes == group_bytes, (shape, dtype, text, block_dim)
        if g.addressable and shape[block_dim] > 1:
            assert g.bytes_per_block == group_bytes
        seen["addressable" if g.addressable else "rejected"] += 1
    assert min(seen.values()) > 20, seen  # the sweep exercises both verdicts


# -- padding that no block owns -------------------------------------------------

PADDING_FAMILY = [
    # shape, dtype, layout, granularity, group_bytes, physical_bytes
    # A partner dim inside one sub-tile: each block is a few bytes of one sub-tile.
    ((128, 4), "int8", "{0,1:T(32,128)(4,1)}", 1, 4, 4096),
    ((7, 1), "bfloat16", "{0,1:T(16,128)(2,1)}", 1, 4, 4096),  # 2 bytes of padding
    ((4, 1), "float8_e4m3fn", "{1,0:T(32,128)(4,1)}", 1, 1, 4096),
    ((5,), "bfloat16", "{0:T(8,128)(2,1)}", 1, 4, 2048),  # the tile's missing dim
    ((3, 2), "int4", "{0,1:T(64,128)(8,1)E(4)}", 1, 4, 4096),
    # Padding between block digits breaks the stride after each tile row.
    ((300,), "bfloat16", "{0:T(8,128)(2,1)}", 128, 2048, 6144),
    ((16, 1), "bfloat16", "{1,0:T(8,128)(2,1)}", 2, 512, 4096),
    ((9, 1), "int8", "{1,0:T(8,8)(4,4)(2,2)}", 4, 32, 128),  # two such gaps
    # Two groups, the second starting mid-row: only it keeps one stride in whole bytes.
    ((5, 1), "int4", "{1,0:T(12,3)(3,1)}", 4, 5, 18),
    ((6, 1), "int4", "{1,0:T(12,3)(3,1)}", 4, 5, 18),
    ((5, 1), "int4", "{1,0:T(6,3)(3,1)}", 5, 9, 9),  # ... unless they pass the end
]


@pytest.mark.parametrize("shape, dtype, text, gran, group_bytes, physical", PADDING_FAMILY)
def test_padding_family_verdicts(shape, dtype, text, gran, group_bytes, physical):
    g = kvxfer.inspect(shape, dtype, text)
    assert (g.granularity, g.group_bytes, g.physical_bytes) == (gran, group_bytes, physical)
    assert g.addressable == (gran == 1)
    assert g.bytes_per_block == (group_bytes if gran == 1 else None)
    assert brute_force_granularity(shape, dtype, text) == (
        gran, group_bytes if gran < shape[0] else None)


def test_partner_dim_inside_a_subtile_is_addressable():
    g = kvxfer.require_addressable((128, 4), "s8", "{0,1:T(32,128)(4,1)}")
    assert [g.block_offset(b) for b in (0, 1, 127)] == [0, 4, 508]
    assert "dim 1 has 4 elements, so of the 8 tile steps of 4 along it only the first" \
        in g.reason
    assert "the blocks fill the first 512 of 4096 bytes" in g.reason
    # The padded analysis refused it: padding rows of dim 1 are not the block's.
    assert padded_granularity((128, 4), "int8", "{0,1:T(32,128)(4,1)}") == (128, None)


def test_gap_between_block_digits_names_the_padding():
    with pytest.raises(LayoutError, match=r"bf16\[16,1\]\{1,0:T\(8,128\)\(2,1\)\}: rule "
                       r"'uniform block stride' failed: dim 1 has 1 element, .* blocks 1 "
                       r"and 2 are further apart .*granularity 2 \(512 bytes per group\)"):
        kvxfer.require_addressable((16, 1), "bf16", "{1,0:T(8,128)(2,1)}")


@pytest.mark.parametrize("seed", range(4))
def test_padding_family_sweep_agrees_with_brute_force(seed):
    """Small block dims inside tiles, partner dims inside a sub-tile, permutations."""
    rng = np.random.default_rng(400 + seed)
    seen = collections.Counter()
    for _ in range(300):
        shape, dtype, text, block_dim = random_padding_case(rng)
        case = (shape, dtype, text, block_dim)
        g = kvxfer.inspect(shape, dtype, text, block_dim=block_dim)
        gran, group_bytes = brute_force_granularity(shape, dtype, text, block_dim)
        assert (g.addressable, g.granularity) == (gran == 1, gran), case
        if gran < shape[block_dim]:
            assert g.group_bytes == group_bytes, case
        if g.addressable and shape[block_dim] > 1:
            assert g.bytes_per_block == group_bytes, case
        n = shape[block_dim]
        seen["addressable" if g.addressable else "grouped" if gran < n else "whole"] += 1
        if g.addressable and n * g.bytes_per_block < g.physical_bytes:
            seen["blocks fill part of the buffer"] += 1
    assert len(seen) == 4 and min(seen.values()) >= 10, seen


@pytest.mark.parametrize("seed", range(2))
def test_padding_owned_by_no_block_only_relaxes(seed):
    """Whatever the padded analysis accepted keeps its verdict; it refused more."""
    rng = np.random.default_rng(500 + seed)
    relaxed = 0
    for i in range(120):
        case = random_padding_case(rng) if i % 2 else random_case(rng)
        g = kvxfer.inspect(case[0], case[1], case[2], block_dim=case[3])
        gran, group_bytes = padded_granularity(*case)
        assert g.granularity <= gran, case
        if g.granularity == gran and gran < case[0][case[3]]:
            assert g.group_bytes == group_bytes, case
        relaxed += g.granularity < gran
    assert relaxed >= 10


# -- sizes no device holds --------------------------------------------------------------


def test_huge_block_dims_are_proven_without_scanning():
    start = time.perf_counter()
    g = kvxfer.inspect((2**55,), "f32")
    assert g.addressable and g.block_offset(2**55 - 1) == (2**55 - 1) * 4
    g = kvxfer.inspect((2**50, 1), "bf16", "{0,1:T(16,128)(2,1)}")
    assert (g.granularity, g.group_bytes) == (128, 4096)  # 4 bytes a block within a tile
    g = kvxfer.inspect((2**51, 16), "bf16", "{1,0:T(8,128)(2,1)}")
    assert (g.granularity, g.group_bytes) == (2, 512)  # rows 2k, 2k+1 share words
    g = kvxfer.inspect((2**55 + 1, 3), "int4", "{0,1:E(4)}")
    assert g.granularity == 2**55 + 1
    for shape, dtype, text in [((2**62,), "int8", None), ((2**55, 128), "bf16", "{1,0}"),
                               ((2**62, 1), "bf16", "{0,1:T(16,128)(2,1)}")]:
        with pytest.raises(LayoutError, match=r"physical size, \d+ bits \(\d+ bytes\) with "
                           r"padding, is 2\*\*63 bits or more"):
            kvxfer.inspect(shape, dtype, text)
    with pytest.raises(LayoutError, match=f"dim 1 has size {2**64}, beyond"):
        kvxfer.inspect((0, 2**64), "int8")
    # The proof works on the axes alone: no loop over divisors or bytes.
    assert time.perf_counter() - start < 1.0


# -- JAX arrays ---------------------------------------------------------------


def _put(x, text):
    layout = Layout.parse(text)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.device_put(x, Format(layout.to_jax(), sharding))


def test_layout_of_jax_array_reverses_major_to_minor():
    x = _put(np.zeros((2, 3, 4), np.float32), "{0,2,1}")
    assert x.format.layout.major_to_minor == (1, 2, 0)
    assert str(Layout.of(x)) == "{0,2,1}"
    assert str(Layout.of(x.format)) == "{0,2,1}"


def test_layout_of_reports_tiles_given_to_cpu():
    x = _put(np.zeros((16, 256), jnp.bfloat16), "{1,0:T(8,128)(2,1)}")
    assert str(Layout.of(x)) == "{1,0:T(8,128)(2,1)}"


def test_layout_of_compiled_formats():
    compiled = jax.jit(lambda a: a * 2).lower(jnp.zeros((8, 4), jnp.float32)).compile()
    (arg_formats, _) = compiled.input_formats
    assert str(Layout.of(arg_formats[0])) == "{1,0}"
    assert str(Layout.of(compiled.output_formats)) == "{1,0}"


def test_inspect_reads_array_layout():
    x = _put(np.zeros((8, 4, 128), np.float32), "{2,0,1}")
    g = kvxfer.inspect(x)
    assert not g.addressable and g.granularity == 8
    g2 = kvxfer.inspect(x, layout="{2,1,0}")  # an emulated layout overrides
    assert g2.addressable and g2.bytes_per_block == 4 * 128 * 4


@pytest.mark.parametrize("name", ["kvxfer.layout", "kvxfer._layout_dtypes",
                                  "kvxfer._layout_geometry", "kvxfer._layout_proof"])
def test_docstring_examples_hold(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result


def test_layout_of_rejects_other_objects():
    with pytest.raises(LayoutError, match="Expected a jax.Array, Format or Layout"):
        Layout.of(42)


# -- catalogues -----------------------------------------------------------------


@pytest.mark.parametrize("path", ["seeds", "tpu_kv_derived", "engines_derived"])
def test_catalogues_agree(path):
    cat = catalog.load(path)
    results = cat.check()
    assert results and all(r.agrees for r in results), [r.disagreement for r in results]
    for e in cat.entries:
        assert e.source == "derived" or e.source.startswith("observed on"), e.source


def test_seed_catalogue_marks_observed():
    cat = catalog.load("seeds")
    assert len(cat.entries) == 6
    assert {e.source for e in cat.entries} == {"observed on tpu7x (upstream report)"}


def test_small_catalogue_entries_agree_with_brute_force():
    cat = catalog.load("tpu_kv_derived")
    checked = 0
    for e in cat.entries:
        g = e.inspect()
        if g.physical_bytes > (1 << 21):
            continue
        gran, _ = brute_force_granularity(e.shape, e.dtype, e.layout, e.block_dim)
        assert g.granularity == gran, e.name
        checked += 1
    assert checked >= 8


def test_engine_catalogue_entries_agree_with_brute_force():
    # Two blocks of each engine array: the byte-by-byte check of every block's range.
    for e in catalog.load("engines_derived").entries:
        shape = (2, *e.shape[1:])
        g = kvxfer.inspect(shape, e.dtype, e.layout)
        gran, _ = brute_force_granularity(shape, e.dtype, e.layout, e.block_dim)
        assert g.granularity == gran == 1, e.name
        assert g.bytes_per_block == e.expected["bytes_per_block"], e.name


def test_catalogue_disagreement_is_reported(tmp_path):
    bad = {"arrays": [{"shape": [512, 6144], "dtype": "bf16", "layout": "{1,0:T(8,128)(2,1)}",
                       "source": "derived", "expected": {"addressable": True}}]}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    (result,) = catalog.load(path).check()
    assert not result.agrees and "addressable is False, expected True" in result.disagreement
