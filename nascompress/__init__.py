"""nascompress: make timm Vision Transformers cheaper without making them worse.

``nascompress.load(path)`` rebuilds any saved model. Importing the package applies the
torchvision fix for a CPU-only torch (so ``import timm`` works after it); timm itself and the
model code are imported on first use.
"""
from __future__ import annotations

from typing import Any

from . import _compat  # noqa: F401  (torchvision CPU fix, before anything imports timm)
from .errors import NascompressError

__version__ = "0.1.0"
__all__ = ["load", "load_with_arch", "save_model", "NascompressError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("load", "load_with_arch", "save_model"):
        from . import io

        return getattr(io, name)
    raise AttributeError(f"module 'nascompress' has no attribute {name!r}")
