"""``kvxfer demo``: a JAX serving loop with a host-tier prefix cache built on kvxfer.

A tiny paged-attention decoder (``kvxfer.demo.model``, bit-reproducible per page)
serves requests that share long system prompts. Their prompt pages are cached in
device blocks, when those run short in host memory through ``kvxfer.HostCache``
over a ``kvxfer.KVCacheManager``, and below it in an optional store tier (a local
directory or Redis); every request's tokens are checked against a run with no
cache. Modules, one idea each:

* ``model``: the decoder (its rooms ``_model_config`` and ``_model_layers``).
* ``tiers``: page keys and the device tier (``DeviceBlocks``).
* ``server``: ``PrefixCacheServer``, which serves one request at a time.
* ``inject``: the demo's fault injector, on ``kvxfer.testing``'s injectors (the
  server's ``Injector``; it imports the server, never the other way).
* ``workload``: the requests, their caches' placement, the no-cache reference.
* ``command``: ``DemoOptions``, ``run_demo``, the summary and the command line.

Example:
    >>> from kvxfer import demo
    >>> demo.DemoOptions(inject="bitflip").requests
    32
"""

from kvxfer.demo.command import DemoOptions as DemoOptions
from kvxfer.demo.command import add_arguments as add_arguments
from kvxfer.demo.command import build_parser as build_parser
from kvxfer.demo.command import format_summary as format_summary
from kvxfer.demo.command import main as main
from kvxfer.demo.command import register_cli as register_cli
from kvxfer.demo.command import run_demo as run_demo
from kvxfer.demo.inject import INJECT_MODES as INJECT_MODES
from kvxfer.demo.inject import FaultInjector as FaultInjector
from kvxfer.demo.inject import InjectMode as InjectMode
from kvxfer.demo.inject import Injection as Injection
from kvxfer.demo.server import PrefixCacheServer as PrefixCacheServer
from kvxfer.demo.server import Request as Request
from kvxfer.demo.server import RequestKind as RequestKind
from kvxfer.demo.server import RequestOutcome as RequestOutcome
from kvxfer.demo.server import ServeStats as ServeStats
from kvxfer.demo.tiers import DeviceBlocks as DeviceBlocks
from kvxfer.demo.tiers import page_keys as page_keys
from kvxfer.demo.workload import make_workload as make_workload
from kvxfer.demo.workload import reference_tokens as reference_tokens
from kvxfer.demo.workload import shard_caches as shard_caches

__all__ = ["DemoOptions", "run_demo", "format_summary", "add_arguments", "build_parser",
           "register_cli", "main", "InjectMode", "INJECT_MODES", "FaultInjector", "Injection",
           "PrefixCacheServer", "Request", "RequestKind", "RequestOutcome", "ServeStats",
           "DeviceBlocks", "page_keys", "make_workload", "shard_caches",
           "reference_tokens"]
