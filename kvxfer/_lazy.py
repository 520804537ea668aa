"""Names a package offers, imported from the module that holds them on first use.

``import kvxfer`` (and so every ``kvxfer`` command, ``--help`` included) must not
start JAX: the command line imports what a command needs when it runs.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["exports"]


def exports(package: str, where: Mapping[str, Sequence[str]]
            ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name of ``where[module]`` is
    imported from ``module`` the first time it is asked for, then kept.

    Example:
        >>> get, names = exports("kvxfer", {"kvxfer.layout": ["inspect"]})
        >>> get("inspect").__name__, "inspect" in names(), get("layout").__name__
        ('inspect', True, 'kvxfer.layout')
    """
    home = {name: module for module, names in where.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = home.get(name)
        if module is None:
            # A submodule not imported yet (``kvxfer.manager``), as an eager face offered.
            if not name.startswith("__") and \
                    importlib.util.find_spec(f"{package}.{name}") is not None:
                return importlib.import_module(f"{package}.{name}")
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        importlib.import_module(package).__dict__[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(importlib.import_module(package).__dict__) | set(home))

    return __getattr__, __dir__
