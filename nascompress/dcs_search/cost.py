"""The DCS search's cost side: the FLOPs of the architecture the gates give (exact, as it will be
materialized, and a differentiable soft estimate), the lambda controller that steers them to a
target, and the end-of-search rounding and calibration.

Every hard count is the aligned one (:func:`~nascompress.methods.dcs.aligned_counts`: 0, the full
width or a multiple of ``align``), so the controller, the calibration and the pipeline's goal
check see the widths the materialized model really has.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from ..models.layers import aligned_width, qk_pads
from ..methods.dcs_gates import aligned_counts
from ..methods.dcs_supernet import head_gates
from ..profiling import count_flops

SMOOTH_MAX_T = 1.0  # temperature (in channels) of the smooth maximum over heads of the Q/K counts


def smooth_max(x: torch.Tensor, t: float = SMOOTH_MAX_T) -> torch.Tensor:
    """A differentiable maximum over the last dim with a positive gradient in every entry:
    t * (logsumexp(x / t) - log H). Exact when all H entries are equal (the heads the search drives
    towards, since they are padded to the largest), within t * log H of the maximum otherwise."""
    return t * (torch.logsumexp(x / t, dim=-1) - math.log(x.shape[-1]))


def block_arch(blk: nn.Module, st: Any, j: int, *, soft: bool, align: int, round_mlp: int = 0) -> dict[str, Any]:
    """Block ``j``'s architecture as the gates give it (see :func:`soft_arch`): ints from the hard
    gates (as materialized: aligned widths, ``round_mlp`` as :func:`round_blocks` would apply it), or
    with ``soft`` the last forward's soft values where the state has them (differentiable tensors)."""
    a = blk.attn
    H, d = a.num_heads, a.head_dim
    depth = getattr(blk, "dcs_depth", None)
    if depth is None:
        present: Any = 1
    elif soft and j in st.soft_depth:
        present = st.soft_depth[j].sum()
    else:
        present = int(bool((depth.detach() > 0).any()))
    hg = head_gates(blk)
    open_heads = None if hg is None else (hg.detach() > 0)
    soft_heads = st.soft_heads.get(j) if soft and hg is not None else None
    if hg is None:
        heads: Any = H
    elif soft_heads is not None:
        heads = soft_heads.sum()
    else:
        heads = int(open_heads.sum())
    qm = a.qk_mask
    if qm is None or qm.mode != "static":
        qk: Any = d
    elif soft and j in st.soft_qk:
        counts = st.soft_qk[j].reshape(H, d).sum(-1)
        if hg is not None:  # a closed head's Q/K channels are gone with it
            counts = counts * (soft_heads if soft_heads is not None else open_heads.to(counts.dtype))
        qk = smooth_max(counts)
    else:
        kept = aligned_counts(qm.theta.detach().reshape(H, d), align=align)
        kept = [c for h, c in enumerate(kept) if open_heads is None or open_heads[h]]
        qk = max(1, *kept) if kept else 0
    alpha = blk.dcs_alpha
    C = blk.mlp.fc1.out_features if st.family == "hidden" else blk.mlp.fc1.in_features
    if alpha is None:
        hidden: Any = C
    elif soft and j in st.soft_gates:
        hidden = st.soft_gates[j].sum()
    else:
        hidden = int((alpha.detach() > 0).sum())
        if round_mlp and 0 < hidden < round_mlp:
            hidden = 0
        elif round_mlp and C - round_mlp < hidden < C:
            hidden = C
        hidden = aligned_width(hidden, align=align, full=C, mode="up")
    return {"present": present, "heads": heads, "qk": qk, "hidden": hidden}


def soft_arch(supernet: nn.Module, *, soft: bool = True, round_mlp: int = 0) -> list[dict[str, Any]]:
    """Per block of a DCS supernet: ``present`` (the block gate, 1 without one), ``heads`` (kept
    heads), ``qk`` (the Q/K width every kept head is padded to: a smooth maximum over the kept heads'
    counts; the head dim where Q/K is not searched) and ``hidden`` (the kept MLP width of the gate
    family: hidden neurons or residual channels). ``soft``: 0-d tensors from the last forward's soft
    gates (differentiable; the hard value where a block has none), else the hard ints of the
    materialized model. What a cost per block (FLOPs here, a latency table) is computed from."""
    st = supernet.dcs_state
    out = [
        block_arch(blk, st, j, soft=soft, align=st.align, round_mlp=round_mlp) for j, blk in enumerate(supernet.blocks)
    ]
    if soft:
        p = next(supernet.parameters())
        out = [{k: torch.as_tensor(v, dtype=torch.float32, device=p.device) for k, v in b.items()} for b in out]
    return out


@dataclass
class CostModel:
    """Per-image MACs of a DCS supernet's architectures, calibrated once with the profiler.

    ``fixed`` is everything but the MLPs and the prunable Q/K part (theta Linears of the
    input-dependent mask included); ``mlp[j]`` block j's dense MLP MACs, linear in its gated width
    ``width[j]`` (residual channels C or hidden neurons Hm: fc1 + fc2 read or write each of them
    once per token); ``qk[j]`` the MACs of one Q/K channel of every head of block j (its q and k
    rows of qkv and its share of QK^T: 2 N C + N^2), 0 when the block's Q/K channels are not
    searched. Where block j has head or block gates, ``attn[j]`` is its attention's dense MACs but
    that Q/K part (linear in the kept heads: a head's v rows, its share of AV and QK^T, its proj
    columns), and with a block gate ``other[j]`` the rest of the block; else both are 0 (in
    ``fixed``). A block costs ``present x (mlp x kept / width + attn x heads / H + other + qk x heads x
    qk_width)`` (:func:`block_arch`). ``weights[j]`` scales block j in the differentiable cost only (a sensitive block's
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
    attn: list[float] = field(default_factory=list)
    unit = "FLOPs"  # what its ratios are of (messages)
    other: list[float] = field(default_factory=list)

    @classmethod
    def build(
        cls, dense_model: nn.Module, supernet: nn.Module, x: torch.Tensor, *, weights: list[float] | None = None
    ) -> "CostModel":
        dense = count_flops(dense_model, x).total
        rep = count_flops(supernet, x)  # gates still all open (alpha_init > 0): full widths
        n = int(supernet.patch_embed.num_patches) + int(supernet.num_prefix_tokens)
        mlp = [b["mlp"] for b in rep.blocks]
        qk, heads, dims, width, attn, other = [], [], [], [], [], []
        hidden = supernet.dcs_state.family == "hidden"
        for blk, counted in zip(supernet.blocks, rep.blocks):
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
            gated = getattr(blk, "dcs_depth", None) is not None
            attn.append(
                counted["attn"] - qk[-1] * a.num_heads * a.head_dim if gated or head_gates(blk) is not None else 0.0
            )
            other.append(counted["other"] if gated else 0.0)
        full_qk = sum(q * h * d for q, h, d in zip(qk, heads, dims))
        return cls(
            dense=dense,
            fixed=rep.total - sum(mlp) - full_qk - sum(attn) - sum(other),
            mlp=mlp,
            width=width,
            qk=qk,
            heads=heads,
            head_dim=dims,
            align=supernet.dcs_state.align,
            weights=list(weights or [1.0] * len(mlp)),
            attn=attn,
            other=other,
        )

    def like(self, dense_model: nn.Module, supernet: nn.Module, x: torch.Tensor) -> "CostModel":
        """The same kind of cost for another supernet of ``dense_model`` (the magnitude baseline's)."""
        return CostModel.build(dense_model, supernet, x)

    def _block_macs(self, j: int, blk: nn.Module, st: Any, *, soft: bool, round_mlp: int) -> Any:
        a = block_arch(blk, st, j, soft=soft, align=self.align, round_mlp=round_mlp)
        macs = self.mlp[j] * a["hidden"] / self.width[j]
        if self.attn[j] or self.other[j]:
            macs = macs + self.attn[j] * a["heads"] / self.heads[j] + self.other[j]
        if self.qk[j]:
            macs = macs + self.qk[j] * a["heads"] * a["qk"]
        return a["present"] * macs

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
            w * (m + q * h * d + at + o)
            for w, m, q, h, d, at, o in zip(
                self.weights, self.mlp, self.qk, self.heads, self.head_dim, self.attn, self.other
            )
        )

    def hard_macs(self, supernet: nn.Module, *, round_mlp: int = 0) -> float:
        """Exact MACs of the materialized model the current gates give (= the profiler's count):
        aligned widths, with ``round_mlp`` as :func:`round_blocks` would apply it."""
        return float(self._macs(supernet, soft=False, round_mlp=round_mlp))

    def soft_macs(self, supernet: nn.Module, *, weighted: bool = False) -> torch.Tensor:
        """Differentiable MACs from the last forward's soft gates, soft Q/K masks, head and block
        gates (with ``weighted``: each block scaled by its weight; compare with :attr:`dense_weighted`)."""
        return self._macs(supernet, soft=True, weighted=weighted)

    @torch.no_grad()
    def expected_macs(self, supernet: nn.Module) -> float:
        """MACs in expectation over the Gumbel noise: P(gate on) = sigmoid(logit)."""
        with expected_gates(supernet):
            return float(self._macs(supernet, soft=True))


@contextmanager
def expected_gates(supernet: nn.Module) -> Iterator[None]:
    """Within it, the state's soft gates are every gate's probability of being on, sigmoid(logit)
    (the soft values a cost reads: their expectation over the Gumbel noise); restored after."""
    st = supernet.dcs_state
    saved = st.soft_gates, st.soft_qk, st.soft_heads, st.soft_depth
    blocks = list(enumerate(supernet.blocks))
    st.soft_gates = {j: torch.sigmoid(b.dcs_alpha) for j, b in blocks if b.dcs_alpha is not None}
    st.soft_qk = {
        j: torch.sigmoid(b.attn.qk_mask.theta)
        for j, b in blocks
        if b.attn.qk_mask is not None and b.attn.qk_mask.mode == "static"
    }
    st.soft_heads = {j: torch.sigmoid(head_gates(b)) for j, b in blocks if head_gates(b) is not None}
    st.soft_depth = {j: torch.sigmoid(b.dcs_depth) for j, b in blocks if getattr(b, "dcs_depth", None) is not None}
    try:
        yield
    finally:
        st.soft_gates, st.soft_qk, st.soft_heads, st.soft_depth = saved


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


def shifted_logits(supernet: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """The gate logits :func:`calibrate` shifts onto the target, each with its mask of free
    (unprotected) entries: every MLP alpha and head gate. Not the block gates: a block is too large a
    unit for a threshold shift to land near a target (one block of a 3-block model is a third of its
    FLOPs; the shift that reopens it overshoots); :func:`calibrate` moves them a step before."""
    out = []
    for b in supernet.blocks:
        if b.dcs_alpha is not None:
            free = ~_protected(b) if _protected(b) is not None else torch.ones_like(b.dcs_alpha, dtype=torch.bool)
            out.append((b.dcs_alpha, free))
        if head_gates(b) is not None:
            out.append((head_gates(b), torch.ones_like(head_gates(b), dtype=torch.bool)))
    return out


def depth_logits(supernet: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """The block gate logits, each with its (all-true) mask, as :func:`shifted_logits` lists them."""
    return [
        (b.dcs_depth, torch.ones_like(b.dcs_depth, dtype=torch.bool))
        for b in supernet.blocks
        if getattr(b, "dcs_depth", None) is not None
    ]


def _bisect_shift(
    supernet: nn.Module, cost: Any, target: float, pairs: list, *, round_mlp: int, at_most: bool
) -> float:
    """The one shift of the logits ``pairs`` (their free entries) that brings the hard ratio closest
    to ``target`` (``at_most``: the closest at or under it); the logits are left as they were."""
    alphas, free = [p for p, _ in pairs], [f for _, f in pairs]
    vals = torch.cat([a[f].flatten() for a, f in zip(alphas, free)]).sort().values
    if not len(vals):
        return 0.0
    cuts = torch.cat([vals[:1] - 1, (vals[1:] + vals[:-1]) / 2, vals[-1:] + 1]).tolist()
    saved = [a.clone() for a in alphas]
    best, best_err = 0.0, math.inf
    lo, hi = 0, len(cuts) - 1  # ratio decreases as the cut rises: bisect for the target
    while lo <= hi:
        mid = (lo + hi) // 2
        for a, f in zip(alphas, free):
            a[f] -= cuts[mid]
        r = cost.hard_macs(supernet, round_mlp=round_mlp) / cost.dense
        for a, sv in zip(alphas, saved):
            a.copy_(sv)
        if abs(r / target - 1) < best_err and (not at_most or r <= target):
            best, best_err = cuts[mid], abs(r / target - 1)
        lo, hi = (mid + 1, hi) if r > target else (lo, mid - 1)
    return best


@torch.no_grad()
def calibrate(
    supernet: nn.Module,
    cost: Any,
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
    The search's projection onto its moving budget and, at its end, the guarded landing. The head
    gate logits shift with the alphas (:func:`shifted_logits`).

    With block gates, two steps: the shift that lands closest with every gate (blocks included) is
    found first and applied to the block gates only, so a block closes where its logit falls below
    the gates the shift closes (which blocks stay is decided on the one logit scale of every gate);
    then the alphas and head gates are shifted onto the target with the blocks fixed, which a block's
    jump in cost (a sixth of a 6-block model) would otherwise keep off it."""
    pairs = shifted_logits(supernet)
    if not pairs:
        return 0.0
    blocks = depth_logits(supernet)
    if blocks:
        b0 = _bisect_shift(supernet, cost, target, pairs + blocks, round_mlp=round_mlp, at_most=at_most)
        for a, _ in blocks:
            a -= b0
    best = _bisect_shift(supernet, cost, target, pairs, round_mlp=round_mlp, at_most=at_most)
    for a, f in pairs:
        a[f] -= best
    if round_mlp and apply_round:
        round_blocks(supernet, round_mlp)
    return best


@torch.no_grad()
def selection_record(supernet: nn.Module, cost: Any) -> dict[str, Any]:
    """FLOPs (exact and expected) and widths kept per block (aligned, as materialized), for the log;
    with a latency cost (:class:`~.latency_cost.LatencyCost`) also its predicted latency."""
    flops = getattr(cost, "flops", cost)  # a latency cost keeps the FLOPs model beside it
    macs = flops.hard_macs(supernet)
    mlp_kept, qk_kept, heads_kept, skipped = [], [], [], []
    for j, blk in enumerate(supernet.blocks):
        a = blk.dcs_alpha
        mlp_kept.append(None if a is None else aligned_counts(a, align=cost.align)[0])
        qm = blk.attn.qk_mask
        if qm is not None and qm.mode == "static":
            qk_kept.append(aligned_counts(qm.theta.reshape(qm.heads, -1), align=cost.align))
        if head_gates(blk) is not None:
            heads_kept.append(int((head_gates(blk) > 0).sum()))
        if getattr(blk, "dcs_depth", None) is not None and not bool((blk.dcs_depth > 0).any()):
            skipped.append(j)
    rec = {
        "macs": macs,
        "flops_ratio": macs / flops.dense,
        "expected_flops_ratio": flops.expected_macs(supernet) / flops.dense,
        "mlp_kept": mlp_kept,
    }
    if flops is not cost:
        ms = cost.hard_macs(supernet)
        rec.update(
            latency_ms=ms,
            dense_latency_ms=cost.dense,
            latency_ratio=ms / cost.dense,
            expected_latency_ratio=cost.expected_macs(supernet) / cost.dense,
        )
    if qk_kept:
        rec["qk_kept"] = qk_kept
    if heads_kept:
        rec["heads_kept"] = heads_kept
    if any(getattr(b, "dcs_depth", None) is not None for b in supernet.blocks):
        rec["skipped_blocks"] = skipped
    return rec


__all__ = [
    "CostModel",
    "LambdaSteer",
    "smooth_max",
    "soft_arch",
    "expected_gates",
    "block_arch",
    "round_blocks",
    "calibrate",
    "shifted_logits",
    "selection_record",
]
