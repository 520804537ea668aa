"""The ``kvxfer`` command line: inspect | plan | probe | bench | demo | aot.

Every command has ``--json``. Bad input exits 2 with one line on stderr; a valid
array that is not addressable is a verdict, not an error (exit 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from kvxfer import _cli_layouts, _interrupt
from kvxfer import _resources
from kvxfer._check import bounded_int, byte_size, path_name, positive_int
from kvxfer._requires import JaxVersionError
from kvxfer._text import format_bytes, table
from kvxfer._version import __version__

if TYPE_CHECKING:
    from kvxfer.layout import SliceGeometry

__all__ = ["main", "main_entry", "build_parser", "UsageError"]


class UsageError(Exception):
    """Bad input on the command line: reported on one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, like every other error.

    A value that starts with ``-`` and a digit (``--shape -5,3``, ``--seed -1``) is
    a value, so the option's own check names it, never "expected one argument".
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-[\d.,\[]|^-(nan|inf)", re.IGNORECASE)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.replace("[", "").replace("]", "").split(",")
                      if s.strip())
    except ValueError:
        raise UsageError(f"--shape {text!r} must be comma-separated integers, "
                         "e.g. 512,3,2048") from None
    if not shape or any(d < 0 for d in shape):
        raise UsageError(f"--shape {text!r} must list one or more non-negative sizes")
    return shape


def _geometry_row(g: SliceGeometry) -> list[Any]:
    return [g.text, g.block_dim, format_bytes(g.physical_bytes),
            format_bytes(g.bytes_per_block), g.granularity, f"{g.padding_factor:.2f}",
            "addressable" if g.addressable else "NOT addressable"]


_GEOMETRY_HEADER = ["array", "block_dim", "physical", "bytes/block", "granularity",
                    "padding", "verdict"]


def _cmd_inspect(args: argparse.Namespace) -> int:
    sources = [args.catalog is not None, args.shape is not None, args.config is not None]
    if sum(sources) != 1:
        raise UsageError("give exactly one of --shape (with --dtype and --layout), "
                         "--catalog NAME|FILE or --config NAME|FILE")
    # What a command needs is imported when it runs: ``kvxfer --help`` starts without
    # numpy (the layout module's).
    if args.shape is not None:
        if args.dtype is None:
            raise UsageError("--dtype is required with --shape")
        return _cli_layouts.inspect_shape(args, _geometry_row, _GEOMETRY_HEADER,
                                          _parse_shape(args.shape))
    if args.config is not None:
        return _cli_layouts.inspect_config(args, _geometry_row, _GEOMETRY_HEADER)
    return _cli_layouts.inspect_catalog(args, _geometry_row, _GEOMETRY_HEADER)


def _builtins(kind: _resources.Kind) -> str:
    """The built-in names of ``kind``, for an option's help."""
    return ", ".join(_resources.builtin_names(kind))


def build_parser() -> argparse.ArgumentParser:
    """The ``kvxfer`` argument parser, every command registered."""
    parser = _Parser(
        prog="kvxfer",
        description="Verified KV-cache transfers between accelerator and host memory.")
    parser.add_argument("--version", action="version", version=f"kvxfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("inspect", help="prove whether KV blocks are contiguous byte ranges",
                       description="Reads an XLA layout and reports, per array, whether "
                       "each block (one index of the block dim) is one contiguous byte "
                       "range, the bytes per block and the granularity.")
    p.add_argument("--shape", help="logical shape, e.g. 512,3,2048")
    p.add_argument("--dtype", help="e.g. bfloat16, bf16, int8, float8_e4m3fn, int4")
    p.add_argument("--layout", help="XLA layout text, e.g. '{2,0,1:T(8,128)(2,1)}' "
                   "(default row-major)")
    p.add_argument("--block-dim", type=bounded_int(0, 63), default=0,
                   help="the block dim (default 0)")
    p.add_argument("--catalog", type=_resources.argument("layouts"),
                   help="a built-in catalogue name or a JSON file: check every entry's "
                   f"verdict (built in: {_builtins('layouts')})")
    p.add_argument("--config", type=_resources.argument("configs"),
                   help="a built-in config name or a TOML file: inspect every layer's "
                   f"cache, one row per slice class (built in: {_builtins('configs')})")
    _cli_layouts.add_source_arguments(p, inspect=True)
    p.add_argument("--json", action="store_true", help="one JSON object per array")
    p.set_defaults(func=_cmd_inspect)

    for register in _extra_commands():
        register(sub)
    return parser


def _cmd_plan(args: argparse.Namespace) -> int:
    from kvxfer import config as _config
    from kvxfer.plan import BudgetError, make_plan

    spec = _config.load(args.config)
    layers, lines, source = _cli_layouts.plan_layers(spec, args)
    hosts = spec.num_host_blocks if args.num_host_blocks is None else args.num_host_blocks
    try:
        plan = make_plan(layers, hosts, path=args.path, host_memory_budget=args.budget)
    except BudgetError as e:
        if args.json:
            print(json.dumps({"config": spec.name, "refused": True, "error": str(e)}))
        print(f"kvxfer plan: refused: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"config": spec.name, "refused": False, **plan.as_dict(),
                          **source}))
    else:
        print(f"{spec.name}: {spec.description}")
        print(plan)
        for line in lines:
            print(line)
    return 0


def _register_plan(sub: Any) -> None:
    from typing import get_args

    from kvxfer._names import PlanPath

    p = sub.add_parser("plan", help="host-memory plan of a model's KV caches, per slice class",
                       description="Groups a model's layers into slice classes, sizes each "
                       "class's host pool on its own and checks the total against the "
                       "host-memory budget, before anything is allocated.")
    p.add_argument("--config", required=True, type=_resources.argument("configs"),
                   help=f"a built-in config name or a TOML file (built in: "
                   f"{_builtins('configs')})")
    p.add_argument("--num-host-blocks", type=positive_int,
                   help="host pages (default: the config's)")
    p.add_argument("--num-blocks", type=positive_int,
                   help="device blocks per layer (default: config)")
    p.add_argument("--path", type=path_name, choices=list(get_args(PlanPath)),
                   default="staged",
                   help="staged stores dense blocks; raw stores the device bytes a raw "
                   "copy moves (whole granularity groups when not addressable); auto: "
                   "device bytes where addressable, else dense blocks")
    p.add_argument("--budget", type=byte_size, help="host-memory budget: bytes or a size "
                   "with a unit: 64GiB or 64G (binary, as -Xmx and docker read 64g), 64GB "
                   "(decimal); the plan prints it in bytes (default: half of the "
                   "available host memory)")
    p.add_argument("--devices", type=bounded_int(1, 4096), default=1,
                   help="shard KV heads over N devices (at most 4096)")
    p.add_argument("--no-tpu-layouts", action="store_true",
                   help="plan with row-major layouts instead of the emulated TPU ones")
    _cli_layouts.add_source_arguments(p, inspect=False)
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=_cmd_plan)


def _extra_commands() -> list[Callable[[Any], None]]:
    """The register functions of the commands after ``inspect``, in ``--help`` order.

    Each lives in a module that imports no JAX (nor what imports it): ``kvxfer --help``,
    ``inspect`` and ``plan`` start without it (tests/test_cli_hostile.py checks), and a
    command imports what it runs when it runs. A new option is walked with hostile
    values by that test too; give it a ``type=`` that names a bad value.
    """
    from kvxfer import _aot_cli, _probe_cli, bench, demo

    return [_register_plan, _probe_cli.register_cli, bench.register_cli, demo.register_cli,
            _aot_cli.register_cli]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status.

    Bad input (a usage error, a bad value, an unreadable or unknown file) is one line
    on stderr and status 2; anything else is a bug and raises. No arguments at all
    print the help (status 0), as ``--help`` does.
    """
    try:
        parser = build_parser()
        if not (sys.argv[1:] if argv is None else list(argv)):
            # A bare ``kvxfer`` asks what there is, as ``kvxfer --help`` does: the help
            # on stdout and exit 0. Nothing was asked that could fail, and bad input
            # keeps its one line on stderr and exit 2.
            print(parser.format_help(), end="")
            return 0
        args = parser.parse_args(argv)
    except UsageError as e:
        command = next((a for a in (argv if argv is not None else sys.argv[1:])
                        if not a.startswith("-")), None)
        # One line, however the value was typed: a newline in it is shown escaped.
        message = str(e).replace("\r", "\\r").replace("\n", "\\n")
        print(f"kvxfer{' ' + command if command else ''}: error: {message}", file=sys.stderr)
        return 2
    # What JAX reads as it starts is set for this call only: an in-process caller's
    # environment is its own again when the command returns (JAX, once started, keeps
    # what it read).
    saved = {k: os.environ.get(k) for k in _JAX_ENVIRONMENT}
    try:
        _cpu_where_no_accelerator()
        devices = getattr(args, "devices", None)
        if isinstance(devices, int) and devices > 1:
            _ask_for_cpu_devices(devices)
        # A long command (one that names its Ctrl-C line) stops at its next safe point
        # on the first Ctrl-C, never inside a compile; a second exits at once.
        on_interrupt = getattr(args, "on_interrupt", None)
        with _interrupt.deferred(on_interrupt(args)) if on_interrupt else \
                contextlib.nullcontext():
            return _run(args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: The variables ``main`` may set before JAX starts (and restores after the command).
_JAX_ENVIRONMENT = ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")


def _run(args: argparse.Namespace) -> int:
    """Runs the parsed command; returns its exit status (bad input: one line, 2)."""
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()
        # A Ctrl-C after the last safe point: the command finished, and says it was
        # asked to stop as a stopped one does.
        return _interrupt.EXIT_STATUS if _interrupt.interrupted() else status
    except _interrupt.Interrupted:
        sys.stdout.flush()
        return _interrupt.EXIT_STATUS
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly; further output goes nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (UsageError, ValueError, OSError, TimeoutError, MemoryError,
            RecursionError, JaxVersionError) as e:  # a LayoutError is a ValueError
        return _one_line(args.command, e)
    except RuntimeError as e:
        # No TPU compiler here (kvxfer.tpu's error: that module is loaded when one is
        # raised), or the accelerator ran out of memory: an outcome of the sizes asked
        # for. Any other RuntimeError is a bug.
        tpu = sys.modules.get("kvxfer.tpu")
        if not (tpu is not None and isinstance(e, tpu.CompilerUnavailableError)
                or "RESOURCE_EXHAUSTED" in str(e).split(":", 1)[0]):
            raise
        return _one_line(args.command, e)


def _one_line(command: str, e: BaseException) -> int:
    """Reports ``e`` on one line of stderr; returns the exit status, 2."""
    if isinstance(e, RecursionError):
        message = "input nested too deeply"
    else:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, MemoryError) and type(e).__name__ == "MemoryError":
        message = f"out of host memory ({message})"
    print(f"kvxfer {command}: error: {message}", file=sys.stderr)
    return 2


def _cpu_where_no_accelerator() -> None:
    """Before JAX starts, on a machine with no TPU and no GPU, and unless the user says
    otherwise (``JAX_PLATFORMS``): JAX on the CPU. With libtpu installed (the ``tpu``
    extra, for deviceless compiles) JAX would try a TPU first, and libtpu prints lines
    of its failure to start on stderr around the command's own one line."""
    if "jax" in sys.modules or "JAX_PLATFORMS" in os.environ:
        return
    import glob

    pci = glob.glob("/sys/bus/pci/devices/*/vendor")
    if not pci or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or any(
            os.path.exists(d) for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg",
                                        "/dev/kfd")):
        return  # an accelerator, or no way to tell: JAX's own choice
    for path in pci:
        try:
            with open(path, encoding="ascii") as f:
                if f.read().strip() == "0x1ae0":  # Google's PCI vendor id: a TPU chip
                    return
        except OSError:
            return
    os.environ["JAX_PLATFORMS"] = "cpu"


def _ask_for_cpu_devices(devices: int) -> None:
    """On the CPU backend several devices exist only if asked for before JAX starts.
    Before then the request goes in the environment, so a command that never needs
    JAX (``plan``) does not start it; once JAX has started (an in-process caller), the
    devices it has are what count."""
    if "jax" not in sys.modules:
        os.environ["JAX_NUM_CPU_DEVICES"] = str(devices)
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError:
        pass


def main_entry() -> None:
    """Console-script entry point.

    Outside a long command's safe points (a quick command, the start, the shutdown
    after a command stopped), Ctrl-C exits at once with status 130, never with a
    KeyboardInterrupt traceback or one raised inside a compile."""
    signal.signal(signal.SIGINT, lambda signum, frame: _interrupt.exit_now())
    status = main()
    # The command is over: a Ctrl-C while the interpreter shuts down would meet the
    # default handler Python restores late in its shutdown and kill the process by
    # SIGINT instead of exiting with the status (130 after a stop). Ignored, then.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(status)


if __name__ == "__main__":
    main_entry()
