"""The one rule of the transfer engine, checked as value semantics.

Every device program of a transfer is enqueued on the caller's thread before
``offload()`` / ``load()`` returns, so:

(a) the caller may donate its caches to its next jitted step right after either call;
(b) the arrays ``load()`` returns are the loaded values for every later computation
    (never stale, never changing afterwards), and a computation dispatched before
    ``load()`` never sees the loaded bytes;
(c) several transfers may be in flight at once;
(d) a page whose own bytes and digest are intact is never freed because one caller
    expected another key for it.

Each test runs on every rig (``engine_rig.RIGS``): raw float32 copies, staged bf16,
float32 with KV heads sharded over 4 devices, and the pinned path on bf16 and on the
sharded caches. ``test_control_*`` tests do the same
moves with a wait between every call and the next: they check the rigs and the host
model themselves, and pass on any engine that round-trips at all. With
``KVXFER_TEST_SERIALIZE=1`` every transfer is waited for inside its call (see
``engine_rig``): the tests that then still fail break the rule in more than timing.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvxfer
from kvxfer import testing
from engine_rig import (NUM_LAYERS, RIG_NAMES, RIGS, HostModel, differing_blocks,
                        host_bits, page_mismatches, read_bits, slow_iterations,
                        slow_read_bits, step)


@pytest.fixture(params=RIG_NAMES)
def rig(request):
    return RIGS[request.param]


def _keys(base, n):
    return [base + j for j in range(n)]


def _offloaded(mgr, caches, model, ids, key):
    """Offloads ``ids`` and waits: (pages, per-layer contents [k, *block])."""
    contents = model.snapshot(ids)
    pages = mgr.offload(caches, ids, _keys(key, len(ids))).wait()
    return pages, contents


def _assert_verified(result, n, what=""):
    assert result.verified_prefix == n, (what, result.verified_prefix, result.reasons)
    assert not result.invalid_pages and not result.reasons, (what, result)
    assert not result.consumed_before_failure, (what, result)


# -- controls: the rig and the model on a fully serialized schedule --------------------

def test_control_round_trip_with_waits(rig):
    caches = rig.caches(seed=1)
    model = HostModel(caches)
    with rig.manager(caches) as mgr:
        pages, contents = _offloaded(mgr, caches, model, [3, 7, 12, 20], key=100)
        assert page_mismatches(rig, mgr, pages, contents) == []
        pats = rig.patterns((1,))
        caches = step(caches, 3, 9, pats)
        model.step(3, 9, pats)
        caches, load = mgr.load(caches, pages, [30, 1, 2, 25])
        _assert_verified(load.result(), 4)
        model.load([30, 1, 2, 25], contents)
        got = [np.asarray(a) for a in read_bits(caches, [30, 1, 2, 25])]
        assert differing_blocks(got, contents, [30, 1, 2, 25]) == []
        assert model.mismatches(caches) == []
        mgr.free(pages)


def test_control_pending_read_before_a_waited_load(rig):
    caches = rig.caches(seed=2)
    model = HostModel(caches)
    n = slow_iterations(rig.name)
    with rig.manager(caches) as mgr:
        pages, contents = _offloaded(mgr, caches, model, [0, 1], key=200)
        old = model.snapshot([10, 11])
        pending = slow_read_bits(caches, [10, 11], n)
        got = [np.asarray(a) for a in pending]  # waited for before the load
        caches, load = mgr.load(caches, pages, [10, 11])
        _assert_verified(load.result(), 2)
        assert differing_blocks(got, old, [10, 11]) == []
        mgr.free(pages)


# -- (a) donation right after the call -----------------------------------------------

def test_donate_right_after_offload(rig):
    """A donating step that overwrites the offloaded blocks right after ``offload()``:
    the pages still hold the bytes as they were at the call."""
    caches = rig.caches(seed=3)
    model = HostModel(caches)
    with rig.manager(caches) as mgr:
        for rep in range(20):
            ids = [(3 + 5 * rep) % 32, (7 + 5 * rep) % 32, (12 + 5 * rep) % 32]
            contents = model.snapshot(ids)
            pats = [rig.patterns((3, rep, w)) for w in ids]
            handle = mgr.offload(caches, ids, _keys(1000 * rep + 1, len(ids)))
            for w, p in zip(ids, pats):  # donate at once, overwriting the offloaded blocks
                caches = step(caches, w, (w + 1) % 32, p)
            for w, p in zip(ids, pats):
                model.step(w, (w + 1) % 32, p)
            pages = handle.wait()
            assert page_mismatches(rig, mgr, pages, contents) == [], f"rep {rep}"
            # and they load back byte-exact (waited, so this part is not under test)
            dst = [(20 + 5 * rep + j) % 32 for j in range(3)]
            caches, load = mgr.load(caches, pages, dst)
            _assert_verified(load.result(), 3, f"rep {rep}")
            model.load(dst, contents)
            assert model.mismatches(caches) == [], f"rep {rep}"
            mgr.free(pages)


def test_donate_right_after_load(rig):
    """A donating step right after ``load()`` (writing blocks the load does not touch):
    the load still verifies, and every loaded block is byte-exact."""
    caches = rig.caches(seed=4)
    model = HostModel(caches)
    with rig.manager(caches) as mgr:
        for rep in range(100):
            pages, contents = _offloaded(mgr, caches, model, [0, 1, 2, 3], key=1000 * rep)
            dst = [8 + rep % 8, 16 + rep % 8, 24 + rep % 5, 5]
            pats = [rig.patterns((4, rep, w)) for w in (30, 31)]
            caches, load = mgr.load(caches, pages, dst)
            for w, p in zip((30, 31), pats):
                caches = step(caches, w, 29, p)  # donates what load() returned, at once
            model.load(dst, contents)
            for w, p in zip((30, 31), pats):
                model.step(w, 29, p)
            _assert_verified(load.result(), 4, f"rep {rep}")
            got = [np.asarray(a) for a in read_bits(caches, dst)]
            assert differing_blocks(got, contents, dst) == [], f"rep {rep}"
            assert model.mismatches(caches) == [], f"rep {rep}"
            mgr.free(pages)


# -- (b) the returned arrays are the loaded values -----------------------------------

def test_no_stale_read_right_after_load(rig):
    """A jitted read dispatched right after ``load()`` (no ``layer_ready``) sees the
    page bytes, 100 times over."""
    caches = rig.caches(seed=5)
    model = HostModel(caches)
    with rig.manager(caches) as mgr:
        stale = []
        for rep in range(100):
            src = [(rep * 3 + j) % 16 for j in range(3)]
            dst = [16 + (rep * 5 + j) % 16 for j in range(3)]
            pages, contents = _offloaded(mgr, caches, model, src, key=1000 * rep)
            caches, load = mgr.load(caches, pages, dst)
            early = read_bits(caches, dst)  # dispatched at once, before anything waits
            model.load(dst, contents)
            _assert_verified(load.result(), 3, f"rep {rep}")
            bad = differing_blocks([np.asarray(a) for a in early], contents, dst)
            if bad:
                stale.append(f"rep {rep}: {bad}")
            mgr.free(pages)
        assert stale == [], f"{len(stale)} of 100 reads right after load() were stale: " \
                            f"{stale[:3]}"
        assert model.mismatches(caches) == []


def test_computation_dispatched_before_load_sees_old_bytes(rig):
    """A slow read of the destination blocks, dispatched before ``load()`` and still
    running when it is called, computes on the old bytes."""
    caches = rig.caches(seed=6)
    model = HostModel(caches)
    n = slow_iterations(rig.name)
    with rig.manager(caches) as mgr:
        for rep in range(3):
            src, dst = [0 + rep, 4 + rep], [20 + rep, 26 + rep]
            pages, contents = _offloaded(mgr, caches, model, src, key=1000 * rep)
            old = model.snapshot(dst)
            pending = slow_read_bits(caches, dst, n)  # ~0.3 s, reads dst at its end
            caches, load = mgr.load(caches, pages, dst)
            model.load(dst, contents)
            _assert_verified(load.result(), 2, f"rep {rep}")
            got = [np.asarray(a) for a in pending]
            assert differing_blocks(got, old, dst) == [], \
                f"rep {rep}: a computation dispatched before load() saw the loaded bytes"
            assert model.mismatches(caches) == [], f"rep {rep}"
            mgr.free(pages)


def test_loaded_arrays_never_change_after_load_returns(rig):
    """Host copies of the returned arrays taken right after ``load()`` returns hold the
    pages already, and equal those taken after ``result()``."""
    caches = rig.caches(seed=7)
    model = HostModel(caches)
    with rig.manager(caches) as mgr:
        problems = []
        for rep in range(20):
            src = [(rep + j * 4) % 16 for j in range(3)]
            dst = [16 + (rep * 3 + j * 5) % 16 for j in range(3)]
            pages, contents = _offloaded(mgr, caches, model, src, key=1000 * rep)
            caches, load = mgr.load(caches, pages, dst)
            first = host_bits(caches)  # at once
            model.load(dst, contents)
            _assert_verified(load.result(), 3, f"rep {rep}")
            later = host_bits(caches)
            stale = differing_blocks([f[dst] for f in first], contents, dst)
            changed = [f"layer {i}" for i in range(NUM_LAYERS)
                       if not np.array_equal(first[i], later[i])]
            if stale or changed:
                problems.append(f"rep {rep}: stale right after load() in {stale}, "
                                f"changed after result() in {changed}")
            mgr.free(pages)
        assert problems == [], f"{len(problems)} of 20 loads: {problems[:3]}"
        # np.asarray of a sharded jax.Array caches its host value: a copy taken too
        # early stays stale in later host copies of the same object too.
        assert model.mismatches(caches) == []


# -- (c) several transfers in flight -------------------------------------------------

def test_two_loads_and_an_offload_in_flight(rig):
    """Two loads into different blocks and an offload of other blocks, all started
    before any is waited for: no error, both verified, every byte exact."""
    caches = rig.caches(seed=8)
    model = HostModel(caches)
    with rig.manager(caches) as mgr:
        for rep in range(100):
            key = 10_000 * rep
            p1, c1 = _offloaded(mgr, caches, model, [0, 1, 2], key=key)
            p2, c2 = _offloaded(mgr, caches, model, [3, 4], key=key + 100)
            d1 = [10 + (rep % 3), 14, 15]
            d2 = [20, 21 + (rep % 4)]
            off_ids = [5, 6, 7, 8]
            c3 = model.snapshot(off_ids)  # blocks neither load writes
            keys3 = _keys(key + 200, len(off_ids))
            caches, l1 = mgr.load(caches, p1, d1)  # three calls back to back
            caches, l2 = mgr.load(caches, p2, d2)
            h3 = mgr.offload(caches, off_ids, keys3)
            model.load(d1, c1)
            model.load(d2, c2)
            errors = []
            pages3 = []
            for what, wait in (("offload", h3.wait), ("load 1", l1.result),
                               ("load 2", l2.result)):
                try:
                    got = wait()
                except kvxfer.TransferError as e:
                    errors.append(f"{what}: {e}")
                    continue
                if what == "offload":
                    pages3 = got
                else:
                    _assert_verified(got, len(p1) if what == "load 1" else len(p2),
                                     f"rep {rep} {what}")
            assert errors == [], f"rep {rep}: {errors}"
            assert page_mismatches(rig, mgr, pages3, c3) == [], f"rep {rep}"
            assert model.mismatches(caches) == [], f"rep {rep}"
            mgr.free(p1 + p2 + pages3)


# -- (d) a caller's wrong key is its own miss ----------------------------------------

def test_wrong_key_is_a_miss_and_the_page_stays_valid(rig):
    """A load expecting another key for page 2 misses at page 2 (the reason names the
    key it expected); the page itself is intact and later loads under its own key.

    Pages after it stay valid too: kvxfer frees only pages proven bad by their own
    digest (tests/test_faults.py checks the rest of that rule).
    """
    caches = rig.caches(seed=9)
    model = HostModel(caches)
    with rig.manager(caches) as mgr:
        pages, contents = _offloaded(mgr, caches, model, [0, 1, 2, 3], key=500)
        keys = testing.wrong_keys(pages, 2)
        dst = [10, 11, 12, 13]
        caches, load = mgr.load(caches, pages, dst, keys=keys)
        result = load.result()
        assert result.verified_prefix == 2, result
        assert 2 in result.reasons, result.reasons
        reason = result.reasons[2]
        assert "key" in reason and (f"{keys[2]:#x}" in reason or str(keys[2]) in reason), \
            reason
        got = [np.asarray(a)[:2] for a in read_bits(caches, dst)]
        assert differing_blocks(got, [c[:2] for c in contents], dst[:2]) == []

        # The page with the intact bytes and digest is still valid under its own key.
        try:
            held = mgr.read_block_bytes(pages[2], 0)
        except kvxfer.PoolError as e:
            pytest.fail(f"a load that expected another key freed the intact page 2: {e}")
        assert held == rig.page_bytes(contents[0][2])
        caches, again = mgr.load(caches, [pages[2]], [20], keys=[pages[2].key])
        _assert_verified(again.result(), 1, "reload of page 2 under its own key")
        got = [np.asarray(a) for a in read_bits(caches, [20])]
        assert differing_blocks(got, [c[2:3] for c in contents], [20]) == []
        mgr.free(pages)  # pages found bad were freed already: a no-op for them
