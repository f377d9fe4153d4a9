"""Distillation losses shared by the methods' training recipes (pure functions)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def kl_to_teacher(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student), averaged over the batch. logits, teacher_logits: (B, classes)."""
    return F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher_logits, -1), reduction="batchmean",
                    log_target=True)
