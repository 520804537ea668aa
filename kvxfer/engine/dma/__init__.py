"""The DMA mover: copy-engine copies between the caches and a pinned host pool, in
XLA's order, beside its stream where the copy engine has streams of its own."""

from kvxfer.engine.dma._engines import CALLBACK_STEPS, HOOKS, is_cuda
from kvxfer.engine.dma._mover import COPY_ENGINES, RELAYOUT_BELOW, DmaMover, DmaOptions, \
    copy_engine, dma_refusal
from kvxfer.engine.dma._staging import Staging

staging_bytes_held = Staging.bytes_held

__all__ = ["DmaMover", "DmaOptions", "COPY_ENGINES", "copy_engine", "dma_refusal",
           "RELAYOUT_BELOW", "CALLBACK_STEPS", "HOOKS", "is_cuda", "staging_bytes_held"]
