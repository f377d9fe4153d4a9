"""``nc.export``: a model as a deployable file from Python (``nc.export.onnx``), the job
``nascompress export`` runs (:func:`nascompress.deploy.export_run`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..deploy import ExportConfig, export_run
from ..deploy.config import build_config
from ..errors import python_api
from .common import model_run, setting_names, split_settings
from .workspace import Workspace


@dataclass(frozen=True)
class Exported:
    """What :func:`onnx` wrote: the file (``path``) and its sidecar (``sidecar``: input size and
    preprocessing, classes, FLOPs, methods, and ``verification``: the file checked against PyTorch)."""

    path: str
    sidecar: dict[str, Any] = field(default_factory=dict)


@python_api("nc.export.onnx")
def onnx(model: Any, path: str | Path, *, force: bool = False, **settings: Any) -> Exported:
    """``nc.export.onnx(model, "model.onnx")``: write a model (an ``nn.Module``, a result of the Python
    API, or a run directory) as the ONNX file ``path`` and its sidecar ``path.json``, run it with ONNX
    Runtime and compare it with the PyTorch model (``nascompress export --format onnx``, the same
    job: :func:`export_run`). ``**settings``: the command's options by Python name (``batch``: an int
    or ``"dynamic"``, ``opset``, ``tolerance``, ``quantize`` ...). Nothing else is written."""
    given = split_settings(settings, {"e": setting_names(ExportConfig)}, what="nc.export.onnx")["e"]
    cfg = build_config({**given, "format": "onnx"})  # (its batch: "dynamic" or an int, as checked there)
    with Workspace(None) as ws:
        side = export_run(model_run(model, ws, "model"), out=Path(path), config=cfg, force=force)
    return Exported(path=str(Path(path)), sidecar=side.to_dict())
