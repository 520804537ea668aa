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
    offsets = tuple(pos * words for pos in range(LAYERS))
    args = {
        "digest": ((ids, _sds((n, 5), np.uint32, device), _sds((LAYERS,), np.uint32, device),
                    count), ()),
        "pinned_write": ((pool, ids, ids, count), (pool.sharding, offsets)),
        "pinned_load": ((pool, ids, ids, count), (pool.sharding, offsets, None, True)),
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
