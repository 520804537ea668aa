"""Every option of every command, with hostile values: one line naming the value and
exit 2, or a run that ends (a bounded refusal or a tiny valid run); never a traceback,
never a read that waits on a FIFO, never memory without a bound. And the commands that
need no JAX start without it."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
WALKER = HERE / "cli_walker.py"
PEAK_RSS = 2 << 30  # a walk holds one tiny probe or demo at a time


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    return env


def _commands():
    """Every subcommand ``kvxfer.cli.build_parser()`` registers (built without JAX)."""
    from cli_walker import subcommands

    return sorted(subcommands()[1])


def test_the_walk_reaches_every_command():
    assert {"inspect", "plan", "probe", "bench", "demo"} <= set(_commands())
    out = subprocess.run([sys.executable, str(WALKER), "--list", "."], capture_output=True,
                         text=True, timeout=120, env=_env(), check=True)
    assert json.loads(out.stdout) == _commands()


# Refusals that need JAX to decide (the devices it has, a mover's verdict on the
# arrays it built): every other exit 2 of the walk must come before JAX is imported.
NEEDS_JAX_TO_REFUSE = ("RESOURCE_EXHAUSTED", "device(s)", "devices present")
# Commands whose argument checks still wait for JAX (none: aot's come first too).
JAX_FIRST: set[str] = set()


def _named(value, line):
    """``value`` is in ``line`` as typed, or quoted (an empty value; one with a newline,
    which would split the line, shown escaped)."""
    return value in line if value and value.isprintable() else repr(value) in line


@pytest.mark.parametrize("command", _commands())
def test_every_option_takes_hostile_values_as_one_line_or_a_bounded_run(command, tmp_path):
    out = subprocess.run([sys.executable, str(WALKER), command, str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    cases = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(cases) >= 9, cases  # at least one option walked with every value
    bad = []
    for c in cases:
        err = c["stderr"].strip()
        if c["raised"] is not None:
            bad.append(f"{c['argv']}: raised {c['raised'].strip().splitlines()[-1]}")
        elif c["status"] not in (0, 1, 2):
            bad.append(f"{c['argv']}: exit {c['status']!r}")
        elif c["status"] == 2 and (len(err.splitlines()) != 1 or not _named(c["value"], err)
                                   or not err.startswith(f"kvxfer {command}")):
            bad.append(f"{c['argv']}: exit 2 with {err!r}")
        elif c["status"] == 2 and c["jax"] and command not in JAX_FIRST and not any(
                why in err for why in NEEDS_JAX_TO_REFUSE):
            # An argument error that waited for JAX's import (seconds on a busy machine).
            bad.append(f"{c['argv']}: refused only after importing JAX: {err!r}")
    assert bad == []
    assert max(c["peak_rss"] for c in cases) < PEAK_RSS
    # The values a user cannot mean are refused, not run (a directory name may be any
    # text); sizes that do not fit the machine are refused before anything is allocated.
    for c in cases:
        if c["value"] in ("99999999999999999999", "nan", "/dev/zero") and \
                c["option"] not in ("--out", "--store", "--layout"):
            assert c["status"] == 2, c
        if command in ("probe", "demo") and c["value"] == "100000000" and \
                c["option"] in ("--pages", "--num-blocks", "--device-blocks", "--host-blocks"):
            assert c["status"] == 2, c


def _imports_after(argv):
    """The modules ``kvxfer ARGV`` leaves imported (run in a fresh interpreter, with
    ``JAX_PLATFORMS`` unset as a user's shell has it: with libtpu installed, JAX would
    then try a TPU first)."""
    code = ("import sys, json; from kvxfer import cli\n"
            "try:\n    status = cli.main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    status = e.code\n"
            "print(json.dumps({'status': status, 'modules': sorted(sys.modules)}))")
    env = _env()
    env.pop("JAX_PLATFORMS", None)
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True,
                         text=True, timeout=120, env=env)
    return {**json.loads(out.stdout.splitlines()[-1]), "stderr": out.stderr}


@pytest.mark.parametrize("argv", [
    ["--help"], ["inspect", "--help"], ["probe", "--help"], ["demo", "--help"],
    ["bench", "--help"], ["plan", "--help"],
    ["inspect", "--shape", "512,3,2048", "--dtype", "bf16", "--layout",
     "{2,0,1:T(8,128)(2,1)}"],
    ["inspect", "--catalog", "seeds"], ["inspect", "--config", "gemma-mixed"],
    ["plan", "--config", "llama3-8b", "--budget", "64GiB"],
    ["plan", "--config", "tiny", "--devices", "2", "--json"],
])
def test_commands_that_need_no_jax_do_not_import_it(argv):
    got = _imports_after(argv)
    assert got["status"] == 0
    assert "jax" not in got["modules"], argv


@pytest.mark.parametrize("argv", [["--help"], ["probe", "--help"], ["aot", "--help"],
                                  ["bench", "--help"], ["demo", "--help"]])
def test_help_does_not_even_import_numpy(argv):
    modules = _imports_after(argv)["modules"]
    assert not {"numpy", "ml_dtypes"} & set(modules), argv


def test_a_refusal_after_jax_starts_is_still_one_line():
    """With libtpu installed (the tpu extra) and JAX_PLATFORMS unset, JAX on a machine
    with no TPU would try one first and libtpu would print its failure on stderr. The
    DMA mover's refusal of emulated TPU layouts comes from the manager, once JAX has
    built the caches."""
    env = _env()
    env.pop("JAX_PLATFORMS", None)
    # libtpu starts (and fails, and says so) every time, not only while no other
    # process on the machine holds its lock file.
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    out = subprocess.run([sys.executable, "-m", "kvxfer", "probe", "--config", "tiny",
                          "--path", "dma"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "kvxfer probe: error: path='dma' copies the arrays' own buffers; it cannot move "
        "emulated TPU layouts (layouts=): use path='raw' or 'auto'"]


@pytest.mark.parametrize("argv,says", [
    (["demo", "--inject", "store-bitflip"], "give --store DIR"),
    (["demo", "--device-blocks", "3"], "--device-blocks 3 is too few"),
    (["demo", "--scale", "256", "--host-blocks", "100000000"], "this demo needs"),
    (["demo", "--store", "redis://127.0.0.1:1"], "redis://127.0.0.1:1"),
    (["probe", "--config", "tiny", "--pages", "100000"], "--pages 100000"),
    (["probe", "--config", "tiny", "--inject", "one-shard"], "needs a sharded layer"),
    (["probe", "--config", "tiny", "--inject", "bitflip", "--integrity", "off"],
     "--integrity page"),
    (["bench", "--store", "/nonexistent/dir"], "'/nonexistent/dir' does not exist"),
    (["bench", "--only", "model"], "--model CONFIG"),
    (["bench", "--model", "no-such-config"], "no-such-config"),
])
def test_argument_errors_come_before_jax_is_imported(argv, says):
    """An argument error that needs no JAX is one line at once: JAX's import takes
    seconds on a busy machine (15 s was seen for ``demo --inject store-bitflip``)."""
    got = _imports_after(argv)
    assert got["status"] == 2, got["stderr"]
    assert says in got["stderr"] and len(got["stderr"].splitlines()) == 1, got["stderr"]
    assert "jax" not in got["modules"], argv


def test_sizes_take_units():
    from kvxfer import cli

    parser = cli.build_parser()
    assert parser.parse_args(["plan", "--config", "tiny", "--budget", "64GiB"]).budget == 64 << 30
    assert parser.parse_args(["plan", "--config", "tiny", "--budget", "1.5 MiB"]).budget == \
        3 << 19
    assert parser.parse_args(["plan", "--config", "tiny", "--budget", "2GB"]).budget == 2 * 10**9
