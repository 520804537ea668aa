"""Store tiers below host memory: page blobs under keys, shared or persistent."""

from kvxfer.store._base import Store as Store
from kvxfer.store._base import StoreError as StoreError

__all__ = ["Store", "StoreError"]
