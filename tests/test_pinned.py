"""The pinned mover: byte-exact round trips through a pinned host pool, chosen by auto.

Caches mix slice classes (bf16 and fp8 with NaN payloads, a layer sharded over 2
devices, a layer replicated over 2, odd block sizes, on CPU a permuted layout); every
moved block must come back bit for bit and every other block must stay as it was.
On a backend with one device (one GPU, say) the sharded and replicated layers have
one shard and one replica.
"""

import threading

import jax
import jax.monitoring
import numpy as np
import pytest
from jax.experimental.layout import Format
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import kvxfer
from kvxfer import integrity, testing
from kvxfer.engine._pinned import IN_PLACE_PLATFORMS, pinned_mode

SRC, DST = [5, 1, 6, 2], [0, 7, 3, 4]
NUM_BLOCKS = 8
PLATFORM = jax.devices()[0].platform
N = min(2, len(jax.devices()))  # devices a layer is sharded or replicated over


def _mesh():
    return Mesh(np.array(jax.devices()[:N]), ("kv",))


def mixed_caches(seed=0):
    """Six layers in five slice classes (five in four off CPU), random bits (NaNs too)."""
    sharded = NamedSharding(_mesh(), P(None, None, "kv"))
    replicated = NamedSharding(_mesh(), P())
    caches = (testing.random_caches(2, NUM_BLOCKS, (4, 128), "bfloat16", seed=seed)
              + testing.random_caches(1, NUM_BLOCKS, (2, 4, 64), "float32", sharding=sharded,
                                      seed=seed + 1)
              + testing.random_caches(1, NUM_BLOCKS, (16, 8), "float8_e4m3fn",
                                      sharding=replicated, seed=seed + 2)
              + testing.random_caches(1, NUM_BLOCKS, (3, 5), "int8", seed=seed + 3))
    if PLATFORM == "cpu":
        # A layout raw copies refuse (block dim most minor): auto moves it pinned.
        permuted = testing.random_caches(1, NUM_BLOCKS, (2, 64), "bfloat16", seed=seed + 4)[0]
        layout = kvxfer.Layout((0, 2, 1))
        caches.append(jax.device_put(permuted, Format(layout.to_jax(), permuted.sharding)))
    return caches


def check_moved(new, before, src, dst):
    """Blocks ``dst`` hold ``src``'s old bits in every layer; every other block is as it was."""
    for i, (a, b) in enumerate(zip(new, before)):
        got = testing.bits(a)
        want = b.copy()
        want[dst] = b[src]
        bad = np.flatnonzero((got != want).reshape(got.shape[0], -1).any(axis=1))
        assert bad.size == 0, f"layer {i}: blocks {bad.tolist()} differ"
        for shard in a.addressable_shards:  # every replica holds the loaded bytes
            idx = shard.index
            assert np.array_equal(testing.bits(shard.data), want[idx]), (i, shard.device)


def page_bytes(array_bits, block, num_shards):
    """What the host page holds for one block: each shard's part, shard-major.

    The sharded layer here splits array dim 2 (the block's dim 1).
    """
    parts = np.split(array_bits[block], num_shards, axis=1) if num_shards > 1 else \
        [array_bits[block]]
    return b"".join(np.ascontiguousarray(p).tobytes() for p in parts)


@pytest.mark.parametrize("gate", ["layer", "all"])
def test_pinned_round_trips_mixed_classes_byte_exact(gate):
    caches = mixed_caches(seed=1)
    before = [testing.bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="pinned")
    assert mgr.paths == ["pinned"] * len(caches)
    assert [(c.num_shards, c.replicas) for c in mgr.plan.classes] == \
        [(1, 1), (N, 1), (1, N), (1, 1), (1, 1)][:len(mgr.plan.classes)]
    assert all(p.pinned for p in mgr.host_pool.pools)
    pages = mgr.offload(caches, SRC, keys=[11, 12, 13, 14]).wait()
    for j, b in enumerate(SRC):  # the pool holds each block's bytes, shard-major
        for i in range(len(caches)):
            shards = mgr.plan.class_of_layer(i)[0].num_shards
            assert mgr.read_block_bytes(pages[j], i) == page_bytes(before[i], b, shards), (j, i)
    new, load = mgr.load(caches, pages, DST, gate=gate)
    for i in range(len(caches)):
        assert load.layer_ready(i) == len(SRC)
    result = load.result()
    assert result.verified_prefix == len(SRC) and not result.reasons, result
    check_moved(new, before, SRC, DST)
    if PLATFORM == "cpu":
        assert kvxfer.Layout.of(new[-1]) == kvxfer.Layout((0, 2, 1))  # the layout is kept
    # The loaded caches move on: a second round trip from them.
    again = [testing.bits(c) for c in new]
    pages2 = mgr.offload(new, [0, 7], keys=[21, 22]).wait()
    new2, load = mgr.load(new, pages2, [6, 5], gate=gate)
    assert load.result().verified_prefix == 2
    check_moved(new2, again, [0, 7], [6, 5])
    mgr.free(pages + pages2)
    assert mgr.num_free_pages == 8
    mgr.close()


def test_a_corrupt_pinned_page_is_a_miss_at_that_page():
    caches = mixed_caches(seed=2)
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="pinned")
    pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
    testing.corrupt_shard(mgr, pages[1], layer=2, shard=N - 1)  # the sharded layer
    _, load = mgr.load(caches, pages, DST, gate="layer")
    result = load.result()
    assert result.verified_prefix == 1
    assert result.reasons[1] == ("digest mismatch in layer 2" if N == 1 else
                                 "shard disagreement: digest mismatch in layer 2 on "
                                 "shard(s) [1] of 2")
    mgr.close()


@pytest.mark.parametrize("bad_layer", [None, 0, 5, 11])
def test_a_one_class_layer_gated_load_releases_what_its_one_job_proves(bad_layer):
    """One class, its digests computed by the load's one program: a clean load releases
    every layer with the whole prefix; a bad page (in the first, a middle or the last
    layer) releases the layers before it with the whole prefix and the rest without it."""
    caches = testing.random_caches(12, NUM_BLOCKS, (4, 128), "bfloat16", seed=12)
    before = [testing.bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="pinned")
    pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
    if bad_layer is not None:
        testing.corrupt_shard(mgr, pages[2], layer=bad_layer, shard=0)
    caches, load = mgr.load(caches, pages, DST, gate="layer")
    result = load.result()
    if bad_layer is None:
        assert result.verified_prefix == 4 and not result.reasons
        assert result.released_prefixes == (4,) * 12
        check_moved(caches, before, SRC, DST)
    else:
        assert result.verified_prefix == 2
        assert result.reasons == {2: f"digest mismatch in layer {bad_layer}"}
        assert result.released_prefixes == (4,) * bad_layer + (2,) * (12 - bad_layer)
        assert result.consumed_before_failure == (bad_layer > 0)
    assert all(load.is_layer_ready(i) for i in range(12))
    mgr.close()


@pytest.mark.skipif(PLATFORM != "cpu", reason="the CPU rule (raw where proven)")
def test_auto_picks_raw_where_proven_and_pinned_for_the_rest():
    caches = mixed_caches(seed=3)
    with kvxfer.KVCacheManager(caches, num_host_blocks=2) as mgr:
        # Row-major whole-byte buffers (sharded and replicated ones too) copy raw on
        # XLA:CPU; the permuted layout goes pinned, where staged went before.
        assert mgr.paths == ["raw"] * 5 + ["pinned"]
        assert kvxfer.manager.AUTO_RULES["cpu"] == ("raw", "pinned", "staged")
        # Raw classes' pools are pinned too: a call behind pending writers moves
        # through the pinned programs instead of waiting (test_calls.py).
        assert [p.pinned for p in mgr.host_pool.pools] == [True] * 5
    with kvxfer.KVCacheManager(caches, num_host_blocks=2, pinned=False) as mgr:
        assert mgr.paths == ["raw"] * 5 + ["staged"]  # no pinned pools: staged
    layouts = [kvxfer.Layout.of(c) for c in caches]
    with kvxfer.KVCacheManager(caches[:2], num_host_blocks=2, layouts=layouts[:2]) as mgr:
        assert mgr.paths == ["emulated"] * 2  # emulated layouts keep their own rule
    with kvxfer.KVCacheManager(caches[:2], num_host_blocks=2, layouts=layouts[:2],
                               path="pinned") as mgr:
        assert mgr.paths == ["pinned"] * 2


@pytest.mark.skipif(PLATFORM not in ("gpu", "tpu"), reason="auto on GPU and TPU")
def test_auto_is_the_pinned_mover_on_gpu_and_tpu():
    caches = mixed_caches(seed=3)
    with kvxfer.KVCacheManager(caches, num_host_blocks=2) as mgr:
        assert mgr.paths == ["pinned"] * len(caches)
        assert all(p.pinned for p in mgr.host_pool.pools)
    with kvxfer.KVCacheManager(caches, num_host_blocks=2, pinned=False) as mgr:
        assert mgr.paths == ["staged"] * len(caches)


def test_pinned_path_refusals_name_what_is_wrong():
    caches = testing.random_caches(1, 4, (8, 128), "float32")
    with pytest.raises(ValueError, match=r"path='pinned' .* cannot run with pinned=False"):
        kvxfer.KVCacheManager(caches, num_host_blocks=2, path="pinned", pinned=False)
    with pytest.raises(ValueError, match=r"path='fast'; expected one of \(.*'pinned'"):
        kvxfer.KVCacheManager(caches, num_host_blocks=2, path="fast")


@pytest.mark.skipif(pinned_mode(jax.devices()[0].platform) != "in-place",
                    reason="the pool is updated in place only where IN_PLACE_PLATFORMS says")
def test_the_pinned_pool_is_updated_in_place():
    assert "cpu" in IN_PLACE_PLATFORMS
    caches = testing.random_caches(3, NUM_BLOCKS, (4, 128), "bfloat16", seed=5)
    before = [testing.bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="pinned")
    pool = mgr.host_pool.pools[0]
    address = pool.data.__array_interface__["data"][0]
    first = pool.array
    assert first.unsafe_buffer_pointer() == address
    for r in range(3):
        pages = mgr.offload(caches, SRC, keys=[r * 10 + j for j in range(4)]).wait()
        assert pool.array is not first and first.is_deleted()  # donated, every time
        assert pool.array.unsafe_buffer_pointer() == address  # ... into the same buffer
        assert pool.array.sharding.memory_kind == "pinned_host"
        for j, b in enumerate(SRC):
            assert mgr.read_block_bytes(pages[j], 1) == before[1][b].tobytes()
        caches, load = mgr.load(caches, pages, DST)
        assert load.result().verified_prefix == 4
        check_moved(caches, before, SRC, DST)
        before = [testing.bits(c) for c in caches]
        mgr.free(pages)
        first = pool.array
    mgr.close()


@pytest.mark.skipif(pinned_mode(jax.devices()[0].platform) != "in-place",
                    reason="offloads digest inside their write only where they write the pool "
                           "itself")
def test_an_offload_dispatches_one_program_that_digests_what_it_writes(monkeypatch):
    """In place, an offload with integrity on runs ``pinned_write`` alone (no digest program
    of its own), and the digests it stores are what a load then verifies against."""
    from kvxfer.engine import _programs
    caches = testing.random_caches(12, NUM_BLOCKS, (4, 128), "bfloat16", seed=11)
    before = [testing.bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="pinned")
    ran = []
    run = _programs.run
    monkeypatch.setattr(_programs, "run", lambda kind, *a, **k: ran.append(kind) or
                        run(kind, *a, **k))
    pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
    assert ran == ["pinned_write"]
    keys = [1, 2, 3, 4]
    for j, (page, b) in enumerate(zip(pages, SRC)):
        for layer in (0, 11):
            words = integrity.as_words_np(before[layer][b][None], 1)
            ident = integrity.identity_words(keys[j], layer, page.generation, 0)
            stored = mgr.host_pool.pools[0].digests[page.slot, layer, 0, :integrity.DIGEST_WORDS]
            np.testing.assert_array_equal(stored, integrity.digest_np(words, ident)[0])
    ran.clear()
    caches, load = mgr.load(caches, pages, DST, gate="layer")
    assert ran == ["pinned_load"] and load.result().verified_prefix == 4
    check_moved(caches, before, SRC, DST)
    mgr.close()


def test_the_pages_route_round_trips_too(monkeypatch):
    """``pinned_route="pages"``: each page an array of pinned memory of its own (what
    backends outside ``IN_PLACE_PLATFORMS`` do), byte-exact, nothing copied on the host."""
    caches = mixed_caches(seed=6)
    before = [testing.bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="pinned", pinned_route="pages")
    assert "pages route" in mgr.paths[0].reason and "pinned_route='pages'" in \
        mgr.paths[0].reason
    assert all(p.pages is not None and p.data is None for p in mgr.host_pool.pools)
    pages = mgr.offload(caches, SRC, keys=[1, 2, 3, 4]).wait()
    new, load = mgr.load(caches, pages, DST, gate="layer")
    assert load.result().verified_prefix == 4
    check_moved(new, before, SRC, DST)
    assert mgr.stats()["host_copy_bytes"] == 0
    mgr.close()
    with pytest.raises(ValueError, match=r"pinned_route='sideways'; expected one of"):
        kvxfer.KVCacheManager(new[:1], num_host_blocks=2, path="pinned",
                              pinned_route="sideways")


class CompileCounter:
    """Counts XLA backend compilations while active."""

    def __init__(self):
        self.count = 0
        self._on = False
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, name, secs, **kwargs):
        if self._on and name.endswith("backend_compile_duration"):
            with self._lock:
                self.count += 1

    def __enter__(self):
        self.count, self._on = 0, True
        return self

    def __exit__(self, *exc):
        self._on = False


_COUNTER = CompileCounter()


@pytest.mark.parametrize("path", ["pinned", "staged", "dma"])
@pytest.mark.parametrize("integrity", ["page", "off"])
def test_warmup_compiles_every_program_a_transfer_runs(path, integrity):
    # Shapes no other test builds, so nothing is compiled before the warm-up.
    sharded = NamedSharding(_mesh(), P(None, "kv"))
    replicated = NamedSharding(_mesh(), P())
    caches = (testing.random_caches(2, 11, (3, 40), "bfloat16", seed=7)
              + testing.random_caches(1, 11, (4, 24), "float32", sharding=sharded, seed=8)
              + testing.random_caches(1, 11, (5, 24), "float8_e4m3fn", sharding=replicated,
                                      seed=9))
    before = [testing.bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path=path, integrity=integrity)
    assert mgr.warmup(4) == [1, 2, 4]
    with _COUNTER as compiled:
        for k, gate in ((3, "layer"), (4, "all"), (1, "layer"), (2, "all")):
            src, dst = list(range(k)), list(range(10, 10 - k, -1))
            pages = mgr.offload(caches, src, keys=list(range(k))).wait()
            caches, load = mgr.load(caches, pages, dst, gate=gate)
            assert load.result().verified_prefix == k
            check_moved(caches, before, src, dst)
            before = [testing.bits(c) for c in caches]
            mgr.free(pages)
    assert compiled.count == 0
    mgr.close()


def test_threads_share_one_pinned_pool():
    """Offloads donate the pool while loads read it: one lock, no lost or stale page."""
    template = testing.random_caches(2, 16, (4, 128), "bfloat16", seed=10)
    mgr = kvxfer.KVCacheManager(template, num_host_blocks=12, path="pinned")
    errors = []

    def worker(t):
        try:
            rng = np.random.default_rng(t)
            caches = testing.random_caches(2, 16, (4, 128), "bfloat16", seed=20 + t)
            for r in range(8):
                k = int(rng.integers(1, 4))
                src, dst = rng.permutation(16)[:k], rng.permutation(16)[:k]
                before = [testing.bits(c) for c in caches]
                pages = mgr.offload(caches, src, keys=[t * 100 + r * 4 + j
                                                       for j in range(k)]).wait()
                caches, load = mgr.load(caches, pages, dst, gate=("layer", "all")[r % 2])
                assert load.result(timeout=60).verified_prefix == k
                check_moved(caches, before, src, dst)
                mgr.free(pages)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "deadlock"
    assert not errors, errors
    assert mgr.num_free_pages == 12
    mgr.close()
