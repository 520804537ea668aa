"""The demo model's configuration: per-layer KV geometry, hyper-parameters, presets.

Layers may differ in KV geometry (``LayerKV``), which gives the KV cache several
slice classes with different bytes per block (``mixed_layers``).

Example:
    >>> cfg = mixed_layers()
    >>> cfg.kv_block_bytes(), sorted(cfg.slice_classes().values())
    ((8192, 16384, 8192, 16384), [(0, 2), (1, 3)])
    >>> scaled(tiny_llama(), 2).layers[0]
    LayerKV(num_kv_heads=4, head_dim=32)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

__all__ = ["LayerKV", "ModelConfig", "tiny_llama", "mixed_layers", "scaled", "blocks_needed"]


@dataclasses.dataclass(frozen=True)
class LayerKV:
    """KV geometry of one layer.

    Attributes:
        num_kv_heads: Number of key/value heads (GQA groups) of the layer.
        head_dim: Per-head dimension of the layer's q/k/v (must be even: RoPE
            rotates pairs of channels).
    """

    num_kv_heads: int
    head_dim: int

    def block_shape(self, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one cache block of this layer: ``[block_size, 2, kv_heads, head_dim]``."""
        return (block_size, 2, self.num_kv_heads, self.head_dim)

    def bytes_per_block(self, block_size: int, dtype: Any = np.float32) -> int:
        """Bytes of one cache block of this layer (K and V together) in ``dtype``."""
        return math.prod(self.block_shape(block_size)) * np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the demo model.

    Attributes:
        vocab_size: Number of token ids.
        d_model: Width of the residual stream.
        num_layers: Number of decoder layers; must equal ``len(layers)``.
        num_q_heads: Query heads of every layer; a multiple of each layer's
            ``num_kv_heads``.
        ffn_dim: Hidden width of the SwiGLU MLP.
        layers: One ``LayerKV`` per layer; layers may differ, which gives the
            KV cache several "slice classes" with different bytes per block.
        block_size: Tokens per KV block (= tokens per prefill page).
        max_blocks_per_seq: Block tables are padded to this length, which
            fixes every compiled shape; it bounds the sequence length to
            ``block_size * max_blocks_per_seq`` tokens.
        rope_theta: RoPE base frequency.
        norm_eps: RMSNorm epsilon.
    """

    vocab_size: int
    d_model: int
    num_layers: int
    num_q_heads: int
    ffn_dim: int
    layers: tuple[LayerKV, ...]
    block_size: int = 16
    max_blocks_per_seq: int = 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        # Accept any sequence for convenience but store a tuple so the config
        # stays hashable (it is used as a cache key and compared in tests).
        object.__setattr__(self, "layers", tuple(self.layers))
        if len(self.layers) != self.num_layers:
            raise ValueError(
                f"num_layers={self.num_layers} but {len(self.layers)} LayerKV entries given"
            )
        for i, lkv in enumerate(self.layers):
            if lkv.num_kv_heads <= 0 or lkv.head_dim <= 0:
                raise ValueError(f"layer {i}: non-positive KV geometry {lkv}")
            if self.num_q_heads % lkv.num_kv_heads:
                raise ValueError(
                    f"layer {i}: num_q_heads={self.num_q_heads} is not a multiple of "
                    f"num_kv_heads={lkv.num_kv_heads}"
                )
            if lkv.head_dim % 2:
                raise ValueError(f"layer {i}: head_dim={lkv.head_dim} must be even for RoPE")
        for name in ("vocab_size", "d_model", "num_q_heads", "ffn_dim", "block_size",
                     "max_blocks_per_seq"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def max_seq_len(self) -> int:
        """Longest sequence (prompt + generated) a block table can describe."""
        return self.block_size * self.max_blocks_per_seq

    def kv_block_bytes(self, dtype: Any = np.float32) -> tuple[int, ...]:
        """Bytes of one block, per layer, for caches of ``dtype``."""
        return tuple(lkv.bytes_per_block(self.block_size, dtype) for lkv in self.layers)

    def slice_classes(self) -> dict[LayerKV, tuple[int, ...]]:
        """Groups layer indices by KV geometry (layers of one class share block shape)."""
        classes: dict[LayerKV, list[int]] = {}
        for i, lkv in enumerate(self.layers):
            classes.setdefault(lkv, []).append(i)
        return {k: tuple(v) for k, v in classes.items()}


def tiny_llama() -> ModelConfig:
    """A 4-layer toy Llama: d_model 128, 4 q heads, 2 kv heads of dim 32, vocab 512."""
    return ModelConfig(
        vocab_size=512,
        d_model=128,
        num_layers=4,
        num_q_heads=4,
        ffn_dim=256,
        layers=(LayerKV(2, 32),) * 4,
    )


def mixed_layers() -> ModelConfig:
    """Like :func:`tiny_llama` but layers alternate (2 kv heads, dim 32) / (1 kv head, dim 128).

    The cache then has two slice classes whose blocks differ in shape *and* in
    size (8 KiB vs 16 KiB per block in float32). The often-quoted pair
    (2, 32) / (1, 64) would give equal bytes per block, so dim 128 is used.
    """
    return dataclasses.replace(tiny_llama(), layers=(LayerKV(2, 32), LayerKV(1, 128)) * 2)


def scaled(
    cfg: ModelConfig,
    factor: int = 1,
    *,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    max_blocks_per_seq: int | None = None,
) -> ModelConfig:
    """Returns a bigger (or re-shaped) copy of ``cfg`` for benchmarks and CLIs.

    Args:
        cfg: Base configuration.
        factor: Width multiplier: ``d_model``, ``ffn_dim``, ``num_q_heads`` and
            every layer's ``num_kv_heads`` are multiplied by it (head_dim is
            kept, so the GQA ratio and RoPE are unchanged and KV bytes per
            block grow by ``factor``).
        num_layers: New depth; the per-layer KV geometry pattern of ``cfg`` is
            repeated cyclically. ``None`` keeps the depth.
        vocab_size: New vocabulary size, or ``None`` to keep it.
        max_blocks_per_seq: New padded block-table length, or ``None``.

    Returns:
        The new configuration.
    """
    if factor < 1:
        raise ValueError("factor must be >= 1")
    depth = cfg.num_layers if num_layers is None else num_layers
    layers = tuple(
        LayerKV(cfg.layers[i % cfg.num_layers].num_kv_heads * factor,
                cfg.layers[i % cfg.num_layers].head_dim)
        for i in range(depth)
    )
    return dataclasses.replace(
        cfg,
        d_model=cfg.d_model * factor,
        ffn_dim=cfg.ffn_dim * factor,
        num_q_heads=cfg.num_q_heads * factor,
        num_layers=depth,
        layers=layers,
        vocab_size=cfg.vocab_size if vocab_size is None else vocab_size,
        max_blocks_per_seq=(cfg.max_blocks_per_seq if max_blocks_per_seq is None
                            else max_blocks_per_seq),
    )


def blocks_needed(prompt_len: int, max_new_tokens: int, block_size: int = 16) -> int:
    """Blocks a request must own for :meth:`Model.generate`.

    The last generated token is returned but never fed back, so its KV is not
    written: positions ``[0, prompt_len + max_new_tokens - 1)`` are.
    """
    written = prompt_len + max(max_new_tokens - 1, 0)
    return -(-written // block_size)
