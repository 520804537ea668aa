"""What a call does on its caller's thread: never the raw path's wait behind pending
writers, a bounded number of programs per call and per warm-up."""

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest

import kvxfer
from kvxfer import testing
from kvxfer.engine import RawMover, RawOrPinnedMover

pytestmark = pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="XLA:CPU paths")

LAYERS, BLOCKS = 4, 16


def _caches(seed=0):
    return testing.random_caches(LAYERS, BLOCKS, (8, 128), "float32", seed=seed)


@jax.jit
def _slow(caches):
    # A chain of matmuls the result depends on: the new caches are not ready for a
    # while after this returns.
    x = jnp.ones((256, 256), jnp.float32)
    x = jax.lax.fori_loop(0, 400, lambda _, x: jnp.tanh(x @ x), x)
    zero = (x[0, 0] > 2.0).astype(jnp.uint32)  # tanh <= 1: always 0, never folded
    return [jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(c, jnp.uint32) + zero,
                                         c.dtype) for c in caches]


def _no_raw(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the raw path ran behind a pending writer")
    monkeypatch.setattr(RawMover, "start_offload", refuse)
    monkeypatch.setattr(RawMover, "start_load", refuse)


def test_auto_on_cpu_is_raw_with_a_pinned_stand_in():
    caches = _caches()
    with kvxfer.KVCacheManager(caches, num_host_blocks=8) as mgr:
        assert set(mgr.paths) == {"raw"}
        assert all(isinstance(m, RawOrPinnedMover) for m in mgr._movers)
    with kvxfer.KVCacheManager(caches, num_host_blocks=8, pinned=False) as mgr:
        assert not any(isinstance(m, RawOrPinnedMover) for m in mgr._movers)


@pytest.mark.parametrize("gate", ["all", "layer"])
def test_auto_does_not_take_the_raw_path_behind_pending_writers(monkeypatch, gate):
    caches = _caches()
    want = [np.asarray(c) for c in caches]
    with kvxfer.KVCacheManager(caches, num_host_blocks=8) as mgr:
        mover = mgr._movers[0]
        _no_raw(monkeypatch)
        caches = _slow(caches)
        assert not all(c.is_ready() for c in caches)
        pages = mgr.offload(caches, [3, 5], [1, 2]).wait()
        assert mover.fallbacks["offload"] == 1
        caches = _slow(caches)
        caches, h = mgr.load(caches, pages, [9, 10], gate=gate)
        assert mover.fallbacks["load"] == 1
        assert h.result().verified_prefix == 2
        got = [np.asarray(c) for c in caches]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g[[9, 10]].view(np.uint32), w[[3, 5]].view(np.uint32))
            np.testing.assert_array_equal(np.delete(g, [9, 10], 0).view(np.uint32),
                                          np.delete(w, [9, 10], 0).view(np.uint32))


def test_auto_takes_the_raw_path_when_ready():
    caches = _caches()
    with kvxfer.KVCacheManager(caches, num_host_blocks=8) as mgr:
        jax.block_until_ready(caches)
        pages = mgr.offload(caches, [1], [1]).wait()
        caches, h = mgr.load(caches, pages, [2])
        assert h.result().verified_prefix == 1
        # Raw offloads when ready; loads run the pinned in-place program (as fast, and
        # enqueued only).
        assert mgr._movers[0].fallbacks == {"offload": 0, "load": 1}
        # A raw page loads through the pinned programs, and the other way round.
        caches = _slow(caches)
        caches, h = mgr.load(caches, pages, [4])
        assert h.result().verified_prefix == 1
        np.testing.assert_array_equal(np.asarray(caches[0])[4], np.asarray(caches[0])[1])


class _Compiles:
    """Counts XLA compilations while active."""

    def __init__(self):
        self.count = 0
        self.on = False
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, event, duration, **kwargs):
        if self.on and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


_COMPILES = _Compiles()


@pytest.mark.parametrize("path", ["auto", "staged", "pinned", "dma"])
def test_warmup_compiles_a_bounded_number_of_programs(path):
    # 12 layers (a digest group and a remainder), one class, buckets 1..8: no program
    # is per layer, and on XLA:CPU the programs that loop over the pages (digests,
    # pinned copies, staged loads) are made once for every bucket.
    # A block shape of its own per path: auto's fallback runs the pinned programs.
    block = {"auto": (6, 128), "staged": (10, 128), "pinned": (14, 128), "dma": (18, 128)}[path]
    caches = testing.random_caches(12, 16, block, "bfloat16", seed=3)
    with kvxfer.KVCacheManager(caches, num_host_blocks=8, path=path) as mgr:
        _COMPILES.count, _COMPILES.on = 0, True
        try:
            buckets = mgr.warmup(8)
        finally:
            _COMPILES.on = False
    assert buckets == [1, 2, 4, 8]
    # pinned: the write and the load, each digesting what it moves (no digest program
    # of its own); auto: those, the raw offload's 2 digest programs and its alias
    # program; staged: the 2 digest programs, a gather per bucket and the load; dma: its
    # offload and its load, each digesting what it moves.
    expected = {"auto": 5, "pinned": 2, "staged": 2 + len(buckets) + 1, "dma": 2}[path]
    assert _COMPILES.count == expected, _COMPILES.count


@pytest.mark.parametrize("path", ["auto", "staged", "pinned"])
def test_calls_on_one_device_put_nothing_on_it(monkeypatch, path):
    # On XLA:CPU a program takes its index arrays as numpy arguments: a device_put of
    # them cost 50-110 us of the caller's time per call (3-5x that after a step).
    caches = _caches(seed=4)
    with kvxfer.KVCacheManager(caches, num_host_blocks=8, path=path) as mgr:
        mgr.warmup(4)
        puts = []
        real = jax.device_put
        for counted in (False, True):  # the first round makes the layer-number vectors
            if counted:
                monkeypatch.setattr(jax, "device_put",
                                    lambda *a, **k: puts.append(a) or real(*a, **k))
            for k, gate in ((3, "layer"), (1, "all")):
                pages = mgr.offload(caches, list(range(k)), list(range(k))).wait()
                caches, load = mgr.load(caches, pages, list(range(8, 8 + k)), gate=gate)
                assert load.result().verified_prefix == k
                mgr.free(pages)
        assert puts == []
