"""What a pretrained model cannot lose, measured before the DCS search.

* Outlier channels (:func:`outlier_gates`): pretrained ViTs carry a few residual channels with
  activations tens to hundreds of times larger than the rest ("massive activations"); they act as
  biases the attention and the norms depend on, and removing one breaks the model. Residual
  family: the residual channels whose largest magnitude entering the MLP half exceeds
  ``ratio`` x the block's median; hidden family: the hidden neurons whose output (rms activation x
  ||fc2 column||) exceeds ``ratio`` x the block's median (the neurons that write such values).
  Their gates are fixed open (:func:`~nascompress.methods.dcs.protect_gates`), at most
  ``max_share`` of a block's gates (the largest first).
* Block sensitivity (:func:`block_sensitivity`): the KL from the dense model when one block alone
  loses its ``SENSITIVITY_DROP`` least important gates of the family. :func:`cost_weights` turns it
  into per-block weights of the differentiable cost, ``clip(sqrt(median / s_j), 1/4, 4)``: a block
  that hurts more when pruned feels less of the cost's push, as a global importance ranking
  (NViT, Torch-Pruning's global pruning) would prune it less.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..models.layers import aligned_width
from ..methods.dcs_importance import BlockStats
from ..methods.dcs import DCSConfig, make_supernet
from .family import dense_targets
from .metrics import Protection

SENSITIVITY_DROP = 0.5  # share of one block's gates dropped to measure its sensitivity
WEIGHT_CLIP = 4.0  # cost weights stay within [1/4, 4]


@torch.no_grad()
def outlier_gates(stats: list[BlockStats], family: str, *, ratio: float, max_share: float = 0.05) -> list[torch.Tensor]:
    """Per block, a bool mask over the family's gates: the outlier channels to keep open."""
    out = []
    for s in stats:
        v = s.residual_absmax if family == "residual" else s.importance.hidden
        v = v.float()
        mask = v > ratio * v.median().clamp_min(1e-12)
        cap = int(max_share * v.numel())
        if int(mask.sum()) > cap:  # keep the largest only
            top = v.topk(cap).indices if cap > 0 else v.new_zeros(0, dtype=torch.long)
            mask = torch.zeros_like(mask)
            mask[top] = True
        out.append(mask)
    return out


class _Replay(nn.Module):
    """Stands in for the blocks before the probed one: returns their (dense) output, cached."""

    def __init__(self) -> None:
        super().__init__()
        self.out: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out


@torch.no_grad()
def block_sensitivity(
    dense: nn.Module,
    images: list[torch.Tensor],
    stats: list[BlockStats],
    family: str,
    *,
    align: int = 1,
    protect: list[torch.Tensor] | None = None,
    targets: list[torch.Tensor] | None = None,
) -> list[float]:
    """Per block j: mean KL(dense || model with block j's ``SENSITIVITY_DROP`` least important
    gates of ``family`` closed) on the preprocessed ``images`` (batches). One probe supernet.

    Blocks before j are the dense model's, so their output is computed once per image (advanced one
    block per probe) and replayed: probing block j runs blocks j.. only (the same function, about 40%
    fewer block forwards on a 12-block model)."""
    targets = targets or dense_targets(dense, images)
    cfg = DCSConfig(qk_mask="none", mlp_gates=family, init_spread=0.0, align=align, hidden_fill="mean")
    probe = make_supernet(copy.deepcopy(dense), cfg, fill=[s.hidden_mean for s in stats]).eval()
    n = sum(len(x) for x in images)
    blocks = probe.blocks
    sequential = isinstance(blocks, nn.Sequential)
    states: list[torch.Tensor] = []  # per batch: the input of block j (the dense model's residual stream)
    if sequential:
        grab = blocks[0].register_forward_pre_hook(lambda _m, args: states.append(args[0]))
        try:
            for x in images:
                probe(x)
        finally:
            grab.remove()
    replay = _Replay()
    out = []
    try:
        for j, (blk, s) in enumerate(zip(list(blocks), stats)):
            imp = s.importance.mlp(family).to(blk.dcs_alpha.device).clone()
            if protect is not None:
                imp[protect[j].to(imp.device)] = float("inf")
            k = aligned_width(round((1 - SENSITIVITY_DROP) * imp.numel()), align=align, full=imp.numel(), mode="up")
            blk.dcs_alpha.fill_(-1.0)
            blk.dcs_alpha[imp.topk(k).indices] = 1.0
            if sequential:
                probe.blocks = nn.Sequential(replay, *list(blocks)[j:])
            kl = 0.0
            for b, (x, t) in enumerate(zip(images, targets)):
                if sequential:
                    replay.out = states[b]
                kl += F.kl_div(F.log_softmax(probe(x).float(), -1), t, log_target=True, reduction="sum").item()
            out.append(kl / n)
            blk.dcs_alpha.fill_(1.0)
            if sequential:  # advance the cached stream through the dense block j
                states = [blk(h) for h in states]
    finally:
        probe.blocks = blocks
    return out


def cost_weights(sensitivity: list[float]) -> list[float]:
    """``clip(sqrt(median / s_j), 1/WEIGHT_CLIP, WEIGHT_CLIP)`` per block (1 where all are equal)."""
    med = float(torch.tensor(sensitivity).median())
    return [
        min(WEIGHT_CLIP, max(1 / WEIGHT_CLIP, (med / max(s, 1e-12)) ** 0.5)) if med > 0 else 1.0 for s in sensitivity
    ]


def protection(
    dense: nn.Module,
    images: list[torch.Tensor],
    stats: list[BlockStats],
    family: str,
    *,
    ratio: float,
    block_weights: bool,
    align: int,
    targets: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor] | None, list[float] | None, Protection]:
    """Outlier masks (``ratio`` 0: none), block cost weights (or None) and their log record
    (:class:`~.metrics.Protection`)."""
    info = Protection.new()
    protect = None
    if ratio > 0 and family != "none":
        protect = outlier_gates(stats, family, ratio=ratio)
        info = info.set(protected=[int(m.sum()) for m in protect])
    weights = None
    if block_weights and family != "none":
        sens = block_sensitivity(dense, images, stats, family, align=align, protect=protect, targets=targets)
        weights = cost_weights(sens)
        info = info.set(block_sensitivity=sens, block_weights=weights)
    return protect, weights, info


__all__ = ["outlier_gates", "block_sensitivity", "cost_weights", "protection", "SENSITIVITY_DROP"]
