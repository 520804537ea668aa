"""The staged mover's staging buffers: reused only once the programs reading them ran,
so back-to-back and overlapping loads stay byte-exact, and warm-up leaves one ready."""

import jax
import numpy as np

import kvxfer
from kvxfer import testing
from kvxfer.engine._staged import StagingArena

bits = testing.bits


class Flag:
    """Stands in for a program's ballast output: ready when the test says so."""

    def __init__(self):
        self.ready = False

    def is_ready(self):
        return self.ready


def test_a_lent_buffer_is_not_handed_out_before_its_readers_ran():
    arena = StagingArena()
    a = arena.take((4, 2, 8), np.float32)
    flag = Flag()
    arena.lend(a, [flag])
    b = arena.take((4, 2, 8), np.float32)
    assert b is not a  # a program may still read ``a``
    flag.ready = True
    assert arena.take((4, 2, 8), np.float32) is a
    assert arena.take((4, 2, 8), np.float32) is not a  # handed out once


def test_spares_are_per_shape_and_dtype_and_bounded():
    arena = StagingArena()
    bufs = [arena.take((3, 5), np.uint16) for _ in range(StagingArena.KEEP + 2)]
    for buf in bufs:
        flag = Flag()
        flag.ready = True
        arena.lend(buf, [flag])
    assert arena.take((3, 5), np.uint32) is not None
    got = [arena.take((3, 5), np.uint16) for _ in range(StagingArena.KEEP + 1)]
    ids = {id(b) for b in bufs}
    assert sum(id(g) in ids for g in got) == StagingArena.KEEP
    assert all(g.ctypes.data % 64 == 0 for g in got)  # aliased by device_put on CPU


def test_warm_up_leaves_a_written_spare_the_first_load_takes():
    caches = testing.random_caches(3, 16, (4, 128), "float32", seed=3)
    with kvxfer.KVCacheManager(caches, num_host_blocks=8, path="staged") as mgr:
        mgr.warmup(4)
        arena = mgr._movers[0]._arena
        assert sum(len(v) for v in arena._spare.values()) == 1
        pages = mgr.offload(caches, [1, 2, 3, 4], keys=[11, 12, 13, 14]).wait()
        caches, handle = mgr.load(caches, pages, [8, 9, 10, 11])
        handle.result()
        assert sum(len(v) for v in arena._spare.values()) == 0  # taken, lent
        for src, dst in zip([1, 2, 3, 4], [8, 9, 10, 11]):
            for layer in caches:
                np.testing.assert_array_equal(bits(layer[dst]), bits(layer[src]))


def test_overlapping_staged_loads_of_different_pages_stay_exact():
    caches = testing.random_caches(4, 32, (4, 128), "float32", seed=4)
    want = [bits(c) for c in caches]
    with kvxfer.KVCacheManager(caches, num_host_blocks=16, path="staged") as mgr:
        mgr.warmup(4)
        groups = [list(range(4 * g, 4 * g + 4)) for g in range(4)]
        pages = [mgr.offload(caches, ids, keys=[100 + i for i in ids]).wait() for ids in groups]
        for rnd in range(3):
            handles = []
            for g, held in enumerate(pages):  # four loads in flight, no wait between
                dst = [16 + i for i in groups[(g + rnd) % 4]]
                caches, h = mgr.load(caches, held, dst)
                handles.append((h, groups[g], dst))
            for h, src, dst in handles:
                h.result()
            jax.block_until_ready(caches)
            for h, src, dst in handles:  # the rows of one round are disjoint
                for layer, ref in zip(caches, want):
                    np.testing.assert_array_equal(bits(layer)[dst], ref[src])
