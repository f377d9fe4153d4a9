"""Training checkpoints of arbitrary nested state (model + optimizer + schedule + RNG), without pickle:
:func:`save_state` stores the tensors in a safetensors file and everything else as a JSON skeleton in
its metadata; :func:`load_state` rebuilds the state (one line for an unreadable or damaged file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from ..errors import NascompressError, SettingError
from .json_io import atomic_path, parse_json


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
        return {
            "__list__": [_flatten(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)],
            "tuple": isinstance(obj, tuple),
        }
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
            skeleton = parse_json((f.metadata() or {})["nascompress_state"], source=f"checkpoint {path}'s metadata")
        tensors = load_file(str(path))
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise NascompressError(f"checkpoint {path} is unreadable ({e}); delete it to start over") from e
    try:
        return _unflatten(skeleton, tensors)
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # a tensor missing, a damaged skeleton
        raise SettingError(
            f"checkpoint {path} is damaged (its tensor {e} is missing or its layout broken); "
            "delete it (a {resume} then starts the run over) or rerun with {force}"
        ) from None
