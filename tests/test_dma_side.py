"""Loads beside XLA's stream (``kvxfer.engine.dma``), on XLA:CPU over the stand-in
CUDA driver, whose own streams run every copy late on a thread of their own: a scatter
that does not wait for its group's copies reads staging they have not reached, and the
load's digests say so."""

from __future__ import annotations

import ctypes
import gc
import re
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import kvxfer
from kvxfer import testing
from kvxfer.engine import COPY_ENGINES, TransferError
from kvxfer.engine.dma._jobs import TICKETS
from kvxfer.engine.dma._mover import layer_groups
from kvxfer.engine._mover import _args_abstract, _sds
from kvxfer.engine import _programs

from cuda_rig import CUDA_ERROR_OUT_OF_MEMORY, NO_CHECK, FakeDriver, HostStreamEngine, dma_mover

pytestmark = pytest.mark.cpu("the stand-in driver's engine runs on XLA:CPU")

bits = testing.bits
held = kvxfer.engine.staging_bytes_held


@pytest.fixture
def fake(monkeypatch):
    driver = FakeDriver(delay=0.1)
    engine = HostStreamEngine(driver.driver(), ordinal=0)
    monkeypatch.setitem(COPY_ENGINES, "cpu", lambda device, copy="batch": engine)
    return driver


def calls(fake, kind):
    return [call for k, call in fake.calls if k == kind]


def offloaded(layers: int = 4, shape=(64, 256), **options):
    """A DMA manager over 64 KiB float32 blocks (a group per layer) with pages 3, 1, 12
    offloaded; the caches, their bits then, the manager, the pages."""
    caches = testing.random_caches(layers, 16, shape, "float32")
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma",
                                dma=kvxfer.DmaOptions(self_check=False, **options))
    pages = mgr.offload(caches, [3, 1, 12], keys=[1, 2, 3]).wait()
    return caches, [bits(c) for c in caches], mgr, pages


def test_a_load_copies_beside_and_each_group_waits_for_its_own_copies(fake):
    caches, before, mgr, pages = offloaded()
    assert dma_mover(mgr).groups == ((0, 1), (1, 2), (2, 3), (3, 4))
    fake.calls.clear()
    new, load = mgr.load(caches, pages, [0, 5, 6])
    assert load.result().verified_prefix == 3
    for c, b in zip(new, before):
        assert np.array_equal(bits(c)[[0, 5, 6]], b[[3, 1, 12]])
    # Four groups of copies on the engine's own stream; XLA's stream waits for each
    # group's event once, and each wait is followed by the word that lets its scatter
    # write.
    # The loads' own stream: not the offloads' (a load never queues behind an offload).
    load_streams = {b["stream"] for b in calls(fake, "batch")}
    assert len(load_streams) == 1 and load_streams < set(fake.streams)
    assert len(fake.streams) == 2
    assert len(calls(fake, "batch")) == 4
    waits = [w for w in calls(fake, "wait") if w["stream"] == HostStreamEngine.STREAM]
    assert len(waits) == 4 and len(calls(fake, "memset")) == 4
    assert held() == 0 and TICKETS.pending() == 0
    mgr.close()


def open_gate(completion, stream, word):
    """A group's hold that lets its scatter run (the word set) without the stream wait."""
    ctypes.c_uint32.from_address(word).value = 1


def test_a_scatter_that_does_not_wait_reads_wrong_bytes_and_is_caught(fake, monkeypatch):
    """The stand-in's copies really come late: without the stream wait the scatter
    reads staging they have not reached, and the digests catch it."""
    caches, before, mgr, pages = offloaded()
    engine = COPY_ENGINES["cpu"](None)
    monkeypatch.setattr(engine, "hold", open_gate)
    new, load = mgr.load(caches, pages, [0, 5, 6])
    assert load.result().verified_prefix == 0
    assert not np.array_equal(bits(new[0])[[0, 5, 6]], before[0][[3, 1, 12]])
    mgr.close()


def test_prefetch_starts_the_copies_and_the_load_only_scatters(fake):
    caches, before, mgr, pages = offloaded()
    fake.calls.clear()
    staged = mgr.prefetch(pages)
    assert len(calls(fake, "batch")) == 4  # the copies are under way before the load
    assert held() > 0
    new, load = mgr.load(caches, pages, [0, 5, 6], prefetched=staged)
    assert load.result().verified_prefix == 3
    assert len(calls(fake, "batch")) == 4  # none more
    for c, b in zip(new, before):
        assert np.array_equal(bits(c)[[0, 5, 6]], b[[3, 1, 12]])
    assert held() == 0
    mgr.close()


def test_a_released_prefetch_holds_its_staging_until_the_copies_end(fake):
    caches, before, mgr, pages = offloaded()
    staged = [mgr.prefetch(pages), mgr.prefetch(pages[:2])]  # two parked at once
    was = mgr.stats()["dma_staging_bytes"]
    assert was > 0 and all(s.release() for s in staged)
    del staged
    gc.collect()
    assert held() == was  # kept: its copies may still be writing it
    time.sleep(1)  # until they end
    new, load = mgr.load(caches, pages, [0, 5, 6])  # a later stage lets it go
    assert load.result().verified_prefix == 3
    assert mgr.stats()["dma_staging_bytes"] == 0
    mgr.close()


def test_a_failed_staging_fails_the_load_and_writes_no_block(fake):
    caches, before, mgr, pages = offloaded()
    fake.fail["cuMemcpyBatchAsync"] = CUDA_ERROR_OUT_OF_MEMORY
    new, load = mgr.load(caches, pages, [0, 5, 6])
    with pytest.raises(TransferError, match="staging failed.*out of memory") as err:
        load.result()
    for c, b in zip(err.value.kv_caches, before):
        assert not c.is_deleted() and np.array_equal(bits(c), b)
    assert held() == 0 and TICKETS.pending() == 0
    del fake.fail["cuMemcpyBatchAsync"]
    new, load = mgr.load(new, pages, [0, 5, 6])
    assert load.result().verified_prefix == 3
    mgr.close()


@pytest.mark.parametrize("budget", ["1", str(1 << 30)])
def test_past_the_staging_budget_a_load_copies_on_xlas_stream(fake, monkeypatch, budget):
    """One transfer beside XLA's stream at a time under a 1-byte budget: a load
    prefetched while another prefetch holds staging copies in its own program."""
    caches, before, mgr, pages = offloaded(staging_bytes=int(budget))
    first = mgr.prefetch(pages[:1])
    fake.calls.clear()
    second = mgr.prefetch(pages)
    assert len(calls(fake, "batch")) == (0 if budget == "1" else 4)
    new, load = mgr.load(caches, pages, [0, 5, 6], prefetched=second)
    assert load.result().verified_prefix == 3
    for c, b in zip(new, before):
        assert np.array_equal(bits(c)[[0, 5, 6]], b[[3, 1, 12]])
    first.release()
    del first
    gc.collect()
    mgr.load(new, pages[:1], [7])[1].result()
    settle()  # once its copies are done
    mgr.close()


@pytest.mark.cpu("2 devices (conftest.py's CPU devices)")
def test_sharded_and_replicated_loads_beside(fake):
    mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices()[:2])
    heads = NamedSharding(mesh, P(None, "tensor"))
    caches = [jax.device_put(c, heads)
              for c in testing.random_caches(3, 16, (64, 256), "bfloat16", seed=1)]
    caches.append(jax.device_put(testing.random_caches(1, 16, (8, 64), "float32")[0],
                                 NamedSharding(mesh, P())))
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma", dma=NO_CHECK)
    before = [bits(c) for c in caches]
    pages = mgr.offload(caches, [3, 1, 12], keys=[1, 2, 3]).wait()
    new, load = mgr.load(caches, pages, [0, 5, 6])
    assert load.result().verified_prefix == 3
    for c, b in zip(new, before):
        assert np.array_equal(bits(c)[[0, 5, 6]], b[[3, 1, 12]])
    for shard in new[3].addressable_shards:  # every replica got the pages
        assert np.array_equal(bits(shard.data)[[0, 5, 6]], before[3][[3, 1, 12]])
    assert held() == 0
    mgr.close()


@pytest.mark.parametrize("layers, shape, groups", [
    (8, (16, 256), ((0, 4), (4, 8))), (9, (4, 256), ((0, 9),)), (2, (64, 256), ((0, 1), (1, 2)))])
def test_several_layers_a_group_load_exactly_with_integrity_off(layers, shape, groups):
    """Layers wait in groups (8 layers of 16 KiB blocks: two of four; 9 of 4 KiB: one):
    every layer of a group is scattered from bytes its copies wrote (late by 0.3 s,
    the programs compiled ahead), with no digest to hide behind."""
    driver = FakeDriver(delay=0.3)
    engine = HostStreamEngine(driver.driver(), ordinal=0)
    with pytest.MonkeyPatch.context() as m:
        m.setitem(COPY_ENGINES, "cpu", lambda device, copy="batch": engine)
        caches = testing.random_caches(layers, 16, shape, "float32", seed=5)
        before = [bits(c) for c in caches]
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma", integrity="off",
                                    dma=NO_CHECK)
        assert dma_mover(mgr).groups == groups
        mgr.warmup(4)
        pages = mgr.offload(caches, [3, 1, 12], keys=[1, 2, 3]).wait()
        new, load = mgr.load(caches, pages, [0, 5, 6])
        assert load.result().verified_prefix == 3
        for c, b in zip(new, before):
            assert np.array_equal(bits(c)[[0, 5, 6]], b[[3, 1, 12]])
        mgr.close()


@pytest.mark.parametrize("layers, shape", [(4, (64, 256)), (8, (16, 256)), (9, (4, 256))])
def test_each_group_waits_then_scatters_before_the_next_waits(layers, shape):
    """The load program's schedule: group g's wait, its rows read, its scatter, then
    group g + 1's wait; and no copy of the staging buffer anywhere, whatever the
    number of layers a group holds."""
    device = jax.devices()[0]
    rows, words = 4, shape[0] * shape[1]
    arrays = tuple(_sds((16, *shape), np.float32, device) for _ in range(layers))
    ids, _, count = _args_abstract(rows, device)
    groups = tuple(layer_groups(layers, words * 4))
    text = _programs.compiled("dma_load_side", arrays, _sds((1,), np.uint32, device),
                              _sds((rows + 1, layers * words), np.uint32, device), ids, count,
                              options=(groups, True, 4, words)).as_text()
    entry = text[text.index("ENTRY"):]
    order = []
    for line in entry.splitlines():
        if "custom-call(" in line and "callback" in line:
            order.append("wait")
        elif "wrapped_scatter" in line.split("=")[0]:
            order.append("scatter")
    assert order == [x for a, b in groups for x in ["wait"] + ["scatter"] * (b - a)]
    assert not re.search(r"copy\(\S*staging", entry)
    assert f"u32[{rows},{layers * words}]" not in "".join(
        line for line in entry.splitlines() if " copy(" in line)


@pytest.mark.cpu("2 devices (conftest.py's CPU devices)")
@pytest.mark.parametrize("stream", ["xla", "side"])
def test_a_sharded_class_moves_a_page_of_a_shard_in_one_copy(fake, monkeypatch, stream):
    """Pages are shard-major, so with the relayout a shard's part of a page is one
    copy: 3 pages x 4 layers of 1 KiB shard blocks are 3 copies per shard, not 12."""
    mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices()[:2])
    caches = [jax.device_put(c, NamedSharding(mesh, P(None, "tensor")))
              for c in testing.random_caches(4, 16, (4, 128), "bfloat16", seed=2)]
    before = [bits(c) for c in caches]
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma",
                                dma=kvxfer.DmaOptions(relayout="always", stream=stream,
                                                      self_check=False))
    assert mgr.plan.classes[0].num_shards == 2
    pages = mgr.offload(caches, [3, 1, 12], keys=[1, 2, 3]).wait()
    new, load = mgr.load(caches, pages, [0, 5, 6])
    assert load.result().verified_prefix == 3
    for c, b in zip(new, before):
        assert np.array_equal(bits(c)[[0, 5, 6]], b[[3, 1, 12]])
    assert [b["count"] for b in calls(fake, "batch")] == [3] * 4  # 2 shards, each way
    mgr.close()


def test_a_dropped_prefetch_gives_back_its_pins_and_released_ones_their_events(fake):
    """A handle neither loaded nor released is let go of by the manager's next call
    (its pins once its copies, which read their slots, have ended: then the pages can
    be freed and their slots reused); prefetches released over and over leave no
    driver event behind."""
    caches, before, mgr, pages = offloaded()
    for _ in range(5):
        mgr.prefetch(pages).release()
    mgr.prefetch(pages)  # dropped at once
    gc.collect()
    mgr.free(pages)
    assert mgr.num_free_pages < 8  # the staging's copies still read the pages' slots
    deadline = time.monotonic() + 10
    while (held() or mgr.num_free_pages < 8) and time.monotonic() < deadline:
        mgr.free(mgr.offload(caches, [0], keys=[99]).wait())  # every entry point reaps
        time.sleep(0.05)
    assert held() == 0 and mgr.num_free_pages == 8
    assert len(fake.events) <= 2, f"{len(fake.events)} events left"
    mgr.close()


def test_a_failure_after_copies_were_enqueued_keeps_their_memory_until_they_end():
    """A driver without the batch call: the second ``cuMemcpyAsync`` of a load's
    staging fails after the first was enqueued (late by 0.3 s), with no event after
    it yet: the load fails, and neither its staging nor anything else that copy
    reaches is let go of before it ends."""
    with testing.watch_releases() as watch, pytest.MonkeyPatch.context() as m:
        driver = FakeDriver(delay=0.3, watch=watch, version=12040)
        engine = HostStreamEngine(driver.driver(), ordinal=0)
        m.setitem(COPY_ENGINES, "cpu", lambda device, copy="batch": engine)
        caches = testing.random_caches(8, 16, (16, 256), "float32", seed=5)
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma", dma=NO_CHECK)
        mgr.warmup(4)  # no compile inside the load to outlast the late copy
        pages = mgr.offload(caches, [3, 1, 12, 9], keys=[1, 2, 3, 4]).wait()
        mgr.free(pages[1:2])  # slots 0, 2, 3: two copies, not one
        pages = pages[:1] + pages[2:]
        driver.fail_at = ("cuMemcpyAsync", 1)
        driver._counts.clear()
        new, load = mgr.load(caches, pages, [0, 5, 6])
        with pytest.raises(TransferError) as err:
            load.result()
        assert not any(c.is_deleted() for c in err.value.kv_caches)
        assert held() == 0
        for handle in list(driver.streams):
            driver._cuStreamSynchronize(handle)
        assert driver.late == []
        assert [k for k, _ in driver.calls if k == "copy"][-2:] == ["copy", "copy"]
        mgr.close()


def test_the_self_check_runs_once_and_a_broken_engine_fails_it(monkeypatch):
    """A good engine passes the self-check, once a process (a second manager adds no
    driver call); one whose stream waits wait for nothing fails it (a several-group
    load reads staging before its copies land): ``path="dma"`` raises naming it, and
    ``auto`` (made to prefer dma here) takes the pinned route, saying why."""
    from kvxfer.manager._select import AUTO_RULES

    driver = FakeDriver(delay=0.05)
    engine = HostStreamEngine(driver.driver(), ordinal=0)
    monkeypatch.setitem(COPY_ENGINES, "cpu", lambda device, copy="batch": engine)
    caches = testing.random_caches(2, 16, (64, 256), "float32")
    kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma").close()
    checked = sum(k == "batch" for k, _ in driver.calls)
    assert checked >= 6  # its round trips ran
    kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma").close()
    assert sum(k == "batch" for k, _ in driver.calls) == checked

    class WaitsForNothing(HostStreamEngine):  # another kind of engine: checked anew
        def hold(self, completion, stream, word):
            open_gate(completion, stream, word)

    broken = WaitsForNothing(FakeDriver(delay=0.3).driver(), ordinal=0)
    monkeypatch.setitem(COPY_ENGINES, "cpu", lambda device, copy="batch": broken)
    with pytest.raises(ValueError, match="self-check failed.*other bytes"):
        kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma")
    monkeypatch.setitem(AUTO_RULES, "cpu", ("dma", "pinned", "staged"))
    mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="auto")
    assert mgr.paths == ["pinned"] * 2 and "self-check failed" in mgr.paths[0].reason
    mgr.close()
    settle()  # the failed checks' staging goes once their late copies end


def settle(timeout: float = 10) -> None:
    """Waits until no staging is held in the process (kept staging is let go of as
    its copies end), so a later test's figures start from 0."""
    from kvxfer.engine.dma._staging import Staging

    deadline = time.monotonic() + timeout
    while held() and time.monotonic() < deadline:
        Staging.reap()
        time.sleep(0.05)
    assert held() == 0


def test_staging_that_finds_no_device_memory_falls_back_to_xlas_stream(fake, monkeypatch):
    """A staging program refused for memory (XLA's RESOURCE_EXHAUSTED) costs nothing
    but the route: the load copies on XLA's stream, exactly, and says so in
    ``stats()``."""
    from kvxfer.engine import _programs

    caches, before, mgr, pages = offloaded()
    run = _programs.run

    def no_memory(kind, *args, **kw):
        if kind == "dma_stage":
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory allocating the staging")
        return run(kind, *args, **kw)
    monkeypatch.setattr(_programs, "run", no_memory)
    new, load = mgr.load(caches, pages, [0, 5, 6])
    assert load.result().verified_prefix == 3
    for c, b in zip(new, before):
        assert np.array_equal(bits(c)[[0, 5, 6]], b[[3, 1, 12]])
    assert mgr.stats()["dma_fallbacks"] == {"budget": 0, "out_of_memory": 1}
    assert mgr.stats()["dma_staging_bytes"] == 0 and TICKETS.pending() == 0
    mgr.close()


@pytest.mark.cpu("4 devices (conftest.py's CPU devices)")
def test_staging_a_load_does_not_take_is_kept_until_its_copies_end(fake):
    """A prefetch consumed by a load that passes fewer pages (a wrong key) and one
    whose load moves only one of its classes both leave staging the load does not
    use: it is kept until its copies end, then let go, never dropped under them."""
    with testing.watch_releases() as watch:
        fake.watch = watch
        caches = [*testing.random_caches(2, 16, (64, 256), "float32", seed=1),
                  *testing.random_caches(2, 16, (32, 128), "bfloat16", seed=2)]
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=8, path="dma", dma=NO_CHECK)
        assert len(mgr.plan.classes) == 2
        pages = mgr.offload(caches, [3, 1, 12], keys=[1, 2, 3]).wait()
        handle = mgr.prefetch(pages)
        caches, load = mgr.load(caches, pages, [0, 5, 6], keys=[1, 99, 3], prefetched=handle)
        assert load.result().verified_prefix == 1
        handle = mgr.prefetch(pages)
        caches, load = mgr.load(caches, pages, {0: [0, 5, 6]}, prefetched=handle)
        assert load.result().verified_prefix == 3
        del handle
        gc.collect()
        deadline = time.monotonic() + 10
        while held() and time.monotonic() < deadline:
            mgr.free(mgr.offload(caches, [9], keys=[9]).wait())  # its calls reap
            time.sleep(0.05)
        assert held() == 0
        for handle_ in list(fake.streams):
            fake._cuStreamSynchronize(handle_)
        assert fake.late == []
        mgr.close()


def test_a_staging_that_fails_midway_fails_its_load_and_ends_every_event(fake):
    """The staging's second group of copies fails to enqueue: the load fails with its
    caches alive, and the first group's event is still waited for and destroyed."""
    caches, before, mgr, pages = offloaded()
    live = len(fake.events)
    fake.fail_at, fake._counts = ("cuMemcpyBatchAsync", 1), {}
    new, load = mgr.load(caches, pages, [0, 5, 6])
    with pytest.raises(TransferError, match="cuMemcpyBatchAsync") as err:
        load.result()
    assert not any(c.is_deleted() for c in err.value.kv_caches)
    assert len(fake.events) == live and held() == 0 and TICKETS.pending() == 0
    mgr.close()


def test_a_transfer_reports_its_first_failure_and_still_ends_every_completion():
    """Two shards' jobs failed: the first shard's error is the one reported, and the
    failed job's completions are ended all the same (their events destroyed)."""
    from kvxfer.engine.dma._jobs import CopyJob
    from kvxfer.engine.dma._staging import Transfer

    class Completion:
        ended = 0

        def end(self, block):
            Completion.ended += 1
            return True

    transfer = Transfer()
    for shard in range(2):
        job = CopyJob(COPY_ENGINES["cpu"](None), "offload")
        TICKETS.issue(jax.devices()[0], job)
        job.error, job.completions = RuntimeError(f"shard {shard} failed"), [Completion()]
        transfer.add(job, jax.numpy.zeros(1), None, shard)
    assert str(transfer.finish()) == "shard 0 failed" and Completion.ended == 2
    assert str(transfer.finish()) == "shard 0 failed" and Completion.ended == 2  # once
    assert TICKETS.pending() == 0
