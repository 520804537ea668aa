"""Helpers for testing code that uses kvxfer: cache builders, raw bits, fault injection.

Used by kvxfer's own tests, probes, benchmark and demo alike. Example:

    >>> from kvxfer import testing
    >>> caches = testing.random_caches(1, 4, (8, 128), "bfloat16", seed=7)
    >>> testing.same_bits(caches[0], testing.bits(caches[0]).view(caches[0].dtype))
    True

Faults (``FAULTS``; ``inject(kind, ...)`` and ``kvxfer probe --inject`` apply them by
name). Each damages host pages *after* their digests were made, so that only
verification can catch it, and each has one meaning:

* ``bitflip``: one host bit of one layer of a page flips (``flip_bit``).
* ``wrong-key``: the caller asks for key K and is handed a page stored under
  another key (``wrong_keys``); no byte is touched, the key check catches it.
* ``misfile``: a slot holds another page's bytes and digests while its metadata
  says it holds this page (``misfile``); the digests, bound to the other page's
  identity, catch it.
* ``stale-slot``: a page is freed and its slot reused while a ref is still held
  (``reuse_slot``); the load reports the stale ref as a miss.
* ``one-shard``: one shard's bytes of a sharded layer are corrupted
  (``corrupt_shard``).
* ``torn``: half of a page's layer bytes are another page's (a torn write,
  ``tear``).
* ``transfer``: the transfer itself fails after some layers moved: a device
  error, reported as ``TransferError``, never as a miss (``failing_transfer``).
* ``zero-dma``: the next load delivers zeros into one page's block of one layer
  and reports no error, as Mosaic DMAs did on some libtpu releases (jax issue
  39744). The host page is intact; only the device-side digest of what arrived
  catches it. It acts through the manager's public hook (``zero_dma``), so it
  applies to every mover alike.

``one-process`` corruption in a multi-process job is ``bitflip`` applied on one
rank only. ``flip_stored_bit`` damages a page at rest in a store tier;
``CountingStore`` counts the calls made to a real store. The faults
act through ``KVCacheManager.set_transfer_hook`` and the host pool's public views.

The DMA mover's hooks: ``callback_fault`` fails a step of its programs' callbacks,
``driver_fault`` one CUDA driver call, ``spy_callbacks`` records what the callbacks
see, and ``watch_releases`` the memory kvxfer lets go of (``ReleaseWatch``: a
stand-in copy engine reports a copy landing in it after it was let go).

    >>> import kvxfer
    >>> caches = testing.random_caches(2, 8, (4, 128), "float32")
    >>> mgr = kvxfer.KVCacheManager(caches, num_host_blocks=4)
    >>> pages = mgr.offload(caches, [0, 1, 2], keys=[1, 2, 3]).wait()
    >>> pages, keys = testing.inject("wrong-key", mgr, caches, pages, index=1, layer=0)
    >>> caches, load = mgr.load(caches, pages, [5, 6, 7], keys=keys)
    >>> load.result().verified_prefix, load.result().reasons[1].split(":")[0]
    (1, 'wrong key')
    >>> mgr.close()
"""

from kvxfer.testing._bits import bits as bits
from kvxfer.testing._bits import random_bits as random_bits
from kvxfer.testing._bits import same_bits as same_bits
from kvxfer.testing._caches import block_shape as block_shape
from kvxfer.testing._caches import random_caches as random_caches
from kvxfer.testing._faults import FAULTS as FAULTS
from kvxfer.testing._faults import Fault as Fault
from kvxfer.testing._faults import InjectedTransferError as InjectedTransferError
from kvxfer.testing._faults import corrupt_shard as corrupt_shard
from kvxfer.testing._faults import failing_transfer as failing_transfer
from kvxfer.testing._faults import flip_bit as flip_bit
from kvxfer.testing._faults import inject as inject
from kvxfer.testing._faults import misfile as misfile
from kvxfer.testing._faults import reuse_slot as reuse_slot
from kvxfer.testing._faults import tear as tear
from kvxfer.testing._faults import wrong_keys as wrong_keys
from kvxfer.testing._faults import zero_dma as zero_dma
from kvxfer.testing._store import CountingStore as CountingStore
from kvxfer.testing._dma import CALLBACK_STEPS as CALLBACK_STEPS
from kvxfer.testing._dma import ReleaseWatch as ReleaseWatch
from kvxfer.testing._dma import callback_fault as callback_fault
from kvxfer.testing._dma import driver_fault as driver_fault
from kvxfer.testing._dma import spy_callbacks as spy_callbacks
from kvxfer.testing._dma import watch_releases as watch_releases
from kvxfer.testing._store import flip_stored_bit as flip_stored_bit

__all__ = ["CALLBACK_STEPS", "ReleaseWatch", "callback_fault", "driver_fault",
           "spy_callbacks", "watch_releases", "bits", "same_bits", "random_bits",
           "block_shape", "random_caches", "FAULTS",
           "Fault", "InjectedTransferError", "flip_bit", "wrong_keys", "misfile",
           "reuse_slot", "corrupt_shard", "tear", "failing_transfer", "zero_dma", "inject",
           "flip_stored_bit", "CountingStore"]
