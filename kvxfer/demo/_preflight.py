"""What ``kvxfer demo`` checks before JAX starts: its options, the sizes they imply
(device blocks a request needs, KV heads to split, host memory), and its store.

Nothing here imports JAX, so the command line reports a bad option in a fraction of
a second rather than after JAX's import (seconds on a busy machine).

Example:
    >>> from kvxfer.demo._options import DemoOptions
    >>> preflight(DemoOptions(device_blocks=2))
    Traceback (most recent call last):
    ...
    ValueError: --device-blocks 2 is too few: a request needs up to 12 blocks
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import numpy as np

from kvxfer._text import format_bytes
from kvxfer.demo import _model_config as _mc
from kvxfer.demo._options import DemoOptions
from kvxfer.store import Store, StoreError, open_store

__all__ = ["Prepared", "options_of", "preflight", "footprint",
           "open_demo_store"]


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared:
    """A demo run's sizes, checked: the model config, the device count and the blocks
    the longest request needs."""

    cfg: _mc.ModelConfig
    devices: int
    max_need: int


def options_of(options: DemoOptions | argparse.Namespace | None,
               overrides: dict[str, Any]) -> DemoOptions:
    """The checked ``DemoOptions`` of ``run_demo``'s arguments (ValueError naming the
    first bad one)."""
    if options is None:
        opts = DemoOptions()
    elif isinstance(options, DemoOptions):
        opts = options
    elif isinstance(options, argparse.Namespace):
        opts = DemoOptions.from_namespace(options)
    else:
        raise TypeError(f"options: expected DemoOptions or argparse.Namespace. Got "
                        f"{options!r} of type {type(options)}")
    if overrides:
        opts = dataclasses.replace(opts, **overrides)
    if isinstance(opts.system_pages, list):
        opts = dataclasses.replace(opts, system_pages=tuple(opts.system_pages))
    opts.check()
    return opts


def _dtype(name: str) -> np.dtype:
    if name != "bfloat16":
        return np.dtype(name)
    import ml_dtypes  # its import takes most of a second: only when asked for

    return np.dtype(ml_dtypes.bfloat16)


def footprint(cfg: _mc.ModelConfig, opts: DemoOptions) -> dict[str, int]:
    """Bytes a demo run holds at once, by part, before any of it is allocated: the
    weights (float32), three sets of device caches (the reference run's, the server's
    and a donated step's), the host pool and the store's copy of it in memory, and
    what the JAX runtime holds per device (``RUNTIME_BYTES_PER_DEVICE``).

    Example:
        >>> footprint(_mc.tiny_llama(), DemoOptions())["host pool"]  # 2 x 64 x 32 KiB
        4194304
    """
    from kvxfer.plan import RUNTIME_BYTES_PER_DEVICE

    d, v, q = cfg.d_model, cfg.vocab_size, cfg.num_q_heads
    weights = 2 * v * d + sum(d * q * lkv.head_dim * 2 + 2 * d * lkv.num_kv_heads * lkv.head_dim
                              + 3 * d * cfg.ffn_dim + 2 * d for lkv in cfg.layers)
    block = sum(cfg.kv_block_bytes(_dtype(opts.dtype)))
    devices = max(opts.devices, 2 if opts.inject == "one-shard" else 1)
    return {"weights": 4 * weights, "device caches": 3 * opts.device_blocks * block,
            "host pool": 2 * opts.host_blocks * block,
            "runtime": devices * RUNTIME_BYTES_PER_DEVICE}


def _check_footprint(cfg: _mc.ModelConfig, opts: DemoOptions) -> None:
    """Refuses (``BudgetError``) a demo whose ``footprint`` exceeds the host memory
    available now, naming each part, before anything is allocated."""
    from kvxfer.plan import BudgetError, available_host_memory

    parts = footprint(cfg, opts)
    budget = available_host_memory()
    if sum(parts.values()) > budget:
        named = ", ".join(f"{k} {format_bytes(n)}" for k, n in parts.items())
        raise BudgetError(f"this demo needs {format_bytes(sum(parts.values()))} ({named}; "
                          f"--scale {opts.scale}, {cfg.num_layers} layers, --device-blocks "
                          f"{opts.device_blocks}, --host-blocks {opts.host_blocks}, "
                          f"--devices {opts.devices}) but "
                          f"{format_bytes(budget)} of host memory is available")


def preflight(opts: DemoOptions) -> Prepared:
    """Checks what ``opts`` imply before anything starts: enough device blocks for the
    longest request, KV heads that split for ``one-shard``, and the host memory the
    run needs (``BudgetError``). Raises ValueError naming the option."""
    devices = opts.devices
    if opts.inject == "one-shard" and devices < 2:
        devices = 2  # corruption on one shard needs at least two shards
    bs = _mc.tiny_llama().block_size
    # The longest prompt: the longest system prompt and a suffix of bs - 1 tokens.
    max_need = _mc.blocks_needed(max(opts.system_pages) * bs + bs - 1, opts.new_tokens, bs)
    base = _mc.tiny_llama() if opts.model == "tiny" else _mc.mixed_layers()
    cfg = _mc.scaled(base, opts.scale, num_layers=opts.layers,
                     max_blocks_per_seq=max(base.max_blocks_per_seq, max_need))
    if opts.device_blocks < max_need:
        raise ValueError(f"--device-blocks {opts.device_blocks} is too few: a request needs "
                         f"up to {max_need} blocks")
    if opts.inject == "one-shard" and not any(
            lkv.num_kv_heads % devices == 0 for lkv in cfg.layers):
        raise ValueError(f"--inject one-shard needs a layer whose KV heads split over "
                         f"{devices} devices; the layers have "
                         f"{sorted({lkv.num_kv_heads for lkv in cfg.layers})} KV heads "
                         "(use --devices 2 or raise --scale)")
    _check_footprint(cfg, opts)
    return Prepared(cfg, devices, max_need)


def open_demo_store(spec: str | None) -> Store | None:
    """The ``--store`` tier, opened and reached (a Redis server answers a ping)."""
    if spec is None:
        return None
    try:
        return open_store(spec)
    except StoreError as e:  # its message names the store, its password redacted
        raise StoreError(f"--store: {e}") from e
