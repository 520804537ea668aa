"""Rigs for the engine-loop and value-semantics tests: caches, steps, reads, a host model.

A *rig* is one way an engine holds its caches: ``raw`` (single-device float32, moved
by raw byte copies on XLA:CPU), ``staged`` (bfloat16, ``path="staged"``), ``sharded``
(KV heads split over 4 devices, ``path="auto"``), ``pinned`` (bfloat16,
``path="pinned"``), ``pinned-sharded`` (the sharded caches on ``path="pinned"``),
``dma`` (bfloat16, ``path="dma"``), ``dma-sharded`` (the sharded caches on it) and
``pages-sharded`` (the sharded caches on the pinned mover's pages route).
Each builds small caches (4 layers x 32 blocks x 16 KiB) and the manager over them.

The jitted programs here are what a serving engine dispatches around kvxfer's calls:

* ``step``: a donating decode step. For every layer it writes block ``w`` with the
  bits of block ``r`` XOR a per-layer pattern, so the step both *reads* the cache
  (a stale read corrupts what it writes) and *writes* it, and the host can compute
  the result exactly (``HostModel.step``).
* ``read_bits``: a plain (non-donating) jitted read of some blocks, as raw bits.
* ``slow_read_bits``: the same read behind a ~0.3 s loop of matmuls whose result
  the read depends on, so the read happens late in a program dispatched early.

Everything is compared as raw bits (``kvxfer.testing.bits``).

``KVXFER_TEST_SERIALIZE=1`` in the environment makes every rig's manager wait for each
transfer inside ``offload()`` / ``load()`` (``SerializedManager``): an engine that
trivially keeps the rule as far as timing goes. The tests that fail only because
work is left on the transfer thread pass under it, which checks the tests themselves;
those that still fail there break the rule some other way (raw writes into buffers a
pending computation reads, a wrong key freeing a page).

bfloat16 note (measured, jax 0.10.2): XLA:CPU's bf16 scatter goes through f32 over
the whole buffer and canonicalizes every NaN in it (0x7ff6 -> 0x7fc0), so a donated
``c.at[w].set(v)`` on a bf16 cache changes NaN bits in blocks it never wrote. The
bf16 rigs' caches and patterns therefore keep exponent bit 14 clear (no NaN, no
Inf can arise, XOR included); float32 rigs use fully random bits, NaNs included
(float32 scatters are exact).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import kvxfer
from kvxfer import testing

NUM_LAYERS = 4
NUM_BLOCKS = 32


@dataclasses.dataclass(frozen=True)
class Rig:
    """How the caches are built and moved.

    Attributes:
      name: the test id.
      dtype: element type of the caches.
      block: the shape of one block (16 KiB).
      path: the manager's ``path=``.
      expect_paths: what ``mgr.paths`` must say for every layer (None: not checked).
      shard_dim: the cache dim split over devices (None: single device).
      mask: the bits caches and step patterns may hold (None: all; see the module
        docstring).
      pinned_mode: the manager's ``pinned_route`` (None: the platform's).
    """

    name: str
    dtype: str
    block: tuple[int, ...]
    path: str
    expect_paths: str | None
    shard_dim: int | None = None
    mask: int | None = None
    pinned_mode: str | None = None

    @property
    def uint(self) -> np.dtype:
        return np.dtype(f"u{np.dtype(jnp.dtype(self.dtype)).itemsize}")

    def sharding(self) -> jax.sharding.Sharding:
        if self.shard_dim is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        devices = jax.devices()
        assert len(devices) >= 4, "conftest.py gives 4 CPU devices"
        spec = [None] * (1 + len(self.block))
        spec[self.shard_dim] = "kv"
        return NamedSharding(Mesh(np.array(devices[:4]), ("kv",)), P(*spec))

    def caches(self, seed: int = 0) -> list[jax.Array]:
        """Fresh caches ``[NUM_BLOCKS, *block]`` per layer, each on its own buffers."""
        if self.mask is None:
            return testing.random_caches(NUM_LAYERS, NUM_BLOCKS, self.block, self.dtype,
                                         sharding=self.sharding(), seed=seed)
        s = self.sharding()
        out = []
        for i in range(NUM_LAYERS):
            raw = testing.bits(testing.random_bits((NUM_BLOCKS, *self.block), self.dtype,
                                                   seed=(seed, i)))
            host = (raw & self.uint.type(self.mask)).view(jnp.dtype(self.dtype))
            out.append(jax.device_put(jax.device_put(host, s), s, may_alias=False))
        jax.block_until_ready(out)
        return out

    def manager(self, caches: Sequence[jax.Array], num_host_blocks: int = 64,
                **kwargs) -> kvxfer.KVCacheManager:
        mgr = kvxfer.KVCacheManager(caches, num_host_blocks=num_host_blocks,
                                    path=self.path, pinned_route=self.pinned_mode, **kwargs)
        if self.expect_paths is not None:
            assert mgr.paths == [self.expect_paths] * NUM_LAYERS, mgr.paths
        if os.environ.get("KVXFER_TEST_SERIALIZE") == "1":
            return SerializedManager(mgr)
        return mgr

    def patterns(self, seed: tuple[int, ...]) -> list[np.ndarray]:
        """One XOR pattern per layer (never all zero), deterministic in ``seed``."""
        out = []
        for i in range(NUM_LAYERS):
            p = testing.bits(testing.random_bits(self.block, self.uint, seed=(*seed, i)))
            if self.mask is not None:
                p = p & self.uint.type(self.mask)
            p.flat[0] |= 1  # a step always changes the block it writes
            out.append(p)
        return out

    def page_bytes(self, block_bits: np.ndarray) -> bytes:
        """What ``mgr.read_block_bytes(page, layer)`` holds for a block of these bits.

        Sharded layers are stored shard-major: each shard's part of the block, in the
        order of its position along the sharded dim.
        """
        if self.shard_dim is None:
            return np.ascontiguousarray(block_bits).tobytes()
        parts = np.split(block_bits, 4, axis=self.shard_dim - 1)
        return b"".join(np.ascontiguousarray(p).tobytes() for p in parts)


class SerializedManager:
    """A manager whose ``offload()`` and ``load()`` return only once the transfer is done.

    Errors stay on the handles (``wait()`` / ``result()`` raise them as usual).
    Everything else is the wrapped manager's.
    """

    def __init__(self, mgr: kvxfer.KVCacheManager):
        self._mgr = mgr

    def offload(self, kv_caches, device_blocks, keys):
        handle = self._mgr.offload(kv_caches, device_blocks, keys)
        try:
            handle.wait()
        except kvxfer.TransferError:
            pass
        return handle

    def load(self, kv_caches, pages, device_blocks, keys=None, gate="all"):
        new, handle = self._mgr.load(kv_caches, pages, device_blocks, keys=keys, gate=gate)
        try:
            handle.result()
        except kvxfer.TransferError:
            pass
        return new, handle

    def __getattr__(self, name):
        return getattr(self._mgr, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._mgr.close()


RIGS = {
    "raw": Rig("raw", "float32", (32, 128), "auto", "raw"),
    "staged": Rig("staged", "bfloat16", (64, 128), "staged", "staged", mask=0xBFFF),
    # [blocks, rows, kv_heads, head_dim]: the 4 KV heads split over the 4 devices.
    "sharded": Rig("sharded", "float32", (8, 4, 128), "auto", None, shard_dim=2),
    "pinned": Rig("pinned", "bfloat16", (64, 128), "pinned", "pinned", mask=0xBFFF),
    # Three of the four shards live off the pool's device: pinned buffers of their own.
    "pinned-sharded": Rig("pinned-sharded", "float32", (8, 4, 128), "pinned", "pinned",
                          shard_dim=2),
    # The DMA mover's programs and descriptors, run by the host copy engine.
    "dma": Rig("dma", "bfloat16", (64, 128), "dma", "dma", mask=0xBFFF),
    "dma-sharded": Rig("dma-sharded", "float32", (8, 4, 128), "dma", "dma", shard_dim=2),
    # The pinned mover's pages route (what a GPU without a copy engine runs), sharded.
    "pages-sharded": Rig("pages-sharded", "float32", (8, 4, 128), "pinned", "pinned",
                         shard_dim=2, pinned_mode="pages"),
}
def _cpu_only(rig: Rig) -> str | None:
    """Why a rig runs on XLA:CPU alone (None: it runs on any backend)."""
    if rig.shard_dim is not None:
        return "its caches are split over 4 devices (conftest.py's CPU devices)"
    if rig.expect_paths == "raw":
        return "the raw mover copies XLA:CPU buffers"
    return None


#: The rigs as test parameters: those built on XLA:CPU facts are marked ``cpu``
#: (skipped, with the reason, on other backends: conftest.py).
RIG_NAMES = [pytest.param(name, marks=pytest.mark.cpu(_cpu_only(rig))) if _cpu_only(rig)
             else name for name, rig in RIGS.items()]


# -- jitted programs an engine dispatches -----------------------------------------------

def _as_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))


def _step(caches, w, r, patterns):
    out = []
    for c, p in zip(caches, patterns):
        v = jax.lax.bitcast_convert_type(_as_bits(c[r]) ^ p, c.dtype)
        out.append(c.at[w].set(v))
    return out


_step_jit = jax.jit(_step, donate_argnums=0)


def step(caches: Sequence[jax.Array], w: int, r: int,
         patterns: Sequence[np.ndarray]) -> list[jax.Array]:
    """The donating decode step: block ``w`` of every layer := bits(block r) ^ pattern.

    The input caches are donated (deleted); use the returned ones.
    """
    return _step_jit(list(caches), np.int32(w), np.int32(r), list(patterns))


@jax.jit
def _read(caches, ids):
    return [_as_bits(c[ids]) for c in caches]


def read_bits(caches: Sequence[jax.Array], ids: Sequence[int]) -> list[jax.Array]:
    """Dispatches a read of blocks ``ids`` of every layer (as bits); does not wait."""
    return _read(list(caches), np.asarray(ids, np.int32))


_W = np.full((256, 256), 1.0 / 256, np.float32)


@jax.jit
def _slow_read(caches, ids, n):
    m = jax.lax.fori_loop(0, n, lambda i, m: jnp.tanh(m @ _W + 1.0), jnp.zeros((256, 256)))
    # The ids depend on the loop's result, so the blocks are read after the loop.
    late = jnp.where(jnp.isnan(m.sum()), 0, ids)
    return [_as_bits(c[late]) for c in caches]


def slow_read_bits(caches: Sequence[jax.Array], ids: Sequence[int], n: int
                   ) -> list[jax.Array]:
    """Dispatches a read of blocks ``ids`` that happens after ``n`` matmuls."""
    return _slow_read(list(caches), np.asarray(ids, np.int32), np.int32(n))


@functools.cache
def slow_iterations(rig_name: str, seconds: float = 0.3) -> int:
    """How many loop iterations make ``slow_read_bits`` take about ``seconds``."""
    caches = RIGS[rig_name].caches(seed=99)
    jax.block_until_ready(slow_read_bits(caches, [0], 1))
    n = 50
    while True:
        t = time.perf_counter()
        jax.block_until_ready(slow_read_bits(caches, [0], n))
        dt = time.perf_counter() - t
        if dt > 0.05 or n > 1 << 20:
            return max(1, int(n * seconds / dt))
        n *= 4


def host_bits(caches: Sequence[jax.Array]) -> list[np.ndarray]:
    """Host copies of every layer's bits (waits for the arrays)."""
    return [testing.bits(c) for c in caches]


# -- the host model -------------------------------------------------------------------

class HostModel:
    """What every block of every layer must hold, in program order.

    The contract under test is sequential semantics: every transfer acts at the
    point of its call, and later computations see it. So offload snapshots the
    blocks at its call, load writes the pages at its call, and a step acts at its call.
    """

    def __init__(self, caches: Sequence[jax.Array]):
        self.blocks = host_bits(caches)

    def snapshot(self, ids: Sequence[int]) -> list[np.ndarray]:
        """Per layer, the bits of blocks ``ids`` now: ``[len(ids), *block]``."""
        ids = np.asarray(ids)
        return [b[ids].copy() for b in self.blocks]

    def step(self, w: int, r: int, patterns: Sequence[np.ndarray]) -> None:
        for b, p in zip(self.blocks, patterns):
            b[w] = b[r] ^ p

    def load(self, ids: Sequence[int], contents: Sequence[np.ndarray]) -> None:
        ids = np.asarray(ids)
        for b, c in zip(self.blocks, contents):
            b[ids] = c

    def mismatches(self, caches: Sequence[jax.Array]) -> list[str]:
        """Where the caches differ from the model: 'layer L block B' strings."""
        out = []
        for i, (got, want) in enumerate(zip(host_bits(caches), self.blocks)):
            bad = np.flatnonzero((got != want).reshape(got.shape[0], -1).any(axis=1))
            out += [f"layer {i} block {int(b)}" for b in bad]
        return out


def differing_blocks(got: Sequence[np.ndarray], want: Sequence[np.ndarray],
                     ids: Sequence[int]) -> list[str]:
    """'layer L block B' for each block of ``ids`` whose bits differ."""
    out = []
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, (g.shape, w.shape)
        for j, b in enumerate(ids):
            if not np.array_equal(g[j], w[j]):
                out.append(f"layer {i} block {int(b)}")
    return out


def page_mismatches(rig: Rig, mgr: kvxfer.KVCacheManager, pages: Sequence[kvxfer.PageRef],
                    contents: Sequence[np.ndarray]) -> list[str]:
    """Pages whose host bytes differ from ``contents`` (per layer ``[k, *block]``)."""
    out = []
    for j, page in enumerate(pages):
        for i in range(NUM_LAYERS):
            if mgr.read_block_bytes(page, i) != rig.page_bytes(contents[i][j]):
                out.append(f"page {j} ({page}) layer {i}")
    return out
