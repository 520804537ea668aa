"""kvxfer: verified KV-cache transfers between accelerator and host memory for JAX.

The public surface, one name a line; modules and subpackages hold the rest
(``kvxfer.testing`` for fault injection and cache builders, ``kvxfer.config`` and
``kvxfer.catalog`` for the shipped model configs and layout catalogues).

Example:
    >>> import kvxfer
    >>> kvxfer.inspect((512, 8, 2048), "bfloat16", "{2,1,0:T(8,128)(2,1)}").bytes_per_block
    32768
"""

from kvxfer._version import __version__ as __version__
from kvxfer.cache import CacheHit as CacheHit
from kvxfer.cache import CacheLoad as CacheLoad
from kvxfer.cache import HostCache as HostCache
from kvxfer.engine import TransferError as TransferError
from kvxfer.hostpool import PageRef as PageRef
from kvxfer.hostpool import PoolError as PoolError
from kvxfer.hostpool import PoolExhaustedError as PoolExhaustedError
from kvxfer.layout import Layout as Layout
from kvxfer.layout import LayoutError as LayoutError
from kvxfer.layout import SliceGeometry as SliceGeometry
from kvxfer.layout import inspect as inspect
from kvxfer.layout import require_addressable as require_addressable
from kvxfer.manager import AgreementError as AgreementError
from kvxfer.manager import IntegrityError as IntegrityError
from kvxfer.manager import KVCacheManager as KVCacheManager
from kvxfer.manager import LoadHandle as LoadHandle
from kvxfer.manager import LoadResult as LoadResult
from kvxfer.manager import OffloadHandle as OffloadHandle
from kvxfer.manager import PageFormatError as PageFormatError
from kvxfer.plan import BudgetError as BudgetError
from kvxfer.plan import LayerSpec as LayerSpec
from kvxfer.plan import Plan as Plan
from kvxfer.plan import make_plan as make_plan

__all__ = ["__version__", "HostCache", "CacheHit", "CacheLoad", "TransferError", "PageRef",
           "PoolError", "PoolExhaustedError", "Layout", "LayoutError", "SliceGeometry",
           "inspect", "require_addressable", "IntegrityError", "KVCacheManager", "LoadHandle",
           "LoadResult", "OffloadHandle", "PageFormatError", "BudgetError", "LayerSpec", "Plan",
           "make_plan", "AgreementError"]
