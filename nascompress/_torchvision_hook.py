"""Lets a plain ``import torchvision`` (and so ``import timm``) work where the installed torchvision
is a CUDA build next to a CPU-only torch (PyPI has no CPU build of torchvision 0.28.0, so
``pip install nascompress`` next to a CPU torch 2.13 gets exactly that pair).

Why it exists: against the CPU torch, that torchvision's compiled ops cannot load and
``import torchvision`` dies with "operator torchvision::nms does not exist"; timm imports torchvision
at import time. The wheel installs ``nascompress-torchvision-cpu.pth`` (setup.py) into site-packages;
its one line runs this file at interpreter start-up (by path: the ``nascompress`` package itself is
not imported). Then it only adds an import hook: on the first ``import torchvision`` the hook tries
to load torchvision's compiled ops and, where they cannot load, declares the two operator schemas
torchvision's Python layer needs (its compiled detection ops, which nascompress never uses, stay
unavailable). Where the ops load (a CUDA torch, or a matching CPU torchvision) nothing changes.
``nascompress._compat`` applies the same remedy after the failure, for environments without the
``.pth`` (an editable install: scripts/setup.sh installs the ``.pth`` there when needed).
"""

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

# the operator schemas torchvision's Python layer needs (also used by nascompress._compat)
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_lib = None  # kept alive: dropping the Library object would unregister the schemas
# the .pth line (one line; ``sitedir`` is the site-packages directory site.addpackage is reading)
PTH_NAME = "nascompress-torchvision-cpu.pth"
PTH_LINE = (
    "import os, pathlib; f = os.path.join(sitedir, 'nascompress', '_torchvision_hook.py'); "
    "os.path.isfile(f) and exec(compile(pathlib.Path(f).read_text(), f, 'exec'), "
    "{'__name__': '_nascompress_torchvision_hook'})\n"
)


class _TorchvisionCPU(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)  # once
        global _lib
        spec = importlib.machinery.PathFinder.find_spec("torchvision")
        if spec is None or not spec.submodule_search_locations:
            return None
        import torch  # the .pth runs this file in every interpreter: torch only once torchvision is imported

        libs = sorted(Path(next(iter(spec.submodule_search_locations))).glob("_C*.so"))
        try:
            for so in libs[:1]:
                torch.ops.load_library(str(so))
            return None  # the compiled ops load: nothing to do
        except (OSError, RuntimeError):
            pass
        try:
            _lib = torch.library.Library("torchvision", "DEF")
            for schema in SCHEMAS:
                _lib.define(schema)
        except RuntimeError:
            pass  # already declared
        return None  # the normal finders import torchvision


# only as a start-up hook (the .pth line, or scripts/setup.sh's copy), not when imported as part of the
# package (nascompress._compat) or by setup.py; once per process
_IMPORTED = ("nascompress._torchvision_hook", "_torchvision_hook")
if __name__ not in _IMPORTED and not any(type(f).__name__ == "_TorchvisionCPU" for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionCPU())
