"""The demo's fault injector: corrupts host pages just before a prefix hit loads them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, get_args

from kvxfer.demo.tiers import SCRATCH_KEY

if TYPE_CHECKING:
    from kvxfer.demo.server import PrefixCacheServer

__all__ = ["InjectMode", "INJECT_MODES", "FaultInjector"]

InjectMode = Literal["bitflip", "wrong-key", "stale-slot", "one-shard"]
INJECT_MODES: tuple[str, ...] = get_args(InjectMode)


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
        block, new_key = cold[0] if cold else (0, SCRATCH_KEY)
        new = mgr.offload(server.kv, [block], [new_key]).wait()[0]
        server.stats.pages_offloaded += 1
        server.stats.bytes_offloaded += mgr.plan.page_bytes
        reused = "reused by" if new.slot == ref.slot else "freed; slot not reused, new page at"
        self.log.append(f"stale-slot: {ref} {reused} {new}")
        if cold:
            server.host.put(new_key, new)
            return None
        return lambda: mgr.free([new])
