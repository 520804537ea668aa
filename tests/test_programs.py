"""The engine's compiled programs on XLA:CPU: loops over the pages move what they move.

The programs that loop over the pages (digests, the pinned mover's in-place copies,
staged loads) read and write raw bits of bf16 and fp8 caches through bitcasts; XLA
would hoist a bitcast of a whole cache out of a loop (a copy of every block on every
call, whatever the page count), and an update through a bitcast carried by the loop
copies the caches in and out. The compiled programs' own memory says which happened.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kvxfer import testing
from kvxfer.engine._batch import abstract, loop_pages
from kvxfer.engine._programs import compiled, unit_count

LAYERS, BLOCKS, BLOCK = 4, 64, (16, 128)


def _sds(shape, dtype, device):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32"])
@pytest.mark.parametrize("kind", ["digest", "pinned_write", "pinned_load", "staged_load"])
def test_page_loops_touch_no_whole_cache(kind, dtype):
    caches = tuple(abstract(c) for c in testing.random_caches(LAYERS, BLOCKS, BLOCK, dtype))
    device = jax.devices()[0]
    n = loop_pages(1, BLOCKS)
    ids, count = _sds((n,), np.int32, device), _sds((), np.int32, device)
    words = unit_count((1, *BLOCK), dtype, 4)
    pool = _sds((8, LAYERS * words), np.uint32, device)
    args = {
        "digest": ((ids, _sds((n, 5), np.uint32, device), _sds((LAYERS,), np.uint32, device),
                    count), ()),
        # (the pool's sharding, the page's first word, 4-byte words, not gathered)
        "pinned_write": ((pool, ids, ids, count), (pool.sharding, 0, 4, False)),
        "pinned_load": ((pool, ids, ids, count), (pool.sharding, 0, 4, False)),
        "staged_load": ((ids, _sds((n, LAYERS, *BLOCK), caches[0].dtype if dtype == "float32"
                                   else f"uint{8 * np.dtype(caches[0].dtype).itemsize}",
                                   device), count), ()),
    }[kind]
    stats = compiled(kind, caches, *args[0], options=args[1]).memory_analysis()
    cache_bytes = caches[0].size * np.dtype(caches[0].dtype).itemsize
    # Scratch for a block or a page at a time, never a cache (a hoisted bitcast).
    assert stats.temp_size_in_bytes < cache_bytes, stats
    if kind in ("pinned_load", "staged_load"):  # the donated caches are written in place
        assert stats.alias_size_in_bytes >= LAYERS * cache_bytes, stats
    if kind == "pinned_write":  # and the donated pool
        assert stats.alias_size_in_bytes >= 8 * LAYERS * words * 4, stats


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_grouped_digest_loops_equal_the_vectorized_digest(dtype):
    # 8 KiB blocks: the loop digests 128 pages an iteration while 128 are left, then one
    # an iteration; every count must give the vectorized program's digests, and zeros
    # past the count.
    import functools

    from kvxfer import integrity
    from kvxfer.engine import _programs

    caches = tuple(testing.random_caches(3, 300, (16, 8192 // 16 // np.dtype(
        jax.numpy.dtype(dtype)).itemsize), dtype, seed=1))
    n = loop_pages(300, 300)
    rng = np.random.default_rng(2)
    ids = np.full(n, 0, np.int32)
    ids[:300] = rng.permutation(300)
    ids[300:] = ids[0]
    base = rng.integers(0, 2**32, (n, integrity.IDENTITY_WORDS), dtype=np.uint32)
    layer_nums = np.array([3, 9, 27], np.uint32)
    g = _programs._digest_group(caches[0], n)
    assert g == _programs.DIGEST_LOOP_BYTES // 8192 and g > 1  # several pages an iteration
    vectorized = jax.jit(functools.partial(_programs._digest_impl,
                                           raw=_programs.needs_raw_bits(caches[0]),
                                           loop=False))
    want = np.asarray(vectorized(caches, ids, base, layer_nums, None))
    for count in (1, g - 1, g, g + 5, 2 * g, 300):
        got = np.asarray(_programs.digest_blocks(caches, ids, base, layer_nums,
                                                 np.int32(count)))
        assert np.array_equal(got[:, :count], want[:, :count]), count
        assert not got[:, count:].any(), count
