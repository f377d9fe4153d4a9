"""nascompress: make timm Vision Transformers cheaper without making them worse."""
from __future__ import annotations

from . import _compat  # noqa: F401  (torchvision CPU fix, before anything imports timm)
from .errors import NascompressError
from .io import load, load_with_arch, save_model

__version__ = "0.1.0"
__all__ = ["load", "load_with_arch", "save_model", "NascompressError", "__version__"]
