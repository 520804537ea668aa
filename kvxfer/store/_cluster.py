"""``RedisClusterStore``: page blobs in a Redis Cluster, the fleet tier.

A Redis Cluster runs a script or a transaction only on keys of one hash slot, and the
single-server store's accounting (one LRU set, one byte counter) would put the whole
store in one slot, on one node. So the store is split into ``D`` accounting domains
(16 by default), domain ``d`` under the hash tag ``{P:d}``: its blobs ``{P:d}b:KEY``
and its ``{P:d}m:lru``, ``{P:d}m:sizes``, ``{P:d}m:bytes`` and ``{P:d}m:clock`` share
one slot, and the single-server store's scripts and transactions
(``kvxfer/store/_keyspace.py``) run per domain, unchanged. A batch sends each primary
the transactions of its domains in one write, to every primary at once, straight to
the node the client's slot map names (a slot that moved meanwhile, MOVED or ASK, sends
that domain's keys one by one through the client, which follows the redirection). A key's domain is
``crc32(key) % D``, the same in every client. The tag is decodable (the last ``:``
ends the prefix), so prefixes never share a domain, nested ones included.

What that keeps and what it gives up:

* put-if-absent has exactly one winner, and each domain's byte count is exact across
  every client, as on one server: the capacity is split evenly over the domains and
  each domain evicts to stay within its share, so the store never holds more than
  ``capacity_bytes``;
* LRU is exact within a domain and approximate across domains: a put evicts the least
  recently used blob of its own domain, which is not always the oldest of the store
  (with many pages per domain, and keys hashed evenly, the difference is small);
  a blob larger than a domain's share is refused (``ValueError``);
* the domains' slots spread over the cluster's primaries, unevenly with few domains
  (the 16 of prefix ``kvxfer:`` fall 7, 3 and 6 on three primaries of equal slot
  ranges); more domains spread more evenly, each with a smaller share.

When a primary dies (with no replica to fail over to), its domains are unreachable:
a ``get`` or ``contains`` of their keys is a miss (counted as ``read_errors``, and
logged once per outage of a domain), never an exception, while the other domains
keep serving; puts and deletes there raise ``StoreError``, which ``HostCache``
counts as a write error. A batch (``get_many``, ``contains_many``) gets misses for the
keys of a dead node's domains and every other key's blob; a ``put_many`` writes the
live domains' keys and raises a ``StoreBatchError`` naming the others (its
``results`` say what the written ones did). A domain that failed is not tried again for
``retry_down_s`` (1 s), so a page of a dead node costs a connection attempt once a
second, not one (and its retries) per page. The other primaries serve only with
``cluster-require-full-coverage no``; by default the whole cluster refuses while a
slot is uncovered, and every read is a miss. redis-py's cluster client refreshes its
slot map on each connection error, so a node restarted on its address, or a replica
promoted in its place, serves its domains again without reopening the store; a
domain whose node restarted without persistence comes back empty (its earlier pages
are misses, its accounting starts again from zero, still exact).
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from typing import Any

from kvxfer._check import check_int
from kvxfer.store._base import StoreError
from kvxfer.store._keyspace_store import KeyspaceStore
from kvxfer.store._redis import INSTALL_HINT, check_prefix, check_timeout_s

__all__ = ["RedisClusterStore", "CLUSTER_SCHEME", "check_cluster_spec"]

log = logging.getLogger("kvxfer")

#: The scheme of a cluster spec: ``redis+cluster://HOST:PORT[,HOST:PORT...]``.
CLUSTER_SCHEME = "redis+cluster"


def _split(spec: str) -> tuple[str | None, str | None, list[tuple[str, int]], str | None]:
    """Username, password, the (host, port) nodes of ``spec``, and why it is bad."""
    if not isinstance(spec, str):
        raise TypeError(f"Expected a Redis Cluster spec str. Got {spec!r} of type "
                        f"{type(spec).__name__}")
    scheme, sep, rest = spec.partition("://")
    if not sep or scheme != CLUSTER_SCHEME:
        return None, None, [], f"the scheme must be {CLUSTER_SCHEME}://"
    user = password = None
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        user, _, password = cred.partition(":")
        user, password = urllib.parse.unquote(user) or None, urllib.parse.unquote(password)
    rest = rest.rstrip("/")
    nodes = []
    for node in rest.split(","):
        host, colon, port = node.rpartition(":")
        host = host.strip("[]")  # [::1]:7000
        if not colon or not host:
            return user, password, [], f"node {node!r} is not HOST:PORT"
        if not port.isdigit() or not 0 < int(port) < 65536:
            return user, password, [], f"node {node!r}: the port is not a number in 1..65535"
        nodes.append((host, int(port)))
    return user, password, nodes, None


def _redact(spec: str) -> str:
    scheme, sep, rest = spec.partition("://")
    if "@" not in rest:
        return spec
    cred, host = rest.rsplit("@", 1)
    user = cred.partition(":")[0]
    return f"{scheme}{sep}{user}:***@{host}"


def check_cluster_spec(spec: str) -> str:
    """``spec`` if it names a Redis Cluster by some of its nodes
    (``redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]``).

    Raises:
      ValueError: another scheme, a node without a host or with a bad port.

    Example:
        >>> check_cluster_spec("redis+cluster://10.0.0.5:7000,10.0.0.6:7000")
        'redis+cluster://10.0.0.5:7000,10.0.0.6:7000'
        >>> try:
        ...     check_cluster_spec("redis+cluster://10.0.0.5")
        ... except ValueError as e:
        ...     print(str(e).split(". Got ")[1])
        'redis+cluster://10.0.0.5': node '10.0.0.5' is not HOST:PORT
    """
    why = _split(spec)[3]
    if why:
        raise ValueError(f"Expected a Redis Cluster spec {CLUSTER_SCHEME}://HOST:PORT"
                         f"[,HOST:PORT...]. Got {_redact(spec)!r}: {why}")
    return spec


class RedisClusterStore(KeyspaceStore):
    """Page blobs in a Redis Cluster, split over accounting domains (see the module).

    Args:
      spec: some of the cluster's nodes, ``redis+cluster://HOST:PORT[,HOST:PORT...]``
        (the rest are discovered); a password may be given as ``USER:PASSWORD@``
        before the first node.
      prefix: the namespace of this store's keys (stores with different prefixes
        share nothing, nested ones too); no braces.
      capacity_bytes: the most blob bytes the store holds in all, split evenly over
        the domains, each kept exactly across every client with LRU eviction; None
        leaves eviction to the servers' ``maxmemory-policy``.
      domains: how many accounting domains; every client of a prefix must use the
        same number.
      timeout_s: socket timeout for connecting and for each command.
      retry_down_s: how long a domain whose node failed is not tried again: its reads
        are misses and its writes ``StoreError`` at once meanwhile.

    Raises:
      ImportError: redis-py is not installed (``pip install 'kvxfer[redis]'``).
      StoreError: no node of ``spec`` answers (naming the spec, password hidden).

    Example (with a cluster with a node at ``127.0.0.1:7000``)::

        store = RedisClusterStore("redis+cluster://127.0.0.1:7000", capacity_bytes=8 << 30)
        store.put("geo/page-1", blob)    # True: this process's put won
        store.get("geo/page-1")          # the blob, from any host; None if its node is down
    """

    name = "redis-cluster"
    _COUNTERS = KeyspaceStore._COUNTERS + ("read_errors",)

    def __init__(self, spec: str, prefix: str = "kvxfer:", capacity_bytes: int | None = None,
                 *, domains: int = 16, timeout_s: float = 30.0, retry_down_s: float = 1.0):
        self.spec = check_cluster_spec(spec)
        try:
            import redis
            from redis.backoff import ExponentialBackoff
            from redis.cluster import ClusterNode, RedisCluster
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError(f"RedisClusterStore needs the redis package: "
                              f"{INSTALL_HINT}") from e
        self.prefix = check_prefix(prefix)
        self.domains = check_int(domains, "domains", minimum=1)
        self.capacity_bytes = None if capacity_bytes is None else \
            check_int(capacity_bytes, "capacity_bytes", minimum=1)
        if self.capacity_bytes is not None and self.capacity_bytes < self.domains:
            raise ValueError(f"capacity_bytes={self.capacity_bytes} must be at least "
                             f"domains={self.domains} (each domain holds its share)")
        check_timeout_s(timeout_s)
        if isinstance(retry_down_s, bool) or not isinstance(retry_down_s, (int, float)) \
                or not 0 <= retry_down_s < float("inf"):
            raise ValueError(f"retry_down_s={retry_down_s!r} must be a number of seconds >= 0")
        self.retry_down_s = float(retry_down_s)
        user, password, nodes, _ = _split(spec)
        where = f"redis cluster store at {_redact(spec)}"
        # RedisClusterException (no node reachable, a slot not covered) is no RedisError.
        x = redis.exceptions
        errors = (x.RedisError, x.RedisClusterException, OSError)
        # What a node down (or a slot without a node) looks like; any other error (a
        # server out of memory, say) is a StoreError even on a read.
        self._outages = (x.ConnectionError, x.TimeoutError, x.ClusterDownError,
                         x.TryAgainError, x.RedisClusterException, OSError)
        try:
            # require_full_coverage=False: a slot map with a node missing still serves
            # the domains of the others. A short retry: redis-py's default backs off
            # for seconds per command, and a read of a dead node should be a quick miss
            # (a refreshed slot map, a promoted replica, is found on the first retry).
            client = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in nodes], username=user,
                password=password, socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s, require_full_coverage=False,
                retry=Retry(ExponentialBackoff(cap=0.1, base=0.02), 2))
        except Exception as e:  # (a node that answers junk, too)
            raise StoreError(f"{where}: cannot connect: {e}") from e
        # A slot that moved (MOVED, ASK): the batch's keys of that domain go one by one
        # through the client, which follows the redirection and refreshes its slot map.
        self._redirects = (x.AskError,)  # (MovedError is an AskError)
        #: Domains that failed: when each is tried again (``time.monotonic()``).
        self._down: dict[int, float] = {}
        self._setup(client, [f"{{{prefix}:{d}}}" for d in range(self.domains)],
                    self.capacity_bytes, errors, where)

    def __repr__(self) -> str:
        return (f"RedisClusterStore({_redact(self.spec)!r}, prefix={self.prefix!r}, "
                f"capacity_bytes={self.capacity_bytes!r}, domains={self.domains})")

    def _node(self, domain: int) -> str:
        try:
            return self._client.get_node_from_key(self._spaces[domain].root).name
        except Exception:  # the slot map itself may be what is missing
            return "unknown"

    def _mark_down(self, domain: int, what: str, e: BaseException) -> None:
        with self._lock:
            first = domain not in self._down
            self._down[domain] = time.monotonic() + self.retry_down_s
        if first:
            log.warning("%s: %s: domain %d (node %s) is unreachable, its pages are misses "
                        "until it returns: %s", self._where, what, domain,
                        self._node(domain), e)

    def _unreachable(self, domain: int, what: str, e: BaseException, n: int = 1) -> None:
        """A read of ``n`` keys of a dead domain: counted, logged once per outage,
        misses."""
        if not isinstance(e, self._outages):
            raise self._fail(what, e) from e
        self._count(read_errors=n)
        self._mark_down(domain, what, e)

    def _lost(self, e: BaseException) -> None:
        """A batch lost a node: the slot map is read again (as the client does when
        one of its own commands loses a node), so a replica promoted in its place is
        found."""
        try:
            self._client.nodes_manager.initialize()
        except Exception:  # no node answers: the next command tries again
            pass

    def _route(self, domain: int) -> tuple[str, Any]:
        """The primary that holds ``domain``'s slot now (from the client's slot map),
        and its client."""
        node = self._client.get_node_from_key(self._spaces[domain].root)
        return node.name, self._client.get_redis_connection(node)

    def _unwritable(self, domain: int, what: str, e: BaseException) -> StoreError:
        if isinstance(e, self._outages):
            self._mark_down(domain, what, e)
        return self._fail(what, e)

    def _held(self, domain: int) -> bool:
        until = self._down.get(domain)
        return until is not None and time.monotonic() < until

    def _reached(self, domain: int) -> None:
        if domain in self._down:
            with self._lock:
                back = self._down.pop(domain, None) is not None
            if back:
                log.info("%s: domain %d (node %s) is reachable again", self._where,
                         domain, self._node(domain))

    def _refuse(self, domain: int, what: str) -> StoreError:
        return StoreError(f"{self._where}: {what}: domain {domain} (node "
                          f"{self._node(domain)}) is down; it is tried again "
                          f"{self.retry_down_s} s after its last failure")

    def domain_of(self, key: str) -> int:
        """The domain ``key`` belongs to (``crc32(key) % domains``)."""
        return self._domain(key)

    def domain_root(self, domain: int) -> str:
        """The hash tag of ``domain``'s keys (``{P:d}``): its blobs are ``{P:d}b:KEY``."""
        return self._spaces[domain].root

    def domain_nodes(self) -> dict[int, str]:
        """Which node (``HOST:PORT``) holds each domain now, from the client's slot map."""
        self._check_open()
        return {d: self._node(d) for d in range(self.domains)}

    def stats(self) -> dict[str, Any]:
        """Counters (see ``Store.stats``): ``blobs`` and ``bytes`` of the whole shared
        store (of its reachable domains, with ``domains_unreachable`` saying how many
        were not); ``puts``, ``gets``, ``hits``, ``evictions`` and ``read_errors`` of
        this client."""
        self._check_open()
        blobs, used, down = self._usage()
        with self._lock:
            counts = dict(self._counts)
        return {"name": self.name, "url": _redact(self.spec), "prefix": self.prefix,
                "domains": self.domains, "domains_unreachable": down,
                "blobs": blobs, "bytes": used, "capacity_bytes": self.capacity_bytes,
                **counts}
