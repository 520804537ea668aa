"""The accelerator routes' programs, lowered for CUDA on this CPU machine, compute on no
value placed in host memory (XLA:GPU would run such arithmetic on the CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvxfer.engine import _programs
from kvxfer.engine._mover import _sds

from checkers import host_arithmetic

DEVICE = jax.devices()[0]
PINNED = jax.sharding.SingleDeviceSharding(DEVICE, memory_kind="pinned_host")
B = 4


def _caches(dtype="bfloat16", layers=3):
    return tuple(jax.ShapeDtypeStruct((16, 8, 64), jnp.dtype(dtype),
                                      sharding=jax.sharding.SingleDeviceSharding(DEVICE))
                 for _ in range(layers))


def _index_args(with_digest):
    ids = _sds((B,), np.int32, DEVICE)
    count = _sds((), np.int32, DEVICE)
    digest = (_sds((B, 5), np.uint32, DEVICE), _sds((3,), np.uint32, DEVICE))
    return ids, count, digest if with_digest else ()


def _programs_of_the_routes():
    """(name, kind, arrays, args, with_digest, options) of every transfer program the
    DMA mover and the pinned mover's pages route run on an accelerator."""
    from kvxfer.engine import _pinned_pages, dma  # noqa: F401 - registers the kinds

    caches = _caches()
    words = 3 * 8 * 64 * 2 // 2
    for with_digest in (True, False):
        ids, count, digest = _index_args(with_digest)
        token = _sds((1,), np.uint32, DEVICE)
        for relayout in (False, True):
            options = (relayout, False, 2)
            yield (f"dma_load-relayout{relayout}-digest{with_digest}", "dma_load", caches,
                   (token, ids, count, *digest), with_digest, options)
            for side in (False, True):  # copies on XLA's stream, or beside it
                yield (f"dma_offload-relayout{relayout}-side{side}-digest{with_digest}",
                       "dma_offload", caches, (token, ids, count, *digest), with_digest,
                       options + (side,))
        # Loads beside XLA's stream: the staging program, and the load from staging
        # (a wait per layer group).
        yield (f"dma_load_side-digest{with_digest}", "dma_load_side", caches,
               (token, _sds((B + 1, words), np.uint16, DEVICE), ids, count, *digest),
               with_digest, (((0, 1), (1, 3)), False, 2, words // 3))
        yield (f"pages_offload-digest{with_digest}", "pages_offload", caches,
               (ids, count, *digest), with_digest, (2, False, B, PINNED))
        rows = tuple(_sds((words,), np.uint16, DEVICE) for _ in range(B))
        yield (f"pages_load-digest{with_digest}", "pages_load", caches,
               (rows, ids, count, *digest), with_digest, (2, False))


    yield ("dma_stage", "dma_stage", (_sds((1,), np.uint32, DEVICE),), (), False,
           (B, words, "uint16"))


CASES = list(_programs_of_the_routes())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_no_arithmetic_reads_host_memory(case):
    _, kind, arrays, args, with_digest, options = case
    text = _programs.lowered_for("cuda", kind, arrays, *args, with_digest=with_digest,
                                 options=options)
    assert "stablehlo" in text
    assert host_arithmetic(text) == []
    if kind == "pages_offload":  # its pages do go out to pinned memory
        assert text.count('_xla_buffer_placement = "pinned_host"') >= B


def test_the_check_finds_arithmetic_on_host_memory():
    """What the pinned mover's old route did: a digest over a buffer in pinned memory."""
    def bad(x, p):
        on_device = jax.device_put(p, jax.sharding.SingleDeviceSharding(DEVICE))
        return x + on_device, jnp.sum(p.astype(jnp.float32))

    text = jax.jit(bad, in_shardings=(None, PINNED)).trace(
        jax.ShapeDtypeStruct((8, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 128), jnp.bfloat16, sharding=PINNED)).lower(
        lowering_platforms=("cuda",)).as_text()
    found = host_arithmetic(text)
    assert len(found) == 1 and found[0].startswith("stablehlo.convert")
