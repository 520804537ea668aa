"""What an adversary or a long uptime found: each case fails without its fix."""

import pytest

import kvxfer
from kvxfer import testing
from kvxfer.hostpool import MAX_GENERATION, PoolError, PoolExhaustedError


@pytest.fixture
def small():
    caches = testing.random_caches(2, 8, (4, 32), "float32")
    with kvxfer.KVCacheManager(caches, num_host_blocks=2) as mgr:
        yield mgr, caches


def test_a_slot_retires_before_its_generation_wraps(small):
    # Digests and blobs carry 32 bits of generation: at 10 k offloads a second a
    # one-page loop reaches 2**32 on slot 0 in five days.
    mgr, caches = small
    pool = mgr.host_pool
    pool._slots[0].generation = MAX_GENERATION - 1  # a slot after 2**32 - 2 reuses
    page, = mgr.offload(caches, [1], keys=[5]).wait()
    assert (page.slot, page.generation) == (0, MAX_GENERATION)
    caches, load = mgr.load(caches, [page], [6])
    assert load.result().verified_prefix == 1  # its last generation still verifies
    blob = mgr.export_page(page)
    mgr.free([page])
    assert pool.num_retired == 1 and mgr.num_free_pages == 1
    again, = mgr.offload(caches, [1], keys=[5]).wait()
    assert again.slot == 1
    with pytest.raises(PoolError, match="host slot 0 has used every generation"):
        mgr.offload(caches, [2], keys=[6], slots=[0])
    with pytest.raises(PoolExhaustedError, match=r"0 of 2 slots free \(1 retired\)"):
        mgr.offload(caches, [2], keys=[6])
    assert mgr.num_free_pages == 0 and mgr.is_valid(again)  # nothing leaked or lost
    mgr.free([again])
    imported = mgr.import_page(blob)  # its digests stay bound to the old generation
    caches, load = mgr.load(caches, [imported], [7])
    assert load.result().verified_prefix == 1
