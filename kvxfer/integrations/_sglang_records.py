"""The records of the sglang-jax host pool: what a load delivered, and its bookkeeping.

``FlushLoadResult`` is public (``kvxfer.integrations.sglang_jax`` exports it); the
rest is the pool's private state: a backup or a staging in flight, a host id's part
in one, and the checks of the ids a call names.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING, Any

import numpy as np

from kvxfer.hostpool import PageRef
from kvxfer.manager import OffloadHandle

__all__ = ["ENGINE_COMMIT", "FlushLoadResult"]

if TYPE_CHECKING:  # what mgr.prefetch returns; not a name kvxfer.manager exports
    from kvxfer.manager import PrefetchHandle

ENGINE_COMMIT = "cddbf6f1cc33cbdd453bd8f36ff7051cf46ca176"
"""The sglang-jax commit this integration was checked against (2026-08-21)."""


@dataclasses.dataclass(frozen=True, slots=True)
class FlushLoadResult:
    """What one ``flush_load`` (or ``copy_to_device``) delivered, by host page id.

    Attributes:
      host_ids: the host page ids of the call, in call order.
      loaded: the host ids whose pages are now in their device pages, verified.
      missed: the host ids not delivered, in call order: a page whose digest failed,
        every page the load did not verify after it, a slot reused since its
        ``stage_load`` (stale), or a slot whose host copy was proven bad before.
        Their device pages hold unverified bytes: the engine must recompute them.
      dropped: the host ids whose host copy failed its own digests: kvxfer freed the
        copy, the id stays allocated to the engine (``free`` it), and every later load
        of it is a miss. A page whose delivery failed over an intact host copy is
        missed but not dropped.
      reasons: host id -> why it was missed.
    """

    host_ids: tuple[int, ...]
    loaded: tuple[int, ...]
    missed: tuple[int, ...]
    dropped: tuple[int, ...]
    reasons: dict[int, str]

    @property
    def verified_pages(self) -> int:
        """Leading host ids of the call that were loaded (the verified prefix)."""
        missed = set(self.missed)
        n = 0
        while n < len(self.host_ids) and self.host_ids[n] not in missed:
            n += 1
        return n

    @property
    def ok(self) -> bool:
        """Every page of the call was loaded and verified."""
        return not self.missed


@dataclasses.dataclass(eq=False)
class _Gather:
    """One ``stage_backup``: its offload, its host ids, and ids freed meanwhile."""

    handle: OffloadHandle
    ids: list[int]
    orphaned: set[int] = dataclasses.field(default_factory=set)
    reaped: set[int] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(eq=False)
class _Stage:
    """One ``stage_load``: its prefetch (None once released) and its pages."""

    handle: PrefetchHandle | None
    pages: list[PageRef]


@dataclasses.dataclass(frozen=True, slots=True)
class _PendingGather:
    """A host id's part of a ``stage_backup``: the backup and the id's place in it."""

    group: _Gather
    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Staged:
    """A host id staged for ``flush_load``: its page, or why it has none."""

    stage: _Stage
    page: PageRef | None
    reason: str | None


def _ids(values: Any, what: str, call: str) -> list[int]:
    """``values`` as Python ints: a sequence of ints or an integer array (any int dtype).

    Floats and bools are refused, never truncated (``1.9`` is not page 1, ``True``
    is not page 1), before the call changes anything.

    Raises:
      TypeError: a value, or the array's dtype, is not an integer (the message
        names the value and the call).
    """
    dtype = getattr(values, "dtype", None)
    if dtype is not None:
        if np.dtype(dtype).kind not in "iu":
            head = np.asarray(values).ravel()
            shown = f"{head[:8].tolist()!r}" + (" ..." if head.size > 8 else "")
            raise TypeError(f"{call} needs integer {what} ids; got an array of dtype "
                            f"{np.dtype(dtype)}: {shown} (nothing was changed)")
        values = np.asarray(values).tolist()
    return [_id(v, what, call) for v in values]


def _id(value: Any, what: str, call: str) -> int:
    """One id as a Python int (see ``_ids``).

    Raises:
      TypeError: a bool, a float, or anything else that is not an integer.
    """
    dtype = getattr(value, "dtype", None)
    if isinstance(value, (bool, np.bool_)) or \
            (dtype is not None and np.dtype(dtype).kind not in "iu"):
        raise TypeError(f"{call} needs integer {what} ids; got {value!r} of type "
                        f"{type(value).__name__} (nothing was changed)")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{call} needs integer {what} ids; got {value!r} of type "
                        f"{type(value).__name__} (nothing was changed)") from None


def _pairs(host_buffer_ids: Any, device_indices: Any, call: str
           ) -> tuple[list[int], list[int]]:
    """Host ids and device pages as ints (``_ids``), checked to pair up one to one."""
    ids = _ids(host_buffer_ids, "host page", call)
    pages = _ids(device_indices, "device page", call)
    if len(ids) != len(pages):
        raise ValueError(f"host_buffer_ids ({len(ids)}) and device_indices ({len(pages)}) "
                         "differ in length")
    return ids, pages


def _unique(ids: list[int], what: str, call: str) -> list[int]:
    """``ids``, checked to name each page once: a second mention is refused, not merged.

    Raises:
      ValueError: an id appears twice (the message names it and the call).
    """
    seen: set[int] = set()
    for i in ids:
        if i in seen:
            raise ValueError(f"{call} names {what} id={i} more than once; each page may "
                             "appear once in a call (nothing was staged, flushed or lost)")
        seen.add(i)
    return ids


def _key(host_id: int, generation: int) -> int:
    """The kvxfer key of a slot's page: the host id and the allocation's epoch."""
    return ((generation & 0xFFFFFFFF) << 32) | host_id
