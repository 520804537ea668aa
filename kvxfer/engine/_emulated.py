"""The emulated mover: raw byte-range copies over emulated TPU device memory.

For layouts the inspector has proven addressable; ``kvxfer.emulate`` builds the byte
image an array has in TPU memory under its layout, and blocks are copied from and to
that image as a DMA engine would copy them from HBM.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import jax
import numpy as np

from kvxfer import emulate
from kvxfer import integrity
from kvxfer.engine._batch import assemble, device_of
from kvxfer.engine._mover import LoadRequest, Mover, Pending
from kvxfer.hostpool import ClassPool
from kvxfer.layout import LayoutError, inspect
from kvxfer.plan import SliceClass

__all__ = ["EmulatedMover"]


class EmulatedOffload(NamedTuple):
    """Per shard, the blocks read ``uint8[L, k, bytes]``, and their digests (or None)."""

    out: list[np.ndarray]
    digests: np.ndarray | None


def _buffer_key(local: jax.Array) -> tuple[int, int]:
    # Per-shard views of an array are new Python objects over the same buffer.
    return device_of(local).id, local.unsafe_buffer_pointer()


class EmulatedMover(Mover[EmulatedOffload, None, None]):
    """Direct copies over emulated TPU memory, for proven-addressable layouts."""

    name = "emulated"

    def __init__(self, cls: SliceClass, pool: ClassPool):
        super().__init__(cls, pool)
        self._layout = cls.layout
        # The device memory of arrays this mover wrote: their images as written,
        # padding bytes included, as HBM would keep them after a DMA. Held only
        # while the array lives.
        self._written: dict[int, tuple[weakref.ref, np.ndarray]] = {}

    def _geometry(self, local: jax.Array):
        g = inspect(local.shape, local.dtype, self._layout)
        if not g.addressable:
            raise LayoutError(f"Direct copy refused for class {self.cls.name}: {g.reason}")
        if g.bytes_per_block != self.cls.shard_block_bytes:
            raise LayoutError(f"class {self.cls.name}: shard blocks are {g.bytes_per_block} "
                              f"bytes under {self._layout}, the plan has "
                              f"{self.cls.shard_block_bytes}")
        return g

    def _image(self, local: jax.Array) -> np.ndarray:
        held = self._written.get(_buffer_key(local))
        if held is not None:
            owner = held[0]()
            # A donated owner's buffer may hold a later step's bytes by now.
            if owner is not None and not owner.is_deleted():
                return held[1]
        return emulate.to_image(np.asarray(local), self._layout)

    def _remember(self, array: jax.Array, images: list[np.ndarray]) -> None:
        """Keeps the images written under ``array``'s shards while ``array`` lives."""
        for shard, image in zip(array.addressable_shards, images):
            self._remember_one(_buffer_key(shard.data), array, image)

    def _remember_one(self, key: tuple[int, int], array: jax.Array,
                      image: np.ndarray) -> None:
        written = self._written

        def forget(ref: weakref.ref) -> None:
            if written.get(key, (None,))[0] is ref:  # not a newer array on that buffer
                del written[key]

        written[key] = (weakref.ref(array, forget), image)

    def _read(self, layers, ids, positions, replica: int = 0) -> list[np.ndarray]:
        """Per shard, ``uint8[len(positions), k, bytes]`` read from the device images."""
        out = []
        for s in range(self.cls.num_shards):
            out.append(np.stack([
                emulate.read_blocks(self._image(layers[p].shards[s][replica]),
                                    self._geometry(layers[p].shards[s][replica]), ids)
                for p in positions]))
        return out

    def _digest_raw(self, raw: list[np.ndarray], batch, positions) -> np.ndarray:
        out = []
        for s, r in enumerate(raw):
            ident = np.stack([batch.identity(self.cls.layers[p], s) for p in positions])
            out.append(self._digest_np(r, ident))
        return np.stack(out, axis=1)

    def start_offload(self, layers, batch, slots, with_digest):
        positions = range(len(layers))
        out = self._read(layers, batch.ids, positions)
        digests = self._digest_raw(out, batch, positions) if with_digest else None
        return EmulatedOffload(out, digests)

    @staticmethod
    def _digest_np(raw: np.ndarray, identity: np.ndarray) -> np.ndarray:
        return integrity.digest_np(integrity.as_words_np(raw, batch_dims=2), identity)

    def finish_offload(self, state: EmulatedOffload, slots):
        out, digests = state
        for s, raw in enumerate(out):
            for pos in range(raw.shape[0]):
                lo, hi = self.pool.shard_range(pos, s)
                self.pool.data[slots, lo:hi] = raw[pos]
                self.copied_on_host(raw[pos].nbytes)
            if digests is not None:
                self._store_digests(slots, s, digests[:, s])

    def warmup(self, arrays, layers, b, with_digest):
        pass  # host-side numpy: nothing to compile

    def start_load(self, arrays, layers, request: LoadRequest, staged: None):
        batch, slots = request.batch, request.slots
        ids, new = batch.ids, []
        for pos, (arr, layer) in enumerate(zip(arrays, layers)):
            shards, images = [], {}
            for s, reps in enumerate(layer.shards):
                lo, hi = self.pool.shard_range(pos, s)
                src = self.pool.data[slots, lo:hi]
                self.copied_on_host(src.nbytes * len(reps))
                out = []
                for a in reps:
                    image = self._image(a)
                    emulate.write_blocks(image, self._geometry(a), ids, src)
                    host = emulate.from_image(image, a.shape, a.dtype, self._layout)
                    written = jax.device_put(host, device_of(a))
                    images[_buffer_key(written)] = image
                    out.append(written)
                shards.append(out)
            array = assemble(arr, shards)
            self._remember(array, [images[_buffer_key(sh.data)]
                                   for sh in array.addressable_shards])
            new.append(array)
        return new, None

    def digests(self, layers, batch, positions, replica=0):
        done = self._digest_raw(self._read(layers, batch.ids, positions, replica), batch,
                                positions)
        return _Done(done)


class _Done(Pending):
    """Digests already computed (numpy, on the host image)."""

    def __init__(self, value: np.ndarray):
        super().__init__([], 0)
        self._value = value

    def get(self) -> np.ndarray:
        return self._value
