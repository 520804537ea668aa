"""The host tier: the cache's pages in the manager's host pool, their order and pins.

``HostTier`` indexes one host page per key, tells its eviction policy
(``CachePolicy``) what arrives, what lookups find and what leaves, counts pins (a
pinned page is never evicted), tracks offloads on their way in, and evicts what the
policy picks to make room, handing each evicted page to the tier below
(``TierBelow``: the store tier) first. It holds no lock: the cache calls it under
its own. Its policy is called through a ``PolicyGuard``: a policy that raises or
answers wrongly costs the pages of one call, never a slot for good.

A put never evicts its own pages: those of its keys already cached stay pinned while
room is made for the rest, and when the pool cannot take every new page (the rest is
pinned, or the put is larger than the pool) the first ones are kept, in key order,
and the rest dropped (``dropped``): a page is useless without the pages of its prefix
before it.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Sequence
import jax

from kvxfer._counters import Counters
from kvxfer.cache._below import TierBelow
from kvxfer.cache._blocks import Columns, pick
from kvxfer.cache._deadline import Deadline
from kvxfer.cache._events import EventHub
from kvxfer.cache._guard import PolicyGuard
from kvxfer.cache._policy import CachePolicy
from kvxfer.hostpool import PageRef, PoolExhaustedError
from kvxfer.manager import KVCacheManager, OffloadHandle, PageFormatError

__all__ = ["HostTier"]

log = logging.getLogger("kvxfer")


class HostTier:
    """One host page per key in ``mgr``'s pool, evicted as ``policy`` picks.

    Args:
      mgr: the manager whose host pool holds the pages.
      stats: the cache's counters (``duplicates``, ``dropped``, ``evictions``,
        ``pages_put``).
      below: the tier evicted and arriving pages are handed to, or None.
      policy: the eviction policy, bound to this tier's capacity.
      events: where the tier's ``stored``/``evicted``/``removed`` events go.
    """

    def __init__(self, mgr: KVCacheManager, stats: Counters, below: TierBelow | None,
                 policy: CachePolicy, events: EventHub):
        self.mgr = mgr
        self.below = below
        self.policy = policy
        self._guard = PolicyGuard(policy)
        self._stats = stats
        self._events = events
        self._index: dict[int, PageRef] = {}
        self._hits: dict[int, int] = {}  # key -> lookups that found it on host
        self._pins: collections.Counter[int] = collections.Counter()
        self._pending: dict[int, OffloadHandle] = {}  # key -> the offload of its page
        self._offloads: list[tuple[OffloadHandle, list[int]]] = []

    # -- what is here --------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[int]:
        """The indexed keys, roughly the first to be evicted first."""
        return self._guard.order(self._index)

    def items(self) -> list[tuple[int, PageRef]]:
        return [(k, self._index[k]) for k in self._guard.order(self._index)]

    def holds(self, key: int) -> bool:
        """Whether ``key`` is indexed or on its way in (its ref not checked)."""
        return key in self._index or key in self._pending

    def page_of(self, key: int) -> PageRef | None:
        """The indexed page of ``key`` as it is (not checked, not marked used)."""
        return self._index.get(key)

    def peek(self, key: int) -> PageRef | None:
        """The valid host page of ``key``, or None; changes nothing."""
        ref = self._index.get(key)
        return ref if ref is not None and self.mgr.is_valid(ref) else None

    def arriving(self, key: int) -> bool:
        """Whether an offload of ``key``'s page is in flight (not indexed yet)."""
        return key in self._pending

    def get(self, key: int) -> PageRef | None:
        """The valid host page of ``key``, or None: an entry whose page was freed
        behind the cache's back leaves the index."""
        ref = self._index.get(key)
        if ref is not None and not self.mgr.is_valid(ref):
            self._unindex(key)
            return None
        return ref

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    # -- use and pins --------------------------------------------------------------

    def hits(self, key: int) -> int:
        """How many lookups found page ``key`` on host since it arrived."""
        return self._hits.get(key, 0)

    def touch(self, key: int) -> None:
        """The indexed page ``key`` was used again (a lookup, a repeated put)."""
        if key in self._index:
            self._guard.touch(key)

    def found(self, key: int) -> None:
        """A lookup found the indexed page ``key``: one use for the policy, one hit for
        the tier below (which may write the page once it has enough)."""
        if key not in self._index:
            return
        self._guard.touch(key)
        hits = self._hits[key] = self._hits.get(key, 0) + 1
        if self.below is not None:
            self.below.hit(key, self._index[key], hits)

    def used_together(self, keys: Sequence[int]) -> None:
        """The pages of one prefix (head first) were just used or arrived together:
        the policy may order them so that evictions take the tail first."""
        keys = [k for k in keys if k in self._index]
        if len(keys) > 1:
            self._guard.used_together(keys)

    def pin(self, key: int) -> None:
        self._pins[key] += 1

    def drop_pins(self) -> None:
        """Forgets every pin (the cache closed: nothing is evicted any more, so a hit
        or a load that never settles pins nothing for good)."""
        self._pins.clear()

    def unpin(self, keys: Iterable[int]) -> None:
        for key in keys:
            self._pins[key] -= 1
            if self._pins[key] <= 0:
                del self._pins[key]

    def add(self, key: int, ref: PageRef) -> bool:
        """Indexes a page that just arrived in host memory; whether it was (a policy
        that refuses it, by raising, costs the page: it is freed, counted ``dropped``)."""
        if key in self._index:  # a page of the key, freed behind the cache's back
            self._unindex(key)
        if not self._guard.insert(key):
            self.mgr.free([ref])
            self._stats.add(dropped=1)
            return False
        self._index[key] = ref
        self._events.emit("stored", key, "host")
        return True

    def discard(self, key: int, ref: PageRef) -> bool:
        """Unindexes ``key`` if it still names ``ref`` (the page is not freed here)."""
        if self._index.get(key) != ref:
            return False
        self._unindex(key)
        return True

    def _unindex(self, key: int) -> None:
        del self._index[key]
        self._hits.pop(key, None)
        self._guard.remove(key)
        self._events.emit("removed", key, "host")

    # -- room ----------------------------------------------------------------------

    def make_room(self, n: int) -> int:
        """Evicts what the policy picks until ``n`` host slots are free (or only pinned
        pages are left); how many of the ``n`` fit.

        Raises:
          PolicyError: the policy raised in ``evict`` or answered it wrongly (the pages
            it named stay cached, and in the policy).
        """
        while self.mgr.num_free_pages < n:
            short = n - self.mgr.num_free_pages
            victims = self._guard.evict(short, self._pins, self._index)
            if not victims:  # pages a policy lost after raising go now
                victims = self._guard.orphans(self._index, self._pins)[:short]
            if not victims:
                break
            for key in victims:
                self._evict(key)
        return min(n, self.mgr.num_free_pages)

    def _evict(self, key: int) -> None:
        """Frees an evicted page (spilling it to the store first)."""
        ref = self._index.pop(key)
        hits = self._hits.pop(key, 0)
        if self.mgr.is_valid(ref):
            if self.below is not None:
                self.below.spill(key, ref, hits)
            self.mgr.free([ref])
        self._stats.add(evictions=1)
        self._events.emit("evicted", key, "host")

    def admit(self, key: int, blob: bytes) -> PageRef | None:
        """A store blob imported as the host page of ``key`` (making room for it), or
        None when no slot is free after every unpinned page went.

        Raises:
          PageFormatError: the blob is not a whole page of this manager (another
            geometry, damaged framing, or some slice classes only).
        """
        if self.make_room(1) < 1:
            return None
        try:
            ref = self.mgr.import_page(blob, key=key)
        except PoolExhaustedError:
            return None
        held = self.mgr.host_pool.classes_of(ref.slot)
        classes = len(self.mgr.plan.classes)
        if len(held) < classes:
            # Some slice classes only (put there by another writer): a lookup of this
            # cache loads every class, so it could never be used.
            self.mgr.free([ref])
            raise PageFormatError(f"it holds slice classes {sorted(held)} of {classes}",
                                  "bad class")
        return ref if self.add(key, ref) else None

    # -- offloads on their way in --------------------------------------------------

    def offload(self, kv_caches: Sequence[jax.Array], cols: Columns, keys: list[int]
                ) -> tuple[list[int], OffloadHandle | None]:
        """Offloads the pages of ``keys`` not cached yet, evicting to make room (never
        the pages of ``keys``; when the rest does not fit, the first new ones are kept).

        Returns:
          The keys being offloaded and their handle (None when there are none).
        """
        todo: dict[int, int] = {}  # key -> its index in the call
        for j, key in enumerate(keys):
            ref = self.get(key)  # a page freed behind the cache's back is put again
            if ref is not None or key in self._pending or key in todo:
                self._stats.add(duplicates=1)
                if ref is not None:
                    self.touch(key)
                continue
            todo[key] = j
        if todo:  # checked before anything is evicted: in range, distinct
            self.mgr.check_blocks(pick(cols, todo.values()), len(todo), "keys")
        own = [k for k in dict.fromkeys(keys) if k in self._index]
        for key in own:  # the prefix this put extends is not evicted for it
            self.pin(key)
        try:
            room = self.make_room(len(todo))
        finally:
            self.unpin(own)
        if room < len(todo):
            self._stats.add(dropped=len(todo) - room)
            todo = dict(list(todo.items())[:room])
        if not todo:
            return [], None
        handle = self.mgr.offload(kv_caches, pick(cols, todo.values()), list(todo))
        new = list(todo)
        for key in new:
            self._pending[key] = handle
        self._offloads.append((handle, new))
        self._stats.add(pages_put=len(new))
        return new, handle

    def collect(self) -> None:
        """Indexes the pages of finished offloads (handing each to the tier below)."""
        still = []
        for handle, keys in self._offloads:
            if not handle.done():
                still.append((handle, keys))
                continue
            for key in keys:
                self._pending.pop(key, None)
            try:
                refs = handle.wait()
            except Exception as e:  # the manager freed the slots; nothing to index
                log.warning("offload of %d cache pages failed: %s", len(keys), e)
                continue
            for key, ref in zip(keys, refs):
                if self.add(key, ref) and self.below is not None:
                    self.below.arrived(key, ref)
            self.used_together(keys)
        self._offloads = still

    def wait_pending(self, key: int, deadline: Deadline) -> None:
        """Waits (until ``deadline``) for the offload of ``key`` if one is in flight,
        and indexes it; one not done by then stays on its way (logged)."""
        handle = self._pending.get(key)
        if handle is not None:
            try:
                handle.wait(deadline.left)
            except TimeoutError:
                log.warning("gave up waiting for the offload of page %#x after %s; "
                            "it is not on host yet", key, deadline)
            except Exception:
                pass
            self.collect()

    def wait_all(self, deadline: Deadline) -> None:
        """Waits (until ``deadline``) for every offload in flight and indexes them;
        those not done by then stay on their way (logged)."""
        late = 0
        for handle, _ in list(self._offloads):
            try:
                handle.wait(deadline.left)
            except TimeoutError:
                late += 1
            except Exception:
                pass
        if late:
            log.warning("gave up waiting for %d offloads of cache pages after %s", late,
                        deadline)
        self.collect()
