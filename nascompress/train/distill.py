"""Knowledge distillation pieces shared by retraining and the DCS search: a forward hook that taps a
model's feature (:class:`FeatureTap`), the logit KD loss and the feature KD loss."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data import InputSpec
from ..errors import NascompressError, SettingError


class FeatureTap:
    """Captures the learned feature X~ (B, D) during ``model(x)`` with a forward (pre-)hook."""

    def __init__(self, model: nn.Module, tap: str):
        self.value: torch.Tensor | None = None
        if tap == "pre_logits":
            head = getattr(model, "head", None)
            if not isinstance(head, nn.Module):
                raise SettingError(
                    "the model has no 'head' module to tap for pre_logits; use {feature_tap} module:<name>"
                )
            self.handle = head.register_forward_pre_hook(lambda m, args: self._set(args[0]))
        else:
            try:
                mod = model.get_submodule(tap[len("module:") :])
            except AttributeError as e:
                raise SettingError(f"{{feature_tap}} {tap!r}: the model has no such submodule") from e
            self.handle = mod.register_forward_hook(lambda m, args, out: self._set(out))

    def _set(self, t: Any) -> None:
        t = t[0] if isinstance(t, (tuple, list)) else t
        self.value = t.mean(1) if t.ndim == 3 else t.flatten(1)  # (B, N, C) -> (B, C)

    def pop(self) -> torch.Tensor:
        v, self.value = self.value, None
        if v is None:
            raise NascompressError("the feature tap saw no forward pass; the model's forward bypasses it")
        return v

    def remove(self) -> None:
        self.handle.remove()


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, *, tau: float) -> torch.Tensor:
    """``tau^2 KL(softmax(t / tau) || softmax(s / tau))``: logits (B, K), (B, K) -> scalar."""
    return (
        F.kl_div(
            F.log_softmax(student / tau, -1), F.log_softmax(teacher / tau, -1), reduction="batchmean", log_target=True
        )
        * tau
        * tau
    )


def feature_kd_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over images of ``||s - t||^2 / ||t||^2``: features (B, D), (B, D) -> scalar."""
    return ((student - teacher).pow(2).sum(-1) / teacher.pow(2).sum(-1).clamp_min(1e-12)).mean()


@torch.no_grad()
def feature_width(model: nn.Module, tap: str, spec: InputSpec, device: torch.device) -> int:
    """Width of ``model``'s tapped feature, from one forward pass of two blank images."""
    was_training, t = model.training, FeatureTap(model, tap)
    try:
        model.eval()(torch.zeros(2, spec.in_chans, *spec.img_size, device=device))
        return t.pop().shape[-1]
    finally:
        t.remove()
        model.train(was_training)
