"""Tests for the serving demo (kvxfer.demo): a host-tier prefix cache on kvxfer.

Every run compares each request's tokens with a run of the same requests with no
cache at all; the runs are small (two short system prompts, few device blocks) so
that device blocks run short, pages go to host, and later requests hit from host.
"""

from __future__ import annotations

import argparse
import functools
import json

import pytest

import kvxfer.testing
from kvxfer import demo
from kvxfer.hostpool import PoolExhaustedError

# Prompts of 3 and 4 pages and at most 6 device blocks: every request evicts the
# other prompt's pages to host, so the third request on is a host hit.
SMALL = dict(requests=5, system_pages=(3, 4), new_tokens=4, device_blocks=6, host_blocks=16,
             progress=False)

SUMMARY_KEYS = {"requests", "device_hits", "host_hits", "bytes_offloaded", "bytes_loaded",
                "pages_verified", "corruptions_detected", "pages_recomputed", "ttft_miss_ms",
                "ttft_host_hit_ms", "tokens_match", "integrity", "inject", "time_s"}


def run(**kw) -> dict:
    return _run(tuple(sorted(kw.items())))


@functools.cache
def _run(kw: tuple) -> dict:
    # Runs are deterministic but for their timings: tests that ask for the same
    # options share one run (and must not change its summary).
    return demo.run_demo(demo.DemoOptions(**{**SMALL, **dict(kw)}))


# -- keys and indexes ------------------------------------------------------------------


def test_page_keys_chain_the_whole_prefix():
    a = list(range(50))
    keys = demo.page_keys(a)
    assert len(keys) == 3 and all(0 <= k < 1 << 64 for k in keys)
    # Same pages, another partial tail: same keys. A change in page 0 changes every key.
    assert demo.page_keys(a[:48] + [1, 2, 3]) == keys
    b = [7] + a[1:]
    assert all(x != y for x, y in zip(demo.page_keys(b), keys))
    # Page 1 alone (no prefix) is not page 1 of the chain.
    assert demo.page_keys(a[16:32])[0] != keys[1]


def test_device_blocks_refcounts_lru_and_eviction():
    blocks = demo.DeviceBlocks(4)
    b0, b1, b2 = blocks.allocate(3)
    assert blocks.publish(10, b0) and blocks.publish(11, b1)
    assert not blocks.publish(10, b2)  # duplicate key: b2 stays private
    blocks.acquire(b0)  # a second request shares page 10
    for b in (b2, b1, b0):
        blocks.release(b)
    assert blocks.num_free == 2 and blocks.num_cold == 1  # b0 still held once
    blocks.release(b0)
    assert blocks.cold_pages() == [(b1, 11), (b0, 10)]
    assert blocks.evict(1) == [(b1, 11)] and blocks.lookup(11) is None
    blocks.reclaim([b1])
    assert blocks.num_free == 3
    with pytest.raises(MemoryError, match="5 device blocks requested, 3 free"):
        blocks.allocate(5)
    with pytest.raises(ValueError, match="no reference held"):
        blocks.release(b1)


# -- serving runs ------------------------------------------------------------------------


def test_run_offloads_hits_from_host_and_matches_no_cache():
    s = run()
    assert SUMMARY_KEYS <= set(s)
    assert s["tokens_match"] is True and s["mismatched_requests"] == []
    assert s["host_hits"] > 0 and s["bytes_loaded"] > 0 and s["bytes_offloaded"] > 0
    assert s["pages_verified"] == s["host_hits"]
    assert s["corruptions_detected"] == 0 and s["pages_recomputed"] == 0
    assert s["ttft_miss_ms"] is not None and s["ttft_host_hit_ms"] is not None
    json.dumps(s)  # the --json object is plain JSON


@pytest.mark.parametrize("inject, extra", [
    ("bitflip", {}),
    ("wrong-key", {}),
    ("stale-slot", {}),
    ("one-shard", {"devices": 2}),
])
def test_injected_faults_are_detected_and_recovered(inject, extra):
    s = run(inject=inject, **extra)
    assert s["corruptions_detected"] > 0, s["injections"]
    assert s["pages_recomputed"] > 0
    assert s["tokens_match"] is True, s["mismatched_requests"]
    assert len(s["injections"]) == 2
    expect = {"bitflip": "digest mismatch in layer", "wrong-key": "wrong key",
              "stale-slot": "stale generation", "one-shard": "shard disagreement"}[inject]
    assert all(expect in d for d in s["detections"]), s["detections"]
    if inject == "wrong-key":  # the words of kvxfer.testing's wrong-key fault
        assert all(t.startswith("wrong-key: the caller asks for key 0x") and
                   "and is handed the page stored under key 0x" in t
                   for t in s["injections"]), s["injections"]


def test_late_bitflip_restarts_from_the_verified_prefix():
    # The second bit flip hits the last layer: layers before it were released with
    # the full prefix and consumed, so the request must restart.
    s = run(inject="bitflip")
    assert s["restarts"] == 1 and s["requests_by_kind"]["recovered"] == 2


def test_one_shard_forces_two_devices_and_mixed_layers_shard():
    # Mixed model: layers with 1 KV head are replicated, the others split over 2
    # devices; the corruption lands on one shard of a split layer.
    s = run(model="mixed", inject="one-shard", devices=1)
    assert s["devices"] == 2 and s["slice_classes"] == 2
    assert s["corruptions_detected"] > 0 and s["tokens_match"] is True


def test_integrity_off_still_matches_without_faults():
    s = run(integrity="off")
    assert s["tokens_match"] is True and s["host_hits"] > 0
    assert s["pages_verified"] == 0


def test_integrity_off_lets_a_bitflip_through_and_exits_1(capsys):
    parser = argparse.ArgumentParser(prog="kvxfer")
    demo.register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo", "--requests", "5", "--system-pages", "3", "4",
                              "--new-tokens", "4", "--device-blocks", "6", "--host-blocks",
                              "16", "--integrity", "off", "--inject", "bitflip", "--json",
                              "--quiet"])
    assert args.func(args) == 1
    s = json.loads(capsys.readouterr().out)
    assert s["corruptions_detected"] == 0 and s["tokens_match"] is False


def test_cli_json_is_one_object_and_exits_0(capsys):
    parser = argparse.ArgumentParser(prog="kvxfer")
    demo.register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo", "--requests", "4", "--system-pages", "3", "4",
                              "--new-tokens", "4", "--device-blocks", "6", "--json", "--quiet"])
    assert args.func(args) == 0
    s = json.loads(capsys.readouterr().out)
    assert SUMMARY_KEYS <= set(s) and s["requests"] == 4 and s["tokens_match"] is True


def test_human_summary_names_every_metric():
    text = demo.format_summary(run())
    for key in ("device_hits", "host_hits", "bytes_offloaded", "bytes_loaded",
                "corruptions_detected", "pages_recomputed", "ttft_miss_ms",
                "ttft_host_hit_ms", "tokens_match", "integrity=page", "inject=none"):
        assert key in text


def test_summary_ends_with_host_hit_ttft_against_misses_and_tokens_match():
    s = run()
    kinds = s["requests_by_kind"]
    assert s["ttft_host_hit_speedup"] == round(s["ttft_miss_ms"] / s["ttft_host_hit_ms"], 2)
    ttft, tokens, _ = demo.format_summary(s).splitlines()[-3:]
    assert ttft.startswith(f"time to first token: host hits {s['ttft_host_hit_ms']:.2f} ms "
                           f"against {s['ttft_miss_ms']:.2f} ms for misses (medians of "
                           f"{kinds['host_hit']} and {kinds['miss']} requests): host hits "
                           f"{s['ttft_host_hit_speedup']:.1f}x")
    assert tokens == "tokens: identical to a run with no cache in all 5 requests"


def test_summary_says_loudly_when_tokens_differ():
    s = dict(run(), tokens_match=False, mismatched_requests=[2, 4], integrity="off")
    last = demo.format_summary(s).splitlines()[-2]
    assert last == ("tokens: DIFFER FROM A RUN WITH NO CACHE in 2 of 5 requests [2, 4] "
                    "(integrity=off: damaged host pages were used unverified)")


def test_summary_without_host_hits_says_there_is_no_comparison():
    s = dict(run(), ttft_host_hit_ms=None, ttft_host_hit_speedup=None)
    assert demo.format_summary(s).splitlines()[-3].startswith(
        "time to first token: no comparison")


def test_inject_suggestion_only_without_injection():
    s = run(inject="bitflip")
    plain, injected = demo.format_summary(run()), demo.format_summary(s)
    assert plain.splitlines()[-1].startswith("next: kvxfer demo --inject bitflip ")
    assert "--inject" not in injected
    faults, ttft, tokens = injected.splitlines()[-3:]
    assert (s["corruptions_detected"], s["restarts"]) == (2, 1)
    assert faults == (f"faults: 2 bitflip injected, 2 detected, {s['pages_recomputed']} pages "
                      "recomputed, restarts 1")
    # Both host hits were damaged: the line says why there is nothing to compare.
    assert ttft == ("time to first token: no comparison, the run had 0 host hits and 2 "
                    "misses (2 hits recovered from damaged cached pages)")
    assert tokens.startswith("tokens: identical to a run with no cache")


@pytest.mark.parametrize("kw, match", [
    (dict(device_blocks=3), "--device-blocks 3 is too few: a request needs up to 6 blocks"),
    (dict(inject="flood"), "inject='flood'; expected one of bitflip"),
    (dict(requests=0), "requests=0 must be >= 1"),
    (dict(inject="one-shard", devices=4), "needs a layer whose KV heads split over 4 devices"),
])
def test_bad_options_name_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        run(**kw)


# -- a store that cannot be used fails the run before any work -----------------------------


def _unusable_store(kind, tmp_path):
    """A store spec that cannot be opened: a Redis port nothing listens on, or a
    directory under a regular file."""
    if kind == "redis":
        import redis_rig

        redis_rig.require()
        return f"redis://127.0.0.1:{redis_rig.free_port()}", "redis store at redis://127.0.0.1:"
    (tmp_path / "file").write_text("not a directory")
    where = str(tmp_path / "file" / "store")
    return where, f"disk store {where!r}: cannot open"


@pytest.mark.parametrize("entry", ["kvxfer", "python -m kvxfer.demo"])
@pytest.mark.parametrize("kind", ["redis", "disk"])
def test_an_unusable_store_fails_before_any_work_with_one_line(tmp_path, monkeypatch, capsys,
                                                               kind, entry):
    from kvxfer import cli
    from kvxfer.demo import command

    spec, names = _unusable_store(kind, tmp_path)
    started = []
    monkeypatch.setattr(command, "reference_tokens", lambda *a: started.append(a))
    monkeypatch.setattr(command, "make_workload", lambda *a, **kw: started.append(a))
    argv = ["--store", spec, "--requests", "4"]
    status = cli.main(["demo", *argv]) if entry == "kvxfer" else demo.main(argv)
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and started == []
    (line,) = err.splitlines()
    assert line.startswith("kvxfer demo: error: --store: " + names), line


# -- a prefix split across tiers -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    from kvxfer.demo import model as m

    return m.Model(m.tiny_llama(), seed=0)


def _host_then_device(srv: demo.PrefixCacheServer, prompt: tuple[int, ...]) -> None:
    """Serves ``prompt`` once, then moves only its page 0 to host (pages 1, 2 stay)."""
    srv.serve(demo.Request(0, prompt, 4))
    cold = srv.blocks.cold_pages()  # deepest page first
    assert len(cold) == 3
    for block, _ in cold[:2]:
        srv.blocks.acquire(block)  # keep pages 2 and 1 on device
    taken = srv.allocate_blocks(srv.blocks.num_free + 1)  # evicts page 0 to host
    assert len(srv.cache) == 1
    for block in taken + [b for b, _ in cold[:2]]:
        srv.blocks.release(block)


@pytest.mark.parametrize("inject", [None, "bitflip"])
def test_prefix_with_host_page_before_device_pages(tiny_model, inject):
    system = tuple(range(1, 49))  # 3 full pages
    first, second = system + (7, 8, 9), system + (5,)
    injector = demo.FaultInjector(inject, limit=1) if inject else None
    with demo.PrefixCacheServer(tiny_model, tiny_model.make_kv_caches(10), num_host_blocks=4,
                                injector=injector) as srv:
        _host_then_device(srv, first)
        out = srv.serve(demo.Request(1, second, 4))
        # All three pages end up cached on device again (page 0 promoted or recomputed).
        assert all(srv.blocks.lookup(k) is not None for k in demo.page_keys(system))
    _, want = tiny_model.generate(tiny_model.make_kv_caches(10), second, list(range(4)), 4)
    assert list(out.tokens) == want
    if inject:
        # Page 0 failed: nothing of the hit is usable, all three pages are recomputed
        # (into private blocks: the device copies of pages 1 and 2 stay cached).
        assert (out.kind, out.host_pages, out.device_pages, out.recomputed_pages) == \
            ("recovered", 0, 0, 3)
        assert srv.stats.corruptions_detected == 1
    else:
        assert (out.kind, out.host_pages, out.device_pages) == ("host_hit", 1, 2)


def test_a_transfer_failure_is_an_error_and_leaks_nothing(tiny_model, monkeypatch):
    from kvxfer import TransferError

    system = tuple(range(1, 49))
    with demo.PrefixCacheServer(tiny_model, tiny_model.make_kv_caches(10),
                                num_host_blocks=4) as srv:
        _host_then_device(srv, system + (7,))
        real_load = srv.mgr.load

        def failing_load(*args, **kwargs):
            caches, handle = real_load(*args, **kwargs)
            handle.result()  # let the real copies finish first

            def broken(i, timeout=None):
                raise TransferError(f"device lost before layer {i}")
            monkeypatch.setattr(handle, "layer_ready", broken)
            return caches, handle

        monkeypatch.setattr(srv.mgr, "load", failing_load)
        with pytest.raises(TransferError, match="device lost before layer 0"):
            srv.serve(demo.Request(1, system + (5,), 4))
        # Every block is free or cached-and-unreferenced again, nothing was published,
        # and the host page is evictable again.
        assert srv.blocks.num_free + srv.blocks.num_cold == srv.blocks.num_blocks
        assert srv.stats.requests == 1 and len(srv.cache) == 1
        assert srv.cache.stats()["pinned_pages"] == 0
        monkeypatch.setattr(srv.mgr, "load", real_load)
        out = srv.serve(demo.Request(2, system + (5,), 4))
    _, want = tiny_model.generate(tiny_model.make_kv_caches(10), system + (5,),
                                  list(range(4)), 4)
    assert out.kind == "host_hit" and list(out.tokens) == want


# -- the stale-slot injector ----------------------------------------------------------------


def _three_pages_on_host(srv: demo.PrefixCacheServer, prompt: tuple[int, ...]) -> list[int]:
    """Serves ``prompt`` (3 full pages), then evicts all its pages to host; their keys."""
    srv.serve(demo.Request(0, prompt, 4))
    keys = [k for _, k in srv.blocks.cold_pages()]
    assert len(keys) == 3
    for block in srv.allocate_blocks(srv.blocks.num_free + len(keys)):
        srv.blocks.release(block)
    assert sorted(srv.cache.keys()) == sorted(keys)
    return demo.page_keys(prompt)


def _stale_slot_server(model) -> tuple[demo.FaultInjector, demo.PrefixCacheServer]:
    injector = demo.FaultInjector("stale-slot", limit=1)
    return injector, demo.PrefixCacheServer(model, model.make_kv_caches(10), num_host_blocks=6,
                                            injector=injector)


def test_stale_slot_reuses_the_slot_even_when_a_lower_slot_is_free(tiny_model):
    system = tuple(range(1, 49))
    injector, srv = _stale_slot_server(tiny_model)
    with srv:
        k0, k1, k2 = _three_pages_on_host(srv, system + (7, 8, 9))
        # Free the deepest page's slot, below page 1's: the pool hands out its lowest
        # free slot, so page 1's slot comes back only after that one is taken.
        low = srv.cache.page_of(k2)
        assert low.slot < srv.cache.page_of(k1).slot
        srv.mgr.free([low])
        out = srv.serve(demo.Request(1, system + (5,), 4))  # hits pages 0, 1 from host
        (inj,) = injector.injections
        stale, new = inj.page, inj.reused_by
        assert stale.key == k1 and new is not None
        assert str(inj) == (f"stale-slot: {stale} freed while the hit still holds it; "
                            f"its slot {stale.slot} reused by {new}")
        # What the log says happened did: the slot holds a newer generation, the load
        # saw the stale ref, and the lower slot is free again.
        assert new.slot == stale.slot and new.generation > stale.generation
        assert srv.mgr.host_pool.state(stale.slot)[0] == new.generation
        assert srv.stats.detection_reasons == [f"stale generation ({stale})"]
        assert srv.mgr.host_pool.state(low.slot)[1] == "free"
    assert (out.kind, out.host_pages, out.recomputed_pages) == ("recovered", 1, 1)
    _, want = tiny_model.generate(tiny_model.make_kv_caches(10), system + (5,), list(range(4)), 4)
    assert list(out.tokens) == want


def test_stale_slot_log_says_when_the_slot_was_not_reused(tiny_model, monkeypatch):
    def never_reused(mgr, caches, page, block, key):
        mgr.free([page])
        raise PoolExhaustedError("host pool exhausted")

    monkeypatch.setattr(kvxfer.testing, "reuse_slot", never_reused)
    system = tuple(range(1, 49))
    injector, srv = _stale_slot_server(tiny_model)
    with srv:
        _three_pages_on_host(srv, system + (7, 8, 9))
        out = srv.serve(demo.Request(1, system + (5,), 4))
        (inj,) = injector.injections
        assert inj.reused_by is None
        assert str(inj) == (f"stale-slot: {inj.page} freed while the hit still holds "
                            f"it; its slot {inj.page.slot} was not reused")
        assert srv.mgr.host_pool.state(inj.page.slot)[:2] == (inj.page.generation, "free")
        assert srv.stats.detection_reasons == [f"freed ({inj.page})"]
    assert out.kind == "recovered"
