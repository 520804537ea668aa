"""Where a layout comes from (``kvxfer.layout_source``): every source answers the same
question the same way, the sources agree where they should, errors name the value at
fault, and asking the TPU compiler leaves the caller's process as it was (no libtpu
loaded in it, no variable left in its environment).

The compiler's tests skip without libtpu, unless ``KVXFER_REQUIRE_TPU=1`` (CI) makes
that a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvxfer import catalog, cli, config, tpu
from kvxfer.layout import Layout, LayoutError
from kvxfer.layout_source import (ArrayFormats, ArraySpec, CatalogLayouts, Compiler,
                                  ConfigLayouts, Given, config_layer_specs)


@pytest.fixture
def libtpu():
    if tpu.available():
        return
    if os.environ.get("KVXFER_REQUIRE_TPU") == "1":
        pytest.fail(f"KVXFER_REQUIRE_TPU=1 and {tpu.INSTALL_HINT}")
    pytest.skip(tpu.INSTALL_HINT)


def _layouts(source, arrays):
    return [str(s.layout) for s in source.layouts(arrays)]


# -- agreement --------------------------------------------------------------------------


def test_an_arrays_own_format_is_what_a_given_layout_says_on_cpu():
    """XLA:CPU lays every array out row-major, and stores a permutation it is given."""
    arrays = [jnp.zeros((8, 2, 128), jnp.bfloat16), jnp.zeros((4, 3), jnp.int8)]
    specs = [ArraySpec.of(a, f"a{i}") for i, a in enumerate(arrays)]
    assert _layouts(ArrayFormats(), specs) == _layouts(Given(), specs) == ["{2,1,0}", "{1,0}"]
    fmt = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    from jax.experimental.layout import Format

    permuted = jax.device_put(np.zeros((8, 4, 16), np.float32),
                              Format(Layout.parse("{1,2,0}").to_jax(), fmt))
    (s,) = ArrayFormats().layouts([ArraySpec.of(permuted)])
    assert str(s.layout) == "{1,2,0}" and s.source == "array"
    assert _layouts(Given("{1,2,0}"), [ArraySpec.of(permuted)]) == ["{1,2,0}"]


def test_a_split_arrays_spec_is_one_shard_a_device():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()[:2]
    if len(devices) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(devices), ("kv",))
    a = jax.device_put(np.zeros((8, 4, 128), np.float32),
                       NamedSharding(mesh, PartitionSpec(None, "kv")))
    spec = ArraySpec.of(a, "k")
    assert (spec.num_devices, spec.shard_dim, spec.shard_shape) == (2, 1, (8, 2, 128))
    (s,) = ArrayFormats().layouts([spec])
    assert s.geometry().shape == (8, 2, 128) and s.geometry().addressable


def test_the_catalogue_source_gives_each_entry_its_own_layout():
    for name in catalog.builtin_names():
        cat = catalog.load(name)
        arrays = [ArraySpec(e.shape, e.dtype, name=e.name) for e in cat.entries]
        got = CatalogLayouts(cat).layouts(arrays)
        assert [str(s.layout) for s in got] == [str(Layout.parse(e.layout))
                                                for e in cat.entries], name
        assert [s.note for s in got] == [e.tpu_default_note for e in cat.entries]


def test_the_config_source_is_what_layer_specs_emulate():
    for name in config.builtin_names():
        spec = config.load(name)
        for n, devices in ((spec.num_device_blocks, 1), (4096, 1), (512, 4)):
            layers, got = config_layer_specs(spec, ConfigLayouts(spec), n, devices)
            emulated = spec.layer_specs(n, num_devices=devices)
            assert [ls.layout for ls in layers] == [ls.layout for ls in emulated], (name, n)
            assert [s.note for s in got] == [g.compiled_note(n, s.array.num_devices
                                                             if s.array.shard_dim else 1)
                                             for g, s in zip(spec.groups, got)]
    # and a row-major plan is what the config's row-major specs say
    spec = config.load("gemma-mixed")
    layers, _ = config_layer_specs(spec, Given(), 64, 2)
    assert layers == spec.layer_specs(64, num_devices=2, emulate_tpu=False)


def test_the_compiler_agrees_with_the_config_and_the_catalogue(libtpu):
    """In one worker call: every built-in config's groups where the config records the
    compiler's choice, at its own block count and at an engine's (4096), replicated
    and split over 4 devices; and every catalogue entry the compiler picks by itself."""
    asked, want = [], []
    for name in config.builtin_names():
        spec = config.load(name)
        for n, devices in ((spec.num_device_blocks, 1), (4096, 1), (4096, 4)):
            _, got = config_layer_specs(spec, ConfigLayouts(spec), n, devices)
            for g, s in zip(spec.groups, got):
                if g.tpu_compiled and g.tpu_layout_note is None:
                    asked.append(s.array)
                    want.append((name, g.name, n, devices, str(s.layout)))
    for name in ("seeds", "engines_derived"):
        cat = catalog.load(name)
        for e, s in zip(cat.entries, CatalogLayouts(cat).layouts(
                [ArraySpec(e.shape, e.dtype, name=e.name) for e in cat.entries])):
            if e.tpu_default:
                asked.append(s.array)
                want.append((name, e.name, e.shape[0], 1, str(s.layout)))
    got = Compiler("v6e", nearest=False).layouts(asked)
    assert len(want) > 20
    assert [w[:-1] + (str(s.layout),) for w, s in zip(want, got)] == want
    assert {s.facts["target"] for s in got} <= {"v6e:2x2", "v6e:2x4"}
    assert all(s.alternatives is None for s in got)


def test_the_compilers_nearest_shapes_are_addressable(libtpu):
    (s,) = Compiler("v5e").layouts([ArraySpec((4096, 16, 576), "bf16", name="mla")])
    assert not s.geometry().addressable and s.facts["libtpu"] == tpu.libtpu_version()
    assert [a.array.shape for a in s.alternatives][0] == (4096, 16, 640)
    assert all(a.geometry().addressable for a in s.alternatives)


# -- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("make, arrays, error, match", [
    (lambda: ConfigLayouts(config.load("tiny")), [ArraySpec((8, 4), "f32", name="attn")],
     LayoutError, "array 'attn' is no layer group of config 'tiny'"),
    (lambda: ConfigLayouts(config.load("tiny")),
     [ArraySpec((8, 16, 2, 2, 33), "f32", name="kv32.1")], LayoutError,
     r"array 'kv32.1': \[8, 16, 2, 2, 33\] float32 \(block dim 0\) is not a cache of group"),
    (lambda: ConfigLayouts(config.load("llama3-8b")),
     [ArraySpec((8, 16, 2, 8, 128), "bf16", 2, 2, name="attn")], LayoutError,
     "split along dim 2; config 'llama3-8b' splits 'attn' along 3"),
    (lambda: CatalogLayouts(catalog.load("seeds")), [ArraySpec((8, 4), "f32", name="x")],
     LayoutError, "array 'x' is no entry of the catalogue"),
    (lambda: CatalogLayouts(catalog.load("seeds")),
     [ArraySpec((8, 4), "f32", name="seed-heads4")], LayoutError,
     r"\[8, 4\] float32 is not the catalogue's \[512, 4, 2048\] bfloat16"),
    (lambda: CatalogLayouts(catalog.Catalog(tuple(
        catalog.Entry("x", (8, 4), "float32", text, 0, "derived", {})
        for text in ("{1,0}", "{0,1}")))), [ArraySpec((8, 4), "f32", name="x")],
     LayoutError, "array 'x': 2 entries of the catalogue have that name and shape, with "
     "different layouts"),
    (lambda: Given(["{1,0}"] * 3), [ArraySpec((4, 4), "f32")], ValueError,
     "has 3 layouts for 1 arrays"),
    (lambda: Given("{2,1,0"), [ArraySpec((4, 4), "f32")], LayoutError, "braces"),
    (ArrayFormats, [ArraySpec((4, 4), "f32", name="k0")], LayoutError,
     r"array k0 \(\[4, 4\] float32\) has no format"),
])
def test_each_source_names_what_it_cannot_lay_out(make, arrays, error, match):
    with pytest.raises(error, match=match):
        make().layouts(arrays)


def test_array_specs_name_their_bad_values():
    with pytest.raises(ValueError, match=r"shard_dim=1 of shape \[8, 3\] does not split "
                                         "over 2 devices"):
        ArraySpec((8, 3), "bf16", 2, 1)
    with pytest.raises(LayoutError, match="bfloat17"):
        ArraySpec((8, 3), "bfloat17")
    with pytest.raises(TypeError, match="shape='8,3' must be a sequence of ints"):
        ArraySpec("8,3", "bf16")
    with pytest.raises(ValueError, match="num_devices=0"):
        ArraySpec((8, 3), "bf16", 0)


def test_the_compiler_refuses_before_it_compiles():
    with pytest.raises(ValueError, match="target='v9': unknown TPU generation 'v9'"):
        Compiler("v9")
    with pytest.raises(ValueError, match="num_devices=64: the largest v6e topology"):
        Compiler("v6e").layouts([ArraySpec((8, 64), "bf16", 64, 1)])
    with pytest.raises(ValueError, match="block_dim=1; the TPU compiler is asked of caches "
                                         "whose block dim is 0"):
        Compiler("v6e").layouts([ArraySpec((8, 64), "bf16", block_dim=1)])


# -- the caller's process ---------------------------------------------------------------

_CALLER = """
import json, os, sys
from kvxfer.cli import main
from kvxfer.layout_source import ArraySpec, Compiler

before = dict(os.environ)
status = [main(argv) for argv in (
    ["inspect", "--shape", "4096,16,576", "--dtype", "bf16", "--target", "v6e"],
    ["inspect", "--config", "llama3-8b", "--target", "v5e", "--devices", "4", "--json"],
    ["plan", "--config", "deepseek-mla", "--target", "tpu7x", "--num-blocks", "4096",
     "--devices", "2"],
    ["plan", "--config", "tiny", "--devices", "2"])]
(s,) = Compiler("v5p").layouts([ArraySpec((64, 16, 2048), "bf16")])
with open("/proc/self/maps") as f:
    mapped = "libtpu" in f.read()
print("RESULT", json.dumps({
    "status": status, "layout": str(s.layout), "mapped": mapped,
    "jax": "jax" in sys.modules, "libtpu": "libtpu" in sys.modules,
    "changed": sorted(k for k in set(before) | set(os.environ)
                      if before.get(k) != os.environ.get(k))}))
"""


def test_the_compiler_source_leaves_the_callers_process_as_it_was(libtpu):
    """The CLI's ``--target`` and the library's compiler source load libtpu in a
    worker only: the caller never imports JAX, maps no libtpu, and its environment is
    as it was after each call (run without JAX_PLATFORMS, which the command line sets
    for JAX to read and takes back)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES", *tpu.LIBTPU_ENVIRONMENT)}
    r = subprocess.run([sys.executable, "-c", _CALLER], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    got = json.loads(line.removeprefix("RESULT "))
    assert got["status"] == [0, 0, 0, 0], r.stdout[-3000:]
    assert got["layout"] == "{2,1,0:T(8,128)(2,1)}"
    assert (got["mapped"], got["jax"], got["libtpu"], got["changed"]) == \
        (False, False, False, [])


def test_in_process_commands_leave_the_environment_alone(libtpu, capsys):
    before = dict(os.environ)
    for argv in (["inspect", "--shape", "64,8,64", "--dtype", "bf16", "--target", "v4"],
                 ["plan", "--config", "tiny", "--target", "v6e", "--devices", "2"],
                 ["inspect", "--catalog", "seeds", "--target", "v5p"]):
        assert cli.main(argv) == 0, capsys.readouterr().err
        assert dict(os.environ) == before, argv
    config_layer_specs(config.load("tiny"), Compiler("v6e", isolated=False), 8)
    assert dict(os.environ) == before


def test_the_cli_takes_one_source(capsys):
    for argv in (["inspect", "--shape", "8,128", "--dtype", "bf16", "--layout", "{1,0}",
                  "--target", "v6e"],
                 ["plan", "--config", "tiny", "--no-tpu-layouts", "--target", "v6e"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "both say where the layout comes from: give one" in err and \
            len(err.splitlines()) == 1
    # a given layout, split over devices: the verdict is one shard's
    assert cli.main(["inspect", "--shape", "64,8,256", "--dtype", "bf16", "--layout",
                     "{2,1,0:T(8,128)(2,1)}", "--devices", "2", "--shard-dim", "2",
                     "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["shape"], row["shard_shape"], row["bytes_per_block"]) == \
        ([64, 8, 256], [64, 8, 128], 2048)
