"""Every TPU transfer program, compiled by the real XLA:TPU compiler without a TPU.

libtpu (the ``tpu`` extra) compiles for v4, v5e, v5p, v6e and tpu7x deviceless. These
tests compile what ``path="auto"`` runs there, at an engine's block count, and check
each program: it compiles, nothing computes on host memory, the in-place route starts
one DMA a page (``dynamic-(update-)slice-start`` on ``S(5)``) into a pool it updates
in place, the pages route copies its pages out with copy-start/copy-done, and device
memory staged stays within the stated bound. Without libtpu they skip, unless
``KVXFER_REQUIRE_TPU=1`` (CI) makes that a failure.

The in-place route is compiled on all five generations for one config, and on one
generation for every config (each class cut to one layer a group: its programs repeat
per layer); the pages route for sharded caches on one generation.
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
from kvxfer.engine import _pinned_programs, abstract_layer, check_program
from kvxfer.manager import choose_movers
from kvxfer.plan import make_plan

def _require_libtpu() -> None:
    if tpu.available():
        return
    if os.environ.get("KVXFER_REQUIRE_TPU") == "1":
        pytest.fail(f"KVXFER_REQUIRE_TPU=1 and {tpu.INSTALL_HINT}")
    pytest.skip(tpu.INSTALL_HINT)


@pytest.fixture
def libtpu():
    _require_libtpu()


IN_PLACE = ("pinned_write", "pinned_load")
TRANSFERS = IN_PLACE + ("pages_offload", "pages_load")


def _check_rows(rows: list[aot.AotResult]) -> None:
    bad = [r.line() for r in rows if not r.ok]
    assert bad == [], "\n".join(bad)
    for r in rows:
        assert r.host_compute == (), r.line()
        assert r.staging_bytes is not None and r.staging_bytes <= r.staging_bound, r.line()
        kind = r.program.split("+")[0]
        if kind == "pinned_write":  # one DMA a page into the pool, updated in place
            assert r.host_transfers == {"dynamic-update-slice-start": 1}, r.line()
            assert r.page_dmas == 1 and r.host_pool == "aliased", r.line()
        elif kind == "pinned_load":  # one DMA a page out of the pool, read only
            assert r.host_transfers == {"dynamic-slice-start": 1}, r.line()
            assert r.page_dmas == 1 and r.host_pool == "read", r.line()
        elif kind == "pages_offload":  # each page a new pinned array
            assert set(r.host_transfers) == {"copy-start"} and r.host_pool == "new", r.line()
        else:  # pages_load reads pages staged on the device; digests only read caches
            assert r.host_transfers == {} and r.host_pool is None, r.line()


@pytest.mark.parametrize("generation", tpu.GENERATIONS)
def test_the_in_place_route_is_one_dma_a_page_on_every_generation(generation, libtpu):
    """tiny's two classes (f32 and bf16) at the blocks a chip holds, 1 and 2 pages."""
    rows = aot.compile_config("tiny", generation, pages=2)
    _check_rows(rows)
    assert {r.program for r in rows} == {"pinned_write+digest", "pinned_load+digest"}
    assert {r.pages for r in rows} == {1, 2} and len({r.slice_class for r in rows}) == 2
    assert all(r.reason == "auto on tpu; in place" for r in rows), rows[0].reason
    assert rows[0].num_blocks == aot.engine_blocks(config.load("tiny"), generation)


def test_every_config_is_moved_in_place_on_one_device(libtpu):
    """Every built-in config at engine sizes, one layer a group, 1 page: the in-place
    route for every class, MLA's cache (block dim inside, not addressable) included."""
    for name in config.builtin_names():
        rows = aot.compile_config(name, "v5e", max_layers=1, pages=1)
        _check_rows(rows)
        assert rows and {r.mover for r in rows} == {"pinned"}, name
        assert {r.program.split("+")[0] for r in rows} == set(IN_PLACE), name


def test_sharded_caches_take_the_pages_route_and_say_why(libtpu):
    rows = aot.compile_config("vllm-tpu-llama3-8b", "v6e", 4, max_layers=1, pages=1)
    _check_rows(rows)
    assert {r.program for r in rows} == {"pages_offload+digest", "pages_load+digest"}
    assert all("pages route: not in place: its shards live on 4 devices" in r.reason
               for r in rows), rows[0].reason


@pytest.mark.parametrize("pages, chunk, under", [(4, None, 4 << 20), (64, 4, 2 << 20)])
def test_a_cache_with_its_block_dim_inside_stages_no_copy_of_itself(libtpu, monkeypatch,
                                                                     pages, chunk, under):
    """vLLM TPU's MLA cache at engine sizes is ``{0,2,1:...}``: a gather or a scatter
    of its blocks would relayout the whole cache (hundreds of MiB). 4 pages stage under
    4 MiB; the 64-page bucket with chunks cut to 4 pages (one layer loops over 16 of
    them) holds the cache to its layout through the loop (else copied whole: 435 MiB),
    one DMA a page, under 2 MiB. Unrolled over 64 pages, llama3-8b's 32 layers staged
    367 and 422 MiB of 268."""
    if chunk is not None:
        monkeypatch.setattr(_pinned_programs, "CHUNK_SLICES", chunk)
        monkeypatch.setattr(aot, "_DONE", {})
    rows = aot.compile_config("deepseek-mla", "v6e", max_layers=1, pages=pages,
                              programs=IN_PLACE)
    rows = [r for r in rows if r.pages == pages]
    assert len(rows) == 2
    _check_rows(rows)
    assert all(r.staging_bytes < under for r in rows), [r.line() for r in rows]


def test_pages_are_bounded_by_what_a_transfer_can_move(libtpu):
    with pytest.raises(ValueError, match=r"pages=64: a transfer moves at most 16 pages here"):
        aot.compile_config("tiny", "v6e", num_blocks=16, pages=64)


def _class_of(shape, dtype, generation="v6e"):
    device = tpu.target_devices(generation, 1)[0]
    x = jax.ShapeDtypeStruct(shape, np.dtype(dtype) if dtype != "bfloat16" else
                             jax.numpy.bfloat16,
                             sharding=jax.sharding.SingleDeviceSharding(device))
    return x, abstract_layer(x)


def test_auto_on_tpu_takes_the_in_place_route_for_any_layout(libtpu):
    device = tpu.target_devices("v6e", 1)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    shapes = [(256, 16, 8, 128), (256, 16, 576)]
    caches = [jax.ShapeDtypeStruct(s, jax.numpy.bfloat16, sharding=sharding) for s in shapes]
    from kvxfer.plan import LayerSpec

    specs = [LayerSpec(f"L{i}", s, "bfloat16", tpu.compiled_layout(s, "bfloat16", "v6e").layout)
             for i, s in enumerate(shapes)]
    plan = make_plan(specs, 4, path="staged")
    chosen = choose_movers(plan, specs, caches, "auto", False)
    assert [(m.name, m.pinned_pool) for m, _ in chosen] == [("pinned", True)] * 2
    assert [why for _, why in chosen] == ["auto on tpu; in place"] * 2


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
    r = _kvxfer("aot", "--target", "v5p", "--config", "tiny", "--pages", "1", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert rows and all(row["ok"] and row["error"] is None for row in rows)
    for row in rows:
        assert {"config", "program", "dtype", "devices", "ok", "error", "host_compute",
                "mover", "reason", "staging_bytes", "slice_class", "page_dmas", "host_pool",
                "num_blocks"} <= set(row)
        assert row["config"] == "tiny" and row["devices"] == 1 and row["host_compute"] == []
        assert row["libtpu"] == tpu.libtpu_version() and row["page_dmas"] == 1
    assert {row["program"] for row in rows} == {"pinned_write+digest", "pinned_load+digest"}


def test_the_command_fits_100_columns_names_programs_apart_and_sums_up(libtpu):
    r = _kvxfer("aot", "--target", "v6e", "--config", "tiny", "--pages", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    programs = [line.split()[1:3] for line in lines if line.startswith("  ok")]
    assert len(programs) == 8 and len({tuple(p) for p in programs}) == 4  # per class
    assert lines[-1].startswith("aot: 8 programs of 1 configs on v6e (pinned): 8 ok, "
                                "0 failed; host compute 0; dma/page 1"), lines[-1]


def test_the_command_compiles_in_a_worker_and_leaves_the_environment_alone(libtpu):
    """libtpu loads in the worker process only; nothing is left in the environment."""
    keys = sorted(tpu.LIBTPU_ENVIRONMENT)
    r = _kvxfer("aot", "--target", "v5e", "--config", "tiny", "--pages", "1",
                prelude="import atexit, os\n"
                "atexit.register(lambda: print('AFTER', 'libtpu' in sys.modules, "
                f"[k for k in {keys!r} if k in os.environ], file=sys.stderr))")
    assert r.returncode == 0, r.stderr
    assert "AFTER False []" in r.stderr, r.stderr[-2000:]


def test_libtpu_environment_is_set_for_the_call_only(libtpu):
    before = {k: os.environ.get(k) for k in tpu.LIBTPU_ENVIRONMENT}
    tpu.compiled_layout((64, 16, 2048), "bf16", "v5p")
    assert {k: os.environ.get(k) for k in tpu.LIBTPU_ENVIRONMENT} == before


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
    assert "unknown TPU generation 'v9'" in err  # before libtpu or JAX is asked


def test_a_bad_target_is_refused_before_jax_is_imported():
    r = _kvxfer("aot", "--target", "v7",
                prelude="import builtins\n_imp = builtins.__import__\n"
                "def _no_jax(name, *a, **k):\n"
                "    assert not name.startswith('jax'), 'jax imported'\n"
                "    return _imp(name, *a, **k)\n"
                "builtins.__import__ = _no_jax")
    assert r.returncode == 2, r.stderr
    assert "unknown TPU generation 'v7'" in r.stderr and "jax imported" not in r.stderr


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


def test_blocks_over_a_mebibyte_stage_no_copy_of_the_cache(libtpu):
    """XLA:TPU gathers blocks of more than 1 MiB through copies of the whole cache
    (vLLM TPU's MLA pages are 1.25 MiB): the in-place route reads them a page at a
    time."""
    rows = aot.compile_config("vllm-tpu-deepseek-mla", "v6e", num_blocks=64, pages=2,
                              max_layers=1)
    assert [r.pages for r in rows] == [1, 1, 2, 2]
    _check_rows(rows)
    assert all(r.staging_bytes < 8 << 20 for r in rows), [r.line() for r in rows]


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
    """int4, int8, fp8, f32 and bf16, on one device (in place) and sharded over four
    (the pages route): auto's choice for each compiles clean."""
    path = tmp_path / "dtypes.toml"
    path.write_text(DTYPES_CONFIG)
    rows = aot.compile_config(str(path), "v5e", devices, num_blocks=256, pages=1)
    _check_rows(rows)
    assert {r.dtype for r in rows} == {"s4", "s8", "f8e4m3fn", "f32", "bf16"}
    kinds = {r.program.split("+")[0] for r in rows}
    assert kinds == (set(IN_PLACE) if devices == 1 else {"pages_offload", "pages_load"})
