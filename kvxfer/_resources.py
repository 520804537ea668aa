"""The data kvxfer ships: model configs and layout catalogues, found by name anywhere.

In the wheel they live inside the package (``kvxfer/configs``, ``kvxfer/layouts``);
in a source checkout, at the top of the repository (``configs/``, ``layouts/``).
A name (``llama3-8b``, ``seeds``) finds the built-in file from any directory; a path
to an existing file is read as given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

__all__ = ["Kind", "data_dir", "builtin_names", "find", "UnknownNameError"]

Kind = Literal["configs", "layouts"]
_SUFFIX = {"configs": ".toml", "layouts": ".json"}
_WHAT = {"configs": "config", "layouts": "catalogue"}

_PACKAGE = Path(__file__).resolve().parent


class UnknownNameError(ValueError):
    """Neither a built-in name nor an existing file."""


def data_dir(kind: Kind) -> Path:
    """Where the built-in ``kind`` files are: inside the package, else the checkout's."""
    inside = _PACKAGE / kind
    if inside.is_dir():
        return inside
    return _PACKAGE.parent / kind


def builtin_names(kind: Kind) -> list[str]:
    """The built-in names of ``kind``, sorted (file stems).

    Example:
        >>> "llama3-8b" in builtin_names("configs"), "seeds" in builtin_names("layouts")
        (True, True)
    """
    d = data_dir(kind)
    return sorted(p.stem for p in d.glob(f"*{_SUFFIX[kind]}")) if d.is_dir() else []


def find(kind: Kind, name: str | os.PathLike[str]) -> Path:
    """The file a user means by ``name``: an existing path, or a built-in name.

    A built-in name may carry its suffix (``seeds.json``) or its folder
    (``layouts/seeds.json``), so commands written for the repository root work
    from any directory.

    Raises:
      UnknownNameError: one message for every unknown name, listing the built-ins.

    Example:
        >>> find("layouts", "seeds").name
        'seeds.json'
    """
    text = os.fspath(name)
    p = Path(text)
    if p.is_file():
        return p
    stem = p.name[:-len(_SUFFIX[kind])] if p.name.endswith(_SUFFIX[kind]) else p.name
    bare = p.parent in (Path("."), Path(kind))
    names = builtin_names(kind)
    if bare and stem in names:
        return data_dir(kind) / f"{stem}{_SUFFIX[kind]}"
    raise UnknownNameError(
        f"{text}: no such file and no built-in {_WHAT[kind]} of that name (built-in "
        f"{_WHAT[kind]}s: {', '.join(names) or 'none found in ' + str(data_dir(kind))})")
