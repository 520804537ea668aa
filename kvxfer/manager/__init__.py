"""The manager: ``KVCacheManager``, its handles and results, verification, movers chosen.

One module an idea: ``_handles`` (what a transfer hands back), ``_verify`` (per-layer
verification), ``_agree`` (lockstep agreement on each load's verified prefix across
processes), ``_select`` (which mover moves each slice class), ``_pages`` (pages as
blobs for tiers below host memory), ``_stats`` (counters) and ``_manager`` (the manager
itself).
"""

from kvxfer.manager._handles import Gate as Gate
from kvxfer.manager._handles import IntegrityError as IntegrityError
from kvxfer.manager._handles import LoadHandle as LoadHandle
from kvxfer.manager._handles import LoadResult as LoadResult
from kvxfer.manager._handles import OffloadHandle as OffloadHandle
from kvxfer.manager._manager import Blocks as Blocks
from kvxfer.manager._manager import IntegrityMode as IntegrityMode
from kvxfer.manager._manager import KVCacheManager as KVCacheManager
from kvxfer.manager._pages import PageFormatError as PageFormatError
from kvxfer.manager._select import AUTO_RULES as AUTO_RULES
from kvxfer.manager._select import PATHS as PATHS
from kvxfer.manager._select import PathMode as PathMode
from kvxfer.manager._verify import TransferHook as TransferHook

__all__ = ["KVCacheManager", "OffloadHandle", "LoadHandle", "LoadResult", "IntegrityError",
           "Gate", "IntegrityMode", "PathMode", "PATHS", "AUTO_RULES", "TransferHook", "Blocks",
           "PageFormatError"]
