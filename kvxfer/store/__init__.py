"""Store tiers below host memory: page blobs under keys, shared or persistent.

* ``DiskStore(path, capacity_bytes=None)``: one file per blob in a local directory,
  each visible only once whole; reopens after a restart with its blobs and their LRU
  order; several processes may share the directory. The embedded default.
* ``RedisStore(url, prefix="kvxfer:", capacity_bytes=None)``: a Redis or Valkey server
  shared by serving processes on several hosts (needs ``pip install 'kvxfer[redis]'``).
* ``RedisClusterStore(spec, prefix="kvxfer:", capacity_bytes=None, domains=16)``: a
  Redis Cluster, the store split into accounting domains over its nodes; a dead
  node's pages are misses.
* ``open_store(spec)``: any of them, from ``DIR``, ``file://DIR``,
  ``redis://HOST:PORT[/DB]`` or ``redis+cluster://HOST:PORT[,HOST:PORT...]``
  (``parse_spec(spec)`` checks one and says which, opening nothing).

Every store also takes batches: ``get_many(keys)``, ``put_many(items)`` and
``contains_many(keys)`` give, in order, what the single-key calls give, with one
round trip per Redis server (one pass over the files on disk). A key that cannot be
done (a server down) fails its batch with a ``StoreBatchError`` that still holds every
other key's result; a blob that fails its checks is a miss for its key only.

``cap_blob_bytes(n)`` (every store) makes a blob larger than ``n`` a miss, refused
before it is read where the store can (a cache sets it to its page size). A store
denies service only by misses, ``StoreError`` and counters in ``stats()``, never by
another library's exception: a server answering junk is a ``StoreError`` counted in
``bad_replies``, and its connection is never used again.

Example:
    >>> import tempfile
    >>> from kvxfer import store
    >>> with tempfile.TemporaryDirectory() as d, store.open_store("file://" + d) as s:
    ...     s.name, s.put("k", b"page"), s.get("k"), s.contains("nope")
    ...     s.put_many([("k", b"new"), ("j", b"jay")]), s.get_many(["j", "no", "k"])
    ('disk', True, b'page', False)
    ([False, True], [b'jay', None, b'page'])
"""

from kvxfer.store._base import Store as Store
from kvxfer.store._base import StoreBatchError as StoreBatchError
from kvxfer.store._base import StoreError as StoreError
from kvxfer.store._cluster import RedisClusterStore as RedisClusterStore
from kvxfer.store._disk import DiskStore as DiskStore
from kvxfer.store._open import SPEC_FORMS as SPEC_FORMS
from kvxfer.store._open import open_store as open_store
from kvxfer.store._open import parse_spec as parse_spec
from kvxfer.store._open import spec_argument as spec_argument
from kvxfer.store._redis import RedisStore as RedisStore
from kvxfer.store._seal import SealError as SealError
from kvxfer.store._seal import Sealer as Sealer

__all__ = ["Store", "StoreError", "StoreBatchError", "DiskStore", "RedisStore",
           "RedisClusterStore", "open_store", "parse_spec", "spec_argument", "SPEC_FORMS",
           "Sealer", "SealError"]
