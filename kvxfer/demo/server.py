"""The demo's server: requests served one at a time through a tiered prefix cache.

Requests share long system prompts. Their full prompt pages are cached under a
chained hash of their tokens (``page_keys``), first in device blocks (the device
tier, ``DeviceBlocks``), once device blocks run short in host memory (the host
tier, :class:`kvxfer.HostCache` over a :class:`kvxfer.KVCacheManager`) and,
given a store, below host memory (a local disk or Redis store tier):

* **Host tier**: cold pages are offloaded with ``cache.put(..., wait=True)`` before
  their device blocks are reused. A later prefix hit pins them with
  ``cache.lookup(keys)`` and promotes them back with ``cache.load(...)``; the
  forward pass of layer ``i`` waits in the model's ``before_layer`` hook until
  ``load.layer_ready(i)`` releases it.
* **Store tier**: pages evicted from host memory are written to the store (and every
  host page at ``close()``); a lookup imports store pages into host memory, and
  the load checks them on the device against the digests made at their first
  offload, in this process or another one.
* **Recovery**: a page that fails verification is a cache miss. The request keeps
  the verified prefix and recomputes the rest; if a layer was already consumed with
  a longer prefix than the final one, the request restarts from the verified
  prefix.
* **Errors**: a transfer or device failure is an error, never a miss: the request
  publishes nothing, gives back its blocks, and the error propagates.

Example:
    >>> from kvxfer.demo import model
    >>> m = model.Model(model.tiny_llama())
    >>> with PrefixCacheServer(m, m.make_kv_caches(8), num_host_blocks=4) as srv:
    ...     first = srv.serve(Request(0, tuple(range(1, 40)), 2))
    ...     again = srv.serve(Request(1, tuple(range(1, 40)), 2))
    >>> first.kind, again.kind, again.device_pages, again.tokens == first.tokens
    ('miss', 'device_hit', 2, True)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import jax
import numpy as np

from kvxfer.cache import CacheHit, CacheLoad, HostCache
from kvxfer.demo import model as _model
from kvxfer.demo.tiers import SCRATCH_KEY, DeviceBlocks, page_keys
from kvxfer.manager import Gate, IntegrityError, IntegrityMode, KVCacheManager
from kvxfer.store import Store

__all__ = ["Request", "RequestKind", "RequestOutcome", "ServeStats", "Injector",
           "PrefixCacheServer"]

RequestKind = Literal["miss", "device_hit", "host_hit", "recovered"]
"""How a request's prompt was served (see ``RequestOutcome.kind``)."""


@dataclasses.dataclass(frozen=True, slots=True)
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


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What serving one request did.

    Attributes:
        rid: Request id.
        tokens: Generated tokens.
        ttft_s: Seconds from request start to the first generated token.
        kind: ``miss``, ``device_hit``, ``host_hit`` (host pages used), or
            ``recovered`` (a host page failed verification and was recomputed).
        device_pages: Prompt pages served from device blocks.
        host_pages: Prompt pages loaded from host memory and used (promoted from the
            store or not).
        computed_pages: Prompt pages computed.
        recomputed_pages: Cache hits dropped because a host page failed.
        restarted: A layer had been consumed with a longer prefix than the
            verified one, so the request restarted from the verified prefix.
    """

    rid: int
    tokens: tuple[int, ...]
    ttft_s: float
    kind: RequestKind
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
    detection_reasons: list[str] = dataclasses.field(default_factory=list)


class Injector(Protocol):
    """What the server calls to damage its cached pages (``kvxfer.demo.FaultInjector``).

    The server knows only these two hooks; an injector reaches the tiers through the
    server it is handed (``cache``, ``mgr``, ``blocks``, ``kv``, ``stats``).
    """

    def before_lookup(self, server: PrefixCacheServer, keys: Sequence[int]) -> None:
        """Called with the keys a request is about to look up below the device tier."""

    def before_load(self, server: PrefixCacheServer, hit: CacheHit
                    ) -> tuple[CacheHit, Callable[[], None] | None]:
        """Called with a pinned hit about to load: the hit to load, and a cleanup to
        call once the load is issued (or None)."""


class _PrefixShrunk(Exception):
    """Raised from ``before_layer`` when a layer is released with a shorter prefix."""


class PrefixCacheServer:
    """Serves requests one at a time over paged KV caches with a two-tier prefix cache.

    Args:
        model: The decoder.
        kv_caches: Its KV caches (one per layer, block dim first, possibly
            sharded over KV heads); the server owns them from now on.
        num_host_blocks: Host pages of the host tier.
        integrity: ``page`` or ``off`` (passed to the manager).
        gate: ``layer`` or ``all`` (how loads release layers).
        injector: Optional fault injector (an ``Injector``), called before each lookup
            and load.
        store: Optional store tier below host memory (the server does not close it).
        namespace: Prefixes the store keys: pages are shared only between servers of
            the same model (its geometry is in the keys already; its weights are not).
            Required with a ``store`` (``command.demo_namespace`` names what changes
            the demo's KV).
    """

    def __init__(self, model: _model.Model, kv_caches: Sequence[jax.Array], *,
                 num_host_blocks: int, integrity: IntegrityMode = "page",
                 gate: Gate = "layer", injector: Injector | None = None,
                 store: Store | None = None, namespace: str | None = None):
        self.model = model
        self.kv = list(kv_caches)
        self.mgr = KVCacheManager(self.kv, num_host_blocks=num_host_blocks, integrity=integrity)
        self.cache = HostCache(self.mgr, store, namespace=namespace)
        self.blocks = DeviceBlocks(self.kv[0].shape[0])
        self.gate = gate
        self.injector = injector
        self.stats = ServeStats()
        self._closed = False

    def close(self) -> None:
        """With a store, writes every cached page it lacks (so a later run finds them)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.cache.store is not None:
                self._spill_device_pages()
                self.cache.flush()
        finally:
            self.cache.close()
            self.mgr.close()

    def _spill_device_pages(self) -> None:
        """Device-cached pages go through host memory into the store, a poolful a time."""
        todo = [(b, k) for b, k in self.blocks.cached_pages() if self.cache.find(k) is None]
        step = self.mgr.host_pool.num_slots
        for i in range(0, len(todo), step):
            chunk = todo[i:i + step]
            self.cache.put(self.kv, [b for b, _ in chunk], [k for _, k in chunk], wait=True)
            self.cache.flush()

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
            pages = self.mgr.offload(self.kv, ids, [SCRATCH_KEY + j for j in ids]).wait()
            self.kv, load = self.mgr.load(self.kv, pages, ids, gate=self.gate)
            for i in range(self.mgr.num_layers):
                load.layer_ready(i)
            result = load.result()
            if result.verified_prefix != k:
                raise IntegrityError(f"warm-up load of {k} empty pages failed: {result}")
            self.mgr.free(pages)
        jax.block_until_ready(self.kv)

    # -- tiers --------------------------------------------------------------------

    def _write_back(self, victims: Sequence[tuple[int, int]]) -> None:
        """Copies evicted device pages to host (the cache skips pages it holds)."""
        # Victims come least recently used first, a prompt's deepest page before its
        # shallower ones; when host is short keep the later ones, which more requests
        # of that prompt can use.
        fresh = [(b, k) for b, k in victims if k not in self.cache]
        room = self.cache.make_room(len(fresh))
        todo = [(b, k) for b, k in victims if k in self.cache] + fresh[len(fresh) - room:]
        new = self.cache.put(self.kv, [b for b, _ in todo], [k for _, k in todo], wait=True)
        self.stats.pages_offloaded += len(new)
        self.stats.bytes_offloaded += len(new) * self.mgr.plan.page_bytes

    def allocate_blocks(self, n: int) -> list[int]:
        """Takes ``n`` free device blocks, offloading cold cached pages to host if short.

        Raises:
            MemoryError: fewer than ``n`` blocks are free or evictable (nothing taken).
        """
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

        # tiers[j]: the shared device block of hit page j, or None for a page in host
        # memory or the store.
        tiers: list[int | None] = []
        for key in cacheable:
            block = self.blocks.lookup(key)
            if block is not None:
                self.blocks.acquire(block)
                tiers.append(block)
            elif self.cache.find(key) is not None:
                tiers.append(None)
            else:
                break
        host_keys = [keys[j] for j, t in enumerate(tiers) if t is None]
        if host_keys and self.injector is not None:
            self.injector.before_lookup(self, host_keys)
        # Pins the host pages (not evictable while this request loads them) and imports
        # store pages into host memory; a store page found damaged is a miss there.
        hit_pages = self.cache.lookup(host_keys) if host_keys else CacheHit((), (), ())
        host_pos = [j for j, t in enumerate(tiers) if t is None][:hit_pages.num_pages]
        if hit_pages.num_pages < len(host_keys):
            cut = [j for j, t in enumerate(tiers) if t is None][hit_pages.num_pages]
            for block in tiers[cut:]:
                if block is not None:
                    self.blocks.release(block)
            del tiers[cut:]
        hit = len(tiers)
        try:
            fresh = iter(self.allocate_blocks(need - (hit - len(host_pos))))
        except BaseException:
            self._abandon([t for t in tiers if t is not None], hit_pages)
            raise
        table_ids = [tiers[j] if j < hit and tiers[j] is not None else next(fresh)
                     for j in range(need)]
        held = [hit_pages]  # the pins, until a load takes them over
        try:
            return self._serve_held(request, t0, prompt, keys, tiers, host_pos, held,
                                    table_ids)
        except BaseException:
            # A transfer or device failure is an error, not a miss: publish nothing,
            # give back every block this request holds, and let it propagate.
            self._abandon(table_ids, held[0])
            raise

    def _abandon(self, blocks: Sequence[int], hit: CacheHit | None) -> None:
        for block in blocks:
            self.blocks.release(block)
        if hit is not None:
            self.cache.release(hit)

    def _serve_held(self, request: Request, t0: float, prompt: np.ndarray,
                    keys: list[int], tiers: list[int | None], host_pos: list[int],
                    held: list[CacheHit | None], table_ids: list[int]) -> RequestOutcome:
        """``serve`` once the request holds its blocks (``table_ids``) and host pins."""
        hit = len(tiers)
        bs = self.model.cfg.block_size
        handle: CacheLoad | None = None
        pages = held[0]
        if host_pos:
            cleanup = None
            if self.injector is not None:
                pages, cleanup = self.injector.before_load(self, pages)
            self.kv, handle = self.cache.load(self.kv, pages, [table_ids[j] for j in host_pos],
                                              gate=self.gate)
            held[0] = None  # the load releases the pins when it settles
            if cleanup is not None:
                cleanup()
            self.stats.pages_loaded += pages.num_pages
            self.stats.bytes_loaded += pages.num_pages * self.mgr.plan.page_bytes
        else:
            self.cache.release(pages)
            held[0] = None

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
            # The cache dropped the pages proven bad from every tier; intact pages past
            # the verified prefix stay cached.
            # Shared device pages past the verified prefix are swapped for private
            # blocks, so the recomputation never writes a block other requests read.
            for j in range(usable, hit):
                if tiers[j] is not None:
                    private = self.allocate_blocks(1)[0]
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
        self._finish(keys, tiers, table_ids, usable)  # last: it drops the blocks
        return outcome

    def _account_load(self, verified: int, reasons: dict[int, str]) -> None:
        if self.mgr.integrity == "page":
            self.stats.pages_verified += verified
        self.stats.corruptions_detected += len(reasons)
        self.stats.detection_reasons.extend(reasons.values())

    def _finish(self, keys: Sequence[int], tiers: Sequence[int | None],
                table_ids: Sequence[int], usable: int) -> None:
        """Publishes the request's full prompt pages and drops its block references."""
        for j in range(len(keys)):
            if not (j < usable and tiers[j] is not None):
                # Computed here, or promoted from host and verified: now device-cached.
                # A duplicate key (an older copy survived) leaves this block private.
                self.blocks.publish(keys[j], table_ids[j])
        # Deepest pages go cold first, so the LRU evicts them before their prefixes.
        for block in reversed(table_ids):
            self.blocks.release(block)
