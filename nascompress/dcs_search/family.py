"""The MLP gate family of a DCS search, chosen by a short measured probe on the user's model
(``mlp_gates="auto"``).

Both families are pruned, with no training, to the same FLOPs: every block keeps the same share
of its gates (residual channels or hidden neurons) by measured activation importance (aligned
widths; closed hidden neurons filled with their mean when the search would fill them), at two
points: half the way to the target and the target itself (MLPs only, Q/K untouched). The family
whose models stay closer to the dense one (the KL summed over both points, on the calibration
images) is chosen; the log and metrics record both KLs and the reason.

Why a probe and not a rule: the paper's residual gates remove channels from the residual stream
every later block reads; a model trained from scratch with DCS in mind tolerates that, but a
pretrained model stores information (and its "massive activations") in specific residual channels,
and removing them breaks it, while its MLP hidden neurons are highly redundant.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..models.layers import aligned_width
from ..methods.dcs_importance import BlockStats, ChannelImportance
from ..methods.dcs import DCSConfig, make_supernet
from ..profiling import count_flops
from .metrics import FamilyChoice

FAMILIES = ("residual", "hidden")
DEFAULT_PROBE_TARGET = 0.7  # the probe's FLOPs target when the search has none


@torch.no_grad()
def dense_targets(dense: nn.Module, images: list[torch.Tensor]) -> list[torch.Tensor]:
    """The dense model's log-probabilities on ``images`` (the reference every probe's KL is taken to)."""
    dense = dense.eval()
    return [F.log_softmax(dense(x).float(), -1) for x in images]


def mlp_share(dense: nn.Module, x: torch.Tensor, ratio: float) -> float:
    """The share of every MLP's gated width to keep so that the model has ``ratio`` x the dense
    FLOPs with only its MLPs pruned (either family: an MLP's MACs are linear in both widths)."""
    rep = count_flops(dense, x)
    mlp = sum(b["mlp"] for b in rep.blocks)
    return max(0.0, 1 - (1 - ratio) * rep.total / mlp) if mlp else 1.0


@torch.no_grad()
def probe_kl(
    dense: nn.Module,
    images: list[torch.Tensor],
    importance: list[ChannelImportance],
    family: str,
    shares: list[float],
    *,
    align: int,
    hidden_fill: str,
    fill: list[torch.Tensor] | None = None,
    targets: list[torch.Tensor] | None = None,
) -> float:
    """Sum over ``shares`` of the mean KL(dense || model whose every block keeps that share of its
    ``family`` gates by ``importance``) on ``images`` (batches of preprocessed images)."""
    targets = targets or dense_targets(dense, images)
    cfg = DCSConfig(qk_mask="none", mlp_gates=family, init_spread=0.0, align=align, hidden_fill=hidden_fill)
    probe = make_supernet(copy.deepcopy(dense), cfg, fill=fill).eval()
    n, total = sum(len(x) for x in images), 0.0
    for share in shares:
        for blk, ci in zip(probe.blocks, importance):
            imp = ci.mlp(family).to(blk.dcs_alpha.device)
            k = aligned_width(round(share * imp.numel()), align=align, full=imp.numel(), mode="up")
            blk.dcs_alpha.fill_(-1.0)
            blk.dcs_alpha[imp.topk(k).indices] = 1.0
        total += (
            sum(
                F.kl_div(F.log_softmax(probe(x).float(), -1), t, log_target=True, reduction="sum").item()
                for x, t in zip(images, targets)
            )
            / n
        )
    return total


@torch.no_grad()
def choose_family(
    dense: nn.Module,
    images: list[torch.Tensor],
    stats: list[BlockStats],
    *,
    target: float | None,
    align: int,
    hidden_fill: str,
    targets: list[torch.Tensor] | None = None,
) -> tuple[str, FamilyChoice]:
    """``(family, why)``: the family whose probe models stay closer to ``dense`` (see the module
    docstring) and why (:class:`~.metrics.FamilyChoice`: each family's KL, the shares probed, the reason)."""
    target = DEFAULT_PROBE_TARGET if target is None else target
    x = images[0][:1]
    shares = [mlp_share(dense, x, r) for r in (1 - (1 - target) / 2, target)]
    targets = targets or dense_targets(dense, images)
    imp, fill = [s.importance for s in stats], [s.hidden_mean for s in stats]
    kls = {
        f: probe_kl(dense, images, imp, f, shares, align=align, hidden_fill=hidden_fill, fill=fill, targets=targets)
        for f in FAMILIES
    }
    chosen = min(FAMILIES, key=lambda f: (kls[f], f != "residual"))  # a tie keeps the paper's family
    other = next(f for f in FAMILIES if f != chosen)
    reason = (
        f"{chosen}: its models pruned to {1 - (1 - target) / 2:.3g}x and {target:.3g}x the FLOPs (MLPs only, "
        f"by activation importance, no training) stay closer to the dense model (KL {kls[chosen]:.4g} against "
        f"{kls[other]:.4g} for {other})"
    )
    return chosen, FamilyChoice.new(family_kl=kls, family_shares=shares, family_reason=reason)


__all__ = ["choose_family", "probe_kl", "mlp_share", "dense_targets", "FAMILIES"]
