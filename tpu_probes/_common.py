"""Helpers shared by the probes in ``tpu_probes/`` (not part of the kvxfer package).

The probes run as scripts (``python tpu_probes/<script>.py``), so this module is
imported as a sibling. It makes ``kvxfer`` importable from a plain checkout (an
installed kvxfer comes first, and finds its configs and catalogues by name), and
holds what more than one probe needs: backend provenance, placing an array with a
requested layout, reading raw XLA:CPU buffer bytes, tables and JSON.
"""

from __future__ import annotations

import datetime
import json
import logging as _py_logging
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

#: The repository root (the folder holding ``tpu_probes/``, ``configs/``, ``layouts/``).
REPO_ROOT = Path(__file__).resolve().parent.parent
#: Where a capture is written, to be contributed as a catalogue of the repository.
LAYOUTS_DIR = REPO_ROOT / "layouts"

try:  # an installed kvxfer (pip install . / a wheel) comes first
    import kvxfer  # noqa: F401
except ImportError:  # a plain checkout: use the package next to this folder
    sys.path.insert(0, str(REPO_ROOT))
    import kvxfer  # noqa: F401

import jax  # noqa: E402

from kvxfer import Layout  # noqa: E402
from kvxfer import _text  # noqa: E402
from kvxfer import testing  # noqa: E402
from kvxfer.layout import dtype_of  # noqa: E402

SUB_BYTE_DTYPES = ("int4", "uint4", "int2", "uint2", "float4_e2m1fn")


# ---------------------------------------------------------------------------
# Running a probe
# ---------------------------------------------------------------------------


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing for ``app.run(main, flags_parser=parse_flags)``.

    A bad flag or a stray argument exits 2 (a probe's 1 means a failed check).
    """
    from absl import flags

    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        print(f"{Path(argv[0]).name}: {e}\nPass --help for usage.", file=sys.stderr)
        sys.exit(2)
    if len(rest) > 1:
        print(f"{Path(argv[0]).name}: unexpected arguments: {' '.join(rest[1:])}\n"
              "Pass --help for usage.", file=sys.stderr)
        sys.exit(2)
    return rest


# "Unable to initialize backend 'tpu'" and the like are not the probes' news.
_py_logging.getLogger("jax._src.xla_bridge").setLevel(_py_logging.WARNING)


# ---------------------------------------------------------------------------
# Backend and provenance
# ---------------------------------------------------------------------------


def chosen_methods(probe: str, given: list[str], known: tuple[str, ...]) -> list[str] | None:
    """The ``--methods`` a probe was given, stripped; None (after saying why on stderr)
    when one is unknown or none is left."""
    methods = [m.strip() for m in given if m.strip()]
    bad = [m for m in methods if m not in known]
    if bad or not methods:
        print(f"{probe}: --methods {','.join(bad) or '(empty)'}: choose from "
              f"{', '.join(known)}", file=sys.stderr)
        return None
    return methods


def device() -> Any:
    """The device the probes use: the first device of the default backend."""
    return jax.devices()[0]


def sanitize(text: str) -> str:
    """``"TPU v5 lite"`` -> ``"tpu_v5_lite"`` (lower case, [a-z0-9_] only)."""
    return re.sub(r"_+", "_", re.sub(r"[^a-z0-9]+", "_", text.lower())).strip("_") or "unknown"


def backend_tag(dev: Any | None = None) -> str:
    """``cpu``, ``tpu_v5_lite``, ``gpu_nvidia_h200``: backend plus device kind, once.

    The device kind is dropped when it only repeats the backend (``cpu``), and it
    stands alone when it already starts with the backend's name (``TPU v5 lite`` ->
    ``tpu_v5_lite``, ``TPU7x`` -> ``tpu7x``).
    """
    dev = dev or device()
    backend = sanitize(dev.platform)
    kind = sanitize(getattr(dev, "device_kind", "") or "")
    if kind in ("", "unknown", backend):
        return backend
    if kind.startswith(backend):
        return kind
    return f"{backend}_{kind}"


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """Where and how a result was produced."""
    import jaxlib

    dev = device()
    try:
        import importlib.metadata as md

        jaxlib_version = md.version("jaxlib")
    except Exception:  # noqa: BLE001 - an unusual install: fall back to the module
        jaxlib_version = getattr(jaxlib, "__version__", "unknown")
    argv = list(sys.argv if argv is None else argv)
    return {
        "backend": dev.platform,
        "device_kind": getattr(dev, "device_kind", ""),
        "num_devices": jax.device_count(),
        "platform_version": str(getattr(dev.client, "platform_version", "")).strip(),
        "jax": jax.__version__,
        "jaxlib": jaxlib_version,
        "kvxfer": getattr(kvxfer, "__version__", "unknown"),
        "python": platform.python_version(),
        "host": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *argv]),
    }


# ---------------------------------------------------------------------------
# Configs and catalogues
# ---------------------------------------------------------------------------


def load_config(name: str):
    """A model config by built-in name or TOML path (kvxfer finds built-ins anywhere)."""
    from kvxfer import config as _config

    return _config.load(name)


def config_names() -> list[str]:
    """Every built-in config."""
    from kvxfer import config as _config

    return _config.builtin_names()


def split_names(values: list[str] | None) -> list[str]:
    """Flag values that may repeat and may hold comma lists: ``["a,b", "c"]``."""
    out: list[str] = []
    for v in values or []:
        out.extend(s.strip() for s in v.split(",") if s.strip())
    return out


# ---------------------------------------------------------------------------
# Arrays
# ---------------------------------------------------------------------------


def is_sub_byte(dtype: Any) -> bool:
    return dtype_of(dtype).name in SUB_BYTE_DTYPES


# Random raw bits and bit comparisons are kvxfer.testing's (one helper, one place).
random_array = testing.random_bits
bits = testing.bits


def to_jax_layout(layout: Layout):
    """A kvxfer ``Layout`` as JAX's ``jax.experimental.layout.Layout``."""
    from jax.experimental.layout import Layout as JaxLayout

    kwargs: dict[str, Any] = {"major_to_minor": tuple(reversed(layout.minor_to_major))}
    if layout.tiles:
        kwargs["tiling"] = tuple(tuple(t) for t in layout.tiles)
    if layout.element_size_bits:
        kwargs["sub_byte_element_size_in_bits"] = layout.element_size_bits
    return JaxLayout(**kwargs)


def put_with_layout(x: np.ndarray, layout: Layout | None, sharding: Any
                    ) -> tuple[jax.Array, str]:
    """``x`` on the device with ``layout`` where the backend accepts it.

    Returns:
      ``(array, note)``; the note is empty when the layout was accepted, else it
      says what the backend refused (the array then has the default layout).
    """
    from jax.experimental.layout import Format

    if layout is None:
        return jax.device_put(x, sharding).block_until_ready(), ""
    try:
        a = jax.device_put(x, Format(to_jax_layout(layout), sharding))
        a.block_until_ready()
        return a, ""
    except Exception as e:  # noqa: BLE001 - any refusal means: use the default
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        a = jax.device_put(x, sharding).block_until_ready()
        return a, (f"the backend refused {layout} ({type(e).__name__}: {first[:200]}); "
                   f"placed with its default layout {Layout.of(a)}")


def untiled(layout: Layout) -> Layout:
    """The same dim order and element size, without tiles or memory space."""
    return Layout(layout.minor_to_major, (), layout.element_size_bits)


def cpu_buffer_bytes(a: jax.Array, nbytes: int) -> np.ndarray:
    """A copy of the first ``nbytes`` of an XLA:CPU array's buffer (one device)."""
    import ctypes

    a.block_until_ready()
    raw = (ctypes.c_uint8 * nbytes).from_address(a.unsafe_buffer_pointer())
    return np.ctypeslib.as_array(raw).copy()


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


# The same helpers the kvxfer command line prints with.
format_bytes = _text.format_bytes
table = _text.table


def _default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, (Path, Layout)):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def dumps(obj: Any, indent: int | None = 1) -> str:
    return json.dumps(obj, indent=indent, default=_default)


def verdict_text(g: Any) -> str:
    """``addressable (32 KiB/block)`` or ``NOT addressable (g=8)``."""
    if g.addressable:
        return f"addressable ({format_bytes(g.bytes_per_block)}/block)"
    return f"NOT addressable (g={g.granularity})"


def show(report: dict[str, Any], as_json: bool, print_table: Any) -> None:
    """Prints a probe's report: one JSON line, or its table."""
    if as_json:
        print(dumps(report, indent=None))
    else:
        print_table(report)


# ---------------------------------------------------------------------------
# Timing a manager
# ---------------------------------------------------------------------------


def round_trips(mgr: Any, caches: list[jax.Array], pages: int,
                iters: int, warmup: int, rng: np.random.Generator, check: bool
                ) -> tuple[list[jax.Array], dict[str, Any]]:
    """Median offload / load / per-layer ready seconds of ``pages`` random blocks.

    With ``check``, the first round trip is compared bit for bit with the blocks as
    they were before it.

    Raises:
      RuntimeError: a load verified fewer pages than it moved, or moved wrong bytes.
    """
    n = caches[0].shape[0]
    offload, load, ready = [], [], []
    for it in range(warmup + iters):
        src = rng.permutation(n)[:pages]
        dst = rng.permutation(n)[:pages]
        keys = [int(k) for k in rng.integers(0, 2**63, pages)]
        before = [testing.bits(c) for c in caches] if check and it == 0 else None
        jax.block_until_ready(caches)
        t0 = time.perf_counter()
        refs = mgr.offload(caches, src, keys).wait()
        t1 = time.perf_counter()
        caches, handle = mgr.load(caches, refs, dst, gate="layer")
        when = []
        for i in range(len(caches)):
            handle.layer_ready(i)
            when.append(time.perf_counter() - t1)
        result = handle.result()
        jax.block_until_ready(caches)
        t2 = time.perf_counter()
        if result.verified_prefix != pages:
            raise RuntimeError(f"load verified {result.verified_prefix} of {pages} pages: "
                               f"{result.reasons}")
        if before is not None:
            for i, (c, b) in enumerate(zip(caches, before)):
                if not np.array_equal(testing.bits(c)[dst], b[src]):
                    raise RuntimeError(f"layer {i}: the loaded blocks differ from the "
                                       "offloaded ones")
        mgr.free(refs)
        if it >= warmup:
            offload.append(t1 - t0)
            load.append(t2 - t1)
            ready.append(when)
    return caches, {"offload_s": statistics.median(offload),
                    "load_s": statistics.median(load),
                    "ready_s": [statistics.median(r[i] for r in ready)
                                for i in range(len(caches))]}
