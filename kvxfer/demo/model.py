"""A tiny Llama-style decoder with a paged, bit-reproducible KV cache.

The model exists to drive the KV-transfer machinery with realistic traffic:
per-layer KV arrays (possibly of different geometry per layer), a block table
per request, and one jitted call per layer so that a serving loop can wait for
layer ``i``'s KV blocks to arrive from the host tier just before layer ``i``
runs.

Architecture: token embedding -> ``num_layers`` x [RMSNorm -> GQA attention
with RoPE -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm ->
unembedding. Each layer has its own KV geometry (``LayerKV``); the query
projection of a layer maps ``d_model -> num_q_heads * head_dim`` of *that*
layer and the output projection maps it back, so layers with different
``head_dim`` coexist.

KV cache layout: for every layer ``i`` one array ``kv[i]`` of shape
``[num_blocks, block_size, 2, num_kv_heads_i, head_dim_i]`` (index 0 of the
third axis is K, index 1 is V), dtype float32 by default or bfloat16. Keys are
stored *after* RoPE, so a block's bytes depend only on the token prefix, never
on where the block lives physically.

Determinism contract (the reason this module exists): the KV written for full
prompt page ``j`` is bit-identical whether pages ``0..j-1`` were computed in the
same call or computed earlier (by another request, into other physical blocks)
and copied back. This holds because every page computation:

* runs the same compiled program (fixed shapes: 16 tokens, a block table padded
  to ``max_blocks_per_seq``, start position and valid-count passed as traced
  int32 scalars, never as Python constants);
* gathers the whole padded window and zeroes every key/value at a position
  ``>= start_pos + num_valid`` *before* any arithmetic, so stale data in unused
  blocks, padding entries of the block table, or rows not yet written can not
  leak into the result (not even as ``0 * nan`` or a signed zero);
* uses physical block ids only as gather/scatter indices.

Only *full* prompt pages computed by :meth:`Model.prefill_page` are canonical
and safe to share through a prefix cache. A partial last page and KV written
by the single-token decode path are deterministic too, but they are not
promised to match bit-for-bit what a full-page computation of the same tokens
would produce.

Partial last pages: a prompt whose length is not a multiple of ``block_size``
has its last page processed as one masked page (tokens padded to 16 with id 0,
``num_valid < 16``). The padding rows are written into the block too; they are
never read (masked by position) and decoding overwrites them in order.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "LayerKV",
    "ModelConfig",
    "Params",
    "Model",
    "tiny_llama",
    "mixed_layers",
    "scaled",
    "init_params",
    "make_kv_caches",
    "pad_block_table",
    "blocks_needed",
    "layer_step",
    "decode_layer_step",
    "embed",
    "logits",
    "greedy_token",
    "rms_norm",
    "rope",
    "compiled_layer_programs",
]

LayerParams = dict[str, jax.Array]
"""Per-layer weights: attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down."""


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------


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

    def bytes_per_block(self, block_size: int, dtype: Any = jnp.float32) -> int:
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

    def kv_block_bytes(self, dtype: Any = jnp.float32) -> tuple[int, ...]:
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


# --------------------------------------------------------------------------
# Parameters and caches
# --------------------------------------------------------------------------


class Params(NamedTuple):
    """All model weights (a pytree).

    Attributes:
        embed: ``[vocab_size, d_model]`` token embedding.
        layers: One ``LayerParams`` dict per layer.
        final_norm: ``[d_model]`` RMSNorm weight applied before unembedding.
        unembed: ``[d_model, vocab_size]`` output projection.
    """

    embed: jax.Array
    layers: list[LayerParams]
    final_norm: jax.Array
    unembed: jax.Array


def init_params(cfg: ModelConfig, seed: int = 0) -> Params:
    """Deterministic random float32 weights (no downloads).

    Weights are drawn with NumPy's PCG64 generator seeded by ``(seed, tensor
    id)`` so they are reproducible across machines and JAX versions, and layer
    ``i``'s weights do not depend on how many layers the model has.

    Args:
        cfg: Model configuration.
        seed: Integer seed.

    Returns:
        The parameters, already on the default JAX device.
    """

    def normal(shape: tuple[int, ...], std: float, *key: int) -> jax.Array:
        rng = np.random.default_rng([seed, *key])
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    d, f, hq = cfg.d_model, cfg.ffn_dim, cfg.num_q_heads
    layers: list[LayerParams] = []
    for i, lkv in enumerate(cfg.layers):
        qd, kvd = hq * lkv.head_dim, lkv.num_kv_heads * lkv.head_dim
        layers.append({
            "attn_norm": jnp.ones((d,), jnp.float32),
            "wq": normal((d, qd), d ** -0.5, 2, i, 0),
            "wk": normal((d, kvd), d ** -0.5, 2, i, 1),
            "wv": normal((d, kvd), d ** -0.5, 2, i, 2),
            # Small residual branches keep the stream well-conditioned at
            # random init so greedy decoding does not collapse immediately.
            "wo": normal((qd, d), 0.5 * qd ** -0.5, 2, i, 3),
            "mlp_norm": jnp.ones((d,), jnp.float32),
            "w_gate": normal((d, f), d ** -0.5, 2, i, 4),
            "w_up": normal((d, f), d ** -0.5, 2, i, 5),
            "w_down": normal((f, d), 0.5 * f ** -0.5, 2, i, 6),
        })
    return Params(
        embed=normal((cfg.vocab_size, d), 1.0, 0),
        layers=layers,
        final_norm=jnp.ones((d,), jnp.float32),
        unembed=normal((d, cfg.vocab_size), d ** -0.5, 1),
    )


def make_kv_caches(cfg: ModelConfig, num_blocks: int, dtype: Any = jnp.float32) -> list[jax.Array]:
    """Allocates zeroed paged KV caches.

    Args:
        cfg: Model configuration.
        num_blocks: Physical blocks per layer (every layer has the same count,
            so one block id addresses the same logical slot in all layers).
        dtype: Cache dtype, ``jnp.float32`` or ``jnp.bfloat16``.

    Returns:
        ``kv[i]`` of shape ``[num_blocks, block_size, 2, num_kv_heads_i,
        head_dim_i]`` for each layer ``i``.
    """
    if np.dtype(dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise ValueError(f"unsupported cache dtype {dtype}")
    return [jnp.zeros((num_blocks, *lkv.block_shape(cfg.block_size)), dtype) for lkv in cfg.layers]


def pad_block_table(block_ids: Sequence[int] | np.ndarray | jax.Array,
                    max_blocks_per_seq: int) -> jax.Array:
    """Pads a request's block ids to the fixed table length (int32).

    Padding entries are 0; they are gathered but always masked, so any valid
    id would do.

    Args:
        block_ids: Physical block ids, one per ``block_size`` tokens.
        max_blocks_per_seq: Fixed table length.

    Returns:
        ``int32[max_blocks_per_seq]`` device array.
    """
    ids = np.asarray(block_ids, dtype=np.int32).reshape(-1)
    if ids.size > max_blocks_per_seq:
        raise ValueError(f"{ids.size} blocks exceed max_blocks_per_seq={max_blocks_per_seq}")
    out = np.zeros((max_blocks_per_seq,), np.int32)
    out[: ids.size] = ids
    return jnp.asarray(out)


def blocks_needed(prompt_len: int, max_new_tokens: int, block_size: int = 16) -> int:
    """Blocks a request must own for :meth:`Model.generate`.

    The last generated token is returned but never fed back, so its KV is not
    written: positions ``[0, prompt_len + max_new_tokens - 1)`` are.
    """
    written = prompt_len + max(max_new_tokens - 1, 0)
    return -(-written // block_size)


# --------------------------------------------------------------------------
# Math
# --------------------------------------------------------------------------


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + eps) * w


def rope(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE. ``x``: ``[T, H, hd]``, ``pos``: ``int32[T]``."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) * (2.0 / x.shape[-1])))
    ang = pos.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _layer_impl(p: LayerParams, x: jax.Array, kv: jax.Array, block_table: jax.Array,
                start_pos: jax.Array, num_valid: jax.Array, *, rope_theta: float,
                norm_eps: float) -> tuple[jax.Array, jax.Array]:
    """One decoder layer for ``T`` consecutive tokens of one request.

    The tokens occupy positions ``[start_pos, start_pos + T)``, all inside the
    block ``block_table[start_pos // block_size]``. Every geometry is read off
    the array shapes so one Python function serves all layer kinds.
    """
    t = x.shape[0]
    _, bs, _, hkv, hd = kv.shape
    hq = p["wq"].shape[1] // hd
    pos = start_pos + jnp.arange(t, dtype=jnp.int32)

    h = rms_norm(x, p["attn_norm"], norm_eps)
    q = rope((h @ p["wq"]).reshape(t, hq, hd), pos, rope_theta)
    k = rope((h @ p["wk"]).reshape(t, hkv, hd), pos, rope_theta)
    v = (h @ p["wv"]).reshape(t, hkv, hd)

    # Write first, then read the window back from the cache: the tokens of
    # this page then see their own K/V rounded to the cache dtype, exactly as
    # later pages (or a request reusing this block) will see them.
    new = jnp.stack([k, v], axis=1).astype(kv.dtype)[None]  # [1, T, 2, hkv, hd]
    blk = block_table[start_pos // bs]
    kv = jax.lax.dynamic_update_slice(kv, new, (blk, start_pos % bs, 0, 0, 0))

    win = kv[block_table]  # [max_blocks, bs, 2, hkv, hd]; padding ids gathered, masked below
    s = win.shape[0] * bs
    win = win.reshape(s, 2, hkv, hd).astype(jnp.float32)
    key_pos = jnp.arange(s, dtype=jnp.int32)
    key_ok = key_pos < start_pos + num_valid
    # Zero (not just mask) everything beyond the valid prefix so stale bytes
    # in unwritten rows / foreign blocks can never reach the arithmetic.
    win = jnp.where(key_ok[:, None, None, None], win, jnp.zeros((), win.dtype))
    kw, vw = win[:, 0], win[:, 1]

    qg = q.reshape(t, hkv, hq // hkv, hd)
    scores = jnp.einsum("tkgd,skd->kgts", qg, kw) * jnp.float32(hd ** -0.5)
    allowed = key_ok[None, :] & (key_pos[None, :] <= pos[:, None])  # [T, S]
    scores = jnp.where(allowed[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    attn = jnp.einsum("kgts,skd->tkgd", probs, vw).reshape(t, hq * hd)
    x = x + attn @ p["wo"]

    h = rms_norm(x, p["mlp_norm"], norm_eps)
    x = x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
    return x, kv


# Donating the cache lets XLA update the block in place instead of copying the
# whole per-layer array every step.
_layer_jit = jax.jit(_layer_impl, static_argnames=("rope_theta", "norm_eps"), donate_argnums=(2,))


def compiled_layer_programs() -> int:
    """How many layer programs are compiled so far (each shape compiles once)."""
    return _layer_jit._cache_size()


def _check_table(block_table: jax.Array | np.ndarray | Sequence[int], max_blocks: int) -> jax.Array:
    """Returns an already padded int32 device table as is, pads anything else."""
    if (isinstance(block_table, jax.Array) and block_table.dtype == jnp.int32
            and block_table.shape == (max_blocks,)):
        return block_table
    return pad_block_table(block_table, max_blocks)


def layer_step(params_i: LayerParams, x: jax.Array, kv_i: jax.Array, block_table: jax.Array,
               start_pos: int, num_valid: int | None = None, *, rope_theta: float = 10000.0,
               norm_eps: float = 1e-5) -> tuple[jax.Array, jax.Array]:
    """Runs one layer over one page of ``block_size`` new tokens (jitted, cache donated).

    Computes K/V for the page, writes them into block
    ``block_table[start_pos // block_size]`` of ``kv_i`` and attends causally
    over positions ``[0, start_pos + num_valid)`` through the block table. One
    compiled program serves every position of every request of this layer
    geometry.

    Args:
        params_i: Weights of the layer.
        x: ``float32[block_size, d_model]`` hidden states of the page.
        kv_i: The layer's cache; it is donated and must not be used afterwards.
        block_table: ``int32[max_blocks_per_seq]`` padded block table (see
            :func:`pad_block_table`).
        start_pos: First position of the page; a multiple of ``block_size``.
        num_valid: Real tokens in the page (``block_size`` unless it is a
            partial last page). Rows beyond are computed and written but never
            attended to.
        rope_theta: RoPE base frequency.
        norm_eps: RMSNorm epsilon.

    Returns:
        ``(x_out, kv_i_new)``: hidden states ``[block_size, d_model]`` and the
        updated cache.
    """
    bs = kv_i.shape[1]
    if x.shape[0] != bs:
        raise ValueError(f"a page has {bs} tokens, got x of shape {x.shape}")
    if start_pos % bs:
        raise ValueError(f"start_pos={start_pos} is not page aligned")
    n = bs if num_valid is None else num_valid
    if not 1 <= n <= bs:
        raise ValueError(f"num_valid={n} outside [1, {bs}]")
    # Scalars always go in as traced int32 so every page hits the same program
    # (a Python constant would be baked in and change the compiled code).
    return _layer_jit(params_i, x, kv_i, block_table, np.int32(start_pos), np.int32(n),
                      rope_theta=float(rope_theta), norm_eps=float(norm_eps))


def decode_layer_step(params_i: LayerParams, x: jax.Array, kv_i: jax.Array,
                      block_table: jax.Array, pos: int, *, rope_theta: float = 10000.0,
                      norm_eps: float = 1e-5) -> tuple[jax.Array, jax.Array]:
    """Runs one layer for a single token at position ``pos`` (jitted, cache donated).

    Writes the token's K/V into row ``pos % block_size`` of block
    ``block_table[pos // block_size]`` (which may be partially filled) and
    attends over positions ``[0, pos]``. Fixed shapes: one program per layer
    geometry for all positions.

    Args:
        params_i: Weights of the layer.
        x: ``float32[1, d_model]`` hidden state of the token.
        kv_i: The layer's cache; donated.
        block_table: ``int32[max_blocks_per_seq]`` padded block table.
        pos: Position of the token.
        rope_theta: RoPE base frequency.
        norm_eps: RMSNorm epsilon.

    Returns:
        ``(x_out [1, d_model], kv_i_new)``.
    """
    if x.shape[0] != 1:
        raise ValueError(f"decode_layer_step takes one token, got x of shape {x.shape}")
    return _layer_jit(params_i, x, kv_i, block_table, np.int32(pos), np.int32(1),
                      rope_theta=float(rope_theta), norm_eps=float(norm_eps))


@jax.jit
def embed(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Embeds ``int32[T]`` tokens with ``table`` ``[vocab, d_model]`` -> ``[T, d_model]``."""
    return jnp.take(table, tokens, axis=0)


@partial(jax.jit, static_argnames=("norm_eps",))
def logits(final_norm: jax.Array, unembed: jax.Array, hidden: jax.Array,
           norm_eps: float = 1e-5) -> jax.Array:
    """Final RMSNorm + unembedding: ``[..., d_model]`` -> ``float32[..., vocab]``."""
    return rms_norm(hidden, final_norm, norm_eps) @ unembed


@partial(jax.jit, static_argnames=("norm_eps",))
def greedy_token(final_norm: jax.Array, unembed: jax.Array, hidden: jax.Array,
                 norm_eps: float = 1e-5) -> jax.Array:
    """Argmax token (int32, lowest id on ties) for one hidden state ``[d_model]``."""
    return jnp.argmax(rms_norm(hidden, final_norm, norm_eps) @ unembed).astype(jnp.int32)


# --------------------------------------------------------------------------
# Model driver
# --------------------------------------------------------------------------


class Model:
    """Host-side driver: runs pages layer by layer and greedy-decodes.

    Cache lists are updated **in place** (the old per-layer arrays are donated
    to XLA and become invalid) and also returned. A ``before_layer(i)`` hook
    may therefore replace ``kv_caches[i]`` in the very list it was given, e.g.
    with the result of a host->device block load; the model reads
    ``kv_caches[i]`` only after the hook returns.

    Attributes:
        cfg: The configuration.
        params: The weights.
    """

    def __init__(self, cfg: ModelConfig, params: Params | None = None, seed: int = 0) -> None:
        """Creates the model.

        Args:
            cfg: Configuration.
            params: Weights; ``init_params(cfg, seed)`` when ``None``.
            seed: Seed used when ``params`` is ``None``.
        """
        self.cfg = cfg
        self.params = init_params(cfg, seed) if params is None else params

    def make_kv_caches(self, num_blocks: int, dtype: Any = jnp.float32) -> list[jax.Array]:
        """Same as :func:`make_kv_caches` for this model's config."""
        return make_kv_caches(self.cfg, num_blocks, dtype)

    def block_table(self, block_ids: Sequence[int] | np.ndarray | jax.Array) -> jax.Array:
        """Pads ``block_ids`` to ``cfg.max_blocks_per_seq`` (see :func:`pad_block_table`)."""
        return _check_table(block_ids, self.cfg.max_blocks_per_seq)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Vocabulary logits of hidden state(s) ``[..., d_model]``."""
        return logits(self.params.final_norm, self.params.unembed, hidden, norm_eps=self.cfg.norm_eps)

    def prefill_page(
        self,
        kv_caches: list[jax.Array],
        tokens16: Sequence[int] | np.ndarray,
        block_table: Sequence[int] | np.ndarray | jax.Array,
        start_pos: int,
        before_layer: Callable[[int], None] | None = None,
    ) -> tuple[list[jax.Array], jax.Array]:
        """Runs all layers over one prompt page and writes its KV.

        Args:
            kv_caches: Per-layer caches; updated in place and returned.
            tokens16: The page's token ids: ``block_size`` of them, or fewer
                for the last partial page of a prompt (padded with id 0 and
                masked; see module docstring).
            block_table: The request's block ids (padded automatically).
            start_pos: Position of the first token; a multiple of ``block_size``.
            before_layer: Called as ``before_layer(i)`` right before layer
                ``i`` is dispatched (e.g. to wait for that layer's KV loads);
                it may replace ``kv_caches[i]``.

        Returns:
            ``(kv_caches, last_hidden)`` where ``last_hidden`` is the
            ``float32[d_model]`` output of the last layer (before the final
            norm) at the page's last *valid* token.
        """
        cfg = self.cfg
        toks = np.asarray(tokens16, np.int32).reshape(-1)
        n = toks.size
        if not 1 <= n <= cfg.block_size:
            raise ValueError(f"a page holds 1..{cfg.block_size} tokens, got {n}")
        if start_pos % cfg.block_size or start_pos + cfg.block_size > cfg.max_seq_len:
            raise ValueError(f"bad page start {start_pos}")
        bt = self.block_table(block_table)
        page = np.zeros((cfg.block_size,), np.int32)
        page[:n] = toks
        x = embed(self.params.embed, jnp.asarray(page))
        for i, p in enumerate(self.params.layers):
            if before_layer is not None:
                before_layer(i)
            x, kv_caches[i] = layer_step(p, x, kv_caches[i], bt, start_pos, n,
                                         rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps)
        return kv_caches, x[n - 1]

    def decode(
        self,
        kv_caches: list[jax.Array],
        block_table: Sequence[int] | np.ndarray | jax.Array,
        prompt_len: int,
        last_hidden: jax.Array,
        max_new_tokens: int,
    ) -> tuple[list[jax.Array], list[int]]:
        """Greedy decoding, one token per step through the single-token path.

        The first token comes from ``last_hidden`` (the prompt's last
        position); each further token feeds the previous one at position
        ``prompt_len + k - 1``, writing its KV into the (possibly partially
        filled) block holding that position. The final token is returned but
        not fed back, so positions ``[0, prompt_len + max_new_tokens - 1)``
        hold KV afterwards.

        Args:
            kv_caches: Per-layer caches holding the prompt's KV; updated in
                place and returned.
            block_table: The request's block ids; must cover
                ``blocks_needed(prompt_len, max_new_tokens)`` blocks.
            prompt_len: Tokens already in the cache.
            last_hidden: ``float32[d_model]`` final-layer hidden state of the
                last prompt token (as returned by :meth:`prefill_page`).
            max_new_tokens: Tokens to generate (>= 0).

        Returns:
            ``(kv_caches, tokens)`` with ``tokens`` a list of ints.
        """
        cfg, prm = self.cfg, self.params
        if max_new_tokens <= 0:
            return kv_caches, []
        need = blocks_needed(prompt_len, max_new_tokens, cfg.block_size)
        if need > cfg.max_blocks_per_seq:
            raise ValueError(f"{need} blocks exceed max_blocks_per_seq={cfg.max_blocks_per_seq}")
        if not isinstance(block_table, jax.Array) and len(block_table) < need:
            raise ValueError(f"block table has {len(block_table)} blocks, {need} needed")
        bt = self.block_table(block_table)
        # Tokens stay on device between steps; only the final list is fetched,
        # so the Python loop never waits for a step to finish.
        tok = greedy_token(prm.final_norm, prm.unembed, last_hidden, norm_eps=cfg.norm_eps)
        out = [tok]
        for k in range(1, max_new_tokens):
            x = embed(prm.embed, tok[None])
            for i, p in enumerate(prm.layers):
                x, kv_caches[i] = decode_layer_step(p, x, kv_caches[i], bt, prompt_len + k - 1,
                                                    rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps)
            tok = greedy_token(prm.final_norm, prm.unembed, x[0], norm_eps=cfg.norm_eps)
            out.append(tok)
        return kv_caches, [int(t) for t in np.asarray(jnp.stack(out))]

    def generate(
        self,
        kv_caches: list[jax.Array],
        prompt_tokens: Sequence[int] | np.ndarray,
        block_table: Sequence[int] | np.ndarray,
        max_new_tokens: int,
        first_page: int = 0,
        before_layer: Callable[[int], None] | None = None,
    ) -> tuple[list[jax.Array], list[int]]:
        """Prefills the prompt page by page from ``first_page`` and greedy-decodes.

        Pages ``0..first_page-1`` must already hold the right KV in the blocks
        ``block_table[0:first_page]`` (e.g. loaded from a prefix cache). If the
        whole prompt is cached (``first_page * block_size >= len(prompt)``) the
        last page is recomputed anyway, because its final hidden state is
        needed for the first token; for a full page this rewrites the same
        bytes. A partial last page is one masked page (module docstring).

        Args:
            kv_caches: Per-layer caches; updated in place and returned.
            prompt_tokens: Prompt token ids (at least one).
            block_table: The request's block ids, at least
                ``blocks_needed(len(prompt), max_new_tokens)`` of them.
            max_new_tokens: Tokens to generate.
            first_page: First page to compute.
            before_layer: Hook passed to :meth:`prefill_page`; called before
                every layer of every computed page, so it should be cheap once
                the layer's loads are complete.

        Returns:
            ``(kv_caches, new_tokens)``.
        """
        cfg = self.cfg
        prompt = np.asarray(prompt_tokens, np.int32).reshape(-1)
        plen = prompt.size
        if plen == 0:
            raise ValueError("empty prompt")
        if first_page < 0:
            raise ValueError("first_page must be >= 0")
        need = blocks_needed(plen, max_new_tokens, cfg.block_size)
        if len(block_table) < need:
            raise ValueError(f"block table has {len(block_table)} blocks, {need} needed")
        bt = self.block_table(block_table)
        n_pages = -(-plen // cfg.block_size)
        last_hidden = None
        for page in range(min(first_page, n_pages - 1), n_pages):
            lo = page * cfg.block_size
            kv_caches, last_hidden = self.prefill_page(
                kv_caches, prompt[lo: lo + cfg.block_size], bt, lo, before_layer)
        return self.decode(kv_caches, bt, plen, last_hidden, max_new_tokens)


# --------------------------------------------------------------------------
# CLI: quick timing
# --------------------------------------------------------------------------


def _bench(cfg: ModelConfig, prompt_len: int, new_tokens: int, dtype: Any, reps: int) -> dict:
    """Times prefill and decode (first call includes compilation)."""
    model = Model(cfg, seed=0)
    n_blocks = blocks_needed(prompt_len, new_tokens, cfg.block_size)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, prompt_len)
    ids = list(range(n_blocks))
    res: dict[str, list[float]] = {"prefill_s": [], "decode_s": []}
    for _ in range(reps + 1):
        kv = model.make_kv_caches(n_blocks, dtype)
        jax.block_until_ready(kv)
        t0 = time.perf_counter()
        bt = model.block_table(ids)
        h = None
        for page in range(-(-prompt_len // cfg.block_size)):
            lo = page * cfg.block_size
            kv, h = model.prefill_page(kv, prompt[lo: lo + cfg.block_size], bt, lo)
        jax.block_until_ready((kv, h))
        t1 = time.perf_counter()
        kv, toks = model.decode(kv, ids, prompt_len, h, new_tokens)
        jax.block_until_ready(kv)
        t2 = time.perf_counter()
        res["prefill_s"].append(t1 - t0)
        res["decode_s"].append(t2 - t1)
    return {
        "first_prefill_s": res["prefill_s"][0], "first_decode_s": res["decode_s"][0],
        "prefill_s": min(res["prefill_s"][1:]), "decode_s": min(res["decode_s"][1:]),
        "tokens": toks,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m kvxfer.demo.model [--preset tiny|mixed] [--scale N] ...``: prints timings."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=("tiny", "mixed"), default="tiny")
    ap.add_argument("--scale", type=int, default=1, help="width multiplier")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    base = tiny_llama() if a.preset == "tiny" else mixed_layers()
    need = blocks_needed(a.prompt_len, a.new_tokens, base.block_size)
    cfg = scaled(base, a.scale, num_layers=a.layers,
                 max_blocks_per_seq=max(base.max_blocks_per_seq, need))
    r = _bench(cfg, a.prompt_len, a.new_tokens, jnp.dtype(a.dtype), a.reps)
    print(f"{a.preset} x{a.scale} layers={cfg.num_layers} d_model={cfg.d_model} "
          f"dtype={a.dtype} backend={jax.default_backend()}")
    print(f"prefill {a.prompt_len} tok: {r['prefill_s'] * 1e3:.1f} ms "
          f"(first call incl. compile {r['first_prefill_s'] * 1e3:.0f} ms)")
    print(f"decode {a.new_tokens} tok: {r['decode_s'] * 1e3:.1f} ms "
          f"(first call incl. compile {r['first_decode_s'] * 1e3:.0f} ms)")
    print(f"tokens: {r['tokens']}")


if __name__ == "__main__":
    main()
