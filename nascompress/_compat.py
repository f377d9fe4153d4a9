"""Import-time fix for torchvision's CUDA wheel on a CPU-only torch.

Why this exists: torchvision 0.28.0 from PyPI is a CUDA build. Paired with the CPU build of
torch 2.13.0 its compiled ops fail to load, and ``import torchvision`` (which timm does at import
time) dies with ``RuntimeError: operator torchvision::nms does not exist``. We catch exactly that
error, declare the two missing operator schemas so torchvision's Python layer can register its
fake kernels, and import again. Only the compiled detection ops stay unavailable, which
nascompress never uses. With a CUDA torch the error does not occur and nothing changes.
"""

from __future__ import annotations

import sys

import torch

from ._torchvision_hook import SCHEMAS  # (importing it as part of the package installs no hook)

_lib = None  # kept alive: dropping the Library object would unregister the schemas


def ensure_torchvision() -> None:
    global _lib
    try:
        import torchvision  # noqa: F401  (the import under test: it fails on a CPU-only torch)
    except RuntimeError as e:
        if "operator torchvision::nms does not exist" not in str(e):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        _lib = torch.library.Library("torchvision", "DEF")
        for schema in SCHEMAS:
            _lib.define(schema)
        import torchvision  # noqa: F401  (again, now that the schemas exist)


ensure_torchvision()
