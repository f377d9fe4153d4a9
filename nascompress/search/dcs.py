"""``nascompress search dcs``: the DCS differentiable channel search (seed 003 section 3.4, A.2).

It runs on the one training loop (:func:`nascompress.train.fit`) with :class:`DCSSearchHooks`.
Each epoch the training split is cut once (:func:`~nascompress.data.split_indices`, fixed seed)
into 70% for the network weights W and 30% for the architecture parameters (every MLP gate
alpha and static Q/K theta); W-steps and arch-steps alternate, spread evenly over the epoch
(first order). W-steps minimise CE (+ ``distill`` x KL to the dense model, which protects
pretrained features); arch-steps minimise

    CE + lambda * log(cost / dense_cost) + entropy_weight * H(g_hat, theta_hat)

where cost (:class:`CostModel`) is the analytic MACs of the network with each block's MLP width
replaced by the soft count sum(g_hat) and each block's Q/K width by a smooth maximum over heads of
the soft per-head counts (the heads are padded to the largest count when materialized), so the
cost is differentiable in every alpha and theta. The temperature starts at 4.5 and is multiplied
by 0.95 every epoch. The weights train at a small lr (base 1e-4 per 512 images, warm-up, cosine,
layer decay) and the architecture parameters at their own larger, constant lr (``arch_lr``).

With ``target_flops`` lambda is steered after every arch-step by :class:`LambdaSteer`, a PI
controller on ``ratio / target - 1`` where ratio is the exact FLOPs of the hard architecture as
it will be materialized (``round_mlp`` applied); lambda is then the Lagrange multiplier of the
target and turns negative below it (see :class:`LambdaSteer`); where the CE gradient per gate
outweighs the cost's (pretrained models), the cost term is scaled up by that ratio, measured once
at the first arch-step (``grad_balance``). The gate logits start open,
spread by an importance score (:class:`~nascompress.methods.dcs.DCSConfig`; weight magnitude, or
measured activations where they are clearly better: ``init_importance``), so channels reach the
threshold one by one rather than all at once. A
search that lands outside the band is reported; with ``calibrate`` (default) the gate threshold is
then shifted to land inside it, and the log and metrics say by how much. A search whose validation
accuracy falls more than ``max_val_drop`` points below the dense model's stops with a message.

Under torchrun (:mod:`nascompress.distributed`) each process takes its shard of both subsets every
epoch; the shards are equal, so every process interleaves its W- and arch-steps in the same order,
and the averaged gradients keep the architecture (and so lambda) the same everywhere.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import distributed
from ..api import count_classes, run_data_config
from ..config import Config, check_choice, check_int, check_range
from ..data import DataConfig, InputSpec, Subset, load_data, make_loader, preprocess, split_indices
from ..errors import NascompressError
from ..hooks import TrainHooks, kl_to_teacher, own_group, param_groups
from ..io import finish_run, load_with_arch, make_arch
from ..layers import qk_pads
from ..methods.dcs import (DCSConfig, activation_importance, arch_parameters, binary_entropy, channel_importance,
                           make_record, make_supernet)
from ..models import ModelSpec, build_model, load_pretrained
from ..profiling import count_flops
from ..train import LOG_FILE, TrainConfig, check_classes, fit, input_spec_for
from ..utils import create_out_dir, prepare_out_dir, recorded_job, write_json

INIT_IMPORTANCE = ("auto", "weight", "activation")
INIT_PROBE_DROPS = (0.2, 0.4)  # shares of each MLP's residual channels the auto choice drops to compare the orders
INIT_MARGIN = 0.9  # auto takes the activation order only where its KL is below 0.9x the weight order's
SMOOTH_MAX_T = 1.0  # temperature (in channels) of the smooth maximum over heads of the Q/K counts


@dataclass(frozen=True)
class DCSSearchConfig(Config):
    """The search's own settings (the optimisation of W is the job's TrainConfig).

    Args:
        arch_lr: peak AdamW lr of the architecture parameters (alpha, static theta); None: sized
            from the budget so that the median gate logit reaches the threshold after about 40% of
            the architecture steps (``alpha_init / (0.4 x arch steps)``, within [0.01, 0.5]).
        arch_lr_end: their lr at the end, as a share of ``arch_lr`` (a cosine between).
        arch_beta1: their Adam momentum (shorter than the weights' 0.9: less lag, less overshoot).
        lam: lambda of ``lambda * log cost`` (paper range 0.1-0.5) when no target is given.
        entropy_weight: weight of the gates' mean binary entropy (pushes the soft gates to 0/1).
        tau0 / tau_decay: temperature at epoch 0 and its factor per epoch.
        target_flops: FLOPs of the result as a ratio of the dense model's, in (0, 1].
        tolerance: relative band around the target the result must land in.
        steer_gain / steer_rate: proportional and integral gains of the lambda controller.
        weight_fraction: share of the training split for W (the rest updates the architecture).
        round_mlp: 0 (the paper) or k > 0: a block MLP keeping fewer than k channels is closed and
            one keeping more than C - k is opened fully (:func:`round_blocks`); the controller
            steers the rounded architecture, and the rounding is applied after the last epoch.
        distill: weight of KL(dense || supernet) added to the W-steps' CE (0: off).
        max_val_drop: stop when validation top-1 falls more than this many points below the dense model's.
        calibrate: if the last epoch ends outside the band, shift the gate threshold to land inside
            it (reported); False: fail instead.
        grad_balance: with a target, measure lambda in units of the CE gradient: at the first
            architecture step the median |d CE / d logit| over every gate is compared with the
            median |d log cost / d logit|, and where CE is the larger by r > 1 the cost term is
            multiplied by r (``lam_scale``, logged). Why: the controller's lambda range was set on
            a small model trained from scratch, where the cost gradient per gate is about twice the
            CE gradient (r = 0.55 on the Fashion-MNIST base: scale 1, unchanged); on a pretrained
            model CE outweighs it (r = 49.7 on DINOv2 ViT-S/14 at 112 px), so no lambda in range
            moved a gate and the search did nothing.
        init_importance: what orders the gates' initial logits (the order in which channels reach
            the threshold): ``weight`` (weight magnitude), ``activation`` (measured on
            ``init_images`` training images, :func:`~nascompress.methods.dcs.activation_importance`)
            or ``auto``: both orders drop their 20% and their 40% least important residual channels
            of every MLP, and the activation order is used where its summed KL to the dense model
            (on those images) is below 0.9x the weight order's, else weight magnitude (logged as
            ``init`` and ``init_kl``). Why: on DINOv2 the weight-magnitude order closes the channels
            the model depends on first (``bench/dcs_init_order.py``); on the Fashion-MNIST base
            trained from scratch the two KLs are within 2% and weight magnitude, the former
            default, stays.
    """

    arch_lr: float | None = None
    arch_lr_end: float = 0.1
    arch_beta1: float = 0.5
    lam: float = 0.2
    entropy_weight: float = 0.01
    tau0: float = 4.5
    tau_decay: float = 0.95
    target_flops: float | None = None
    tolerance: float = 0.05
    steer_gain: float = 2.0
    steer_rate: float = 0.05
    weight_fraction: float = 0.7
    round_mlp: int = 0
    distill: float = 0.5
    max_val_drop: float = 15.0
    calibrate: bool = True
    grad_balance: bool = True
    init_importance: str = "auto"
    init_images: int = 256

    def __post_init__(self) -> None:
        check_choice("--init-importance", self.init_importance, INIT_IMPORTANCE)
        check_int("init_images", self.init_images, 1)
        if self.target_flops is not None:
            check_range("--target-flops", self.target_flops, 0, 1, lo_open=True)
        if self.arch_lr is not None:
            check_range("--arch-lr", self.arch_lr, 0, lo_open=True)
        check_range("arch_lr_end", self.arch_lr_end, 0, 1)
        check_range("arch_beta1", self.arch_beta1, 0, 1, hi_open=True)
        check_range("--lam", self.lam, 0)
        check_range("--entropy-weight", self.entropy_weight, 0)
        check_range("tau0", self.tau0, 0, lo_open=True)
        check_range("tau_decay", self.tau_decay, 0, 1, lo_open=True)
        check_range("tolerance", self.tolerance, 0, 1, lo_open=True)
        check_range("weight_fraction", self.weight_fraction, 0, 1, lo_open=True, hi_open=True)
        check_int("--round-mlp", self.round_mlp, 0)
        check_range("--distill", self.distill, 0)
        check_range("--max-val-drop", self.max_val_drop, 0)


# The search's W optimisation: pretrained-safe (small base lr, warm-up, layer decay), keep the last epoch.
SEARCH_TRAIN_DEFAULTS: dict[str, Any] = {"epochs": 4, "batch_size": 128, "base_lr": 1e-4, "min_lr": 1e-6,
                                         "warmup_epochs": 0.2, "weight_decay": 0.01, "layer_decay": 0.75,
                                         "keep": "last"}


def search_train_config(**overrides: Any) -> TrainConfig:
    d = dict(SEARCH_TRAIN_DEFAULTS)
    d.update({k: v for k, v in overrides.items() if v is not None})
    return TrainConfig.from_dict(d)


@dataclass(frozen=True)
class DCSSearchJob(Config):
    """Everything ``nascompress search dcs`` needs; written to the run's ``config.json``.

    Args:
        source: a dense run directory (``nascompress train`` / ``import``) or a timm model name.
        weights: local weights for a timm name (``.safetensors``/``.pth``).
        model_kwargs: timm build overrides for a timm name (num_classes defaults to the data's).
        data: the dataset (default: the source run's ``data`` section, else Fashion-MNIST).
    """

    source: str
    out: str
    method: DCSConfig = field(default_factory=DCSConfig)
    search: DCSSearchConfig = field(default_factory=DCSSearchConfig)
    train: TrainConfig = field(default_factory=search_train_config)
    data: DataConfig | None = None
    weights: str | None = None
    model_kwargs: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# The cost model: exact MACs of the hard architecture, and its differentiable soft estimate


def smooth_max(x: torch.Tensor, t: float = SMOOTH_MAX_T) -> torch.Tensor:
    """A differentiable maximum over the last dim with a positive gradient in every entry:
    t * (logsumexp(x / t) - log H). Exact when all H entries are equal (the heads the search drives
    towards, since they are padded to the largest), within t * log H of the maximum otherwise."""
    return t * (torch.logsumexp(x / t, dim=-1) - math.log(x.shape[-1]))


@dataclass
class CostModel:
    """Per-image MACs of a DCS supernet's architectures, calibrated once with the profiler.

    ``fixed`` is everything but the MLPs and the prunable Q/K part (theta Linears of the
    input-dependent mask included); ``mlp[j]`` block j's dense MLP MACs (linear in its kept width);
    ``qk[j]`` the MACs of one Q/K channel of every head of block j (its q and k rows of qkv and its
    share of QK^T: 2 N C + N^2), 0 when the block's Q/K channels are not searched.
    """

    dense: float
    fixed: float
    mlp: list[float]
    width: list[int]
    qk: list[float]
    heads: list[int]
    head_dim: list[int]

    @classmethod
    def build(cls, dense_model: nn.Module, supernet: nn.Module, x: torch.Tensor) -> "CostModel":
        dense = count_flops(dense_model, x).total
        rep = count_flops(supernet, x)  # gates still all open (alpha_init > 0): full widths
        n = int(supernet.patch_embed.num_patches) + int(supernet.num_prefix_tokens)
        mlp = [b["mlp"] for b in rep.blocks]
        qk, heads, dims = [], [], []
        for blk in supernet.blocks:
            a = blk.attn
            static = a.qk_mask is not None and a.qk_mask.mode == "static"
            # where the materialized q/k run zero-padded to the head dim (layers.qk_pads: the CPU's
            # fused kernel), a kept channel saves its qkv rows only, not its share of QK^T
            pads = qk_pads(a.qk_layout, qk_dim=1, head_dim=a.head_dim, device_type=x.device.type,
                           dtype=a.qkv.weight.dtype) and a.fused_attn
            qk.append(float(2 * n * a.qkv.in_features + (0 if pads else n * n)) if static else 0.0)
            heads.append(a.num_heads)
            dims.append(a.head_dim)
        full_qk = sum(q * h * d for q, h, d in zip(qk, heads, dims))
        return cls(dense=dense, fixed=rep.total - sum(mlp) - full_qk, mlp=mlp,
                   width=[blk.mlp.fc1.in_features for blk in supernet.blocks], qk=qk, heads=heads, head_dim=dims)

    def _macs(self, supernet: nn.Module, *, soft: bool, round_mlp: int = 0) -> Any:
        st = supernet.dcs_state
        total: Any = self.fixed
        for j, blk in enumerate(supernet.blocks):
            alpha = blk.dcs_alpha
            C = self.width[j]
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
            total = total + self.mlp[j] * kept / C
            if self.qk[j]:
                H, d = self.heads[j], self.head_dim[j]
                if soft and j in st.soft_qk:
                    kmax = smooth_max(st.soft_qk[j].reshape(H, d).sum(-1))
                else:
                    kmax = max(1, int((blk.attn.qk_mask.theta.detach().reshape(H, d) > 0).sum(-1).max()))
                total = total + self.qk[j] * H * kmax
        return total

    def hard_macs(self, supernet: nn.Module, *, round_mlp: int = 0) -> float:
        """Exact MACs of the materialized model the current gates give (= the profiler's count),
        with ``round_mlp`` as :func:`round_blocks` would apply it."""
        return float(self._macs(supernet, soft=False, round_mlp=round_mlp))

    def soft_macs(self, supernet: nn.Module) -> torch.Tensor:
        """Differentiable MACs from the last forward's soft gates and soft Q/K masks."""
        return self._macs(supernet, soft=True)

    @torch.no_grad()
    def expected_macs(self, supernet: nn.Module) -> float:
        """MACs in expectation over the Gumbel noise: P(gate on) = sigmoid(logit)."""
        st = supernet.dcs_state
        saved = st.soft_gates, st.soft_qk
        st.soft_gates = {j: torch.sigmoid(b.dcs_alpha) for j, b in enumerate(supernet.blocks) if b.dcs_alpha is not None}
        st.soft_qk = {j: torch.sigmoid(b.attn.qk_mask.theta) for j, b in enumerate(supernet.blocks) if self.qk[j]}
        try:
            return float(self._macs(supernet, soft=True))
        finally:
            st.soft_gates, st.soft_qk = saved


@dataclass
class LambdaSteer:
    """PI controller of lambda toward a FLOPs target (state: the integral, checkpointed).

    ``lam = clip(integral + gain * e)``, ``integral = clip(integral + rate * e)`` with
    ``e = ratio / target - 1``, both clipped to ``[-lam_max, lam_max]``. The integral only moves
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


@torch.no_grad()
def round_blocks(supernet: nn.Module, k: int) -> dict[str, list[int]]:
    """Close block MLPs keeping fewer than ``k`` channels, open those keeping more than C - k.

    Not in the paper; why: a block MLP with a handful of channels still pays its whole hidden
    width at run time (fc1's bias and output, GELU over all hidden units), which FLOPs do not
    count, so its few FLOPs buy little speed; a nearly full one pays a gather and a write-back
    for nothing. Closing sets alpha to -30 (no Gumbel sample reopens it); opening sets the
    negative alphas to +1. Returns the block indices changed.
    """
    closed, opened = [], []
    for j, blk in enumerate(supernet.blocks):
        alpha = blk.dcs_alpha
        if alpha is None:
            continue
        kept, C = int((alpha > 0).sum()), alpha.numel()
        if 0 < kept < k:
            alpha.clamp_(max=-30.0)
            closed.append(j)
        elif C - k < kept < C:
            alpha.clamp_(min=1.0)
            opened.append(j)
    return {"closed": closed, "opened": opened}


@torch.no_grad()
def calibrate(supernet: nn.Module, cost: CostModel, target: float, *, round_mlp: int = 0) -> float:
    """Shift every alpha by one constant (then :func:`round_blocks` with ``round_mlp``) so that the
    hard ratio is closest to ``target``; return the shift. Kept counts fall monotonically as the
    shift rises (rounding keeps that order), so the shift is bisected. The fallback of a search
    that did not land by itself; its use is reported."""
    alphas = [blk.dcs_alpha for blk in supernet.blocks if blk.dcs_alpha is not None]
    if not alphas:
        return 0.0
    vals = torch.cat([a.flatten() for a in alphas]).sort().values
    cuts = torch.cat([vals[:1] - 1, (vals[1:] + vals[:-1]) / 2, vals[-1:] + 1]).tolist()

    def shifted(b: float) -> None:
        for a in alphas:
            a.sub_(b)
        if round_mlp:
            round_blocks(supernet, round_mlp)

    saved = [a.clone() for a in alphas]
    best, best_err = 0.0, math.inf
    lo, hi = 0, len(cuts) - 1  # ratio decreases as the cut rises: bisect for the target
    while lo <= hi:
        mid = (lo + hi) // 2
        shifted(cuts[mid])
        r = cost.hard_macs(supernet) / cost.dense
        for a, s in zip(alphas, saved):
            a.copy_(s)
        if abs(r / target - 1) < best_err:
            best, best_err = cuts[mid], abs(r / target - 1)
        lo, hi = (mid + 1, hi) if r > target else (lo, mid - 1)
    shifted(best)
    return best


def _interleave(n_w: int, n_a: int) -> list[str]:
    """``n_w`` 'w' and ``n_a`` 'a' steps, the arch-steps spread evenly between the W-steps."""
    keys = [((i + 0.5) / n_w, "w") for i in range(n_w)] + [((j + 1.0) / n_a, "a") for j in range(n_a)]
    return [k for _, k in sorted(keys)]


# ---------------------------------------------------------------------------------------------
# The search as training hooks


class DCSSearchHooks(TrainHooks):
    """The DCS search plugged into :func:`~nascompress.train.fit` (see the module docstring)."""

    def __init__(self, supernet: nn.Module, *, dense: nn.Module | None, cost: CostModel, job: DCSSearchJob,
                 base_arch: dict[str, Any], train_size: int, init_info: dict[str, Any] | None = None):
        self.cost, self.cfg, self.job, self.base_arch, self.dense = cost, job.search, job, base_arch, dense
        self.init_info = init_info or {}  # how the gates' start was ordered: logged with the first epoch
        self.epochs = job.train.epochs
        self.arch_params = arch_parameters(supernet)
        ids = {id(p) for p in self.arch_params}
        self.w_params = [p for p in supernet.parameters() if id(p) not in ids]
        self.w_idx, self.a_idx = split_indices(train_size, (self.cfg.weight_fraction, 1 - self.cfg.weight_fraction),
                                               seed=job.train.seed)
        self.lam = self.cfg.lam
        # lambda is the controller's output with a target (integral from 0: no wind-up while the
        # gates are still far from the threshold); without one it is the paper's constant --lam
        self.steer = None if self.cfg.target_flops is None else LambdaSteer(
            self.cfg.target_flops, 0.0, self.cfg.steer_gain, self.cfg.steer_rate)
        self.tau = self.cfg.tau0
        self.lam_scale: float | None = None if (self.steer is not None and self.cfg.grad_balance) else 1.0
        self.balance: dict[str, float] | None = None
        # arch steps of the whole search (under torchrun each rank takes its shard: world x fewer steps)
        arch_steps = self.epochs * math.ceil(len(self.a_idx) / (job.train.batch_size * distributed.world().size))
        self.arch_lr = self.cfg.arch_lr if self.cfg.arch_lr is not None else min(0.5, max(
            0.01, job.method.alpha_init / (0.4 * max(1, arch_steps))))

    def ratio(self, supernet: nn.Module) -> float:
        return self.cost.hard_macs(supernet, round_mlp=self.cfg.round_mlp) / self.cost.dense

    def param_groups(self, model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
        groups = param_groups(model, weight_decay=cfg.weight_decay, layer_decay=cfg.layer_decay)
        # the architecture logits follow their own schedule (cosine from arch_lr to arch_lr_end x arch_lr,
        # so the controller still moves them at the end, ever more finely) and a short momentum (less
        # lag between lambda and the FLOPs, so less overshoot around the target)
        return own_group(groups, self.arch_params, weight_decay=0.0, own_lr=self.arch_lr,
                         own_lr_end=self.cfg.arch_lr_end, betas=(self.cfg.arch_beta1, 0.999))

    def batches(self, data, *, epoch, loader):
        w = loader(Subset(data.train, self.w_idx))
        a = loader(Subset(data.train, self.a_idx), stream=1)
        order = _interleave(len(w), len(a))

        def gen():
            w_it, a_it = iter(w), iter(a)
            for kind in order:
                imgs, labels = next(w_it if kind == "w" else a_it)
                yield imgs, labels, kind
        return gen(), len(order)

    def on_epoch_start(self, model: nn.Module, *, epoch: int) -> None:
        self.tau = self.cfg.tau0 * self.cfg.tau_decay ** epoch
        model.dcs_state.tau = self.tau

    def prepare_step(self, model: nn.Module, tag: Any) -> None:
        for p in self.w_params:  # first order: each step differentiates only what it updates
            p.requires_grad_(tag == "w")
        for p in self.arch_params:
            p.requires_grad_(tag == "a")

    def loss(self, model, x, y, *, epoch, cfg, tag=None):
        logits = model(x)
        ce = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
        if tag == "w":
            if self.cfg.distill > 0 and self.dense is not None:
                with torch.no_grad():
                    t_logits = self.dense(x)
                kl = kl_to_teacher(logits, t_logits)
                return ce + self.cfg.distill * kl, {"ce_w": ce.detach(), "kl_w": kl.detach()}
            return ce, {"ce_w": ce.detach()}
        st = model.dcs_state
        log_cost = torch.log(self.cost.soft_macs(model) / self.cost.dense)
        soft = [st.soft_gates[j] for j in sorted(st.soft_gates)] + [st.soft_qk[j] for j in sorted(st.soft_qk)]
        ent = binary_entropy(torch.cat(soft)) if soft else torch.zeros((), device=x.device)
        if self.lam_scale is None:  # the first arch-step: measure the balance on its own graph
            self.lam_scale = self.grad_balance(ce, log_cost)
        loss = ce + self.lam_scale * self.lam * log_cost + self.cfg.entropy_weight * ent
        return loss, {"ce_a": ce.detach(), "log_cost": log_cost.detach(), "entropy": ent.detach()}

    def grad_balance(self, ce: torch.Tensor, log_cost: torch.Tensor) -> float:
        """``max(1, r)``, r = median |d CE / d logit| / median |d log cost / d logit| over every gate
        (medians averaged over the processes, so every one uses the same scale); see
        :attr:`DCSSearchConfig.grad_balance`. Reads gradients only: no extra forward, no RNG draw."""
        params = [p for p in self.arch_params if p.requires_grad]
        med = []
        for out in (ce, log_cost):
            grads = torch.autograd.grad(out, params, retain_graph=True, allow_unused=True)
            g = [t.detach().abs().flatten() for t in grads if t is not None]
            med.append(float(torch.cat(g).median()) if g else 0.0)
        world = distributed.world().size
        ce_med, cost_med = (v / world for v in distributed.all_sum(med))
        self.balance = {"ce_grad_median": ce_med, "cost_grad_median": cost_med}
        return max(1.0, ce_med / cost_med) if cost_med > 0 else 1.0

    def after_step(self, model: nn.Module, tag: Any) -> None:
        if tag == "a" and self.steer is not None:
            self.lam = self.steer.update(self.ratio(model))

    def on_epoch_end(self, model: nn.Module, *, epoch: int) -> dict[str, Any]:
        for p in self.w_params + self.arch_params:
            p.requires_grad_(True)
        rec: dict[str, Any] = {"tau": self.tau, "lam": self.lam, "lam_scale": self.lam_scale, "arch_lr": self.arch_lr}
        if self.balance is not None:
            rec["grad_balance"], self.balance = self.balance, None
        if epoch == 0:
            rec.update(self.init_info)
        if epoch == self.epochs - 1:  # the end: apply the rounding the controller steered for
            if self.cfg.round_mlp:
                rec["rounded"] = round_blocks(model, self.cfg.round_mlp)
            ratio = self.ratio(model)
            target = self.cfg.target_flops
            if target is not None and abs(ratio / target - 1) > self.cfg.tolerance:
                if not self.cfg.calibrate:
                    raise NascompressError(f"the search ended at a FLOPs ratio of {ratio:.3f}, outside {target} "
                                           f"+-{self.cfg.tolerance:.0%}; run more --epochs or raise --arch-lr")
                shift = calibrate(model, self.cost, target, round_mlp=self.cfg.round_mlp)
                rec["calibration"] = {"ratio_before": ratio, "alpha_shift": shift}
        rec.update(selection_record(model, self.cost))
        return rec

    def arch(self, model: nn.Module, arch: dict[str, Any]) -> dict[str, Any]:
        return dict(self.base_arch, methods=list(self.base_arch["methods"]) +
                    [make_record(model, self.job.method, stage="supernet")])

    def check(self, record: dict[str, Any], start: dict[str, Any] | None) -> None:
        if start is None:
            return
        drop = start["val_top1"] - record["val_top1"]
        if drop > self.cfg.max_val_drop:
            head = (f"the search collapsed: validation top-1 fell from {start['val_top1']:.2f}% (the dense model) to "
                    f"{record['val_top1']:.2f}% after epoch {record['epoch']}, more than --max-val-drop "
                    f"{self.cfg.max_val_drop:g} points")
            calib = record.get("calibration")
            if calib and abs(calib["ratio_before"] / self.cfg.target_flops - 1) > 2 * self.cfg.tolerance:
                # the gates did not get near the target by themselves: the end-of-search threshold shift
                # did the pruning, blindly (one shift for every gate), which is what broke the model
                raise NascompressError(
                    f"{head}, after the end-of-search calibration had to move the FLOPs ratio from "
                    f"{calib['ratio_before']:.3f} to the target {self.cfg.target_flops}: the search had too few "
                    f"architecture steps to get there itself; give it more (--epochs, more --train-limit images, "
                    f"a smaller --batch-size) or a larger --arch-lr (now {self.arch_lr:.3g})")
            raise NascompressError(
                f"{head}; lower the weights' lr (--base-lr, now "
                f"{self.job.train.peak_lr_for(world_size=distributed.world().size):.2g} peak) or --arch-lr, or raise "
                f"--distill; or, as the gates reached their budget by themselves, keep this search "
                f"(--max-val-drop 100) and let materialize + retrain --teacher DENSE --feat-kd 1 recover it")

    def state_dict(self) -> dict[str, Any]:
        return {"lam": self.lam, "integral": None if self.steer is None else self.steer.integral,
                "lam_scale": self.lam_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lam = state.get("lam", self.lam)
        if state.get("lam_scale") is not None:
            self.lam_scale = state["lam_scale"]
        if self.steer is not None and state.get("integral") is not None:
            self.steer.integral = state["integral"]


def selection_record(supernet: nn.Module, cost: CostModel) -> dict[str, Any]:
    """FLOPs (exact and expected) and channels kept per block, for the log."""
    macs = cost.hard_macs(supernet)
    mlp_kept, qk_kept = [], []
    for blk in supernet.blocks:
        a = blk.dcs_alpha
        mlp_kept.append(None if a is None else int((a > 0).sum()))
        qm = blk.attn.qk_mask
        if qm is not None and qm.mode == "static":
            qk_kept.append([int(v) for v in (qm.theta.reshape(qm.heads, -1) > 0).sum(-1)])
    rec = {"macs": macs, "flops_ratio": macs / cost.dense, "expected_flops_ratio": cost.expected_macs(supernet) / cost.dense,
           "mlp_kept": mlp_kept}
    if qk_kept:
        rec["qk_kept"] = qk_kept
    return rec


# ---------------------------------------------------------------------------------------------
# The job


def _build_source(job: DCSSearchJob) -> tuple[nn.Module, dict[str, Any], DataConfig]:
    src = Path(job.source)
    if src.is_dir():
        model, arch = load_with_arch(src)
        if arch["methods"]:
            raise NascompressError(f"{src} is not a dense run (it has methods {[m['name'] for m in arch['methods']]})")
        return model, arch, job.data or run_data_config(src) or DataConfig()
    if job.weights is None:
        raise NascompressError(f"{job.source} is not a run directory; to search a timm model name give --weights FILE")
    data = job.data or DataConfig()
    spec = ModelSpec(job.source, dict({"num_classes": count_classes(data)}, **job.model_kwargs))
    model = build_model(spec)
    load_pretrained(model, job.weights)
    return model, make_arch(spec, input_spec=input_spec_for(model, data.dataset).to_dict()), data


@torch.no_grad()
def init_importance(dense: nn.Module, images: list[torch.Tensor], how: str) -> tuple[
        list[tuple[torch.Tensor, torch.Tensor]] | None, dict[str, Any]]:
    """The gate-initialisation importance of :attr:`DCSSearchConfig.init_importance` on the
    preprocessed calibration ``images`` (batches): ``(importance or None for weight magnitude, info)``,
    info ``{"init": chosen, "init_kl": {order: KL}}`` (the KL only with ``auto``)."""
    if how == "weight":
        return None, {"init": "weight"}
    act = activation_importance(dense, images)
    if how == "activation":
        return act, {"init": "activation"}
    dense = dense.eval()
    targets = [F.log_softmax(dense(x).float(), -1) for x in images]
    probe = make_supernet(copy.deepcopy(dense), DCSConfig(qk_mask="none", init_spread=0.0)).eval()
    kls = {}
    for name, imp in (("weight", [channel_importance(b) for b in dense.blocks]), ("activation", act)):
        kls[name] = 0.0
        for drop in INIT_PROBE_DROPS:
            for blk, (mlp, _) in zip(probe.blocks, imp):
                keep = mlp.topk(max(1, round((1 - drop) * mlp.numel()))).indices
                blk.dcs_alpha.fill_(-1.0)
                blk.dcs_alpha[keep.to(blk.dcs_alpha.device)] = 1.0
            kl = sum(F.kl_div(F.log_softmax(probe(x).float(), -1), t, log_target=True, reduction="sum").item()
                     for x, t in zip(images, targets))
            kls[name] += kl / sum(len(x) for x in images)
    chosen = "activation" if kls["activation"] < INIT_MARGIN * kls["weight"] else "weight"
    return (act if chosen == "activation" else None), {"init": chosen, "init_kl": kls}


def calibration_images(data: Any, spec: InputSpec, *, n: int, seed: int, batch_size: int = 64) -> list[torch.Tensor]:
    """``n`` preprocessed training images (a seeded draw, the same on every rank), in batches."""
    out, got = [], 0
    with torch.random.fork_rng(devices=[]):  # seeded augmentation draws; the caller's RNG is untouched
        torch.manual_seed(seed)
        for imgs, _ in make_loader(data.train, batch_size=batch_size, shuffle=True, seed=seed, num_workers=0):
            x = preprocess(imgs, spec)[:n - got]
            out.append(x)
            got += len(x)
            if got >= n:
                break
    return out


def search_dcs(job: DCSSearchJob, *, force: bool = False, resume: bool = False) -> dict[str, Any]:
    """Run (or ``resume``) the DCS search; writes the supernet, arch.json, log.jsonl, metrics.json."""
    out = Path(job.out)
    if resume:
        job = recorded_job(out, DCSSearchJob, "nascompress search dcs")
    elif Path(job.source).is_dir():  # recorded absolute: materialize reads the dense run's data section
        job = job.replace(source=str(Path(job.source).resolve()))
    if job.train.keep != "last":
        job = job.replace(train=job.train.replace(keep="last"))  # the result is the last architecture
    device = distributed.init(job.train.device)
    prepare_out_dir(out, force=force, resume=resume)
    dense, base_arch, data_cfg = _build_source(job)
    spec = InputSpec.from_dict(base_arch["input"])
    data = load_data(data_cfg, spec=spec)
    check_classes(dense.num_classes, data)
    importance, init_info = init_importance(
        dense, calibration_images(data, spec, n=job.search.init_images, seed=job.train.seed)
        if job.search.init_importance != "weight" else [], job.search.init_importance)
    torch.manual_seed(job.train.seed)
    supernet = make_supernet(copy.deepcopy(dense), job.method, tau=job.search.tau0, importance=importance)
    cost = CostModel.build(dense, supernet, torch.zeros(1, spec.in_chans, *spec.img_size))
    dense.eval().requires_grad_(False).to(device)  # the W-steps' distillation teacher runs beside the supernet
    hooks = DCSSearchHooks(supernet, dense=dense if job.search.distill > 0 else None, cost=cost, job=job,
                           base_arch=base_arch, train_size=len(data.train), init_info=init_info)
    distributed.barrier()  # every rank has checked `out` before rank 0 creates it
    if distributed.is_main():
        create_out_dir(out, force=force, resume=resume)
        write_json(out / "config.json", job.replace(data=data_cfg).to_dict())
    distributed.barrier()
    fit_metrics = fit(supernet, data=data, input_spec=spec, cfg=job.train, out_dir=out, arch=hooks.arch(supernet, base_arch),
                      hooks=hooks, resume=resume, finish=False)
    log = [json.loads(ln) for ln in (out / LOG_FILE).read_text().splitlines() if ln]
    last = log[-1]
    calib = [r["calibration"] for r in log if "calibration" in r]
    metrics = dict(fit_metrics, finished=True, dense_macs=cost.dense, macs=last["macs"], flops_ratio=last["flops_ratio"],
                   target_flops=job.search.target_flops, lam=last["lam"], val_top1=last["val_top1"],
                   dense_val_top1=log[0]["val_top1"] if log[0].get("start") else None,
                   search_time_s=fit_metrics["train_time_s"], epoch_time_s=[r["epoch_time_s"] for r in log[1:]],
                   mlp_kept=last["mlp_kept"], qk_kept=last.get("qk_kept"), calibrated=bool(calib),
                   calibration=calib[-1] if calib else None, train_images=len(data.train), dataset=data.name,
                   **init_info)
    if distributed.is_main():
        finish_run(out, metrics)  # the last write: marks the search complete
    return metrics


__all__ = ["DCSSearchConfig", "DCSSearchJob", "DCSSearchHooks", "CostModel", "LambdaSteer", "search_dcs", "calibrate",
           "round_blocks", "search_train_config", "smooth_max"]
