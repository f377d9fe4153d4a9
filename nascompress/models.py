"""Building timm ViTs from a spec, and loading weights into them strictly.

A model is described by a :class:`ModelSpec` (a timm name plus build kwargs). Weights never
come from a hub: ``pretrained=False`` always, and weights are loaded from local files.
"""
from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import _compat  # noqa: F401  (must run before timm imports torchvision)

import timm
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from .errors import NascompressError

# The base timm entry used for a custom small ViT; every size comes from the overrides.
CUSTOM_BASE = "vit_tiny_patch16_224"
# timm modules whose models are VisionTransformer instances (checked again after building).
_VIT_MODULES = {"vision_transformer", "deit", "vision_transformer_hybrid"}


@dataclass(frozen=True)
class ModelSpec:
    """What is needed to rebuild a timm model: its registered name and build kwargs.

    Args:
        name: a timm model name (``vit_*``, ``deit_*`` ...).
        kwargs: keyword overrides passed to ``timm.create_model`` (num_classes, img_size,
            in_chans, patch_size, embed_dim, depth, num_heads, ...).
    """

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        return cls(name=d["name"], kwargs=dict(d.get("kwargs", {})))


def custom_vit_spec(*, img_size: int, patch_size: int, embed_dim: int, depth: int, num_heads: int,
                    num_classes: int, in_chans: int = 3, mlp_ratio: float = 4.0) -> ModelSpec:
    """A small plain ViT of the given shape (built from timm's VisionTransformer)."""
    if embed_dim % num_heads:
        raise NascompressError(f"--embed-dim {embed_dim} must be divisible by --num-heads {num_heads}")
    if img_size % patch_size:
        raise NascompressError(f"--img-size {img_size} must be divisible by --patch-size {patch_size}")
    return ModelSpec(CUSTOM_BASE, dict(img_size=img_size, patch_size=patch_size, embed_dim=embed_dim,
                                       depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio,
                                       num_classes=num_classes, in_chans=in_chans))


def _check_name(name: str) -> None:
    if timm.is_model(name):
        return
    known = timm.list_models("vit_*") + timm.list_models("deit_*")
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see timm.list_models('vit_*')"
    raise NascompressError(f"unknown model name {name!r}{hint}")


def build_model(spec: ModelSpec) -> VisionTransformer:
    """Build ``spec`` with random init (never downloads). Raises for non-ViT models."""
    _check_name(spec.name)
    if timm.models._registry._model_to_module.get(spec.name) not in _VIT_MODULES:
        raise NascompressError(
            f"{spec.name} is not a timm VisionTransformer (it comes from timm.models."
            f"{timm.models._registry._model_to_module.get(spec.name)}); nascompress supports ViT-family models (vit_*, deit_*)")
    try:
        model = timm.create_model(spec.name, pretrained=False, **spec.kwargs)
    except (TypeError, ValueError, AssertionError) as e:
        raise NascompressError(f"cannot build {spec.name} with {spec.kwargs}: {e}") from e
    if not isinstance(model, VisionTransformer):
        raise NascompressError(
            f"{spec.name} is a {type(model).__name__}, not a timm VisionTransformer; "
            "nascompress supports ViT-family models (vit_*, deit_*)")
    return model


def input_size(model: VisionTransformer) -> tuple[int, int, int]:
    """(C, H, W) expected by the model's patch embedding."""
    pe = model.patch_embed
    return (pe.proj.in_channels, *pe.img_size)


def read_weights_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state dict from a local ``.safetensors`` or ``.pth``/``.pt``/``.bin`` file.

    ``.pth`` files are read with ``weights_only=True`` (no code is unpickled). A nested
    ``{"model": ...}`` or ``{"state_dict": ...}`` checkpoint is unwrapped.
    """
    path = Path(path)
    if not path.is_file():
        raise NascompressError(f"weights file {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            sd = load_file(str(path))
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt or truncated file: every reader raises its own type
        raise NascompressError(f"weights file {path} is corrupt or not a weights file ({type(e).__name__}: {e})") from e
    for key in ("model", "state_dict", "model_ema"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
            break
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise NascompressError(f"weights file {path} does not hold a state dict of tensors")
    return sd


def load_state_strict(model: nn.Module, sd: dict[str, torch.Tensor], *, source: str) -> None:
    """Load ``sd`` into ``model`` strictly; on a mismatch name the first differing tensor."""
    own = model.state_dict()
    for k, v in own.items():
        if k not in sd:
            raise NascompressError(f"{source} does not match the model: tensor {k} {tuple(v.shape)} is missing from the file")
        if tuple(sd[k].shape) != tuple(v.shape):
            hint = ""
            if k.startswith("head."):
                hint = "; the class count differs: set --num-classes to match the file, or pass --reset-head"
            raise NascompressError(
                f"{source} does not match the model: {k} has shape {tuple(sd[k].shape)} in the file "
                f"but {tuple(v.shape)} in the model{hint}")
    extra = [k for k in sd if k not in own]
    if extra:
        raise NascompressError(f"{source} does not match the model: unexpected tensor {extra[0]} {tuple(sd[extra[0]].shape)} in the file")
    model.load_state_dict(sd, strict=True)


def load_pretrained(model: VisionTransformer, path: str | Path, *, reset_head: bool = False) -> None:
    """Load dense timm weights from a local file (original timm/DeiT checkpoints included).

    The position embedding is resampled to the model's grid as timm does; with
    ``reset_head`` the classifier is left at its initialisation (new class count).
    """
    from timm.models.vision_transformer import checkpoint_filter_fn

    sd = read_weights_file(path)
    sd = checkpoint_filter_fn(sd, model)
    if reset_head:
        own = model.state_dict()
        for k in [k for k in sd if k.startswith("head.")]:
            sd[k] = own[k]
    load_state_strict(model, sd, source=f"weights file {path}")
