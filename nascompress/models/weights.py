"""Loading weights into a built model strictly: reading a local weights file (``.safetensors`` or a
``.pth`` state dict, never unpickling code), naming the tensors that do not fit, and loading dense
timm weights (:func:`load_pretrained`) into a model :mod:`nascompress.models.build` built.
"""

from __future__ import annotations

from pathlib import Path
import warnings

from .. import _compat  # noqa: F401  (must run before timm imports torchvision)

import torch
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn
from torch import nn
from safetensors.torch import load_file
from timm.models.pvt_v2 import checkpoint_filter_fn as pvt_filter

from ..errors import NascompressError, SettingError
from ..importer.shapes import check_resampling
from .build import is_pyramid
from ..runs.json_io import check_regular_file


def read_weights_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state dict from a local ``.safetensors`` or ``.pth``/``.pt``/``.bin`` file.

    ``.pth`` files are read with ``weights_only=True`` (no code is unpickled). A nested
    ``{"model": ...}`` or ``{"state_dict": ...}`` checkpoint is unwrapped.
    """
    path = Path(path)
    check_regular_file(path, what="weights file", fix="give a .safetensors or .pth file")
    try:
        if path.suffix == ".safetensors":
            sd = load_file(str(path))
        else:
            with warnings.catch_warnings():  # torch warns about pickle protocols before it refuses a file:
                warnings.simplefilter("ignore")  # the refusal below says it in one line
                sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt or truncated file: every reader raises its own type
        raise NascompressError(
            f"weights file {path} is corrupt or not a weights file ({_unreadable(path, e)}); "
            "give a .safetensors or .pth state dict (download or export it again)"
        ) from e
    for key in ("model", "state_dict", "model_ema"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
            break
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise NascompressError(f"weights file {path} does not hold a state dict of tensors")
    bad = [k for k, v in sd.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:  # they would train and evaluate to NaN (a NaN loss is no learning-rate problem)
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise NascompressError(
            f"weights file {path} holds values that are not finite (NaN or inf) in {bad[0]}{more}: the "
            "file is damaged or the training that wrote it diverged; give other weights"
        )
    return sd


def _unreadable(path: Path, e: Exception) -> str:
    """Why a weights file could not be read, in words (a text file, a truncated file, ...)."""
    try:
        head = path.read_bytes()[:512]
    except OSError as err:
        return err.strerror or str(err)
    if not head:
        return "it is empty"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c.isspace() for c in text):
        return "it holds text, not tensors"
    if path.suffix == ".safetensors":
        return f"not a complete safetensors file: {str(e).splitlines()[0]}"
    if "Weights only load failed" in str(e):
        return "it pickles objects other than tensors, which nascompress never unpickles: that could run code"
    return "neither a complete PyTorch zip checkpoint nor a pickle of tensors"


def state_mismatches(model: nn.Module, sd: dict[str, torch.Tensor]) -> list[str]:
    """Every way ``sd`` does not fit ``model``, one phrase each, in the model's tensor order
    (missing and differently shaped tensors), then the file's unexpected tensors."""
    own = model.state_dict()
    out = []
    for k, v in own.items():
        if k not in sd:
            out.append(f"tensor {k} {tuple(v.shape)} is missing from the file")
        elif tuple(sd[k].shape) != tuple(v.shape):
            out.append(f"{k} has shape {tuple(sd[k].shape)} in the file but {tuple(v.shape)} in the model")
    out += [f"unexpected tensor {k} {tuple(v.shape)} in the file" for k, v in sd.items() if k not in own]
    return out


def mismatch_report(bad: list[str], *, first: int = 3) -> str:
    """The first ``first`` mismatches of :func:`state_mismatches` and how many more, for a message."""
    more = f"; and {len(bad) - first} more" if len(bad) > first else ""
    return "; ".join(bad[:first]) + more


def load_state_strict(model: nn.Module, sd: dict[str, torch.Tensor], *, source: str) -> None:
    """Load ``sd`` into ``model`` strictly; on a mismatch name the first differing tensors (up to 3)."""
    bad = state_mismatches(model, sd)
    if bad:
        hint = ""
        if any(b.startswith("tensor head.") for b in bad):
            hint = "; the file has no classifier head (a backbone-only checkpoint): pass {reset_head} for a new one"
        elif any(b.startswith("head.") for b in bad[:3]):
            hint = "; the class count differs: set {num_classes} to match the file, or pass {reset_head}"
        raise SettingError(f"{source} does not match the model: {mismatch_report(bad)}{hint}")
    model.load_state_dict(sd, strict=True)


def checkpoint_filter(sd: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``sd`` in ``model``'s timm layout: timm's own filter of the model's family (original checkpoint
    formats renamed; a ViT's position embedding resampled to its grid)."""
    if is_pyramid(model):
        return pvt_filter(sd, model)
    return checkpoint_filter_fn(sd, model)


def load_pretrained(model: VisionTransformer, path: str | Path, *, reset_head: bool = False) -> None:
    """Load dense timm weights from a local file (original timm/DeiT checkpoints included).

    The position grid is resampled as timm does, and said; a patch kernel of another size is refused
    (:func:`~nascompress.importer.shapes.check_resampling`). ``reset_head``: the head is left at its
    initialisation (the file's may differ or be missing: DINOv2, MAE, CLIP); the rest must be there and fit.
    """
    check_resampling(raw := read_weights_file(path), model, path)
    sd = checkpoint_filter(raw, model)
    if reset_head:
        own = model.state_dict()
        sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
        sd.update({k: v for k, v in own.items() if k.startswith("head.")})
    load_state_strict(model, sd, source=f"weights file {path}")
