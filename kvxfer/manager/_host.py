"""Host pages by hand: free, validity, one layer's bytes read and written, blobs in and out.

What a manager does to its host pages without moving them to or from the devices:
``HostPages`` frees them, says whether a ref still holds its page, reads or replaces
one layer's bytes (re-digesting them on the host), and exports a page as a blob for
tiers below host memory or imports one back (``_pages`` holds the blob format).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer import integrity as _integrity
from kvxfer.hostpool import HostPool, PageRef, PoolError
from kvxfer.manager._checks import check_key
from kvxfer.manager._pages import PageFormatError, decode, encode
from kvxfer._counters import Counters
from kvxfer.plan import Plan, SliceClass

__all__ = ["HostPages", "host_copy_intact"]


def _shard_digest(pool: HostPool, cls: SliceClass, slot: int, pos: int, shard: int,
                  key: int, block: np.ndarray | None = None) -> np.ndarray:
    """The digest of one shard of one layer of a slot, made from its host bytes (or
    from ``block``, bytes about to replace them)."""
    if block is None:
        block = pool.pools[cls.index].shard_view(slot, pos, shard)
    words = _integrity.as_words_np(block[None], batch_dims=1)
    ident = _integrity.identity_words(key, cls.layers[pos], pool.seal_of(slot), shard)
    return _integrity.digest_np(words, ident)[0]


def host_copy_intact(pool: HostPool, classes: Sequence[SliceClass], slot: int,
                     key: int) -> bool:
    """Whether a slot's host bytes still match the digests made on the device.

    After a load's device digest fails, this tells a delivery fault (host bytes
    intact: the transfer delivered wrong bytes) from a bad page (host bytes that
    fail their own digests). The caller holds the slot as a reader, so no offload
    writes it meanwhile.
    """
    for cls in classes:
        stored = pool.pools[cls.index].digests[slot, :, :, :_integrity.DIGEST_WORDS]
        for pos in range(len(cls.layers)):
            for s in range(cls.num_shards):
                if not np.array_equal(_shard_digest(pool, cls, slot, pos, s, key),
                                      stored[pos, s]):
                    return False
    return True


class HostPages:
    """The host pages of one manager, as the caller handles them.

    Args:
      plan: the host-memory plan.
      pool: the host pool.
      fingerprint: what the manager's pages mean (``_pages.fingerprint``).
      stats: the manager's counters.
      with_digest: whether pages carry digests (``integrity="page"``).
    """

    def __init__(self, plan: Plan, pool: HostPool, fingerprint: bytes, stats: Counters,
                 with_digest: bool):
        self._plan = plan
        self._pool = pool
        self._fingerprint = fingerprint
        self._stats = stats
        self._with_digest = with_digest
        self._layer_class = [plan.class_of_layer(i) for i in range(plan.num_layers)]

    def free(self, pages: Sequence[PageRef]) -> None:
        pages = list(pages)
        for j, p in enumerate(pages):
            if not isinstance(p, PageRef):
                raise TypeError(f"pages[{j}]: expected a PageRef. Got {p!r} of type {type(p)}")
        self._pool.release_many([(p.slot, p.generation) for p in pages])

    def is_valid(self, page: PageRef) -> bool:
        if not isinstance(page, PageRef):
            raise TypeError(f"expected a PageRef. Got {page!r} of type {type(page)}")
        gen, state, key = self._pool.state(page.slot)
        return gen == page.generation and state == "valid" and key == page.key

    def _layer(self, page: PageRef, layer: int) -> tuple[SliceClass, int]:
        """Checks ``page`` and ``layer``; returns the layer's class and position."""
        num_layers = len(self._layer_class)
        if not isinstance(page, PageRef):
            raise TypeError(f"expected a PageRef. Got {page!r} of type {type(page)}")
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int. Got {layer!r} of type {type(layer)}")
        if not 0 <= layer < num_layers:
            raise IndexError(f"layer {layer} out of range [0, {num_layers})")
        return self._layer_class[layer]

    def _check_holds(self, page: PageRef, layer: int, cls: SliceClass) -> None:
        """Checks that the pinned slot holds ``page``'s key and ``layer``'s class."""
        if cls.index not in self._pool.classes_of(page.slot):
            raise PoolError(f"{page} does not hold layer {layer} (it holds slice "
                            f"classes {sorted(self._pool.classes_of(page.slot))}; layer "
                            f"{layer} is in class {cls.index})")
        if self._pool.key_of(page.slot) != page.key:
            raise PoolError(f"{page}: slot {page.slot} holds key "
                            f"{self._pool.key_of(page.slot):#x}")

    def read_block_bytes(self, page: PageRef, layer: int) -> bytes:
        cls, pos = self._layer(page, layer)
        # A brief pin: no free or offload takes the slot, and a block write waits.
        problem, = self._pool.acquire_readers([(page.slot, page.generation)], brief=True)
        if problem is not None:
            gen, state, _ = self._pool.state(page.slot)
            raise PoolError(f"{page} is not a valid page ({problem}: slot generation "
                            f"{gen}, {state})")
        try:
            self._check_holds(page, layer, cls)
            pool = self._pool.pools[cls.index]
            return b"".join(pool.shard_view(page.slot, pos, s).tobytes()
                            for s in range(cls.num_shards))
        finally:
            self._pool.release_readers([page.slot], brief=True)

    def write_block_bytes(self, page: PageRef, layer: int,
                          data: bytes | bytearray | memoryview) -> None:
        """Replaces one layer of a page and its digests as one edit.

        Readers (loads, prefetches, exports, block reads) find the page as it was or
        as written, never bytes and digests of two versions. A page a load or a
        prefetch holds is refused: that transfer read, or may yet read, the bytes as
        they are, and would find them disagreeing with new digests.
        """
        cls, pos = self._layer(page, layer)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, bytearray or memoryview. Got {type(data)}")
        buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        size = cls.bytes_per_block
        if buf.size != size:
            raise ValueError(f"layer {layer}: {buf.size} bytes given, a block is {size}")
        try:
            self._pool.begin_edit(page.slot, page.generation)
        except PoolError as e:
            raise PoolError(f"{page}: layer {layer} not written: {e}") from e
        try:
            self._check_holds(page, layer, cls)
            pool = self._pool.pools[cls.index]
            parts, at = [], 0
            for s in range(cls.num_shards):
                n = pool.shard_view(page.slot, pos, s).size
                parts.append(buf[at:at + n])
                at += n
            # Digests made from the new bytes before either lands, so both land at once.
            digests = [_shard_digest(self._pool, cls, page.slot, pos, s, page.key, part)
                       for s, part in enumerate(parts)] if self._with_digest else None
            with pool.lock:  # no program copies the pool in and out meanwhile
                for s, part in enumerate(parts):
                    pool.shard_view(page.slot, pos, s)[:] = part
                    if digests is not None:
                        pool.digests[page.slot, pos, s, :_integrity.DIGEST_WORDS] = digests[s]
        finally:
            self._pool.end_edit(page.slot)

    def export_page(self, page: PageRef) -> bytes:
        if not isinstance(page, PageRef):
            raise TypeError(f"expected a PageRef. Got {page!r} of type {type(page)}")
        problem, = self._pool.acquire_readers([(page.slot, page.generation)], brief=True)
        if problem is not None:
            raise PoolError(f"{page} cannot be exported: {problem}")
        try:
            if self._pool.key_of(page.slot) != page.key:
                raise PoolError(f"{page}: slot {page.slot} holds key "
                                f"{self._pool.key_of(page.slot):#x}")
            parts = {c: (self._pool.pools[c].read_page(page.slot),
                         self._pool.pools[c].digests[page.slot])
                     for c in sorted(self._pool.classes_of(page.slot))}
            blob = encode(self._plan, self._fingerprint, page.key,
                          self._pool.seal_of(page.slot), self._with_digest, parts)
        finally:
            self._pool.release_readers([page.slot], brief=True)
        self._stats.add(pages_exported=1)
        return blob

    def import_page(self, blob: bytes | bytearray | memoryview,
                    key: Any | None = None) -> PageRef:
        want = None if key is None else check_key(key, "key")
        try:
            page = decode(self._plan, self._fingerprint, blob)
            if want is not None and page.key != want:
                raise PageFormatError(f"page blob of key {page.key:#x} where key {want:#x} "
                                      "was expected", "wrong key")
            if self._with_digest and not page.digested:
                raise PageFormatError("page blob carries no digests (exported with "
                                      "integrity='off'); this manager verifies every page",
                                      "no digests")
        except PageFormatError as e:
            self._stats.add_labelled("imports_refused", e.kind)
            raise
        (slot, generation), = self._pool.allocate(1)
        for c, data in page.data.items():
            pool = self._pool.pools[c]
            with pool.lock:  # no program copies the pool in and out meanwhile
                pool.write_page(slot, data)
                pool.digests[slot] = page.digests[c]
        self._pool.commit(slot, generation, page.key, frozenset(page.data), seal=page.seal)
        self._stats.add(pages_imported=1)
        return PageRef(page.key, slot, generation)
