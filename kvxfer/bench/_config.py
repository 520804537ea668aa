"""What a benchmark run measures: ``BenchConfig`` and its presets."""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Sequence
from typing import Any, Literal

__all__ = ["BenchConfig", "BatchedBaseline", "Only", "KiB", "MiB", "GiB",
           "check_run_arguments"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: The sections a run may be limited to (``only=``, ``kvxfer bench --only``).
Only = Literal["store", "fit", "model", "policy"]

#: Where the batched user baselines run: every case, the reference cell only, or nowhere.
BatchedBaseline = Literal["all", "reference", "none"]

#: The cases of the first-call and queued-steps sections, by name (``_caller.CALL_CASES``
#: says each one's dtype and path), and the paths the engine-fit section times.
CALL_CASE_NAMES = ("staged", "raw", "pinned")
FIT_PATH_NAMES = ("auto", "staged", "pinned")


@dataclasses.dataclass(frozen=True, slots=True)
class BenchConfig:
    """What ``run_bench`` measures. ``full()`` / ``quick()`` / ``smoke()`` are presets.

    A *block* is one layer's block (``block_bytes``); a *page* is one block index
    across every layer, what one host slot holds (``layers x block_bytes``).

    Attributes:
      layers: layers of the benchmark model (every layer one cache array).
      batch_bytes: bytes per offload/load call in the throughput section.
      cells: ``(block_bytes, dtype)`` cases of the throughput section.
      reference: the cell the concurrency, overhead, integrity-traffic and memory
        sections reuse, and where the per-block-size targets are read.
      prefix_block_bytes: block size (bfloat16) of the prefix-length sweep.
      prefix_pages: prefix lengths (pages per call) of the sweep.
      concurrency: requests in flight (issued before the first wait).
      request_pages: pages per request in the concurrency section.
      overhead_pages: pages per call in the host-overhead section.
      cache_small_bytes, cache_large_bytes: the two caches of the cache-size figure.
      cache_load_pages: pages loaded into each of them.
      repeats: timed repeats per variant (after one warm-up).
      overhead_repeats: timed repeats per variant of the host-overhead section.
      baseline_budget_s: seconds each per-page user loop may run per case (a loop
        cut short reports the throughput of the pages it moved).
      cache_size_extras: also load into both caches with ``path="staged"`` and
        with a user's jitted donated scatter.
      batched_baseline: where to time the batched user baselines: ``"all"`` cases,
        the ``"reference"`` cell only, or ``"none"`` (on CPU the batched gather runs
        below 1 GB/s, so one sample of it can cost seconds).
      call_block_bytes: block size of the queued-steps and first-call sections, which
        time a bfloat16 cache on ``path="staged"``, a float32 one on ``path="auto"``
        (the raw path on XLA:CPU) and a float16 one on ``path="pinned"``.
      call_blocks: blocks per layer of those caches; the first call without warm-up
        gets one block more. Both must be shapes no other section builds.
      call_pages: pages per ``offload()`` / ``load()`` call in both sections (and the
        ``warmup`` size).
      queued_steps: donating jitted steps dispatched, not waited for, before each
        timed call of the queued-steps section.
      step_ms: the arithmetic each step aims at (passes over every layer, calibrated).
      call_repeats: timed repeats of the queued-steps section.
      call_cases: the cases (``CALL_CASE_NAMES``) the first-call and queued-steps
        sections time: each case compiles the programs of two managers of its own.
      fit_pages: pages per call of the engine-fit section (and its ``warmup`` size).
      fit_block_bytes: block size of the engine-fit section (bfloat16 caches).
      fit_steps: donating steps queued before each queued call of the engine-fit
        section; fit_step_ms: the time each aims at.
      hit_samples: the fewest 1-page hits of the engine-fit section timed per path
        (as many run untimed first; a hit is a millisecond: the median of fewer than
        120 moved by 5-10 % from run to run).
      fit_repeats: timed repeats of the engine-fit section (15: a call's host time on
        XLA:CPU varies by 1-2 ms with what the program it enqueued does to the same
        cores, and the median of 7 moved by as much between variants of one code path).
      warmup_paths: the paths (``FIT_PATH_NAMES``) whose ``warmup`` the engine-fit
        section times in fresh processes (two processes a path, seconds each).
      store_blob_bytes: blob sizes of the store section (a blob is one exported page).
      store_bytes: bytes each store variant writes or reads per repeat, per blob size
        (at most ``store_max_blobs`` blobs: small blobs cost an fsync each).
      store_max_blobs: the most blobs a store variant writes or reads per repeat.
      store_repeats: timed repeats of the store section.
      lookup_pages: pages of the prefix lookup each Redis store is measured with (one
        ``get`` per page against one ``get_many``); lookup_blob_bytes: the page blob
        sizes it is measured at; lookup_reference_bytes: the one of them its target is
        checked at (32 KiB: a page of the demo's ``tiny_llama``, 4 layers of 8 KiB
        blocks); lookup_repeats: its timed repeats.
      policy_requests: requests of each trace the policy section replays (its
        counts do not depend on the machine; its time grows with them).

    Example:
        >>> cfg = BenchConfig.smoke()
        >>> cfg.layers, cfg.reference
        (2, (16384, 'bfloat16'))
        >>> BenchConfig.smoke().as_dict()["cells"]
        [[16384, 'bfloat16']]
    """

    layers: int = 32
    batch_bytes: int = 256 * MiB
    cells: tuple[tuple[int, str], ...] = (
        (64 * KiB, "bfloat16"), (16 * KiB, "bfloat16"), (256 * KiB, "bfloat16"),
        (2 * MiB, "bfloat16"), (16 * KiB, "int8"), (64 * KiB, "int8"), (2 * MiB, "int8"),
        (64 * KiB, "float8_e4m3fn"), (16 * KiB, "float32"), (64 * KiB, "float32"),
        (2 * MiB, "float32"))
    reference: tuple[int, str] = (64 * KiB, "bfloat16")
    prefix_block_bytes: int = 16 * KiB
    prefix_pages: tuple[int, ...] = (1, 4, 16, 64, 128, 256, 1024)
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    request_pages: int = 16
    overhead_pages: int = 32
    cache_small_bytes: int = 64 * MiB
    cache_large_bytes: int = 1 * GiB
    cache_load_pages: int = 32
    repeats: int = 15
    overhead_repeats: int = 50
    baseline_budget_s: float = 1.5
    cache_size_extras: bool = True
    batched_baseline: BatchedBaseline = "all"
    call_block_bytes: int = 16 * KiB
    call_blocks: int = 64
    call_pages: int = 32
    queued_steps: int = 10
    step_ms: float = 5.0
    call_repeats: int = 9
    call_cases: tuple[str, ...] = CALL_CASE_NAMES
    fit_pages: int = 64
    fit_block_bytes: int = 64 * KiB
    fit_steps: int = 3
    fit_step_ms: float = 150.0
    fit_repeats: int = 15
    warmup_paths: tuple[str, ...] = FIT_PATH_NAMES
    hit_samples: int = 120
    store_blob_bytes: tuple[int, ...] = (64 * KiB, 1 * MiB, 8 * MiB)
    store_bytes: int = 64 * MiB
    store_max_blobs: int = 128
    store_repeats: int = 5
    lookup_pages: int = 32
    lookup_blob_bytes: tuple[int, ...] = (4 * KiB, 32 * KiB, 256 * KiB)
    lookup_reference_bytes: int = 32 * KiB
    lookup_repeats: int = 30
    policy_requests: int = 200
    copy_sizes: tuple[int, ...] = (16 * KiB, 32 * KiB, 64 * KiB, 2 * MiB)
    copy_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        choices = typing.get_args(BatchedBaseline)
        if self.batched_baseline not in choices:
            raise ValueError(f"Expected batched_baseline in {choices}. Got "
                             f"{self.batched_baseline!r} of type "
                             f"{type(self.batched_baseline).__name__}")
        if self.reference not in self.cells:
            raise ValueError(f"reference={self.reference!r} must be one of cells={self.cells!r}")
        from kvxfer.layout import dtype_of  # here: ``kvxfer --help`` starts without numpy

        for block, dtype in self.cells:
            itemsize = dtype_of(dtype).itemsize
            if block % itemsize or block < itemsize:
                raise ValueError(f"cell ({block}, {dtype!r}): block_bytes must be a positive "
                                 f"multiple of {itemsize}")
            if self.batch_bytes < self.layers * block:
                raise ValueError(f"batch_bytes={self.batch_bytes} holds no page of "
                                 f"{self.layers} layers x {block} bytes")
        if self.cache_small_bytes < self.layers * self.cache_load_pages * self.reference[0]:
            raise ValueError(f"cache_small_bytes={self.cache_small_bytes} cannot hold "
                             f"{self.cache_load_pages} pages of {self.layers} layers")
        if max(self.concurrency) * self.request_pages > self.reference_pages or \
                self.overhead_pages > self.reference_pages:
            raise ValueError(f"concurrency x request_pages and overhead_pages must fit the "
                             f"reference cell's {self.reference_pages} pages")
        if self.call_block_bytes % 4 or self.call_block_bytes < 4:
            raise ValueError(f"call_block_bytes={self.call_block_bytes} must be a positive "
                             "multiple of 4 (it holds float32 blocks)")
        if not 1 <= self.call_pages <= self.call_blocks:
            raise ValueError(f"call_pages={self.call_pages} must be in [1, "
                             f"call_blocks={self.call_blocks}]")
        if self.fit_pages < 1 or self.fit_block_bytes % 2 or self.fit_block_bytes < 2 or \
                self.fit_steps < 1 or not self.fit_step_ms > 0 or self.fit_repeats < 1 or \
                self.hit_samples < 1:
            raise ValueError(f"fit_pages={self.fit_pages}, fit_block_bytes="
                             f"{self.fit_block_bytes} (bfloat16 blocks), fit_steps="
                             f"{self.fit_steps}, fit_step_ms={self.fit_step_ms} and "
                             f"fit_repeats={self.fit_repeats}, hit_samples="
                             f"{self.hit_samples} must be positive")
        for name, got, choices in (("call_cases", self.call_cases, CALL_CASE_NAMES),
                                   ("warmup_paths", self.warmup_paths, FIT_PATH_NAMES)):
            if not got or len(set(got)) != len(got) or not set(got) <= set(choices):
                raise ValueError(f"Expected {name} to name some of {choices}, each once. "
                                 f"Got {got!r} of type {type(got).__name__}")
        if self.queued_steps < 1 or not self.step_ms > 0 or self.call_repeats < 1:
            raise ValueError(f"queued_steps={self.queued_steps}, step_ms={self.step_ms} and "
                             f"call_repeats={self.call_repeats} must be positive")
        if not self.store_blob_bytes or min(self.store_blob_bytes) < 1 or \
                self.store_bytes < max(self.store_blob_bytes) or self.store_repeats < 1 or \
                self.store_max_blobs < 1:
            raise ValueError(f"store_blob_bytes={self.store_blob_bytes!r} must be positive "
                             f"sizes up to store_bytes={self.store_bytes}, and "
                             f"store_repeats={self.store_repeats} and store_max_blobs="
                             f"{self.store_max_blobs} positive")
        if self.lookup_pages < 1 or not self.lookup_blob_bytes or \
                min(self.lookup_blob_bytes) < 1 or self.lookup_repeats < 1:
            raise ValueError(f"lookup_pages={self.lookup_pages}, lookup_blob_bytes="
                             f"{self.lookup_blob_bytes!r} and lookup_repeats="
                             f"{self.lookup_repeats} must be positive")
        if self.lookup_reference_bytes not in self.lookup_blob_bytes:
            raise ValueError(f"lookup_reference_bytes={self.lookup_reference_bytes} must be "
                             f"one of lookup_blob_bytes={self.lookup_blob_bytes!r}")
        if self.policy_requests < 1:
            raise ValueError(f"policy_requests={self.policy_requests} must be positive")
        ours = {(self.call_block_bytes, d, n) for d in ("bfloat16", "float32", "float16")
                for n in (self.call_blocks, self.cold_call_blocks)}
        clash = sorted(ours & self._other_caches())
        if clash:  # a first call or a warm-up would find its programs compiled
            raise ValueError(f"call_blocks={self.call_blocks}: caches of {clash[0][2]} "
                             f"blocks of {clash[0][0]} bytes ({clash[0][1]}) are built by "
                             "another section too; the first-call section needs shapes "
                             "new to the run")

    @property
    def reference_pages(self) -> int:
        """Pages per call of the reference cell."""
        return self.batch_bytes // (self.layers * self.reference[0])

    @property
    def cold_call_blocks(self) -> int:
        """Blocks per layer of the first-call section's manager without warm-up."""
        return self.call_blocks + 1

    def _other_caches(self) -> set[tuple[int, str, int]]:
        """``(block_bytes, dtype, blocks)`` of the caches the other sections build."""
        out = {(b, d, self.batch_bytes // (self.layers * b)) for b, d in self.cells}
        if not self.sweep_on_reference:
            out.add((self.prefix_block_bytes, "bfloat16", max(self.prefix_pages)))
        block = self.reference[0]
        out |= {(block, "bfloat16", total // (self.layers * block))
                for total in (self.cache_small_bytes, self.cache_large_bytes)}
        return out

    @property
    def sweep_on_reference(self) -> bool:
        """The prefix sweep runs on the reference cell's caches (no programs to compile)."""
        return (self.prefix_block_bytes, "bfloat16") == self.reference and \
            max(self.prefix_pages) <= self.reference_pages

    @classmethod
    def full(cls) -> BenchConfig:
        """The full run (about 10 minutes on a 2-core CPU)."""
        return cls()

    @classmethod
    def quick(cls) -> BenchConfig:
        """Every section, fewer cases and repeats, 32 MiB a call (the full run: 256 MiB).

        Sized to stay well under 2 GB of host memory at its peak (64 MiB calls peaked at
        2.07 GB: each throughput cell holds four managers' pools of twice its pages):
        32 MiB calls, a 256 MiB large cache, up to 4 requests in flight. Its prefix
        sweep reuses the reference cell (64 KiB blocks, up to 16 pages) and its requests
        share the sweep's page counts: each new cache shape or page-count bucket costs
        seconds of compilation. Its caller-thread sections move 8 pages a call, as a
        warm-up compiles every bucket up to the size it is given.
        """
        return cls(cells=((64 * KiB, "bfloat16"), (16 * KiB, "int8"), (1 * MiB, "float32")),
                   batch_bytes=32 * MiB, cache_large_bytes=256 * MiB, copy_bytes=16 * MiB,
                   concurrency=(1, 2, 4), overhead_pages=16,
                   prefix_block_bytes=64 * KiB, prefix_pages=(1, 4, 16), request_pages=4,
                   repeats=5, overhead_repeats=20, baseline_budget_s=0.2,
                   cache_size_extras=False, batched_baseline="none", call_pages=8,
                   call_repeats=5, fit_pages=16, fit_step_ms=50.0, fit_repeats=3,
                   store_bytes=16 * MiB, store_max_blobs=64, store_repeats=3)

    @classmethod
    def smoke(cls) -> BenchConfig:
        """Tiny sizes for tests: every section, in under 30 seconds (figures mean little).

        Each distinct cache shape, host pool size, integrity mode and path compiles its
        programs (seconds each on XLA:CPU), so the sections share them where they can:
        the engine-fit calls and 1-page hits run on caches and pools of the cache-size
        section's shapes (4 and 16 blocks, 4 host pages), and the prefix sweep's longer
        prefix is the throughput cell's call (a new page count compiles the user
        baselines and the plain-JAX routes again; the shorter, 1 page, is where a
        target is read). One throughput cell; the caller-thread
        sections and the warm-up in fresh processes time one case, the pinned mover's
        (the fewest programs to compile), and list the others as not measured.
        """
        return cls(layers=2, batch_bytes=256 * KiB,
                   cells=((16 * KiB, "bfloat16"),),
                   reference=(16 * KiB, "bfloat16"), prefix_block_bytes=16 * KiB,
                   prefix_pages=(1, 8), concurrency=(1, 2), request_pages=1,
                   overhead_pages=2, cache_small_bytes=128 * KiB, cache_large_bytes=512 * KiB,
                   cache_load_pages=4, repeats=2, overhead_repeats=3,
                   baseline_budget_s=0.02, cache_size_extras=True, call_block_bytes=4 * KiB,
                   call_blocks=8, call_pages=2, step_ms=1.0, call_repeats=2,
                   call_cases=("pinned",), warmup_paths=("pinned",), fit_pages=2,
                   fit_block_bytes=16 * KiB, fit_steps=1, fit_step_ms=1.0, fit_repeats=2,
                   hit_samples=16,
                   store_blob_bytes=(4 * KiB, 64 * KiB), store_bytes=256 * KiB,
                   store_repeats=2, lookup_pages=4, lookup_blob_bytes=(4 * KiB,),
                   lookup_reference_bytes=4 * KiB, lookup_repeats=3, policy_requests=24,
                   copy_sizes=(4 * KiB, 16 * KiB), copy_bytes=128 * KiB)

    def as_dict(self) -> dict[str, Any]:
        """The config as JSON-ready lists and numbers."""
        d = dataclasses.asdict(self)
        d["cells"] = [list(c) for c in self.cells]
        d["reference"] = list(self.reference)
        for k in ("prefix_pages", "concurrency", "store_blob_bytes", "lookup_blob_bytes",
                  "copy_sizes", "call_cases", "warmup_paths"):
            d[k] = list(d[k])
        return d


def check_run_arguments(stores: Sequence[str], only: str | None,
                        models: Sequence[str]) -> None:
    """Refuses ``run_bench``'s arguments that would fail a run midway, before JAX is
    imported and anything is measured: a bad ``only``, ``only="model"`` without
    ``models`` (or ``models`` with another ``only``), a model config that does not
    load, a store spec that does not parse or a disk store's directory that is not
    one.

    Raises:
      ValueError: naming the bad value (``ConfigError`` for a config).
      StoreError: an OSError naming a store directory that is not one.

    Example:
        >>> check_run_arguments(["/nonexistent/dir"], None, [])
        Traceback (most recent call last):
        ...
        kvxfer.store._base.StoreError: bench: store directory '/nonexistent/dir' does not exist
    """
    from kvxfer import config as _config
    from kvxfer.store import StoreError, parse_spec

    if only is not None and only not in typing.get_args(Only):
        raise ValueError(f"Expected only in {typing.get_args(Only)} or None. Got {only!r} "
                         f"of type {type(only).__name__}")
    if only == "model" and not models:
        raise ValueError("only='model' needs a config in models= (kvxfer bench --only model "
                         "--model CONFIG); got none")
    if models and only not in (None, "model"):
        raise ValueError(f"models={list(models)!r} are measured by the models section, "
                         f"which only={only!r} leaves out; use only='model' (--only model) "
                         "or run every section")
    for name in models:  # a typo must not cost a whole run
        _config.load(name)
    for spec in stores:
        kind, where = parse_spec(spec)
        if kind != "disk":
            continue
        # The bench writes in a new temporary directory inside this one.
        if not os.path.isdir(where):
            raise StoreError(f"bench: store directory {where!r} "
                             + ("is not a directory" if os.path.exists(where)
                                else "does not exist"))
        if not os.access(where, os.W_OK | os.X_OK):
            raise StoreError(f"bench: store directory {where!r} is not writable")
