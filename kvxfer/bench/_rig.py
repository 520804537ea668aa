"""The kvxfer side of a case: caches and one ``KVCacheManager`` per (integrity, path)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from kvxfer import testing
from kvxfer.bench.timing import now
from kvxfer.hostpool import PageRef, has_pinned_host
from kvxfer.manager import Gate, IntegrityMode, KVCacheManager, LoadResult, PathMode

__all__ = ["Rig", "make_caches", "load_name", "check_loaded", "LOAD_VARIANTS"]

#: The load variants every case times: (integrity, gate).
LOAD_VARIANTS: tuple[tuple[IntegrityMode, Gate], ...] = (
    ("off", "all"), ("off", "layer"), ("page", "all"), ("page", "layer"))


def load_name(integrity: str, gate: str) -> str:
    """The report's name of a kvxfer load variant: ``load_page_all``."""
    return f"load_{integrity}_{gate}"


def make_caches(layers: int, num_blocks: int, block_bytes: int, dtype: str,
                seed: int = 0) -> list[jax.Array]:
    """Caches ``[num_blocks, ...]`` of ``block_bytes`` per block, random bits in each."""
    return testing.random_caches(layers, num_blocks, testing.block_shape(block_bytes, dtype),
                                 dtype, seed=seed)


def check_loaded(result: LoadResult, n: int) -> None:
    """Raises unless a load verified all of its ``n`` pages (a figure of a miss is no figure)."""
    if result.verified_prefix != n:
        raise RuntimeError(f"bench: a load verified {result.verified_prefix} of {n} pages: "
                           f"{result.reasons}")


class Rig:
    """Caches and one ``KVCacheManager`` per (integrity, path) over them.

    Loads (kvxfer's and the user baselines') replace ``caches`` with what they return.
    ``routes`` keeps what a section compiled over these caches for a list of pages (the
    plain-JAX routes), for the next section that moves the same pages.
    """

    def __init__(self, caches: list[jax.Array], num_host_blocks: int,
                 kinds: Sequence[tuple[IntegrityMode, PathMode]] = (("off", "auto"),
                                                                    ("page", "auto"))):
        self.caches = caches
        self.num_host_blocks = num_host_blocks
        self.mgrs: dict[tuple[IntegrityMode, PathMode], KVCacheManager] = {}
        self.routes: dict[tuple[int, ...], Any] = {}
        for k in kinds:
            self.add(*k)
        self._key = 0

    def add(self, integrity: IntegrityMode, path: PathMode) -> KVCacheManager:
        """Adds a manager over the caches for ``(integrity, path)``."""
        self.mgrs[(integrity, path)] = KVCacheManager(
            self.caches, num_host_blocks=self.num_host_blocks, integrity=integrity, path=path)
        return self.mgrs[(integrity, path)]

    def add_pinned(self) -> bool:
        """Adds pinned managers (both integrity modes) when ``path="auto"`` is not the
        pinned mover for these caches and the backend has one; whether it added them."""
        if set(self.mgr("page").paths) == {"pinned"} or \
                not all(has_pinned_host(d) for d in self.caches[0].sharding.device_set):
            return False
        for integrity in ("off", "page"):
            self.add(integrity, "pinned")
        return True

    def mgr(self, integrity: IntegrityMode, path: PathMode = "auto") -> KVCacheManager:
        return self.mgrs[(integrity, path)]

    def keys(self, n: int) -> list[int]:
        """``n`` page keys not used before in this rig."""
        self._key += n
        return list(range(self._key - n, self._key))

    def hold(self, integrity: IntegrityMode, ids: Sequence[int], path: PathMode = "auto"
             ) -> list[PageRef]:
        """Offloads ``ids`` and keeps the pages (sources for loads)."""
        return self.mgr(integrity, path).offload(self.caches, ids, self.keys(len(ids))).wait()

    def offload(self, integrity: IntegrityMode, ids: Sequence[int], path: PathMode = "auto"
                ) -> dict[str, float]:
        """One timed offload of ``ids`` (its pages are freed after): total and call seconds."""
        mgr = self.mgr(integrity, path)
        keys = self.keys(len(ids))
        t0 = now()
        handle = mgr.offload(self.caches, ids, keys)
        t1 = now()
        pages = handle.wait()
        t2 = now()
        mgr.free(pages)
        return {"s": t2 - t0, "call_s": t1 - t0}

    def load(self, integrity: IntegrityMode, pages: Sequence[PageRef], ids: Sequence[int],
             gate: Gate, path: PathMode = "auto") -> dict[str, float]:
        """One timed load: total, call, and first-layer-ready seconds."""
        mgr = self.mgr(integrity, path)
        t0 = now()
        self.caches, handle = mgr.load(self.caches, pages, ids, gate=gate)
        t1 = now()
        handle.layer_ready(0)
        t2 = now()
        result = handle.result()
        t3 = now()
        check_loaded(result, len(pages))
        return {"s": t3 - t0, "call_s": t1 - t0, "first_s": t2 - t0}

    def close(self) -> None:
        for m in self.mgrs.values():
            m.close()
        self.mgrs.clear()
        self.routes.clear()
        self.caches = []
