"""Distillation losses shared by the methods' training recipes (pure functions)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def kl_to_teacher(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student), averaged over the batch. logits, teacher_logits: (B, classes)."""
    return F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher_logits, -1), reduction="batchmean",
                    log_target=True)


def features_and_logits(model, teacher, x: torch.Tensor):
    """Student tokens and logits (with grad) and the teacher's (without): the distillation inputs.

    Returns (feats (B, N, C), logits (B, K), teacher_feats (B, N_t, C_t), teacher_logits (B, K)).
    """
    feats = model.forward_features(x)
    logits = model.forward_head(feats)
    with torch.no_grad():
        t_feats = teacher.forward_features(x)
        t_logits = teacher.forward_head(t_feats)
    return feats, logits, t_feats, t_logits
