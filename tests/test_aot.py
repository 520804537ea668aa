"""Every TPU transfer program, compiled by the real XLA:TPU compiler without a TPU.

libtpu (the ``tpu`` extra) compiles for v4, v5e, v5p, v6e and tpu7x deviceless. These
tests compile what ``path="auto"`` runs there for every built-in config, replicated
and sharded over 4 devices, and check each program: it compiles, nothing computes on
host memory, the payload reaches host memory through DMAs or copy-start/copy-done,
and its device-memory staging is within the stated bound. Without libtpu they skip,
unless ``KVXFER_REQUIRE_TPU=1`` (CI) makes that a failure.

The transfer programs are compiled for all five generations over four devices (sharded
and replicated layers) and for one generation on one device; the digest programs
(plain XLA on device memory, 1-3 s a compile) for one generation; each class cut to
one layer a group (its programs repeat per layer). About 45 s of CPU time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from kvxfer import aot, config, tpu
from kvxfer.engine import abstract_layer, check_program, pallas_compile_refusal
from kvxfer.manager import choose_movers
from kvxfer.plan import make_plan

# Other processes may hold libtpu's lockfile; deviceless compiles open no chip.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _require_libtpu() -> None:
    if tpu.available():
        return
    if os.environ.get("KVXFER_REQUIRE_TPU") == "1":
        pytest.fail(f"KVXFER_REQUIRE_TPU=1 and {tpu.INSTALL_HINT}")
    pytest.skip(tpu.INSTALL_HINT)


@pytest.fixture
def libtpu():
    _require_libtpu()


TRANSFERS = ("pallas_offload", "pallas_load", "pages_offload", "pages_load")


def _check_rows(rows: list[aot.AotResult]) -> None:
    bad = [r.line() for r in rows if not r.ok]
    assert bad == [], "\n".join(bad)
    for r in rows:
        assert r.host_compute == (), r.line()
        assert r.staging_bytes is not None and r.staging_bytes <= r.staging_bound, r.line()
        # The payload reaches host memory by the kernels' DMAs or copy-start/done.
        if r.program in ("pallas_offload", "pallas_load"):
            assert r.host_transfers == {"custom-call": 1}, r.line()
            assert r.staging_bytes == 0, r.line()  # DMAs straight from the caches
        elif r.program == "pages_offload":
            assert set(r.host_transfers) == {"copy-start"}, r.line()
        else:  # pages_load reads pages staged on the device; digests only read caches
            assert r.host_transfers == {}, r.line()


def _check_transfers(generation: str, devices: int) -> set[str]:
    """Every built-in config's transfer programs on ``devices`` devices of
    ``generation``; the movers picked."""
    movers = set()
    for name in config.builtin_names():
        rows = aot.compile_config(name, generation, devices, max_layers=1, programs=TRANSFERS)
        _check_rows(rows)
        assert rows, name
        movers |= {r.mover for r in rows}
        for r in rows:  # the pallas mover's kernels, else the pages route's
            assert r.program.startswith("pallas_" if r.mover == "pallas" else "pages_")
            assert r.reason.startswith("auto on tpu"), r.reason
            if r.mover != "pallas":
                assert "not pallas" in r.reason, r.reason
    return movers


@pytest.mark.parametrize("generation", tpu.GENERATIONS)
def test_every_transfer_program_of_every_config_compiles_clean(generation, libtpu):
    """Over four devices, each layer sharded where its config shards it and replicated
    where it does not divide: Pallas kernels wherever the class is addressable under
    the compiler's layout, the pages route elsewhere."""
    assert _check_transfers(generation, 4) == {"pallas", "pinned"}


def test_every_transfer_program_compiles_clean_on_one_device(libtpu):
    """Unsharded (each class's whole blocks on one device)."""
    assert _check_transfers("v5e", 1) == {"pallas", "pinned"}


def test_the_pallas_mover_is_picked_for_the_engines_caches(libtpu):
    rows = aot.compile_config("vllm-tpu-llama3-8b", "v6e", 4, max_layers=1,
                              programs=TRANSFERS)
    assert {(r.mover, r.program) for r in rows} == {("pallas", "pallas_offload"),
                                                    ("pallas", "pallas_load")}
    rows = aot.compile_config("seed-interleaved", "v6e", max_layers=1, programs=TRANSFERS)
    assert {r.mover for r in rows} == {"pinned"}
    assert "rule 'block dim outermost' failed" in rows[0].reason


def test_digest_programs_compile_clean_replicated_and_sharded(libtpu):
    """Over 4 devices: the sharded layers' shards and the replicated layers' replicas
    (each replica's program is the one a single device runs)."""
    rows = [r for name in config.builtin_names()
            for r in aot.compile_config(name, "v6e", 4, max_layers=1, programs=("digest",))]
    # Digest programs of their own are the Pallas mover's (the pages route digests in
    # its transfer programs), for every config with a class it moves.
    assert {r.mover for r in rows} == {"pallas"}
    assert len({r.config for r in rows}) > len(config.builtin_names()) // 2
    _check_rows(rows)


def test_several_buckets_and_every_layer_of_a_config(libtpu):
    rows = aot.compile_config("tiny", "v5e", 4, pages=4, programs=TRANSFERS)
    _check_rows(rows)
    assert sorted({r.pages for r in rows}) == [1, 2, 4]
    assert {r.layers for r in rows} == {2}


def _class_of(shape, dtype, generation="v6e"):
    device = tpu.target_devices(generation, 1)[0]
    x = jax.ShapeDtypeStruct(shape, np.dtype(dtype) if dtype != "bfloat16" else
                             jax.numpy.bfloat16,
                             sharding=jax.sharding.SingleDeviceSharding(device))
    return x, abstract_layer(x)


@pytest.mark.parametrize("generation", ["v4", "v6e"])
def test_the_compile_check_refuses_kernels_the_compiler_refuses(generation, libtpu):
    """A block dim the compiler moves inward (``{0,2,1:...}`` from 128 blocks of a
    576-wide MLA latent) is refused by the inspector, and the kernels would not
    compile either: the check says so, naming the kernel and the chip."""
    _, layer = _class_of((256, 16, 576), "bfloat16", generation)
    why = pallas_compile_refusal([layer])
    assert why is not None and "does not compile for TPU" in why
    assert "Unimplemented DMA" in why
    _, layer = _class_of((256, 16, 8, 128), "bfloat16", generation)
    assert pallas_compile_refusal([layer]) is None


def test_blocks_not_a_multiple_of_4_kib_are_refused_by_the_compile_check(libtpu):
    """Addressable 1 KiB blocks (one-token pages of 2 KV heads): the host side of a DMA
    must start at a multiple of 4 KiB, which page 1 of a buffer of them does not."""
    shape = (64, 1, 2, 2, 128)
    layout = tpu.compiled_layout(shape, "bfloat16", "v6e")
    assert layout.geometry().addressable and layout.geometry().bytes_per_block == 1024
    _, layer = _class_of(shape, "bfloat16")
    why = pallas_compile_refusal([layer])
    assert why is not None and "offset_in_bytes % word_size == 0" in why
    _, layer = _class_of((64, 4, 2, 2, 128), "bfloat16")  # 4 KiB blocks
    assert pallas_compile_refusal([layer]) is None


def test_auto_picks_pallas_only_where_proven_and_says_why(libtpu):
    device = tpu.target_devices("v6e", 1)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    shapes = [(256, 16, 8, 128), (256, 16, 576)]
    caches = [jax.ShapeDtypeStruct(s, jax.numpy.bfloat16, sharding=sharding) for s in shapes]
    from kvxfer.plan import LayerSpec

    specs = [LayerSpec(f"L{i}", s, "bfloat16", tpu.compiled_layout(s, "bfloat16", "v6e").layout)
             for i, s in enumerate(shapes)]
    plan = make_plan(specs, 4, path="staged")
    chosen = choose_movers(plan, specs, caches, "auto", False)
    assert [m.name for m, _ in chosen] == ["pallas", "pinned"]
    assert chosen[0][1] == "auto on tpu"
    assert chosen[1][1].startswith("auto on tpu; not pallas: layer 1: "
                                   "bf16[256,16,576]{0,2,1:T(8,128)(2,1)}")


def test_check_program_finds_host_compute(libtpu):
    """Arithmetic on a pinned_host array is host compute; a move is not."""
    device = tpu.target_devices("v6e", 1)[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    dev = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((8, 128), np.float32, sharding=host)
    moved = jax.jit(lambda a: a, out_shardings=dev).lower(x).compile()
    assert check_program(moved).host_compute == ()
    computed = jax.jit(lambda a: a * 2, out_shardings=host).lower(x).compile()
    assert check_program(computed).host_compute != ()


def _kvxfer(*args: str, env: dict | None = None, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"import sys\n{prelude}\nfrom kvxfer.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


def test_the_command_prints_a_json_object_per_program(libtpu):
    r = _kvxfer("aot", "--target", "v5p", "--config", "tiny", "--devices", "4", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert rows and all(row["ok"] and row["error"] is None for row in rows)
    for row in rows:
        assert {"config", "program", "dtype", "devices", "ok", "error", "host_compute",
                "mover", "reason", "staging_bytes", "slice_class"} <= set(row)
        assert row["config"] == "tiny" and row["devices"] == 4 and row["host_compute"] == []
        assert row["libtpu"] == tpu.libtpu_version()
    assert {row["program"] for row in rows} >= {"digest", "pallas_offload", "pallas_load"}


def test_without_libtpu_the_command_is_one_line_and_exit_2():
    r = _kvxfer("aot", "--target", "v6e", prelude="sys.modules['libtpu'] = None")
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"kvxfer aot: {tpu.INSTALL_HINT}"]


def test_a_bad_target_is_one_line_and_exit_2(capsys):
    from kvxfer import cli

    assert cli.main(["aot", "--target", "v9", "--config", "tiny"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    if tpu.available():
        assert "unknown TPU generation 'v9'" in err


def test_mgr_paths_say_why_each_mover_was_chosen():
    import jax.numpy as jnp

    import kvxfer

    caches = [jnp.zeros((8, 128), jnp.float32), jnp.zeros((8, 128), jnp.int4)]
    with kvxfer.KVCacheManager(caches, num_host_blocks=2) as mgr:
        assert mgr.paths == ["raw", "pinned"]
        assert mgr.paths[0].reason == "auto on cpu"
        assert mgr.paths[1].reason.startswith("auto on cpu; not raw: raw copies need")
    with kvxfer.KVCacheManager(caches[:1], num_host_blocks=2, path="staged") as mgr:
        assert mgr.paths == ["staged"] and mgr.paths[0].reason == "path='staged'"


def test_digests_of_blocks_over_a_mebibyte_stage_no_copy_of_the_cache(libtpu):
    """XLA:TPU gathers blocks of more than 1 MiB through copies of the whole cache
    (vLLM TPU's MLA pages are 1.25 MiB): their digests loop over the pages instead."""
    rows = aot.compile_config("vllm-tpu-deepseek-mla", "v6e", num_blocks=64, pages=2,
                              max_layers=1, programs=("digest",))
    assert [r.pages for r in rows] == [1, 2]
    _check_rows(rows)
    assert all(r.staging_bytes < 4 << 20 for r in rows), [r.line() for r in rows]


DTYPES_CONFIG = """
name = "dtypes"
description = "one layer group per dtype the builtin configs lack or hold once"
num_device_blocks = 256
num_host_blocks = 16
block_size = 16
""" + "".join(f"""
[[layers]]
name = "{name}"
count = 1
block_shape = [16, 2, 8, 128]
dtype = "{dtype}"
shard_dim = 3
""" for name, dtype in [("i4", "int4"), ("i8", "int8"), ("f8", "float8_e4m3fn"),
                        ("f32", "float32"), ("bf16", "bfloat16")])


@pytest.mark.parametrize("devices", [1, 4])
def test_every_dtype_compiles_clean(devices, tmp_path, libtpu):
    """int4 (the pages route: the kernels copy whole elements), int8, fp8, f32 and
    bf16, replicated and sharded: auto's choice for each compiles clean, and int4 is
    never the Pallas mover's."""
    path = tmp_path / "dtypes.toml"
    path.write_text(DTYPES_CONFIG)
    rows = aot.compile_config(str(path), "v5e", devices)
    _check_rows(rows)
    assert {r.dtype for r in rows} == {"s4", "s8", "f8e4m3fn", "f32", "bf16"}
    assert {r.mover for r in rows if r.dtype == "s4"} == {"pinned"}
    assert any(r.mover == "pallas" for r in rows)
