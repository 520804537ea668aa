"""What the demo serves: requests that share system prompts, and their tokens with no cache.

``make_workload`` builds the requests; ``shard_caches`` places the model's KV
caches over devices (KV heads split); ``reference_tokens`` generates every
request with a fresh cache and no prefix reuse, the run whose tokens the served
ones must equal.

Example:
    >>> from kvxfer.demo import model
    >>> reqs = make_workload(model.tiny_llama(), 3, system_pages=(2,))
    >>> [r.prompt[:32] == reqs[0].prompt[:32] for r in reqs]  # one shared system prompt
    [True, True, True]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from kvxfer.demo import model as _model
from kvxfer.demo.server import Request

__all__ = ["make_workload", "shard_caches", "reference_tokens"]


def make_workload(cfg: _model.ModelConfig, num_requests: int, seed: int = 0, *,
                  system_pages: Sequence[int] = (6, 8, 10), new_tokens: int = 8) -> list[Request]:
    """Requests sharing a few long system prompts, each with a short unique suffix.

    The first requests take the system prompts in turn (so every prompt is cached
    early); later ones pick one at random. Suffixes are 1..block_size-1 tokens, so
    every prompt ends in a partial page that is computed, never cached.

    Example:
        >>> from kvxfer.demo import model
        >>> reqs = make_workload(model.tiny_llama(), 4, system_pages=(2, 3))
        >>> [r.system for r in reqs][:2], [len(r.prompt) // 16 for r in reqs][:2]
        ([0, 1], [2, 3])
        >>> all(len(r.prompt) % 16 for r in reqs)  # every prompt ends in a partial page
        True
    """
    bs = cfg.block_size
    rng = np.random.default_rng([seed, 7])
    systems = [rng.integers(1, cfg.vocab_size, n * bs) for n in system_pages]
    out = []
    for rid in range(num_requests):
        s = rid % len(systems) if rid < len(systems) else int(rng.integers(len(systems)))
        suffix = rng.integers(1, cfg.vocab_size, int(rng.integers(1, bs)))
        prompt = np.concatenate([systems[s], suffix]).astype(np.int32)
        out.append(Request(rid, tuple(int(t) for t in prompt), new_tokens, s))
    return out


def shard_caches(caches: Sequence[jax.Array], devices: Sequence[Any]) -> list[jax.Array]:
    """Places caches over ``devices``: KV heads (dim 3) split where they divide evenly.

    Layers whose head count does not divide are replicated (the manager stores a
    replicated layer once and loads it into every replica). The block dim is never
    sharded: the manager moves whole blocks per shard.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> caches = shard_caches([jnp.zeros((4, 16, 2, 2, 32))], jax.devices()[:1])
        >>> caches[0].sharding.device_set == {jax.devices()[0]}
        True
    """
    if len(devices) == 1:
        return [jax.device_put(a, devices[0]) for a in caches]
    mesh = jax.sharding.Mesh(np.array(devices), ("kv",))
    P = jax.sharding.PartitionSpec
    return [jax.device_put(a, jax.sharding.NamedSharding(
        mesh, P(None, None, None, "kv", None) if a.shape[3] % len(devices) == 0 else P()))
        for a in caches]


def reference_tokens(model: _model.Model, requests: Sequence[Request],
                     make_caches: Callable[[], list[jax.Array]],
                     progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """Generates every request with a fresh cache and no prefix reuse (``Model.generate``).

    Args:
        model: The decoder.
        requests: The requests.
        make_caches: Returns fresh, empty KV caches (called once per request).
        progress: Called with the number of requests done after each one.

    Returns:
        Each request's generated tokens.

    Example:
        >>> from kvxfer.demo import model
        >>> m = model.Model(model.tiny_llama())
        >>> [toks] = reference_tokens(m, [Request(0, tuple(range(1, 20)), 2)],
        ...                           lambda: m.make_kv_caches(4))
        >>> len(toks)
        2
    """
    out = []
    for r in requests:
        need = _model.blocks_needed(len(r.prompt), r.max_new_tokens, model.cfg.block_size)
        _, toks = model.generate(make_caches(), r.prompt, list(range(need)), r.max_new_tokens)
        out.append(list(toks))
        if progress is not None:
            progress(len(out))
    return out
