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

The model's rooms: ``_model_config`` (``ModelConfig``, ``LayerKV``, the presets),
``_model_layers`` (the jitted layer programs); this module holds the weights,
the caches, the block tables and the ``Model`` driver, and re-exports the rest.

Example:
    >>> m = Model(tiny_llama())
    >>> kv = m.make_kv_caches(4)
    >>> kv, tokens = m.generate(kv, list(range(1, 20)), [0, 1], 3)
    >>> len(tokens), kv[0].shape
    (3, (4, 16, 2, 2, 32))
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvxfer.demo._model_config import (LayerKV, ModelConfig, blocks_needed, mixed_layers,
                                       scaled, tiny_llama)
from kvxfer.demo._model_layers import (LayerParams, compiled_layer_programs,
                                       decode_layer_step, embed, greedy_token, layer_step,
                                       logits, rms_norm, rope)

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


def _check_table(block_table: jax.Array | np.ndarray | Sequence[int], max_blocks: int) -> jax.Array:
    """Returns an already padded int32 device table as is, pads anything else."""
    if (isinstance(block_table, jax.Array) and block_table.dtype == jnp.int32
            and block_table.shape == (max_blocks,)):
        return block_table
    return pad_block_table(block_table, max_blocks)


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