"""DynamicViT: learned, input-dependent token keep decisions (METHODS.md section 3).

Prediction modules sit before layers 4, 7, 10 of a 12-layer ViT (scaled for other depths);
stage s keeps ``rho ** s`` of the ORIGINAL patch tokens (or the product of per-stage rates). In
training the decisions are hard Gumbel-softmax samples (straight-through), multiplied across
stages, and tokens are masked in the attention softmax rather than removed. At inference each
stage keeps the top ``int(ratio_s * N)`` tokens by keep probability (as the official code
counts) and physically drops the rest; prefix tokens (class, registers) are always kept.

Masked softmax reading: the paper's A_ij = exp(P_ij) G_ij / sum_k exp(P_ik) G_ik (G_ii = 1,
G_ij = D_j) is passed to the block's OWN attention as the additive mask log(G + 1e-6), so any
attention under it (timm's, DCS, Sparsifiner) works unchanged. The gradient of log(G + eps)
through the softmax equals the multiplicative form's for G + eps, i.e. the paper's to within eps.

Untrained predictors are a random token choice. :func:`calibrate_predictors` is the short
predictor-only stage (backbone frozen, distillation to the dense model) that makes a cheap
zero-shot trial meaningful; the recipe's ``predictor_epochs`` runs the same stage at the start
of a fine-tune.

Record: ``{"name": "dynamicvit", "config": {"rho": 0.7, "prune_layers": [4, 7, 10]}, "recipe": {...}}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Config, check_settings, field_name, setting
from ..errors import NascompressError
from ..train.hooks import TrainHooks, features_and_logits, kl_to_teacher, param_groups, short_stage
from . import Method, TrainOverrides, register_method
from .tokens import keep_prefix_and, patched_class, token_layers

MASK_EPS = 1e-6
PREDICTOR = ".dvit_predictor."


# ---------------------------------------------------------------------------------------------
# Pure tensor functions
# ---------------------------------------------------------------------------------------------
class ScorePredictor(nn.Module):
    """The prediction module: local + global features -> (keep, drop) logits.

    z = GELU(Linear(LN(x))) (width C); z_local = first C/2 channels, z_global = the
    policy-weighted mean of the last C/2; MLP([z_local, z_global]) -> 2 logits per token
    (softmax gives pi; Gumbel-softmax and the ranking by logit_keep - logit_drop need no
    normalisation). The first MLP layer is applied as W_local z_local + W_global z_global, so the
    global half is multiplied once per image, not per token (same weights, same result).
    """

    def __init__(self, dim: int):
        super().__init__()
        self.inp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
        self.out = nn.Sequential(
            nn.Linear(dim, dim // 2), nn.GELU(), nn.Linear(dim // 2, dim // 4), nn.GELU(), nn.Linear(dim // 4, 2)
        )

    def forward(self, x: torch.Tensor, policy: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, N, C) patch tokens, policy (B, N) in {0, 1} or None (all kept) -> (B, N, 2)."""
        z = self.inp(x)
        h = z.shape[-1] // 2
        local, glob = z[..., :h], z[..., h:]
        if policy is None:
            g = glob.mean(dim=1, keepdim=True)
        else:
            w = policy.unsqueeze(-1)
            g = (glob * w).sum(dim=1, keepdim=True) / w.sum(dim=1, keepdim=True).clamp_min(1e-6)
        first = self.out[0]
        y = F.linear(local, first.weight[:, :h], first.bias) + F.linear(g, first.weight[:, h:])
        for i in range(1, len(self.out)):  # (self.out[1:] would build a new Sequential on every call)
            y = self.out[i](y)
        return y

    def matmul_macs(self, inputs: tuple, output: torch.Tensor) -> float:
        """The first MLP layer, run as two F.linear calls the Linear hooks do not see."""
        B, N, C = inputs[0].shape
        first = self.out[0]
        h = C // 2
        return float(B * N * h * first.out_features + B * (first.in_features - h) * first.out_features)


def keep_count(ratio: float, n: int) -> int:
    """Tokens kept at a stage whose cumulative keep ratio is ``ratio``, of ``n`` original patch
    tokens: int(ratio * n), at least 1."""
    return max(1, int(ratio * n + 1e-6))


def gumbel_keep(logits: torch.Tensor, prev: torch.Tensor, *, tau: float = 1.0) -> torch.Tensor:
    """Hard straight-through Gumbel-softmax keep decision, cumulative: (B, N, 2), (B, N) -> (B, N).

    ``logits`` may be unnormalised: Gumbel-softmax is invariant to a per-token shift."""
    return F.gumbel_softmax(logits, tau=tau, hard=True)[..., 0] * prev


def policy_attn_bias(policy: torch.Tensor, eps: float = MASK_EPS) -> torch.Tensor:
    """Additive attention mask log(G + eps), G_ij = 1 if i == j else policy_j: (B, N) -> (B, 1, N, N)."""
    N = policy.shape[1]
    eye = torch.eye(N, dtype=policy.dtype, device=policy.device)
    g = policy[:, None, None, :] * (1 - eye) + eye
    return torch.log(g + eps)


def ratio_loss(decisions: list[torch.Tensor], targets: list[float]) -> torch.Tensor:
    """(1 / S) sum_s mean_b (ratio_s - mean_i D_i^{b,s})^2; decisions: S tensors (B, N)."""
    losses = [((d.mean(dim=1) - t) ** 2).mean() for d, t in zip(decisions, targets)]
    return torch.stack(losses).mean()


def token_distill_loss(tokens: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MSE of the kept final tokens against the teacher's (mean over kept tokens and channels,
    as the official mse_token loss): tokens, teacher (B, N, C), mask (B, N) in {0, 1}."""
    err = ((tokens - teacher) ** 2).mean(dim=-1)  # (B, N)
    return (err * mask).sum() / mask.sum().clamp_min(1.0)


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DynamicViTConfig(Config):
    """DynamicViT settings (recorded in arch.json).

    Args:
        rho: the keep rate of each stage relative to the tokens the previous stage kept: one
            number (stage s keeps rho^s of the patch tokens, the paper's schedule) or one per
            pruning layer (a per-stage schedule; stage s keeps prod(rho[:s]) of the patch tokens).
        prune_layers: 1-based layers whose input is pruned (default: 4, 7, 10 of 12 scaled).
    """

    rho: float | tuple[float, ...] = setting(
        0.7,
        lo=0,
        hi=1,
        lo_open=True,
        help=("DynamicViT keep ratio rho in (0, 1] (stage s keeps rho^s), or one rate per stage: 0.9,0.7,0.7."),
    )
    prune_layers: tuple[int, ...] | None = setting(
        None, help=("Token pruning layers, 1-based, e.g. 4,7,10 (default: scaled from 4,7,10 of 12).")
    )

    def __post_init__(self) -> None:
        check_settings(self, name=field_name)  # every setting() against its declaration

    def stage_ratios(self, stages: int) -> list[float]:
        """Cumulative keep ratio of each stage (of the original patch tokens)."""
        rates = list(self.rho) if isinstance(self.rho, tuple) else [self.rho] * stages
        return [math.prod(rates[:s]) for s in range(1, stages + 1)]


@dataclass(frozen=True)
class DynamicViTRecipe(Config):
    """DynamicViT training (the paper's weights; the official code trains the backbone at 0.01 x lr).

    Args:
        w_kl / w_distill / w_ratio: weights of KL to the dense teacher, the kept-token MSE, the ratio loss.
        gumbel_tau: Gumbel-softmax temperature.
        backbone_lr_scale: the backbone's lr relative to the predictors'.
        predictor_epochs: the first epochs train the predictors only (backbone frozen, distilled
            to the dense model).
        predictor_steps: steps of that predictor-only stage before a zero-shot save (``--zero-shot``).
    """

    w_kl: float = setting(0.5, lo=0, help="Weight of KL(student || dense teacher) on the logits.")
    w_distill: float = setting(0.5, lo=0, help="Weight of the kept tokens' MSE to the dense teacher's.")
    w_ratio: float = setting(2.0, lo=0, help="Weight of the keep-ratio loss (each stage's kept share to its target).")
    gumbel_tau: float = setting(1.0, lo=0, lo_open=True, help="Gumbel-softmax temperature of the training masks.")
    backbone_lr_scale: float = setting(0.01, lo=0, help="The backbone's lr relative to the predictors'.")
    predictor_epochs: float = setting(
        0.0, lo=0, help=("The first epochs train the predictors only (backbone frozen, distilled to the dense model).")
    )
    predictor_steps: int = setting(
        100, lo=0, help=("Steps of the predictor-only stage before a zero-shot model (--zero-shot).")
    )

    def __post_init__(self) -> None:
        check_settings(self, name=field_name)  # every setting() against its declaration


# ---------------------------------------------------------------------------------------------
# Patch
# ---------------------------------------------------------------------------------------------
@dataclass
class DynamicViTState:
    """Shared by the patched blocks of one model, reset by the first stage on every forward."""

    ratios: list[float]  # cumulative keep ratio per stage
    prefix: int = 1
    tau: float = 1.0
    n0: int = 0  # original patch-token count of the current forward
    policy: torch.Tensor | None = None  # (B, N) training mask incl. prefix, cumulative
    decisions: list[torch.Tensor] = field(default_factory=list)  # per stage (B, N0), training
    kept: list[int] = field(default_factory=list)  # per stage tokens kept, inference

    def __deepcopy__(self, memo: dict) -> "DynamicViTState":  # the masks are graph tensors: not copied
        return DynamicViTState(ratios=list(self.ratios), prefix=self.prefix, tau=self.tau)


class DynamicViTBlock:
    """Mixin over the block's class (:class:`~nascompress.models.layers.NCBlock` or a DCS block): DynamicViT.

    Modifications: a block with a predictor (``dvit_stage`` >= 1) first scores its patch tokens;
    training: Gumbel decisions update the shared cumulative policy; inference: the top tokens
    are gathered (prefix first). In training every block from the first stage on passes
    ``log(G + eps)`` as ``attn_mask`` to its own forward.
    """

    dvit_state: DynamicViTState
    dvit_stage: int  # 0: no predictor here

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        st = self.dvit_state
        if self.dvit_stage:
            x = self._predict(x, st)
        if self.training and st.policy is not None and st.policy.shape[1] == x.shape[1]:
            bias = policy_attn_bias(st.policy).to(x.dtype)
            attn_mask = bias if attn_mask is None else attn_mask + bias
        return super().forward(x, attn_mask=attn_mask, is_causal=is_causal)

    def _predict(self, x: torch.Tensor, st: DynamicViTState) -> torch.Tensor:
        p = st.prefix
        B, N = x.shape[0], x.shape[1] - p
        if self.dvit_stage == 1:
            st.n0, st.policy, st.decisions, st.kept = N, None, [], []
        ratio = st.ratios[self.dvit_stage - 1]
        if ratio >= 1:  # compression off at this stage: exactly the dense block
            if not self.training:
                st.kept.append(N)
            return x
        spatial = x[:, p:]
        if self.training:
            prev = x.new_ones(B, N) if st.policy is None else st.policy[:, p:]
            logits = self.dvit_predictor(spatial, prev)
            d = gumbel_keep(logits, prev, tau=st.tau)
            st.decisions.append(d)
            st.policy = torch.cat([x.new_ones(B, p), d], dim=1)
            return x
        st.policy = None
        keep = keep_count(ratio, st.n0)
        if keep >= N:
            st.kept.append(N)
            return x
        logits = self.dvit_predictor(spatial)
        score = logits[..., 0] - logits[..., 1]  # (B, N), monotone in the keep probability
        idx = score.topk(keep, dim=1).indices
        st.kept.append(keep)
        return keep_prefix_and(x, idx, p)


@register_method
class DynamicViT(Method):
    token_stage = True
    name = "dynamicvit"
    summary = "learned per-image token keep decisions with prediction modules (Rao et al. 2021)"
    config_cls = DynamicViTConfig
    recipe_cls = DynamicViTRecipe
    # official: 5e-4 per 512 for the predictors, the backbone at 0.01 x that
    train_overrides = TrainOverrides(base_lr=5e-4, warmup_epochs=0.2, epochs=2)
    stacks_on = frozenset({"dcs", "uniform", "sparsifiner"})
    off_config = {"rho": 1.0}
    paper_config = {"rho": 0.7}
    calibrates = True

    def resolve(self, model: nn.Module, cfg: DynamicViTConfig) -> DynamicViTConfig:
        layers = token_layers(model, "dynamicvit", cfg.prune_layers)
        if isinstance(cfg.rho, tuple) and len(cfg.rho) != len(layers):
            raise NascompressError(
                f"rho has {len(cfg.rho)} per-stage rates but there are {len(layers)} pruning "
                "layers; give one rho or one ratio per layer"
            )
        return cfg.replace(prune_layers=tuple(layers))

    def patch(self, model: nn.Module, cfg: DynamicViTConfig, record: dict[str, Any]) -> nn.Module:
        layers = list(cfg.prune_layers)
        tau = float(record.get("recipe", {}).get("gumbel_tau", 1.0))
        state = DynamicViTState(ratios=cfg.stage_ratios(len(layers)), prefix=int(model.num_prefix_tokens), tau=tau)
        ref = next(model.parameters())
        for i, blk in enumerate(model.blocks):
            if i < layers[0] - 1:
                continue
            if isinstance(blk, DynamicViTBlock):
                raise NascompressError(f"dynamicvit is already applied to blocks.{i}")
            blk.__class__ = patched_class(type(blk), DynamicViTBlock, "DynamicViT")
            blk.dvit_state = state
            blk.dvit_stage = layers.index(i + 1) + 1 if (i + 1) in layers else 0
            if blk.dvit_stage:
                blk.dvit_predictor = ScorePredictor(model.embed_dim).to(device=ref.device, dtype=ref.dtype)
        model.dvit_state = state
        return model

    def hooks(self, model, record, *, teacher, train_cfg):
        r = DynamicViTRecipe.from_dict(record.get("recipe", {}))
        return DynamicViTHooks(model, teacher, r)

    def calibrate(self, model, record, *, teacher, batches, steps=None):
        """Untrained predictors are a random token choice: train them alone first."""
        return calibrate_predictors(
            model, teacher, batches, recipe=DynamicViTRecipe.from_dict(record.get("recipe", {})), steps=steps
        )


# ---------------------------------------------------------------------------------------------
# Training: the recipe, and the predictor-only stage
# ---------------------------------------------------------------------------------------------
def dynamicvit_loss(
    model: nn.Module,
    teacher: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    r: DynamicViTRecipe,
    *,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """L = CE + w_kl KL(student || teacher) + w_distill kept-token MSE + w_ratio ratio loss."""
    st: DynamicViTState = model.dvit_state
    feats, logits, t_feats, t_logits = features_and_logits(model, teacher, x)
    ce = F.cross_entropy(logits, y, label_smoothing=label_smoothing)
    kl = kl_to_teacher(logits, t_logits)
    p = st.prefix
    mask = st.policy[:, p:].detach() if st.policy is not None else feats.new_ones(feats.shape[0], feats.shape[1] - p)
    distill = (
        token_distill_loss(feats[:, p:], t_feats[:, p:], mask) if feats.shape == t_feats.shape else feats.new_zeros(())
    )
    ratio = ratio_loss(st.decisions, st.ratios[: len(st.decisions)]) if st.decisions else feats.new_zeros(())
    loss = ce + r.w_kl * kl + r.w_distill * distill + r.w_ratio * ratio
    return loss, {
        "ce": ce.detach(),
        "kl": kl.detach(),
        "distill": distill.detach(),
        "ratio": ratio.detach(),
        "kept_last": mask.float().mean(),
    }


def _freeze_backbone(model: nn.Module, frozen: bool) -> None:
    for name, p in model.named_parameters():
        if PREDICTOR not in name:
            p.requires_grad_(not frozen)


def calibrate_predictors(
    model: nn.Module,
    teacher: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    recipe: DynamicViTRecipe | None = None,
    lr: float = 1e-3,
    steps: int | None = None,
) -> dict[str, float]:
    """The predictor-only stage: backbone frozen, the predictors trained with the recipe's loss
    (distillation to the dense ``teacher`` included) on preprocessed ``batches`` (x, y).

    Returns the mean losses of the last 10 steps. The model is left in eval mode, backbone
    trainable again."""
    r = recipe or DynamicViTRecipe()
    teacher.eval()
    _freeze_backbone(model, True)
    try:
        return short_stage(
            model,
            [p for n, p in model.named_parameters() if PREDICTOR in n],
            batches,
            lambda x, y: dynamicvit_loss(model, teacher, x, y, r),
            steps=r.predictor_steps if steps is None else steps,
            lr=lr,
        )
    finally:
        _freeze_backbone(model, False)


class DynamicViTHooks(TrainHooks):
    """The recipe's loss; predictors at the full lr, the backbone at ``backbone_lr_scale`` x lr; the
    first ``predictor_epochs`` train the predictors only."""

    def __init__(self, model: nn.Module, teacher: nn.Module, recipe: DynamicViTRecipe):
        self.teacher, self.r = teacher, recipe
        self.state: DynamicViTState = model.dvit_state
        self._epoch = self._step = 0
        # a stage that keeps every token runs no predictor: its parameters take no part in the loss
        self.unused_parameters = any(r >= 1 for r in self.state.ratios)

    def param_groups(self, model, cfg):
        return param_groups(
            model,
            weight_decay=cfg.weight_decay,
            layer_decay=cfg.layer_decay,
            is_new=lambda n: PREDICTOR in n,
            scale=lambda n: self.r.backbone_lr_scale,
        )

    def on_epoch_start(self, model: nn.Module, *, epoch: int) -> None:
        self._epoch, self._step = epoch, 0

    def prepare_step(self, model: nn.Module, tag: Any) -> None:
        progress = self._epoch + self._step / max(1, self.steps_per_epoch)
        _freeze_backbone(model, progress < self.r.predictor_epochs)
        self._step += 1

    def loss(self, model, x, y, *, epoch: int, cfg, tag=None):
        return dynamicvit_loss(model, self.teacher, x, y, self.r, label_smoothing=cfg.label_smoothing)

    def on_epoch_end(self, model: nn.Module, *, epoch: int) -> dict[str, Any]:
        _freeze_backbone(model, False)
        return {}


__all__ = [
    "DynamicViT",
    "DynamicViTConfig",
    "DynamicViTRecipe",
    "DynamicViTState",
    "DynamicViTBlock",
    "ScorePredictor",
    "calibrate_predictors",
    "dynamicvit_loss",
    "gumbel_keep",
    "keep_count",
    "policy_attn_bias",
    "ratio_loss",
    "token_distill_loss",
]
