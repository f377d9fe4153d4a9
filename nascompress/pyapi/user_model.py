"""The models and settings users hold, as the API takes them: a ``torch.compile``d model
(``_orig_mod``) or a ``DataParallel`` / ``DistributedDataParallel`` one (``.module``) unwrapped
(:func:`unwrap`); a half, bf16 or CUDA model copied to fp32 on the CPU (:func:`cpu_fp32`; the caller's
model is never moved or cast in place) and the result given back in the caller's dtype
(:func:`user_dtype`); a ``torch.device`` as its name, a device the library does not train on refused
in one line (:func:`device_name`); a model with ``qk_norm`` refused before a search whose static Q/K
mask could not be materialized on it (:func:`check_qk_norm`); the parameters the caller froze
recorded in the run's ``arch.json`` (:func:`with_frozen`: no stage trains them) and given back frozen
(:func:`restore_frozen`)."""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch
from torch import nn

from ..errors import NascompressError
from ..runs.files import Arch

FROZEN_KEY = "frozen"  # arch.json: the parameters the caller froze; no stage trains them

DEVICE_TYPES = ("cpu", "cuda")  # what the library trains on ("auto": cuda where there is one, else cpu)


def unwrap(model: Any) -> Any:
    """The module inside a ``torch.compile`` wrapper (``_orig_mod``) or a ``DataParallel`` /
    ``DistributedDataParallel`` one (``.module``), at any depth; anything else as it is."""
    while isinstance(model, nn.Module):
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            break
    return model


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def user_dtype(model: Any) -> torch.dtype | None:
    """The floating dtype of the caller's model (of its first floating parameter) when it is not
    fp32 (a ``.half()`` or bf16 model), else None."""
    model = unwrap(model)
    if not isinstance(model, nn.Module):
        return None
    dt = next((t.dtype for t in _tensors(model) if t.is_floating_point()), torch.float32)
    return None if dt == torch.float32 else dt


def cpu_fp32(model: nn.Module) -> nn.Module:
    """``model`` when every tensor of it is on the CPU and every floating one fp32; else a copy that
    is (the caller's model is never moved to the CPU or cast in place)."""
    ts = _tensors(model)
    if all(t.device.type == "cpu" and (not t.is_floating_point() or t.dtype == torch.float32) for t in ts):
        return model
    return copy.deepcopy(model).cpu().float()  # (float(): floating tensors only; integer buffers kept)


def as_user_dtype(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """A result model in the caller's dtype (:func:`user_dtype`; None: as it is, fp32)."""
    return model if dtype is None else model.to(dtype)


def device_name(device: Any, *, arg: str = "device") -> str:
    """``device`` (a name or a ``torch.device``) as the name the stages record; a device the library
    does not train on (``mps``, ``xla`` ...) refused in one line naming the argument ``arg``."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise NascompressError(f"{arg}= must be 'auto', 'cpu', 'cuda' or 'cuda:N' (or a torch.device), got {device!r}")
    if device in ("", "auto"):
        return "auto"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise NascompressError(f"{arg}={device!r} is not a device: give 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if kind not in DEVICE_TYPES:
        raise NascompressError(
            f"{arg}={device!r} is not supported: nascompress trains on the CPU or CUDA; give {arg}='cpu' or 'cuda'"
        )
    return device


def has_qk_norm(model: Any) -> bool:
    """Does ``model`` (a module, or a result holding one in ``.model``) normalize its queries and keys
    (timm's ``qk_norm=True``)? A run directory is not loaded for this (False)."""
    m = unwrap(getattr(model, "model", model))
    if not isinstance(m, nn.Module):
        return False
    return any(
        getattr(mod, "q_norm", None) is not None and not isinstance(mod.q_norm, nn.Identity) for mod in m.modules()
    )


def check_qk_norm(model: Any, qk_mask: str, *, how: str) -> None:
    """Refuse, before anything is searched, a static Q/K mask (the default) on a model with
    ``qk_norm``: it could not be materialized (the norm needs every channel). ``how``: how the caller
    sets the mask, for the message (``qk_mask='none'`` or ``dcs={'qk_mask': 'none'}``)."""
    if qk_mask == "static" and has_qk_norm(model):
        raise NascompressError(
            "this model normalizes its queries and keys (qk_norm=True), so a static Q/K mask (the default) "
            f"could not be materialized on it: give {how} (or 'input') to search the MLP channels alone"
        )


def frozen_names(model: Any) -> list[str]:
    """The names of the parameters the caller froze (``requires_grad=False``) in ``model`` (a module
    or a result holding one); none for a run directory."""
    m = unwrap(getattr(model, "model", model))
    if not isinstance(m, nn.Module) or all(p.requires_grad for p in m.parameters()):
        return []
    return [n for n, p in m.named_parameters() if not p.requires_grad]


def with_frozen(arch: Arch, names: Iterable[str]) -> Arch:
    """``arch`` recording ``names`` (:func:`frozen_names`) as :attr:`Arch.frozen` (``arch.json``'s
    :data:`FROZEN_KEY`): the one place a run keeps them, read by every training stage
    (:func:`nascompress.train.loop.fit` leaves them out of the optimizer) and by
    :func:`restore_frozen`; none: the key left out."""
    return arch.set(frozen=tuple(names))


def restore_frozen(model: nn.Module, arch: Arch | dict[str, Any]) -> nn.Module:
    """``model`` with the parameters its ``arch`` records as frozen given back ``requires_grad=False``
    (in place; a model read from a run comes with every parameter trainable)."""
    names = set(Arch.of(arch).frozen)
    for n, p in model.named_parameters():
        if n in names:
            p.requires_grad_(False)
    return model


__all__ = [
    "frozen_names",
    "FROZEN_KEY",
    "with_frozen",
    "restore_frozen",
    "DEVICE_TYPES",
    "unwrap",
    "user_dtype",
    "cpu_fp32",
    "as_user_dtype",
    "device_name",
    "has_qk_norm",
    "check_qk_norm",
]
