"""kvxfer: verified KV-cache transfers between accelerator and host memory for JAX."""

from kvxfer.layout import Layout as Layout
from kvxfer.layout import LayoutError as LayoutError
from kvxfer.layout import SliceGeometry as SliceGeometry
from kvxfer.layout import inspect as inspect
from kvxfer.layout import require_addressable as require_addressable

__version__ = "0.1.0"
