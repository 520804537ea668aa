"""The manager: ``KVCacheManager``, its handles and results, verification, movers chosen.

One module an idea: ``_manager`` (the manager itself: its construction, properties and
one short public method per operation), ``_checks`` (argument checks), ``_offload``
(the offload path), ``_load`` (the load path, prefetch included), ``_host`` (host
pages by hand: free, read and write a layer's bytes, export and import),
``_handles`` (what a transfer hands back), ``_prefetch`` (staged loads),
``_verify`` (per-layer verification), ``_agree`` (lockstep agreement on each load's
verified prefix and bad pages across processes), ``_select`` (which mover moves each slice class),
``_pages`` (pages as blobs for tiers below host memory). Counters are shared with the
cache (``kvxfer._counters``).

Besides the manager and what it hands back, the package exports what the cache and
the fault injectors build on: ``check_key`` (a page key as the manager takes it),
``Agreement`` and ``describe_keys`` (lockstep rounds across processes, which a
``HostCache`` lookup takes part in too), ``first_span`` (where a page blob's bytes
start), ``blob_bytes`` (how large a whole page's blob is) and ``PrefetchHandle``; and
what ``kvxfer aot`` chooses movers with for caches it only describes
(``choose_movers``, whose choices are ``MoverChoice``s: ``mgr.paths`` entries with
their reasons). Nothing outside the package imports its private modules.
"""

from kvxfer.manager._agree import Agreement as Agreement
from kvxfer.manager._agree import AgreementError as AgreementError
from kvxfer.manager._agree import describe_keys as describe_keys
from kvxfer.manager._checks import check_key as check_key
from kvxfer.manager._handles import Gate as Gate
from kvxfer.manager._handles import IntegrityError as IntegrityError
from kvxfer.manager._handles import LoadHandle as LoadHandle
from kvxfer.manager._handles import LoadResult as LoadResult
from kvxfer.manager._handles import OffloadHandle as OffloadHandle
from kvxfer.manager._manager import Blocks as Blocks
from kvxfer.manager._manager import IntegrityMode as IntegrityMode
from kvxfer.manager._manager import KVCacheManager as KVCacheManager
from kvxfer.manager._pages import PageFormatError as PageFormatError
from kvxfer.manager._pages import blob_bytes as blob_bytes
from kvxfer.manager._pages import first_span as first_span
from kvxfer.manager._prefetch import PrefetchHandle as PrefetchHandle
from kvxfer.manager._select import AUTO_RULES as AUTO_RULES
from kvxfer.manager._select import MoverChoice as MoverChoice
from kvxfer.manager._select import choose_movers as choose_movers
from kvxfer.manager._select import PATHS as PATHS
from kvxfer.manager._select import PathMode as PathMode
from kvxfer.manager._verify import TransferHook as TransferHook

__all__ = ["KVCacheManager", "OffloadHandle", "LoadHandle", "LoadResult", "IntegrityError",
           "Gate", "IntegrityMode", "PathMode", "PATHS", "AUTO_RULES", "TransferHook", "Blocks",
           "PageFormatError", "AgreementError", "PrefetchHandle", "Agreement", "describe_keys",
           "check_key", "first_span", "blob_bytes", "MoverChoice", "choose_movers"]
