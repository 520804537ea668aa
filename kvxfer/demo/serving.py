"""The demo's names as one module (older imports of ``kvxfer.demo.serving``).

The code lives in ``kvxfer.demo.tiers``, ``inject``, ``server``, ``workload`` and
``command``; ``kvxfer.demo`` exports the same names.

Example:
    >>> import kvxfer.demo
    >>> from kvxfer.demo import serving
    >>> serving.run_demo is kvxfer.demo.run_demo
    True
"""

from kvxfer.demo.command import DemoOptions as DemoOptions
from kvxfer.demo.command import add_arguments as add_arguments
from kvxfer.demo.command import format_summary as format_summary
from kvxfer.demo.command import main as main
from kvxfer.demo.command import register_cli as register_cli
from kvxfer.demo.command import run_demo as run_demo
from kvxfer.demo.inject import INJECT_MODES as INJECT_MODES
from kvxfer.demo.inject import FaultInjector as FaultInjector
from kvxfer.demo.server import PrefixCacheServer as PrefixCacheServer
from kvxfer.demo.server import Request as Request
from kvxfer.demo.server import RequestOutcome as RequestOutcome
from kvxfer.demo.tiers import DeviceBlocks as DeviceBlocks
from kvxfer.demo.tiers import HostIndex as HostIndex
from kvxfer.demo.tiers import page_keys as page_keys
from kvxfer.demo.workload import make_workload as make_workload
from kvxfer.demo.workload import reference_tokens as reference_tokens
from kvxfer.demo.workload import shard_caches as shard_caches

__all__ = ["INJECT_MODES", "DemoOptions", "Request", "RequestOutcome", "DeviceBlocks",
           "HostIndex", "FaultInjector", "PrefixCacheServer", "page_keys", "make_workload",
           "shard_caches", "reference_tokens", "run_demo", "add_arguments", "register_cli",
           "format_summary", "main"]
