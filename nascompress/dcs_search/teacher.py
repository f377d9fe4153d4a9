"""What the DCS search reads per step besides the batch: the frozen dense model's outputs cached
once per training image (:class:`TeacherCache`: the search reads its training images unaugmented; its
batches carry their images' indices, :class:`~nascompress.data.Indexed`), the step tags (:class:`StepTag`)
and the order of weight and architecture steps in an epoch (:func:`interleave`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import runtime
from ..data import InputSpec, make_loader, preprocess
from ..train.distill import FeatureTap


class StepTag(str):
    """A step's kind, ``"w"`` or ``"a"`` (compares equal to it), carrying the training-set indices
    of its batch's images (``idx``; None where the teacher is not cached)."""

    idx: torch.Tensor | None

    def __new__(cls, kind: str, idx: torch.Tensor | None = None) -> "StepTag":
        tag = super().__new__(cls, kind)
        tag.idx = idx
        return tag


@dataclass
class TeacherCache:
    """The frozen dense model's logits (and pre-logits features) for every training image, computed
    once before the search: the teacher is frozen and the search's training images are not augmented
    (in-memory datasets never are; an ImageFolder is read without its training transform), so each
    image's outputs never change, and reading them saves a teacher forward on every step."""

    logits: torch.Tensor  # (N, classes)
    feat: torch.Tensor | None  # (N, D)

    @classmethod
    @torch.no_grad()
    def build(
        cls,
        dense: nn.Module,
        train: Any,
        spec: InputSpec,
        *,
        device: torch.device,
        feat: bool,
        amp: str = "off",
        batch_size: int = 64,
    ) -> "TeacherCache":
        """``amp``: the search's precision (its steps' teacher forwards would run under it too)."""
        tap = FeatureTap(dense, "pre_logits") if feat else None
        logits, feats = [], []
        try:
            with runtime.autocast(device, amp), runtime.cpu_attention(dense, device, amp):
                for imgs, _ in make_loader(train, batch_size=batch_size, shuffle=False, num_workers=0):
                    logits.append(dense(preprocess(imgs.to(device), spec)).float())
                    if tap is not None:
                        feats.append(tap.pop().float())
        finally:
            if tap is not None:
                tap.remove()
        return cls(torch.cat(logits), torch.cat(feats) if feats else None)

    def read(self, idx: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        idx = idx.to(self.logits.device)
        feat = None if self.feat is None else self.feat[idx].to(device)
        return self.logits[idx].to(device), feat


def teacher_outputs(
    dense: nn.Module,
    x: torch.Tensor,
    *,
    cache: TeacherCache | None = None,
    idx: torch.Tensor | None = None,
    tap: FeatureTap | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The frozen dense model's logits and pre-logits features (``tap``'s; None without one) for the
    batch ``x``: read from ``cache`` at the batch's image indices ``idx`` where both are given, else
    a forward of ``dense``."""
    if cache is not None and idx is not None:
        return cache.read(idx, x.device)
    with torch.no_grad():
        logits = dense(x)
    return logits, (tap.pop() if tap is not None else None)


def interleave(n_w: int, n_a: int) -> list[str]:
    """``n_w`` 'w' and ``n_a`` 'a' steps, the arch-steps spread evenly between the W-steps."""
    keys = [((i + 0.5) / n_w, "w") for i in range(n_w)] + [((j + 1.0) / n_a, "a") for j in range(n_a)]
    return [k for _, k in sorted(keys)]


__all__ = ["StepTag", "TeacherCache", "interleave", "teacher_outputs"]
