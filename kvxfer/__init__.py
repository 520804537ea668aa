"""kvxfer: verified KV-cache transfers between accelerator and host memory for JAX."""

from kvxfer.engine import TransferError as TransferError
from kvxfer.hostpool import PageRef as PageRef
from kvxfer.hostpool import PoolError as PoolError
from kvxfer.hostpool import PoolExhaustedError as PoolExhaustedError
from kvxfer.layout import Layout as Layout
from kvxfer.layout import LayoutError as LayoutError
from kvxfer.layout import SliceGeometry as SliceGeometry
from kvxfer.layout import inspect as inspect
from kvxfer.layout import require_addressable as require_addressable
from kvxfer.manager import IntegrityError as IntegrityError
from kvxfer.manager import KVCacheManager as KVCacheManager
from kvxfer.manager import LoadHandle as LoadHandle
from kvxfer.manager import LoadResult as LoadResult
from kvxfer.manager import OffloadHandle as OffloadHandle
from kvxfer.plan import BudgetError as BudgetError
from kvxfer.plan import LayerSpec as LayerSpec
from kvxfer.plan import Plan as Plan
from kvxfer.plan import make_plan as make_plan

from kvxfer._version import __version__ as __version__
