"""nascompress: make timm Vision Transformers cheaper without making them worse.

From Python (``import nascompress as nc``; the same jobs the commands run, see ``docs/api.md``):

* ``nc.compress(model, train=..., target_flops=0.6)``: a model in, a smaller model out;
* the stages one by one: ``nc.dcs.search``, ``nc.materialize``, ``nc.retrain``, ``nc.tokens.apply``,
  ``nc.export.onnx``, ``nc.quantize``, ``nc.study`` (an Optuna study of a search space);
* ``nc.from_transformers`` (a Hugging Face ViT in), ``Compressed.to_transformers`` (out);
* ``nc.load(path)`` rebuilds any saved model.

``nc.retrain`` is the function :func:`nascompress.pyapi.stages.retrain` (the stage the commands run
is :mod:`nascompress.retraining.run`);
``nc.export`` is the module :mod:`nascompress.pyapi.export`, with :func:`nascompress.pyapi.export.onnx`.
``dir(nc)`` lists every name above (tab completion).

Importing the package applies the torchvision fix for a CPU-only torch (so ``import timm`` works
after it); timm itself and the model code are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import _compat  # noqa: F401  (torchvision CPU fix, before anything imports timm)
from .errors import NascompressError

__version__ = "0.1.0"
__all__ = [
    "load",
    "load_with_arch",
    "save_model",
    "NascompressError",
    "__version__",
    "compress",
    "Compressed",
    "CompressReport",
    "materialize",
    "retrain",
    "quantize",
    "from_transformers",
    "to_transformers",
    "study",
    "dcs",
    "tokens",
    "export",
]

# name -> (module, attribute; None: the module itself), imported on first use
_LAZY = {
    "load": ("nascompress.runs.io", "load"),
    "load_with_arch": ("nascompress.runs.io", "load_with_arch"),
    "save_model": ("nascompress.runs.io", "save_model"),
    "compress": ("nascompress.pyapi.compress", "compress"),
    "Compressed": ("nascompress.pyapi.compress", "Compressed"),
    "CompressReport": ("nascompress.pyapi.compress", "CompressReport"),
    "materialize": ("nascompress.pyapi.stages", "materialize"),
    "retrain": ("nascompress.pyapi.stages", "retrain"),
    "quantize": ("nascompress.pyapi.stages", "quantize"),
    "from_transformers": ("nascompress.pyapi.hf", "from_transformers"),
    "to_transformers": ("nascompress.pyapi.hf", "to_transformers"),
    "study": ("nascompress.pyapi.study", "study"),
    "dcs": ("nascompress.pyapi.dcs", None),
    "tokens": ("nascompress.pyapi.tokens", None),
    "export": ("nascompress.pyapi.export", None),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module 'nascompress' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
