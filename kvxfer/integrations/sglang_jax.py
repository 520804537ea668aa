"""sglang-jax HiCache: a host KV pool whose transfers kvxfer makes and verifies.

``KvxferHostKVPool`` is a drop-in for sglang-jax's ``LRUHostKVPool``
(``sgl_jax.srt.mem_cache.host_kv_pool``): the same constructor arguments and the
same calls (``alloc``/``free``, ``reserve``/``release``, ``inc_lock_ref``/
``dec_lock_ref``, ``stage_backup``/``flush_backup``, ``stage_load``/``flush_load``,
``copy_into``/``copy_to_device``, ``precompile_transfers``, ``available_size``/
``total_size``), with the same page-id boundary: every int crossing it is a page id,
device page ids are global over the data-parallel page axis. Underneath, a
``kvxfer.KVCacheManager`` over the device pool's ``kv_buffer`` moves the pages with
integrity on by default: the engine's host page ids are kvxfer slots
(``offload(..., slots=ids)``), ``stage_load`` stages with ``mgr.prefetch`` (no cache
touched, any thread) and ``flush_load`` runs ``mgr.load(..., prefetched=)`` on the
thread that owns the caches and waits for its verification.

Inside sglang-jax, ``install()`` (before the engine builds its HiCache) makes
``init_hicache`` build this pool and makes ``UnifiedRadixCache`` act on what it
verified: a page that misses cuts the matched prefix there, and the engine recomputes
the rest (``kvxfer/integrations/_sglang_radix.py``). ``uninstall()`` undoes it.

Checked against sglang-jax commit cddbf6f1cc33cbdd453bd8f36ff7051cf46ca176
(2026-08-21); on a sglang-jax without one of the names ``install()`` rebinds or calls
(``ENGINE_NAMES``) it raises ``EngineMismatchError`` naming it and that commit, and
changes nothing. Importing this module never imports sglang-jax (``install()`` does):
the pool reads only the device pool's ``kv_buffer`` (a list of per-layer arrays, page
axis first, reassigned element by element as the engine's own pool does) and, in
``precompile_transfers``, its ``size`` and the page size.

Example:
    >>> import types, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from kvxfer.integrations.sglang_jax import KvxferHostKVPool
    >>> dev = types.SimpleNamespace(kv_buffer=[jnp.ones((9, 1, 2, 1, 128))] * 2)
    >>> pool = KvxferHostKVPool(dev, 4, 1, 2, (1, 2, 1, 128), jnp.float32, None,
    ...                         P(None, None, None, None, None))
    >>> ids = [int(i) for i in pool.alloc(2)]
    >>> pool.copy_into([1, 2], ids)
    >>> pool.copy_to_device(ids, [5, 6]).verified_pages
    2
    >>> pool.close()
"""

from kvxfer.integrations._sglang_pool import KvxferHostKVPool as KvxferHostKVPool
from kvxfer.integrations._sglang_radix import ENGINE_NAMES as ENGINE_NAMES
from kvxfer.integrations._sglang_radix import EngineMismatchError as EngineMismatchError
from kvxfer.integrations._sglang_radix import LoadBackVerdict as LoadBackVerdict
from kvxfer.integrations._sglang_radix import install as install
from kvxfer.integrations._sglang_radix import installed as installed
from kvxfer.integrations._sglang_radix import load_back_verdict as load_back_verdict
from kvxfer.integrations._sglang_radix import uninstall as uninstall
from kvxfer.integrations._sglang_records import ENGINE_COMMIT as ENGINE_COMMIT
from kvxfer.integrations._sglang_records import FlushLoadResult as FlushLoadResult

__all__ = ["KvxferHostKVPool", "FlushLoadResult", "ENGINE_COMMIT", "ENGINE_NAMES",
           "EngineMismatchError", "install", "uninstall", "installed", "LoadBackVerdict",
           "load_back_verdict"]
