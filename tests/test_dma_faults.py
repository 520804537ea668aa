"""What a failure meets on the DMA mover: nothing deletes the caches, nothing touches
memory a transfer no longer owns.

Every step of a program's callback is made to fail in turn (every dtype the mover
accepts, sharded and not, relayout never and always); the transfer fails with a
``TransferError`` and the caches are alive with every byte they held. The two attacks
the review found (a program queued behind a slow step outliving its pool, slots and
ticket) run in a process of their own, so a regression is a failed test, not a crash
of the suite.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.buffer_callback import buffer_callback
from jax.sharding import NamedSharding, PartitionSpec as P

import kvxfer
from kvxfer import testing
from kvxfer.engine import TransferError
from kvxfer.engine.dma._engines import CALLBACK_STEPS, buffer_address
from kvxfer.engine.dma._jobs import TICKETS
from kvxfer.testing import callback_fault

bits = testing.bits
held = kvxfer.engine.staging_bytes_held

#: Whole-byte dtypes the DMA mover accepts, each in a slice class of its own: every
#: width (1, 2 and 4 bytes), both float8 formats engines ship.
DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "float32")


def mixed_caches(sharded: bool) -> list[jax.Array]:
    """One layer of every dtype in ``DTYPES`` (16 blocks of 4 x 128 elements), heads
    split over 2 devices when ``sharded``."""
    caches = [testing.random_caches(1, 16, (4, 128), dt, seed=i)[0]
              for i, dt in enumerate(DTYPES)]
    if sharded:
        mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices()[:2])
        caches = [jax.device_put(c, NamedSharding(mesh, P(None, "tensor"))) for c in caches]
    return caches


def assert_alive(caches: list[jax.Array], expected: list[np.ndarray]) -> None:
    """Every array alive on every shard, holding ``expected``'s bits."""
    for c, e in zip(caches, expected):
        assert not c.is_deleted()
        for shard in c.addressable_shards:
            assert not shard.data.is_deleted()
            np.asarray(shard.data)  # readable: not an errored buffer
        assert np.array_equal(bits(c), e)


@pytest.mark.parametrize("case", ["never", "always", "sharded", "beside"])
@pytest.mark.parametrize("step", CALLBACK_STEPS)
def test_each_step_of_the_callback_failing_leaves_the_caches_alive(step, case, monkeypatch):
    """``beside``: the CUDA engine over the stand-in driver, offloads copying beside
    XLA's stream (XLA:CPU only)."""
    sharded = case == "sharded"
    if sharded and len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    if case == "beside":
        if jax.default_backend() != "cpu":
            pytest.skip("the stand-in driver's engine runs on XLA:CPU")
        from cuda_rig import FakeDriver, HostStreamEngine
        from kvxfer.engine import COPY_ENGINES

        engine = HostStreamEngine(FakeDriver(delay=0.01).driver(), ordinal=0)
        monkeypatch.setitem(COPY_ENGINES, "cpu", lambda device, copy="batch": engine)
    caches = mixed_caches(sharded)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma", dma=kvxfer.DmaOptions(
        relayout="never" if sharded or case == "beside" else case, self_check=False))
    assert mgr.paths == ["dma"] * len(DTYPES)
    pages = mgr.offload(caches, [1, 2, 3], keys=[1, 2, 3]).wait()
    before = [bits(c) for c in caches]

    with callback_fault(step):
        handle = mgr.offload(caches, [4, 5], keys=[4, 5])
        with pytest.raises(TransferError, match="injected failure at the callback's"):
            handle.wait()
        new, load = mgr.load(caches, pages, [9, 10, 11])
        with pytest.raises(TransferError) as err:
            load.result()
    assert err.value.kv_caches is not None
    assert_alive(err.value.kv_caches, before)  # a failed load writes no block
    assert all(a is b for a, b in zip(err.value.kv_caches, new))
    assert TICKETS.pending() == 0 and mgr.num_free_pages == 5 and held() == 0

    # The caches go on: the same load, without the fault, lands every page.
    new, load = mgr.load(new, pages, [9, 10, 11])
    assert load.result().verified_prefix == 3
    for c, b in zip(new, before):
        assert np.array_equal(bits(c)[[9, 10, 11]], b[[1, 2, 3]])
    mgr.close()


def test_a_load_failing_between_shards_hands_back_every_shard(monkeypatch):
    """Shard 0's program is enqueued (its caches donated), shard 1's fails to enqueue:
    the call's ``TransferError`` holds arrays whose shard 0 is the loaded one and shard
    1 the untouched one, every shard alive; the pins go once shard 0's program ran."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    from kvxfer.engine import _programs

    caches = mixed_caches(sharded=True)[:2]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma")
    pages = mgr.offload(caches, [1, 2], keys=[1, 2]).wait()
    before = [bits(c) for c in caches]
    run, calls = _programs.run, []

    def second_fails(kind, *args, **kwargs):
        if kind == "dma_load":
            calls.append(kind)
            if len(calls) % 2 == 0:
                raise RuntimeError("the second shard's program failed to enqueue")
        return run(kind, *args, **kwargs)

    monkeypatch.setattr(_programs, "run", second_fails)
    with pytest.raises(TransferError, match="failed to enqueue") as err:
        mgr.load(caches, pages, [9, 10])
    monkeypatch.setattr(_programs, "run", run)
    got = err.value.kv_caches
    assert got is not None and len(got) == 2
    for c, b in zip(got, before):
        assert not c.is_deleted()
        shards = sorted(c.addressable_shards, key=lambda s: s.device.id)
        assert all(not s.data.is_deleted() for s in shards)
        # Dim 1 split over the 2 devices; shard 1 was never written.
        assert np.array_equal(bits(shards[1].data), b[:, 2:])
    # The first class's shard 0 was loaded before its shard 1 failed.
    shard0 = sorted(got[0].addressable_shards, key=lambda s: s.device.id)[0]
    assert np.array_equal(bits(shard0.data)[[9, 10]], before[0][[1, 2], :2])
    assert TICKETS.pending() == 0 and mgr.num_free_pages == 6
    new, load = mgr.load(got, pages, [9, 10])
    assert load.result().verified_prefix == 2
    mgr.close()


def test_failures_on_data_parallel_groups_wait_for_every_group(monkeypatch):
    """A block dim split over 2 devices (one DMA mover a group): an offload failing in
    the call and a load failing on the transfer thread give back their slots and pins
    only once every group's program has run; the caches go on."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    caches = testing.random_caches(2, 16, (4, 128), "float32",
                                   sharding=NamedSharding(mesh, P("data")))
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma")
    assert mgr.paths == ["dma", "dma"]
    pages = mgr.offload(caches, [1, 9], keys=[1, 2]).wait()  # one page a group
    before = [bits(c) for c in caches]

    def hook(event, layer, array):
        if event == "gather_enqueued":
            raise OSError("fails once both groups are enqueued")

    mgr.set_transfer_hook(hook)
    with pytest.raises(TransferError, match="fails once both groups"):
        mgr.offload(caches, [2, 10], keys=[3, 4])
    mgr.set_transfer_hook(None)
    assert mgr.num_free_pages == 6 and TICKETS.pending() == 0
    with testing.failing_transfer(mgr):
        new, load = mgr.load(caches, pages, [3, 11])
    with pytest.raises(TransferError) as err:
        load.result()
    landed = [b.copy() for b in before]  # the programs ran; the thread failed after
    for b in landed:
        b[[3, 11]] = b[[1, 9]]
    assert_alive(err.value.kv_caches, landed)
    new, load = mgr.load(new, pages, [3, 11])
    assert load.result().verified_prefix == 2
    for c, b in zip(new, before):
        assert np.array_equal(bits(c)[[3, 11]], b[[1, 9]])
    mgr.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_addresses_need_no_type_string(dtype):
    """The callback reads a buffer's address from its DLPack capsule alone: a buffer
    whose ``__cuda_array_interface__`` and ``__array__`` fail (XLA:GPU builds none for
    float8 types) still gives its address."""
    got = {}

    class OnlyDlpack:
        def __init__(self, buf):
            self._buf = buf

        def __dlpack__(self, *args, **kwargs):
            return self._buf.__dlpack__(*args, **kwargs)

        @property
        def __cuda_array_interface__(self):
            raise NotImplementedError("Unimplemented primitive type")

        def __array__(self, *args, **kwargs):
            raise NotImplementedError("device memory")

    def callback(ctx, out, x):
        got["address"] = buffer_address(OnlyDlpack(x))

    # XLA hands a callback the caller's own parameter buffer (no copy).
    x = testing.random_caches(1, 4, (8, 128), dtype)[0]
    jax.jit(lambda a: buffer_callback(callback, jax.ShapeDtypeStruct((1,), jnp.uint32))(a)
            )(x).block_until_ready()
    assert got["address"] == x.unsafe_buffer_pointer() != 0


# -- the attacks, each in a process of its own --------------------------------------

def _slow(x: jax.Array, caches: list[jax.Array], rounds: int = 40) -> list[jax.Array]:
    """``caches`` unchanged, ready only after ``rounds`` matrix products on ``x``'s
    device (40: a second or so; float32 caches: adding zero keeps every bit)."""
    return _slow_step(rounds)(caches, x)


@functools.cache
def _slow_step(rounds: int):
    def step(cs, x):
        for _ in range(rounds):
            x = jnp.tanh(x @ x)
        return [c + x[0, 0] * 0 for c in cs]
    return jax.jit(step)


def _weight(device) -> jax.Array:
    return jax.device_put(jnp.ones((1200, 1200), jnp.float32) / 1200, device)


def _scenario_queued_load() -> None:
    """(a) A load whose transfer thread fails while its program is queued behind a
    slow step; the manager is closed and dropped: the program still copies."""
    import gc

    caches = testing.random_caches(3, 64, (64, 256), "float32", seed=0)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=16, path="dma")
    pages = mgr.offload(caches, [1, 2, 3, 4], keys=[1, 2, 3, 4]).wait()
    before = [bits(c) for c in caches]
    slow = _slow(_weight(caches[0].devices().pop()), caches)
    with testing.failing_transfer(mgr):
        new, load = mgr.load(slow, pages, [8, 9, 10, 11])
    err = load.exception()
    assert isinstance(err, TransferError), err
    mgr.close()
    del mgr, pages, load, err
    gc.collect()
    for c, b in zip(new, before):
        assert np.array_equal(bits(c)[[8, 9, 10, 11]], b[[1, 2, 3, 4]])


def _scenario_queued_offload() -> None:
    """(a) An offload that fails in the call while its program is queued behind a
    slow step: its slots are taken again at once by pages written on the host (a
    store's pages imported), which the program must not overwrite; the manager is
    closed and dropped."""
    import gc
    import time

    caches = testing.random_caches(3, 64, (64, 256), "float32", seed=0)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4, path="dma")  # 4 slots in all
    pages = mgr.offload(caches, [5, 6, 7, 8], keys=[5, 6, 7, 8]).wait()  # compiles
    blobs = [mgr.export_page(p) for p in pages]
    caches, load = mgr.load(caches, pages, [20, 21, 22, 23])
    load.result()
    mgr.free(pages)
    before = [bits(c) for c in caches]
    w = _weight(caches[0].devices().pop())
    jax.block_until_ready(_slow(w, caches))
    slow = _slow(w, caches)

    def hook(event, layer, array):
        if event == "gather_enqueued":
            raise OSError("the call fails once the program is enqueued")

    mgr.set_transfer_hook(hook)
    try:
        mgr.offload(slow, [1, 2, 3, 4], keys=[1, 2, 3, 4])
    except TransferError:
        pass
    else:
        raise AssertionError("the offload did not fail")
    mgr.set_transfer_hook(None)
    pages = [mgr.import_page(b) for b in blobs]  # the same slots, written on the host
    jax.block_until_ready(slow)
    time.sleep(0.3)  # the failed offload's program has run, if it was still queued
    new, load = mgr.load(caches, pages, [30, 31, 32, 33])
    assert load.result().verified_prefix == 4, load.result()
    for c, b in zip(new, before):
        assert np.array_equal(bits(c)[[30, 31, 32, 33]], b[[5, 6, 7, 8]])
    mgr.close()
    del mgr, pages, load
    gc.collect()
    jax.block_until_ready(new)


def _scenario_lost_ticket() -> None:
    """(b) Two devices: shard 0 of an offload fails while shard 1's program is queued
    behind a slow step; the next load on device 1 must keep its own job and caches."""
    d0, d1 = jax.devices()[:2]
    mesh = jax.sharding.Mesh(np.array([d0, d1]), ("tensor",))
    sharding = NamedSharding(mesh, P(None, "tensor"))
    caches = testing.random_caches(2, 32, (64, 256), "float32", sharding=sharding, seed=3)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma")
    pages = mgr.offload(caches, [1, 2], keys=[1, 2]).wait()
    before = [bits(c) for c in caches]

    # Shard 0's inputs come from a step that fails on the device (its program then
    # fails before its callback), queued behind a short step (XLA:CPU runs a program
    # with a host callback at dispatch when its inputs are ready); shard 1's from a
    # step several times longer.
    # (a few thousand flops: XLA:CPU runs a cheaper program inline, at dispatch)
    broken = jax.jit(lambda x: buffer_callback(_raise, jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x + jnp.sum(jnp.arange(4096, dtype=x.dtype) * x[0, 0, 0]) * 0))
    shards = [[c.addressable_shards[i].data for c in caches] for i in (0, 1)]
    w0, w1 = _weight(d0), _weight(d1)
    for i, (w, n) in enumerate([(w0, 8), (w1, 80)]):  # compiled before the race starts
        _slow_step(n).lower(shards[i], w).compile()
        jax.block_until_ready(_slow_step(n)(shards[i], w))
    try:
        jax.block_until_ready(broken(shards[0][0]))
    except Exception:  # noqa: BLE001 - compiled now
        pass
    second = _slow(w1, shards[1], rounds=80)
    first = _slow(w0, shards[0], rounds=8)
    mixed = [jax.make_array_from_single_device_arrays(c.shape, c.sharding, [broken(a), b])
             for c, a, b in zip(caches, first, second)]
    handle = mgr.offload(mixed, [3, 4], keys=[3, 4])
    try:
        handle.wait()
    except TransferError:
        pass
    else:
        raise AssertionError("the offload did not fail")
    # Device 1 again, while (old code) the queued program still held a freed ticket.
    new, load = mgr.load(caches, pages, [10, 11])
    assert load.result().verified_prefix == 2
    for c, b in zip(new, before):
        assert not c.is_deleted()
        assert np.array_equal(bits(c)[[10, 11]], b[[1, 2]])
    mgr.close()


def _raise(ctx, out, x):
    raise ValueError("a device step failed")


SCENARIOS = {"queued-load": _scenario_queued_load, "queued-offload": _scenario_queued_offload,
             "lost-ticket": _scenario_lost_ticket}


@pytest.mark.cpu("the scenarios queue programs behind slow steps on XLA:CPU devices")
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_queued_program_outlives_the_failure_before_it(scenario):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(kvxfer.__file__))] + sys.path))
    proc = subprocess.run([sys.executable, __file__, scenario], capture_output=True,
                          text=True, timeout=240, env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert "scenario passed" in proc.stdout


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
    SCENARIOS[sys.argv[1]]()
    print("scenario passed", flush=True)


def test_a_versioned_dlpack_capsule_gives_the_same_address():
    """DLPack 1.x capsules (``dltensor_versioned``, numpy's when asked for 1.0) hold the
    tensor further in than legacy ones; both give the buffer's address."""
    x = np.arange(512, dtype=np.float32)[8:]  # a view: its data pointer is offset

    class Exporter:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def __dlpack__(self):
            return x.__dlpack__(**self.kwargs)

    assert buffer_address(Exporter(max_version=(1, 0))) == buffer_address(Exporter()) \
        == x.ctypes.data
