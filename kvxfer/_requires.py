"""The oldest jax and jaxlib kvxfer runs on, and the error an older one gets.

``pyproject.toml`` states the same floor (``jax>=`` and ``jaxlib>=`` it;
tests/test_package.py keeps the two equal). pip enforces it at install; this check
is for an environment that has an older jax all the same (installed with
``--no-deps``, or by another tool): the engine (and so the manager, the cache, the
demo and the bench) refuses to import there with one error that names both versions,
rather than failing later, deep in a transfer, with an error of jax's own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["JAX_FLOOR", "JaxVersionError", "version_tuple", "version_key", "jax_refusal",
           "require_jax"]

JAX_FLOOR = "0.10.2"
"""The oldest jax and jaxlib kvxfer runs on (jax pins its jaxlib to its own version).

jaxlib 0.10.2 is the first whose XLA:CPU runs programs with ``pinned_host`` outputs
(the host pools kvxfer allocates, and the pinned mover's in-place programs on CPU):
before it they fail to compile ("No registered implementation for untyped custom call
to annotate_device_placement for Host"); and jax 0.10.0 the first whose
``jax.set_mesh`` takes ``None`` (kvxfer's programs run under no context mesh).
"""


class JaxVersionError(ImportError):
    """The installed jax or jaxlib is older than ``JAX_FLOOR``."""


def version_tuple(text: str) -> tuple[int, ...]:
    """The release numbers a version string starts with (``"0.10.2.dev1"``: 0, 10, 2).

    Raises:
      ValueError: ``text`` does not start with a number.

    Example:
        >>> version_tuple("0.10.2"), version_tuple("0.11.0.dev20260101+cuda12")
        ((0, 10, 2), (0, 11, 0))
    """
    m = re.match(r"\d+(?:\.\d+)*", str(text).strip())
    if m is None:
        raise ValueError(f"version {text!r} ({type(text).__name__}) does not start with "
                         "release numbers, such as '0.10.2'")
    return tuple(int(p) for p in m.group().split("."))


_PRE = re.compile(r"[-_.]?(a|alpha|b|beta|c|rc|pre|preview)[-_.]?\d*")
_DEV = re.compile(r"[-_.]?dev")
_POST = re.compile(r"[-_.]?(post|rev|r)[-_.]?\d*|-\d")


def version_key(text: str) -> tuple[tuple[int, ...], int]:
    """A key that orders versions as PEP 440 does where it matters for a floor: a
    pre-release (``0.10.2rc1``, ``0.10.2b1``) and a development release
    (``0.10.2.dev1``) come before their release, a post-release after it, a local
    version (``+cuda12``) with it; ``0.10`` equals ``0.10.0``.

    Raises:
      ValueError: ``text`` does not start with a number (``version_tuple``).

    Example:
        >>> [version_key(v) < version_key("0.10.2") for v in
        ...  ("0.10.2rc1", "0.10.2.dev1", "0.10.2", "0.10.2.post1", "0.11.0.dev20260101")]
        [True, True, False, False, False]
    """
    release = version_tuple(text)
    rest = str(text).strip()[len(".".join(map(str, release))):].lower().split("+")[0]
    while release and release[-1] == 0:
        release = release[:-1]  # 0.10 == 0.10.0
    # Within one release: dev < pre-release < the release < post-release.
    stage = 0 if _DEV.match(rest) else 1 if _PRE.match(rest) else \
        3 if _POST.match(rest) else 2
    return release, stage


def jax_refusal(versions: Mapping[str, str]) -> str | None:
    """Why kvxfer cannot run on these versions (None: it can).

    Args:
      versions: ``{"jax": version, "jaxlib": version}`` (any packages: each is held to
        ``JAX_FLOOR``).

    Example:
        >>> jax_refusal({"jax": "0.10.2", "jaxlib": "0.10.2"}) is None
        True
        >>> why = jax_refusal({"jax": "0.9.2", "jaxlib": "0.9.2"})
        >>> "jax and jaxlib 0.10.2 or newer" in why and "has jax 0.9.2, jaxlib 0.9.2" in why
        True
        >>> jax_refusal({"jax": "0.10.2rc1", "jaxlib": "0.10.2"}) is None  # before 0.10.2
        False
    """
    floor = version_key(JAX_FLOOR)
    if all(version_key(v) >= floor for v in versions.values()):
        return None
    have = ", ".join(f"{name} {v}" for name, v in versions.items())
    return (f"kvxfer needs jax and jaxlib {JAX_FLOOR} or newer (XLA:CPU programs with "
            f"pinned_host outputs; jax.set_mesh(None)), and this environment has {have}: "
            f"pip install -U 'jax>={JAX_FLOOR}' 'jaxlib>={JAX_FLOOR}'")


def require_jax() -> None:
    """Raises ``JaxVersionError`` where the installed jax or jaxlib is too old.

    Example:
        >>> require_jax()  # jax and jaxlib at JAX_FLOOR or newer: nothing happens
    """
    import jax
    import jaxlib

    why = jax_refusal({"jax": jax.__version__, "jaxlib": jaxlib.__version__})
    if why is not None:
        raise JaxVersionError(why)
