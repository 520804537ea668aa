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
* ``command``: ``run_demo`` and its summary; ``_options`` (``DemoOptions``, the
  flags) and ``_cli`` (the command line) import nothing heavy.

Example:
    >>> from kvxfer import demo
    >>> demo.DemoOptions(inject="bitflip").requests
    32
"""

from kvxfer import _lazy

_WHERE = {
    "kvxfer.demo._options": ["DemoOptions", "add_arguments", "INJECT_MODES", "InjectMode"],
    "kvxfer.demo._cli": ["build_parser", "main", "register_cli"],
    "kvxfer.demo.command": ["format_summary", "run_demo"],
    "kvxfer.demo.inject": ["FaultInjector", "Injection"],
    "kvxfer.demo.server": ["PrefixCacheServer", "Request", "RequestKind", "RequestOutcome",
                           "ServeStats"],
    "kvxfer.demo.tiers": ["DeviceBlocks", "page_keys"],
    "kvxfer.demo.workload": ["make_workload", "reference_tokens", "shard_caches"],
}
"""Where each name lives: imported from there on first use (``kvxfer --help`` starts
without JAX)."""

__getattr__, __dir__ = _lazy.exports(__name__, _WHERE)

__all__ = ["DemoOptions", "run_demo", "format_summary", "add_arguments", "build_parser",
           "register_cli", "main", "InjectMode", "INJECT_MODES", "FaultInjector", "Injection",
           "PrefixCacheServer", "Request", "RequestKind", "RequestOutcome", "ServeStats",
           "DeviceBlocks", "page_keys", "make_workload", "shard_caches",
           "reference_tokens"]
