"""An engine loop over kvxfer: donating decode steps with transfers in flight around them.

Every iteration runs a donating jitted decode step that reads one block of every layer
and writes another (``engine_rig.step``); every few iterations the loop starts an
offload of some blocks and a load of earlier pages into other blocks, without waiting,
and waits for them a few iterations later, so that up to two loads and two offloads
are in flight at once. It uses the arrays each ``load()`` returns as its caches.

A host model (``engine_rig.HostModel``) holds what every block must contain under the
one rule of the transfer engine: each transfer acts at its call, each step at
its call. When a transfer is waited for, the loop checks that nothing failed, that an
offload's pages hold the blocks as they were at its call, that a load verified every
page, that a read dispatched right after ``load()`` saw the pages (no stale read), and
that the caches equal the model. ``sync=True`` is the control: the same schedule with
every transfer waited for right after its call, which any engine that round-trips
passes; it checks the loop and the model themselves.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import numpy as np
import pytest

import kvxfer
from engine_rig import (NUM_BLOCKS, NUM_LAYERS, RIG_NAMES, RIGS, HostModel,
                        differing_blocks, page_mismatches, read_bits, step)

ITERATIONS = 200
OFFLOAD_EVERY, OFFLOAD_WAIT = 3, 4  # start an offload every 3 iterations, wait 4 later
LOAD_EVERY, LOAD_WAIT = 4, 6        # start a load every 4 iterations, wait 6 later
MAX_READY = 24                      # pages kept for loading; older ones are freed


@dataclasses.dataclass
class _Offload:
    started: int
    ids: list[int]
    contents: list[np.ndarray]  # per layer [k, *block], as at the call
    handle: Any


@dataclasses.dataclass
class _Load:
    started: int
    pages: list[kvxfer.PageRef]
    dst: list[int]
    contents: list[np.ndarray]
    gate: str
    handle: Any
    early: Any = None  # a read of dst dispatched right after load()


@dataclasses.dataclass
class _Stats:
    offloads: int = 0
    loads: int = 0
    pages_loaded: int = 0
    max_in_flight: int = 0
    max_loads_in_flight: int = 0
    seconds: float = 0.0


class _Loop:
    def __init__(self, rig, sync: bool):
        self.rig, self.sync = rig, sync
        self.caches = rig.caches(seed=11)
        self.model = HostModel(self.caches)
        self.mgr = rig.manager(self.caches, num_host_blocks=64)
        self.offloads: list[_Offload] = []
        self.loads: list[_Load] = []
        self.ready: list[tuple[kvxfer.PageRef, list[np.ndarray]]] = []
        self.keys = itertools.count(1)
        self.stats = _Stats()
        self.it = 0

    def where(self, what: str) -> str:
        return f"{self.rig.name} iteration {self.it}: {what}"

    # -- transfers ---------------------------------------------------------------------

    def start_offload(self) -> None:
        ids = [(self.it * 5 + 11 * j) % NUM_BLOCKS for j in range(3)]
        contents = self.model.snapshot(ids)
        handle = self.mgr.offload(self.caches, ids, [next(self.keys) for _ in ids])
        self.offloads.append(_Offload(self.it, ids, contents, handle))
        self.stats.offloads += 1

    def finish_offload(self, o: _Offload) -> None:
        what = f"offload of blocks {o.ids} started at iteration {o.started}"
        try:
            pages = o.handle.wait(timeout=60)
        except kvxfer.TransferError as e:
            pytest.fail(self.where(f"{what} failed: {e}"))
        assert page_mismatches(self.rig, self.mgr, pages, o.contents) == [], \
            self.where(f"{what}: pages do not hold the blocks as they were at the call")
        self.ready += [(p, [c[j] for c in o.contents]) for j, p in enumerate(pages)]
        while len(self.ready) > MAX_READY:
            self.mgr.free([self.ready.pop(0)[0]])

    def start_load(self) -> None:
        if not self.ready:
            return
        take, self.ready = self.ready[:4], self.ready[4:]
        pages = [p for p, _ in take]
        contents = [np.stack([c[i] for _, c in take]) for i in range(NUM_LAYERS)]
        busy = {b for load in self.loads for b in load.dst}
        free = [b for b in range(NUM_BLOCKS) if b not in busy]
        start = (self.it * 9) % len(free)
        dst = [free[(start + 7 * j) % len(free)] for j in range(len(pages))]
        assert len(set(dst)) == len(dst)
        gate = "layer" if self.stats.loads % 2 else "all"
        self.caches, handle = self.mgr.load(self.caches, pages, dst, gate=gate)
        early = None if self.sync else read_bits(self.caches, dst)  # at once
        self.model.load(dst, contents)
        load = _Load(self.it, pages, dst, contents, gate, handle, early)
        self.loads.append(load)
        self.stats.loads += 1

    def finish_load(self, load: _Load) -> None:
        n = len(load.pages)
        what = (f"load (gate={load.gate!r}) of {n} pages into blocks {load.dst} started "
                f"at iteration {load.started}")
        try:
            if load.gate == "layer":
                prefixes = [load.handle.layer_ready(i, timeout=60) for i in range(NUM_LAYERS)]
                assert prefixes == [n] * NUM_LAYERS, self.where(f"{what}: {prefixes}")
            result = load.handle.result(timeout=60)
        except kvxfer.TransferError as e:
            pytest.fail(self.where(f"{what} failed: {e}"))
        assert result.verified_prefix == n and not result.invalid_pages and \
            not result.reasons and not result.consumed_before_failure, \
            self.where(f"{what}: {result}")
        if load.early is None:  # sync: read only once the load is done
            load.early = read_bits(self.caches, load.dst)
        stale = differing_blocks([np.asarray(a) for a in load.early], load.contents,
                                 load.dst)
        assert stale == [], self.where(f"{what}: a read dispatched right after load() "
                                       f"saw other bytes (stale) in {stale}")
        self.mgr.free(load.pages)
        self.stats.pages_loaded += n

    def settle(self, final: bool = False) -> None:
        """Waits for the transfers due now (all of them when ``final``)."""
        due = [o for o in self.offloads if final or self.sync or
               self.it - o.started >= OFFLOAD_WAIT]
        for o in due:
            self.offloads.remove(o)
            self.finish_offload(o)
        due_loads = [load for load in self.loads if final or self.sync or
                     self.it - load.started >= LOAD_WAIT]
        for load in due_loads:
            self.loads.remove(load)
            self.finish_load(load)
        if due_loads:
            bad = self.model.mismatches(self.caches)
            assert bad == [], self.where(f"the caches differ from the model in {len(bad)} "
                                         f"blocks, e.g. {bad[:4]}")

    # -- the loop ------------------------------------------------------------------------

    def run(self, iterations: int) -> _Stats:
        t0 = time.perf_counter()
        for self.it in range(iterations):
            self.settle()
            if self.it % OFFLOAD_EVERY == 0:
                self.start_offload()
                if self.sync:
                    self.settle()
            if self.it % LOAD_EVERY == 1:
                self.start_load()
                if self.sync:
                    self.settle()
            self.stats.max_in_flight = max(self.stats.max_in_flight,
                                           len(self.offloads) + len(self.loads))
            self.stats.max_loads_in_flight = max(self.stats.max_loads_in_flight,
                                                 len(self.loads))
            # The decode step: reads a block the newest load writes (if one is in
            # flight), writes another, and donates the caches at once.
            w = (self.it * 7 + 3) % NUM_BLOCKS
            r = self.loads[-1].dst[0] if self.loads else (self.it * 13 + 5) % NUM_BLOCKS
            patterns = self.rig.patterns((self.it,))
            self.caches = step(self.caches, w, r, patterns)
            self.model.step(w, r, patterns)
        self.it = iterations
        self.settle(final=True)
        bad = self.model.mismatches(self.caches)
        assert bad == [], self.where(f"at the end the caches differ from the model in "
                                     f"{len(bad)} blocks, e.g. {bad[:4]}")
        self.mgr.free([p for p, _ in self.ready])
        self.ready = []
        self.mgr.close()
        self.stats.seconds = time.perf_counter() - t0
        return self.stats


@pytest.mark.parametrize("rig", RIG_NAMES)
def test_engine_loop_with_transfers_in_flight(rig):
    stats = _Loop(RIGS[rig], sync=False).run(ITERATIONS)
    assert stats.max_loads_in_flight >= 2 and stats.max_in_flight >= 3, stats
    assert stats.loads >= 25 and stats.pages_loaded >= 90, stats


@pytest.mark.parametrize("rig", RIG_NAMES)
def test_control_engine_loop_waiting_after_every_call(rig):
    stats = _Loop(RIGS[rig], sync=True).run(ITERATIONS)
    assert stats.max_in_flight == 0, stats
    assert stats.loads >= 25 and stats.pages_loaded >= 90, stats
