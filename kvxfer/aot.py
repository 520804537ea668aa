"""Every transfer program kvxfer would run on a TPU, compiled without one.

``kvxfer aot --target v6e`` takes each model config, describes its caches as an
engine holds them on that TPU (``jax.ShapeDtypeStruct``s sharded over deviceless
devices of the target, in the compiler's default layouts: what an engine's arrays
get), at an engine's block count (the most blocks a chip's HBM holds for the config,
``engine_blocks``, unless told), plans them as ``KVCacheManager`` would, picks each
slice class's mover as ``path="auto"`` does there, and compiles every program that
mover runs, for every page bucket up to the transfer size asked: the movers' own
programs (``kvxfer.engine.transfer_programs``), never copies of them.

Each program is then checked (``kvxfer.engine.check_program``): no host compute (XLA
turns arithmetic on host memory into host compute; kvxfer's programs must only move
bytes there), how many DMAs it starts a page (``dynamic-(update-)slice-start`` on
``S(5)``: one a page for the in-place route), whether a program that writes the host
pool updates it in place (``host_pool == "aliased"``: a pool that is not aliased would
be copied whole through device memory), and device memory staged beside its arguments
within ``staging_bound``.

``compile_config`` compiles in the calling process (libtpu is loaded there); the
command line runs it in a worker process (``kvxfer._worker.Worker``), so ``kvxfer aot``
never loads libtpu itself, and a compile that aborts ends only the worker.

Example:
    >>> from kvxfer import aot
    >>> rows = aot.compile_config("tiny", "v6e", pages=2)   # doctest: +SKIP
    >>> [(r.program, r.page_dmas, r.host_pool) for r in rows][:2]   # doctest: +SKIP
    [('pinned_write+digest', 1.0, 'aliased'), ('pinned_load+digest', 1.0, 'read')]

(Skipped where libtpu is not installed; tests/test_aot.py runs it.)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import sys
import textwrap
import threading
import time
from collections.abc import Collection, Hashable
from typing import Any

from kvxfer import config as _config
from kvxfer import tpu
from kvxfer._check import check_int
from kvxfer._text import format_bytes
from kvxfer._worker import WorkerDied
from kvxfer.engine import (ProgramCheck, abstract_layer, bucket, check_program,
                           transfer_programs)
from kvxfer.layout import dtype_of, short_dtype_name
from kvxfer.layout_source import Compiler, config_layer_specs
from kvxfer.manager import choose_movers
from kvxfer.plan import LayerSpec, SliceClass, make_plan

__all__ = ["AotResult", "compile_config", "staging_bound", "engine_blocks", "HBM_BYTES",
           "summary"]

#: HBM of one device (what ``jax.devices()`` lists: a TensorCore of v4 and tpu7x, a
#: chip of v5e, v5p and v6e), by generation.
HBM_BYTES: dict[str, int] = {"v4": 16 << 30, "v5e": 16 << 30, "v5p": 95 << 30,
                             "v6e": 32 << 30, "tpu7x": 96 << 30}

#: The share of a device's HBM an engine gives its KV caches at most (the rest holds
#: weights and activations; vLLM's default memory utilization is 0.9 of it all).
KV_SHARE = 0.9

#: Transfers are compiled for up to this many pages by default (every bucket).
DEFAULT_PAGES = 64

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
      num_blocks: device blocks per layer the caches were compiled with.
      page_dmas: DMAs it starts a page to or from host memory (None: none).
      host_pool: what it does with host memory (``ProgramCheck.host_pool``).
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
    num_blocks: int = 0
    page_dmas: float | None = None
    host_pool: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` object."""
        out = dataclasses.asdict(self)
        out["host_compute"] = list(self.host_compute)
        out["libtpu"] = tpu.libtpu_version()
        return out

    def line(self) -> str:
        """One line of at most 100 columns (the error on lines of its own): verdict,
        program, bucket, DMAs a page, what it does with the host pool, staging against
        its bound, compile time. The config, target and class head their group
        (``header``)."""
        verdict = "ok  " if self.ok else "FAIL"
        dmas = "-" if self.page_dmas is None else f"{self.page_dmas:g}"
        text = (f"  {verdict} {self.program:<22.22} p={self.pages:<5} dma/p={dmas:<4} "
                f"host={self.host_pool or '-':<7} staged {format_bytes(self.staging_bytes)}"
                f" of {format_bytes(self.staging_bound)} {self.seconds:.1f}s")
        if self.ok:
            return text[:100]
        return text[:100] + "\n" + textwrap.fill(str(self.error), 100, initial_indent="       ",
                                                 subsequent_indent="       ")

    def header(self) -> str:
        """The lines heading a class's programs: config, target, blocks, class, mover
        and why (wrapped at 100 columns)."""
        head = (f"{self.config} on {self.target} x{self.devices}, {self.num_blocks} blocks: "
                f"{self.slice_class} ({self.layers} layers) {self.mover}: {self.reason}")
        return textwrap.fill(head, 100, subsequent_indent="    ")


def summary(rows: list[AotResult]) -> str:
    """The closing line: programs compiled, failed, host compute, DMAs a page.

    Example:
        >>> summary([])
        'aot: 0 programs'
    """
    if not rows:
        return "aot: 0 programs"
    failed = sum(not r.ok for r in rows)
    host = sum(len(r.host_compute) for r in rows)
    dmas = sorted({r.page_dmas for r in rows if r.page_dmas is not None})
    movers = sorted({r.mover for r in rows})
    configs = len({r.config for r in rows})
    return (f"aot: {len(rows)} programs of {configs} configs on {rows[0].target.split(':')[0]}"
            f" ({', '.join(movers)}): {len(rows) - failed} ok, {failed} failed; host compute "
            f"{host}; dma/page {'/'.join(f'{d:g}' for d in dmas) or '-'}")[:100]


# Compiled programs' checks (or errors) by program key, for up to ``_DONE_SIZE``
# programs: configs that share shapes, and buckets that share a program, compile once.
_DONE: dict[Hashable, tuple[ProgramCheck | None, str | None, float]] = {}
_DONE_SIZE = 4096
_DONE_LOCK = threading.Lock()


def _compile(key: Hashable, job: Any, pages: int
             ) -> tuple[ProgramCheck | None, str | None, float]:
    with _DONE_LOCK:
        if key in _DONE:
            return _DONE[key]
    start = time.perf_counter()
    try:
        result: tuple[ProgramCheck | None, str | None, float] = (
            check_program(job(), pages), None, 0.0)
    except Exception as e:  # noqa: BLE001 - XLA's errors carry no common type
        text = str(e).strip().splitlines()
        result = (None, text[0] if text else type(e).__name__, 0.0)
    result = (result[0], result[1], time.perf_counter() - start)
    with _DONE_LOCK:
        if len(_DONE) >= _DONE_SIZE:
            _DONE.clear()
        _DONE[key] = result
    return result


def _compiler(target: str) -> Compiler:
    """The layout source of every cache here: the compiler, in this process (the command
    line runs ``compile_config`` in a worker already)."""
    return Compiler(target, isolated=False, nearest=False)


def engine_blocks(spec: _config.ModelSpec, target: str, num_devices: int = 1) -> int:
    """The most blocks a layer of ``spec`` can hold on ``target``: ``KV_SHARE`` of one
    device's HBM (``HBM_BYTES``) over the bytes every layer's shard of a block takes on
    that device, padding included (the compiler's layout at the config's own block
    count). What an engine sized to the chip allocates.

    Raises:
      CompilerUnavailableError: libtpu is not installed.
    """
    name = tpu.topology(target, num_devices)
    hbm = HBM_BYTES[name.partition(":")[0]]
    per_block = 0.0
    for ls in config_layer_specs(spec, _compiler(name), None, num_devices)[0]:
        g = ls.shard_geometry
        logical = math.prod(ls.shard_shape[1:]) * dtype_of(ls.dtype).itemsize
        per_block += logical * (g.padding_factor or 1.0)
    return max(1, int(KV_SHARE * hbm // max(per_block, 1.0)))


def _caches(spec: _config.ModelSpec, target: str, num_devices: int, num_blocks: int,
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
    layer_specs = config_layer_specs(spec, _compiler(target), num_blocks, num_devices)[0]
    shardings = spec.shardings(devices)
    caches, specs = [], []
    for ls, sharding in ((layer_specs[i], shardings[i]) for i in keep):
        caches.append(jax.ShapeDtypeStruct(ls.shape, dtype_of(ls.dtype), sharding=sharding))
        specs.append(ls)
    return caches, specs


def check_pages(pages: int, num_blocks: int, num_host_blocks: int) -> int:
    """``pages`` if a transfer can move that many pages: no more than a layer's blocks
    (a transfer names distinct blocks) or the host pool's slots.

    Example:
        >>> check_pages(64, 16, 32)
        Traceback (most recent call last):
        ...
        ValueError: pages=64: a transfer moves at most 16 pages here (16 device blocks a layer, 32 host blocks)
    """
    pages = check_int(pages, "pages", minimum=1)
    most = min(num_blocks, num_host_blocks)
    if pages > most:
        raise ValueError(f"pages={pages}: a transfer moves at most {most} pages here "
                         f"({num_blocks} device blocks a layer, {num_host_blocks} host blocks)")
    return pages


def compile_config(config: str, target: str, num_devices: int = 1, *,
                   num_blocks: int | None = None, pages: int | None = None,
                   max_layers: int | None = None,
                   programs: Collection[str] | None = None) -> list[AotResult]:
    """Compiles every transfer program of ``config`` on ``num_devices`` of ``target``.

    Args:
      config: a builtin config name or a TOML file.
      target: a TPU generation (``"v6e"``) or topology (``"v6e:2x4"``).
      num_devices: devices the caches are spread over (sharded as the config shards).
      num_blocks: device blocks per layer (default: ``engine_blocks``, what the chip
        holds).
      pages: compile for transfers of up to this many pages (every bucket up to it,
        as ``KVCacheManager.warmup(pages)`` does; default ``DEFAULT_PAGES``, or fewer
        where a layer or the host pool holds fewer).
      max_layers: keep only the first ``max_layers`` layers of each layer group (a
        quicker check of DMAs a page, host compute and aliasing; staging grows with
        the layers, so check it with every layer; None: every layer).
      programs: compile only programs of these kinds (``AotResult.program``, or its
        kind before ``+`` or ``_``; None: every one).

    Returns:
      One ``AotResult`` per program, class by class.

    Raises:
      CompilerUnavailableError: libtpu is not installed.
      ValueError: an unknown config or target, too many devices, or ``pages`` more
        than a transfer can move (``check_pages``).
    """
    spec = _config.load(config)
    num_devices = check_int(num_devices, "num_devices", minimum=1)
    name = tpu.topology(target, num_devices)
    if max_layers is not None:
        max_layers = check_int(max_layers, "max_layers", minimum=1)
    if num_blocks is None:
        num_blocks = engine_blocks(spec, name, num_devices)
    num_blocks = check_int(num_blocks, "num_blocks", minimum=1)
    if pages is None:
        pages = min(DEFAULT_PAGES, num_blocks, spec.num_host_blocks)
    pages = check_pages(pages, num_blocks, spec.num_host_blocks)
    caches, specs = _caches(spec, name, num_devices, num_blocks, max_layers)
    plan = make_plan(specs, spec.num_host_blocks, path="staged")
    buckets = [1 << i for i in range(bucket(pages).bit_length())]
    work = []
    for cls, (mover, reason) in zip(plan.classes,
                                    choose_movers(plan, specs, caches, "auto", False)):
        layers = [abstract_layer(_laid_out(caches[i], specs[i].layout)) for i in cls.layers]
        work += [(cls, mover, reason, job) for job in transfer_programs(
                     mover, cls, layers, buckets, num_slots=plan.num_host_blocks)
                 if programs is None or _kind(job.name) in programs or job.name in programs]
    # XLA compiles with the GIL released: the programs compile side by side.
    workers = max(1, min(len(work), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers, "kvxfer-aot") as pool:
        compiled = list(pool.map(lambda w: _compile(w[3].key, w[3].compile, w[3].bucket),
                                 work))
    out = []
    for (cls, mover, reason, job), (check, error, seconds) in zip(work, compiled):
        bound = staging_bound(cls, job.bucket)
        if check is not None and error is None:
            if check.host_compute:
                error = f"host compute: {', '.join(check.host_compute[:3])}"
            elif check.host_pool == "copied":
                error = ("the host pool is not aliased: the program would copy the whole "
                         "pool through device memory")
            elif check.staging_bytes > bound:
                error = (f"stages {format_bytes(check.staging_bytes)} of device memory, "
                         f"over its bound of {format_bytes(bound)}")
        out.append(AotResult(
            spec.name, name, num_devices, cls.name, len(cls.layers), mover.name, reason,
            job.name, short_dtype_name(cls.dtype), job.bucket, error is None, error,
            check.host_compute if check else (), check.host_transfers if check else {},
            check.staging_bytes if check else None, bound, seconds, num_blocks,
            check.page_dmas if check else None, check.host_pool if check else None))
    return out


def _laid_out(cache: Any, layout: Any) -> Any:
    """``cache`` (abstract) with its layout named, as an engine's array names its own
    (``Array.format``): the programs hold a cache to its layout where they read it in a
    loop, which they can only where they are told it (``_pinned_programs._in_chunks``).
    The layout is the compiler's default for the cache, so the program is the same."""
    import jax
    from jax.experimental.layout import Format

    if layout is None:
        return cache
    return jax.ShapeDtypeStruct(cache.shape, cache.dtype,
                                sharding=Format(layout.to_jax(), cache.sharding))


def _kind(program: str) -> str:
    """A program's kind without what tells it from others of its kind
    (``pinned_write+digest`` and ``digest_8l`` are a ``pinned_write`` and a ``digest``)."""
    kind = program.split("+")[0]
    return "digest" if kind.startswith("digest_") else kind


def _cmd_aot(args: argparse.Namespace) -> int:
    try:
        tpu.require_compiler()
    except tpu.CompilerUnavailableError as e:
        print(f"kvxfer aot: {e}", file=sys.stderr)
        return 2
    configs = args.config or _config.builtin_names()
    rows: list[AotResult] = []
    failed = False
    # libtpu loads in the worker, never here; a compile that aborts ends the worker.
    with tpu.compile_worker() as worker:
        for name in configs:
            try:
                got = worker.call(compile_config, name, args.target, args.devices,
                                  num_blocks=args.num_blocks, pages=args.pages,
                                  max_layers=args.max_layers)
            except ValueError as e:
                print(f"kvxfer aot: {name}: {e}", file=sys.stderr)
                return 2
            except WorkerDied as e:
                print(f"FAIL {name} on {args.target}: the compiler ended its process ({e})",
                      flush=True)
                failed = True
                continue
            _print_rows(got, args.json)
            rows += got
    if not args.json:
        print(summary(rows), flush=True)
    return 1 if failed or any(not r.ok for r in rows) else 0


def _print_rows(got: list[AotResult], as_json: bool) -> None:
    heading = None
    for r in got:
        if as_json:
            print(json.dumps(r.as_dict()), flush=True)
            continue
        if (r.config, r.slice_class) != heading:
            heading = (r.config, r.slice_class)
            print(r.header(), flush=True)
        print(r.line(), flush=True)
