"""The demo's fault injector: damages host pages just before a prefix hit loads them.

Each fault means what it means in ``kvxfer.testing`` (``FAULTS``) and is made
with its injectors, after the pages' digests were made, so that only
verification can catch it:

* ``bitflip``: one host bit of one layer of the page flips (``flip_bit``).
* ``wrong-key``: the caller asks for key K and is handed a page stored under
  another key. Here the cause is an index bug: the host index entries of two
  keys are swapped (``HostIndex.swap``), so the load asks for K and gets the
  other key's page; no byte is touched, the key check catches it.
* ``stale-slot``: the page is freed and its slot reused by another page while
  the host index still holds the old ref (``reuse_slot``).
* ``one-shard``: one bit flips in one shard of a sharded layer only
  (``flip_bit`` on that shard's bytes).

The target is the middle host page of a prefix hit, so the verified prefix is
non-empty and recovery keeps part of the hit.

Example:
    >>> injector = FaultInjector("wrong-key", limit=1)
    >>> injector.count, injector.log
    (0, [])
    >>> FaultInjector("flood")
    Traceback (most recent call last):
    ...
    ValueError: inject='flood'; expected one of bitflip, wrong-key, stale-slot, one-shard
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, get_args

from kvxfer import testing
from kvxfer.demo.tiers import SCRATCH_KEY
from kvxfer.hostpool import PageRef, PoolExhaustedError

if TYPE_CHECKING:
    from kvxfer.demo.server import PrefixCacheServer

__all__ = ["InjectMode", "INJECT_MODES", "Injection", "FaultInjector"]

InjectMode = Literal["bitflip", "wrong-key", "stale-slot", "one-shard"]
INJECT_MODES: tuple[str, ...] = get_args(InjectMode)
"""The faults ``kvxfer demo --inject`` knows (a subset of ``kvxfer.testing.FAULTS``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Injection:
    """One fault the injector made.

    Attributes:
        fault: Which fault.
        page: The page it damaged (``wrong-key``: the page the caller is handed;
            ``stale-slot``: the freed page whose ref the index still holds).
        text: What was done, in words.
        reused_by: ``stale-slot`` only: the page now in ``page``'s slot, or None
            when no offload reached that slot.

    Example:
        >>> str(Injection("bitflip", PageRef(5, 0, 1), "flipped a bit"))
        'bitflip: flipped a bit'
    """

    fault: InjectMode
    page: PageRef
    text: str
    reused_by: PageRef | None = None

    def __str__(self) -> str:
        return f"{self.fault}: {self.text}"


class FaultInjector:
    """Injects one fault into the host tier before up to ``limit`` prefix hits load.

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
            other = others[-1]
            server.host.swap(key, other)
            self.injections.append(Injection(
                "wrong-key", server.host.get(key),
                f"the caller asks for key {key:#x} and is handed the page stored under key "
                f"{other:#x} (their host index entries were swapped)"))
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

    def _stale(self, server: PrefixCacheServer, key: int) -> Callable[[], None] | None:
        mgr = server.mgr
        ref = server.host.get(key)
        # Refill the slot with a real write-back of a cold device page that has no
        # host copy yet, if one is waiting; else with a scratch page.
        cold = [(b, k) for b, k in server.blocks.cold_pages() if k not in server.host]
        block, new_key = cold[0] if cold else (0, SCRATCH_KEY)
        # The pool hands out its lowest free slot, so the freed slot comes back only
        # once every lower free slot is taken: reuse_slot offloads until it does.
        # The index is (wrongly) not told of the free: it keeps the stale ref.
        try:
            new = testing.reuse_slot(mgr, server.kv, ref, block, new_key)
        except PoolExhaustedError:  # the slot is still being read: it never came back
            self.injections.append(Injection(
                "stale-slot", ref, f"{ref} freed while the host index still holds it; "
                f"its slot {ref.slot} was not reused"))
            return None
        # Pages reuse_slot offloaded only to reach the slot were freed at once: the
        # stats count the one page that took the slot.
        server.stats.pages_offloaded += 1
        server.stats.bytes_offloaded += mgr.plan.page_bytes
        reused = new.slot == ref.slot
        self.injections.append(Injection(
            "stale-slot", ref, f"{ref} freed while the host index still holds it; "
            + (f"its slot {ref.slot} reused by {new}" if reused else
               f"its slot {ref.slot} was not reused ({new} went elsewhere)"),
            reused_by=new if reused else None))
        if cold:
            server.host.put(new_key, new)
            return None
        return lambda: mgr.free([new])
