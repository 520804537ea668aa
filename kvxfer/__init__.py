"""kvxfer: verified KV-cache transfers between accelerator and host memory for JAX.

The public surface (``__all__``); modules and subpackages hold the rest
(``kvxfer.testing`` for fault injection and cache builders, ``kvxfer.config`` and
``kvxfer.catalog`` for the shipped model configs and layout catalogues).

Example:
    >>> import kvxfer
    >>> kvxfer.inspect((512, 8, 2048), "bfloat16", "{2,1,0:T(8,128)(2,1)}").bytes_per_block
    32768
"""

from kvxfer import _lazy
from kvxfer._version import __version__ as __version__

_WHERE = {
    "kvxfer.cache": ["HostCache", "CacheHit", "CacheLoad"],
    "kvxfer.engine": ["TransferError", "DmaOptions"],
    "kvxfer.hostpool": ["PageRef", "PoolError", "PoolExhaustedError"],
    "kvxfer.layout": ["Layout", "LayoutError", "SliceGeometry", "inspect",
                      "require_addressable"],
    "kvxfer.manager": ["AgreementError", "IntegrityError", "KVCacheManager", "LoadHandle",
                       "LoadResult", "OffloadHandle", "PageFormatError"],
    "kvxfer.plan": ["BudgetError", "LayerSpec", "Plan", "make_plan"],
}
"""Where each public name lives; it is imported from there on first use, so
``import kvxfer`` (and the ``kvxfer`` command line) starts without JAX."""

__getattr__, __dir__ = _lazy.exports(__name__, _WHERE)

__all__ = ["__version__", "HostCache", "CacheHit", "CacheLoad", "TransferError", "PageRef",
           "PoolError", "PoolExhaustedError", "Layout", "LayoutError", "SliceGeometry",
           "inspect", "require_addressable", "IntegrityError", "KVCacheManager", "LoadHandle",
           "LoadResult", "OffloadHandle", "PageFormatError", "BudgetError", "LayerSpec", "Plan",
           "make_plan", "AgreementError", "DmaOptions"]
