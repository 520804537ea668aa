"""Every transfer program kvxfer would run on a TPU, compiled without one.

``kvxfer aot --target v6e`` takes each model config, describes its caches as an
engine holds them on that TPU (``jax.ShapeDtypeStruct``s sharded over deviceless
devices of the target, in the compiler's default layouts: what an engine's arrays
get), plans them as ``KVCacheManager`` would, picks each slice class's mover as
``path="auto"`` does there (the Pallas kernels only where the compiler takes them),
and compiles every program that mover runs, for the transfer sizes asked: the
movers' own programs (``kvxfer.engine.transfer_programs``), never copies of them.

Each program is then checked (``kvxfer.engine.check_program``): no host compute (XLA
turns arithmetic on host memory into host compute; kvxfer's programs must only move
bytes there), the payload reaching host memory only by DMAs (Pallas kernels) or
``copy-start``/``copy-done``, and device memory staged beside its arguments within
``staging_bound``.

Example:
    >>> from kvxfer import aot
    >>> rows = aot.compile_config("tiny", "v6e")   # doctest: +SKIP
    >>> [(r.program, r.ok) for r in rows][:3]      # doctest: +SKIP
    [('digest', True), ('pallas_offload', True), ('pallas_load', True)]

(Skipped where libtpu is not installed; tests/test_aot.py runs it.)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Collection, Hashable
from typing import Any

from kvxfer import config as _config
from kvxfer import tpu
from kvxfer._check import check_int
from kvxfer._text import format_bytes
from kvxfer.engine import (ProgramCheck, abstract_layer, bucket, check_program,
                           transfer_programs)
from kvxfer.layout import dtype_of, short_dtype_name
from kvxfer.manager import choose_movers
from kvxfer.plan import LayerSpec, SliceClass, make_plan

__all__ = ["AotResult", "compile_config", "staging_bound"]

#: Device memory a program may stage beyond twice the pages it moves: digests, index
#: arrays and the compiler's own scratch.
STAGING_SLACK = 4 << 20

#: And for each layer of the class: XLA:TPU moves small arrays (a 16-block cache of
#: scales, say) through on-chip memory, which ``memory_analysis`` counts as staged;
#: measured at up to 250 KiB a layer, whatever the block count.
STAGING_PER_LAYER = 256 << 10


def staging_bound(cls: SliceClass, pages: int) -> int:
    """The device memory a transfer program of ``pages`` pages of ``cls`` may stage
    beside its arguments and outputs: twice the shard bytes it moves (a gathered copy
    of the pages, and one more for the compiler's copies around it), plus
    ``STAGING_SLACK`` and ``STAGING_PER_LAYER`` a layer. A program that copies a
    whole cache of an engine's size (thousands of blocks) for a few pages is over it.
    """
    layers = len(cls.layers)
    return 2 * pages * layers * cls.shard_block_bytes + STAGING_SLACK + \
        layers * STAGING_PER_LAYER


@dataclasses.dataclass(frozen=True)
class AotResult:
    """One program compiled for a target: what it is and what the compiler made of it.

    Attributes:
      config: the model config.
      target: the topology compiled for (``"v6e:2x2"``).
      devices: devices the caches are spread over.
      slice_class: the slice class the program moves (its name in the plan).
      layers: layers of the class.
      mover: the mover ``path="auto"`` picks for the class there, and ``reason``, why.
      program: the program's kind (``pallas_offload``, ``pages_load``, ``digest``, ...).
      dtype: the class's element type.
      pages: the transfer size (bucket) it serves.
      ok: it compiled, with no host compute and staging within ``staging_bound``.
      error: why not (None when ok).
      host_compute: instructions computing on host memory (empty when clean).
      host_transfers: operations moving bytes to or from host memory, by opcode.
      staging_bytes: device memory it stages (``memory_analysis().temp_size_in_bytes``).
      staging_bound: what it may stage (``staging_bound``).
      seconds: the compile's wall time.
    """

    config: str
    target: str
    devices: int
    slice_class: str
    layers: int
    mover: str
    reason: str
    program: str
    dtype: str
    pages: int
    ok: bool
    error: str | None
    host_compute: tuple[str, ...]
    host_transfers: dict[str, int]
    staging_bytes: int | None
    staging_bound: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` object."""
        out = dataclasses.asdict(self)
        out["host_compute"] = list(self.host_compute)
        out["libtpu"] = tpu.libtpu_version()
        return out

    def line(self) -> str:
        """One line: verdict, config, class, mover, program, size and staging."""
        staged = "-" if self.staging_bytes is None else format_bytes(self.staging_bytes)
        verdict = "ok  " if self.ok else "FAIL"
        text = (f"{verdict} {self.config} {self.target} x{self.devices} {self.slice_class} "
                f"({self.layers} layers, {self.dtype}) {self.mover} {self.program} "
                f"pages={self.pages} staging={staged} {self.seconds:.2f}s")
        return text if self.ok else f"{text}: {self.error}"


# Compiled programs' checks (or errors) by program key, for up to ``_DONE_SIZE``
# programs: configs that share shapes, and buckets that share a program, compile once.
_DONE: dict[Hashable, tuple[ProgramCheck | None, str | None, float]] = {}
_DONE_SIZE = 4096
_DONE_LOCK = threading.Lock()


def _compile(key: Hashable, job: Any) -> tuple[ProgramCheck | None, str | None, float]:
    with _DONE_LOCK:
        if key in _DONE:
            return _DONE[key]
    start = time.perf_counter()
    try:
        result: tuple[ProgramCheck | None, str | None, float] = (check_program(job()), None, 0.0)
    except Exception as e:  # noqa: BLE001 - XLA's errors carry no common type
        text = str(e).strip().splitlines()
        result = (None, text[0] if text else type(e).__name__, 0.0)
    result = (result[0], result[1], time.perf_counter() - start)
    with _DONE_LOCK:
        if len(_DONE) >= _DONE_SIZE:
            _DONE.clear()
        _DONE[key] = result
    return result


def _caches(spec: _config.ModelSpec, target: str, num_devices: int, num_blocks: int | None,
            max_layers: int | None = None) -> tuple[list[Any], list[LayerSpec]]:
    """Abstract caches of the config on ``target`` (default layouts), and their specs
    with the compiler's layout of each shard; with ``max_layers``, the first layers of
    each layer group only."""
    import jax

    devices = tpu.target_devices(target, num_devices)
    keep, first = [], 0
    for g in spec.groups:
        keep += range(first, first + min(g.count, max_layers or g.count))
        first += g.count
    layer_specs = spec.layer_specs(num_blocks, num_devices, emulate_tpu=False)
    shardings = spec.shardings(devices)
    caches, specs = [], []
    for ls, sharding in ((layer_specs[i], shardings[i]) for i in keep):
        shard_dim = None
        if ls.num_shards > 1:
            shard_dim = next(d for d, (a, b) in enumerate(zip(ls.shape, ls.shard_shape))
                             if a != b)
        compiled = tpu.compiled_layout(ls.shape, ls.dtype, target, num_devices=num_devices,
                                       shard_dim=shard_dim)
        caches.append(jax.ShapeDtypeStruct(ls.shape, dtype_of(ls.dtype), sharding=sharding))
        specs.append(dataclasses.replace(ls, layout=compiled.layout))
    return caches, specs


def compile_config(config: str, target: str, num_devices: int = 1, *,
                   num_blocks: int | None = None, pages: int = 1,
                   max_layers: int | None = None,
                   programs: Collection[str] | None = None) -> list[AotResult]:
    """Compiles every transfer program of ``config`` on ``num_devices`` of ``target``.

    Args:
      config: a builtin config name or a TOML file.
      target: a TPU generation (``"v6e"``) or topology (``"v6e:2x4"``).
      num_devices: devices the caches are spread over (sharded as the config shards).
      num_blocks: device blocks per layer (default: the config's).
      pages: compile for transfers of up to this many pages (every bucket up to it,
        as ``KVCacheManager.warmup(pages)`` does).
      max_layers: keep only the first ``max_layers`` layers of each layer group (a
        quicker check: the programs of a class differ only in how many layers they
        repeat; None: every layer).
      programs: compile only programs of these kinds (``AotResult.program``; None:
        every one).

    Returns:
      One ``AotResult`` per program, class by class.

    Raises:
      CompilerUnavailableError: libtpu is not installed.
      ValueError: an unknown config or target, or too many devices.
    """
    spec = _config.load(config)
    # Other processes may hold libtpu's lockfile; deviceless compiles open no chip.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    num_devices = check_int(num_devices, "num_devices", minimum=1)
    pages = check_int(pages, "pages", minimum=1)
    name = tpu.topology(target, num_devices)
    if max_layers is not None:
        max_layers = check_int(max_layers, "max_layers", minimum=1)
    caches, specs = _caches(spec, name, num_devices, num_blocks, max_layers)
    plan = make_plan(specs, spec.num_host_blocks, path="staged")
    buckets = [1 << i for i in range(bucket(pages).bit_length())]
    work = []
    for cls, (mover, reason) in zip(plan.classes,
                                    choose_movers(plan, specs, caches, "auto", False)):
        layers = [abstract_layer(caches[i]) for i in cls.layers]
        work += [(cls, mover, reason, job) for job in transfer_programs(mover, cls, layers,
                                                                         buckets)
                 if programs is None or job.name in programs]
    # XLA compiles with the GIL released: the programs compile side by side.
    workers = max(1, min(len(work), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers, "kvxfer-aot") as pool:
        compiled = list(pool.map(lambda w: _compile(w[3].key, w[3].compile), work))
    out = []
    for (cls, mover, reason, job), (check, error, seconds) in zip(work, compiled):
        bound = staging_bound(cls, job.bucket)
        if check is not None and error is None:
            if check.host_compute:
                error = f"host compute: {', '.join(check.host_compute[:3])}"
            elif check.staging_bytes > bound:
                error = (f"stages {format_bytes(check.staging_bytes)} of device memory, "
                         f"over its bound of {format_bytes(bound)}")
        out.append(AotResult(
            spec.name, name, num_devices, cls.name, len(cls.layers), mover.name, reason,
            job.name, short_dtype_name(cls.dtype), job.bucket, error is None, error,
            check.host_compute if check else (), check.host_transfers if check else {},
            check.staging_bytes if check else None, bound, seconds))
    return out


def _cmd_aot(args: argparse.Namespace) -> int:
    try:
        tpu.require_compiler()
    except tpu.CompilerUnavailableError as e:
        print(f"kvxfer aot: {e}", file=sys.stderr)
        return 2
    configs = args.config or _config.builtin_names()
    failed = 0
    for name in configs:
        for r in compile_config(name, args.target, args.devices, num_blocks=args.num_blocks,
                                pages=args.pages, max_layers=args.max_layers):
            failed += not r.ok
            print(json.dumps(r.as_dict()) if args.json else r.line(), flush=True)
    return 1 if failed else 0
