"""Top-1 accuracy, loss and teacher agreement on a split."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from .data import InputSpec, make_loader, preprocess


@torch.no_grad()
def evaluate(model: nn.Module, ds: Dataset, *, input_spec: InputSpec, device: torch.device,
             batch_size: int = 256, teacher: nn.Module | None = None,
             teacher_spec: InputSpec | None = None) -> dict[str, Any]:
    """Return ``{"top1", "loss", "n"}`` (and ``"agreement"`` with a teacher) over ``ds``.

    Args:
        model: the model to evaluate (put in eval mode here).
        ds: a dataset yielding raw images (uint8) and labels.
        input_spec: the model's preprocessing.
        teacher: optional model whose top-1 predictions the model's are compared to.
    """
    model.eval().to(device)
    if teacher is not None:
        teacher.eval().to(device)
    correct = agree = n = 0
    loss_sum = 0.0
    for imgs, labels in make_loader(ds, batch_size=batch_size, shuffle=False):
        x, y = preprocess(imgs, input_spec).to(device), labels.to(device)
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        pred = logits.argmax(-1)
        correct += (pred == y).sum().item()
        if teacher is not None:
            tx = x if teacher_spec is None else preprocess(imgs, teacher_spec).to(device)
            agree += (teacher(tx).argmax(-1) == pred).sum().item()
        n += len(y)
    out: dict[str, Any] = {"top1": 100.0 * correct / max(n, 1), "loss": loss_sum / max(n, 1), "n": n}
    if teacher is not None:
        out["agreement"] = 100.0 * agree / max(n, 1)
    return out
