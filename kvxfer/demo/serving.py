"""A serving loop with a host-tier prefix cache, built on kvxfer (``kvxfer demo``).

Requests share long system prompts. Their full prompt pages are cached under a
chained hash of their tokens, first in device blocks (the device tier) and, once
device blocks run short, in host memory (the host tier) through
:class:`kvxfer.KVCacheManager`:

* **Device tier**: a block allocator with a prefix index. Blocks of cached pages
  are reference counted; unreferenced ones wait in an LRU list and are the first
  to go when a request needs blocks.
* **Host tier**: cold pages are offloaded with ``mgr.offload(...).wait()`` before
  their device blocks are reused. A later prefix hit promotes them back with
  ``mgr.load(..., keys=..., gate="layer")``; the forward pass of layer ``i`` waits
  in the model's ``before_layer`` hook until ``load.layer_ready(i)`` releases it.
* **Recovery**: a page that fails verification is a cache miss. The request keeps
  the verified prefix and recomputes the rest; if a layer was already consumed with
  a longer prefix than the final one, the request restarts from the verified
  prefix. Tokens are always checked against a run of the same requests with no
  cache at all.

Faults can be injected into the host tier after pages were offloaded (a bit flip,
a page under the wrong key, a slot reused while still referenced, or damage on one
shard only) to show detection *and* recovery.

Example:
    >>> from kvxfer.demo.serving import DemoOptions, run_demo
    >>> summary = run_demo(DemoOptions(requests=6, progress=False))  # doctest: +SKIP
    >>> summary["tokens_match"], summary["host_hits"] > 0  # doctest: +SKIP
    (True, True)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from kvxfer._text import format_bytes, table
from kvxfer.demo import model as _model
from kvxfer.hostpool import PageRef
from kvxfer.manager import IntegrityError, KVCacheManager, LoadHandle

__all__ = [
    "INJECT_MODES",
    "DemoOptions",
    "Request",
    "RequestOutcome",
    "DeviceBlocks",
    "HostIndex",
    "FaultInjector",
    "PrefixCacheServer",
    "page_keys",
    "make_workload",
    "shard_caches",
    "reference_tokens",
    "run_demo",
    "add_arguments",
    "register_cli",
    "format_summary",
    "main",
]

InjectMode = Literal["bitflip", "wrong-key", "stale-slot", "one-shard"]
INJECT_MODES: tuple[str, ...] = ("bitflip", "wrong-key", "stale-slot", "one-shard")

# The key a scratch page is offloaded under when a stale-slot injection has to
# refill a freed slot and no cold device page is waiting to be written back.
_SCRATCH_KEY = 0xFFFF_FFFF_0000_0000


# ---------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------


def page_keys(tokens: Sequence[int] | np.ndarray, block_size: int = 16,
              parent: int = 0) -> list[int]:
    """Chained 64-bit keys of the *full* pages of a token sequence.

    ``key[j] = blake2b(key[j - 1] || tokens of page j)`` (``key[-1] = parent``), so a
    page's key names its whole prefix: two requests share page ``j`` only if they
    share pages ``0..j``. A trailing partial page gets no key: the model promises
    bit-identical KV only for full prompt pages.

    Args:
        tokens: Token ids.
        block_size: Tokens per page.
        parent: Key of the page before the first one (0 at the start of a prompt).

    Returns:
        One key in ``[0, 2**64)`` per full page.

    Example:
        >>> a = page_keys(list(range(40)))
        >>> len(a), a == page_keys(list(range(32)) + [9, 9])[:2]
        (2, True)
        >>> page_keys(list(range(16)))[0] == page_keys([1] + list(range(1, 16)))[0]
        False
    """
    toks = np.asarray(tokens, dtype="<i4").reshape(-1)
    keys, key = [], int(parent)
    for j in range(len(toks) // block_size):
        h = hashlib.blake2b(key.to_bytes(8, "little"), digest_size=8, person=b"kvxfer-page")
        h.update(toks[j * block_size:(j + 1) * block_size].tobytes())
        key = int.from_bytes(h.digest(), "little")
        keys.append(key)
    return keys


# ---------------------------------------------------------------------------
# Device tier: block allocator with a prefix index
# ---------------------------------------------------------------------------


class DeviceBlocks:
    """Device block allocator with a device-tier prefix index (refcounts, LRU).

    A block is *free*, *held* (refcount > 0; cached or private to a request), or
    *cold* (cached, refcount 0, in the LRU list, evictable). ``evict`` takes cold
    blocks out of the index; the caller copies them out and then ``reclaim``\\ s them.

    Args:
        num_blocks: Device blocks per layer.

    Example:
        >>> blocks = DeviceBlocks(4)
        >>> b, = blocks.allocate(1)
        >>> blocks.publish(77, b)
        True
        >>> blocks.release(b)
        >>> blocks.lookup(77) == b, blocks.num_cold
        (True, 1)
        >>> blocks.evict(1) == [(b, 77)], blocks.lookup(77)
        (True, None)
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        self._refs = [0] * num_blocks
        self._index: dict[int, int] = {}  # key -> block
        self._key_of: dict[int, int] = {}  # block -> key (cached blocks only)
        # Cold cached blocks, least recently used first.
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cold(self) -> int:
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._index)

    def lookup(self, key: int) -> int | None:
        """The block caching ``key``, or None."""
        return self._index.get(key)

    def cold_pages(self) -> list[tuple[int, int]]:
        """``(block, key)`` of cold cached blocks, least recently used first."""
        return [(b, self._key_of[b]) for b in self._lru]

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` free blocks (refcount 1 each).

        Raises:
            MemoryError: fewer than ``n`` blocks are free (nothing taken).
        """
        if n > len(self._free):
            raise MemoryError(f"{n} device blocks requested, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def acquire(self, block: int) -> None:
        """Adds a reference to a cached block (a prefix hit)."""
        self._refs[block] += 1
        self._lru.pop(block, None)

    def release(self, block: int) -> None:
        """Drops a reference; an unreferenced block goes cold (cached) or free."""
        if self._refs[block] <= 0:
            raise ValueError(f"device block {block} released with no reference held")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._lru[block] = None
                self._lru.move_to_end(block)
            else:
                self._free.append(block)

    def publish(self, key: int, block: int) -> bool:
        """Caches a held block under ``key``; False (nothing done) if ``key`` is cached."""
        if key in self._index or block in self._key_of:
            return False
        self._index[key] = block
        self._key_of[block] = key
        return True

    def evict(self, n: int) -> list[tuple[int, int]]:
        """Takes up to ``n`` cold blocks out of the index, LRU first: ``(block, key)``.

        The blocks are neither free nor cached until ``reclaim``: the caller copies
        their bytes out first.
        """
        out = []
        while self._lru and len(out) < n:
            block, _ = self._lru.popitem(last=False)
            key = self._key_of.pop(block)
            del self._index[key]
            out.append((block, key))
        return out

    def reclaim(self, blocks: Sequence[int]) -> None:
        """Returns evicted blocks to the free list."""
        self._free.extend(blocks)


# ---------------------------------------------------------------------------
# Host tier index
# ---------------------------------------------------------------------------


class HostIndex:
    """Host-tier prefix index: key -> ``PageRef``, in LRU order, with pins.

    Pinned keys (pages a request is about to load) are never chosen for eviction.

    Example:
        >>> idx = HostIndex()
        >>> idx.put(5, PageRef(5, 0, 1)); idx.put(6, PageRef(6, 1, 1))
        >>> idx.pin(5)
        >>> idx.coldest_unpinned()
        6
    """

    def __init__(self) -> None:
        self._refs: collections.OrderedDict[int, PageRef] = collections.OrderedDict()
        self._pinned: set[int] = set()

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, key: int) -> bool:
        return key in self._refs

    def keys(self) -> list[int]:
        """Keys, least recently used first."""
        return list(self._refs)

    def get(self, key: int) -> PageRef:
        return self._refs[key]

    def put(self, key: int, ref: PageRef) -> None:
        self._refs[key] = ref
        self._refs.move_to_end(key)

    def touch(self, key: int) -> None:
        self._refs.move_to_end(key)

    def pop(self, key: int) -> PageRef:
        self._pinned.discard(key)
        return self._refs.pop(key)

    def pin(self, key: int) -> None:
        self._pinned.add(key)

    def unpin(self, key: int) -> None:
        self._pinned.discard(key)

    def swap(self, a: int, b: int) -> None:
        """Exchanges the refs of two keys (a simulated index bug)."""
        self._refs[a], self._refs[b] = self._refs[b], self._refs[a]

    def coldest_unpinned(self) -> int | None:
        return next((k for k in self._refs if k not in self._pinned), None)


# ---------------------------------------------------------------------------
# Requests, options, statistics
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request.

    Attributes:
        rid: Request id (its position in the workload).
        prompt: Prompt token ids.
        max_new_tokens: Tokens to generate greedily.
        system: Index of the shared system prompt it starts with (-1: none).
    """

    rid: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    system: int = -1


@dataclasses.dataclass(frozen=True)
class RequestOutcome:
    """What serving one request did.

    Attributes:
        rid: Request id.
        tokens: Generated tokens.
        ttft_s: Seconds from request start to the first generated token.
        kind: ``miss``, ``device_hit``, ``host_hit`` (host pages used), or
            ``recovered`` (a host page failed verification and was recomputed).
        device_pages: Prompt pages served from device blocks.
        host_pages: Prompt pages loaded from host and used.
        computed_pages: Prompt pages computed.
        recomputed_pages: Cache hits dropped because a host page failed.
        restarted: A layer had been consumed with a longer prefix than the
            verified one, so the request restarted from the verified prefix.
    """

    rid: int
    tokens: tuple[int, ...]
    ttft_s: float
    kind: str
    device_pages: int
    host_pages: int
    computed_pages: int
    recomputed_pages: int
    restarted: bool


@dataclasses.dataclass
class ServeStats:
    """Counters of a serving run (pages unless named bytes)."""

    requests: int = 0
    device_hits: int = 0
    host_hits: int = 0
    computed_pages: int = 0
    pages_offloaded: int = 0
    bytes_offloaded: int = 0
    pages_loaded: int = 0
    bytes_loaded: int = 0
    pages_verified: int = 0
    corruptions_detected: int = 0
    pages_recomputed: int = 0
    restarts: int = 0
    device_evictions: int = 0
    host_evictions: int = 0
    detection_reasons: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
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
        inject: A fault to inject into the host tier, or None.
        injections: How many times to inject it.
        gate: ``layer`` (layer i starts once verified) or ``all``.
        system_pages: Pages of each shared system prompt.
        new_tokens: Tokens generated per request.
        dtype: Cache dtype, ``float32`` or ``bfloat16``.
        seed: Seed of the weights and the workload.
        progress: Progress lines on stderr for runs longer than a few seconds.
    """

    model: Literal["tiny", "mixed"] = "tiny"
    scale: int = 1
    layers: int | None = None
    requests: int = 32
    devices: int = 1
    device_blocks: int = 20
    host_blocks: int = 64
    integrity: Literal["page", "off"] = "page"
    inject: InjectMode | None = None
    injections: int = 2
    gate: Literal["layer", "all"] = "layer"
    system_pages: tuple[int, ...] = (6, 8, 10)
    new_tokens: int = 8
    dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0
    progress: bool = True

    def check(self) -> None:
        """Raises ValueError naming the first bad option."""
        if self.model not in ("tiny", "mixed"):
            raise ValueError(f"model={self.model!r}; expected 'tiny' or 'mixed'")
        if self.integrity not in ("page", "off"):
            raise ValueError(f"integrity={self.integrity!r}; expected 'page' or 'off'")
        if self.inject is not None and self.inject not in INJECT_MODES:
            raise ValueError(f"inject={self.inject!r}; expected one of {', '.join(INJECT_MODES)}")
        if self.gate not in ("layer", "all"):
            raise ValueError(f"gate={self.gate!r}; expected 'layer' or 'all'")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}; expected 'float32' or 'bfloat16'")
        for name in ("scale", "requests", "devices", "device_blocks", "host_blocks",
                     "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"layers={self.layers} must be >= 1")
        if self.injections < 0:
            raise ValueError(f"injections={self.injections} must be >= 0")
        if not self.system_pages or min(self.system_pages) < 1:
            raise ValueError(f"system_pages={self.system_pages} must be positive page counts")


class _PrefixShrunk(Exception):
    """Raised from ``before_layer`` when a layer is released with a shorter prefix."""


# ---------------------------------------------------------------------------
# Fault injection
# ---------------------------------------------------------------------------


class FaultInjector:
    """Corrupts host-tier state after pages were offloaded, just before a hit loads them.

    The target is the middle host page of a prefix hit, so the verified prefix is
    non-empty and recovery keeps part of the hit. Modes:

    * ``bitflip``: flips one bit of one layer of the page in host memory, *after* its
      digest was made (straight into the pool bytes: ``write_block_bytes`` would
      re-digest). The first injection hits layer 0 (caught before any layer is
      consumed), the second the last layer (layers before it were already consumed:
      the request restarts from the verified prefix).
    * ``wrong-key``: swaps the index entries of the page and another host page.
    * ``stale-slot``: frees the page and lets another page reuse its slot while the
      index still holds the old ref.
    * ``one-shard``: flips a bit in one shard of one sharded layer only.

    Args:
        mode: One of ``INJECT_MODES``.
        limit: Injections to make.
    """

    def __init__(self, mode: InjectMode, limit: int = 2):
        if mode not in INJECT_MODES:
            raise ValueError(f"inject={mode!r}; expected one of {', '.join(INJECT_MODES)}")
        self.mode = mode
        self.limit = limit
        self.log: list[str] = []

    @property
    def count(self) -> int:
        return len(self.log)

    def before_load(self, server: PrefixCacheServer,
                    host_keys: Sequence[int]) -> Callable[[], None] | None:
        """Injects into one of ``host_keys`` (pinned, about to be loaded) if due.

        Returns:
            A cleanup to call once the load has been issued, or None.
        """
        if self.count >= self.limit or not host_keys:
            return None
        target = len(host_keys) // 2
        key = host_keys[target]
        if self.mode in ("bitflip", "one-shard"):
            self._flip(server, key, late=self.count % 2 == 1)
            return None
        if self.mode == "wrong-key":
            # Prefer a partner outside this request, so only the target is misnamed here.
            others = [k for k in server.host.keys() if k not in host_keys] or \
                list(host_keys[target + 1:])
            if not others:
                return None
            server.host.swap(key, others[-1])
            self.log.append(f"wrong-key: index entries of {key:#x} and {others[-1]:#x} swapped")
            return None
        return self._stale(server, key)

    def _flip(self, server: PrefixCacheServer, key: int, late: bool) -> None:
        mgr = server.mgr
        ref = server.host.get(key)
        layers = list(range(mgr.num_layers))
        if self.mode == "one-shard":
            layers = [i for i in layers if mgr.plan.class_of_layer(i)[0].num_shards > 1]
            if not layers:
                raise ValueError("one-shard injection needs a layer whose KV heads are split "
                                 "over devices (--devices 2 with an even KV head count)")
        layer = layers[-1] if late else layers[0]
        cls, pos = mgr.plan.class_of_layer(layer)
        pool = mgr.host_pool.pools[cls.index]
        if self.mode == "one-shard":
            shard = cls.num_shards - 1
            lo, hi = pool.shard_range(pos, shard)
            where = f"shard {shard} of {cls.num_shards} of layer {layer}"
        else:
            lo, hi = pool.layer_range(pos)
            where = f"layer {layer}"
        # Bit 6 of the top byte of a 32-bit word is an exponent bit of an f32 (or of
        # the upper bf16): with --integrity off the damage then shows in the tokens.
        byte = lo + ((hi - lo) // 2 & ~3) + 3
        pool.data[ref.slot, byte] ^= 0x40
        self.log.append(f"{self.mode}: flipped a bit of {where} of host page {ref}")

    def _stale(self, server: PrefixCacheServer, key: int) -> Callable[[], None] | None:
        mgr = server.mgr
        ref = server.host.get(key)
        mgr.free([ref])  # the index is (wrongly) not told: it keeps the stale ref
        # Refill the slot: host pools hand out the most recently freed slot first.
        # Prefer a real write-back of a cold device page that has no host copy yet.
        cold = [(b, k) for b, k in server.blocks.cold_pages() if k not in server.host]
        block, new_key = cold[0] if cold else (0, _SCRATCH_KEY)
        new = mgr.offload(server.kv, [block], [new_key]).wait()[0]
        server.stats.pages_offloaded += 1
        server.stats.bytes_offloaded += mgr.plan.page_bytes
        reused = "reused by" if new.slot == ref.slot else "freed; slot not reused, new page at"
        self.log.append(f"stale-slot: {ref} {reused} {new}")
        if cold:
            server.host.put(new_key, new)
            return None
        return lambda: mgr.free([new])


# ---------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------


class PrefixCacheServer:
    """Serves requests one at a time over paged KV caches with a two-tier prefix cache.

    Args:
        model: The decoder.
        kv_caches: Its KV caches (one per layer, block dim first, possibly
            sharded over KV heads); the server owns them from now on.
        num_host_blocks: Host pages of the host tier.
        integrity: ``page`` or ``off`` (passed to the manager).
        gate: ``layer`` or ``all`` (how loads release layers).
        injector: Optional fault injector.

    Example:
        >>> m = _model.Model(_model.tiny_llama())  # doctest: +SKIP
        >>> with PrefixCacheServer(m, m.make_kv_caches(24), num_host_blocks=32) as s:
        ...     out = s.serve(Request(0, tuple(range(40)), 4))  # doctest: +SKIP
    """

    def __init__(self, model: _model.Model, kv_caches: Sequence[jax.Array], *,
                 num_host_blocks: int, integrity: Literal["page", "off"] = "page",
                 gate: Literal["layer", "all"] = "layer",
                 injector: FaultInjector | None = None):
        self.model = model
        self.kv = list(kv_caches)
        self.mgr = KVCacheManager(self.kv, num_host_blocks=num_host_blocks, integrity=integrity)
        self.blocks = DeviceBlocks(self.kv[0].shape[0])
        self.host = HostIndex()
        self.gate = gate
        self.injector = injector
        self.stats = ServeStats()

    def close(self) -> None:
        self.mgr.close()

    def __enter__(self) -> PrefixCacheServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- warm-up ----------------------------------------------------------------

    def warm_up(self, max_pages: int) -> None:
        """Compiles the transfer programs for every bucket of page counts up to ``max_pages``.

        Offloads and loads back blocks of the still-empty caches, so time-to-first-token
        measures transfers, not compilation.
        """
        limit = min(max_pages, self.mgr.num_free_pages, self.blocks.num_free)
        sizes = sorted({min(1 << e, limit) for e in range(max(limit, 1).bit_length() + 1)})
        for k in sizes:
            ids = list(range(k))
            pages = self.mgr.offload(self.kv, ids, [_SCRATCH_KEY + j for j in ids]).wait()
            self.kv, load = self.mgr.load(self.kv, pages, ids, gate=self.gate)
            for i in range(self.mgr.num_layers):
                load.layer_ready(i)
            result = load.result()
            if result.verified_prefix != k:
                raise IntegrityError(f"warm-up load of {k} empty pages failed: {result}")
            self.mgr.free(pages)
        jax.block_until_ready(self.kv)

    # -- tiers --------------------------------------------------------------------

    def _make_host_room(self, n: int) -> int:
        """Frees least recently used unpinned host pages until ``n`` slots are free."""
        while self.mgr.num_free_pages < n:
            key = self.host.coldest_unpinned()
            if key is None:
                break
            self.mgr.free([self.host.pop(key)])
            self.stats.host_evictions += 1
        return min(n, self.mgr.num_free_pages)

    def _write_back(self, victims: Sequence[tuple[int, int]]) -> None:
        """Copies evicted device pages to host (unless host already holds them)."""
        todo = []
        for block, key in victims:
            if key in self.host:  # inclusive tiers: a promoted page kept its host copy
                self.host.touch(key)
            else:
                todo.append((block, key))
        # Victims come least recently used first, a prompt's deepest page before its
        # shallower ones; when host is short keep the later ones, which more requests
        # of that prompt can use.
        room = self._make_host_room(len(todo))
        todo = todo[len(todo) - room:]
        if not todo:
            return
        refs = self.mgr.offload(self.kv, [b for b, _ in todo], [k for _, k in todo]).wait()
        for (_, key), ref in zip(todo, refs):
            self.host.put(key, ref)
        self.stats.pages_offloaded += len(refs)
        self.stats.bytes_offloaded += len(refs) * self.mgr.plan.page_bytes

    def _allocate(self, n: int) -> list[int]:
        """``n`` free device blocks, offloading cold cached pages to host if short."""
        short = n - self.blocks.num_free
        if short > 0:
            victims = self.blocks.evict(short)
            if len(victims) < short:
                raise MemoryError(f"device blocks exhausted: {n} needed, "
                                  f"{self.blocks.num_free + len(victims)} free or evictable "
                                  f"of {self.blocks.num_blocks}; raise --device-blocks")
            # The blocks are reused only after their bytes are safely on host.
            self._write_back(victims)
            self.blocks.reclaim([b for b, _ in victims])
            self.stats.device_evictions += len(victims)
        return self.blocks.allocate(n)

    # -- one request ----------------------------------------------------------------

    def _forward(self, prompt: np.ndarray, table_ids: Sequence[int], first_page: int,
                 max_new_tokens: int, t0: float,
                 before_layer: Callable[[int], None] | None) -> tuple[list[int], float]:
        """Prefills pages ``first_page..`` and decodes; returns (tokens, ttft seconds).

        Mirrors ``Model.generate`` but stops the clock at the first token.
        """
        cfg, prm = self.model.cfg, self.model.params
        bt = self.model.block_table(table_ids)
        n_pages = -(-len(prompt) // cfg.block_size)
        hidden = None
        for page in range(first_page, n_pages):
            lo = page * cfg.block_size
            # prefill_page updates self.kv in place, so an exception from the hook
            # leaves the list holding the live (not donated) arrays.
            self.kv, hidden = self.model.prefill_page(self.kv, prompt[lo:lo + cfg.block_size],
                                                      bt, lo, before_layer)
        first = int(_model.greedy_token(prm.final_norm, prm.unembed, hidden,
                                        norm_eps=cfg.norm_eps))
        ttft = time.perf_counter() - t0
        self.kv, tokens = self.model.decode(self.kv, bt, len(prompt), hidden, max_new_tokens)
        if tokens and tokens[0] != first:
            raise RuntimeError(f"first token {first} differs from decode's {tokens[0]}")
        return tokens, ttft

    def serve(self, request: Request) -> RequestOutcome:
        """Serves one request: prefix lookup, promotion from host, prefill, decode.

        Raises:
            TransferError: a transfer or device failure (never treated as a miss).
            MemoryError: the request needs more device blocks than exist.
        """
        t0 = time.perf_counter()
        cfg = self.model.cfg
        bs = cfg.block_size
        prompt = np.asarray(request.prompt, np.int32)
        need = _model.blocks_needed(len(prompt), request.max_new_tokens, bs)
        keys = page_keys(prompt, bs)
        # The page holding the last prompt token is always computed: its hidden state
        # gives the first token, and a block being written is then never shared.
        cacheable = keys[:(len(prompt) - 1) // bs]

        # tiers[j]: the shared device block of hit page j, or None for a host page.
        tiers: list[int | None] = []
        for key in cacheable:
            block = self.blocks.lookup(key)
            if block is not None:
                self.blocks.acquire(block)
                tiers.append(block)
            elif key in self.host:
                self.host.pin(key)  # not evictable while this request loads it
                tiers.append(None)
            else:
                break
        hit = len(tiers)
        host_pos = [j for j, t in enumerate(tiers) if t is None]
        host_keys = [keys[j] for j in host_pos]
        try:
            fresh = iter(self._allocate(need - (hit - len(host_pos))))
        except BaseException:
            self._abandon([t for t in tiers if t is not None], host_keys)
            raise
        table_ids = [tiers[j] if j < hit and tiers[j] is not None else next(fresh)
                     for j in range(need)]
        try:
            return self._serve_held(request, t0, prompt, keys, tiers, host_pos, host_keys,
                                    table_ids)
        except BaseException:
            # A transfer or device failure is an error, not a miss: publish nothing,
            # give back every block this request holds, and let it propagate.
            self._abandon(table_ids, host_keys)
            raise

    def _abandon(self, blocks: Sequence[int], host_keys: Sequence[int]) -> None:
        for block in blocks:
            self.blocks.release(block)
        for key in host_keys:
            self.host.unpin(key)

    def _serve_held(self, request: Request, t0: float, prompt: np.ndarray,
                    keys: list[int], tiers: list[int | None], host_pos: list[int],
                    host_keys: list[int], table_ids: list[int]) -> RequestOutcome:
        """``serve`` once the request holds its blocks (``table_ids``)."""
        hit = len(tiers)
        bs = self.model.cfg.block_size
        handle: LoadHandle | None = None
        if host_pos:
            cleanup = self.injector.before_load(self, host_keys) if self.injector else None
            refs = [self.host.get(k) for k in host_keys]
            self.kv, handle = self.mgr.load(self.kv, refs, [table_ids[j] for j in host_pos],
                                            keys=host_keys, gate=self.gate)
            if cleanup is not None:
                cleanup()
            self.stats.pages_loaded += len(refs)
            self.stats.bytes_loaded += len(refs) * self.mgr.plan.page_bytes

        def wait_layer(i: int) -> None:
            # Layer i may run only once its host pages are verified, and only if all
            # of them are: a shorter released prefix means this pass must stop here.
            if handle.layer_ready(i) < len(host_pos):
                raise _PrefixShrunk(i)

        usable, restarted, shrunk = hit, False, False
        try:
            tokens, ttft = self._forward(prompt, table_ids, hit, request.max_new_tokens, t0,
                                         wait_layer if handle is not None else None)
        except _PrefixShrunk:
            shrunk = True
        except BaseException:
            if handle is not None:  # its copies must end before the blocks are reused
                try:
                    handle.result()
                except Exception:
                    pass
            raise
        if handle is not None:
            # After a stopped pass this also waits for the copies into the remaining
            # layers, which must land before the recomputation overwrites those blocks.
            result = handle.result()
            self._account_load(result.verified_prefix, result.reasons)
            if not shrunk and result.verified_prefix < len(host_pos):
                # Impossible with a correct manager: the hook saw every layer released
                # with the full prefix.
                raise IntegrityError(f"request {request.rid}: load ended with prefix "
                                     f"{result.verified_prefix} after every layer was "
                                     f"released with {len(host_pos)}: {result}")
        if shrunk:
            restarted = result.consumed_before_failure
            usable = host_pos[result.verified_prefix]
            # The manager already freed the invalid pages: forget them, do not free.
            for idx in result.invalid_pages:
                self.host.pop(host_keys[idx])
            # Shared device pages past the verified prefix are swapped for private
            # blocks, so the recomputation never writes a block other requests read.
            for j in range(usable, hit):
                if tiers[j] is not None:
                    private = self._allocate(1)[0]
                    self.blocks.release(tiers[j])
                    tiers[j], table_ids[j] = None, private
            self.stats.pages_recomputed += hit - usable
            self.stats.restarts += int(restarted)
            tokens, ttft = self._forward(prompt, table_ids, usable, request.max_new_tokens, t0,
                                         None)

        device_pages = sum(1 for j in range(usable) if tiers[j] is not None)
        host_pages = usable - device_pages
        kind = ("recovered" if shrunk else "host_hit" if host_pages else
                "device_hit" if device_pages else "miss")
        computed = -(-len(prompt) // bs) - usable
        st = self.stats
        st.requests += 1
        st.device_hits += device_pages
        st.host_hits += host_pages
        st.computed_pages += computed
        outcome = RequestOutcome(request.rid, tuple(tokens), ttft, kind, device_pages,
                                 host_pages, computed, hit - usable, restarted)
        self._finish(keys, tiers, table_ids, usable, host_keys)  # last: it drops the blocks
        return outcome

    def _account_load(self, verified: int, reasons: dict[int, str]) -> None:
        if self.mgr.integrity == "page":
            self.stats.pages_verified += verified
        self.stats.corruptions_detected += len(reasons)
        self.stats.detection_reasons.extend(reasons.values())

    def _finish(self, keys: Sequence[int], tiers: Sequence[int | None],
                table_ids: Sequence[int], usable: int, host_keys: Sequence[int]) -> None:
        """Publishes the request's full prompt pages and drops its block references."""
        for j in range(len(keys)):
            if not (j < usable and tiers[j] is not None):
                # Computed here, or promoted from host and verified: now device-cached.
                # A duplicate key (an older copy survived) leaves this block private.
                self.blocks.publish(keys[j], table_ids[j])
        # Deepest pages go cold first, so the LRU evicts them before their prefixes.
        for block in reversed(table_ids):
            self.blocks.release(block)
        for key in host_keys:
            if key in self.host:
                self.host.unpin(key)
                self.host.touch(key)


# ---------------------------------------------------------------------------
# Workload, sharding, reference
# ---------------------------------------------------------------------------


def make_workload(cfg: _model.ModelConfig, num_requests: int, seed: int = 0, *,
                  system_pages: Sequence[int] = (6, 8, 10), new_tokens: int = 8) -> list[Request]:
    """Requests sharing a few long system prompts, each with a short unique suffix.

    The first requests take the system prompts in turn (so every prompt is cached
    early); later ones pick one at random. Suffixes are 1..block_size-1 tokens, so
    every prompt ends in a partial page that is computed, never cached.

    Example:
        >>> reqs = make_workload(_model.tiny_llama(), 4, system_pages=(2, 3))
        >>> [r.system for r in reqs][:2], [len(r.prompt) // 16 for r in reqs][:2]
        ([0, 1], [2, 3])
        >>> all(len(r.prompt) % 16 for r in reqs)  # every prompt ends in a partial page
        True
    """
    bs = cfg.block_size
    rng = np.random.default_rng([seed, 7])
    systems = [rng.integers(1, cfg.vocab_size, n * bs) for n in system_pages]
    out = []
    for rid in range(num_requests):
        s = rid % len(systems) if rid < len(systems) else int(rng.integers(len(systems)))
        suffix = rng.integers(1, cfg.vocab_size, int(rng.integers(1, bs)))
        prompt = np.concatenate([systems[s], suffix]).astype(np.int32)
        out.append(Request(rid, tuple(int(t) for t in prompt), new_tokens, s))
    return out


def shard_caches(caches: Sequence[jax.Array], devices: Sequence[Any]) -> list[jax.Array]:
    """Places caches over ``devices``: KV heads (dim 3) split where they divide evenly.

    Layers whose head count does not divide are replicated (the manager stores a
    replicated layer once and loads it into every replica). The block dim is never
    sharded: the manager moves whole blocks per shard.
    """
    if len(devices) == 1:
        return [jax.device_put(a, devices[0]) for a in caches]
    mesh = jax.sharding.Mesh(np.array(devices), ("kv",))
    P = jax.sharding.PartitionSpec
    return [jax.device_put(a, jax.sharding.NamedSharding(
        mesh, P(None, None, None, "kv", None) if a.shape[3] % len(devices) == 0 else P()))
        for a in caches]


def reference_tokens(model: _model.Model, requests: Sequence[Request],
                     make_caches: Callable[[], list[jax.Array]],
                     progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """Generates every request with a fresh cache and no prefix reuse (``Model.generate``)."""
    out = []
    for r in requests:
        need = _model.blocks_needed(len(r.prompt), r.max_new_tokens, model.cfg.block_size)
        _, toks = model.generate(make_caches(), r.prompt, list(range(need)), r.max_new_tokens)
        out.append(list(toks))
        if progress is not None:
            progress(len(out))
    return out


# ---------------------------------------------------------------------------
# The demo
# ---------------------------------------------------------------------------


class _Progress:
    """Progress lines on stderr, only once a run has taken a few seconds."""

    def __init__(self, enabled: bool, after_s: float = 3.0, every_s: float = 2.0):
        self.enabled = enabled
        self.start = time.perf_counter()
        self.after_s, self.every_s = after_s, every_s
        self.last = -1e9

    def __call__(self, text: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.start < self.after_s:
            return
        if force or now - self.last >= self.every_s:
            self.last = now
            print(f"kvxfer demo [{now - self.start:5.1f} s] {text}", file=sys.stderr, flush=True)


def _ensure_devices(n: int) -> list[Any]:
    """The first ``n`` devices, asking XLA:CPU for more if JAX has not started yet."""
    if n > 1 and jax.config.jax_num_cpu_devices < n:
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # backends already initialized: use what exists
            pass
    devices = jax.devices()
    if len(devices) < n:
        raise ValueError(f"--devices {n}: JAX has {len(devices)} "
                         f"{devices[0].platform} device(s); on CPU start with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    return devices[:n]


def _median_ms(values: Sequence[float]) -> float | None:
    return round(float(np.median(values)) * 1e3, 3) if values else None


def _model_config(options: DemoOptions, requests_need: int) -> _model.ModelConfig:
    base = _model.tiny_llama() if options.model == "tiny" else _model.mixed_layers()
    return _model.scaled(base, options.scale, num_layers=options.layers,
                         max_blocks_per_seq=max(base.max_blocks_per_seq, requests_need))


def run_demo(options: DemoOptions | argparse.Namespace | None = None, **overrides: Any) -> dict:
    """Runs the serving demo and returns its summary.

    Serves a workload through :class:`PrefixCacheServer`, then compares every
    request's tokens with a run of the same requests with a fresh cache and no
    prefix reuse.

    Args:
        options: A ``DemoOptions``, the ``argparse`` namespace of ``kvxfer demo``,
            or None for the defaults.
        **overrides: ``DemoOptions`` fields to override.

    Returns:
        The summary: ``requests, device_hits, host_hits`` (pages served from each
        tier), ``bytes_offloaded, bytes_loaded, pages_verified,
        corruptions_detected, pages_recomputed, ttft_miss_ms, ttft_host_hit_ms,
        tokens_match`` and more (see ``format_summary``).

    Raises:
        ValueError: a bad option (e.g. too few device blocks for a request).

    Example:
        >>> s = run_demo(requests=6, inject="bitflip", progress=False)  # doctest: +SKIP
        >>> s["corruptions_detected"] > 0 and s["tokens_match"]  # doctest: +SKIP
        True
    """
    opts = _options(options, overrides)
    t_start = time.perf_counter()
    devices_n = opts.devices
    if opts.inject == "one-shard" and devices_n < 2:
        devices_n = 2  # corruption on one shard needs at least two shards
    devices = _ensure_devices(devices_n)
    progress = _Progress(opts.progress)

    bs = _model.tiny_llama().block_size
    # The longest prompt: the longest system prompt and a suffix of bs - 1 tokens.
    max_need = _model.blocks_needed(max(opts.system_pages) * bs + bs - 1, opts.new_tokens, bs)
    cfg = _model_config(opts, max_need)
    requests = make_workload(cfg, opts.requests, opts.seed, system_pages=opts.system_pages,
                             new_tokens=opts.new_tokens)
    if opts.device_blocks < max_need:
        raise ValueError(f"--device-blocks {opts.device_blocks} is too few: a request needs "
                         f"up to {max_need} blocks")
    if opts.inject == "one-shard" and not any(
            lkv.num_kv_heads % len(devices) == 0 for lkv in cfg.layers):
        raise ValueError(f"--inject one-shard needs a layer whose KV heads split over "
                         f"{len(devices)} devices; the layers have "
                         f"{sorted({lkv.num_kv_heads for lkv in cfg.layers})} KV heads "
                         "(use --devices 2 or raise --scale)")
    model = _model.Model(cfg, seed=opts.seed)
    dtype = jnp.dtype(opts.dtype)

    def fresh_caches() -> list[jax.Array]:
        return shard_caches(model.make_kv_caches(opts.device_blocks, dtype), devices)

    # The reference first: it also compiles the model's programs, so the served
    # requests' time-to-first-token does not include compilation.
    t0 = time.perf_counter()
    reference = reference_tokens(model, requests, fresh_caches,
                                 lambda i: progress(f"reference run {i}/{len(requests)}"))
    reference_s = time.perf_counter() - t0

    injector = FaultInjector(opts.inject, opts.injections) if opts.inject else None
    outcomes: list[RequestOutcome] = []
    with PrefixCacheServer(model, fresh_caches(), num_host_blocks=opts.host_blocks,
                           integrity=opts.integrity, gate=opts.gate, injector=injector) as srv:
        progress("warm-up: compiling the transfer programs", force=True)
        t0 = time.perf_counter()
        srv.warm_up(max(opts.system_pages))
        warmup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for r in requests:
            outcomes.append(srv.serve(r))
            st = srv.stats
            progress(f"served {len(outcomes)}/{len(requests)} (pages from device "
                     f"{st.device_hits}, host {st.host_hits}; corruptions "
                     f"{st.corruptions_detected})")
        serve_s = time.perf_counter() - t0
        stats, plan = srv.stats, srv.mgr.plan
        paths = sorted(set(srv.mgr.paths))
    sharded = sum(len(c.layers) for c in plan.classes if c.num_shards > 1)

    mismatched = [o.rid for o, ref in zip(outcomes, reference) if list(o.tokens) != ref]
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for o in outcomes:
        by_kind[o.kind].append(o.ttft_s)
    progress("done", force=True)
    return {
        "requests": stats.requests,
        "device_hits": stats.device_hits,
        "host_hits": stats.host_hits,
        "computed_pages": stats.computed_pages,
        "requests_by_kind": {k: len(by_kind.get(k, ())) for k in
                             ("miss", "device_hit", "host_hit", "recovered")},
        "pages_offloaded": stats.pages_offloaded,
        "bytes_offloaded": stats.bytes_offloaded,
        "pages_loaded": stats.pages_loaded,
        "bytes_loaded": stats.bytes_loaded,
        "pages_verified": stats.pages_verified,
        "corruptions_detected": stats.corruptions_detected,
        "pages_recomputed": stats.pages_recomputed,
        "restarts": stats.restarts,
        "device_evictions": stats.device_evictions,
        "host_evictions": stats.host_evictions,
        "ttft_miss_ms": _median_ms(by_kind["miss"]),
        "ttft_device_hit_ms": _median_ms(by_kind["device_hit"]),
        "ttft_host_hit_ms": _median_ms(by_kind["host_hit"]),
        "ttft_recovered_ms": _median_ms(by_kind["recovered"]),
        "tokens_match": not mismatched,
        "mismatched_requests": mismatched,
        "integrity": opts.integrity,
        "inject": opts.inject,
        "injections": injector.log if injector else [],
        "detections": stats.detection_reasons,
        "gate": opts.gate,
        "model": opts.model,
        "layers": cfg.num_layers,
        "scale": opts.scale,
        "dtype": opts.dtype,
        "devices": len(devices),
        "sharded_layers": sharded,
        "device_blocks": opts.device_blocks,
        "host_blocks": opts.host_blocks,
        "page_bytes": plan.page_bytes,
        "slice_classes": len(plan.classes),
        "transfer_paths": paths,
        "seed": opts.seed,
        "reference_s": round(reference_s, 3),
        "warmup_s": round(warmup_s, 3),
        "serve_s": round(serve_s, 3),
        "time_s": round(time.perf_counter() - t_start, 3),
    }


def _options(options: DemoOptions | argparse.Namespace | None,
             overrides: dict[str, Any]) -> DemoOptions:
    if options is None:
        opts = DemoOptions()
    elif isinstance(options, DemoOptions):
        opts = options
    elif isinstance(options, argparse.Namespace):
        names = {f.name for f in dataclasses.fields(DemoOptions)}
        opts = DemoOptions(**{k: v for k, v in vars(options).items() if k in names})
    else:
        raise TypeError(f"options: expected DemoOptions or argparse.Namespace. Got "
                        f"{options!r} of type {type(options)}")
    if overrides:
        opts = dataclasses.replace(opts, **overrides)
    if isinstance(opts.system_pages, list):
        opts = dataclasses.replace(opts, system_pages=tuple(opts.system_pages))
    opts.check()
    return opts


def format_summary(summary: dict) -> str:
    """The human-readable summary table of a ``run_demo`` result."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} ms"

    kinds = summary["requests_by_kind"]
    rows = [
        ["requests", summary["requests"],
         ", ".join(f"{k} {v}" for k, v in kinds.items())],
        ["device_hits", summary["device_hits"], "prompt pages served from device blocks"],
        ["host_hits", summary["host_hits"], "prompt pages promoted from host and used"],
        ["computed_pages", summary["computed_pages"], "prompt pages computed"],
        ["bytes_offloaded", format_bytes(summary["bytes_offloaded"]),
         f"{summary['pages_offloaded']} pages of {format_bytes(summary['page_bytes'])}"],
        ["bytes_loaded", format_bytes(summary["bytes_loaded"]),
         f"{summary['pages_loaded']} pages"],
        ["pages_verified", summary["pages_verified"], f"integrity={summary['integrity']}"],
        ["corruptions_detected", summary["corruptions_detected"],
         f"inject={summary['inject'] or 'none'}"],
        ["pages_recomputed", summary["pages_recomputed"],
         f"restarts {summary['restarts']}"],
        ["ttft_miss_ms", ms(summary["ttft_miss_ms"]), "median"],
        ["ttft_device_hit_ms", ms(summary["ttft_device_hit_ms"]), "median"],
        ["ttft_host_hit_ms", ms(summary["ttft_host_hit_ms"]), "median"],
        ["ttft_recovered_ms", ms(summary["ttft_recovered_ms"]), "median"],
        ["tokens_match", summary["tokens_match"],
         "vs. no cache" + (f"; differ: {summary['mismatched_requests']}"
                           if summary["mismatched_requests"] else "")],
        ["time_s", f"{summary['time_s']:.2f}",
         f"reference {summary['reference_s']:.2f}, warm-up {summary['warmup_s']:.2f}, "
         f"serve {summary['serve_s']:.2f}"],
    ]
    head = [
        f"kvxfer demo: model={summary['model']} layers={summary['layers']} "
        f"scale={summary['scale']} dtype={summary['dtype']} "
        f"slice_classes={summary['slice_classes']} devices={summary['devices']} "
        f"(KV heads split in {summary['sharded_layers']} layers)",
        f"tiers: device_blocks={summary['device_blocks']} "
        f"host_blocks={summary['host_blocks']} paths={','.join(summary['transfer_paths'])} "
        f"gate={summary['gate']} integrity={summary['integrity']} "
        f"inject={summary['inject'] or 'none'}",
    ]
    lines = head + [table(rows, ["metric", "value", "note"])]
    lines += [f"injected: {t}" for t in summary["injections"]]
    lines += [f"detected: {t}" for t in summary["detections"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``kvxfer demo`` options to ``parser``."""
    d = DemoOptions()
    parser.add_argument("--model", choices=("tiny", "mixed"), default=d.model,
                        help="tiny: uniform layers; mixed: two slice classes (default tiny)")
    parser.add_argument("--scale", type=_positive, default=d.scale,
                        help="width multiplier: KV heads, d_model, ffn (default 1)")
    parser.add_argument("--layers", type=_positive, default=d.layers,
                        help="decoder layers (default: the preset's 4)")
    parser.add_argument("--requests", type=_positive, default=d.requests,
                        help=f"requests to serve (default {d.requests})")
    parser.add_argument("--devices", type=_positive, default=d.devices,
                        help="devices to shard KV heads over (default 1; CPU devices are "
                        "created as needed)")
    parser.add_argument("--device-blocks", type=_positive, default=d.device_blocks,
                        help=f"device KV blocks per layer (default {d.device_blocks}: few, "
                        "so cold pages go to host)")
    parser.add_argument("--host-blocks", type=_positive, default=d.host_blocks,
                        help=f"host pages (default {d.host_blocks})")
    parser.add_argument("--integrity", choices=("page", "off"), default=d.integrity,
                        help="page: verify page digests on load (default); off: skip")
    parser.add_argument("--inject", choices=INJECT_MODES, default=None,
                        help="corrupt host pages after offload: bitflip, wrong-key, "
                        "stale-slot, one-shard (forces --devices >= 2)")
    parser.add_argument("--injections", type=int, default=d.injections,
                        help=f"how many times to inject (default {d.injections})")
    parser.add_argument("--gate", choices=("layer", "all"), default=d.gate,
                        help="release each layer once verified (default) or all at once")
    parser.add_argument("--system-pages", type=_positive, nargs="+", default=d.system_pages,
                        help="pages of each shared system prompt (default 6 8 10)")
    parser.add_argument("--new-tokens", type=_positive, default=d.new_tokens,
                        help=f"tokens generated per request (default {d.new_tokens})")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype,
                        help="KV cache dtype (default float32)")
    parser.add_argument("--seed", type=int, default=d.seed, help="weights and workload seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", dest="progress", action="store_false",
                        help="no progress lines on stderr")


def _cmd_demo(args: argparse.Namespace) -> int:
    summary = run_demo(args)
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0 if summary["tokens_match"] else 1


_DESCRIPTION = ("Serves requests that share long system prompts through a two-tier "
                "prefix cache: device blocks, and host pages moved and verified by "
                "kvxfer. Checks every request's tokens against a run with no cache; "
                "exits 1 if any differ.")


def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Adds the ``demo`` subcommand to an ``argparse`` subparsers object.

    The command's handler is ``args.func(args) -> exit status``.

    Example:
        >>> p = argparse.ArgumentParser(prog="kvxfer")
        >>> sub = p.add_subparsers(dest="command")
        >>> _ = register_cli(sub)
        >>> p.parse_args(["demo", "--inject", "bitflip"]).inject
        'bitflip'
    """
    p = subparsers.add_parser("demo", help="serving loop with a verified host-tier prefix cache",
                              description=_DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvxfer.demo [options]``: the ``kvxfer demo`` command on its own."""
    parser = argparse.ArgumentParser(prog="python -m kvxfer.demo", description=_DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return _cmd_demo(args)
    except (ValueError, MemoryError) as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"kvxfer demo: error: {message}", file=sys.stderr)
        return 2
