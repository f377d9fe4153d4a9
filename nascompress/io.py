"""The model file format and the one loader that rebuilds any saved model.

A nascompress model is ``model.safetensors`` plus ``arch.json`` in one directory. ``arch.json``
(also embedded in the safetensors metadata under ``nascompress_arch``, so the weights file alone
is enough) holds::

    {"format": "nascompress-arch/2",
     "model": {"name": <timm name>, "kwargs": {...}},        # ModelSpec
     "input": {"in_chans", "img_size", "mean", "std",         # preprocessing (data.InputSpec)
               "interpolation", "crop_pct", "crop_mode"},
     "methods": [{"name": "dcs", "config": {...}, ...}, ...]} # every compression decision

Training checkpoints (optimizer, schedules, RNG) are saved with :func:`save_state`, which
stores tensors in safetensors and everything else as JSON: nothing is pickled.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file
from torch import nn

from .errors import NascompressError
from .methods import apply_methods
from .models import ModelSpec, build_model, load_state_strict
from .utils import atomic_path, read_json, write_json

ARCH_FORMAT = "nascompress-arch/2"
# /1: written before the method contract; its new-parameter names differ (see _upgrade_v1)
READ_FORMATS = ("nascompress-arch/1", ARCH_FORMAT)
_V1_RENAMES = ((".attn.sp_w_down", ".attn.kernel.w_down"), (".attn.sp_w_up", ".attn.kernel.w_up"),
               (".attn.dcs_theta", ".attn.qk_mask.theta"))
ARCH_FILE = "arch.json"
MODEL_FILE = "model.safetensors"


def make_arch(spec: ModelSpec, *, input_spec: dict[str, Any], methods: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"format": ARCH_FORMAT, "model": spec.to_dict(), "input": dict(input_spec), "methods": list(methods or [])}


def validate_arch(arch: Any, *, source: str) -> dict[str, Any]:
    if not isinstance(arch, dict) or arch.get("format") not in READ_FORMATS or "model" not in arch:
        raise NascompressError(f"{source} is not a nascompress arch (expected format {ARCH_FORMAT!r})")
    arch.setdefault("methods", [])
    return arch


def _upgrade_v1(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """State dicts of format /1 name the methods' new parameters differently: rename them."""
    out = {}
    for k, v in sd.items():
        for old, new in _V1_RENAMES:
            if old in k:
                k = k.replace(old, new)
        out[k] = v
    return out


def build_from_arch(arch: dict[str, Any]) -> nn.Module:
    """Build the (randomly initialised) model that ``arch`` describes, methods applied."""
    model = build_model(ModelSpec.from_dict(arch["model"]))
    return apply_methods(model, arch["methods"])


def _state_dict_for_save(model: nn.Module) -> dict[str, torch.Tensor]:
    # safetensors refuses shared and non-contiguous tensors (sliced weights).
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}


def save_model(run_dir: str | Path, model: nn.Module, arch: dict[str, Any], *, filename: str = MODEL_FILE) -> Path:
    """Write ``filename`` (weights, arch in metadata) and ``arch.json`` atomically into run_dir."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / filename
    with atomic_path(path) as tmp:
        save_file(_state_dict_for_save(model), str(tmp), metadata={"nascompress_arch": json.dumps(arch)})
    write_json(run_dir / ARCH_FILE, arch)
    return path


def _resolve(path: str | Path) -> tuple[Path, dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        raise NascompressError(f"{path} does not exist; give a run directory or a model.safetensors file")
    if path.is_dir():
        weights = path / MODEL_FILE
        if not weights.is_file():
            raise NascompressError(f"{path} holds no {MODEL_FILE}; is it a finished nascompress run?")
        if (path / ARCH_FILE).is_file():
            return weights, validate_arch(read_json(path / ARCH_FILE), source=str(path / ARCH_FILE))
        path = weights
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise NascompressError(f"{path} is not a readable safetensors file ({e})") from e
    if "nascompress_arch" not in meta:
        raise NascompressError(f"{path} has no arch.json beside it and no nascompress_arch metadata")
    return path, validate_arch(json.loads(meta["nascompress_arch"]), source=f"{path} metadata")


def recorded_input(path: str | Path) -> dict[str, Any] | None:
    """The ``input`` (preprocessing) recorded in a nascompress ``.safetensors`` file's metadata,
    or None for any other weights file (a foreign checkpoint, a ``.pth``)."""
    path = Path(path)
    if path.suffix != ".safetensors" or not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        return json.loads(meta["nascompress_arch"]).get("input") if "nascompress_arch" in meta else None
    except (SafetensorError, OSError, ValueError, AttributeError):
        return None


def load_arch(path: str | Path) -> dict[str, Any]:
    return _resolve(path)[1]


def load_with_arch(path: str | Path, *, map_location: str | torch.device = "cpu",
                   dtype: str | torch.dtype | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a saved model from its directory (or safetensors file) and load it strictly.

    ``dtype`` (``fp32``, ``bf16``, ``fp16`` or a torch dtype; None: as saved, float32) converts the
    floating weights for inference; feed the model inputs of that dtype."""
    from .runtime import parse_dtype

    dt = None if dtype is None else parse_dtype(dtype)
    weights, arch = _resolve(path)
    model = build_from_arch(arch)
    try:
        sd = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise NascompressError(f"{weights} is corrupt ({e}); re-run the command that wrote it") from e
    if arch["format"] != ARCH_FORMAT:
        sd, arch["format"] = _upgrade_v1(sd), ARCH_FORMAT
    load_state_strict(model, sd, source=str(weights))
    model = model.to(map_location) if dt is None else model.to(map_location, dt)
    return model.eval(), arch


def load(path: str | Path, *, map_location: str | torch.device = "cpu",
         dtype: str | torch.dtype | None = None) -> nn.Module:
    """Load any saved nascompress model: ``nascompress.load("runs/base")``, or for bfloat16 inference
    on a GPU ``nascompress.load("runs/base", map_location="cuda", dtype="bf16")``. Eval mode."""
    return load_with_arch(path, map_location=map_location, dtype=dtype)[0]


# ----------------------------------------------------------------------------------------------
# Checkpoints of arbitrary nested state (model + optimizer + schedule), without pickle.

def _flatten(obj: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    if isinstance(obj, torch.Tensor):
        key = prefix or "_"
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {"__dict__": {k: _flatten(v, tensors, f"{prefix}/{k}") for k, v in obj.items()}}
        return {"__items__": [[k, _flatten(v, tensors, f"{prefix}/{k}")] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_flatten(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)],
                "tuple": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot save {type(obj).__name__} at {prefix!r} in a checkpoint")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: _unflatten(v, tensors) for k, v in obj["__dict__"].items()}
        if "__items__" in obj:
            return {k: _unflatten(v, tensors) for k, v in obj["__items__"]}
        if "__list__" in obj:
            items = [_unflatten(v, tensors) for v in obj["__list__"]]
            return tuple(items) if obj.get("tuple") else items
    return obj


def save_state(path: str | Path, state: dict[str, Any]) -> None:
    """Save nested state (tensors, dicts with int keys, lists, scalars) atomically, no pickle."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(state, tensors, "")
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"nascompress_state": json.dumps(skeleton)})


def load_state(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with safe_open(str(path), "pt") as f:
            skeleton = json.loads((f.metadata() or {})["nascompress_state"])
        tensors = load_file(str(path))
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise NascompressError(f"checkpoint {path} is unreadable ({e}); delete it to start over") from e
    return _unflatten(skeleton, tensors)
