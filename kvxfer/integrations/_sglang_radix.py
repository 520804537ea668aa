"""sglang-jax's radix cache acting on what kvxfer's host pool verified.

sglang-jax's ``UnifiedRadixCache.init_load_back`` un-tombstones a chain of host-only
nodes and the request is admitted with their tokens as its prefix; the load itself
(``finish_load_back``) runs later and its result is dropped. ``install()`` makes a
short verified load a recompute instead: the load runs, and is verified, before the
request is admitted, and the matched prefix is cut to the pages that verified.

The decision is ``load_back_verdict`` (a pure function of the flush plan and what the
pool's ``flush_load`` returned); the tree surgery uses the engine's own methods.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvxfer.integrations._sglang_pool import KvxferHostKVPool
from kvxfer.integrations._sglang_records import ENGINE_COMMIT

__all__ = ["LoadBackVerdict", "load_back_verdict", "install", "uninstall", "installed",
           "EngineMismatchError", "ENGINE_NAMES"]

if TYPE_CHECKING:
    from kvxfer.integrations._sglang_records import FlushLoadResult

log = logging.getLogger("kvxfer")

_BASE = 0  # sglang-jax's BASE_COMPONENT_TYPE (ComponentType.FULL)
_lock = threading.Lock()
_originals: list[tuple[Any, str, Any]] = []  # (owner, name, what it held): uninstall

_RADIX = "sgl_jax.srt.mem_cache.unified_radix_cache"
ENGINE_NAMES: tuple[tuple[str, str], ...] = (
    ("sgl_jax.srt.mem_cache.host_kv_pool", "LRUHostKVPool"),
    ("sgl_jax.srt.mem_cache.unified_cache_components", "EvictLayer.DEVICE"),
    (_RADIX, "UnifiedRadixCache.init_load_back"),
    (_RADIX, "UnifiedRadixCache._split_node"),
    (_RADIX, "UnifiedRadixCache._cascade_evict"),
    (_RADIX, "UnifiedRadixCache._update_evictable_leaf_sets"),
)
"""``(module, name)`` of each sglang-jax name ``install()`` rebinds or calls, as they
are at ``ENGINE_COMMIT``; ``install()`` checks them all before it changes anything."""


class EngineMismatchError(ImportError):
    """The sglang-jax importable here lacks a name ``install()`` needs (a version other
    than the one checked against); nothing was installed."""


def _engine_parts() -> dict[str, Any]:
    """Every ``ENGINE_NAMES`` entry, looked up (``"module:name"`` -> value), before
    anything is rebound.

    Raises:
      ImportError: sglang-jax is not importable at all.
      EngineMismatchError: a module or name is missing, or a module's import raised,
        naming the first one and the commit this integration was checked against.
    """
    import importlib

    try:
        importlib.import_module("sgl_jax")
    except ImportError as e:
        raise ImportError("kvxfer.integrations.sglang_jax.install() needs sglang-jax "
                          f"(the sgl_jax package) importable: {e}") from e
    found = {}
    for module_name, name in ENGINE_NAMES:
        missing = None
        try:
            value: Any = importlib.import_module(module_name)
        except ImportError as e:
            gone = getattr(e, "name", None) or ""
            if gone and module_name != gone and not module_name.startswith(gone + "."):
                raise ImportError(
                    f"kvxfer.integrations.sglang_jax.install(): importing {module_name} "
                    f"failed: {e}: a package sglang-jax needs is not installed (this is "
                    "not a version mismatch). Nothing was installed") from e
            missing = module_name
        except Exception as e:  # noqa: BLE001  (the engine's own import failed)
            first = (str(e).strip().splitlines() or [""])[0]
            raise EngineMismatchError(
                f"kvxfer.integrations.sglang_jax.install(): importing {module_name} "
                f"raised {type(e).__name__}: {first}; kvxfer's integration was checked "
                f"against sglang-jax commit {ENGINE_COMMIT}. Nothing was installed") from e
        else:
            owner_name = module_name
            for part in name.split("."):
                # init_load_back is wrapped where the class defines it, never inherited.
                holder = value.__dict__ if part == "init_load_back" else None
                if holder is not None and part not in holder or \
                        holder is None and not hasattr(value, part):
                    missing = f"{owner_name}.{part}"
                    break
                value = holder[part] if holder is not None else getattr(value, part)
                owner_name = f"{owner_name}.{part}"
        if missing is not None:
            raise EngineMismatchError(
                f"kvxfer.integrations.sglang_jax.install(): this sglang-jax has no "
                f"{missing}; kvxfer's integration was checked against sglang-jax commit "
                f"{ENGINE_COMMIT} (2026-08-21), whose names it rebinds and calls. "
                "Nothing was installed: use that sglang-jax, or a kvxfer checked against "
                "yours")
        found[f"{module_name}:{name}"] = value
    return found


@dataclasses.dataclass(frozen=True, slots=True)
class LoadBackVerdict:
    """What of a load-back's flush plan the engine may keep on device.

    Attributes:
      entries: leading plan entries (tree nodes) whose pages all verified.
      pages: leading verified pages of the entry after them (0 when there is none).
      dropped: host ids whose host copies failed their digests (kvxfer freed them):
        the nodes holding them must not keep their host copy.
      total: plan entries.
    """

    entries: int
    pages: int
    dropped: frozenset[int]
    total: int

    @property
    def ok(self) -> bool:
        """Every page of the plan verified."""
        return self.entries == self.total

    def kept_pages(self, plan: Sequence[tuple[Sequence[int], Sequence[int]]]) -> int:
        """Pages of ``plan`` that verified as a prefix (what the request may reuse)."""
        return sum(len(host) for host, _ in plan[:self.entries]) + self.pages


def load_back_verdict(plan: Sequence[tuple[Sequence[int], Sequence[int]]],
                      results: Sequence[FlushLoadResult | None]) -> LoadBackVerdict:
    """Decides how much of a load-back the engine keeps, from each entry's ``flush_load``.

    Args:
      plan: ``init_load_back``'s flush plan: per tree node, in root-to-leaf order,
        ``(host page ids, device page ids)``.
      results: per entry, what ``KvxferHostKVPool.flush_load`` returned, or None for
        an entry whose load raised or was never made (nothing of it verified).

    Returns:
      A ``LoadBackVerdict``: the verified prefix in entries and pages, and every host
      id dropped in any entry (an entry after the first miss may hold one too).

    Example:
        >>> from kvxfer.integrations.sglang_jax import FlushLoadResult
        >>> ok = FlushLoadResult((0, 1), (0, 1), (), (), {})
        >>> bad = FlushLoadResult((2, 3), (2,), (3,), (3,), {3: "digest"})
        >>> v = load_back_verdict([([0, 1], [5, 6]), ([2, 3], [7, 8])], [ok, bad])
        >>> v.entries, v.pages, sorted(v.dropped), v.ok
        (1, 1, [3], False)
        >>> v.kept_pages([([0, 1], [5, 6]), ([2, 3], [7, 8])])
        3

    Raises:
      ValueError: ``results`` and ``plan`` differ in length, or a result is for other
        host ids than its entry.
    """
    if len(results) != len(plan):
        raise ValueError(f"{len(results)} results for a flush plan of {len(plan)} entries")
    dropped: set[int] = set()
    for k, ((host, _), r) in enumerate(zip(plan, results)):
        if r is not None and tuple(int(i) for i in host) != tuple(r.host_ids):
            raise ValueError(f"result {k} is for host ids {list(r.host_ids)}, its plan "
                             f"entry names {[int(i) for i in host]}")
        if r is not None:
            dropped.update(r.dropped)
    entries = 0
    while entries < len(plan) and results[entries] is not None and results[entries].ok:
        entries += 1
    pages = 0
    if entries < len(plan) and results[entries] is not None:
        pages = results[entries].verified_pages
    return LoadBackVerdict(entries, pages, frozenset(dropped), len(plan))


def install() -> None:
    """Makes sglang-jax's HiCache use kvxfer's host pool and act on its verification.

    Rebinds ``sgl_jax.srt.mem_cache.host_kv_pool.LRUHostKVPool`` to
    ``KvxferHostKVPool`` (``init_hicache`` builds its host pool through that name),
    and wraps ``UnifiedRadixCache.init_load_back``: with a kvxfer pool it loads the
    un-tombstoned chain at once (after the cache's donation barrier, where the
    overlap scheduler sets one; the engine's scheduling step is donation-safe
    otherwise), waits for the verification, and when a page missed

    * splits the node holding the first missed page at it (the engine's
      ``_split_node``), returns the verified part, and tombstones the rest again:
      its device slots are freed, so the request recomputes those tokens;
    * drops the host copy of a node holding a dropped page (its host ids freed), so
      the tree never offers it again (a node with an intact host copy keeps it).

    The returned flush plan is empty (the load is done): ``finish_load_back`` has
    nothing left to scatter. The cost: a load-back no longer overlaps the forward
    before it (a request cannot be admitted on a prefix that has not verified yet).

    Call before ``init_hicache``, in every process that builds one: a server's
    scheduler runs in a process of its own, so start the server with
    ``python -m kvxfer.integrations.sglang_jax_launch`` (which installs in each).
    Idempotent; ``uninstall()`` restores the engine's own bindings.

    Example (needs sglang-jax; the engine's tests in one process)::

        from kvxfer.integrations.sglang_jax import install
        install()     # then build the radix cache and init_hicache as the engine does

    Raises:
      ImportError: sglang-jax is not importable (the message says so).
      EngineMismatchError: an ImportError: the sglang-jax found lacks one of
        ``ENGINE_NAMES`` (a version not checked against); the message names it and
        ``ENGINE_COMMIT``. Nothing is rebound.
    """
    import importlib

    parts = _engine_parts()
    host_kv_pool = importlib.import_module("sgl_jax.srt.mem_cache.host_kv_pool")
    UnifiedRadixCache = importlib.import_module(_RADIX).UnifiedRadixCache
    device_layer = parts["sgl_jax.srt.mem_cache.unified_cache_components:EvictLayer.DEVICE"]
    with _lock:
        if _originals:
            return
        original = UnifiedRadixCache.__dict__["init_load_back"]

        def init_load_back(self: Any, last_host_node: Any, host_hit_length: int,
                           mem_quota: int | None = None) -> Any:
            indices, last, plan = original(self, last_host_node, host_hit_length,
                                           mem_quota=mem_quota)
            if not plan or not isinstance(self.host_pool, KvxferHostKVPool):
                return indices, last, plan
            kept = _verified_load_back(self, last, plan, device_layer)
            if kept is None:
                return indices, last, []
            tokens, node = kept
            if tokens == 0:
                return indices[:0], last_host_node, []
            return indices[:tokens], node, []

        init_load_back.__wrapped__ = original  # type: ignore[attr-defined]
        init_load_back.__doc__ = ("sglang-jax's init_load_back, whose load kvxfer makes "
                                  "and verifies at once, the prefix cut at a miss "
                                  "(kvxfer.integrations.sglang_jax.install).")
        _originals.append((host_kv_pool, "LRUHostKVPool", host_kv_pool.LRUHostKVPool))
        _originals.append((UnifiedRadixCache, "init_load_back", original))
        host_kv_pool.LRUHostKVPool = KvxferHostKVPool
        UnifiedRadixCache.init_load_back = init_load_back


def uninstall() -> None:
    """Restores what ``install()`` rebound (a no-op when it is not installed).

    Pools and caches built meanwhile keep their kvxfer pool; only later
    ``init_hicache`` calls and later load-backs see the engine's own code again.
    """
    with _lock:
        while _originals:
            owner, name, value = _originals.pop()
            setattr(owner, name, value)


def installed() -> bool:
    """Whether ``install()`` is in effect."""
    with _lock:
        return bool(_originals)


def _verified_load_back(cache: Any, last: Any, plan: list[tuple[list[int], list[int]]],
                        device_layer: Any) -> tuple[int, Any] | None:
    """Loads ``plan`` now and cuts the chain to what verified.

    Returns None when all of it verified, else (the tokens kept, the deepest kept
    node).
    """
    chain = _chain(last, plan)
    barrier = getattr(cache, "_donation_barrier", None)
    if barrier is not None:
        barrier()
    try:
        cache.hicache_controller.drain_loads()
    except Exception:  # a staging failed: its entry's flush_load below raises, a miss
        log.warning("sglang-jax load-back: staging failed", exc_info=True)
    results: list[FlushLoadResult | None] = [None] * len(plan)
    for k, (host, devices) in enumerate(plan):
        try:
            results[k] = cache.host_pool.flush_load(host, list(devices))
        except Exception:  # a device, transfer or staging failure: a miss from here
            log.warning("sglang-jax load-back: flush_load of host pages %s failed; the "
                        "prefix is cut before them", list(host), exc_info=True)
        # The later entries are flushed all the same: each staging is consumed, and a
        # bad host copy among them is found and dropped.
    verdict = load_back_verdict(plan, results)
    if verdict.ok:
        return None
    page_size = cache.page_size
    boundary = chain[0].parent
    cut = chain[verdict.entries:]
    keep = chain[:verdict.entries]
    if verdict.pages:
        head = cache._split_node(cut[0].key, cut[0], verdict.pages * page_size)
        keep.append(head)
    for node in reversed(cut):  # deepest first: a tombstone never sits above a live node
        for component in cache._components_tuple:
            if component.node_has_component_data(node, device_layer):
                component.evict_component(node, device_layer)
        cache._cascade_evict(node)
        _drop_bad_host_copy(cache, node, verdict.dropped)
    for node in [*keep, *cut, boundary]:
        if node is cache.root_node or node.parent.children.get(
                cache.get_child_key_fn(node.key)) is node:  # still in the tree
            cache._update_evictable_leaf_sets(node)
    tokens = verdict.kept_pages(plan) * page_size
    log.warning("sglang-jax load-back: %d of %d tokens verified; the rest is recomputed "
                "(host copies dropped: %s)", tokens,
                sum(len(h) for h, _ in plan) * page_size, sorted(verdict.dropped))
    return tokens, (keep[-1] if keep else boundary)


def _chain(last: Any, plan: list[tuple[list[int], list[int]]]) -> list[Any]:
    """The nodes of a flush plan, root side first (the plan holds one entry a node)."""
    chain = []
    node = last
    for _ in plan:
        chain.append(node)
        node = node.parent
    chain.reverse()
    for node, (host, _) in zip(chain, plan):
        held = node.component_data[_BASE].host_value
        if held is None or [int(b) for b in held] != [int(b) for b in host]:
            raise RuntimeError(
                "sglang-jax's init_load_back returned a flush plan whose host pages "
                f"{[int(b) for b in host]} are not its node chain's ({held}); this "
                f"kvxfer install() was checked against sglang-jax commit {ENGINE_COMMIT}")
    return chain


def _drop_bad_host_copy(cache: Any, node: Any, dropped: frozenset[int]) -> None:
    """Frees a node's host copy when one of its pages proved bad (all of it, or none)."""
    cd = node.component_data[_BASE]
    if cd.host_value is None:
        return
    ids = [int(b) for b in cd.host_value]
    if dropped.isdisjoint(ids):
        return
    controller = cache.hicache_controller
    if controller.has_inflight(ids) or any(n is node for n, _ in cache.ongoing_write.values()):
        return  # its writer settles it; the dropped pages load as misses meanwhile
    controller.evict_callback(ids)
    cd.host_value = None
    cache.evictable_host_leaves.discard(node)
    if not node.children:  # dead, and nothing below it: the engine deletes such a node
        parent = node.parent
        cache._remove_leaf_from_parent(node)
        cache._update_evictable_leaf_sets(parent)
