"""How the DMA mover runs: one value, passed to ``KVCacheManager(dma=...)`` and checked
when it is made (no environment variable is read)."""

from __future__ import annotations

import dataclasses

from kvxfer._text import format_bytes, parse_bytes

__all__ = ["DmaOptions"]

_CHOICES = {"stream": ("side", "xla"), "relayout": ("auto", "always", "never"),
            "copy": ("batch", "loop")}


@dataclasses.dataclass(frozen=True)
class DmaOptions:
    """Options of the DMA mover (``KVCacheManager(..., dma=DmaOptions(...))``).

    Attributes:
      stream: ``"side"`` (default): copies run on the copy engine's own streams, one a
        direction, ordered by events, where it has them (CUDA), so the engine's steps on
        XLA's stream do not wait for them; ``"xla"``: on XLA's stream, in its order.
      relayout: ``"auto"`` (default) gathers a transfer's pages on the device first
        where shard blocks are under 64 KiB (a copy a page); ``"always"``, ``"never"``.
      staging_bytes: device staging transfers beside XLA's stream may hold at once on
        a device, bytes or a size (``"1GiB"``, the default), and at most half its free
        memory. A transfer past it copies on XLA's stream (counted in ``stats()``), but
        one alone on its device, which runs beside where it fits that half.
      copy: ``"batch"`` (a ``cuMemcpyBatchAsync`` a transfer where the driver has it,
        the default) or ``"loop"`` (``cuMemcpyAsync`` a copy).
      self_check: the first manager of a process over a copy engine with streams of
        its own (a GPU's) runs a small round trip of every program form, bytes compared,
        and one injected callback failure (``kvxfer.manager.dma_self_check``); on a
        failure ``path="auto"`` takes the pinned route (why: ``mgr.paths``) and
        ``path="dma"`` raises.

    Raises:
      ValueError: a value not among the choices, or not a size, naming field and value.

    Example:
        >>> DmaOptions(staging_bytes="256MiB").staging_bytes
        268435456
        >>> DmaOptions(stream="aside")
        Traceback (most recent call last):
        ...
        ValueError: DmaOptions(stream='aside'): expected one of ('side', 'xla')
    """

    stream: str = "side"
    relayout: str = "auto"
    staging_bytes: int | str = 1 << 30
    copy: str = "batch"
    self_check: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.self_check, bool):
            raise ValueError(f"DmaOptions(self_check={self.self_check!r}): expected True or False")
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"DmaOptions({name}={value!r}): expected one of {choices}")
        size = self.staging_bytes
        if isinstance(size, bool) or not isinstance(size, (int, str)):
            raise ValueError(f"DmaOptions(staging_bytes={size!r}): expected bytes (an int) "
                             "or a size such as '1GiB'")
        try:
            nbytes = parse_bytes(size) if isinstance(size, str) else int(size)
        except ValueError as e:
            raise ValueError(f"DmaOptions(staging_bytes={size!r}): {e}") from None
        if nbytes < 0:
            raise ValueError(f"DmaOptions(staging_bytes={size!r}): a size is not negative")
        object.__setattr__(self, "staging_bytes", nbytes)

    def __str__(self) -> str:
        return (f"stream={self.stream}, relayout={self.relayout}, "
                f"staging={format_bytes(int(self.staging_bytes))}, copy={self.copy}, "
                f"self_check={self.self_check}")
