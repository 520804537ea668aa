"""kvxfer as the JAX engines run it: Explicit and Auto meshes, context meshes,
engine-owned host slots, prefetched loads."""

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import kvxfer

PATHS = ["auto", "staged", "pinned", "pallas", "dma"]


def _mesh(shape, names, types, devices=None):
    devices = jax.devices()[:int(np.prod(shape))] if devices is None else devices
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), names, axis_types=types)


def _caches(sharding, dtype=jnp.bfloat16, layers=3, blocks=16):
    shape = (blocks, 4, 4, 128)
    out = []
    for i in range(layers):
        x = jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(dtype)
        out.append(jax.device_put(x, sharding))
    return out


def _round_trip(caches, path, src=(1, 9, 4), dst=(3, 12, 0)):
    before = [np.asarray(c) for c in caches]
    shardings = [c.sharding for c in caches]
    types = [c.aval.sharding for c in caches]
    with kvxfer.KVCacheManager(caches, num_host_blocks=8, path=path) as mgr:
        pages = mgr.offload(caches, list(src), keys=[1, 2, 3]).wait()
        caches, load = mgr.load(caches, pages, list(dst), gate="layer")
        assert load.result().verified_prefix == len(src)
    for b, c, sh, ty in zip(before, caches, shardings, types):
        got = np.asarray(c)
        assert got.view(np.uint8).tobytes() != b"" and (got[list(dst)] == b[list(src)]).all()
        untouched = [i for i in range(len(b)) if i not in dst]
        assert (got[untouched] == b[untouched]).all()
        assert c.sharding == sh, (c.sharding, sh)
        assert c.aval.sharding == ty, (c.aval.sharding, ty)  # the sharding type kept
    return caches


def test_layers_of_splits_every_layer_as_sharded_layer_of_does():
    from kvxfer.engine import ShardedLayer, layers_of
    mesh = _mesh((2, 2), ("data", "tensor"), (AxisType.Explicit,) * 2)
    one = _caches(jax.sharding.SingleDeviceSharding(jax.devices()[1]), layers=2)
    sharded = _caches(NamedSharding(mesh, P("data", None, "tensor")), layers=1)
    for arrays in (one, one + sharded):
        got, want = layers_of(arrays), [ShardedLayer.of(a) for a in arrays]
        assert [type(x) for x in got] == [ShardedLayer] * len(arrays)
        assert [[[id(a) for a in reps] for reps in x.shards] for x in got[:2]] == \
            [[[id(a)]] for a in one]  # one-device arrays taken whole, as they are
        assert [[[(a.shape, a.sharding) for a in reps] for reps in x.shards] for x in got] == \
            [[[(a.shape, a.sharding) for a in reps] for reps in x.shards] for x in want]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("spec", [P(None, None, "tensor"), P()], ids=["heads", "replicated"])
@pytest.mark.parametrize("context", [False, True], ids=["plain", "set_mesh"])
def test_explicit_mesh_round_trip(path, spec, context):
    mesh = _mesh((2, 2), ("data", "tensor"), (AxisType.Explicit,) * 2)
    caches = _caches(NamedSharding(mesh, spec))
    with jax.set_mesh(mesh) if context else contextlib.nullcontext():
        _round_trip(caches, path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_one_device_explicit_mesh_under_set_mesh(path, dtype):
    # A one-device shard is the caller's array itself, typed f32[16@data,4,4@tensor,...].
    mesh = _mesh((1, 1), ("data", "tensor"), (AxisType.Explicit,) * 2)
    caches = _caches(NamedSharding(mesh, P("data", None, "tensor")), dtype)
    with jax.set_mesh(mesh):
        _round_trip(caches, path)


@pytest.mark.parametrize("path", ["auto", "staged", "pinned"])
def test_mixed_axis_types_and_a_context_mesh_of_other_devices(path):
    devices = jax.devices()
    mesh = _mesh((2,), ("tensor",), (AxisType.Auto,), devices[:2])
    other = _mesh((2,), ("x",), (AxisType.Explicit,), devices[2:])
    caches = _caches(NamedSharding(mesh, P(None, None, "tensor")))
    with jax.set_mesh(other):
        _round_trip(caches, path)
    mixed = _mesh((2, 2), ("data", "tensor"), (AxisType.Auto, AxisType.Explicit))
    with jax.set_mesh(mixed):
        _round_trip(_caches(NamedSharding(mixed, P(None, None, "tensor"))), path)


def test_context_is_restored_and_a_donating_step_runs_after():
    mesh = _mesh((2, 2), ("data", "tensor"), (AxisType.Explicit,) * 2)
    sharding = NamedSharding(mesh, P(None, None, "tensor"))
    caches = _caches(sharding, jnp.float32)
    step = jax.jit(lambda cs: [c * 2 for c in cs], donate_argnums=0)
    with jax.set_mesh(mesh):
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8)
        want = np.asarray(caches[0][2])
        handle = mgr.offload(caches, [2], keys=[9])
        assert jax.sharding.get_abstract_mesh() == mesh.abstract_mesh
        caches = step(caches)  # donates what the offload read
        pages = handle.wait()
        caches, load = mgr.load(caches, pages, [5])
        caches = step(caches)
        assert load.result().verified_prefix == 1
        np.testing.assert_array_equal(np.asarray(caches[0][5]), want * 2)
        assert caches[0].aval.sharding.mesh.axis_types == (AxisType.Explicit,) * 2
        mgr.close()


# -- engine-owned host slots ------------------------------------------------------


def _mgr(path="auto", host=4, layers=2):
    caches = [jnp.arange(16 * 256, dtype=jnp.float32).reshape(16, 256) + 1000 * i
              for i in range(layers)]
    return caches, kvxfer.KVCacheManager(caches, num_host_blocks=host, path=path)


@pytest.mark.parametrize("path", ["auto", "staged", "pinned"])
def test_slots_overwrite_a_full_pool(path):
    caches, mgr = _mgr(path)
    with mgr:
        old = mgr.offload(caches, [0, 1, 2, 3], keys=[1, 2, 3, 4], slots=[3, 2, 1, 0]).wait()
        assert [p.slot for p in old] == [3, 2, 1, 0] and mgr.num_free_pages == 0
        new, = mgr.offload(caches, [7], keys=[70], slots=[2]).wait()
        assert new.slot == 2 and new.generation > old[1].generation
        assert not mgr.is_valid(old[1]) and mgr.is_valid(new)
        assert all(mgr.is_valid(p) for p in (old[0], old[2], old[3]))
        caches, load = mgr.load(caches, [old[1], new], [10, 11])
        result = load.result()
        assert result.verified_prefix == 0 and "stale" in result.reasons[0]
        caches, load = mgr.load(caches, [new], [12])
        assert load.result().verified_prefix == 1
        np.testing.assert_array_equal(np.asarray(caches[1][12]), np.asarray(caches[1][7]))
        with pytest.raises(kvxfer.PoolError, match="stale"):
            mgr.free([old[1]])
        mgr.free([new])
        assert mgr.num_free_pages == 1
        # A freed named slot is taken by kvxfer's own allocation too, once.
        free, = mgr.offload(caches, [5], keys=[50]).wait()
        assert free.slot == 2 and mgr.num_free_pages == 0


def test_slots_refused_while_a_load_reads_them_and_nothing_written():
    caches, mgr = _mgr("staged")
    with mgr:
        pages = mgr.offload(caches, [1, 2], keys=[1, 2], slots=[0, 1]).wait()
        gate = threading.Event()
        mgr.set_transfer_hook(lambda event, layer, array:
                              event == "load_layer" and gate.wait(30))
        caches, load = mgr.load(caches, pages, [8, 9])
        before = mgr.read_block_bytes(pages[1], 0)
        with pytest.raises(kvxfer.PoolError, match="host slot 1 .*a load is reading"):
            mgr.offload(caches, [5, 6], keys=[5, 6], slots=[3, 1])
        assert mgr.read_block_bytes(pages[1], 0) == before
        assert mgr.num_free_pages == 2 and mgr.is_valid(pages[1])
        gate.set()
        assert load.result().verified_prefix == 2
        mgr.set_transfer_hook(None)
        again, _ = mgr.offload(caches, [5, 6], keys=[5, 6], slots=[3, 1]).wait()
        assert again.slot == 3 and not mgr.is_valid(pages[1])


def test_slots_bad_values_and_a_failed_offload_leaves_them_free():
    caches, mgr = _mgr("staged")
    with mgr:
        for slots, err, match in [([0, 0], kvxfer.PoolError, "named twice"),
                                  ([0, 4], ValueError, r"slots\[1\] = 4 is not a host slot"),
                                  ([0, -1], ValueError, r"slots\[1\] = -1"),
                                  ([0], ValueError, "1 slots for 2 keys"),
                                  ("ab", TypeError, "sequence of ints")]:
            with pytest.raises(err, match=match):
                mgr.offload(caches, [1, 2], keys=[1, 2], slots=slots)
        assert mgr.num_free_pages == 4
        held, = mgr.offload(caches, [1], keys=[1], slots=[2]).wait()
        caches[0].delete()
        with pytest.raises(ValueError, match="deleted"):
            mgr.offload(caches, [3], keys=[3], slots=[2])
        assert mgr.num_free_pages == 3 and mgr.is_valid(held)  # bad input: nothing lost


@pytest.mark.parametrize("event", ["gather_enqueued", "host_written"])
def test_a_failed_offload_leaves_the_named_slots_free(event):
    caches, mgr = _mgr("staged")
    with mgr:
        held, = mgr.offload(caches, [1], keys=[1], slots=[2]).wait()

        def hook(at, layer, array):
            if at == event:
                raise RuntimeError("injected")

        mgr.set_transfer_hook(hook)
        with pytest.raises(kvxfer.TransferError, match="injected"):
            mgr.offload(caches, [3, 4], keys=[3, 4], slots=[2, 0]).wait()
        assert mgr.num_free_pages == 4 and not mgr.is_valid(held)


# -- prefetched loads -------------------------------------------------------------


@pytest.mark.parametrize("path", ["auto", "staged", "pinned", "pallas", "dma"])
def test_prefetch_on_another_thread_then_load(path):
    caches, mgr = _mgr(path, host=8, layers=3)
    with mgr:
        pages = mgr.offload(caches, [1, 2, 3], keys=[1, 2, 3]).wait()
        want = [np.asarray(c)[[1, 2, 3]] for c in caches]
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("h", mgr.prefetch(pages)))
        t.start()
        t.join()
        handle = box["h"]
        assert handle.num_staged == 3 and not handle.problems
        with pytest.raises(kvxfer.PoolError, match="a load is reading"):
            mgr.offload(caches, [4], keys=[4], slots=[pages[0].slot])  # pinned
        caches, load = mgr.load(caches, pages, [10, 11, 12], prefetched=handle, gate="layer")
        assert load.result().verified_prefix == 3
        for w, c in zip(want, caches):
            np.testing.assert_array_equal(np.asarray(c)[[10, 11, 12]], w)
        with pytest.raises(ValueError, match="consumed already"):
            mgr.load(caches, pages, [13, 14, 15], prefetched=handle)
        mgr.free(pages)
        assert mgr.num_free_pages == 8  # the load released the prefetch's pins


def test_prefetch_checks_release_and_stale_pages():
    caches, mgr = _mgr("staged", host=8)
    _, other = _mgr("staged", host=8)
    with mgr, other:
        pages = mgr.offload(caches, [1, 2, 3], keys=[1, 2, 3]).wait()
        handle = mgr.prefetch(pages)
        with pytest.raises(ValueError, match="staged 3 pages"):
            mgr.load(caches, pages[:2], [10, 11], prefetched=handle)
        # Refs that happen to name live pages of the other manager too (so only the
        # handle tells): a ref never valid there is refused before the handle is read.
        other.offload(caches, [4, 5, 6], keys=[7, 8, 9]).wait()
        with pytest.raises(ValueError, match="another KVCacheManager"):
            other.load(caches, pages, [10, 11, 12], prefetched=handle)
        with pytest.raises(TypeError, match="prefetched="):
            mgr.load(caches, pages, [10, 11, 12], prefetched=object())
        mgr.free(pages[1:2])  # deferred: the prefetch reads it
        assert mgr.num_free_pages == 5
        assert handle.release() and not handle.release()
        assert mgr.num_free_pages == 6
        # A page freed before the prefetch: staging stops there, the load misses from it.
        handle = mgr.prefetch(pages)
        assert handle.num_staged == 1 and "freed" in handle.problems[1]
        caches, load = mgr.load(caches, pages, [10, 11, 12], keys=[1, 2, 3],
                                prefetched=handle)
        result = load.result()
        assert result.verified_prefix == 1 and result.invalid_pages == (1, 2)
        # A wrong key found at the load: fewer pages than staged, staged again.
        handle = mgr.prefetch([pages[0], pages[2]])
        caches, load = mgr.load(caches, [pages[0], pages[2]], [4, 5], keys=[1, 99],
                                prefetched=handle)
        assert load.result().verified_prefix == 1
        np.testing.assert_array_equal(np.asarray(caches[0][4]), np.asarray(caches[0][1]))
        mgr.free([pages[0], pages[2]])
        assert mgr.num_free_pages == 8


# -- a page axis sharded over data parallelism ------------------------------------

DP = {"data2_tensor2": ((2, 2), ("data", "tensor"), P("data", None, "tensor")),
      "data4": ((4,), ("data",), P("data")),
      "data2_replicated": ((2, 2), ("data", "tensor"), P("data"))}


def _dp_caches(case, layers=3):
    shape, names, spec = DP[case]
    mesh = _mesh(shape, names, (AxisType.Explicit,) * len(names))
    return mesh, _caches(NamedSharding(mesh, spec), layers=layers)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(DP))
def test_data_parallel_page_axis_round_trip(case, path):
    mesh, caches = _dp_caches(case)
    with jax.set_mesh(mesh):
        # Blocks of every group in one call, each landing in another group.
        _round_trip(caches, path, src=(1, 9, 14), dst=(12, 0, 5))


@pytest.mark.parametrize("path", ["auto", "staged", "pinned", "dma"])
@pytest.mark.parametrize("case", ["data2_tensor2", "data2_replicated"])
def test_data_parallel_bad_page_is_the_verified_prefix(case, path):
    from kvxfer import testing

    mesh, caches = _dp_caches(case)
    with jax.set_mesh(mesh), kvxfer.KVCacheManager(caches, num_host_blocks=8,
                                                   path=path) as mgr:
        mgr.warmup(4)
        pages = mgr.offload(caches, [2, 10, 3, 11], keys=[1, 2, 3, 4]).wait()
        testing.flip_bit(mgr, pages[1], layer=1)  # a page from group 1
        caches, load = mgr.load(caches, pages, [8, 0, 9, 1], gate="layer")
        result = load.result()
        assert result.verified_prefix == 1 and result.freed_pages == (1,)
        assert "layer 1" in result.reasons[1]
        # zero-dma: a load that silently delivers zeros into a block of group 0.
        testing.zero_dma(mgr, layer=2, block=1)
        caches, load = mgr.load(caches, [pages[2], pages[3]], [12, 1])
        result = load.result()
        assert result.verified_prefix == 1 and result.invalid_pages == (1,)


def test_data_parallel_refusals():
    mesh = _mesh((4,), ("data",), (AxisType.Explicit,))
    even = jax.device_put(jnp.zeros((16, 4, 128)), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match="layer 0: .*emulated layouts"):
        kvxfer.KVCacheManager([even], num_host_blocks=4, layouts=["{2,1,0}"])
    with kvxfer.KVCacheManager([even], num_host_blocks=4) as mgr:
        with pytest.raises(ValueError, match=r"device_blocks\[0\] = 16 is out of range"):
            mgr.offload([even], [16], keys=[1])
