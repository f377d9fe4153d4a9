"""A run's folder on disk: the arch.json/metrics.json formats and sidecars (:mod:`.files`), the run
directory, its config and its lock (:mod:`.run_dir`), training checkpoints and logs (:mod:`.store`),
the checkpoint file format (:mod:`.checkpoint`), and saving/loading models and run completeness
(:mod:`.io`).

The public names of those modules are importable from here; they are imported on first use, so that
``nascompress.runs.files`` stays cheap to import (``runs.io`` builds models: timm, the methods)."""

from __future__ import annotations

import importlib
from typing import Any

# name -> the submodule that defines it
_NAMES = {
    "ARCH_FILE": "files",
    "ARCH_FORMAT": "files",
    "Arch": "files",
    "CHECKPOINT_FILE": "store",
    "CONFIG_FILE": "run_dir",
    "LAST_FILE": "store",
    "LOG_FILE": "store",
    "METRICS_FILE": "files",
    "MODEL_FILE": "io",
    "MethodRecord": "files",
    "Quantization": "files",
    "READ_FORMATS": "files",
    "RUN_FILES": "io",
    "Record": "files",
    "RunDir": "run_dir",
    "RunMetrics": "files",
    "RunStore": "store",
    "Sidecar": "files",
    "VOUCHED_FILES": "io",
    "build_from_arch": "io",
    "check_complete": "io",
    "check_finite": "io",
    "check_map": "files",
    "check_number": "files",
    "check_str": "files",
    "checked_int": "store",
    "checked_number": "store",
    "continue_advice": "io",
    "damaged_checkpoint": "store",
    "file_sha256": "io",
    "find_metrics": "files",
    "finish_run": "io",
    "has_metrics": "files",
    "load": "io",
    "load_arch": "io",
    "load_state": "checkpoint",
    "load_typed": "io",
    "load_with_arch": "io",
    "make_arch": "io",
    "optional": "files",
    "read_arch": "io",
    "read_arch_json": "files",
    "read_metrics": "files",
    "read_metrics_json": "files",
    "read_sidecar": "files",
    "recorded_input": "io",
    "restore_model": "store",
    "run_state": "io",
    "save_model": "io",
    "save_state": "checkpoint",
    "set_labels": "io",
    "sidecar_path": "files",
    "timm_pretrained_cfg": "io",
    "validate_arch": "files",
    "write_arch_json": "files",
    "write_metrics_json": "files",
    "write_sidecar_json": "files",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
