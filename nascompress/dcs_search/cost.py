"""The DCS search's cost side: the FLOPs of the architecture the gates give (exact, as it will be
materialized, and a differentiable soft estimate), the lambda controller that steers them to a
target, and the end-of-search rounding and calibration.

Every hard count is the aligned one (:func:`~nascompress.methods.dcs.aligned_counts`: 0, the full
width or a multiple of ``align``), so the controller, the calibration and the pipeline's goal
check see the widths the materialized model really has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..layers import aligned_width, qk_pads
from ..methods.dcs import aligned_counts
from ..profiling import count_flops

SMOOTH_MAX_T = 1.0  # temperature (in channels) of the smooth maximum over heads of the Q/K counts


def smooth_max(x: torch.Tensor, t: float = SMOOTH_MAX_T) -> torch.Tensor:
    """A differentiable maximum over the last dim with a positive gradient in every entry:
    t * (logsumexp(x / t) - log H). Exact when all H entries are equal (the heads the search drives
    towards, since they are padded to the largest), within t * log H of the maximum otherwise."""
    return t * (torch.logsumexp(x / t, dim=-1) - math.log(x.shape[-1]))


@dataclass
class CostModel:
    """Per-image MACs of a DCS supernet's architectures, calibrated once with the profiler.

    ``fixed`` is everything but the MLPs and the prunable Q/K part (theta Linears of the
    input-dependent mask included); ``mlp[j]`` block j's dense MLP MACs, linear in its gated width
    ``width[j]`` (residual channels C or hidden neurons Hm: fc1 + fc2 read or write each of them
    once per token); ``qk[j]`` the MACs of one Q/K channel of every head of block j (its q and k
    rows of qkv and its share of QK^T: 2 N C + N^2), 0 when the block's Q/K channels are not
    searched. ``weights[j]`` scales block j in the differentiable cost only (a sensitive block's
    gates feel less of the cost's push; :mod:`nascompress.dcs_search.protect`); the hard counts,
    which the controller steers, are never weighted.
    """

    dense: float
    fixed: float
    mlp: list[float]
    width: list[int]
    qk: list[float]
    heads: list[int]
    head_dim: list[int]
    align: int = 1
    weights: list[float] = field(default_factory=list)

    @classmethod
    def build(
        cls, dense_model: nn.Module, supernet: nn.Module, x: torch.Tensor, *, weights: list[float] | None = None
    ) -> "CostModel":
        dense = count_flops(dense_model, x).total
        rep = count_flops(supernet, x)  # gates still all open (alpha_init > 0): full widths
        n = int(supernet.patch_embed.num_patches) + int(supernet.num_prefix_tokens)
        mlp = [b["mlp"] for b in rep.blocks]
        qk, heads, dims, width = [], [], [], []
        hidden = supernet.dcs_state.family == "hidden"
        for blk in supernet.blocks:
            a = blk.attn
            static = a.qk_mask is not None and a.qk_mask.mode == "static"
            # where the materialized q/k run zero-padded to the head dim (layers.qk_pads: the CPU's
            # fused kernel), a kept channel saves its qkv rows only, not its share of QK^T
            pads = (
                qk_pads(a.qk_layout, qk_dim=1, head_dim=a.head_dim, device_type=x.device.type, dtype=a.qkv.weight.dtype)
                and a.fused_attn
            )
            qk.append(float(2 * n * a.qkv.in_features + (0 if pads else n * n)) if static else 0.0)
            heads.append(a.num_heads)
            dims.append(a.head_dim)
            width.append(blk.mlp.fc1.out_features if hidden else blk.mlp.fc1.in_features)
        full_qk = sum(q * h * d for q, h, d in zip(qk, heads, dims))
        return cls(
            dense=dense,
            fixed=rep.total - sum(mlp) - full_qk,
            mlp=mlp,
            width=width,
            qk=qk,
            heads=heads,
            head_dim=dims,
            align=supernet.dcs_state.align,
            weights=list(weights or [1.0] * len(mlp)),
        )

    def _block_macs(self, j: int, blk: nn.Module, st: Any, *, soft: bool, round_mlp: int) -> Any:
        alpha, C = blk.dcs_alpha, self.width[j]
        if alpha is None:
            kept: Any = C
        elif soft and j in st.soft_gates:
            kept = st.soft_gates[j].sum()
        else:
            kept = int((alpha.detach() > 0).sum())
            if round_mlp and 0 < kept < round_mlp:
                kept = 0
            elif round_mlp and C - round_mlp < kept < C:
                kept = C
            kept = aligned_width(kept, align=self.align, full=C, mode="up")
        macs = self.mlp[j] * kept / C
        if self.qk[j]:
            H, d = self.heads[j], self.head_dim[j]
            if soft and j in st.soft_qk:
                kmax = smooth_max(st.soft_qk[j].reshape(H, d).sum(-1))
            else:
                kmax = max(1, *aligned_counts(blk.attn.qk_mask.theta.detach().reshape(H, d), align=self.align))
            macs = macs + self.qk[j] * H * kmax
        return macs

    def _macs(self, supernet: nn.Module, *, soft: bool, round_mlp: int = 0, weighted: bool = False) -> Any:
        st = supernet.dcs_state
        total: Any = self.fixed
        for j, blk in enumerate(supernet.blocks):
            w = self.weights[j] if weighted else 1.0
            total = total + w * self._block_macs(j, blk, st, soft=soft, round_mlp=round_mlp)
        return total

    @property
    def dense_weighted(self) -> float:
        """The dense model's MACs with every block scaled by its weight (the soft cost's unit)."""
        return self.fixed + sum(
            w * (m + q * h * d) for w, m, q, h, d in zip(self.weights, self.mlp, self.qk, self.heads, self.head_dim)
        )

    def hard_macs(self, supernet: nn.Module, *, round_mlp: int = 0) -> float:
        """Exact MACs of the materialized model the current gates give (= the profiler's count):
        aligned widths, with ``round_mlp`` as :func:`round_blocks` would apply it."""
        return float(self._macs(supernet, soft=False, round_mlp=round_mlp))

    def soft_macs(self, supernet: nn.Module, *, weighted: bool = False) -> torch.Tensor:
        """Differentiable MACs from the last forward's soft gates and soft Q/K masks (with
        ``weighted``: each block scaled by its weight; compare with :attr:`dense_weighted`)."""
        return self._macs(supernet, soft=True, weighted=weighted)

    @torch.no_grad()
    def expected_macs(self, supernet: nn.Module) -> float:
        """MACs in expectation over the Gumbel noise: P(gate on) = sigmoid(logit)."""
        st = supernet.dcs_state
        saved = st.soft_gates, st.soft_qk
        st.soft_gates = {
            j: torch.sigmoid(b.dcs_alpha) for j, b in enumerate(supernet.blocks) if b.dcs_alpha is not None
        }
        st.soft_qk = {j: torch.sigmoid(b.attn.qk_mask.theta) for j, b in enumerate(supernet.blocks) if self.qk[j]}
        try:
            return float(self._macs(supernet, soft=True))
        finally:
            st.soft_gates, st.soft_qk = saved


@dataclass
class LambdaSteer:
    """PI controller of lambda toward a FLOPs target (state: the integral, checkpointed).

    ``lam = clip(integral + gain * e)``, ``integral = clip(integral + rate * e)`` with
    ``e = ratio / target - 1``, both clipped to ``[-lam_max, lam_max]``. ``target`` may move
    (the search's progressive target sets it before every update). The integral only moves
    once some gate has closed (``ratio < 0.999``): while every gate is still open (they start at a
    large logit and take steps to cross) the error is large and constant, and integrating it wound
    lambda up far past the value that holds the target, so the search overshot and ended below
    it (0.607 for a 0.7 target on the README job, 0.40 for 0.6 on the bench). lambda is the
    Lagrange multiplier of the equality ``ratio = target``: positive above the target (the cost
    pushes channels closed), negative below it (it reopens the channels closest to the threshold);
    with Adam only the sign of the cost's push is felt, so the restoring force below the target
    is what stops the momentum and the entropy term from closing on past it.
    """

    target: float
    integral: float
    gain: float = 2.0
    rate: float = 0.05
    lam_max: float = 5.0

    def update(self, ratio: float) -> float:
        e = ratio / self.target - 1
        if ratio < 0.999:  # conditional integration: no wind-up before any gate has crossed
            self.integral = max(-self.lam_max, min(self.lam_max, self.integral + self.rate * e))
        return max(-self.lam_max, min(self.lam_max, self.integral + self.gain * e))


def _protected(blk: nn.Module) -> torch.Tensor | None:
    return getattr(blk, "dcs_protect", None)


@torch.no_grad()
def round_blocks(supernet: nn.Module, k: int) -> dict[str, list[int]]:
    """Close block MLPs keeping fewer than ``k`` channels, open those keeping more than C - k.

    Not in the paper; why: a block MLP with a handful of channels still pays its whole hidden
    width at run time (fc1's bias and output, GELU over all hidden units), which FLOPs do not
    count, so its few FLOPs buy little speed; a nearly full one pays a gather and a write-back
    for nothing. Closing sets alpha to -30 (no Gumbel sample reopens it); opening sets the
    negative alphas to +1. A block with protected gates is never closed. Returns the block indices changed.
    """
    closed, opened = [], []
    for j, blk in enumerate(supernet.blocks):
        alpha = blk.dcs_alpha
        if alpha is None:
            continue
        kept, C = int((alpha > 0).sum()), alpha.numel()
        if 0 < kept < k and _protected(blk) is None:
            alpha.clamp_(max=-30.0)
            closed.append(j)
        elif C - k < kept < C:
            alpha.clamp_(min=1.0)
            opened.append(j)
    return {"closed": closed, "opened": opened}


@torch.no_grad()
def calibrate(
    supernet: nn.Module,
    cost: CostModel,
    target: float,
    *,
    round_mlp: int = 0,
    apply_round: bool = True,
    at_most: bool = False,
) -> float:
    """Shift every (unprotected) alpha by one constant so that the hard ratio (counted with
    ``round_mlp`` as :func:`round_blocks` would round) is closest to ``target`` (``at_most``: the
    closest at or under it); return the shift.
    Kept counts fall monotonically as the shift rises (rounding and alignment keep that order), so
    the shift is bisected. With ``apply_round`` the rounding is then applied to the logits (the end
    of a search); without it (the projection during the search) only the shift is.
    The search's projection onto its moving budget and, at its end, the guarded landing."""
    blocks = [blk for blk in supernet.blocks if blk.dcs_alpha is not None]
    if not blocks:
        return 0.0
    free = [
        ~_protected(b) if _protected(b) is not None else torch.ones_like(b.dcs_alpha, dtype=torch.bool) for b in blocks
    ]
    alphas = [b.dcs_alpha for b in blocks]
    vals = torch.cat([a[f].flatten() for a, f in zip(alphas, free)]).sort().values
    if not len(vals):
        return 0.0
    cuts = torch.cat([vals[:1] - 1, (vals[1:] + vals[:-1]) / 2, vals[-1:] + 1]).tolist()

    def shifted(b: float) -> None:
        for a, f in zip(alphas, free):
            a[f] -= b

    saved = [a.clone() for a in alphas]
    best, best_err = 0.0, math.inf
    lo, hi = 0, len(cuts) - 1  # ratio decreases as the cut rises: bisect for the target
    while lo <= hi:
        mid = (lo + hi) // 2
        shifted(cuts[mid])
        r = cost.hard_macs(supernet, round_mlp=round_mlp) / cost.dense
        for a, s in zip(alphas, saved):
            a.copy_(s)
        if abs(r / target - 1) < best_err and (not at_most or r <= target):
            best, best_err = cuts[mid], abs(r / target - 1)
        lo, hi = (mid + 1, hi) if r > target else (lo, mid - 1)
    shifted(best)
    if round_mlp and apply_round:
        round_blocks(supernet, round_mlp)
    return best


@torch.no_grad()
def selection_record(supernet: nn.Module, cost: CostModel) -> dict[str, Any]:
    """FLOPs (exact and expected) and widths kept per block (aligned, as materialized), for the log."""
    macs = cost.hard_macs(supernet)
    mlp_kept, qk_kept = [], []
    for blk in supernet.blocks:
        a = blk.dcs_alpha
        mlp_kept.append(None if a is None else aligned_counts(a, align=cost.align)[0])
        qm = blk.attn.qk_mask
        if qm is not None and qm.mode == "static":
            qk_kept.append(aligned_counts(qm.theta.reshape(qm.heads, -1), align=cost.align))
    rec = {
        "macs": macs,
        "flops_ratio": macs / cost.dense,
        "expected_flops_ratio": cost.expected_macs(supernet) / cost.dense,
        "mlp_kept": mlp_kept,
    }
    if qk_kept:
        rec["qk_kept"] = qk_kept
    return rec


__all__ = ["CostModel", "LambdaSteer", "smooth_max", "round_blocks", "calibrate", "selection_record"]
