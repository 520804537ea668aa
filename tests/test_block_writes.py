"""Block writes racing loads, prefetches and exports, on every mover XLA:CPU runs.

``write_block_bytes`` replaces one layer of a host page and its digests together: a
load, prefetch or export sees the page as it was before the write or as it is after
it, whole, and never judges a good page bad. A write to a page a load or a prefetch
holds is refused (``PoolError`` naming the page), since the transfer has read, or may
be reading, the old bytes: accepting it would make the load see a page whose bytes
and digests disagree, and blame the transfer.
"""

from __future__ import annotations

import re
import threading
import time

import jax
import numpy as np
import pytest

import kvxfer
from kvxfer import testing

bits = testing.bits

#: Every manager route on XLA:CPU: (path, layouts emulated, pinned_route).
ROUTES = {
    "raw": ("auto", False, None),
    "staged": ("staged", False, None),
    "pinned": ("pinned", False, None),
    "pinned-pages": ("pinned", False, "pages"),
    "dma": ("dma", False, None),
    "emulated": ("auto", True, None),
}
#: How long the stress part of each route runs at most (a bound, never asserted).
STRESS_SECONDS = 2.0
SRC, DST = [1, 4, 6, 7], [9, 10, 11, 12]


def _manager(route: str, monkeypatch) -> tuple[kvxfer.KVCacheManager, list[jax.Array]]:
    path, emulated, pinned_route = ROUTES[route]
    # 64 KiB blocks: a host digest of one block takes long enough for a racing load
    # to land between a write's bytes and its digests, if they are not one step.
    caches = testing.random_caches(2, 16, (64, 256), "float32", seed=3)
    layouts = [kvxfer.Layout.of(c) for c in caches] if emulated else None
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path=path, layouts=layouts,
                                pinned_route=pinned_route)
    expected = {"raw": "raw", "staged": "staged", "pinned": "pinned",
                "pinned-pages": "pinned", "dma": "dma", "emulated": "emulated"}[route]
    assert mgr.paths == [expected] * 2
    return mgr, caches


def _refusal(page: kvxfer.PageRef) -> str:
    return re.escape(str(page)) + r".*(load|prefetch)"


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_writes_racing_loads_prefetches_and_exports_never_fault_a_good_page(route,
                                                                            monkeypatch):
    mgr, caches = _manager(route, monkeypatch)
    pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
    before = [bits(c) for c in caches]
    target = pages[0]
    old = mgr.read_block_bytes(target, 0)
    new_bytes = testing.random_bits((len(old),), "uint8", seed=11).tobytes()
    versions = {old, new_bytes}
    refused: list[str] = []
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            for data in (new_bytes, old):
                try:
                    mgr.write_block_bytes(target, 0, data)
                except kvxfer.PoolError as e:
                    refused.append(str(e))
                time.sleep(0)  # let the loads' Python run between writes

    def check(new, result, loaded_pages, dst):
        assert result.verified_prefix == len(loaded_pages), result.reasons
        assert result.freed_pages == () and result.reasons == {}
        got = [bits(c) for c in new]
        assert got[0][dst[0]].tobytes() in versions  # the old page whole, or the new
        assert np.array_equal(got[1][dst[0]], before[1][SRC[0]])
        for j in range(1, len(loaded_pages)):
            for layer in range(2):
                assert np.array_equal(got[layer][dst[j]], before[layer][SRC[j]])
        return new

    mgr.warmup(len(pages))  # the race, not compiling, fills the rounds
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    rounds = 0
    deadline = time.monotonic() + STRESS_SECONDS
    try:
        while time.monotonic() < deadline or rounds < 3:
            kind = ("load", "prefetch", "export")[rounds % 3]
            if kind == "load":
                caches, load = mgr.load(caches, pages, DST)
                caches = check(caches, load.result(), pages, DST)
            elif kind == "prefetch":
                staged = mgr.prefetch(pages)
                caches, load = mgr.load(caches, pages, DST, prefetched=staged)
                caches = check(caches, load.result(), pages, DST)
            else:
                blob = mgr.export_page(target)
                copy = mgr.import_page(blob, key=target.key)
                caches, load = mgr.load(caches, [copy], DST[:1])
                caches = check(caches, load.result(), [copy], DST[:1])
                mgr.free([copy])
            # No transfer holds the page now: a write of our own goes in.
            mgr.write_block_bytes(target, 0, old)
            rounds += 1
    finally:
        stop.set()
        thread.join()
    st = mgr.stats()
    assert st["transfer_faults"] == 0 and st["pages_freed"] == 0, st
    assert all(mgr.is_valid(p) for p in pages)
    for msg in refused:
        assert re.search(_refusal(target), msg), msg
    mgr.close()


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_write_to_a_prefetched_page_is_refused_and_the_load_verifies(route, monkeypatch):
    mgr, caches = _manager(route, monkeypatch)
    pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
    before = [bits(c) for c in caches]
    staged = mgr.prefetch(pages)
    zeros = bytes(len(mgr.read_block_bytes(pages[1], 1)))
    with pytest.raises(kvxfer.PoolError, match=_refusal(pages[1])):
        mgr.write_block_bytes(pages[1], 1, zeros)
    caches, load = mgr.load(caches, pages, DST, prefetched=staged)
    result = load.result()
    assert result.verified_prefix == 4 and result.reasons == {}
    assert np.array_equal(bits(caches[1])[DST[1]], before[1][SRC[1]])
    assert mgr.stats()["transfer_faults"] == 0
    mgr.write_block_bytes(pages[1], 1, zeros)  # the load is done: the page is free to edit
    assert mgr.read_block_bytes(pages[1], 1) == zeros
    caches, load = mgr.load(caches, pages[1:2], DST[:1])
    assert load.result().verified_prefix == 1
    assert not bits(caches[1])[DST[0]].any()
    mgr.close()


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_write_to_a_page_a_load_is_reading_is_refused(route, monkeypatch):
    mgr, caches = _manager(route, monkeypatch)
    pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
    zeros = bytes(len(mgr.read_block_bytes(pages[2], 0)))
    waiting, go = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold(event, layer, array):
        if event == "load_layer" and layer == 0:
            waiting.set()
            go.wait(60)

    mgr.set_transfer_hook(hold)
    caches, load = mgr.load(caches, pages, DST)
    try:
        assert waiting.wait(60)
        try:
            mgr.write_block_bytes(pages[2], 0, zeros)
        except BaseException as e:  # noqa: BLE001 - checked below, after the load ends
            errors.append(e)
    finally:
        go.set()
    result = load.result()
    mgr.set_transfer_hook(None)
    assert len(errors) == 1 and isinstance(errors[0], kvxfer.PoolError), errors
    assert re.search(_refusal(pages[2]), str(errors[0])), errors[0]
    assert result.verified_prefix == 4 and result.reasons == {}
    assert mgr.stats()["transfer_faults"] == 0
    mgr.close()
