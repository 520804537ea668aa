"""kvxfer's counters for Prometheus, through ``prometheus_client`` (an optional extra).

``register(source)`` adds a collector that reads ``source.stats()`` (a
``KVCacheManager`` or a ``HostCache``) at every scrape: counters as
``<prefix>_<name>_total``, labelled counters with a ``reason`` or ``tier`` label,
pool and store sizes as gauges, and transfer times as a summary (count and sum) plus
``<prefix>_<name>_seconds_quantile{quantile=...}`` gauges (``load``, ``offload``).

Example (with ``pip install 'kvxfer[prometheus]'``)::

    import prometheus_client, kvxfer.metrics
    kvxfer.metrics.register(mgr)     # kvxfer_*
    kvxfer.metrics.register(cache)   # kvxfer_cache_*, its store as kvxfer_cache_store_tier_*
    prometheus_client.start_http_server(9400)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["register", "families"]

# stats() entries that are levels, not running totals.
_GAUGES = frozenset({"host_pages", "host_free_pages", "pinned_pages", "blobs", "bytes",
                     "capacity_bytes", "domains", "domains_unreachable"})
_LABELS = {"mismatches": "reason", "imports_refused": "reason", "bad_pages_by_tier": "tier"}


class _HasStats(Protocol):
    def stats(self) -> dict[str, Any]: ...


def _client():
    try:
        from prometheus_client import core
    except ImportError as e:
        raise ImportError("kvxfer.metrics needs prometheus_client: pip install "
                          "'kvxfer[prometheus]'") from e
    return core


def families(stats: dict[str, Any], prefix: str) -> Iterator[Any]:
    """The metric families of one ``stats()`` snapshot (nested dicts flattened)."""
    core = _client()
    for name, value in stats.items():
        full = f"{prefix}_{name}"
        if isinstance(value, dict) and "p50" in value:
            summary = core.SummaryMetricFamily(full, f"kvxfer {name}",
                                               count_value=value["count"],
                                               sum_value=value["sum"])
            yield summary
            q = core.GaugeMetricFamily(f"{full}_quantile",
                                       f"kvxfer {name} quantiles (recent transfers)",
                                       labels=["quantile"])
            for label, key in (("0.5", "p50"), ("0.9", "p90"), ("0.99", "p99")):
                q.add_metric([label], value[key])
            yield q
        elif isinstance(value, dict) and name in _LABELS:
            c = core.CounterMetricFamily(full, f"kvxfer {name}", labels=[_LABELS[name]])
            for label, n in value.items():
                c.add_metric([str(label)], n)
            yield c
        elif isinstance(value, dict):  # a nested source (a cache's store)
            yield from families(value, f"{full}_tier")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if name in _GAUGES:
                yield core.GaugeMetricFamily(full, f"kvxfer {name}", value=value)
            else:
                yield core.CounterMetricFamily(full, f"kvxfer {name}", value=value)


class _Collector:
    def __init__(self, source: _HasStats, prefix: str):
        self._source, self._prefix = source, prefix

    def collect(self) -> Iterator[Any]:
        yield from families(self._source.stats(), self._prefix)


def register(source: _HasStats, *, prefix: str | None = None, registry: Any = None) -> Any:
    """Exports ``source.stats()`` to Prometheus at every scrape.

    Args:
      source: a ``KVCacheManager`` or ``HostCache`` (anything with ``stats()``).
      prefix: metric name prefix, one per source (default ``kvxfer`` for a manager,
        ``kvxfer_cache`` for a ``HostCache``; a cache's store counters follow as
        ``<prefix>_store_tier_*``).
      registry: a ``prometheus_client.CollectorRegistry`` (default: the global one).

    Returns:
      The collector (``registry.unregister(collector)`` removes it).

    Raises:
      ImportError: prometheus_client is not installed.
    """
    if not callable(getattr(source, "stats", None)):
        raise TypeError(f"source must have a stats() method. Got {type(source).__name__}")
    if prefix is None:
        from kvxfer.cache import HostCache

        prefix = "kvxfer_cache" if isinstance(source, HostCache) else "kvxfer"
    if not isinstance(prefix, str) or not prefix.replace("_", "").isalnum():
        raise ValueError(f"prefix={prefix!r}: use letters, digits and underscores")
    core = _client()
    collector = _Collector(source, prefix)
    (registry if registry is not None else core.REGISTRY).register(collector)
    return collector
