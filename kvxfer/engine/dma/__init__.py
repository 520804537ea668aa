"""The DMA mover: copy-engine copies between the caches and a pinned host pool, in
XLA's order, beside its stream where the copy engine has streams of its own. Its
modules, by idea: options, copy descriptors, the CUDA engine, jobs and their callback,
staging, programs, and the mover."""

from kvxfer.engine.dma._engines import CALLBACK_STEPS as CALLBACK_STEPS
from kvxfer.engine.dma._engines import HOOKS as HOOKS
from kvxfer.engine.dma._engines import is_cuda as is_cuda
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
