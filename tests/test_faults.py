"""The fault matrix: every fault x dtype x page size x gate is detected and recovered."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import kvxfer
from kvxfer import testing as faults

DTYPES = ["bfloat16", "float8_e4m3fn", "float32"]
PAGE_SIZES = [16 << 10, 64 << 10, 1 << 20]
SRC, DST = [5, 1, 6, 2], [0, 7, 3, 4]
BAD, BAD_LAYER, LAYERS = 2, 1, 3
REASONS = {"bitflip": "digest mismatch in layer 1", "wrong-key": "wrong key",
           "misfile": "digest mismatch in layer 0", "stale-slot": "stale generation",
           "one-shard": "shard disagreement", "torn": "digest mismatch in layer 1",
           "zero-dma": "transfer: digest mismatch in layer 1"}
# Faults the bad page's own digest proves, its host copy failing them too (the others
# are caught by keys or slots, or, zero-dma, by the device digest of an intact page).
PROVEN = ("bitflip", "misfile", "one-shard", "torn")


bits = faults.bits


def make_caches(dtype, page_bytes, sharded, seed=0):
    itemsize = np.dtype(jax.numpy.dtype(dtype)).itemsize
    block = (page_bytes // itemsize // 256, 2, 128)
    sharding = None
    if sharded:
        mesh = Mesh(np.array(jax.devices()[:2]), ("kv",))
        sharding = NamedSharding(mesh, P(None, None, "kv"))
    return faults.random_caches(LAYERS, 8, block, dtype, sharding=sharding, seed=seed)


@pytest.mark.parametrize("gate", ["layer", "all"])
@pytest.mark.parametrize("page_bytes", PAGE_SIZES, ids=["16KiB", "64KiB", "1MiB"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fault", list(REASONS) + ["transfer"])
def test_fault_matrix(fault, dtype, page_bytes, gate):
    caches = make_caches(dtype, page_bytes, sharded=fault == "one-shard")
    before = [bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8)
    assert mgr.plan.classes[0].bytes_per_block == page_bytes
    pages = mgr.offload(caches, SRC, keys=[101, 102, 103, 104]).wait()
    keys = None
    if fault != "transfer":
        pages, keys = faults.inject(fault, mgr, caches, pages, BAD, BAD_LAYER,
                                    device_blocks=DST)

    def released_blocks_are_good(new, layer, prefix):
        got = bits(new[layer])
        for j in range(prefix):
            assert np.array_equal(got[DST[j]], before[layer][SRC[j]]), (layer, j)

    if fault == "transfer":
        with faults.failing_transfer(mgr, after_layers=BAD_LAYER):
            new, handle = mgr.load(caches, pages, DST, gate=gate)
            with pytest.raises(kvxfer.TransferError, match="injected device transfer failure"):
                handle.result()
        if gate == "layer":  # what was released before the failure is correct
            released_blocks_are_good(new, 0, handle.layer_ready(0))
        with pytest.raises(kvxfer.TransferError):
            handle.layer_ready(LAYERS - 1)
        return

    new, handle = mgr.load(caches, pages, DST, keys=keys, gate=gate)
    for layer in range(LAYERS):  # consume each layer as soon as it is released
        released_blocks_are_good(new, layer, handle.layer_ready(layer))
    result = handle.result()
    assert result.verified_prefix == BAD
    assert result.invalid_pages == (2, 3)
    assert REASONS[fault] in result.reasons[BAD]
    # Only a page proven bad by its own digest is freed; the others stay valid.
    proven = fault in PROVEN
    assert result.freed_pages == ((BAD,) if proven else ())
    assert mgr.is_valid(pages[BAD + 1])
    assert mgr.is_valid(pages[BAD]) == (fault in ("wrong-key", "zero-dma"))
    for layer in range(LAYERS):
        released_blocks_are_good(new, layer, BAD)
    consumed = gate == "layer" and fault in ("bitflip", "torn", "one-shard", "zero-dma")
    assert result.consumed_before_failure == consumed
    if consumed:
        with pytest.raises(kvxfer.IntegrityError, match="restart the request from page 2"):
            result.raise_if_consumed()
    # The bad page and those after it were freed; the verified ones are still ours.
    mgr.free(pages[:BAD])
    if fault == "stale-slot":  # the slot belongs to the page that reused it
        gen, state, key = mgr.host_pool.state(pages[BAD].slot)
        assert state == "valid" and gen > pages[BAD].generation
        with pytest.raises(kvxfer.PoolError, match="is stale"):
            mgr.free([pages[BAD]])
        pages[BAD] = kvxfer.PageRef(key, pages[BAD].slot, gen)
    mgr.free(pages[BAD:])  # the intact ones; freeing those kvxfer freed is a no-op
    assert mgr.num_free_pages == 8


def test_gate_all_releases_nothing_before_verification():
    caches = make_caches("bfloat16", 16 << 10, sharded=False)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8)
    pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
    faults.flip_bit(mgr, pages[1], layer=2)
    with faults.failing_transfer(mgr, after_layers=LAYERS):  # slow nothing, count layers
        new, handle = mgr.load(caches, pages, DST, gate="all")
        assert handle.layer_ready(0) == 1  # layer 0 was fine, but released with the final prefix
    assert handle.result().released_prefixes == (1, 1, 1)


def test_clean_run_has_no_false_positives():
    """At least 1 GiB of pages through offload and load, integrity on, zero mismatches."""
    caches = make_caches("bfloat16", 256 << 10, sharded=False, seed=9)
    caches = [jax.numpy.concatenate([c] * 8) for c in caches]  # 64 blocks x 3 layers
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=64)
    rng = np.random.default_rng(1)
    moved = 0
    while moved < (1 << 30):
        src = rng.permutation(64)[:48]
        dst = rng.permutation(64)[:48]
        before = [bits(c) for c in caches]
        pages = mgr.offload(caches, src, keys=[int(k) for k in rng.integers(0, 2**62, 48)]).wait()
        caches, handle = mgr.load(caches, pages, dst, gate="layer")
        result = handle.result()
        assert result.verified_prefix == 48 and not result.reasons
        for c, b in zip(caches, before):
            assert np.array_equal(bits(c)[dst], b[src])
        mgr.free(pages)
        moved += 48 * 3 * (256 << 10)
    assert mgr.num_free_pages == 64


@pytest.mark.parametrize("gate", ["layer", "all"])
@pytest.mark.parametrize("mover", ["raw", "staged", "emulated", "pinned", "pinned-sharded",
                                   "pallas", "dma"])
def test_zero_dma_is_caught_on_every_mover(mover, gate):
    """A load that silently delivers zeros into one page's block is a digest mismatch at
    that page, whichever mover moved it; the host page itself is intact."""
    dtype = "float32" if mover == "pinned-sharded" else "bfloat16"
    caches = make_caches(dtype, 16 << 10, sharded=mover == "pinned-sharded", seed=4)
    before = [bits(c) for c in caches]
    path = {"raw": "auto", "emulated": "auto", "pinned-sharded": "pinned"}.get(mover, mover)
    layouts = [kvxfer.Layout.of(c) for c in caches] if mover == "emulated" else None
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path=path, layouts=layouts)
    assert mgr.paths == [mover.split("-")[0]] * LAYERS
    pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
    host = mgr.read_block_bytes(pages[BAD], BAD_LAYER)
    faults.inject("zero-dma", mgr, caches, pages, BAD, BAD_LAYER, device_blocks=DST)
    new, handle = mgr.load(caches, pages, DST, gate=gate)
    result = handle.result()
    assert result.verified_prefix == BAD
    # The host copy matches its digests: a delivery fault, the page kept for the next.
    assert result.reasons[BAD] == ("transfer: digest mismatch in layer 1, while its host "
                                   "copy matches its digests (the page is kept)")
    assert result.freed_pages == () and mgr.is_valid(pages[BAD])
    assert mgr.stats()["transfer_faults"] == 1
    got = bits(new[BAD_LAYER])
    assert not got[DST[BAD]].any()  # zeros arrived, and no error was raised
    assert before[BAD_LAYER][SRC[BAD]].any()  # where the page held random bits
    assert np.array_equal(got[DST[BAD + 1]], before[BAD_LAYER][SRC[BAD + 1]])
    for layer in range(LAYERS):
        for j in range(BAD):
            assert np.array_equal(bits(new[layer])[DST[j]], before[layer][SRC[j]])
    assert host.count(0) < len(host)  # the host page is intact: the fault was the move
    assert mgr.set_transfer_hook(None) is None  # the fault hooked one load only
    new, handle = mgr.load(new, pages, DST, gate=gate)
    assert handle.result().verified_prefix == len(pages)  # transient: gone next load
    mgr.close()


@pytest.mark.parametrize("path", ["auto", "staged", "pinned"])
def test_concurrent_threads_offload_load_and_free(path):
    """Several threads share one manager with slot reuse: no corruption, hang or leak."""
    import threading

    num_threads, rounds = 4, 12
    template = make_caches("bfloat16", 16 << 10, sharded=False, seed=3)
    mgr = kvxfer.KVCacheManager(template, num_host_blocks=10, path=path)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            rng = np.random.default_rng(100 + t)
            caches = make_caches("bfloat16", 16 << 10, sharded=False, seed=10 + t)
            for r in range(rounds):
                k = int(rng.integers(1, 4))
                src, dst = rng.permutation(8)[:k], rng.permutation(8)[:k]
                before = [bits(c) for c in caches]
                while True:
                    try:
                        pages = mgr.offload(caches, src, keys=[t * 1000 + r * 10 + j
                                                               for j in range(k)]).wait()
                        break
                    except kvxfer.PoolExhaustedError:
                        threading.Event().wait(0.001)
                caches, handle = mgr.load(caches, pages, dst, gate=("layer", "all")[r % 2])
                result = handle.result(timeout=60)
                assert result.verified_prefix == k and not result.reasons, result
                for c, b in zip(caches, before):
                    assert np.array_equal(bits(c)[dst], b[src])
                mgr.free(pages)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "deadlock"
    assert not errors, errors
    assert mgr.num_free_pages == 10


def test_slots_read_by_a_load_in_flight_are_not_reused():
    import threading

    caches = make_caches("float32", 16 << 10, sharded=False)
    before = [bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
    gate = threading.Event()
    mgr.set_transfer_hook(lambda event, layer, array: event == "load_layer" and gate.wait(30))
    new, handle = mgr.load(caches, pages, DST)  # consumes caches
    mgr.free(pages)  # the load still reads these slots
    assert mgr.num_free_pages == 0
    with pytest.raises(kvxfer.PoolExhaustedError):
        mgr.offload(new, [0], keys=[9])
    gate.set()
    assert handle.result().verified_prefix == 4
    mgr.set_transfer_hook(None)
    for c, b in zip(new, before):
        assert np.array_equal(bits(c)[DST], b[SRC])
    assert mgr.num_free_pages == 4


@pytest.mark.parametrize("fault", faults.FAULTS)
def test_probe_inject_detects_each_fault(fault):
    from kvxfer.probe import run_probe

    if fault == "one-shard":
        report = run_probe("tiny", num_pages=6, num_blocks=16, devices=2, integrity="page",
                           inject=fault, gate="layer")
    else:
        report = run_probe("tiny", num_pages=6, num_blocks=16, integrity="page",
                           inject=fault, gate="layer")
    injected = report["summary"]["injected"]
    assert report["ok"] and injected["detected"], injected
    if fault != "transfer":
        assert report["summary"]["verified_prefix"] == 3


@pytest.mark.parametrize("gate", ["layer", "all"])
def test_every_replica_is_verified(gate):
    """A replicated layer is loaded into every replica, and each copy is checked."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("kv",))
    x = jax.device_put(np.arange(8 * 1024, dtype=np.float32).reshape(8, 1024),
                       NamedSharding(mesh, P()))
    mgr = kvxfer.KVCacheManager([x], num_host_blocks=4)
    assert mgr.plan.classes[0].replicas == 2
    pages = mgr.offload([x], [1, 2, 3], keys=[1, 2, 3]).wait()

    def corrupt_second_replica(event, layer, array):
        if event != "loaded_layer":
            return
        # The bytes are written behind XLA's back: once the program writing them ran
        # (auto loads through an enqueued program where the replicas' buffers differ).
        array.block_until_ready()
        replica = array.addressable_shards[1].data
        view = np.ctypeslib.as_array(
            (__import__("ctypes").c_uint8 * replica.nbytes).from_address(
                replica.unsafe_buffer_pointer()))
        view[DST[1] * 4096 + 5] ^= 1  # one bit of page 1 in the second replica only

    mgr.set_transfer_hook(corrupt_second_replica)
    (y,), handle = mgr.load([x], pages, DST[:3], gate=gate)
    result = handle.result()
    assert result.verified_prefix == 1
    assert "replica(s) [1] of 2" in result.reasons[1]


def test_shared_buffers_are_unshared_before_raw_writes():
    """Arrays sharing a buffer (here one cache passed as two layers, as XLA:CPU's replicas
    of a replicated device_put can) get private copies before a raw load writes."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("kv",))
    x = jax.device_put(np.arange(8 * 1024, dtype=np.float32).reshape(8, 1024),
                       NamedSharding(mesh, P()))
    x = jax.device_put(x, x.sharding, may_alias=False)
    before = np.array(x)
    twin = [x, x]
    mgr = kvxfer.KVCacheManager(twin, num_host_blocks=2)
    assert mgr.paths == ["raw", "raw"]
    pages = mgr.offload(twin, [2], keys=[6]).wait()
    new, handle = mgr.load(twin, pages, [5])
    assert handle.result().verified_prefix == 1
    ptrs = {s.data.unsafe_buffer_pointer() for a in new for s in a.addressable_shards}
    assert len(ptrs) == 4  # every layer and replica now has its own buffer
    assert np.array_equal(np.array(x), before)  # the shared original is untouched
    for a in new:
        assert np.array_equal(np.array(a)[5], before[2])


def test_inject_knows_every_fault_it_lists_and_transfer_fails_one_load():
    caches = make_caches("float32", 16 << 10, sharded=False)
    before = [bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8)
    pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
    pages, keys = faults.inject("transfer", mgr, caches, pages, BAD, BAD_LAYER)
    assert keys is None
    caches, handle = mgr.load(caches, pages, DST, gate="layer")
    with pytest.raises(kvxfer.TransferError, match="injected device transfer failure"):
        handle.result()
    assert handle.layer_ready(0) == len(SRC)  # layer 0 moved before the failure
    caches, handle = mgr.load(caches, pages, DST)  # the fault was one load only
    assert handle.result().verified_prefix == len(SRC)
    for c, b in zip(caches, before):
        assert np.array_equal(bits(c)[DST], b[SRC])
    with pytest.raises(ValueError, match=r"unknown fault 'flood'; expected one of \("
                       r"'bitflip', .*'transfer', 'zero-dma'\)"):
        faults.inject("flood", mgr, caches, pages, BAD, BAD_LAYER)


def test_a_wrong_expected_key_is_a_miss_for_that_request_only():
    caches = make_caches("float32", 16 << 10, sharded=False)
    before = [bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8)
    pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
    caches, handle = mgr.load(caches, pages, DST, keys=[1, 2, 99, 4])
    result = handle.result()
    assert result.verified_prefix == 2 and result.freed_pages == ()
    assert result.reasons[2] == "wrong key: expected 0x63, page holds 0x3"
    assert all(mgr.is_valid(p) for p in pages)
    caches, handle = mgr.load(caches, pages[2:], DST[2:], keys=[3, 4])  # its real holder
    assert handle.result().verified_prefix == 2
    for c, b in zip(caches, before):
        assert np.array_equal(bits(c)[DST], b[SRC])


def test_help_of_the_testing_package_gives_every_fault_its_meaning():
    import pydoc

    text = pydoc.render_doc(faults, renderer=pydoc.plaintext)
    for name in faults.FAULTS:
        line = next((ln for ln in text.splitlines() if ln.strip().startswith(f"* ``{name}``:")),
                    None)
        assert line is not None, f"help(kvxfer.testing) does not explain {name!r}"
        assert len(line.split(":", 1)[1].strip()) > 10, line


def test_cache_builders_default_to_a_device_of_this_process(monkeypatch):
    """On rank 1 of a two-process job ``jax.devices()[0]`` is rank 0's device; the
    builders must place on ``jax.local_devices()[0]`` (here a stand-in: device 2)."""
    from kvxfer import config

    mine = jax.devices()[2]
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [mine])
    caches = faults.random_caches(2, 4, (4, 128), "float32")
    assert all(c.devices() == {mine} for c in caches)
    built = config.load_builtin("tiny").build_caches(4)
    assert all(c.devices() == {mine} for c in built)
