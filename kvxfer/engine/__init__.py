"""The block transfer engine: batched device↔host page copies, per slice class.

Movers, chosen per slice class (one module each), all behind one ``Mover`` interface:

* ``StagedMover`` (every backend, every layout): compiled gather / donated scatter
  programs with the page digests in the same program; the portable fallback.
* ``RawMover`` (XLA:CPU, row-major whole-byte layouts): raw byte-range copies between
  the device buffers and the host pool.
* ``PinnedMover`` (XLA:CPU and TPU, ``_pinned.IN_PLACE_PLATFORMS``): compiled programs
  that write pages, with their digests, into a pinned host pool in place (one
  dynamic-update-slice a page: on TPU one DMA into a slot-major pool) and read them
  from there into the donated caches.
* ``PinnedPagesMover`` (the pinned mover's route elsewhere, ``pinned_mover``): compiled
  programs that gather a transfer's pages on the device, digest them there and hand
  each page out as an array of pinned host memory, its storage from then on; loads
  move the pages' arrays to the device and scatter them into the donated caches.
* ``EmulatedMover`` (emulated TPU memory): raw byte-range copies over emulated device
  images, for layouts the inspector has proven addressable.
* ``DmaMover`` (NVIDIA GPUs with ``cuda-bindings``; XLA:CPU with a host copy engine;
  the ``dma`` package): programs that digest on the device and call a
  ``buffer_callback`` enqueuing batched copy-engine copies, beside XLA's stream where
  the engine has streams of its own (ordered by events), between the caches' blocks
  and a page-major pool allocated and pinned outside XLA.
* ``PallasMover`` (TPU; Pallas interpret mode on CPU; only when asked for): per-block
  DMA kernels between the caches and page buffers the host copies into the pool.
* ``GroupedMover`` (a block dim sharded over data parallelism): runs another mover
  group by group, each group's pages on the devices that hold its blocks.

Movers work shard by shard on the devices that own the shards; replicas of a
replicated layer are stored once and loaded into every replica.

``__all__`` is the interface and the movers. The package also names, outside
``__all__``, the few helpers other parts of kvxfer build on (the manager, the bench,
the fault injectors): how block counts are padded (``bucket``), running under no
context mesh (``own_context``), a shard typed as a one-device array (``local``), an
array without its buffers (``abstract``), every layer's shards at once
(``layers_of``), a block dim's split over groups (``BlockGroups``), buffers shared
between arrays (``shared_buffers``), whether a mover can take an array
(``raw_capable``, ``pinned_capable``, ``pallas_refusal``, ``dma_refusal``), the
pinned mover's class on a platform (``pinned_mover``), the copy
engine of each platform (``COPY_ENGINES``, ``copy_engine``), the steps of the DMA
programs' callbacks (``CALLBACK_STEPS``; ``kvxfer.testing`` injects failures there and
spies on them), whether a GPU is NVIDIA's
(``is_cuda``), compiles collected to run
side by side (``deferred_compiles``), an array's format handed to the programs
(``known_format``) and the digest programs' chunk (``DIGEST_CHUNK``); and, for
compiling for devices not at hand (``kvxfer aot``), a layer of abstract caches split
into shards (``abstract_layer``), a mover's programs (``transfer_programs``,
``ProgramJob``), what a compiled program does with host memory (``check_program``,
``ProgramCheck``). They are
imported from here, so nothing outside the package imports its private modules.
"""

from kvxfer._requires import require_jax

# First, before the movers' modules import jax: an older jax or jaxlib is refused here
# with the versions kvxfer needs (JaxVersionError), not by jax later, inside a transfer.
require_jax()

from kvxfer.engine._aot import ProgramCheck as ProgramCheck
from kvxfer.engine._aot import ProgramJob as ProgramJob
from kvxfer.engine._aot import abstract_layer as abstract_layer
from kvxfer.engine._aot import check_program as check_program
from kvxfer.engine._aot import transfer_programs as transfer_programs
from kvxfer.engine._batch import PageBatch as PageBatch
from kvxfer.engine._batch import ShardedLayer as ShardedLayer
from kvxfer.engine._batch import abstract as abstract
from kvxfer.engine._batch import bucket as bucket
from kvxfer.engine._batch import layers_of as layers_of
from kvxfer.engine._batch import local as local
from kvxfer.engine._batch import own_context as own_context
from kvxfer.engine._auto import RawOrPinnedMover as RawOrPinnedMover
from kvxfer.engine.dma import CALLBACK_STEPS as CALLBACK_STEPS
from kvxfer.engine.dma import COPY_ENGINES as COPY_ENGINES
from kvxfer.engine.dma import DmaMover as DmaMover
from kvxfer.engine.dma import DmaOptions as DmaOptions
from kvxfer.engine.dma import copy_engine as copy_engine
from kvxfer.engine.dma import dma_refusal as dma_refusal
from kvxfer.engine.dma import is_cuda as is_cuda
from kvxfer.engine.dma import staging_bytes_held as staging_bytes_held
from kvxfer.engine._emulated import EmulatedMover as EmulatedMover
from kvxfer.engine._grouped import BlockGroups as BlockGroups
from kvxfer.engine._grouped import GroupedMover as GroupedMover
from kvxfer.engine._mover import LoadRequest as LoadRequest
from kvxfer.engine._mover import Mover as Mover
from kvxfer.engine._mover import Pending as Pending
from kvxfer.engine._mover import TransferError as TransferError
from kvxfer.engine._pallas import PallasMover as PallasMover
from kvxfer.engine._pallas import pallas_refusal as pallas_refusal
from kvxfer.engine._pinned import PinnedMover as PinnedMover
from kvxfer.engine._pinned import pinned_capable as pinned_capable
from kvxfer.engine._pinned import pinned_mover as pinned_mover
from kvxfer.engine._pinned import in_place_refusal as in_place_refusal
from kvxfer.engine._pinned import pinned_mode as pinned_mode
from kvxfer.engine._pinned import PINNED_ROUTES as PINNED_ROUTES
from kvxfer.engine._pinned_pages import PinnedPagesMover as PinnedPagesMover
from kvxfer.engine._programs import DIGEST_CHUNK as DIGEST_CHUNK
from kvxfer.engine._programs import deferred_compiles as deferred_compiles
from kvxfer.engine._programs import known_format as known_format
from kvxfer.engine._raw import RawMover as RawMover
from kvxfer.engine._raw import raw_capable as raw_capable
from kvxfer.engine._raw import shared_buffers as shared_buffers
from kvxfer.engine._staged import StagedMover as StagedMover

__all__ = ["Mover", "LoadRequest", "Pending", "PageBatch", "ShardedLayer", "TransferError",
           "StagedMover", "RawMover", "PinnedMover", "PinnedPagesMover", "DmaMover", "DmaOptions",
           "PallasMover", "EmulatedMover",
           "GroupedMover", "RawOrPinnedMover"]
