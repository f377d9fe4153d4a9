"""The magnitude rules of the search's baseline (:mod:`.baseline`): the MLP hidden neurons'
(:func:`magnitude_scores`, :func:`set_hidden_gates`) and, where the search gates them, the heads' and
the blocks' (:class:`Structure`, :func:`fix_structure`).

For heads and blocks the baseline keeps the searched model's shape on those axes, chosen by
magnitude: every block keeps as many heads as the searched model's, those of largest L2 norm of
their qkv rows and proj columns (:func:`~nascompress.methods.dcs_structure.head_scores`), and as
many blocks are removed as the searched model removes, those whose residual branches write the
smallest weights (:func:`~nascompress.methods.dcs_structure.block_scores`). The MLP hidden neurons
then make up the rest of the FLOPs target, as without these axes: the two candidates differ in
which units they keep, not in how many.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models.layers import aligned_width
from ..methods.dcs_gates import PROTECT_LOGIT
from ..methods.dcs_supernet import head_gates
from ..methods.dcs_structure import block_scores, head_scores


@torch.no_grad()
def magnitude_scores(model: nn.Module) -> list[torch.Tensor]:
    """Per block, the hidden neurons' group L2 magnitude divided by the block's mean (Torch-Pruning's
    ``GroupMagnitudeImportance(p=2)`` with its ``mean`` normalizer)."""
    out = []
    for blk in model.blocks:
        fc1, fc2 = blk.mlp.fc1, blk.mlp.fc2
        s = fc1.weight.float().pow(2).sum(1) + fc2.weight.float().pow(2).sum(0)
        if fc1.bias is not None:
            s = s + fc1.bias.float().pow(2)
        out.append(s / s.mean().clamp_min(1e-12))
    return out


def set_hidden_gates(supernet: nn.Module, scores: list[torch.Tensor], threshold: float, align: int) -> list[int]:
    """Open, per block, its neurons scoring above ``threshold`` (the count rounded up to ``align``, at
    least ``align``; the highest scores first) and close the rest; returns the kept counts."""
    counts = []
    with torch.no_grad():
        for blk, s in zip(supernet.blocks, scores):
            n = s.numel()
            k = aligned_width(max(int((s > threshold).sum()), min(align, n)), align=align, full=n, mode="up")
            keep = torch.zeros(n, dtype=torch.bool, device=s.device)
            keep[s.topk(k).indices] = True
            blk.dcs_alpha.copy_(torch.where(keep, PROTECT_LOGIT, -PROTECT_LOGIT).to(blk.dcs_alpha))
            counts.append(k)
    return counts


@dataclass(frozen=True)
class Structure:
    """The searched model's heads kept per block (None: no head gates) and blocks removed (None: no block gates)."""

    heads: list[int] | None = None
    skipped: int | None = None

    @classmethod
    @torch.no_grad()
    def of(cls, supernet: nn.Module) -> "Structure":
        heads = [int((head_gates(b) > 0).sum()) for b in supernet.blocks if head_gates(b) is not None]
        depth = [b.dcs_depth for b in supernet.blocks if getattr(b, "dcs_depth", None) is not None]
        return cls(
            heads=heads if len(heads) == len(supernet.blocks) else None,
            skipped=sum(not bool((d > 0).any()) for d in depth) if depth else None,
        )


@torch.no_grad()
def fix_structure(supernet: nn.Module, dense: nn.Module, structure: Structure) -> dict[str, Any]:
    """Fix ``supernet``'s head and block gates (+-PROTECT_LOGIT) to ``structure``'s counts by the
    magnitude of ``dense``'s heads and blocks; returns the log record (heads kept, blocks removed)."""
    info: dict[str, Any] = {}
    if structure.heads is not None:
        for blk, dblk, k in zip(supernet.blocks, dense.blocks, structure.heads):
            s = head_scores(dblk.attn)
            logits = head_gates(blk)
            keep = torch.zeros(s.numel(), dtype=torch.bool)
            keep[s.topk(k).indices] = True
            logits.copy_(torch.where(keep, PROTECT_LOGIT, -PROTECT_LOGIT).to(logits))
        info["heads_kept"] = list(structure.heads)
    if structure.skipped is not None:
        s = block_scores(dense)
        drop = set(s.argsort()[: structure.skipped].tolist())
        for j, blk in enumerate(supernet.blocks):
            blk.dcs_depth.fill_(-PROTECT_LOGIT if j in drop else PROTECT_LOGIT)
        info["skipped_blocks"] = sorted(drop)
    return info


__all__ = ["Structure", "fix_structure", "magnitude_scores", "set_hidden_gates"]
