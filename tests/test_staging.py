"""The staged mover's loads. On XLA:CPU they read the pool in place (its pool is a
device array, other devices see it without a copy) in one program that also digests
what it wrote; with ``StagedMover.pool_in_place`` off they go through staging buffers,
reused only once the programs reading them ran, so back-to-back and overlapping loads
stay byte-exact, and warm-up leaves one ready."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import kvxfer
import kvxfer.engine._programs as programs
from kvxfer import testing
from kvxfer.engine._staged import StagedMover, StagingArena

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


def test_warm_up_leaves_a_written_spare_the_first_load_takes(monkeypatch):
    monkeypatch.setattr(StagedMover, "pool_in_place", False)
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


@pytest.mark.parametrize("mode", ["in-place", "copy"])
def test_overlapping_staged_loads_of_different_pages_stay_exact(mode, monkeypatch):
    monkeypatch.setattr(StagedMover, "pool_in_place", mode == "in-place")
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


def _programs_run(monkeypatch) -> list[str]:
    """The kinds of the programs kvxfer runs from now on, in order."""
    kinds: list[str] = []
    run = programs.run

    def counting(kind, *args, **kwargs):
        kinds.append(kind)
        return run(kind, *args, **kwargs)

    monkeypatch.setattr(programs, "run", counting)
    return kinds


@pytest.mark.parametrize("path", ["staged", "pinned"])
def test_a_load_reads_the_pool_in_place_and_digests_in_its_own_program(path, monkeypatch):
    caches = testing.random_caches(3, 16, (4, 128), "bfloat16", seed=5)
    before = [bits(c) for c in caches]
    with kvxfer.KVCacheManager(caches, num_host_blocks=8, path=path) as mgr:
        mgr.warmup(4)
        pool = mgr._pool.pools[0]
        if path == "staged":  # the pool is the device array the programs read
            assert pool.owner.unsafe_buffer_pointer() == pool.data.ctypes.data
        pages = mgr.offload(caches, [1, 2, 3], keys=[11, 12, 13]).wait()
        kinds = _programs_run(monkeypatch)
        caches, handle = mgr.load(caches, pages, [8, 9, 10], gate="layer")
        assert handle.result().verified_prefix == 3
        assert kinds == ["pinned_load"]  # one program: the pages and their digests
        if path == "staged":
            assert sum(len(v) for v in mgr._movers[0]._arena._spare.values()) <= 1
        for layer, ref in zip(caches, before):
            np.testing.assert_array_equal(bits(layer)[[8, 9, 10]], ref[[1, 2, 3]])
        # What the program read is the pool as it is now: a host bit flipped after the
        # offload is caught by those digests, at its page.
        testing.flip_bit(mgr, pages[1], layer=2)
        caches, handle = mgr.load(caches, pages, [12, 13, 14])
        result = handle.result()
        assert result.verified_prefix == 1 and "digest mismatch in layer 2" in result.reasons[1]
        # A transfer hook may stand in for what was written: the digests are then
        # programs of their own, reading what the hook returned.
        kinds.clear()
        mgr.set_transfer_hook(lambda event, layer, array: None)
        caches, handle = mgr.load(caches, [pages[0]], [15], gate="all")
        assert handle.result().verified_prefix == 1
        assert kinds[0] == "pinned_load" and "digest" in kinds[1:]
        mgr.set_transfer_hook(None)


def test_staged_loads_of_a_sharded_class_read_the_pool_on_every_device():
    mesh = jax.make_mesh((2,), ("kv",), devices=jax.devices()[:2])
    sharding = NamedSharding(mesh, P(None, None, "kv"))
    caches = testing.random_caches(2, 12, (4, 64), "float32", sharding=sharding, seed=6)
    before = [bits(c) for c in caches]
    with kvxfer.KVCacheManager(caches, num_host_blocks=6, path="staged") as mgr:
        mover = mgr._movers[0]
        pages = mgr.offload(caches, [0, 5, 7, 2], keys=[1, 2, 3, 4]).wait()
        caches, handle = mgr.load(caches, pages, [11, 3, 9, 1], gate="layer")
        assert handle.result().verified_prefix == 4
        data = mgr._pool.pools[0].data
        assert len(mover._pools) == 2  # one view of the pool per device, no copy
        assert all(a is not None and a.unsafe_buffer_pointer() == data.ctypes.data
                   for a in mover._pools.values())
        for layer, ref in zip(caches, before):
            np.testing.assert_array_equal(bits(layer)[[11, 3, 9, 1]], ref[[0, 5, 7, 2]])
            assert layer.sharding == sharding
