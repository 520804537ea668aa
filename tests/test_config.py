"""Model KV-cache configs (configs/*.toml) and their loader (kvxfer.config)."""

from __future__ import annotations

import math
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from kvxfer import config
from kvxfer.config import ConfigError, LayerGroup, ModelSpec
from kvxfer.layout import Layout
from kvxfer.plan import make_plan

BUILTINS = ["deepseek-mla", "gemma-mixed", "int8-kv", "llama3-8b", "llama3-8b-fp8",
            "seed-good", "seed-interleaved", "sglang-llama3-8b-p1", "sglang-llama3-8b-p64",
            "tiny", "vllm-tpu-deepseek-mla", "vllm-tpu-llama3-8b", "vllm-tpu-llama3-8b-fp8"]
HUGE_BUDGET = 1 << 40

# name -> [(group, count, block_shape, dtype, tpu_layout, shard_dim)]: the TPU compiler's
# layout for one device at engine sizes (tests/test_tpu_compiler.py checks it), or one
# the config keeps on purpose (tiny, seed-good's h4: tpu_layout_note).
EXPECTED = {
    "llama3-8b": [("attn", 32, (16, 2, 8, 128), "bfloat16", "{4,3,2,1,0:T(8,128)(2,1)}", 3)],
    "gemma-mixed": [
        ("local", 20, (16, 2, 4, 256), "bfloat16", "{4,3,2,1,0:T(4,128)(2,1)}", 3),
        ("global", 6, (16, 2, 16, 256), "bfloat16", "{4,3,2,1,0:T(8,128)(2,1)}", 3)],
    "deepseek-mla": [("mla", 61, (16, 576), "bfloat16", "{0,2,1:T(8,128)(2,1)}", None)],
    "llama3-8b-fp8": [
        ("kv", 32, (16, 2, 8, 128), "float8_e4m3fn", "{4,3,2,1,0:T(8,128)(4,1)}", 3),
        ("scales", 32, (2, 8), "float32", "{0,2,1:T(8,128)}", 2)],
    "int8-kv": [("attn", 16, (16, 32, 128), "int8", "{3,2,1,0:T(32,128)(4,1)}", 2)],
    "tiny": [("kv32", 2, (16, 2, 2, 32), "float32", "{4,3,2,1,0:T(8,128)}", 3),
             ("kv16", 2, (16, 2, 4, 64), "bfloat16", "{4,3,2,1,0:T(8,128)(2,1)}", 3)],
    "seed-interleaved": [
        ("interleaved", 20, (3, 2048), "bfloat16", "{2,0,1:T(8,128)(2,1)}", None)],
    "seed-good": [("h4", 4, (4, 2048), "bfloat16", "{2,1,0:T(8,128)(2,1)}", None),
                  ("h8", 4, (8, 2048), "bfloat16", "{2,1,0:T(8,128)(2,1)}", None),
                  ("h16", 4, (16, 2048), "bfloat16", "{2,1,0:T(8,128)(2,1)}", None)],
    # The engines' own caches (derived TPU layouts: layouts/engines_derived.json).
    "sglang-llama3-8b-p1": [
        ("kv", 32, (1, 8, 2, 128), "bfloat16", "{4,3,2,1,0:T(2,128)(2,1)}", 2)],
    "sglang-llama3-8b-p64": [
        ("kv", 32, (64, 8, 2, 128), "bfloat16", "{4,3,2,1,0:T(2,128)(2,1)}", 2)],
    "vllm-tpu-llama3-8b": [
        ("kv", 32, (16, 8, 2, 128), "bfloat16", "{4,3,2,1,0:T(2,128)(2,1)}", 2)],
    "vllm-tpu-llama3-8b-fp8": [
        ("kv", 32, (16, 4, 4, 128), "float8_e4m3fn", "{4,3,2,1,0:T(4,128)(4,1)}", 2)],
    "vllm-tpu-deepseek-mla": [
        ("mla", 61, (32, 32, 640), "bfloat16", "{3,2,1,0:T(8,128)(2,1)}", None)],
}
SLICE_CLASSES = {"llama3-8b": 1, "gemma-mixed": 2, "deepseek-mla": 1, "llama3-8b-fp8": 2,
                 "int8-kv": 1, "tiny": 2, "seed-interleaved": 1, "seed-good": 3,
                 "sglang-llama3-8b-p1": 1, "sglang-llama3-8b-p64": 1, "vllm-tpu-llama3-8b": 1,
                 "vllm-tpu-llama3-8b-fp8": 1, "vllm-tpu-deepseek-mla": 1}


@pytest.fixture(scope="module")
def specs() -> dict[str, ModelSpec]:
    return {name: config.load_builtin(name) for name in config.builtin_names()}


@pytest.fixture(scope="module")
def tiny() -> ModelSpec:
    return config.load_builtin("tiny")


def test_builtin_names_match_the_shipped_files():
    from kvxfer import _resources

    files = sorted(p.stem for p in _resources.data_dir("configs").glob("*.toml"))
    assert config.builtin_names() == files == BUILTINS


@pytest.mark.parametrize("name", BUILTINS)
def test_every_config_loads_with_the_specified_groups(name, specs):
    spec = specs[name]
    assert spec.name == name and spec.description
    got = [(g.name, g.count, g.block_shape, g.dtype, g.tpu_layout, g.shard_dim)
           for g in spec.groups]
    assert got == EXPECTED[name]
    assert spec.num_layers == sum(e[1] for e in EXPECTED[name])
    assert pathlib.Path(spec.source).is_absolute() and spec.source.endswith(f"{name}.toml")
    names = spec.layer_names()
    assert len(names) == len(set(names)) == spec.num_layers
    assert names[0] == f"{EXPECTED[name][0][0]}.0"


@pytest.mark.parametrize("name", BUILTINS)
def test_layer_specs_and_slice_classes(name, specs):
    spec = specs[name]
    layer_specs = spec.layer_specs()
    assert [s.name for s in layer_specs] == spec.layer_names()
    expected_shapes = [(spec.num_device_blocks, *e[2]) for e in EXPECTED[name]
                       for _ in range(e[1])]
    assert [s.shape for s in layer_specs] == expected_shapes
    assert all(s.num_shards == 1 and s.replicas == 1 for s in layer_specs)
    plan = make_plan(layer_specs, spec.num_host_blocks, host_memory_budget=HUGE_BUDGET)
    assert len(plan.classes) == SLICE_CLASSES[name]
    assert plan.num_layers == spec.num_layers


def test_default_device_caches_stay_small(specs):
    # Small default block counts so the caches build quickly on the CPU backend.
    for name, spec in specs.items():
        total = sum(g.logical_block_bytes * g.count for g in spec.groups) * \
            spec.num_device_blocks
        # One 1024-token MLA block of 61 layers is 76 MiB: that config holds 2.
        limit = {"seed-interleaved": 128 << 20, "vllm-tpu-deepseek-mla": 160 << 20}.get(
            name, 64 << 20)
        assert total <= limit, (name, total)


def test_mixed_configs_have_different_bytes_per_block(specs):
    for name in ("gemma-mixed", "llama3-8b-fp8", "tiny", "seed-good"):
        plan = make_plan(specs[name].layer_specs(), 8, host_memory_budget=HUGE_BUDGET)
        staged = [c.bytes_per_block for c in plan.classes]
        assert len(set(staged)) > 1, (name, staged)
    gemma = make_plan(specs["gemma-mixed"].layer_specs(), 8, path="raw",
                      host_memory_budget=HUGE_BUDGET)
    # The compiler tiles the 4 local kv heads with a 4-row tile: no padding on the device.
    assert [c.bytes_per_block for c in gemma.classes] == [64 << 10, 256 << 10]


def test_seed_interleaved_costs_221_gib_on_the_raw_path(specs):
    spec = specs["seed-interleaved"]
    geos = spec.inspect_layers()
    assert len(geos) == 20 and all(not g.addressable for _, g in geos)
    assert geos[0][1].granularity == 512 and geos[0][1].group_bytes == 6 << 20
    raw = make_plan(spec.layer_specs(), spec.num_host_blocks, path="raw",
                    host_memory_budget=HUGE_BUDGET)
    assert raw.total_host_bytes == 20 * 1886 * (6 << 20)
    assert round(raw.total_host_bytes / 2**30) == 221
    staged = make_plan(spec.layer_specs(), spec.num_host_blocks,
                       host_memory_budget=HUGE_BUDGET)
    assert staged.total_host_bytes == 20 * 1886 * 3 * 2048 * 2


# -- the engines' own caches --------------------------------------------------------------
# Their shape rules, restated from the engines' sources: sglang-jax (cddbf6f)
# MHATokenToKVPool._create_buffers with get_dtype_packing = 32 // bits and head_dim
# rounded up to 128; tpu-inference (b8692ff) ragged_paged_attention v3 get_kv_cache_shape,
# and mla v2 get_kv_cache_shape with MLA_KV_PACKING_SIZE = 32 tokens.


def _align(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _packing(dtype: str) -> int:
    from kvxfer.layout import dtype_of

    return 32 // (8 * dtype_of(dtype).itemsize)


def sglang_shape(size, page_size, dp_size, kv_heads, head_dim, dtype):
    p = _packing(dtype)
    return ((size + page_size * dp_size) // page_size, page_size, kv_heads * 2 // p, p,
            _align(head_dim, 128))


def vllm_shape(num_blocks, block_size, kv_heads, head_dim, dtype):
    p = _packing(dtype)
    return (num_blocks, block_size, _align(kv_heads * 2, p) // p, p, _align(head_dim, 128))


def vllm_mla_shape(num_blocks, block_size, kv_lora_rank, rope_dim, kv_packing=32):
    kv_dim = _align(kv_lora_rank, 128) + _align(rope_dim, 128)
    return (num_blocks, _align(block_size, kv_packing) // kv_packing, kv_packing,
            _align(kv_dim, 128))


# name -> (the full default cache shape by the engine's rule, tokens per block, bytes
# per block of one layer)
ENGINE_CACHES = {
    "sglang-llama3-8b-p1": (sglang_shape(255, 1, 1, 8, 128, "bfloat16"), 1, 4 << 10),
    "sglang-llama3-8b-p64": (sglang_shape(192, 64, 1, 8, 128, "bfloat16"), 64, 256 << 10),
    "vllm-tpu-llama3-8b": (vllm_shape(16, 16, 8, 128, "bfloat16"), 16, 64 << 10),
    "vllm-tpu-llama3-8b-fp8": (vllm_shape(16, 16, 8, 128, "float8_e4m3fn"), 16, 32 << 10),
    "vllm-tpu-deepseek-mla": (vllm_mla_shape(2, 1024, 512, 64), 1024, 1280 << 10),
}


@pytest.mark.parametrize("name", sorted(ENGINE_CACHES))
def test_engine_configs_hold_the_engines_cache_shapes(name, specs):
    spec = specs[name]
    shape, tokens, block_bytes = ENGINE_CACHES[name]
    (group,) = spec.groups
    assert (spec.num_device_blocks, *group.block_shape) == shape
    assert spec.block_size == tokens and group.logical_block_bytes == block_bytes
    # Derived TPU layouts, tiling the (packing, head_dim) pair: a block is one byte range
    # and costs its logical bytes on the device.
    (_, g), *_ = spec.inspect_layers()
    assert g.addressable and g.bytes_per_block == block_bytes and g.padding_factor == 1.0
    # Heads split like the engines' tensor / model axis; the MLA latent is replicated.
    by4 = spec.layer_specs(num_devices=4)[0]
    assert (by4.num_shards, by4.replicas) == ((1, 4) if "mla" in name else (4, 1))


def test_engine_configs_match_the_derived_catalogue(specs):
    from kvxfer import catalog

    cat = catalog.load("engines_derived")
    assert cat.entries and {e.source for e in cat.entries} == {"derived"}
    assert cat.provenance["backend"] == "none"
    assert all(r.agrees for r in cat.check())
    by_array = {(e.shape[1:], e.dtype): e.layout for e in cat.entries
                if not e.name.endswith("-if-full-tile")}
    for name in ENGINE_CACHES:
        (group,) = specs[name].groups
        assert by_array[(group.block_shape, group.dtype)] == group.tpu_layout, name


@pytest.mark.parametrize("name", sorted(ENGINE_CACHES))
def test_engine_configs_plan_from_the_command_line(name, specs):
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvxfer", "plan", "--config", name,
                        "--devices", "4", "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    spec = specs[name]
    (cls,) = out["classes"]
    assert out["num_layers"] == spec.num_layers and not out["refused"]
    assert cls["bytes_per_block"] == ENGINE_CACHES[name][2] and cls["addressable"]
    assert cls["layout"] == spec.groups[0].tpu_layout
    assert out["page_bytes"] == spec.num_layers * ENGINE_CACHES[name][2]
    assert out["total_host_bytes"] == spec.num_host_blocks * out["page_bytes"]


def test_seed_good_geometries(specs):
    geos = dict(specs["seed-good"].inspect_layers())
    assert {n.split(".")[0]: (g.addressable, g.bytes_per_block) for n, g in geos.items()} \
        == {"h4": (True, 32768), "h8": (True, 32768), "h16": (True, 65536)}


def test_inspect_layers_and_tpu_layouts(specs):
    mla = specs["deepseek-mla"]
    geos = mla.inspect_layers(num_blocks=8)
    assert [n for n, _ in geos] == mla.layer_names()
    g = geos[0][1]
    assert g.shape == (8, 16, 576) and g.addressable and g.bytes_per_block == 16 * 640 * 2
    layouts = mla.tpu_layouts()
    assert len(layouts) == 61 and layouts[0] == Layout.parse("{2,1,0:T(8,128)(2,1)}")
    # Without tpu_layout a layer is inspected row-major and has no TPU layout.
    plain = ModelSpec("m", "", 4, 4, None, (LayerGroup("a", 2, (3, 5), "int8"),))
    assert plain.tpu_layouts() == [None, None]
    assert all(str(g.layout) == "{2,1,0}" and g.addressable for _, g in
               plain.inspect_layers())


def test_layer_specs_emulate_tpu_off_gives_row_major(specs):
    s = specs["llama3-8b"].layer_specs(num_blocks=4, emulate_tpu=False)[0]
    assert s.layout == Layout.row_major(5) and s.shape == (4, 16, 2, 8, 128)


def test_layer_specs_sharding_over_devices(specs):
    tiny = specs["tiny"].layer_specs(num_devices=4)
    # kv32 has 2 heads (not divisible by 4): replicated; kv16 has 4: sharded.
    assert [(s.num_shards, s.replicas) for s in tiny] == [(1, 4), (1, 4), (4, 1), (4, 1)]
    assert [(s.num_shards, s.replicas) for s in specs["tiny"].layer_specs(num_devices=2)] \
        == [(2, 1)] * 4
    mla = specs["deepseek-mla"].layer_specs(num_blocks=2, num_devices=4)
    assert all((s.num_shards, s.replicas) == (1, 4) for s in mla)
    plan = make_plan(tiny, 4, host_memory_budget=HUGE_BUDGET)
    assert sorted((c.num_shards, c.replicas) for c in plan.classes) == [(1, 4), (4, 1)]
    with pytest.raises(ValueError, match="num_devices"):
        specs["tiny"].layer_specs(num_devices=0)
    with pytest.raises(ValueError, match="num_blocks"):
        specs["tiny"].layer_specs(num_blocks=0)


def test_build_caches_shapes_dtypes_and_determinism(tiny):
    a = tiny.build_caches()
    assert [x.shape for x in a] == [(32, 16, 2, 2, 32)] * 2 + [(32, 16, 2, 4, 64)] * 2
    assert [str(x.dtype) for x in a] == ["float32"] * 2 + ["bfloat16"] * 2
    assert all(len(x.devices()) == 1 for x in a)
    bits = [np.asarray(x).view(np.uint8) for x in a]
    again = [np.asarray(x).view(np.uint8) for x in tiny.build_caches()]
    assert all(np.array_equal(p, q) for p, q in zip(bits, again))
    # Every layer differs, and another seed gives other bits.
    assert not np.array_equal(bits[0], bits[1]) and not np.array_equal(bits[2], bits[3])
    other = [np.asarray(x).view(np.uint8) for x in tiny.build_caches(seed=1)]
    assert not any(np.array_equal(p, q) for p, q in zip(bits, other))
    # Raw random bits: every byte value shows up (floats are not limited to finite).
    assert len(np.unique(bits[3])) == 256
    small = tiny.build_caches(num_blocks=3)
    assert [x.shape[0] for x in small] == [3] * 4


def test_build_caches_sharded_over_four_devices(tiny):
    devices = jax.devices()[:4]
    assert len(devices) == 4  # tests/conftest.py sets 4 CPU devices
    caches = tiny.build_caches(devices=devices)
    for x in caches[:2]:  # 2 heads: replicated over the mesh
        assert isinstance(x.sharding, NamedSharding)
        assert x.sharding.spec == PartitionSpec()
        assert x.sharding.mesh.axis_names == ("kv",)
        assert len(x.addressable_shards) == 4
        assert {s.data.shape for s in x.addressable_shards} == {(32, 16, 2, 2, 32)}
    for x in caches[2:]:  # 4 heads: one head per device
        assert isinstance(x.sharding, NamedSharding)
        assert x.sharding.spec == PartitionSpec(None, None, None, "kv")
        assert {s.device for s in x.addressable_shards} == set(devices)
        assert {s.data.shape for s in x.addressable_shards} == {(32, 16, 2, 1, 64)}
    # Same contents as the single-device build.
    single = tiny.build_caches()
    for x, y in zip(caches, single):
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    assert tiny.shardings(devices)[3] == caches[3].sharding


@pytest.mark.parametrize("name", BUILTINS)
def test_build_caches_for_every_config(name, specs):
    spec = specs[name]
    caches = spec.build_caches(num_blocks=2)
    assert [x.shape for x in caches] == [s.shape for s in spec.layer_specs(num_blocks=2)]
    assert [str(x.dtype) for x in caches] == [s.dtype for s in spec.layer_specs()]


def test_int4_and_bool_caches_hold_valid_values(tmp_path):
    path = tmp_path / "sub.toml"
    path.write_text('num_device_blocks = 8\nnum_host_blocks = 4\n'
                    '[[layers]]\nname = "q"\ncount = 1\nblock_shape = [16, 128]\n'
                    'dtype = "int4"\ntpu_layout = "{2,1,0:T(8,128)(8,1)E(4)}"\n'
                    '[[layers]]\nname = "m"\ncount = 1\nblock_shape = [4]\ndtype = "bool"\n')
    spec = config.load(path)
    q, m = spec.build_caches()
    qv = np.asarray(q).astype(np.int8)
    assert qv.min() >= -8 and qv.max() <= 7 and len(np.unique(qv)) == 16
    assert set(np.unique(np.asarray(m).view(np.uint8))) <= {0, 1}


def test_load_accepts_builtin_names_and_paths(tmp_path, monkeypatch):
    from kvxfer import _resources

    monkeypatch.chdir(tmp_path)  # names are found from any directory
    by_name = config.load("tiny")
    copy = tmp_path / "mine.toml"
    copy.write_bytes((_resources.data_dir("configs") / "tiny.toml").read_bytes())
    by_path = config.load(copy)
    assert by_name.groups == by_path.groups == config.load_builtin(str(copy)).groups
    assert by_name.block_size == 16 and by_name.num_host_blocks == 16
    assert by_path.name == "tiny"  # the file's own name key, not its stem


def test_unknown_config_names_list_the_built_ins():
    with pytest.raises(ConfigError, match="llama9: no such file and no built-in config of "
                       "that name; did you mean 'llama3-8b'\\? \\(built-in configs: "
                       "deepseek-mla, gemma-mixed"):
        config.load("llama9")


def _groups(*groups: tuple[str, int, str]) -> str:
    """A config text with one [[layers]] group per (name, count, dtype)."""
    return "num_device_blocks = 16\nnum_host_blocks = 4\n" + "".join(
        f'[[layers]]\nname = "{name}"\ncount = {count}\nblock_shape = [16, 128]\n'
        f'dtype = "{dtype}"\n' for name, count, dtype in groups)


def test_configs_that_cannot_be_real_are_refused_fast(tmp_path):
    with pytest.raises(ConfigError, match="count: 1000000000 is more than any real model"):
        config.load(_write(tmp_path, _groups(("a", 10**9, "bf16"))))
    with pytest.raises(ConfigError, match="layers\\[1\\].count: brings the model to 8000 "
                       "layers"):
        config.load(_write(tmp_path, _groups(("g0", 4000, "bf16"), ("g1", 4000, "bf16"))))


def test_complex_dtypes_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="not a real numeric type"):
        config.load(_write(tmp_path, _groups(("a", 1, "complex64"))))


# -- errors ---------------------------------------------------------------------------

GOOD = """\
name = "bad"
num_device_blocks = 8
num_host_blocks = 4

[[layers]]
name = "a"
count = 2
block_shape = [16, 2, 4, 32]
dtype = "bfloat16"
tpu_layout = "{4,3,2,1,0:T(8,128)(2,1)}"
shard_dim = 3

[[layers]]
name = "b"
count = 1
block_shape = [16, 64]
dtype = "float32"
"""


def _write(tmp_path, text: str) -> pathlib.Path:
    path = tmp_path / "x.toml"
    path.write_text(text)
    return path


def test_the_error_fixture_itself_loads(tmp_path):
    spec = config.load(_write(tmp_path, GOOD))
    assert spec.num_layers == 3 and spec.block_size is None


@pytest.mark.parametrize("old, new, key, match", [
    ('num_host_blocks = 4', 'num_host_blocks = 4\nnum_hots_blocks = 4',
     "num_hots_blocks", "unknown key; did you mean 'num_host_blocks'"),
    ('dtype = "float32"', 'dtype = "float32"\ndtpye = "int8"', "layers[1].dtpye",
     "unknown key"),
    ('dtype = "float32"', 'dtype = "bfloat17"', "layers[1].dtype",
     "unknown dtype 'bfloat17'"),
    ('dtype = "float32"', 'dtype = "object"', "layers[1].dtype", "unknown dtype"),
    ('"{4,3,2,1,0:T(8,128)(2,1)}"', '"{4,3,2,1,0:T(8,128"', "layers[0].tpu_layout",
     "bad layout"),
    ('"{4,3,2,1,0:T(8,128)(2,1)}"', '"{2,1,0:T(8,128)(2,1)}"', "layers[0].tpu_layout",
     "rank 3"),
    ('"{4,3,2,1,0:T(8,128)(2,1)}"', '"{4,3,2,1,0:T(8,128)(3,1)}"',
     "layers[0].tpu_layout", "does not fit"),
    ('shard_dim = 3', 'shard_dim = 0', "layers[0].shard_dim", "block dim"),
    ('shard_dim = 3', 'shard_dim = 5', "layers[0].shard_dim", "out of range"),
    ('count = 2', 'count = 0', "layers[0].count", "must be >= 1"),
    ('count = 2', 'count = true', "layers[0].count", "expected an integer"),
    ('count = 2', 'count = "2"', "layers[0].count", "expected an integer"),
    ('block_shape = [16, 64]', 'block_shape = [16, 0]', "layers[1].block_shape[1]",
     "must be >= 1"),
    ('block_shape = [16, 64]', 'block_shape = []', "layers[1].block_shape",
     "at least one dim"),
    ('name = "b"', 'name = "a"', "layers[1].name", "already the name of layers[0]"),
    ('name = "b"', 'name = "b.c"', "layers[1].name", "letters, digits"),
    ('count = 1\n', '', "layers[1].count", "missing"),
    ('num_device_blocks = 8\n', '', "num_device_blocks", "missing"),
    ('num_host_blocks = 4', 'num_host_blocks = -1', "num_host_blocks", "must be >= 1"),
])
def test_bad_config_names_file_and_key(tmp_path, old, new, key, match):
    assert old in GOOD
    path = _write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(ConfigError) as info:
        config.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {key}: "), message
    assert match in message, message
    assert len(message.splitlines()) == 1


def test_no_layers_invalid_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"x\.toml: layers: .*array of tables"):
        config.load(_write(tmp_path, "num_device_blocks = 1\nnum_host_blocks = 1\n"
                                     "layers = 3\n"))
    with pytest.raises(ConfigError, match=r"x\.toml: invalid TOML"):
        config.load(_write(tmp_path, "name = \n"))
    with pytest.raises(ConfigError, match=r"nope\.toml: no such file"):
        config.load(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="no built-in config.*tiny"):
        config.load_builtin("no-such-model")
    assert issubclass(ConfigError, ValueError)


def test_layer_group_validates_in_code():
    with pytest.raises(ConfigError, match="layer group 'g': dtype: unknown dtype"):
        LayerGroup("g", 1, (4,), "bfloat17")
    with pytest.raises(ConfigError, match="shard_dim"):
        LayerGroup("g", 1, (4, 8), "int8", shard_dim=0)
    g = LayerGroup("g", 1, [4, 8], "bf16", "{2, 1, 0}")
    assert g.block_shape == (4, 8) and g.dtype == "bfloat16" and g.tpu_layout == "{2,1,0}"
    assert g.logical_block_bytes == 64 and math.prod(g.block_shape) == 32
