"""The ``kvxfer demo`` options: ``DemoOptions`` and the flags that set them.

This module imports nothing heavy: the command line builds its parser from it without
starting JAX.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> add_arguments(p)
    >>> DemoOptions.from_namespace(p.parse_args(["--requests", "6"])).requests
    6
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Literal, get_args

from kvxfer._check import MAX_COUNT, bounded_int, check_int
from kvxfer._names import Gate, IntegrityMode
from kvxfer.store import spec_argument

__all__ = ["ModelPreset", "MODEL_PRESETS", "CacheDtype", "CACHE_DTYPES", "InjectMode",
           "INJECT_MODES", "LIMITS", "DemoOptions", "add_arguments"]

ModelPreset = Literal["tiny", "mixed"]
MODEL_PRESETS: tuple[str, ...] = get_args(ModelPreset)
CacheDtype = Literal["float32", "bfloat16"]
CACHE_DTYPES: tuple[str, ...] = get_args(CacheDtype)
_INTEGRITY_MODES: tuple[str, ...] = get_args(IntegrityMode)
_GATES: tuple[str, ...] = get_args(Gate)
InjectMode = Literal["bitflip", "wrong-key", "stale-slot", "one-shard", "store-bitflip"]
INJECT_MODES: tuple[str, ...] = get_args(InjectMode)
"""The faults ``kvxfer demo --inject`` knows (``kvxfer.testing.FAULTS`` of the host tier,
and ``store-bitflip`` at rest in the store tier)."""

LIMITS = {"scale": 256, "layers": 4096, "requests": 10_000, "devices": 256,
          "device_blocks": MAX_COUNT, "host_blocks": MAX_COUNT, "injections": 10_000,
          "system_pages": 1024, "new_tokens": 4096, "seed": 2**32 - 1}
"""The largest value each count option takes. Sizes inside these are still checked
against the machine's memory before anything is allocated (``run_demo`` refuses a
demo that would not fit with a ``BudgetError`` naming the sizes)."""

@dataclasses.dataclass(frozen=True, slots=True)
class DemoOptions:
    """Options of :func:`run_demo` (the ``kvxfer demo`` flags).

    Attributes:
        model: ``tiny`` (uniform layers) or ``mixed`` (two slice classes).
        scale: Width multiplier (KV heads, d_model, ...).
        layers: Decoder layers (None: the preset's 4).
        requests: Requests to serve.
        devices: Devices to shard KV heads over (``NamedSharding``).
        device_blocks: Device KV blocks per layer (small, so the device tier fills).
        host_blocks: Host pages of the host tier.
        integrity: ``page`` (digests verified on load) or ``off``.
        inject: A fault to inject into the host or store tier, or None.
        injections: How many times to inject it.
        gate: ``layer`` (layer i starts once verified) or ``all``.
        system_pages: Pages of each shared system prompt.
        new_tokens: Tokens generated per request.
        dtype: Cache dtype, ``float32`` or ``bfloat16``.
        seed: Seed of the weights and the workload.
        progress: Progress lines on stderr for runs longer than a few seconds.
        store: A store tier below host memory: a directory, ``file://DIR`` or
            ``redis://HOST:PORT[/DB]`` (None: no store). Host pages are written to it
            when evicted and at the end, so a later run on the same store gets hits.

    Example:
        >>> DemoOptions(requests=0).check()
        Traceback (most recent call last):
        ...
        ValueError: requests=0 must be >= 1
    """

    model: ModelPreset = "tiny"
    scale: int = 1
    layers: int | None = None
    requests: int = 32
    devices: int = 1
    device_blocks: int = 20
    host_blocks: int = 64
    integrity: IntegrityMode = "page"
    inject: InjectMode | None = None
    injections: int = 2
    gate: Gate = "layer"
    system_pages: tuple[int, ...] = (6, 8, 10)
    new_tokens: int = 8
    dtype: CacheDtype = "float32"
    seed: int = 0
    progress: bool = True
    store: str | None = None

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> DemoOptions:
        """The options of a parsed ``kvxfer demo`` command line (other names ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def check(self) -> None:
        """Raises ValueError naming the first bad option."""
        for name, choices in (("model", MODEL_PRESETS), ("integrity", _INTEGRITY_MODES),
                              ("gate", _GATES), ("dtype", CACHE_DTYPES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r}; expected one of "
                                 f"{', '.join(choices)}")
        if self.inject is not None and self.inject not in INJECT_MODES:
            raise ValueError(f"inject={self.inject!r}; expected one of {', '.join(INJECT_MODES)}")
        for name in ("scale", "requests", "devices", "device_blocks", "host_blocks",
                     "new_tokens", "layers", "injections", "seed"):
            value = getattr(self, name)
            if value is None and name == "layers":
                continue
            low = 0 if name in ("injections", "seed") else 1
            check_int(value, name, minimum=low)
            if value > LIMITS[name]:
                raise ValueError(f"{name}={value} must be <= {LIMITS[name]}")
        if not self.system_pages or min(self.system_pages) < 1 or \
                max(self.system_pages) > LIMITS["system_pages"]:
            raise ValueError(f"system_pages={self.system_pages} must be page counts from 1 "
                             f"to {LIMITS['system_pages']}")
        if self.inject == "store-bitflip" and not self.store:
            raise ValueError("inject='store-bitflip' damages pages at rest in the store: "
                             "give --store DIR or --store redis://HOST:PORT")
        if self.store is not None and (not isinstance(self.store, str) or not self.store):
            raise ValueError(f"store={self.store!r}; expected a directory, file://DIR or "
                             "redis://HOST:PORT[/DB]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``kvxfer demo`` options to ``parser``.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> add_arguments(p)
        >>> p.parse_args(["--system-pages", "3", "4"]).system_pages
        [3, 4]
    """
    d = DemoOptions()

    def count(name: str, low: int = 1) -> Callable[[str], int]:
        return bounded_int(low, LIMITS[name])

    parser.add_argument("--model", choices=MODEL_PRESETS, default=d.model,
                        help="tiny: uniform layers; mixed: two slice classes (default tiny)")
    parser.add_argument("--scale", type=count("scale"), default=d.scale,
                        help="width multiplier: KV heads, d_model, ffn (default 1)")
    parser.add_argument("--layers", type=count("layers"), default=d.layers,
                        help="decoder layers (default: the preset's 4)")
    parser.add_argument("--requests", type=count("requests"), default=d.requests,
                        help=f"requests to serve (default {d.requests})")
    parser.add_argument("--devices", type=count("devices"), default=d.devices,
                        help="devices to shard KV heads over (default 1; CPU devices are "
                        "created as needed)")
    parser.add_argument("--device-blocks", type=count("device_blocks"),
                        default=d.device_blocks,
                        help=f"device KV blocks per layer (default {d.device_blocks}: few, "
                        "so cold pages go to host)")
    parser.add_argument("--host-blocks", type=count("host_blocks"), default=d.host_blocks,
                        help=f"host pages (default {d.host_blocks})")
    parser.add_argument("--integrity", choices=_INTEGRITY_MODES, default=d.integrity,
                        help="page: verify page digests on load (default); off: skip")
    parser.add_argument("--inject", choices=INJECT_MODES, default=None,
                        help="damage cached pages after offload: "
                        f"{', '.join(INJECT_MODES)} (one-shard forces --devices >= 2; "
                        "store-bitflip needs --store)")
    parser.add_argument("--store", default=None, type=spec_argument,
                        metavar="DIR|redis://HOST:PORT|redis+cluster://HOST:PORT,...",
                        help="a store tier below host memory: evicted host pages (and all "
                        "of them at the end) go there, and a later run on the same store "
                        "starts with its pages")
    parser.add_argument("--injections", type=count("injections", 0), default=d.injections,
                        help=f"how many times to inject (default {d.injections})")
    parser.add_argument("--gate", choices=_GATES, default=d.gate,
                        help="layer: release each layer to the model once it is verified; "
                        f"all: release every layer together once all are (default: {d.gate})")
    parser.add_argument("--system-pages", type=count("system_pages"), nargs="+",
                        default=d.system_pages,
                        help="pages of each shared system prompt (default 6 8 10)")
    parser.add_argument("--new-tokens", type=count("new_tokens"), default=d.new_tokens,
                        help=f"tokens generated per request (default {d.new_tokens})")
    parser.add_argument("--dtype", choices=CACHE_DTYPES, default=d.dtype,
                        help="KV cache dtype (default float32)")
    parser.add_argument("--seed", type=count("seed", 0), default=d.seed,
                        help="weights and workload seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", dest="progress", action="store_false",
                        help="no progress lines on stderr")
