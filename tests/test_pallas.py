"""The Pallas mover (``path="pallas"``), run in Pallas TPU interpret mode on CPU.

The kernels are the ones a TPU runs; only the HOST memory space is replaced (interpret
mode has none), and the mover's kernels loop over their pages where a TPU's unroll
them (both forms are run here), so these tests cover the DMAs, the scalar-prefetched
ids, the per-layer semaphores and completion, the page buffers, and the refusals. Sizes are tiny: the interpreter simulates every DMA.
"""

from __future__ import annotations

import contextlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import kvxfer
from engine_rig import HostModel, Rig, page_mismatches, read_bits, step
from kvxfer import testing

bits = testing.bits

# Signalling and quiet NaNs with payloads, which XLA:CPU's bf16 gathers would rewrite.
BF16_NANS = np.array([0x7F81, 0xFFC1, 0x7FF6, 0xFF80 | 0x23], np.uint16)


def with_nans(caches: list[jax.Array], block: int) -> list[jax.Array]:
    """The caches with NaN payloads written into ``block`` of every bf16 layer."""
    out = []
    for c in caches:
        if c.dtype == jnp.bfloat16:
            raw = bits(c)
            raw[block].flat[:len(BF16_NANS)] = BF16_NANS
            c = jax.device_put(raw.view(jnp.bfloat16), c.sharding, may_alias=False)
        out.append(c)
    return out


def mixed_caches() -> list[jax.Array]:
    """Three slice classes: bf16 (two layers), f32 and fp8, 16 blocks each."""
    caches = (testing.random_caches(2, 16, (8, 128), "bfloat16", seed=1)
              + testing.random_caches(1, 16, (4, 128), "float32", seed=2)
              + testing.random_caches(1, 16, (16, 128), "float8_e4m3fn", seed=3))
    return with_nans(caches, 5)


def expect_loaded(before: list[np.ndarray], src, dst) -> list[np.ndarray]:
    out = []
    for b in before:
        e = b.copy()
        e[list(dst)] = b[list(src)]
        out.append(e)
    return out


def _in_the_interpreter() -> bool:
    """Whether the running code was called from the Pallas interpreter's callbacks.

    The interpreter computes indices with eager jnp ops inside its io_callbacks
    (``jit(multiply)``, ``jit(add)``, ``jit(unstack)``, ...). Those compile on first use
    and again whenever JAX's own caches drop them (seen once in a full suite run, on a
    load that compiled nothing else), so they say nothing about kvxfer's programs.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if "pallas/mosaic/interpret" in frame.f_code.co_filename.replace(os.sep, "/"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def compiled_programs():
    """The names of the programs XLA compiles inside the block (a list, filled in),
    less the interpreter's own helpers (``_in_the_interpreter``)."""
    names: list[str] = []

    def listen(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and not _in_the_interpreter():
            names.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_mixed_classes_round_trip_byte_exact_with_layer_gate():
    caches = mixed_caches()
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=6, path="pallas", integrity="page")
    assert mgr.paths == ["pallas"] * 4
    assert len(mgr.plan.classes) == 3
    # No pool is the kernels' array: pages go through page buffers (on TPU the
    # compiler takes host-side DMAs at static offsets only).
    assert all(p.owner is None for p in mgr.host_pool.pools)
    before = [bits(c) for c in caches]
    src, dst = [5, 12, 0, 7], [9, 1, 15, 5]
    pages = mgr.offload(caches, src, keys=[11, 12, 13, 14]).wait()
    for j, b in enumerate(src):  # the pages hold the blocks' bytes, NaN payloads too
        for i in range(4):
            assert mgr.read_block_bytes(pages[j], i) == before[i][b].tobytes(), (j, i)
    caches, load = mgr.load(caches, pages, dst, gate="layer")
    for i in range(4):
        assert load.layer_ready(i, timeout=60) == 4
    result = load.result()
    assert result.verified_prefix == 4 and result.invalid_pages == ()
    for i, (got, want) in enumerate(zip(caches, expect_loaded(before, src, dst))):
        assert np.array_equal(bits(got), want), f"layer {i}"
    mgr.close()


def test_host_writes_are_digested_like_the_device_digests_them():
    """A deliberate host write is re-digested with numpy; the load's device digest of
    the block it lands in agrees, so pages mean the same bytes on both sides."""
    caches = mixed_caches()[:2]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2, path="pallas")
    pages = mgr.offload(caches, [2, 3], keys=[1, 2]).wait()
    size = mgr.plan.class_of_layer(1)[0].bytes_per_block
    pattern = testing.random_bits((size,), "uint8", seed=9)
    mgr.write_block_bytes(pages[1], 1, pattern.tobytes())
    caches, load = mgr.load(caches, pages, [10, 11])
    assert load.result().verified_prefix == 2
    assert bits(caches[1])[11].tobytes() == pattern.tobytes()
    mgr.close()


@pytest.mark.parametrize("layouts", [False, True])
def test_the_tiled_rank2_seed_is_refused_naming_shape_and_layout(layouts):
    seed = "{1,0:T(8,128)(2,1)}"
    x = jnp.zeros((512, 6144), jnp.bfloat16)
    kwargs = {}
    if layouts:
        kwargs["layouts"] = [seed]
    else:  # XLA:CPU reports (and keeps) the tiling it was given
        x = jax.device_put(x, Format(kvxfer.Layout.parse(seed).to_jax(), x.sharding))
        assert str(kvxfer.Layout.of(x)) == seed
    assert kvxfer.layout.shape_text(x.shape, x.dtype, kvxfer.Layout.parse(seed)) == \
        "bf16[512,6144]" + seed
    with pytest.raises(kvxfer.LayoutError) as e:
        kvxfer.KVCacheManager([x], num_host_blocks=2, path="pallas", **kwargs)
    msg = str(e.value)
    assert msg.startswith("Pallas path refused for c0:bf16[6144] (layers [0]), layer 0")
    assert "bf16[512,6144]" + seed in msg and "granularity 8" in msg


def test_proven_classes_under_emulated_layouts_are_refused():
    x = jnp.zeros((16, 8, 256), jnp.float32)
    assert kvxfer.inspect(x.shape, x.dtype, "{2,1,0:T(8,128)}").addressable
    with pytest.raises(kvxfer.LayoutError, match=r"f32\[16,8,256\]\{2,1,0:T\(8,128\)\}: the "
                       r"Pallas DMAs move the arrays' real buffers.*path='raw'"):
        kvxfer.KVCacheManager([x], num_host_blocks=2, path="pallas",
                              layouts=["{2,1,0:T(8,128)}"])
    with kvxfer.KVCacheManager([x], num_host_blocks=2, layouts=["{2,1,0:T(8,128)}"]) as mgr:
        assert mgr.paths == ["emulated"]  # the mover for emulated memory


def test_sub_byte_elements_are_refused():
    x = jnp.zeros((8, 128), jnp.int4)
    with pytest.raises(kvxfer.LayoutError, match=r"s4\[8,128\]\{1,0\}: int4 elements are "
                       "narrower than a byte"):
        kvxfer.KVCacheManager([x], num_host_blocks=2, path="pallas")


def test_a_flipped_host_bit_is_caught_at_its_page():
    caches = mixed_caches()[:3]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4, path="pallas")
    before = [bits(c) for c in caches]
    pages = mgr.offload(caches, [1, 2, 3, 4], keys=[1, 2, 3, 4]).wait()
    testing.flip_bit(mgr, pages[2], layer=2, seed=5)
    caches, load = mgr.load(caches, pages, [8, 9, 10, 11], gate="layer")
    result = load.result()
    assert result.verified_prefix == 2
    assert result.invalid_pages == (2, 3)
    assert result.reasons == {2: "digest mismatch in layer 2"}
    assert result.freed_pages == (2,)  # only the page whose own digest failed
    # Layers 0 and 1 were released at 4 pages before layer 2 found page 2 bad.
    assert result.consumed_before_failure
    assert result.released_prefixes == (4, 4, 2)
    for i, (got, want) in enumerate(zip(caches, expect_loaded(before, [1, 2], [8, 9]))):
        assert np.array_equal(bits(got)[[8, 9]], want[[8, 9]]), f"layer {i}"
    mgr.close()


def test_each_layer_is_reported_written_as_its_kernels_are_enqueued():
    """``request.written(pos, array)`` per layer, in order, with that layer's loaded
    array (the hook faults use), and the transfer thread waits layer by layer."""
    caches = testing.random_caches(3, 16, (8, 128), "float32", seed=4)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2, path="pallas")
    before = [bits(c) for c in caches]
    pages = mgr.offload(caches, [3, 4], keys=[1, 2]).wait()
    events = []

    def hook(event, layer, array):
        if event == "loaded_layer":
            # On the caller's thread, before later layers' kernels are enqueued.
            events.append((event, layer, bool(np.array_equal(bits(array)[[6, 7]],
                                                             before[layer][[3, 4]]))))
        else:
            events.append((event, layer))

    mgr.set_transfer_hook(hook)
    caches, load = mgr.load(caches, pages, [6, 7], gate="layer")
    assert load.result().verified_prefix == 2
    assert [e for e in events if e[0] == "loaded_layer"] == [
        ("loaded_layer", i, True) for i in range(3)]
    assert [e for e in events if e[0] == "load_layer"] == [("load_layer", i) for i in range(3)]
    mgr.close()


def test_a_transfer_failure_after_some_layers_is_an_error_not_a_miss():
    caches = testing.random_caches(3, 16, (8, 128), "float32", seed=6)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=2, path="pallas")
    pages = mgr.offload(caches, [1], keys=[1]).wait()
    with testing.failing_transfer(mgr, after_layers=1):
        caches, load = mgr.load(caches, pages, [2], gate="layer")
        with pytest.raises(kvxfer.TransferError, match="injected device transfer failure"):
            load.result()
    caches, load = mgr.load(caches, pages, [3])  # the caches returned stay usable
    assert load.result().verified_prefix == 1
    mgr.close()


# float32 with fully random bits, NaNs included: XLA:CPU's bf16 scatter in the step
# would canonicalize NaNs in the whole cache (see engine_rig), float32 scatters do not.
PALLAS_RIG = Rig("pallas", "float32", (32, 128), "pallas", "pallas")


def test_donating_steps_between_transfers_see_and_keep_the_right_bytes():
    """Offload, then a donating step: the pages hold the blocks as at the offload.
    Load, then a read and a donating step right away: both see the loaded blocks."""
    rig = PALLAS_RIG
    caches = rig.caches(seed=7)
    model = HostModel(caches)
    mgr = rig.manager(caches, num_host_blocks=8)
    patterns = rig.patterns((1,))
    pending = []
    for it, (src, w) in enumerate([([3, 4], 4), ([10, 3], 10), ([20, 21], 3)]):
        contents = model.snapshot(src)
        handle = mgr.offload(caches, src, keys=[100 * it + 1, 100 * it + 2])
        caches = step(caches, w, src[0], patterns)  # donates what the offload read
        model.step(w, src[0], patterns)
        pending.append((handle, contents))
    for it, (handle, contents) in enumerate(pending):
        pages = handle.wait()
        assert page_mismatches(rig, mgr, pages, contents) == []
        dst = [24 + 2 * it, 25 + 2 * it]
        caches, load = mgr.load(caches, pages, dst, gate="layer" if it % 2 else "all")
        early = read_bits(caches, dst)  # dispatched right after load()
        model.load(dst, contents)
        caches = step(caches, 0, dst[0], patterns)
        model.step(0, dst[0], patterns)
        assert load.result().verified_prefix == 2
        for i, (got, want) in enumerate(zip(early, contents)):
            assert np.array_equal(np.asarray(got), want), f"iteration {it} layer {i}"
    assert model.mismatches(caches) == []
    mgr.close()


def test_sharded_and_replicated_layers_are_byte_exact_per_shard():
    mesh = Mesh(np.array(jax.devices()[:4]), ("kv",))
    heads = NamedSharding(mesh, P(None, None, "kv", None))
    caches = (testing.random_caches(2, 16, (4, 4, 128), "bfloat16", sharding=heads, seed=8)
              + testing.random_caches(1, 16, (4, 128), "bfloat16",
                                      sharding=NamedSharding(mesh, P()), seed=9))
    caches = with_nans(caches, 6)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4, path="pallas")
    assert mgr.paths == ["pallas"] * 3
    assert [(c.num_shards, c.replicas) for c in mgr.plan.classes] == [(4, 1), (1, 4)]
    # Both move through page buffers.
    assert [p.owner is not None for p in mgr.host_pool.pools] == [False, False]
    before = [bits(c) for c in caches]
    src, dst = [6, 1, 14], [2, 15, 7]
    pages = mgr.offload(caches, src, keys=[1, 2, 3]).wait()
    for j, b in enumerate(src):  # shard-major pages: each shard's part side by side
        parts = np.split(before[0][b], 4, axis=1)
        assert mgr.read_block_bytes(pages[j], 0) == b"".join(
            np.ascontiguousarray(p).tobytes() for p in parts)
    caches, load = mgr.load(caches, pages, dst, gate="layer")
    assert load.result().verified_prefix == 3
    for i, (c, want) in enumerate(zip(caches, expect_loaded(before, src, dst))):
        assert c.sharding == (heads if i < 2 else NamedSharding(mesh, P()))
        for s in c.addressable_shards:  # every shard and every replica
            assert np.array_equal(bits(s.data), want[s.index]), (i, s.device)
    mgr.close()


def test_a_bad_replica_is_caught_on_the_replica():
    """A replica's page buffer is staged from the pool; corrupting the host page after
    the digests were made is caught on every replica that received it."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("kv",))
    x = jax.device_put(np.arange(8 * 256, dtype=np.float32).reshape(8, 256),
                       NamedSharding(mesh, P()))
    mgr = kvxfer.KVCacheManager([x], num_host_blocks=2, path="pallas")
    pages = mgr.offload([x], [3, 4], keys=[7, 8]).wait()
    testing.flip_bit(mgr, pages[1], layer=0, bit=77)
    (y,), load = mgr.load([x], pages, [5, 6])
    result = load.result()
    assert result.verified_prefix == 1
    assert result.reasons[1] == "digest mismatch in layer 0"
    for s in y.addressable_shards:
        assert np.array_equal(np.asarray(s.data)[5], np.arange(3 * 256, 4 * 256))
    mgr.close()


def test_warmup_compiles_every_kernel_a_bucket_runs():
    mesh = Mesh(np.array(jax.devices()[:2]), ("kv",))
    caches = (testing.random_caches(2, 8, (2, 128), "float32", seed=10)
              + testing.random_caches(1, 8, (2, 2, 128), "float32",
                                      sharding=NamedSharding(mesh, P(None, None, "kv")),
                                      seed=11))
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4, path="pallas")
    assert mgr.warmup(2) == [1, 2]
    with compiled_programs() as names:
        pages = mgr.offload(caches, [1, 2], keys=[1, 2]).wait()
        for gate in ("all", "layer"):
            caches, load = mgr.load(caches, pages, [4, 5], gate=gate)
            assert load.result().verified_prefix == 2
    assert names == []
    assert mgr.warmup(2) == [1, 2]
    with compiled_programs() as names:
        caches, load = mgr.load(caches, pages, [6, 7], gate="layer")
        assert load.result().verified_prefix == 2
    assert names == []
    mgr.close()


def test_a_class_of_more_layers_than_one_interpreted_kernel_moves():
    """Interpreted offload kernels move 8 layers each: 11 layers take two, and one
    offload and one load kernel serve every transfer size (the buffers are sized for
    every transfer up to the class's blocks), compiled by warm-up."""
    caches = with_nans(testing.random_caches(11, 8, (2, 128), "bfloat16", seed=13), 2)
    before = [bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="pallas")
    with compiled_programs() as names:
        assert mgr.warmup(8) == [1, 2, 4, 8]
    kernels = [f for f in names if "kvxfer" in f]
    assert sorted(kernels) == ["jit(kvxfer_load)", "jit(kvxfer_offload)",
                              "jit(kvxfer_offload)"], kernels
    with compiled_programs() as names:
        for src, dst in (([2], [7]), ([0, 2, 5], [6, 1, 3]), (list(range(8)), list(range(8)))):
            pages = mgr.offload(caches, src, keys=[10 + i for i in src]).wait()
            caches, load = mgr.load(caches, pages, dst, gate="layer")
            assert load.result().verified_prefix == len(src)
            want = expect_loaded(before, src, dst)
            for i, (c, w) in enumerate(zip(caches, want)):
                assert np.array_equal(bits(c), w), f"layer {i}"
            before = want
            mgr.free(pages)
    assert [f for f in names if "kvxfer" in f or "digest" in f] == []
    mgr.close()


def test_offloads_in_flight_keep_host_writes_to_other_pages():
    caches = testing.random_caches(2, 16, (4, 128), "float32", seed=12)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="pallas")
    pool = mgr.host_pool.pools[0]
    address = pool.data.ctypes.data
    (kept,) = mgr.offload(caches, [9], keys=[99]).wait()
    handles = [mgr.offload(caches, [i], keys=[i + 1]) for i in range(6)]  # in flight
    new = np.full(4 * 128, 7.0, np.float32).tobytes()
    mgr.write_block_bytes(kept, 0, new)  # while those offloads run
    pages = [h.wait()[0] for h in handles]
    pool.check_owner()
    assert pool.data.ctypes.data == address
    assert mgr.read_block_bytes(kept, 0) == new
    before = [bits(c) for c in caches]
    for i, page in enumerate(pages):
        assert mgr.read_block_bytes(page, 1) == before[1][i].tobytes()
    mgr.close()


def test_pages_are_interchangeable_with_the_staged_path():
    """A pallas page exported and imported by a staged manager (and back) loads and
    verifies: both store the same bytes under the same digests."""
    caches = mixed_caches()[:3]
    before = [bits(c) for c in caches]
    pallas = kvxfer.KVCacheManager(caches, num_host_blocks=2, path="pallas")
    staged = kvxfer.KVCacheManager(caches, num_host_blocks=2, path="staged")
    assert pallas.fingerprint == staged.fingerprint
    (page,) = pallas.offload(caches, [5], keys=[42]).wait()
    moved = staged.import_page(pallas.export_page(page), key=42)
    caches, load = staged.load(caches, [moved], [13])
    assert load.result().verified_prefix == 1
    (page,) = staged.offload(caches, [13], keys=[43]).wait()
    back = pallas.import_page(staged.export_page(page), key=43)  # numpy writes the pool
    caches, load = pallas.load(caches, [back], [14])
    assert load.result().verified_prefix == 1
    for i, (c, b) in enumerate(zip(caches, before)):
        assert np.array_equal(bits(c)[[13, 14]], b[[5, 5]]), f"layer {i}"
    pallas.close()
    staged.close()


def test_two_threads_moving_their_own_classes_at_once():
    """Interpret mode keeps one process-wide state: kernels of two classes issued from
    two threads must not overlap in it (each class is one thread's here)."""
    import threading

    def make(seed):
        return (testing.random_caches(1, 16, (4, 128), "bfloat16", seed=seed)
                + testing.random_caches(1, 16, (4, 128), "float32", seed=seed + 1))

    mgr = kvxfer.KVCacheManager(make(0), num_host_blocks=12, path="pallas")
    errors = []

    def worker(t):
        try:
            rng = np.random.default_rng(t)
            caches = make(20 + 2 * t)
            for r in range(6):
                k = int(rng.integers(1, 4))
                src, dst = rng.permutation(16)[:k], rng.permutation(16)[:k]
                before = bits(caches[t])
                pages = mgr.offload(caches, {t: src},
                                    keys=[t * 100 + r * 4 + j for j in range(k)]).wait()
                caches, load = mgr.load(caches, pages, {t: dst})
                assert load.result(timeout=60).verified_prefix == k
                assert np.array_equal(bits(caches[t])[dst], before[src])
                mgr.free(pages)
        except BaseException as e:  # reported below, with the thread
            errors.append((t, e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=240)
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    assert mgr.num_free_pages == 12
    mgr.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "int8", "float32"])
@pytest.mark.parametrize("unroll", [False, True])
def test_the_kernels_move_exact_bits_looped_and_unrolled(dtype, unroll):
    """The TPU form of the kernels (pages unrolled, each guarded by the runtime count)
    and the interpreted loop move the same bits: 3 pages of a 4-page buffer, and the
    load leaves every other block as it was."""
    from kvxfer.engine import _pallas_kernels as kernels

    device = jax.devices()[0]
    shape = (8, 2, 128) if dtype != "int8" else (8, 4, 128)
    (cache,) = with_nans(testing.random_caches(1, shape[0], shape[1:], dtype, seed=21), 3)
    ids = jax.device_put(np.array([3, 0, 6, 6], np.int32), device)
    n = np.array([3], np.int32)
    host = jax.ShapeDtypeStruct((4, 1, *shape[1:]), cache.dtype)
    offload = kernels.offload_program((cache.format,), host, device, True, unroll)
    pages, done = jax.block_until_ready(offload(n, ids, (cache,)))
    want = bits(cache)
    got = bits(pages)
    assert int(np.asarray(done)[0]) == 3
    assert np.array_equal(got[:3, 0], want[[3, 0, 6]])
    load = kernels.load_program(cache.format, device, True, unroll)
    target = jax.device_put(np.zeros(shape, cache.dtype), cache.sharding)
    dst = jax.device_put(np.array([7, 1, 2, 5], np.int32), device)
    out, done = jax.block_until_ready(load(n, dst, target, pages[:, 0]))
    expect = np.zeros_like(want)
    expect[[7, 1, 2]] = want[[3, 0, 6]]
    assert np.array_equal(bits(out), expect)
