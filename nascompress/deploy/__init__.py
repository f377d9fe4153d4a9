"""``nascompress export``: a compressed model as a file that runs without nascompress.

:func:`export_run` loads a saved model (:func:`nascompress.load`), traces it and writes an ONNX file
(ONNX Runtime, TensorRT, OpenVINO ...) or a ``torch.export`` program (``.pt2``, loaded with
``torch.export.load``). The file holds the compressed model as it runs at inference: DCS's and
uniform pruning's smaller layers, the gathers and ``index_add`` of DCS's MLP channels, EViT's and
DynamicViT's data-dependent token selection (``TopK``, ``Gather``), Sparsifiner's predicted masks or
kept blocks, in any allowed stack of them. Where a method's inference path cannot be traced, an
equal traceable path is swapped in for the export (:mod:`.paths`). MG-ViT and Hierarchical MG-ViT
are written as their two stages plus the exit rule (:mod:`.graphs`).

Every file is checked before it is kept: written to a temporary file, run by the runtime a user
would run it with (ONNX Runtime on the CPU; ``torch.export.load``) on a fixed random batch (and on
one image when the batch is dynamic), and compared with the PyTorch model: max |logit difference|
and top-1 agreement. Beyond the tolerance the command fails and leaves no file. The sidecar
``FILE.json`` holds what a serving stack needs: input size and preprocessing (mean, std,
interpolation, crop), class count, FLOPs, the methods and their settings, the source run and the
check's result.

Refused, each with one line: a DCS supernet (not a smaller model yet: materialize it first), a
method with no export path, ``bf16`` ONNX (ONNX Runtime's CPU provider has no bfloat16 kernels for
these ops, so the file could not be checked), MG-ViT with a fixed batch (its second stage takes the
images that did not exit).

int8: ``config.quantize`` (``export --quantize int8``) or :mod:`.quantize` (``nascompress quantize``)
writes an int8 ONNX file made with ONNX Runtime's quantization tooling from the checked fp32 file,
and keeps it only when its top-1 on the run's validation split is within the allowed drop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import DTYPES, FORMATS, ExportConfig, config_for, parse_batch
from .run import SIDECAR_FORMAT, stage_path
from ..runs.files import Sidecar, sidecar_path
from .run import export_run as _export_fp
from .quantize import quantize_run


def export_run(
    run: str | Path, *, out: str | Path, config: ExportConfig | None = None, force: bool = False, data: Any = None
) -> Sidecar:
    """Export the model saved in ``run`` to ``out`` and check it; returns the sidecar, as written to
    ``out + ".json"`` (:func:`nascompress.deploy.run.export_run`). With ``config.quantize`` (``int8``,
    ``int8-static``, ``int8-dynamic``) the file is the int8 ONNX file ``nascompress quantize`` writes
    with its default settings (:func:`nascompress.deploy.quantize.quantize_run`), calibrated and
    checked on ``data`` (None: the run's dataset)."""
    if config is not None and config.quantize != "none":
        return quantize_run(run, out=out, config=config_for(config.quantize), export=config, data=data, force=force)
    return _export_fp(run, out=out, config=config, force=force)


__all__ = [
    "ExportConfig",
    "FORMATS",
    "DTYPES",
    "parse_batch",
    "export_run",
    "sidecar_path",
    "stage_path",
    "SIDECAR_FORMAT",
]
