"""The data kvxfer ships: model configs and layout catalogues, found by name anywhere.

In the wheel they live inside the package (``kvxfer/configs``, ``kvxfer/layouts``);
in a source checkout, at the top of the repository (``configs/``, ``layouts/``).
A name (``llama3-8b``, ``seeds``) finds the built-in file from any directory; a path
to an existing file is read as given.
"""

from __future__ import annotations

import argparse
import difflib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Literal

__all__ = ["Kind", "data_dir", "builtin_names", "find", "read", "argument",
           "UnknownNameError", "MAX_FILE_BYTES"]

Kind = Literal["configs", "layouts"]
_SUFFIX = {"configs": ".toml", "layouts": ".json"}
_WHAT = {"configs": "config", "layouts": "catalogue"}

_PACKAGE = Path(__file__).resolve().parent


MAX_FILE_BYTES = 16 << 20
"""The largest config or catalogue file read (16 MiB); the shipped ones are a few KiB."""


class UnknownNameError(ValueError):
    """Neither a built-in name nor a readable regular file (the message says which)."""


def _not_a_file(p: Path | int) -> str | None:
    """What ``p`` (a path or an open descriptor) is when it exists but is not a regular
    file (``"a directory"``, ``"a FIFO"``, ...); None for a file or nothing there."""
    try:
        mode = os.fstat(p).st_mode if isinstance(p, int) else p.stat().st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in ((stat.S_ISDIR, "a directory"),
                                          (stat.S_ISFIFO, "a FIFO"),
                                          (stat.S_ISCHR, "a character device"),
                                          (stat.S_ISBLK, "a block device"),
                                          (stat.S_ISSOCK, "a socket")) if test(mode)),
                "not a regular file")


def _shown(text: str) -> str:
    """``text`` as an error message names it: quoted where it is empty or holds a
    character that would not print as itself (a newline would split the one line)."""
    return text if text.strip() and text.isprintable() else repr(text)


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
      UnknownNameError: one message for every unknown name, listing the built-ins,
        with the nearest built-in name first where one is close (difflib).

    Example:
        >>> find("layouts", "seeds").name
        'seeds.json'
        >>> try:
        ...     find("configs", "llama3-8")
        ... except UnknownNameError as e:
        ...     print(str(e).split(" (")[0])
        llama3-8: no such file and no built-in config of that name; did you mean 'llama3-8b'?
    """
    text = os.fspath(name)
    shown = _shown(text)
    if not text.strip() or "\0" in text:
        raise UnknownNameError(f"{shown}: expected a built-in {_WHAT[kind]} name or a "
                               f"{_SUFFIX[kind]} file")
    p = Path(text)
    what = _not_a_file(p)
    if what is not None:
        raise UnknownNameError(f"{shown}: is {what}, not a {_WHAT[kind]} file")
    if p.is_file():
        return p
    stem = p.name[:-len(_SUFFIX[kind])] if p.name.endswith(_SUFFIX[kind]) else p.name
    bare = p.parent in (Path("."), Path(kind))
    names = builtin_names(kind)
    if bare and stem in names:
        return data_dir(kind) / f"{stem}{_SUFFIX[kind]}"
    close = difflib.get_close_matches(stem, names, n=1, cutoff=0.6) if bare else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UnknownNameError(
        f"{shown}: no such file and no built-in {_WHAT[kind]} of that name{hint} (built-in "
        f"{_WHAT[kind]}s: {', '.join(names) or 'none found in ' + str(data_dir(kind))})")


def read(kind: Kind, name: str | os.PathLike[str]) -> tuple[Path, bytes]:
    """``(path, contents)`` of the file ``find`` names, read only if it is a regular file
    of at most ``MAX_FILE_BYTES`` (a FIFO, a device or a directory is never opened).

    Raises:
      UnknownNameError: what ``find`` raises, and a file over ``MAX_FILE_BYTES``.
      OSError: the file cannot be read.

    Example:
        >>> path, data = read("layouts", "seeds")
        >>> path.name, data[:1]
        ('seeds.json', b'{')
    """
    path, shown = find(kind, name), _shown(os.fspath(name))
    # Non-blocking, so a FIFO put there since ``find`` looked cannot hang the open.
    with open(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
        what = _not_a_file(f.fileno())
        if what is not None:
            raise UnknownNameError(f"{shown}: is {what}, not a {_WHAT[kind]} file")
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise UnknownNameError(f"{shown}: larger than {MAX_FILE_BYTES >> 20} MiB, "
                               f"too large for a {_WHAT[kind]} file")
    return path, data


def argument(kind: Kind) -> Callable[[str], str]:
    """An argparse type for a ``kind`` name or file: ``find``'s answer, so an unknown
    name, a directory, a FIFO or a device is refused as the command line is read.

    Example:
        >>> argument("configs")("tiny")
        'tiny'
    """
    def parse(text: str) -> str:
        try:
            find(kind, text)
        except UnknownNameError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    parse.__name__ = f"{_WHAT[kind]} name or file"
    return parse
