"""A page that misses in kvxfer's host pool is recomputed by sglang-jax's radix cache.

Two halves. Without sglang-jax: the decision ``install()`` patches into the radix
cache (``load_back_verdict``), driven by what the real pool's ``flush_load`` returns
for a flush plan shaped as the engine builds one (a host bit flip, a transfer fault,
a load that raised). With sglang-jax importable (``sgl_jax`` on the path): the
engine's own ``UnifiedRadixCache``, ``HiCacheController``, device pool and allocator,
wired by its ``init_hicache`` after ``install()``, cut a load-back at the page that
missed. Those tests skip, saying so, where sglang-jax is not installed (kvxfer's CI).
"""

import contextlib
import importlib.util
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvxfer import testing
from kvxfer.integrations import sglang_jax
from kvxfer.integrations.sglang_jax import (
    FlushLoadResult,
    KvxferHostKVPool,
    load_back_verdict,
)

from test_integration_sglang import assert_page, device_pool, host_pool, snapshot

# -- the decision, with the real pool (no engine needed) ----------------------------------


def load_back(pool, plan):
    """What the patched init_load_back does with a plan: stage each entry, then flush."""
    for host, _ in plan:
        pool.stage_load(host)
    return [pool.flush_load(host, devices) for host, devices in plan]


@pytest.fixture
def backed_up():
    """Two tree nodes of two pages each, backed up: (device pool, host pool, plan)."""
    dev = device_pool(pages=12)
    pool = host_pool(dev, pool_size=4)
    ids = pool.alloc(4).tolist()
    pool.copy_into([1, 2, 3, 4], ids)
    plan = [(ids[:2], [6, 7]), (ids[2:], [8, 9])]  # (host pages, device pages) a node
    yield dev, pool, plan
    pool.close()


def test_a_host_bit_flip_cuts_the_load_back_at_the_page_that_missed(backed_up):
    dev, pool, plan = backed_up
    want = snapshot(dev, 3)
    bad = plan[1][0][1]
    testing.flip_bit(pool.manager, pool.page_of(bad), layer=1, seed=2)
    results = load_back(pool, plan)
    verdict = load_back_verdict(plan, results)
    assert (verdict.entries, verdict.pages, verdict.dropped) == (1, 1, {bad})
    assert not verdict.ok and verdict.kept_pages(plan) == 3
    assert_page(dev, 8, want)                   # the kept pages hold the node's bytes
    assert pool.page_of(bad) is None            # the bad host copy is gone


def test_a_transfer_fault_over_an_intact_copy_cuts_but_drops_nothing(backed_up):
    dev, pool, plan = backed_up
    testing.zero_dma(pool.manager, layer=0, block=7)   # the first node's second page
    verdict = load_back_verdict(plan, load_back(pool, plan))
    assert (verdict.entries, verdict.pages, verdict.dropped) == (0, 1, frozenset())
    assert verdict.kept_pages(plan) == 1
    assert all(pool.page_of(i) is not None for host, _ in plan for i in host)


def test_a_bad_page_after_the_first_miss_is_still_dropped(backed_up):
    _, pool, plan = backed_up
    first, later = plan[0][0][0], plan[1][0][1]
    for i in (first, later):
        testing.flip_bit(pool.manager, pool.page_of(i), layer=0, seed=i)
    verdict = load_back_verdict(plan, load_back(pool, plan))
    assert (verdict.entries, verdict.pages) == (0, 0)
    assert verdict.dropped == {first, later} and verdict.kept_pages(plan) == 0


def test_a_clean_load_back_keeps_everything_and_a_raised_entry_keeps_nothing(backed_up):
    _, pool, plan = backed_up
    results = load_back(pool, plan)
    assert load_back_verdict(plan, results).ok
    verdict = load_back_verdict(plan, [results[0], None])
    assert (verdict.entries, verdict.pages, verdict.kept_pages(plan)) == (1, 0, 2)


def test_the_verdict_refuses_results_that_are_not_the_plans():
    plan = [([0, 1], [5, 6])]
    other = FlushLoadResult((1, 0), (1, 0), (), (), {})
    with pytest.raises(ValueError, match=r"result 0 is for host ids \[1, 0\]"):
        load_back_verdict(plan, [other])
    with pytest.raises(ValueError, match="2 results for a flush plan of 1 entries"):
        load_back_verdict(plan, [other, other])


def test_install_without_sglang_jax_says_what_it_needs(monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] == "sgl_jax"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "sgl_jax", None)
    with pytest.raises(ImportError, match=r"install\(\) needs sglang-jax"):
        sglang_jax.install()
    assert not sglang_jax.installed()


def _engine_without(tmp_path, missing):
    """A package laid out like sglang-jax where ``install()`` looks, defining every
    name of ``ENGINE_NAMES`` except ``missing`` (an sglang-jax of another version)."""
    root = tmp_path / "engine"
    mem = root / "sgl_jax" / "srt" / "mem_cache"
    mem.mkdir(parents=True)
    for d in (root / "sgl_jax", root / "sgl_jax" / "srt", mem):
        (d / "__init__.py").write_text("")
    radix = [n.split(".")[1] for m, n in sglang_jax.ENGINE_NAMES if n.startswith("Unified")]
    methods = "".join(f"    def {n}(self, *a, **k): pass\n" for n in radix if n != missing)
    (mem / "unified_radix_cache.py").write_text(
        "class UnifiedRadixCache:\n" + (methods or "    pass\n"))
    (mem / "host_kv_pool.py").write_text("class LRUHostKVPool: pass\n")
    (mem / "unified_cache_components.py").write_text(
        "class EvictLayer:\n    DEVICE = 1\n")
    return root


def _run_beside(root, code: str) -> list[str]:
    """Runs ``code`` in a fresh process with the engine tree ``root`` first on the path;
    its two lines of output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get(
        "PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


@pytest.mark.parametrize("missing", ["init_load_back", "_split_node"])
def test_install_on_an_unchecked_engine_names_the_missing_name_and_changes_nothing(
        tmp_path, missing):
    root = _engine_without(tmp_path, missing)
    code = ("import sys; from kvxfer.integrations import sglang_jax\n"
            "from sgl_jax.srt.mem_cache import host_kv_pool, unified_radix_cache\n"
            "try:\n    sglang_jax.install()\n"
            "except sglang_jax.EngineMismatchError as e:\n    print(e)\n"
            "print(sglang_jax.installed(), host_kv_pool.LRUHostKVPool.__module__,\n"
            "      'kvxfer' in str(vars(unified_radix_cache.UnifiedRadixCache)))")
    message, state = _run_beside(root, code)
    assert f"UnifiedRadixCache.{missing}" in message
    assert sglang_jax.ENGINE_COMMIT in message and "Nothing was installed" in message
    assert state == "False sgl_jax.srt.mem_cache.host_kv_pool False"


@pytest.mark.parametrize("first_line, error, says", [
    # the engine's own module fails: named, with the commit kvxfer was checked against
    ("import types; types.NoSuchThing", "EngineMismatchError",
     ["importing sgl_jax.srt.mem_cache.unified_radix_cache raised AttributeError",
      sglang_jax.ENGINE_COMMIT]),
    # a package the engine imports is missing: named as that, not as another version
    ("import kvxfer_no_such_dependency", "ImportError",
     ["kvxfer_no_such_dependency", "not a version mismatch"])])
def test_install_on_an_engine_whose_module_fails_to_import_says_why(tmp_path, first_line,
                                                                    error, says):
    root = _engine_without(tmp_path, None)
    radix = root / "sgl_jax" / "srt" / "mem_cache" / "unified_radix_cache.py"
    radix.write_text(first_line + "\n" + radix.read_text())
    code = ("from kvxfer.integrations import sglang_jax\n"
            "try:\n    sglang_jax.install()\n"
            "except ImportError as e:\n    print(type(e).__name__, e)\n"
            "print(sglang_jax.installed())")
    message, state = _run_beside(root, code)
    assert message.startswith(error + " ") and state == "False", message
    assert all(s in message for s in says), message


def test_the_launcher_without_sglang_jax_says_so_on_one_line(tmp_path):
    if importlib.util.find_spec("sgl_jax") is not None:
        pytest.skip("sglang-jax is importable here: the launcher starts the engine")
    out = subprocess.run([sys.executable, "-m", "kvxfer.integrations.sglang_jax_launch",
                          "--model-path", "m"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "needs sglang-jax" in out.stderr


# -- inside sglang-jax (skipped where it is not installed) --------------------------------

PAGE = 2            # tokens a page
SEG = 2 * PAGE      # tokens a tree node of the tests


@pytest.fixture
def sgl_jax():
    """sglang-jax's radix cache module, or a skip saying it is not installed."""
    return pytest.importorskip(
        "sgl_jax.srt.mem_cache.unified_radix_cache",
        reason="sglang-jax (the sgl_jax package) is not installed: the engine-side "
               "tests of install() need it on the path")


@pytest.fixture
def engine(sgl_jax):
    """sglang-jax's radix cache with HiCache built by its own init_hicache, installed."""
    from sgl_jax.srt.mem_cache import kv_cache_builder
    from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sgl_jax.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sgl_jax.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sgl_jax.srt.utils.mesh_utils import create_device_mesh

    mesh = create_device_mesh(ici_parallelism=[1, -1], dcn_parallelism=[1, 1],
                              devices=jax.devices()[:1])
    sglang_jax.install()
    with contextlib.ExitStack() as stack:
        stack.callback(sglang_jax.uninstall)
        stack.enter_context(jax.set_mesh(mesh))
        kv = MHATokenToKVPool(size=64, page_size=PAGE, dtype=jnp.float32, head_num=4,
                              head_dim=8, layer_num=2, mesh=mesh, dp_size=1)
        alloc = PagedTokenToKVPoolAllocator(size=64, page_size=PAGE, kvcache=kv, dp_size=1)
        cache = UnifiedRadixCache(
            req_to_token_pool=ReqToTokenPool(size=8, max_context_len=128, dtype=np.int32),
            token_to_kv_pool_allocator=alloc, page_size=PAGE, kv_head_num=4, head_dim=8,
            layer_num=2, max_seq_len=128, dtype=jnp.float32)
        args = types.SimpleNamespace(hicache_ratio=0.5, hicache_write_through_threshold=1,
                                     hicache_write_policy="write_through")
        kv_cache_builder.init_hicache(cache, args, mesh, alloc)
        stack.callback(cache.host_pool.close)
        stack.callback(cache.hicache_controller.shutdown)
        yield types.SimpleNamespace(cache=cache, kv=kv, alloc=alloc)


def _key(tokens):
    from sgl_jax.srt.mem_cache.radix_cache import RadixKey
    return RadixKey(token_ids=list(tokens), extra_key=None, dp_rank=0)


def _fill(eng, n, seed):
    """n device token slots holding random KV; returns them and their bytes by layer."""
    idx = eng.alloc.alloc(n, dp_rank=0)
    for layer, buf in enumerate(eng.kv.kv_buffer):
        pages = np.asarray(idx)[::PAGE] // PAGE
        vals = jax.random.normal(jax.random.PRNGKey(seed * 10 + layer),
                                 (len(pages), *buf.shape[1:]), buf.dtype)
        eng.kv.kv_buffer[layer] = buf.at[pages].set(vals, out_sharding=buf.sharding)
    return np.asarray(idx), _tokens(eng, idx)


def _tokens(eng, idx):
    """The KV bytes of device token slots, by layer."""
    idx = np.asarray(idx)
    return [testing.bits(b)[idx // PAGE, idx % PAGE] for b in eng.kv.kv_buffer]


def _two_nodes_on_host(eng):
    """Tokens a (one node) and a + b (its child), backed up, then evicted from device."""
    from sgl_jax.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams

    cache = eng.cache
    tokens = list(range(100, 100 + 2 * SEG))
    idx, want = _fill(eng, 2 * SEG, seed=4)
    for _ in range(2):                          # the second insert is the reuse: backup
        cache.insert(InsertParams(key=_key(tokens[:SEG]), value=idx[:SEG]))
        cache.insert(InsertParams(key=_key(tokens), value=idx))
    cache.hicache_controller.drain_pending()
    cache.writing_check()
    assert not cache.ongoing_write
    cache.evict(EvictParams(num_tokens=2 * SEG, dp_rank=0))
    (a,) = cache.root_node.children.values()
    (b,) = a.children.values()
    assert a.evicted and a.backuped and b.evicted and b.backuped
    return tokens, want, a, b


def _match(eng, tokens):
    from sgl_jax.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    return eng.cache.match_prefix(MatchPrefixParams(key=_key(tokens)))


def test_the_engine_builds_kvxfers_pool_and_install_is_reversible(engine):
    from sgl_jax.srt.mem_cache import host_kv_pool
    from sgl_jax.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    assert type(engine.cache.host_pool) is KvxferHostKVPool
    patched = UnifiedRadixCache.init_load_back
    sglang_jax.install()                        # idempotent: nothing wrapped twice
    assert UnifiedRadixCache.init_load_back is patched and sglang_jax.installed()
    original = patched.__wrapped__
    sglang_jax.uninstall()
    assert UnifiedRadixCache.init_load_back is original
    assert host_kv_pool.LRUHostKVPool is not KvxferHostKVPool
    assert not sglang_jax.installed()
    sglang_jax.install()
    assert host_kv_pool.LRUHostKVPool is KvxferHostKVPool


def test_a_host_bit_flip_is_recomputed_not_attended(engine):
    cache, pool = engine.cache, engine.cache.host_pool
    tokens, want, a, b = _two_nodes_on_host(engine)
    bad = int(b.component_data[0].host_value[1])       # b's second page
    testing.flip_bit(pool.manager, pool.page_of(bad), layer=1, seed=3)
    mr = _match(engine, tokens)
    assert mr.host_hit_length == 2 * SEG and mr.last_host_node is b
    free_dev, free_host = engine.alloc.available_size(0), pool.available_size()

    new, last, plan = cache.init_load_back(mr.last_host_node, mr.host_hit_length,
                                           mem_quota=64)
    assert plan == [] and len(new) == SEG + PAGE        # a, and b's page that verified
    assert last.parent is a and len(last.key) == PAGE and not last.evicted
    got = _tokens(engine, new)
    for layer in range(2):
        assert np.array_equal(got[layer], want[layer][:SEG + PAGE])
    # b's bad page: its device slots are free again, its host copy gone, its node too.
    assert engine.alloc.available_size(0) == free_dev - (SEG + PAGE)
    assert pool.available_size() == free_host + 1 and not b.backuped
    assert list(last.children.values()) == []
    again = _match(engine, tokens)
    assert len(again.device_indices) == SEG + PAGE and again.host_hit_length == 0
    cache.finish_load_back(plan)                        # nothing left to scatter
    # The request prefills the rest, and its insert covers every token on device.
    from sgl_jax.srt.mem_cache.base_prefix_cache import InsertParams
    rest, _ = _fill(engine, PAGE, seed=9)
    cache.insert(InsertParams(key=_key(tokens), value=np.concatenate([new, rest])))
    assert len(_match(engine, tokens).device_indices) == 2 * SEG


def test_a_transfer_fault_keeps_the_host_copy_for_the_next_load(engine):
    cache, pool = engine.cache, engine.cache.host_pool
    tokens, want, a, b = _two_nodes_on_host(engine)
    mr = _match(engine, tokens)
    with testing.failing_transfer(pool.manager, after_layers=2):   # a's load passes
        new, last, plan = cache.init_load_back(mr.last_host_node, mr.host_hit_length,
                                               mem_quota=64)
    assert plan == [] and len(new) == SEG and last is a
    assert b.evicted and b.backuped                     # a tombstone with its host copy
    mr = _match(engine, tokens)
    assert len(mr.device_indices) == SEG and mr.host_hit_length == SEG
    new, last, plan = cache.init_load_back(mr.last_host_node, mr.host_hit_length,
                                           mem_quota=64)
    assert len(new) == SEG and last is b and plan == []
    got = _tokens(engine, new)
    for layer in range(2):
        assert np.array_equal(got[layer], want[layer][SEG:])


def test_without_install_the_engine_attends_the_flipped_page(engine):
    # What install() changes: the engine's own load-back claims every token.
    cache, pool = engine.cache, engine.cache.host_pool
    tokens, want, a, b = _two_nodes_on_host(engine)
    testing.flip_bit(pool.manager, pool.page_of(int(b.component_data[0].host_value[1])),
                     layer=1, seed=3)
    sglang_jax.uninstall()
    mr = _match(engine, tokens)
    new, last, plan = cache.init_load_back(mr.last_host_node, mr.host_hit_length,
                                           mem_quota=64)
    cache.finish_load_back(plan)
    assert len(new) == 2 * SEG and last is b and not b.evicted


def test_the_launcher_installs_in_the_processes_the_engine_spawns(sgl_jax):
    # spawn runs the launching module again as __mp_main__ in each child process: the
    # scheduler's process installs before it builds its HiCache. Importing does not.
    code = ("import runpy, sys; from kvxfer.integrations import sglang_jax as s; "
            "import kvxfer.integrations.sglang_jax_launch; assert not s.installed(); "
            "runpy.run_module('kvxfer.integrations.sglang_jax_launch', "
            "run_name='__mp_main__'); assert s.installed(); "
            "from sgl_jax.srt.mem_cache import host_kv_pool as h; "
            "assert h.LRUHostKVPool is s.KvxferHostKVPool")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
