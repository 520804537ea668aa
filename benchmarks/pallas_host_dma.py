"""Which Pallas DMA forms between HBM and host memory the TPU compiler takes, deviceless.

The Pallas mover copies one block per DMA between a cache in HBM and a buffer in
``pinned_host`` memory (``pl.HOST``). libtpu 0.0.42.1 (the one jax 0.10.2 pins)
refuses a DMA whose host-side offset is a runtime value for most tilings
(``LLO_CHECK ... multiplier_in_bytes % word_size == 0``), so the kernels put each
page at a static row of a page buffer and unroll their pages. This script compiles,
for each generation and dtype, the candidate forms of an offload kernel of ``--pages``
pages and ``--layers`` layers of ``[N, *block]`` caches, and prints whether each
compiled and how long it took:

* ``dynamic-slot``: ``host[slots[j], l]`` in a ``pl.loop`` (the pool written in place);
* ``dynamic-dense``: the same into a host buffer asked for untiled, row-major;
* ``static-rows``: ``host[j, l]`` unrolled over pages and layers in one kernel;
* ``static-rows-1-layer``: one layer a kernel, its pages unrolled (what the mover runs).

Usage:  JAX_PLATFORMS=cpu python benchmarks/pallas_host_dma.py [--targets v4 v6e ...]
            [--dtypes bfloat16 ...] [--pages 64] [--layers 8] [--block 16,8,128]

Needs libtpu (``pip install 'kvxfer[tpu]'``); no TPU.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.layout import Format, Layout  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from kvxfer import tpu  # noqa: E402
from kvxfer.engine import _pallas_kernels as kernels  # noqa: E402


def _candidate(form: str, block: tuple[int, ...], dtype, pages: int, layers: int, device):
    """Compiles one candidate form; returns the compiled program."""
    single = jax.sharding.SingleDeviceSharding(device)
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    cache = jax.ShapeDtypeStruct((4 * pages, *block), dtype, sharding=single)
    ids = jax.ShapeDtypeStruct((pages,), np.int32, sharding=single)
    n = jax.ShapeDtypeStruct((1,), np.int32)
    if form == "static-rows-1-layer":  # the mover's own kernel
        buffer = jax.ShapeDtypeStruct((pages, 1, *block), dtype)
        return kernels.offload_program((cache.format,), buffer, device).lower(
            n, ids, (cache,)).compile()
    if form == "static-rows":
        buffer = jax.ShapeDtypeStruct((pages, layers, *block), dtype)
        return kernels.offload_program((cache.format,) * layers, buffer, device).lower(
            n, ids, (cache,) * layers).compile()
    # The dynamic forms: the slot of each page a runtime value read from SMEM.
    shape = (pages, layers, *block)

    def kernel(n_ref, ids_ref, slots_ref, *refs):
        caches, (out, sems) = refs[:layers], refs[layers:]
        for l in range(layers):
            @pl.loop(0, n_ref[0])
            def _(j):
                c = pltpu.make_async_copy(caches[l].at[ids_ref[j]], out.at[slots_ref[j], l],
                                          sems.at[l])
                c.start()
                c.wait()

    def f(n, ids, slots, caches):
        return pl.pallas_call(
            kernel, out_shape=pl.HOST(shape, dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=3, grid=(1,),
                in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * layers,
                out_specs=pl.BlockSpec(memory_space=pl.HOST),
                scratch_shapes=[pltpu.SemaphoreType.DMA((layers,))]))(n, ids, slots, *caches)

    out = host if form == "dynamic-slot" else \
        Format(Layout(tuple(range(len(shape))), tiling=()), host)
    return jax.jit(f, out_shardings=out).lower(
        n, ids, jax.ShapeDtypeStruct((pages,), np.int32), (cache,) * layers).compile()


FORMS = ("dynamic-slot", "dynamic-dense", "static-rows", "static-rows-1-layer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=list(tpu.GENERATIONS))
    parser.add_argument("--dtypes", nargs="+",
                        default=["bfloat16", "float32", "float8_e4m3fn", "int8"])
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--block", default="16,8,128", help="one block's shape")
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    args = parser.parse_args()
    block = tuple(int(d) for d in args.block.split(","))
    print(f"libtpu {tpu.require_compiler()}, jax {jax.__version__}: offload kernels of "
          f"{args.pages} pages x {args.layers} layers of [{','.join(map(str, block))}] blocks")
    for target in args.targets:
        device = tpu.target_devices(target, 1)[0]
        for dtype in args.dtypes:
            for form in args.forms:
                start = time.perf_counter()
                try:
                    _candidate(form, block, jnp.dtype(dtype), args.pages, args.layers, device)
                    verdict = "compiles"
                except Exception as e:  # noqa: BLE001 - XLA's errors carry no common type
                    verdict = "REFUSED: " + (str(e).strip().splitlines() or ["?"])[0][:110]
                seconds = time.perf_counter() - start
                print(f"{target:6} {dtype:14} {form:20} {seconds:6.2f} s  {verdict}",
                      flush=True)


if __name__ == "__main__":
    main()
