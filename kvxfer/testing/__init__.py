"""Helpers for testing code that uses kvxfer: cache builders, raw bits, fault injection.

Used by kvxfer's own tests, probes, benchmark and demo alike. Example:

    >>> from kvxfer import testing
    >>> caches = testing.random_caches(1, 4, (8, 128), "bfloat16", seed=7)
    >>> testing.same_bits(caches[0], testing.bits(caches[0]).view(caches[0].dtype))
    True
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
from kvxfer.testing._store import flip_stored_bit as flip_stored_bit

__all__ = ["bits", "same_bits", "random_bits", "block_shape", "random_caches", "FAULTS",
           "Fault", "InjectedTransferError", "flip_bit", "wrong_keys", "misfile",
           "reuse_slot", "corrupt_shard", "tear", "failing_transfer", "zero_dma", "inject",
           "flip_stored_bit"]
