"""Transfer handles as ``concurrent.futures.Future``s: callbacks, waits, polls, cancel,
and the offload stages ``set_transfer_hook`` sees."""

import concurrent.futures
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvxfer
from kvxfer import testing

SRC, DST = [5, 1, 6, 2], [0, 7, 3, 4]
LAYERS = 3
WAIT = 60  # seconds: generous on a loaded machine, never reached when things work

bits = testing.bits


def make(num_host_blocks=4, path="auto", caches=None):
    caches = caches or testing.random_caches(LAYERS, 8, (4, 128), "float32", seed=1)
    return caches, kvxfer.KVCacheManager(caches, num_host_blocks=num_host_blocks, path=path)


class Hold:
    """A transfer hook that holds the transfer thread at one event until ``go()``."""

    def __init__(self, event, layer=None):
        self.event, self.layer = event, layer
        self.reached = threading.Event()
        self._gate = threading.Event()

    def __call__(self, event, layer, array):
        if event == self.event and self.layer in (None, layer):
            self.reached.set()
            assert self._gate.wait(WAIT), "held transfer never let go"

    def go(self):
        self._gate.set()


def held_load(mgr, caches, pages, gate="all", layer=None):
    """A load held on the transfer thread before it waits for ``layer`` (default: any)."""
    hold = Hold("load_layer", layer)
    mgr.set_transfer_hook(hold)
    new, handle = mgr.load(caches, pages, DST, gate=gate)
    assert hold.reached.wait(WAIT)
    return new, handle, hold


def test_handles_are_futures():
    caches, mgr = make()
    with mgr:
        off = mgr.offload(caches, SRC, keys=[1, 2, 3, 4])
        assert isinstance(off, concurrent.futures.Future)
        pages = off.result(timeout=WAIT)
        assert off.wait() == pages and off.exception() is None
        assert off.done() and not off.running() and not off.cancelled()
        caches, load = mgr.load(caches, pages, DST)
        assert isinstance(load, concurrent.futures.Future)
        assert load.result(WAIT).verified_prefix == 4 and load.exception() is None
        assert not load.running() and not load.cancelled()


def test_add_done_callback_before_and_after_completion():
    caches, mgr = make()
    with mgr:
        pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
        new, handle, hold = held_load(mgr, caches, pages)
        fired, threads = [], []

        def callback(f):
            fired.append(f)
            threads.append(threading.current_thread())

        handle.add_done_callback(callback)
        assert not fired and handle.running() and not handle.done()
        hold.go()
        concurrent.futures.wait([handle], WAIT)
        assert fired == [handle] and threads[0] is not threading.current_thread()
        handle.add_done_callback(callback)  # already done: runs now, on this thread
        assert fired == [handle, handle] and threads[1] is threading.current_thread()
        assert handle.result().verified_prefix == 4

        mgr.set_transfer_hook(None)
        mgr.free(pages)
        off = mgr.offload(new, [0], keys=[9])
        done = threading.Event()
        off.add_done_callback(lambda f: done.set())
        assert done.wait(WAIT) and off.result()[0].key == 9


def test_wait_and_as_completed_over_offloads_and_loads():
    caches, mgr = make(num_host_blocks=8)
    with mgr:
        offs = [mgr.offload(caches, [b], keys=[b]) for b in range(4)]
        done, not_done = concurrent.futures.wait(offs, WAIT)
        assert done == set(offs) and not not_done
        pages = [o.result()[0] for o in offs]
        loads = []
        for p, d in zip(pages, [4, 5, 6, 7]):
            caches, h = mgr.load(caches, [p], [d])
            loads.append(h)
        got = list(concurrent.futures.as_completed(loads + offs, timeout=WAIT))
        assert set(got) == set(loads + offs)
        assert all(h.result().verified_prefix == 1 for h in loads)
        for i, c in enumerate(caches):
            assert np.array_equal(bits(c)[[4, 5, 6, 7]], bits(c)[[0, 1, 2, 3]])


@pytest.mark.parametrize("path", ["auto", "staged", "pinned", "dma"])
def test_a_caller_blocked_on_a_small_load_verifies_it_itself(path):
    """A load whose one program digests every layer is verified by the caller blocked
    in ``layer_ready`` when it gets there first: here the transfer thread is held in
    another transfer's done-callback, and the layers are released all the same. The
    transfer thread still settles the load and ends the handle."""
    caches, mgr = make(num_host_blocks=8, path=path)
    with mgr:
        pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
        busy, held = threading.Event(), threading.Event()
        first = mgr.offload(caches, [0], keys=[9])
        first.add_done_callback(lambda f: (busy.set(), held.wait(WAIT)))
        assert busy.wait(WAIT)  # the transfer thread is in the callback
        before = [bits(c) for c in caches]
        new, handle = mgr.load(caches, pages, DST, gate="layer")
        try:
            assert handle.layer_ready(LAYERS - 1) == 4
            assert not held.is_set(), "the layers waited for the transfer thread"
            assert all(handle.is_layer_ready(i) for i in range(LAYERS))
            assert not handle.done()  # the transfer thread has not settled it yet
        finally:
            held.set()
        assert handle.result(WAIT).verified_prefix == 4
        assert handle.released_prefixes == (4,) * LAYERS
        for old, c in zip(before, new):
            assert np.array_equal(bits(c)[DST], old[SRC])
        mgr.free(pages + first.result(WAIT))
        assert mgr.num_free_pages == 8


@pytest.mark.parametrize("gate", ["layer", "all"])
def test_is_layer_ready_never_blocks(gate):
    caches, mgr = make()
    with mgr:
        pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
        new, handle, hold = held_load(mgr, caches, pages, gate=gate, layer=1)
        if gate == "layer":
            assert handle.layer_ready(0, timeout=WAIT) == 4  # released before layer 1
        t0 = time.perf_counter()
        ready = [handle.is_layer_ready(i) for i in range(LAYERS)]
        assert time.perf_counter() - t0 < 0.05
        assert ready == [gate == "layer", False, False]
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError, match="layer 1 not ready after 0.0 s"):
            handle.layer_ready(1, timeout=0)  # a poll
        with pytest.raises(TimeoutError, match="load not done after 0.0 s"):
            handle.result(timeout=0)
        with pytest.raises(TimeoutError):
            handle.exception(timeout=0)
        assert time.perf_counter() - t0 < 0.05
        with pytest.raises(IndexError):
            handle.is_layer_ready(LAYERS)
        hold.go()
        assert handle.result(WAIT).verified_prefix == 4
        assert all(handle.is_layer_ready(i) for i in range(LAYERS))
        assert handle.layer_ready(2, timeout=0) == 4


def test_a_layer_released_with_prefix_0_reads_apart_from_one_not_released():
    caches, mgr = make()
    with mgr:
        pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
        testing.flip_bit(mgr, pages[0], layer=0)  # no page of the load is usable
        new, handle, hold = held_load(mgr, caches, pages, gate="layer", layer=1)
        assert handle.layer_ready(0, timeout=WAIT) == 0  # released, with nothing usable
        assert handle.layer_ready(0, timeout=0) == 0  # and stays so
        assert handle.is_layer_ready(0) and not handle.is_layer_ready(1)
        assert handle.released_prefixes == (0, None, None)
        with pytest.raises(TimeoutError, match="layer 1 not ready"):
            handle.layer_ready(1, timeout=0)
        hold.go()
        result = handle.result(WAIT)
        assert result.verified_prefix == 0 and result.released_prefixes == (0, 0, 0)
        assert not result.consumed_before_failure
        result.raise_if_consumed()


def test_a_failed_load_leaves_unreleased_layers_none():
    caches, mgr = make()
    with mgr:
        pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
        with testing.failing_transfer(mgr, after_layers=1):
            new, handle = mgr.load(caches, pages, DST, gate="layer")
        with pytest.raises(kvxfer.TransferError):
            handle.result(WAIT)
        assert handle.released_prefixes == (4, None, None)


def test_the_transfer_thread_half_of_a_handle_is_private():
    for cls, names in ((kvxfer.LoadHandle, ("finish", "release")),
                       (kvxfer.OffloadHandle, ("finish",))):
        for name in names:
            assert not hasattr(cls, name), f"{cls.__name__}.{name} is public"
            assert callable(getattr(cls, f"_{name}"))


def test_failed_load_carries_the_transfer_error_it_raises():
    caches, mgr = make()
    with mgr:
        pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
        with testing.failing_transfer(mgr, after_layers=1):
            new, handle = mgr.load(caches, pages, DST, gate="layer")
            with pytest.raises(kvxfer.TransferError, match="load failed") as raised:
                handle.result(WAIT)
        assert handle.exception() is raised.value
        assert isinstance(raised.value.__cause__, testing.InjectedTransferError)
        assert [handle.is_layer_ready(i) for i in range(LAYERS)] == [True, False, False]
        with pytest.raises(kvxfer.TransferError, match="before layer 1"):
            handle.layer_ready(1)
        assert not handle.cancel() and not handle.cancelled()
        assert mgr.num_free_pages == 0  # the pages are still the caller's


@pytest.mark.parametrize("gate", ["layer", "all"])
def test_cancel_releases_the_pins_of_an_aborted_load(gate):
    caches, mgr = make()
    before = [bits(c) for c in caches]
    with mgr:
        pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
        testing.flip_bit(mgr, pages[3], layer=2)  # a check the cancelled load skips
        new, handle, hold = held_load(mgr, caches, pages, gate=gate, layer=1)
        mgr.free(pages[:2])  # deferred: the load reads them
        assert mgr.num_free_pages == 0
        assert handle.cancel()
        assert handle.cancel()  # asked again: still True, nothing more to do
        assert handle.running() and not handle.done() and not handle.cancelled()
        assert mgr.num_free_pages == 0  # the device work still reads the pool
        fired = []
        handle.add_done_callback(fired.append)
        hold.go()
        done, _ = concurrent.futures.wait([handle], WAIT)
        assert done == {handle} and fired == [handle]
        assert handle.cancelled() and handle.done() and not handle.running()
        assert mgr.num_free_pages == 2  # freed pages returned, the others unpinned
        with pytest.raises(concurrent.futures.CancelledError):
            handle.result()
        with pytest.raises(concurrent.futures.CancelledError):
            handle.exception()
        with pytest.raises(concurrent.futures.CancelledError):
            handle.layer_ready(2)
        assert not handle.is_layer_ready(1) and not handle.is_layer_ready(2)
        assert handle.cancel()  # already cancelled
        # Nothing was verified, so nothing was judged bad: the flipped page stays.
        assert mgr.is_valid(pages[3])
        mgr.free(pages[2:])
        assert mgr.num_free_pages == 4  # no pin left behind
        # The caches handed back are usable, holding the (unverified) loaded blocks.
        for a, b in zip(new, before):
            assert not a.is_deleted()
            assert np.array_equal(bits(a)[DST[:3]], b[SRC[:3]])
        mgr.set_transfer_hook(None)
        (page,) = mgr.offload(new, [0], keys=[9]).wait()
        new, again = mgr.load(new, [page], [1])
        assert again.result(WAIT).verified_prefix == 1


def test_cancel_after_done_is_false():
    caches, mgr = make()
    with mgr:
        off = mgr.offload(caches, SRC, keys=[1, 2, 3, 4])
        pages = off.wait(WAIT)
        assert not off.cancel() and not off.cancelled() and off.result() == pages
        caches, load = mgr.load(caches, pages, DST)
        result = load.result(WAIT)
        assert not load.cancel() and not load.cancelled() and load.result() is result
        mgr.free(pages)
        assert mgr.num_free_pages == 4


def test_cancel_of_an_offload_before_its_pages_are_committed():
    caches, mgr = make()
    with mgr:
        hold = Hold("host_written")
        mgr.set_transfer_hook(hold)
        off = mgr.offload(caches, SRC, keys=[1, 2, 3, 4])
        assert hold.reached.wait(WAIT)
        assert mgr.num_free_pages == 0
        assert off.cancel() and not off.done()
        hold.go()
        concurrent.futures.wait([off], WAIT)
        assert off.cancelled() and mgr.num_free_pages == 4
        with pytest.raises(concurrent.futures.CancelledError):
            off.wait()


def test_offload_hooks_fire_per_class_on_their_threads():
    caches = testing.random_caches(2, 8, (4, 128), "float32", seed=2) + \
        testing.random_caches(1, 8, (2, 64), "bfloat16", seed=3)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    firsts = [c.layers[0] for c in mgr.plan.classes]
    assert len(firsts) == 2
    seen = []

    def hook(event, layer, array):
        seen.append((event, layer, threading.current_thread() is threading.main_thread(),
                     isinstance(array, jax.Array), array is None))

    with mgr:
        mgr.set_transfer_hook(hook)
        mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait(WAIT)
    assert [s for s in seen if s[0] == "gather_enqueued"] == \
        [("gather_enqueued", i, True, True, False) for i in firsts]
    assert [s for s in seen if s[0] == "host_written"] == \
        [("host_written", i, False, False, True) for i in firsts]
    assert [s[0] for s in seen] == ["gather_enqueued"] * 2 + ["host_written"] * 2


@pytest.mark.parametrize("event", ["gather_enqueued", "host_written"])
def test_a_raising_offload_hook_frees_the_slots(event):
    caches, mgr = make()

    def hook(at, layer, array):
        if at == event:
            raise OSError(f"injected at {at}")

    with mgr:
        mgr.set_transfer_hook(hook)
        if event == "gather_enqueued":
            with pytest.raises(kvxfer.TransferError, match="injected at gather_enqueued"):
                mgr.offload(caches, SRC, keys=[1, 2, 3, 4])
        else:
            off = mgr.offload(caches, SRC, keys=[1, 2, 3, 4])
            with pytest.raises(kvxfer.TransferError, match="injected at host_written") as e:
                off.wait(WAIT)
            assert off.exception() is e.value and not off.cancelled()
            assert mgr.stats()["transfer_errors"] == 1
        assert mgr.num_free_pages == 4
        mgr.set_transfer_hook(None)
        pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait(WAIT)
        assert len(pages) == 4 and mgr.num_free_pages == 0


@pytest.mark.parametrize("path", ["auto", "pinned", "staged", "dma"])
def test_blocks_rewritten_while_their_gather_is_in_flight(path):
    """An engine frees and reallocates the blocks right after ``offload`` enqueued their
    gather (donating the cache to the step that rewrites them): the pages hold the
    blocks as they were at the call."""
    caches, mgr = make(path=path)
    before = [bits(c) for c in caches]
    rewrite = jax.jit(lambda a: a.at[jnp.array(SRC)].set(0), donate_argnums=0)
    rewritten = []

    def hook(event, layer, array):
        if event == "gather_enqueued":
            rewritten.append(rewrite(array))

    with mgr:
        mgr.set_transfer_hook(hook)
        pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait(WAIT)
        assert len(rewritten) == len(mgr.plan.classes)
        assert not bits(rewritten[0])[SRC].any()
        for i, b in enumerate(before):
            for j, p in enumerate(pages):
                assert mgr.read_block_bytes(p, i) == b[SRC[j]].tobytes(), (i, j)


def test_an_error_escaping_the_transfer_thread_still_ends_the_handle(monkeypatch):
    caches, mgr = make()
    with mgr:
        pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()

        def boom(*args):
            raise RuntimeError("a bug in the transfer thread")

        monkeypatch.setattr(mgr._loads, "_count", boom)
        new, handle = mgr.load(caches, pages, DST)
        with pytest.raises(kvxfer.TransferError, match="a bug in the transfer thread"):
            handle.result(WAIT)
        assert handle.done() and isinstance(handle.exception(), kvxfer.TransferError)
        mgr.free(pages)
        assert mgr.num_free_pages == 4  # the pins were released before the error


@pytest.mark.parametrize("gate", ["layer", "all"])
def test_failing_transfer_fails_its_load_when_waited_on_after_the_block(gate):
    caches, mgr = make(num_host_blocks=8)
    with mgr:
        pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
        for attempt in range(12):
            with testing.failing_transfer(mgr):
                caches, handle = mgr.load(caches, pages, DST, gate=gate)
            with pytest.raises(kvxfer.TransferError, match="load failed") as raised:
                handle.result(WAIT)
            assert isinstance(raised.value.__cause__, testing.InjectedTransferError), attempt
        caches, handle = mgr.load(caches, pages, DST, gate=gate)  # after: untouched
        assert handle.result(WAIT).verified_prefix == 4


def test_failing_transfer_binds_to_the_loads_started_inside_it():
    """The transfer thread reaches the load's layers only after the block has exited
    (held by an earlier hook): the load still fails there."""
    caches, mgr = make()
    with mgr:
        pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
        hold = Hold("load_layer", 0)  # layer 1 is reached after the block, not before
        mgr.set_transfer_hook(hold)
        with testing.failing_transfer(mgr, after_layers=1):
            caches, handle = mgr.load(caches, pages, DST, gate="layer")
        assert mgr.set_transfer_hook(hold) is hold  # the block put the hook back
        assert hold.reached.wait(WAIT) and not handle.done()
        hold.go()
        with pytest.raises(kvxfer.TransferError, match="before layer 1"):
            handle.layer_ready(1, timeout=WAIT)
        assert handle.released_prefixes == (4, None, None)


def test_a_transfer_keeps_the_hook_of_its_call():
    """Hooks change while the transfer thread is held on an earlier load: each later
    transfer still sees (only) the hook installed at its own call."""
    caches, mgr = make(num_host_blocks=8)
    with mgr:
        pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
        hold = Hold("load_layer")
        mgr.set_transfer_hook(hold)
        caches, first = mgr.load(caches, pages, DST)
        assert hold.reached.wait(WAIT)  # the transfer thread waits from here on
        seen = []
        mgr.set_transfer_hook(lambda event, layer, array: seen.append(("offload's", event)))
        offload = mgr.offload(caches, [3], keys=[9])
        mgr.set_transfer_hook(None)
        caches, second = mgr.load(caches, pages, SRC)  # started with no hook
        mgr.set_transfer_hook(lambda event, layer, array: seen.append(("later", event)))
        hold.go()
        for handle in (first, offload, second):
            handle.result(WAIT)
        assert seen == [("offload's", "gather_enqueued"), ("offload's", "host_written")]


def test_the_transfer_thread_runs_calls_in_order_past_one_that_raises():
    from kvxfer.manager._thread import TransferThread
    t = TransferThread("kvxfer-test")
    out, started = [], threading.Event()

    def boom():
        raise RuntimeError("a call's own failure")

    t.submit(started.wait, WAIT)  # holds the thread while the rest is queued
    for i in range(5):
        t.submit(out.append, i)
        if i == 2:
            t.submit(boom)
    started.set()
    t.shutdown(wait=True)
    assert out == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="shut down"):
        t.submit(out.append, 5)
    t.shutdown()  # twice: nothing happens


def test_the_transfer_thread_shut_down_from_its_own_call_and_by_collection():
    import gc
    from kvxfer.manager._thread import TransferThread
    t, done = TransferThread("kvxfer-test"), threading.Event()
    t.submit(lambda: (t.shutdown(wait=True), done.set()))  # no join of itself
    assert done.wait(WAIT)
    t._thread.join(WAIT)
    assert not t._thread.is_alive()

    t = TransferThread("kvxfer-test")
    t.submit(int)
    thread = t._thread
    del t
    gc.collect()
    thread.join(WAIT)
    assert not thread.is_alive()


def test_a_closed_manager_ends_its_transfer_thread():
    caches, mgr = make()
    pages = mgr.offload(caches, [0], keys=[3]).wait()
    thread = mgr._worker._thread
    assert thread.is_alive() and thread.daemon
    mgr.close()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        mgr.load(caches, pages, [1])
