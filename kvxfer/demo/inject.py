"""The demo's fault injector: damages cached pages just before a prefix hit uses them.

Each fault means what it means in ``kvxfer.testing`` (``FAULTS``) and is made
with its injectors, after the pages' digests were made, so that only
verification can catch it:

* ``bitflip``: one host bit of one layer of the page flips (``flip_bit``).
* ``wrong-key``: the caller asks for key K and is handed a page stored under
  another key. Here the cause is an index bug: the hit handed to the load holds
  another cached key's page in K's place, so the load asks for K and gets the
  other key's page; no byte is touched, the key check catches it.
* ``stale-slot``: the page is freed and its slot reused by another page while
  the hit still holds the old ref (``reuse_slot``).
* ``one-shard``: one bit flips in one shard of a sharded layer only
  (``flip_bit`` on that shard's bytes).
* ``store-bitflip``: one bit of a page at rest in the store tier flips
  (``flip_stored_bit``) before a lookup promotes it; the page imports whole and
  its digest, made on the device at its first offload, catches the flip at load.

The target is the middle host page of a prefix hit, so the verified prefix is
non-empty and recovery keeps part of the hit.

Example:
    >>> injector = FaultInjector("wrong-key", limit=1)
    >>> injector.count, injector.log
    (0, [])
    >>> FaultInjector("flood")
    Traceback (most recent call last):
    ...
    ValueError: inject='flood'; expected one of bitflip, wrong-key, stale-slot, one-shard, store-bitflip
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kvxfer import testing
from kvxfer.cache import CacheHit
from kvxfer.demo._options import INJECT_MODES as INJECT_MODES
from kvxfer.demo._options import InjectMode as InjectMode
from kvxfer.demo.server import PrefixCacheServer
from kvxfer.demo.tiers import SCRATCH_KEY
from kvxfer.hostpool import PageRef, PoolExhaustedError

__all__ = ["InjectMode", "INJECT_MODES", "Injection", "FaultInjector"]



@dataclasses.dataclass(frozen=True, slots=True)
class Injection:
    """One fault the injector made.

    Attributes:
        fault: Which fault.
        page: The page it damaged (``wrong-key``: the page the caller is handed;
            ``stale-slot``: the freed page whose ref the hit still holds;
            ``store-bitflip``: None, the page is in the store under ``key``).
        text: What was done, in words.
        reused_by: ``stale-slot`` only: the page now in ``page``'s slot, or None
            when no offload reached that slot.

    Example:
        >>> str(Injection("bitflip", PageRef(5, 0, 1), "flipped a bit"))
        'bitflip: flipped a bit'
    """

    fault: InjectMode
    page: PageRef | None
    text: str
    reused_by: PageRef | None = None
    key: int | None = None

    def __str__(self) -> str:
        return f"{self.fault}: {self.text}"


class FaultInjector:
    """Injects one fault into the host tier before up to ``limit`` prefix hits load.

    The server's ``Injector``: it calls ``before_lookup`` and ``before_load``.

    ``bitflip`` and ``one-shard`` alternate between the first layer (caught before
    any layer is consumed) and the last one (the layers before it were already
    consumed: the request restarts from the verified prefix).

    Args:
        mode: One of ``INJECT_MODES``.
        limit: Injections to make.

    Raises:
        ValueError: ``mode`` is not one of ``INJECT_MODES``.
    """

    def __init__(self, mode: InjectMode, limit: int = 2):
        if mode not in INJECT_MODES:
            raise ValueError(f"inject={mode!r}; expected one of {', '.join(INJECT_MODES)}")
        self.mode = mode
        self.limit = limit
        self.injections: list[Injection] = []

    @property
    def count(self) -> int:
        return len(self.injections)

    @property
    def log(self) -> list[str]:
        """One line per injection, in order."""
        return [str(i) for i in self.injections]

    def before_lookup(self, server: PrefixCacheServer, keys: Sequence[int]) -> None:
        """``store-bitflip``: flips a bit of one of ``keys`` held only in the store, if due."""
        if self.mode != "store-bitflip" or self.count >= self.limit:
            return
        cache = server.cache
        stored = [k for k in keys if cache.find(k) == "store"]
        if not stored:
            return
        key = stored[len(stored) // 2]
        bit = testing.flip_stored_bit(cache.store, cache.store_key(key), seed=self.count)
        self.injections.append(Injection(
            "store-bitflip", None, f"flipped bit {bit} of page {key:#x} at rest in the "
            f"{cache.store.name} store", key=key))

    def before_load(self, server: PrefixCacheServer, hit: CacheHit
                    ) -> tuple[CacheHit, Callable[[], None] | None]:
        """Injects into one page of ``hit`` (pinned, about to be loaded) if due.

        Returns:
            The hit to load (another one for ``wrong-key``) and a cleanup to call once
            the load has been issued, or None.
        """
        if self.mode == "store-bitflip" or self.count >= self.limit or not hit.num_pages:
            return hit, None
        target = hit.num_pages // 2
        key = hit.keys[target]
        if self.mode in ("bitflip", "one-shard"):
            self._flip(server, hit.pages[target], late=self.count % 2 == 1)
            return hit, None
        if self.mode == "wrong-key":
            # Prefer a partner outside this request, so only the target is misnamed here.
            cached = server.cache.keys()
            others = [k for k in cached if k not in hit.keys] or list(hit.keys[target + 1:])
            if not others:
                return hit, None
            other = others[-1]
            handed = server.cache.page_of(other) if other not in hit.keys else \
                hit.pages[hit.keys.index(other)]
            if handed is None:
                return hit, None
            pages = list(hit.pages)
            pages[target] = handed
            self.injections.append(Injection(
                "wrong-key", handed,
                f"the caller asks for key {key:#x} and is handed the page stored under key "
                f"{other:#x} (an index bug)"))
            return dataclasses.replace(hit, pages=tuple(pages)), None
        return hit, self._stale(server, hit.pages[target])

    def _flip(self, server: PrefixCacheServer, ref: PageRef, late: bool) -> None:
        mgr = server.mgr
        layers = list(range(mgr.num_layers))
        if self.mode == "one-shard":
            layers = [i for i in layers if mgr.plan.class_of_layer(i)[0].num_shards > 1]
            if not layers:
                raise ValueError("one-shard injection needs a layer whose KV heads are split "
                                 "over devices (--devices 2 with an even KV head count)")
        layer = layers[-1] if late else layers[0]
        cls, _ = mgr.plan.class_of_layer(layer)
        if self.mode == "one-shard":
            shard: int | None = cls.num_shards - 1
            size = cls.shard_block_bytes
            where = f"shard {shard} of {cls.num_shards} of layer {layer}"
        else:
            shard, size = None, cls.bytes_per_block
            where = f"layer {layer}"
        # Bit 6 of the top byte of a 32-bit word is an exponent bit of an f32 (or of
        # the upper bf16): with --integrity off the damage then shows in the tokens.
        bit = ((size // 2 & ~3) + 3) * 8 + 6
        testing.flip_bit(mgr, ref, layer, bit, shard=shard)
        self.injections.append(Injection(self.mode, ref,
                                         f"flipped a bit of {where} of {ref} on host"))

    def _stale(self, server: PrefixCacheServer, ref: PageRef) -> Callable[[], None] | None:
        mgr = server.mgr
        # Refill the slot with a page of a cold device block (its real bytes, under a
        # scratch key: the page exists only to take the slot).
        cold = server.blocks.cold_pages()
        block = cold[0][0] if cold else 0
        # The pool hands out its lowest free slot, so the freed slot comes back only
        # once every lower free slot is taken: reuse_slot offloads until it does.
        # The hit is (wrongly) not told of the free: it keeps the stale ref.
        try:
            new = testing.reuse_slot(mgr, server.kv, ref, block, SCRATCH_KEY)
        except PoolExhaustedError:  # the slot is still being read: it never came back
            self.injections.append(Injection(
                "stale-slot", ref, f"{ref} freed while the hit still holds it; "
                f"its slot {ref.slot} was not reused"))
            return None
        # Pages reuse_slot offloaded only to reach the slot were freed at once: the
        # stats count the one page that took the slot.
        server.stats.pages_offloaded += 1
        server.stats.bytes_offloaded += mgr.plan.page_bytes
        reused = new.slot == ref.slot
        self.injections.append(Injection(
            "stale-slot", ref, f"{ref} freed while the hit still holds it; "
            + (f"its slot {ref.slot} reused by {new}" if reused else
               f"its slot {ref.slot} was not reused ({new} went elsewhere)"),
            reused_by=new if reused else None))
        return lambda: mgr.free([new])
