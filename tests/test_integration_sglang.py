"""KvxferHostKVPool against the interface sglang-jax's HiCache calls (LRUHostKVPool).

The contract is what a caller sees: slot bookkeeping (alloc/free, reserve/release,
lock refs), the two-phase transfers split across threads as the HiCache controller
splits them, reused ids never receiving a stale transfer, sharded caches, and a bad
page reported as a miss through ``flush_load``. sglang-jax is not needed.
"""

import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import time

import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from kvxfer import testing
from kvxfer.engine import TransferError
from kvxfer.integrations.sglang_jax import FlushLoadResult, KvxferHostKVPool

SPEC = P("data", None, "tensor", None, None)  # how sglang-jax shards its KV buffer


@dataclasses.dataclass
class DevicePool:
    """The part of sglang-jax's device KV pool the host pool reads."""

    kv_buffer: list[jax.Array]
    page_size: int
    size: int


def device_pool(*, pages=9, page_size=1, heads=2, layers=2, dtype=jnp.float32,
                sharding=None, seed=0):
    shape = (pages, page_size, heads, 1, 128)
    bufs = []
    for layer in range(layers):
        x = jax.random.normal(jax.random.PRNGKey(seed * 10 + layer), shape, jnp.float32)
        x = x.astype(dtype)
        bufs.append(jax.device_put(x, sharding) if sharding is not None else x)
    return DevicePool(bufs, page_size, (pages - 1) * page_size)


def host_pool(dev, pool_size=4, **kw):
    shape = tuple(int(d) for d in dev.kv_buffer[0].shape[1:])
    return KvxferHostKVPool(dev, pool_size, dev.page_size, len(dev.kv_buffer), shape,
                            dev.kv_buffer[0].dtype, None, SPEC, **kw)


@pytest.fixture
def dev():
    return device_pool()


@pytest.fixture
def pool(dev):
    p = host_pool(dev)
    yield p
    p.close()


def snapshot(dev, page):
    return [testing.bits(b)[page].copy() for b in dev.kv_buffer]


def assert_page(dev, page, expected):
    for layer, want in enumerate(expected):
        got = testing.bits(dev.kv_buffer[layer])[page]
        assert np.array_equal(got, want), f"layer {layer} of device page {page}"


# -- slots ------------------------------------------------------------------------------


def test_reserve_release_and_sizes(pool):
    assert pool.total_size() == 4 and pool.available_size() == 4
    ids = [pool.reserve() for _ in range(4)]
    assert sorted(ids) == [0, 1, 2, 3] and pool.reserve() is None
    assert pool.available_size() == 0
    pool.release(ids[1])
    assert pool.available_size() == 1 and pool.reserve() == ids[1]
    pool.release(ids[0])
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(ids[0])
    with pytest.raises(ValueError, match="outside pool range"):
        pool.release(99)


def test_alloc_is_all_or_nothing_and_free_dedupes(pool):
    pages = pool.alloc(3)
    assert pages.dtype == np.int64 and len(set(pages.tolist())) == 3
    assert pool.alloc(2) is None and pool.available_size() == 1
    pool.free([int(pages[0]), int(pages[0]), int(pages[1])])
    assert pool.available_size() == 3
    with pytest.raises(ValueError, match="need_pages"):
        pool.alloc(0)


def test_lock_refs_guard_free(pool):
    (b,) = pool.alloc(1).tolist()
    with pytest.raises(RuntimeError, match="underflow"):
        pool.dec_lock_ref(b)
    pool.inc_lock_ref(b)
    pool.inc_lock_ref(b)
    pool.dec_lock_ref(b)
    with pytest.raises(RuntimeError, match="locked"):
        pool.free([b])
    pool.dec_lock_ref(b)
    pool.free([b])
    with pytest.raises(RuntimeError, match="not allocated"):
        pool.inc_lock_ref(b)
    with pytest.raises(ValueError, match="outside pool range"):
        pool.inc_lock_ref(99)


def test_a_bad_id_in_free_frees_nothing(pool):
    ids = pool.alloc(2).tolist()
    pool.inc_lock_ref(ids[1])
    with pytest.raises(RuntimeError, match="locked"):
        pool.free(ids)
    assert pool.available_size() == 2


def test_constructor_checks_against_the_device_pool(dev, caplog):
    with pytest.raises(ValueError, match="pool_size"):
        KvxferHostKVPool(dev, 0, 1, 2, (1, 2, 1, 128), jnp.float32, None, SPEC)
    with pytest.raises(ValueError, match="layer_num"):
        KvxferHostKVPool(dev, 4, 1, 3, (1, 2, 1, 128), jnp.float32, None, SPEC)
    # Callers pass shapes the engine's pool never checks: the buffers are the truth.
    with caplog.at_level("WARNING", logger="kvxfer"):
        pool = KvxferHostKVPool(dev, 4, 1, 2, (8,), jnp.bfloat16, None, SPEC)
    assert "per_layer_shape=(8,)" in caplog.text
    (b,) = pool.alloc(1).tolist()
    want = snapshot(dev, 1)
    pool.copy_into([1], [b])
    assert pool.copy_to_device([b], [3]).ok
    assert_page(dev, 3, want)
    pool.close()


# -- transfers ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,page_size", [(jnp.float32, 1), (jnp.bfloat16, 4)])
def test_round_trip_is_bit_exact_and_touches_nothing_else(dtype, page_size):
    dev = device_pool(dtype=dtype, page_size=page_size)
    pool = host_pool(dev)
    try:
        srcs, dsts = [1, 2, 3], [6, 7, 8]
        want = [snapshot(dev, s) for s in srcs]
        guard = snapshot(dev, 0)
        ids = pool.alloc(3).tolist()
        pool.copy_into(srcs, ids)
        result = pool.copy_to_device(ids, dsts)
        assert isinstance(result, FlushLoadResult)
        assert result.ok and result.verified_pages == 3 and result.loaded == tuple(ids)
        for d, w in zip(dsts, want):
            assert_page(dev, d, w)
        assert_page(dev, 0, guard)
    finally:
        pool.close()


def test_the_controller_split_stores_the_bytes_of_the_call(dev, pool):
    # As HiCacheController.write: the gather on the KV-owning thread, the host put on
    # its D2H worker; the engine's next step may overwrite the page at once.
    want = snapshot(dev, 2)
    (b,) = pool.alloc(1).tolist()
    pool.stage_backup([2], [b])
    dev.kv_buffer = [buf.at[2].set(0) for buf in dev.kv_buffer]
    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        worker.submit(pool.flush_backup, [b]).result()
        worker.submit(pool.stage_load, [b]).result()   # H2D stage off the KV thread
    result = pool.flush_load([b], [5])
    assert result.ok
    assert_page(dev, 5, want)


def test_two_phase_errors_are_loud(pool):
    (b,) = pool.alloc(1).tolist()
    with pytest.raises(RuntimeError, match="stage_backup"):
        pool.flush_backup([b])
    with pytest.raises(RuntimeError, match="stage_load"):
        pool.flush_load([b], [0])
    with pytest.raises(RuntimeError, match="empty"):
        pool.stage_load([b])
    with pytest.raises(ValueError, match="length"):
        pool.copy_into([1, 2], [b])
    with pytest.raises(ValueError, match="outside pool range"):
        pool.copy_to_device([99], [0])
    with pytest.raises(ValueError, match="id=-1 outside pool range"):
        pool.flush_backup([-1])
    with pytest.raises(RuntimeError, match="not allocated"):
        pool.stage_backup([0], [(b + 1) % 4])
    with pytest.raises(NotImplementedError):
        pool.copy_from_device([], b)


def test_device_page_bounds_are_the_buffer_rows(dev, pool):
    (b,) = pool.alloc(1).tolist()
    n = dev.kv_buffer[0].shape[0]
    with pytest.raises(ValueError, match="device page"):
        pool.stage_backup([n], [b])
    pool.copy_into([n - 1], [b])        # the top row (the engine's sentinel page) is valid
    pool.stage_load([b])
    with pytest.raises(ValueError, match="device page"):
        pool.flush_load([b], [-1])


def test_free_forgets_a_slot_and_its_transfers(dev, pool):
    (b,) = pool.alloc(1).tolist()
    pool.stage_backup([1], [b])
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.flush_backup([b])
    (b,) = pool.alloc(1).tolist()
    pool.copy_into([1], [b])
    pool.stage_load([b])
    pool.release(b)
    with pytest.raises(RuntimeError, match="stage_load"):
        pool.flush_load([b], [4])
    assert pool.available_size() == 4
    # The orphaned backup's page is freed once its offload lands (a done callback).
    deadline = time.monotonic() + 10
    while pool.manager.num_free_pages != 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.manager.num_free_pages == 4


def test_a_reused_id_never_receives_a_stale_backup(dev):
    pool = host_pool(dev, pool_size=1)
    try:
        (b,) = pool.alloc(1).tolist()
        pool.stage_backup([1], [b])
        pool.free([b])
        (again,) = pool.alloc(1).tolist()
        assert again == b
        with pytest.raises(RuntimeError, match="empty"):
            pool.stage_load([b])          # the old backup did not land in the new owner
        want = snapshot(dev, 3)
        pool.copy_into([3], [b])          # a new backup into the id waits for the old one
        assert pool.copy_to_device([b], [6]).ok
        assert_page(dev, 6, want)
    finally:
        pool.close()


def test_a_reused_id_is_not_scattered_from_a_stale_stage(dev):
    pool = host_pool(dev, pool_size=1)
    try:
        (b,) = pool.alloc(1).tolist()
        pool.copy_into([2], [b])
        pool.stage_load([b])
        guard = snapshot(dev, 7)
        pool.free([b])
        pool.alloc(1)
        with pytest.raises(RuntimeError, match="stage_load"):
            pool.flush_load([b], [7])    # free() dropped the staged load
        assert_page(dev, 7, guard)
    finally:
        pool.close()


def test_an_id_freed_while_its_flush_waits_takes_a_new_backup_that_waits(dev):
    # The D2H worker waits in flush_backup for an offload still writing the slot; the
    # engine thread frees the id, gets it again and backs a new page up into it.
    pool = host_pool(dev, pool_size=1)
    landing, land = threading.Event(), threading.Event()
    previous = pool.manager.set_transfer_hook(None)

    def hold(event, layer, array):
        out = previous(event, layer, array)
        if event == "host_written" and not land.is_set():
            landing.set()
            land.wait(60)                       # the offload lands when the test says
        return out

    pool.manager.set_transfer_hook(hold)
    try:
        (b,) = pool.alloc(1).tolist()
        pool.stage_backup([1], [b])
        with concurrent.futures.ThreadPoolExecutor(2) as threads:
            flush = threads.submit(pool.flush_backup, [b])
            assert landing.wait(60)
            deadline = time.monotonic() + 60    # until the worker took the entry
            while b in pool._pending_gather and time.monotonic() < deadline:
                time.sleep(0.001)
            assert b not in pool._pending_gather and not flush.done()
            pool.free([b])
            assert pool.alloc(1).tolist() == [b]
            want = snapshot(dev, 3)
            backup = threads.submit(pool.stage_backup, [3], [b])
            land.set()
            backup.result(60)                   # waited for the old backup, no PoolError
            flush.result(60)                    # the freed id published nothing
        pool.flush_backup([b])
        assert pool.manager.num_free_pages == 0  # the old page freed, the new one held
        assert pool.copy_to_device([b], [6]).ok
        assert_page(dev, 6, want)
    finally:
        land.set()
        pool.close()


def test_a_call_naming_an_id_twice_is_refused_before_anything_is_lost(dev, pool):
    a, b = pool.alloc(2).tolist()
    want = [snapshot(dev, 1), snapshot(dev, 2)]
    with pytest.raises(ValueError, match=f"stage_backup names host page id={a} more"):
        pool.stage_backup([1, 2], [a, a])
    assert pool._pending_gather == {} and pool.manager.num_free_pages == 4
    pool.stage_backup([1, 2], [a, b])
    with pytest.raises(ValueError, match=f"flush_backup names host page id={b} more"):
        pool.flush_backup([b, a, b])
    pool.flush_backup([a, b])                   # the refusal kept both staged backups
    with pytest.raises(ValueError, match=f"stage_load names host page id={a} more"):
        pool.copy_to_device([a, a], [5, 6])
    pool.stage_load([a, b])
    with pytest.raises(ValueError, match=f"flush_load names host page id={a} more"):
        pool.flush_load([a, a], [5, 6])
    with pytest.raises(ValueError, match="flush_load names device page id=5 more"):
        pool.flush_load([a, b], [5, 5])
    assert pool.flush_load([a, b], [5, 6]).ok   # the staged loads survived both
    assert_page(dev, 5, want[0])
    assert_page(dev, 6, want[1])
    with pytest.raises(ValueError, match="copy_to_device names device page id=7 more"):
        pool.copy_to_device([a, b], [7, 7])
    assert pool._pending_load == {}
    assert pool.copy_to_device([b, a], [7, 8]).ok
    assert_page(dev, 8, want[0])


# Each call that takes ids, given a bad one where ``b`` (host id 1) or a device page
# belongs: truncated, 1.9 and True would both be 1.
ID_CALLS = {
    "free": lambda p, x, b: p.free([x]),
    "release": lambda p, x, b: p.release(x),
    "inc_lock_ref": lambda p, x, b: p.inc_lock_ref(x),
    "dec_lock_ref": lambda p, x, b: p.dec_lock_ref(x),
    "page_of": lambda p, x, b: p.page_of(x),
    "stage_backup host": lambda p, x, b: p.stage_backup([3], [x]),
    "stage_backup device": lambda p, x, b: p.stage_backup([x], [b]),
    "copy_into host": lambda p, x, b: p.copy_into([3], [x]),
    "copy_into device": lambda p, x, b: p.copy_into([x], [b]),
    "flush_backup": lambda p, x, b: p.flush_backup([x]),
    "stage_load": lambda p, x, b: p.stage_load([x]),
    "flush_load host": lambda p, x, b: p.flush_load([x], [5]),
    "flush_load device": lambda p, x, b: p.flush_load([b], [x]),
    "copy_to_device host": lambda p, x, b: p.copy_to_device([x], [5]),
    "copy_to_device device": lambda p, x, b: p.copy_to_device([b], [x]),
}


def pool_state(dev, pool):
    return (pool.available_size(), list(pool._lock_ref), sorted(pool._pending_gather),
            sorted(pool._pending_load), [pool.page_of(i) for i in range(4)],
            [testing.bits(b).copy() for b in dev.kv_buffer])


@pytest.mark.parametrize("call", list(ID_CALLS))
def test_a_float_or_bool_id_is_refused_naming_it_before_anything_changes(dev, pool, call):
    a, b = pool.alloc(2).tolist()
    assert b == 1
    pool.inc_lock_ref(a)                    # dec_lock_ref(1) would unlock nothing
    pool.stage_backup([1, 2], [a, b])       # a backup of b pending: flush_backup(1) would
    pool.flush_backup([a])                  # publish it
    pool.stage_load([a])                    # a load of a staged
    before = pool_state(dev, pool)
    name = call.split()[0]
    for bad in (1.9, True, 1.0, np.float32(1.0), np.bool_(True), jnp.float32(1.0)):
        with pytest.raises(TypeError, match=f"{name} needs integer .*{re.escape(repr(bad))}"):
            ID_CALLS[call](pool, bad, b)
    if name not in ("release", "inc_lock_ref", "dec_lock_ref", "page_of"):
        for arr in (np.array([1.0]), np.array([True]), jnp.asarray([1.5])):  # a whole array
            with pytest.raises(TypeError, match=f"{name} needs integer .*dtype"):
                _call_with_array(pool, call, arr, b)
    after = pool_state(dev, pool)
    assert after[:5] == before[:5]
    assert all(np.array_equal(x, y) for x, y in zip(after[5], before[5]))


def _call_with_array(pool, call, arr, b):
    """``call`` with ``arr`` as the whole id argument where ID_CALLS passes a list."""
    name, _, side = call.partition(" ")
    if name in ("free", "flush_backup", "stage_load"):
        return getattr(pool, name)(arr)
    if name in ("stage_backup", "copy_into"):   # (device pages, host ids)
        return getattr(pool, name)(*((np.asarray([3]), arr) if side == "host"
                                     else (arr, np.asarray([b]))))
    return getattr(pool, name)(*((arr, np.asarray([5])) if side == "host"
                                 else (np.asarray([b]), arr)))


def test_the_engines_integer_arrays_of_any_int_dtype_move_pages(dev, pool):
    a, b = (jnp.int32(i) for i in pool.alloc(2))
    want = [snapshot(dev, 1), snapshot(dev, 2)]
    pool.copy_into(jnp.asarray([1, 2], jnp.int32), np.asarray([a, b], np.uint8))
    pool.stage_load(jnp.asarray([a, b], jnp.int32))
    assert pool.flush_load([a, np.int16(b)], np.asarray([5, 6], np.int64)).ok
    assert pool.copy_to_device(np.asarray([b], np.uint32), [jnp.int32(7)]).ok
    assert_page(dev, 5, want[0])
    assert_page(dev, 6, want[1])
    assert_page(dev, 7, want[1])
    pool.inc_lock_ref(np.int64(a))
    pool.dec_lock_ref(a)
    assert pool.page_of(jnp.asarray(b, jnp.int32)) is not None
    pool.free(jnp.asarray([a, b], jnp.int32))
    assert pool.available_size() == 4


def test_precompile_takes_no_slot_and_writes_no_page(dev, pool):
    before = [testing.bits(b).copy() for b in dev.kv_buffer]
    pool.precompile_transfers()
    pool.precompile_transfers(max_pages=2)
    assert pool.available_size() == 4
    for layer, want in enumerate(before):
        assert np.array_equal(testing.bits(dev.kv_buffer[layer]), want)


# -- sharded over the engine's mesh -------------------------------------------------------


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_sharded_pages_move_between_data_shards(axis_type):
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(axis_type,) * 2)
    sharding = NamedSharding(mesh, SPEC)
    dev = device_pool(pages=8, heads=4, sharding=sharding, seed=3)
    with jax.set_mesh(mesh):
        pool = KvxferHostKVPool(dev, 4, 1, 2, (1, 4, 1, 128), jnp.float32, mesh, SPEC)
        try:
            srcs, dsts = [1, 6], [5, 2]          # each page crosses to the other data shard
            want = [snapshot(dev, s) for s in srcs]
            ids = pool.alloc(2).tolist()
            pool.copy_into(srcs, ids)
            assert pool.copy_to_device(ids, dsts).ok
            for d, w in zip(dsts, want):
                assert_page(dev, d, w)
            assert all(b.sharding == sharding for b in dev.kv_buffer)
        finally:
            pool.close()


# -- integrity --------------------------------------------------------------------------


def test_a_host_bit_flip_is_a_miss_from_that_page_and_drops_the_copy(dev):
    misses = []
    pool = host_pool(dev, on_load_miss=misses.append)
    try:
        ids = pool.alloc(3).tolist()
        want = snapshot(dev, 1)
        pool.copy_into([1, 2, 3], ids)
        testing.flip_bit(pool.manager, pool.page_of(ids[1]), layer=1, seed=5)
        result = pool.copy_to_device(ids, [6, 7, 8])
        assert result.verified_pages == 1 and result.loaded == (ids[0],)
        assert result.missed == (ids[1], ids[2]) and result.dropped == (ids[1],)
        assert not result.ok and misses == [result]
        assert_page(dev, 6, want)
        assert pool.page_of(ids[1]) is None and pool.page_of(ids[2]) is not None
        # The dropped id stays the engine's and is a miss on every later load.
        again = pool.copy_to_device([ids[1]], [6])
        assert again.missed == (ids[1],) and "dropped before" in again.reasons[ids[1]]
        assert pool.copy_to_device([ids[2]], [8]).ok   # the page after it was intact
        pool.free(ids)
        assert pool.available_size() == 4
    finally:
        pool.close()


def test_a_zero_dma_over_an_intact_copy_is_a_miss_that_keeps_the_page(dev, pool):
    ids = pool.alloc(2).tolist()
    want = snapshot(dev, 2)
    pool.copy_into([1, 2], ids)
    testing.zero_dma(pool.manager, layer=1, block=7)
    result = pool.copy_to_device(ids, [6, 7])
    assert result.verified_pages == 1 and result.missed == (ids[1],)
    assert result.dropped == () and result.reasons[ids[1]].startswith("transfer")
    assert pool.page_of(ids[1]) is not None
    assert pool.copy_to_device([ids[1]], [7]).ok    # the kept copy loads next time
    assert_page(dev, 7, want)


# -- the engine's white-box names --------------------------------------------------------
# sglang-jax's own tests reach into LRUHostKVPool's private state; the pool offers the
# same names as views of its own bookkeeping, and these are their contracts.


def test_the_slots_view_shows_committed_pages_where_the_host_pool_keeps_them(dev, pool):
    assert len(pool._slots) == 4 and list(pool._slots) == [None] * 4
    ids = pool.alloc(2).tolist()
    pool.stage_backup([1, 2], ids)
    assert pool._slots[ids[0]] is None          # staged is not committed
    pool.flush_backup(ids)
    for i in ids:
        copy = pool._slots[i]
        assert copy.page == pool.page_of(i)
        assert copy.sharding == pool.manager.host_pool.pools[0].array.sharding
        assert copy.sharding.memory_kind == "pinned_host"   # the default path's pool
    assert pool._slots[-4] == pool._slots[0] and pool._slots[-1] is None  # as a list
    with pytest.raises(IndexError, match="outside pool range"):
        pool._slots[4]
    with pytest.raises(TypeError):
        pool._slots[ids[0]] = None              # read-only
    pool.free([ids[0]])
    assert pool._slots[ids[0]] is None and pool._slots[ids[1]] is not None


def test_a_plain_host_pool_has_no_sharding_in_the_slots_view(dev):
    """``_slots[i].sharding`` names pinned memory only where the pool is a pinned array:
    the staged mover's pool is plain host memory on XLA:CPU, and pinned by default on a
    backend with ``pinned_host`` memory (a GPU), where the view must say so."""
    pool = host_pool(dev, path="staged")
    try:
        (i,) = pool.alloc(1).tolist()
        pool.copy_into([1], [i])
        pinned = pool.manager.host_pool.pools[0].pinned
        sharding = pool._slots[i].sharding
        assert (sharding.memory_kind == "pinned_host") if pinned else sharding is None
        assert pool._slots[i].page == pool.page_of(i)
    finally:
        pool.close()


def test_pending_entries_carry_the_epoch_of_the_allocation(dev, pool):
    assert pool._pending_lock is pool._pending_load_lock
    (i,) = pool.alloc(1).tolist()
    pool.stage_backup([1], [i])
    with pool._pending_lock:
        epoch, _ = pool._pending_gather[i]
    assert epoch == pool._generation[i]
    pool.flush_backup([i])
    assert i not in pool._pending_gather
    pool.stage_load([i])
    with pool._pending_load_lock:
        assert pool._pending_load[i][0] == pool._generation[i]
    assert pool.flush_load([i], [5]).ok and i not in pool._pending_load
    pool.free([i])
    (again,) = pool.alloc(1).tolist()
    assert pool._generation[again] == epoch + (again == i)


def test_a_backup_whose_entry_names_another_epoch_is_not_published(dev, pool):
    (i,) = pool.alloc(1).tolist()
    pool.stage_backup([2], [i])
    with pool._pending_lock:
        epoch, entry = pool._pending_gather[i]
        pool._pending_gather[i] = (epoch - 1, entry)
    pool.flush_backup([i])
    assert pool._slots[i] is None and pool.page_of(i) is None
    assert pool.manager.num_free_pages == 4     # the stale backup's page was freed
    with pytest.raises(RuntimeError, match="empty"):
        pool.stage_load([i])


def test_a_load_whose_entry_names_another_epoch_is_not_scattered(dev, pool):
    (i,) = pool.alloc(1).tolist()
    want = snapshot(dev, 2)
    pool.copy_into([2], [i])
    guard = snapshot(dev, 7)
    pool.stage_load([i])
    with pool._pending_load_lock:
        epoch, entry = pool._pending_load[i]
        pool._pending_load[i] = (epoch + 1, entry)
    result = pool.flush_load([i], [7])
    assert result.missed == (i,) and result.reasons[i].startswith("stale")
    assert_page(dev, 7, guard)
    assert pool._slots[i] is not None           # the host copy is the allocation's still
    assert pool.copy_to_device([i], [7]).ok
    assert_page(dev, 7, want)


def test_the_gather_point_sees_each_layer_inside_the_backup(dev, pool):
    seen = []
    ids = pool.alloc(3).tolist()

    def point(buf, idx, sharding):
        seen.append((buf, idx.tolist(), idx.dtype, sharding, dict(pool._pending_gather)))

    pool._jit_gather_one_layer = point
    # A fault from kvxfer.testing chains to the pool's hook: the point still runs.
    with testing.failing_transfer(pool.manager, after_layers=100):
        pool.stage_backup([5, 1, 3], ids)
    pool.flush_backup(ids)
    assert pool._pad_to_page_bucket(3) == 4 and [pool._pad_to_page_bucket(n)
                                                 for n in (1, 2, 5)] == [1, 2, 8]
    assert len(seen) == len(dev.kv_buffer)
    for layer, (buf, idx, dtype, sharding, pending) in enumerate(seen):
        assert buf is dev.kv_buffer[layer]
        assert idx == [5, 1, 3, 5] and dtype == np.int32   # padded to the bucket
        assert sharding == pool._slots[ids[0]].sharding
        assert pending == {}                    # before the backup is published


@pytest.mark.parametrize("where", ["caller's thread", "another thread"])
def test_an_id_reused_at_the_gather_point_gets_nothing_from_the_backup(dev, where):
    pool = host_pool(dev, pool_size=1)
    try:
        (i,) = pool.alloc(1).tolist()
        pool.copy_into([4], [i])                # an older page the reuse must drop too
        reused = []

        def reuse():
            pool.free([i])
            reused.extend(pool.alloc(1).tolist())

        def point(buf, idx, sharding):
            if reused:
                return
            if where == "caller's thread":
                reuse()                         # the pool holds no lock here
            else:
                with concurrent.futures.ThreadPoolExecutor(1) as other:
                    other.submit(reuse).result()

        pool._jit_gather_one_layer = point
        pool.stage_backup([2], [i])
        assert reused == [i]
        assert i not in pool._pending_gather and pool._slots[i] is None
        with pytest.raises(RuntimeError, match="stage_backup"):
            pool.flush_backup([i])
        with pytest.raises(RuntimeError, match="empty"):
            pool.stage_load([i])
        # A backup into the reused id waits for the stale one and holds its own page.
        del pool._jit_gather_one_layer
        want = snapshot(dev, 6)
        pool.copy_into([6], [i])
        assert pool.manager.num_free_pages == 0
        assert pool.copy_to_device([i], [8]).ok
        assert_page(dev, 8, want)
    finally:
        pool.close()


def test_a_gather_point_that_raises_fails_the_backup_and_stages_nothing(dev, pool):
    (i,) = pool.alloc(1).tolist()

    def point(buf, idx, sharding):
        raise OSError("the engine's hook failed")

    pool._jit_gather_one_layer = point
    with pytest.raises(TransferError, match="the engine's hook failed"):
        pool.stage_backup([1], [i])
    assert i not in pool._pending_gather and pool.manager.num_free_pages == 4
    del pool._jit_gather_one_layer
    want = snapshot(dev, 1)
    pool.copy_into([1], [i])
    assert pool.copy_to_device([i], [5]).ok
    assert_page(dev, 5, want)


# -- import hygiene ---------------------------------------------------------------------


def test_importing_kvxfer_or_the_integration_imports_no_engine():
    code = ("import sys, kvxfer; assert 'kvxfer.integrations' not in sys.modules; "
            "import kvxfer.integrations.sglang_jax, kvxfer.integrations.sglang_jax_launch; "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'sgl_jax']; "
            "assert not bad, bad")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
