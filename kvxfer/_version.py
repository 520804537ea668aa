"""The version of kvxfer (one place: the wheel and ``kvxfer --version`` read it)."""

__version__ = "0.2.0"

__all__ = ["__version__"]
