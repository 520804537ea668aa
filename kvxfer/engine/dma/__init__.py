"""The DMA mover: copy-engine copies between the caches and a pinned host pool, in
XLA's order, beside its stream where the copy engine has streams of its own.

By idea: ``_options`` (``DmaOptions``, how it runs), ``_copies`` (copy descriptors,
the host copy engine, device addresses, test hooks), ``_cuda`` (the CUDA driver's copy
engine), ``_jobs`` (a program's copies, the tickets its callback finds them by, the
callback), ``_staging`` (what a transfer enqueued and the device staging it holds),
``_programs`` (the jitted programs) and ``_mover`` (``DmaMover``).
"""

from kvxfer.engine.dma._copies import CALLBACK_STEPS as CALLBACK_STEPS
from kvxfer.engine.dma._copies import HOOKS as HOOKS
from kvxfer.engine.dma._cuda import is_cuda as is_cuda
from kvxfer.engine.dma._mover import COPY_ENGINES as COPY_ENGINES
from kvxfer.engine.dma._mover import RELAYOUT_BELOW as RELAYOUT_BELOW
from kvxfer.engine.dma._mover import DmaMover as DmaMover
from kvxfer.engine.dma._mover import copy_engine as copy_engine
from kvxfer.engine.dma._mover import dma_refusal as dma_refusal
from kvxfer.engine.dma._options import DmaOptions as DmaOptions
from kvxfer.engine.dma._staging import Staging as _Staging

staging_bytes_held = _Staging.bytes_held

__all__ = ["DmaMover", "DmaOptions", "COPY_ENGINES", "copy_engine", "dma_refusal",
           "RELAYOUT_BELOW", "CALLBACK_STEPS", "HOOKS", "is_cuda", "staging_bytes_held"]
