"""Lets a plain ``import torchvision`` (and so ``import timm``) work where the installed torchvision
is a CUDA build next to a CPU-only torch (PyPI has no CPU build of torchvision 0.28.0).

scripts/setup.sh installs this file into the environment's site-packages as
``_torchvision_cpu_hook.py`` with a ``.pth`` line importing it, only when ``import torchvision``
fails there with "operator torchvision::nms does not exist". At start-up it adds an import hook and
nothing else; on the first ``import torchvision`` the hook tries to load torchvision's compiled
ops, and where they cannot load declares the two operator schemas torchvision's Python layer needs
(its compiled detection ops, which nascompress never uses, stay unavailable). Same remedy as
``nascompress._compat``, applied before any import instead of after the failure.
"""
import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_lib = None  # kept alive: dropping the Library object would unregister the schemas


class _TorchvisionCPU(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)  # once
        global _lib
        spec = importlib.machinery.PathFinder.find_spec("torchvision")
        if spec is None or not spec.submodule_search_locations:
            return None
        import torch

        libs = sorted(Path(next(iter(spec.submodule_search_locations))).glob("_C*.so"))
        try:
            for so in libs[:1]:
                torch.ops.load_library(str(so))
            return None  # the compiled ops load: nothing to do
        except (OSError, RuntimeError):
            pass
        try:
            _lib = torch.library.Library("torchvision", "DEF")
            for schema in _SCHEMAS:
                _lib.define(schema)
        except RuntimeError:
            pass  # already declared
        return None  # the normal finders import torchvision


sys.meta_path.insert(0, _TorchvisionCPU())
