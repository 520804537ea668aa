"""Host pools: one page-first buffer per slice class, and one slot table for all.

A *page* is one block index across every layer. Slot ``s`` of every class pool
holds the same page, so a page is addressed by one ``(slot, generation)`` pair;
each class stores its part of the page as one contiguous byte range, shard-major:
``[shard 0: layer 0 | ... | layer L-1 | shard 1: layer 0 | ... | shard S-1: layer L-1]``
(``SliceClass.shard_range``). Movers copy shard by shard, each shard on its own
device, so each shard's part of a page is one contiguous range: one copy per page
and shard, not one small strided copy per layer. For one-shard classes it is
``[layer 0 | ... | layer L-1]``. A layer's bytes (``read_block_bytes``) are its
shards' blocks in shard order, gathered from the shards' ranges.

Every slot carries a generation that changes on each reuse, and each page records
its key, generation and, per layer and shard, its digest. Digests and page blobs
carry 32 bits of generation, so a slot whose generation reaches ``MAX_GENERATION``
(2**32 - 1) is retired once that page is freed, never reused under an identity an
older page had; the pool then has one slot fewer (``num_retired``).

Example:
    >>> from kvxfer.plan import LayerSpec, make_plan
    >>> plan = make_plan([LayerSpec("L0", (8, 16, 4), "float32")], num_host_blocks=4)
    >>> pool = HostPool(plan)
    >>> (s0, g0), = pool.allocate(1)
    >>> pool.release(s0, g0)
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvxfer._hostalloc import allocate_bytes, host_view
from kvxfer._hostalloc import has_pinned_host as has_pinned_host
from kvxfer._hostalloc import word_bytes as word_bytes
from kvxfer._hostmem import HostMemory
from kvxfer._pagearrays import PageArrays
from kvxfer.plan import Plan, SliceClass

__all__ = ["HostPool", "PageRef", "PoolError", "PoolExhaustedError", "ClassPool",
           "HostBacking", "DIGEST_SLOTS", "MAX_GENERATION", "word_bytes", "has_pinned_host"]

log = logging.getLogger("kvxfer")

# The last generation a slot is handed out under (digests and blobs carry 32 bits).
MAX_GENERATION = (1 << 32) - 1

# uint32 words reserved per (layer, shard) digest; integrity uses up to this many.
DIGEST_SLOTS = 4


class PoolError(ValueError):
    """A slot that is unknown, already free, or of another generation."""


class PoolExhaustedError(MemoryError):
    """Not enough free host slots for a request; nothing was allocated."""


@dataclasses.dataclass(frozen=True, slots=True)
class PageRef:
    """A page on the host: its key, slot and the slot's generation when written.

    Attributes:
      key: the caller's identity for the page (a 64-bit int, e.g. a chained token hash).
      slot: host slot index (the same in every class pool).
      generation: the slot's generation; a stale ref has an older one.
    """

    key: int
    slot: int
    generation: int

    def __post_init__(self):
        for name, value, limit in (("key", self.key, 1 << 64), ("slot", self.slot, None),
                                   ("generation", self.generation, None)):
            bound = "in [0, 2**64)" if limit else ">= 0"
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"PageRef.{name} must be an int {bound}. Got {value!r} of "
                                f"type {type(value).__name__}")
            if value < 0 or (limit is not None and value >= limit):
                raise ValueError(f"PageRef.{name} must be {bound}. Got {value!r}")
            object.__setattr__(self, name, int(value))

    def __str__(self) -> str:
        return f"page(key={self.key:#x}, slot={self.slot}, gen={self.generation})"


HostBacking = Callable[[int], Any]
"""``make(num_slots) -> owner``: allocates a class pool the way its mover needs it.

The owner is a host-memory ``jax.Array`` stored row-major whose buffer is exactly the
pool's ``num_slots * page_bytes`` bytes, page-first (for movers whose device programs
write the pool in place: the Pallas DMAs), or a ``HostMemory`` of that size allocated
outside XLA (for movers whose copy engines reach it directly: the DMA mover):
``ClassPool.data`` views its bytes. Or it is a ``PageArrays``, a host-memory array per
page (the pinned mover's pure-JAX route): the pool then has no ``data``, and its pages
are reached through ``ClassPool.shard_view``, ``read_page`` and ``write_page``. ``make``
may return None for the default allocation.
"""


class ClassPool:
    """The host buffer of one slice class: ``data[slot]`` is one page's bytes.

    A pinned pool lives in one device's ``pinned_host`` memory, held by a JAX array
    (``array``, ``uint{8 * word_bytes}[num_slots, page_bytes // word_bytes]``) whose
    buffer ``data`` views. Programs may update it in place: a program that donates
    ``array`` and returns the same buffer hands its result to ``swap``. A mover may
    allocate the pool itself instead (``HostBacking``; the array is then ``owner``,
    in the mover's own shape, handed over with ``hand_over``).

    Attributes:
      cls: the slice class.
      data: ``uint8[num_slots, page_bytes]`` (None where each page is an array of its
        own, ``pages``: use ``shard_view``, ``read_page`` and ``write_page``).
      digests: ``uint32[num_slots, layers, shards, DIGEST_SLOTS]``.
      pinned: whether ``data`` is pinned (``pinned_host`` memory of ``device``, or
        ``memory`` page-locked by a copy engine).
      device: the device whose pinned memory holds the pool, or whose mover allocated
        it (None otherwise).
      memory: the ``HostMemory`` holding the pool where a mover allocated it outside
        XLA (None otherwise).
      word_bytes: the size of the words ``array`` holds (see ``word_bytes``).
      lock: held while a program reads or donates ``array`` (so it is enqueued with
        the array of the moment, and no two programs donate the same one).
    """

    def __init__(self, cls: SliceClass, num_slots: int, *, pinned: bool = False,
                 device: Any = None, backing: HostBacking | None = None):
        self.cls = cls
        self.word_bytes = word_bytes(cls)
        nbytes = num_slots * cls.page_bytes
        owner = backing(num_slots) if backing is not None and nbytes else None
        #: The pool's memory where it was allocated outside XLA (None otherwise).
        self.memory: HostMemory | None = None
        #: The pool's pages where each is an array of its own (None otherwise).
        self.pages: PageArrays | None = None
        if isinstance(owner, PageArrays):
            flat, self._array, self.pages = None, None, owner
            self.pinned = True
        elif isinstance(owner, HostMemory):  # memory the mover's copy engine reaches
            if owner.nbytes != nbytes:
                raise PoolError(f"host memory of {owner.nbytes} bytes cannot hold a pool of "
                                f"{nbytes} bytes")
            flat, self._array, self.memory = owner.view(), None, owner
            self.pinned = owner.pinned
        elif owner is not None:  # a host-memory JAX array (see HostBacking)
            if owner.nbytes != nbytes:
                raise PoolError(f"a host backing of {owner.nbytes} bytes ({owner.dtype}"
                                f"{list(owner.shape)}) cannot hold a pool of {nbytes} bytes")
            flat, self._array = host_view(owner, nbytes), owner
            self.pinned = getattr(owner.sharding, "memory_kind", None) == "pinned_host"
        else:
            flat, self._array = allocate_bytes(nbytes, pinned, device, self.word_bytes,
                                                num_slots)
            self.pinned = self._array is not None
        self.device = device if self.pinned or backing is not None else None
        self.lock = threading.Lock()
        self.data = None if flat is None else flat.reshape(num_slots, cls.page_bytes)
        self.digests = np.zeros((num_slots, len(cls.layers), cls.num_shards, DIGEST_SLOTS),
                                dtype=np.uint32)
        self._word_offsets = [tuple(self.shard_range(pos, s)[0] // self.word_bytes
                                    for pos in range(len(cls.layers)))
                              for s in range(cls.num_shards)]

    @property
    def array(self) -> Any:
        """The JAX array holding a pinned pool's bytes now (None when not pinned)."""
        return self._array

    def swap(self, new: Any) -> None:
        """Takes ``new`` (returned by a program that donated ``array``) as the pool.

        Call with ``lock`` held.

        Raises:
          PoolError: ``new`` does not live in the pool's buffer (the program did not
            update it in place), so ``data`` would not show what it wrote. The pool
            keeps its array (or ``new``, if the old one was consumed anyway).
        """
        if new.shape != self._array.shape or new.dtype != self._array.dtype:
            raise PoolError(f"pool array {new.dtype}{list(new.shape)} replaces "
                            f"{self._array.dtype}{list(self._array.shape)}")
        address = self.data.__array_interface__["data"][0]
        if new.unsafe_buffer_pointer() != address:
            if self._array.is_deleted():
                self._array = new
            raise PoolError(f"the program did not update the pinned pool of {self.cls.name} "
                            f"in place (buffer {new.unsafe_buffer_pointer():#x}, pool "
                            f"{address:#x}); its pages would not reach the host pool")
        self._array = new

    def word_offsets(self, shard: int) -> tuple[int, ...]:
        """Where shard ``shard`` of each layer starts inside a page, in words of
        ``word_bytes`` (what programs reading or writing ``array`` in place take)."""
        return self._word_offsets[shard]

    def shard_range(self, pos: int, shard: int) -> tuple[int, int]:
        """Byte range of one shard of layer ``pos`` inside a page (shard-major:
        ``SliceClass.shard_range``)."""
        return self.cls.shard_range(pos, shard)

    def shard_span(self, shard: int) -> tuple[int, int]:
        """Byte range of shard ``shard``'s blocks of every layer inside a page (one
        range: ``SliceClass.shard_span``)."""
        return self.cls.shard_span(shard)

    @property
    def nbytes(self) -> int:
        return self.pages.nbytes if self.data is None else self.data.nbytes

    def shard_view(self, slot: int, pos: int, shard: int) -> np.ndarray:
        """A writable ``uint8`` view of one shard of layer ``pos`` of ``slot``'s page."""
        if self.data is None:
            return self.pages.shard_view(slot, pos, shard)
        lo, hi = self.shard_range(pos, shard)
        return self.data[slot, lo:hi]

    def read_page(self, slot: int) -> np.ndarray:
        """``slot``'s page (shard-major: each shard's layers side by side): a view
        where the pool is one buffer, else a new array."""
        return self.pages.read(slot) if self.data is None else self.data[slot]

    def write_page(self, slot: int, data: np.ndarray) -> None:
        """Replaces ``slot``'s page with ``data`` (``read_page``'s byte order)."""
        if self.data is None:
            self.pages.write(slot, data)
        else:
            self.data[slot] = data

    @property
    def owner(self) -> Any:
        """The JAX array whose buffer ``data`` views (None for a numpy pool)."""
        return self._array

    def hand_over(self, owner: Any) -> None:
        """Records the array that owns the pool's buffer now.

        A program that writes the pool in place takes the owner (donated) and returns
        a new array over the same buffer; the pool keeps that one, so the buffer lives
        as long as the pool. Call it on the thread that dispatched the program.
        """
        if self._array is None:
            raise PoolError(f"class pool {self.cls.name} is numpy memory, not a JAX array")
        self._array = owner

    def check_owner(self) -> None:
        """Checks that the recorded owner is still the buffer ``data`` views.

        Raises:
          PoolError: it is another buffer (a program that should have written the pool
            in place wrote a copy), naming both addresses.
        """
        owner = self._array
        if owner is None:
            return
        ptr = owner.unsafe_buffer_pointer()
        if ptr != self.data.ctypes.data or owner.nbytes != self.data.nbytes:
            raise PoolError(f"class pool {self.cls.name}: its owner array is at {ptr:#x} "
                            f"({owner.nbytes} bytes), the pool's bytes at "
                            f"{self.data.ctypes.data:#x} ({self.data.nbytes} bytes): a "
                            "program wrote a copy of the pool instead of the pool")


def _never_issued(generation: int, current: int, state: str) -> str | None:
    """See ``HostPool.never_issued``."""
    if generation == 0 or generation > current:
        return (f"generation {generation} was never issued for this slot (it is at "
                f"generation {current})")
    if generation == current and state == "writing":
        return f"generation {generation} of this slot is still being written"
    return None


@dataclasses.dataclass
class _Slot:
    generation: int = 0
    # free | writing | valid | released (free once readers finish) | retired (every
    # generation used: never handed out again)
    state: str = "free"
    key: int = 0
    readers: int = 0  # pins of every kind, an edit's own included
    brief: int = 0  # of those, host readers that copy bytes and let go (see acquire_readers)
    edited: bool = False  # a block write is replacing bytes and digests (begin_edit)
    waiting: int = 0  # readers waiting for an edit to end: the next edit waits for them
    classes: frozenset[int] = frozenset()  # the slice classes the page holds
    seal: int = 0  # the generation the page's digests are bound to


class HostPool:
    """All class pools of a plan plus the slot table they share.

    Thread-safe: allocation, release and reader accounting take one lock.

    Args:
      plan: the plan (already checked against the budget).
      pinned: allocate through JAX ``pinned_host`` memory: one flag for every class or
        one per class (default: when the backend is not CPU, where host memory is
        already what the device uses, and offers ``pinned_host``).
      device: the device whose ``pinned_host`` memory to use: one for every class or
        one per class (default: this process's first device).
      backings: ``{class index: HostBacking}`` for classes allocated as a mover asks.
    """

    def __init__(self, plan: Plan, *, pinned: bool | Sequence[bool] | None = None,
                 device: Any = None, backings: Mapping[int, HostBacking | None] | None = None):
        n = len(plan.classes)
        devices = list(device) if isinstance(device, (list, tuple)) else [device] * n
        flags = list(pinned) if isinstance(pinned, (list, tuple)) else [pinned] * n
        if len(devices) != n or len(flags) != n:
            raise ValueError(f"{len(devices)} devices and {len(flags)} pinned flags for "
                             f"{n} slice classes")
        if any(d is None for d in devices) or any(f is None for f in flags):
            import jax

            devices = [d or jax.local_devices()[0] for d in devices]
            flags = [d.platform != "cpu" and has_pinned_host(d) if f is None else bool(f)
                     for f, d in zip(flags, devices)]
        self.plan = plan
        self.num_slots = plan.num_host_blocks
        backings = backings or {}
        self.pools = tuple(ClassPool(c, self.num_slots, pinned=f, device=d,
                                     backing=backings.get(c.index))
                           for c, f, d in zip(plan.classes, flags, devices))
        self._slots = [_Slot() for _ in range(self.num_slots)]
        # A min-heap: requests get the lowest free slots, so a request's slots tend to
        # be consecutive and its copies run as single slices. A slot the caller names
        # (``claim``) leaves its entry behind: entries of slots no longer free are
        # skipped when popped, and ``_num_free`` is the count.
        self._free = list(range(self.num_slots))
        self._num_free = self.num_slots
        self._invalidated: dict[int, int] = {}  # slot -> generation found bad
        self._retired = 0
        self._lock = threading.Lock()
        # Signalled when an edit ends or a brief reader lets go (begin_edit, acquire_readers).
        self._edits = threading.Condition(self._lock)

    # -- accounting ---------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    @property
    def num_free(self) -> int:
        with self._lock:
            return self._num_free

    @property
    def num_retired(self) -> int:
        """Slots that used every generation up to ``MAX_GENERATION`` and are out of use."""
        with self._lock:
            return self._retired

    def _slot(self, slot: int) -> _Slot:
        """The slot's record; generations are compared by each caller."""
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or \
                not 0 <= slot < self.num_slots:
            raise PoolError(f"unknown host slot {slot!r}; slots are 0..{self.num_slots - 1}")
        return self._slots[slot]

    # -- slots --------------------------------------------------------------

    def allocate(self, n: int) -> list[tuple[int, int]]:
        """Takes ``n`` free slots (all or none) and bumps their generations.

        Raises:
          PoolExhaustedError: fewer than ``n`` slots are free.
        """
        with self._lock:
            if n > self._num_free:
                retired = f" ({self._retired} retired)" if self._retired else ""
                raise PoolExhaustedError(
                    f"host pool exhausted: {n} pages requested, {self._num_free} of "
                    f"{self.num_slots} slots free{retired}; free pages or raise "
                    "num_host_blocks")
            out = []
            while len(out) < n:
                slot = heapq.heappop(self._free)
                if self._slots[slot].state == "free":
                    out.append((slot, self._take_locked(slot)))
            return out

    def claim(self, slots: Sequence[int]) -> list[tuple[int, int]]:
        """Takes the slots the caller names (all or none) and bumps their generations.

        For engines that choose host ids themselves. A named slot may be free or hold
        a committed page: that page is overwritten, so every ref to it becomes stale
        (its generation is older).

        Raises:
          PoolError: a slot is unknown or named twice, is being written by another
            transfer, or holds a page a transfer is reading; naming the slot. Nothing
            is taken then.
        """
        with self._lock:
            seen: set[int] = set()
            for j, slot in enumerate(slots):
                s = self._slot(slot)
                if slot in seen:
                    raise PoolError(f"slots[{j}] = {slot} is named twice")
                seen.add(slot)
                if s.edited:
                    raise PoolError(f"host slot {slot} cannot be overwritten: a block "
                                    f"write is editing its page (generation {s.generation})")
                if s.readers:
                    raise PoolError(f"host slot {slot} cannot be overwritten: a load is "
                                    f"reading its page (generation {s.generation})")
                if s.state == "writing":
                    raise PoolError(f"host slot {slot} cannot be overwritten: another "
                                    f"offload is writing it (generation {s.generation})")
                if s.state == "retired" or s.generation >= MAX_GENERATION:
                    raise PoolError(f"host slot {slot} has used every generation up to "
                                    f"2**32 - 1 and is retired; name another slot")
            return [(int(slot), self._take_locked(int(slot))) for slot in slots]

    def _take_locked(self, slot: int) -> int:
        """Makes a free or committed slot ``writing`` under a new generation."""
        s = self._slots[slot]
        if s.state == "free":
            self._num_free -= 1
        self._invalidated.pop(slot, None)  # an older ref to it is now just stale
        s.generation += 1
        s.state = "writing"
        s.key = 0
        s.classes = frozenset()
        return s.generation

    def commit(self, slot: int, generation: int, key: int,
               classes: frozenset[int] | None = None, seal: int | None = None) -> None:
        """Marks a written slot valid under ``key``, holding ``classes`` (default all).

        ``seal`` is the generation the page's digests are bound to: the slot's own
        generation for a page offloaded here (the default), the exporting slot's
        generation for an imported page (its digests travel unchanged).
        """
        with self._lock:
            s = self._slot(slot)
            if s.generation == generation and s.state == "writing":
                s.state, s.key = "valid", key
                s.classes = frozenset(range(len(self.pools))) if classes is None else \
                    frozenset(classes)
                s.seal = generation if seal is None else seal

    def seal_of(self, slot: int) -> int:
        """The generation the digests of the page in ``slot`` are bound to."""
        return self.seals_of([slot])[0]

    def seals_of(self, slots: Sequence[int]) -> list[int]:
        """``seal_of`` for many slots, under one lock (a load's pages)."""
        with self._lock:
            return [self._slot(slot).seal for slot in slots]

    def classes_of(self, slot: int) -> frozenset[int]:
        """The slice classes whose part of the page ``slot`` holds."""
        with self._lock:
            return self._slot(slot).classes

    def release(self, slot: int, generation: int) -> None:
        """Frees a slot; if a transfer is reading it, the slot returns once it ends.

        Raises:
          PoolError: unknown slot, a stale generation, or a slot already free.
        """
        self.release_many([(slot, generation)])

    def release_many(self, refs: Sequence[tuple[int, int]]) -> None:
        """Frees several slots, all or none.

        Raises:
          PoolError: naming the first bad ref (unknown, stale, already free, or
            listed twice); nothing is freed then.
        """
        with self._lock:
            seen: set[int] = set()
            todo = []
            for slot, generation in refs:
                s = self._slot(slot)
                if self._invalidated.get(slot) == generation:
                    todo.append((slot, None))  # found bad and freed already: a no-op
                    continue
                if generation == 0 or generation > s.generation:
                    raise PoolError(f"host slot {slot} generation {generation} was never "
                                    f"issued (the slot is at generation {s.generation}): "
                                    "a ref of another pool, or one no offload returned")
                if s.generation != generation:
                    raise PoolError(f"host slot {slot} generation {generation} is stale (now "
                                    f"{s.generation}): the page was freed and the slot reused")
                if s.state in ("free", "released", "retired") or slot in seen:
                    raise PoolError(f"double free of host slot {slot} generation "
                                    f"{generation}")
                seen.add(slot)
                todo.append((slot, s))
            for slot, s in todo:
                if s is None:
                    self._invalidated.pop(slot, None)
                else:
                    self._release_locked(slot, s)

    def invalidate(self, slot: int, generation: int) -> bool:
        """Frees a page found bad; a later ``release`` of the same ref is a no-op."""
        with self._lock:
            s = self._slot(slot)
            if s.generation != generation or s.state in ("free", "released", "retired"):
                return False
            self._invalidated[slot] = generation
            self._release_locked(slot, s)
            return True

    def _release_locked(self, slot: int, s: _Slot) -> None:
        if s.readers:
            s.state = "released"
        else:
            self._free_locked(slot, s)

    def _free_locked(self, slot: int, s: _Slot) -> None:
        if s.generation >= MAX_GENERATION:  # a new generation would wrap: retire it
            s.state = "retired"
            self._retired += 1
            log.warning("host slot %d used every generation up to 2**32 - 1 and is "
                        "retired; the pool has %d of %d slots left", slot,
                        self.num_slots - self._retired, self.num_slots)
            return
        s.state = "free"
        self._num_free += 1
        heapq.heappush(self._free, slot)
        if len(self._free) > 2 * self.num_slots:  # entries left by claims: rebuild
            self._free = sorted({f for f in self._free if self._slots[f].state == "free"})

    def state(self, slot: int) -> tuple[int, str, int]:
        """(generation, state, key) of a slot."""
        with self._lock:
            s = self._slot(slot)
            return s.generation, s.state, s.key

    def never_issued(self, refs: Sequence[tuple[int, int]]) -> list[str | None]:
        """Per ``(slot, generation)``: why no ref to it was ever handed out, or None.

        Refs are handed out for committed pages only, and a slot takes a new
        generation each time it is written, so a generation of 0, one ahead of the
        slot's, or the slot's own while its page is still being written was never a
        page of this pool (a ref of another pool, or one made up). Older
        generations are stale refs, not this.

        Raises:
          PoolError: an unknown slot.

        Example:
            >>> from kvxfer.plan import LayerSpec, make_plan
            >>> pool = HostPool(make_plan([LayerSpec("L0", (8, 4), "float32")], 2))
            >>> (s, g), = pool.allocate(1)
            >>> pool.commit(s, g, key=7)
            >>> pool.never_issued([(s, g), (s, g + 1)])
            [None, 'generation 2 was never issued for this slot (it is at generation 1)']
        """
        with self._lock:
            return [_never_issued(generation, s.generation, s.state)
                    for s, (_, generation) in zip([self._slot(slot) for slot, _ in refs],
                                                  refs)]

    def acquire_readers(self, refs: Sequence[tuple[int, int]], *,
                        brief: bool = False) -> list[str | None]:
        """Pins slots for a transfer that reads them; returns a problem per ref or None.

        A problem is ``"stale generation"`` or ``"freed"``; such refs are not pinned.
        A slot a block write is editing (``begin_edit``) is pinned once the edit ends,
        so a reader finds its bytes and digests both as they were or both as written.

        Args:
          refs: ``(slot, generation)`` per page.
          brief: the reader only copies host bytes on this thread and lets go (a
            block read, an export): an edit waits for it. A load or prefetch, which
            holds its pins while device programs read the pages, is not brief: an
            edit of a page it holds is refused.
        """
        out: list[str | None] = []
        with self._lock:
            records = [self._slot(slot) for slot, _ in refs]  # all checked before any pin
            if any(s.edited for s in records):
                # An edit only copies host memory: short, so wait it out. Counted, so
                # that no next edit of the slot starts before this reader is in.
                for s in records:
                    s.waiting += 1
                try:
                    self._edits.wait_for(lambda: not any(s.edited for s in records))
                finally:
                    for s in records:
                        s.waiting -= 1
                    self._edits.notify_all()
            for s, (slot, generation) in zip(records, refs):
                if s.generation != generation:
                    out.append("stale generation")
                elif s.state != "valid":
                    out.append("freed" if s.state in ("free", "released", "retired") else
                               "still being written")
                else:
                    s.readers += 1
                    s.brief += brief
                    out.append(None)
        return out

    def release_readers(self, slots: Sequence[int], *, brief: bool = False) -> None:
        """Unpins slots ``acquire_readers`` pinned (with the same ``brief``)."""
        with self._lock:
            for slot in slots:
                s = self._slots[slot]
                s.readers -= 1
                if brief:
                    s.brief -= 1
                    self._edits.notify_all()
                if s.readers == 0 and s.state == "released":
                    self._free_locked(slot, s)

    def begin_edit(self, slot: int, generation: int) -> None:
        """Takes a committed page for a block write: its bytes and digests change
        together while no one else reads them.

        Waits for another edit of the slot (and for the readers that came during it
        to pin the page first) and for brief readers (block reads, exports) to
        finish; readers that come meanwhile wait for ``end_edit``. The slot stays
        pinned (no free or offload takes it) until ``end_edit``.

        Raises:
          PoolError: the ref is stale or its page freed, or a load or prefetch holds
            the page (it has read, or may yet read, the bytes as they are); naming
            the slot and what holds it. Nothing is taken then.

        Example:
            >>> from kvxfer.plan import LayerSpec, make_plan
            >>> pool = HostPool(make_plan([LayerSpec("L0", (8, 4), "float32")], 2))
            >>> (s, g), = pool.allocate(1)
            >>> pool.commit(s, g, key=7)
            >>> pool.acquire_readers([(s, g)])  # a load holds the page
            [None]
            >>> try:
            ...     pool.begin_edit(s, g)
            ... except PoolError as e:
            ...     print(str(e)[:55])
            host slot 0 generation 1 cannot be edited: 1 load or pr
            >>> pool.release_readers([s])  # the load ended
            >>> pool.begin_edit(s, g)  # bytes and digests are replaced here
            >>> pool.end_edit(s)
        """
        with self._lock:
            s = self._slot(slot)
            self._edits.wait_for(lambda: not s.edited and not s.waiting)
            if s.generation != generation or s.state != "valid":
                raise PoolError(f"host slot {slot} generation {generation} holds no page to "
                                f"edit (the slot is at generation {s.generation}, "
                                f"{s.state})")
            held = s.readers - s.brief
            if held:
                raise PoolError(f"host slot {slot} generation {generation} cannot be "
                                f"edited: {held} load or prefetch pin(s) hold its page; "
                                "write once the load ends or the prefetch is released")
            s.edited = True
            s.readers += 1
            self._edits.wait_for(lambda: not s.brief)

    def end_edit(self, slot: int) -> None:
        """Ends ``begin_edit``: readers waiting for the slot go ahead."""
        with self._lock:  # one step: a writer woken here must not find this edit's pin
            s = self._slots[slot]
            s.edited = False
            s.readers -= 1
            if s.readers == 0 and s.state == "released":
                self._free_locked(slot, s)
            self._edits.notify_all()

    def key_of(self, slot: int) -> int:
        with self._lock:
            return self._slots[slot].key
