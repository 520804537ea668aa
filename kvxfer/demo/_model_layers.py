"""The demo model's layer programs: one jitted decoder layer for a page or a token.

Architecture of a layer: RMSNorm -> GQA attention with RoPE over the request's
paged KV (gathered through its block table) -> residual -> RMSNorm -> SwiGLU
MLP -> residual. One compiled program per layer geometry serves every position
of every request (``kvxfer.demo.model`` states the determinism contract these
programs keep). Also the embedding, the logits and the greedy token.

Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.ones((1, 2, 4))  # [T, H, head_dim]
    >>> bool(jnp.allclose(rope(x, jnp.zeros((1,), jnp.int32), 10000.0), x))
    True
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["LayerParams", "rms_norm", "rope", "layer_step", "decode_layer_step", "embed",
           "logits", "greedy_token", "compiled_layer_programs"]

LayerParams = dict[str, jax.Array]
"""Per-layer weights: attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down."""


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
