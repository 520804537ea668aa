"""Walks every option of one ``kvxfer`` subcommand with hostile values, in this process.

``python cli_walker.py COMMAND WORKDIR`` prints one JSON object per case: the argv, the
exit status, stderr, the traceback when ``kvxfer.cli.main`` raised, and whether the case
needed JAX. Options are enumerated from ``kvxfer.cli.build_parser()``, so an option
added later is walked too. The test (tests/test_cli_hostile.py) runs it under a timeout
and judges the cases.

Whether a case needs JAX is found in two passes: first every case runs with JAX's
import refused (an import hook raises ``NeedsJax``, a BaseException no error handler
catches, where ``import jax`` would start it); a case that ends there never imported
JAX. The cases that reached the hook run again, JAX allowed.
"""

import argparse
import contextlib
import importlib.abc
import io
import json
import os
import resource
import sys
import traceback

from kvxfer import cli

HUGE, BIG = "99999999999999999999", "100000000"


def hostile_values(workdir):
    fifo = os.path.join(workdir, "fifo")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    directory = os.path.join(workdir, "dir")
    os.makedirs(directory, exist_ok=True)
    return [HUGE, BIG, "-1", "nan", "ünïcødé", "", "two\nlines", fifo, directory,
            "/dev/zero"]


# What each command needs besides the walked option to run on a tiny scale (an option
# of a command not listed here is walked alone). The walked option replaces its own entry.
BASES = {
    "inspect": {"--shape": "8,128", "--dtype": "bf16"},
    "plan": {"--config": "tiny"},
    "probe": {"--config": "tiny", "--pages": "2", "--num-blocks": "4"},
    "bench": {"--targets": None},
    "aot": {"--target": "v6e", "--config": "tiny", "--max-layers": "1", "--pages": "1"},
    "demo": {"--requests": "1", "--system-pages": "1", "--new-tokens": "1",
             "--device-blocks": "4", "--host-blocks": "4", "--quiet": None},
}
# Options that exclude the base's (inspect takes one source of arrays).
ALONE = {("inspect", "--catalog"), ("inspect", "--config")}
# Options that act only beside others: walked with them, so each value reaches the
# code that uses it (a TPU compile, deviceless, where libtpu is installed).
WITH = {
    ("inspect", "--devices"): {"--target": "v6e", "--shape": "8,128", "--dtype": "bf16"},
    ("inspect", "--shard-dim"): {"--target": "v6e", "--shape": "8,128", "--dtype": "bf16",
                                 "--devices": "2"},
    ("inspect", "--num-blocks"): {"--target": "v6e", "--config": "tiny"},
    ("plan", "--devices"): {"--config": "tiny", "--target": "v6e"},
    ("plan", "--num-blocks"): {"--config": "tiny", "--target": "v6e"},
}


def subcommands():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub.choices


def options(parser):
    """``(option string, takes a value)`` of every option but ``--help``."""
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        yield action.option_strings[-1], action.nargs != 0


def cases(command, subparser, workdir):
    values = hostile_values(workdir)
    for option, takes_value in options(subparser):
        base = {} if (command, option) in ALONE else dict(
            WITH.get((command, option), BASES.get(command, {})))
        base.pop(option, None)
        argv = [command]
        for k, v in base.items():
            argv += [k] if v is None else [k, v]
        if not takes_value:
            yield option, HUGE, argv + [option, HUGE]
            continue
        for value in values:
            yield option, value, argv + [option, value]


class NeedsJax(BaseException):
    """Raised where a case would import JAX while the first pass refuses it."""


class _RefuseJax(importlib.abc.MetaPathFinder):
    """While ``refusing``, ``import jax`` (or jaxlib) raises ``NeedsJax``."""

    refusing = False

    def find_spec(self, name, path=None, target=None):
        if self.refusing and name.partition(".")[0] in ("jax", "jaxlib"):
            raise NeedsJax(name)
        return None


REFUSE_JAX = _RefuseJax()
sys.meta_path.insert(0, REFUSE_JAX)


def run(argv):
    """``(status, stderr, traceback or None, needs_jax)`` of ``kvxfer ARGV``."""
    out, err = io.StringIO(), io.StringIO()
    status, raised, needs_jax = None, None, False
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(argv)
        except SystemExit as e:  # --version
            status = e.code
        except NeedsJax:
            needs_jax = True
        except BaseException:  # noqa: BLE001  (a traceback is what the walk looks for)
            raised = traceback.format_exc()
    return status, err.getvalue(), raised, needs_jax


def peak_rss():
    """This process's peak resident memory in bytes. ``VmHWM`` is the high-water mark of
    this program's own memory: ``ru_maxrss`` would also count the memory of the parent
    it was forked from (Linux keeps the larger across ``execve``), a whole test
    session's when the suite starts the walker."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    command, workdir = sys.argv[1], sys.argv[2]
    _, commands = subcommands()
    if command == "--list":
        print(json.dumps(sorted(commands)))
        return
    os.chdir(workdir)
    assert "jax" not in sys.modules, "the walk starts without JAX"
    later = []
    REFUSE_JAX.refusing = True
    for case in cases(command, commands[command], workdir):
        status, err, raised, needs_jax = run(case[2])
        if needs_jax:
            later.append(case)
        else:
            report(case, status, err, raised, jax=False)
    REFUSE_JAX.refusing = False
    for case in later:
        status, err, raised, _ = run(case[2])
        report(case, status, err, raised, jax=True)


def report(case, status, err, raised, *, jax):
    option, value, argv = case
    print(json.dumps({"option": option, "value": value, "argv": argv, "status": status,
                      "stderr": err, "raised": raised, "jax": jax,
                      "peak_rss": peak_rss()}), flush=True)


if __name__ == "__main__":
    main()
