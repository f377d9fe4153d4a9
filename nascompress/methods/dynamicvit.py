"""DynamicViT: learned, input-dependent token keep decisions (METHODS.md section 3).

Prediction modules sit before layers 4, 7, 10 of a 12-layer ViT (scaled for other depths);
stage s keeps ``rho ** s`` of the ORIGINAL patch tokens. In training the decisions are hard
Gumbel-softmax samples (straight-through), multiplied across stages, and tokens are masked in
the attention softmax rather than removed. At inference each stage keeps the top
``int(rho ** s * N)`` tokens by keep probability (as the official code counts) and physically
drops the rest; CLS is always kept.

Masked softmax reading: the paper's A_ij = exp(P_ij) G_ij / sum_k exp(P_ik) G_ik (G_ii = 1,
G_ij = D_j) is passed to the block's OWN attention as the additive mask log(G + 1e-6), so any
attention module (timm fused SDPA, DCS, Sparsifiner) works unchanged. The gradient of
log(G + eps) through the softmax equals the multiplicative form's gradient for G + eps, i.e.
the paper's to within eps; masked tokens keep a weight of 1e-6 (the official code adds a
similar eps).

Zero-shot (``--zero-shot``) means the predictors are untrained (seeded random init): FLOPs and
token counts are exact, accuracy is that of a random token choice. Fine-tune to train them.

Record: ``{"name": "dynamicvit", "config": {"rho": 0.7, "prune_layers": [4, 7, 10]},
"recipe": {"w_kl": 0.5, "w_distill": 0.5, "w_ratio": 2.0, "gumbel_tau": 1.0,
"backbone_lr_scale": 0.01}}``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import NascompressError
from ..distill import features_and_logits, kl_to_teacher  # the paper's L_KL
from ..finetune import Recipe, register_recipe
from ..train import TrainConfig, TrainHooks, decay_groups
from . import register_method
from .tokens import check_keys, check_layers, check_rate, check_vit, keep_cls_and, patched_class, scale_layers

METHOD_KEYS = ("rho", "prune_layers")
RECIPE_KEYS = ("w_kl", "w_distill", "w_ratio", "gumbel_tau", "backbone_lr_scale")
MASK_EPS = 1e-6


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
        self.out = nn.Sequential(nn.Linear(dim, dim // 2), nn.GELU(), nn.Linear(dim // 2, dim // 4), nn.GELU(),
                                 nn.Linear(dim // 4, 2))

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
        return self.out[1:](y)

    def matmul_macs(self, inputs: tuple, output: torch.Tensor) -> float:
        """The first MLP layer, run as two F.linear calls the Linear hooks do not see."""
        B, N, C = inputs[0].shape
        first = self.out[0]
        h = C // 2
        return float(B * N * h * first.out_features + B * (first.in_features - h) * first.out_features)


def keep_count(rho: float, stage: int, n: int) -> int:
    """Tokens kept at ``stage`` (1-based) of ``n`` original patch tokens: int(rho^s * n), >= 1."""
    return max(1, int(rho ** stage * n + 1e-6))


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
    """(1 / S) sum_s mean_b (rho^s - mean_i D_i^{b,s})^2; decisions: S tensors (B, N)."""
    losses = [((d.mean(dim=1) - t) ** 2).mean() for d, t in zip(decisions, targets)]
    return torch.stack(losses).mean()


def token_distill_loss(tokens: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MSE of the kept final tokens against the teacher's (mean over kept tokens and channels,
    as the official mse_token loss): tokens, teacher (B, N, C), mask (B, N) in {0, 1}."""
    err = ((tokens - teacher) ** 2).mean(dim=-1)  # (B, N)
    return (err * mask).sum() / mask.sum().clamp_min(1.0)


# ---------------------------------------------------------------------------------------------
# Patch
# ---------------------------------------------------------------------------------------------
@dataclass
class DynamicViTState:
    """Shared by the patched blocks of one model, reset by the first stage on every forward."""

    rho: float
    num_stages: int
    tau: float = 1.0
    n0: int = 0  # original patch-token count of the current forward
    policy: torch.Tensor | None = None  # (B, N) training mask incl. CLS, cumulative
    decisions: list[torch.Tensor] = field(default_factory=list)  # per stage (B, N0), training
    kept: list[int] = field(default_factory=list)  # per stage tokens kept, inference

    def __deepcopy__(self, memo: dict) -> "DynamicViTState":  # the masks are graph tensors: not copied
        return DynamicViTState(rho=self.rho, num_stages=self.num_stages, tau=self.tau)


class DynamicViTBlock:
    """Mixin over the block's class (timm Block, timm 1.0.31, or a DCS block): DynamicViT.

    Modifications: a block with a predictor (``dvit_stage`` >= 1) first scores its patch tokens;
    training: Gumbel decisions update the shared cumulative policy; inference: the top tokens
    are gathered (CLS first). In training every block from the first stage on passes
    ``log(G + eps)`` as ``attn_mask`` to ``super().forward`` (its own attn and mlp).
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
        B, N = x.shape[0], x.shape[1] - 1
        if self.dvit_stage == 1:
            st.n0, st.policy, st.decisions, st.kept = N, None, [], []
        if st.rho >= 1:  # compression off: no decisions, exactly the dense block
            return x
        spatial = x[:, 1:]
        if self.training:
            prev = x.new_ones(B, N) if st.policy is None else st.policy[:, 1:]
            logits = self.dvit_predictor(spatial, prev)
            d = gumbel_keep(logits, prev, tau=st.tau)
            st.decisions.append(d)
            st.policy = torch.cat([x.new_ones(B, 1), d], dim=1)
            return x
        st.policy = None
        keep = keep_count(st.rho, self.dvit_stage, st.n0)
        if keep >= N:
            st.kept.append(N)
            return x
        logits = self.dvit_predictor(spatial)
        score = logits[..., 0] - logits[..., 1]  # (B, N), monotone in the keep probability
        idx = score.topk(keep, dim=1).indices
        st.kept.append(keep)
        return keep_cls_and(x, idx)


def resolve_config(model: nn.Module, config: dict[str, Any]) -> dict[str, Any]:
    check_keys(config, METHOD_KEYS, "dynamicvit")
    depth = len(model.blocks)
    layers = config.get("prune_layers")
    return {"rho": check_rate(config.get("rho", 0.7), "rho"),
            "prune_layers": scale_layers(depth) if layers is None else check_layers(layers, depth)}


@register_method("dynamicvit")
def apply(model: nn.Module, record: dict[str, Any]) -> nn.Module:
    """Patch a timm ViT in place: predictors ``blocks.<l-1>.dvit_predictor`` before each layer l."""
    check_vit(model, "dynamicvit")
    cfg = resolve_config(model, dict(record.get("config", {})))
    tau = float(record.get("recipe", {}).get("gumbel_tau", 1.0))
    layers = cfg["prune_layers"]
    state = DynamicViTState(rho=cfg["rho"], num_stages=len(layers), tau=tau)
    first = layers[0] - 1
    for i, blk in enumerate(model.blocks):
        if i < first:
            continue
        if isinstance(blk, DynamicViTBlock):
            raise NascompressError(f"dynamicvit is already applied to blocks.{i}")
        blk.__class__ = patched_class(type(blk), DynamicViTBlock, "DynamicViT")
        blk.dvit_state = state
        blk.dvit_stage = layers.index(i + 1) + 1 if (i + 1) in layers else 0
        if blk.dvit_stage:
            p = ScorePredictor(model.embed_dim)
            ref = next(model.parameters())
            blk.dvit_predictor = p.to(device=ref.device, dtype=ref.dtype)
    model.dvit_state = state
    return model


# ---------------------------------------------------------------------------------------------
# Fine-tuning recipe
# ---------------------------------------------------------------------------------------------
class DynamicViTHooks(TrainHooks):
    """L = CE + w_kl KL(student || teacher) + w_distill token MSE + w_ratio ratio loss."""

    def __init__(self, model: nn.Module, teacher: nn.Module, *, w_kl: float, w_distill: float, w_ratio: float,
                 backbone_lr_scale: float = 0.01):
        self.teacher, self.w_kl, self.w_distill, self.w_ratio = teacher, w_kl, w_distill, w_ratio
        self.backbone_lr_scale = backbone_lr_scale
        self.state: DynamicViTState = model.dvit_state

    def param_groups(self, model, cfg):
        """Predictors at the full lr, the backbone at ``backbone_lr_scale`` x lr (official: 0.01)."""
        groups = []
        for g in decay_groups(model, cfg.weight_decay):
            pred = [p for p in g["params"] if id(p) in self._pred_ids(model)]
            rest = [p for p in g["params"] if id(p) not in self._pred_ids(model)]
            groups += [dict(g, params=pred, lr_scale=1.0), dict(g, params=rest, lr_scale=self.backbone_lr_scale)]
        return [g for g in groups if g["params"]]

    @staticmethod
    def _pred_ids(model: nn.Module) -> set[int]:
        return {id(p) for n, p in model.named_parameters() if ".dvit_predictor." in n}

    def loss(self, model, x, y, *, epoch: int, cfg: TrainConfig):
        st = self.state
        feats, logits, t_feats, t_logits = features_and_logits(model, self.teacher, x)
        ce = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
        kl = kl_to_teacher(logits, t_logits)
        mask = st.policy[:, 1:].detach() if st.policy is not None else feats.new_ones(feats.shape[:2])[:, 1:]
        distill = token_distill_loss(feats[:, 1:], t_feats[:, 1:], mask)
        targets = [st.rho ** s for s in range(1, st.num_stages + 1)]
        ratio = ratio_loss(st.decisions, targets) if st.decisions else feats.new_zeros(())
        loss = ce + self.w_kl * kl + self.w_distill * distill + self.w_ratio * ratio
        kept = float(mask.mean().item())
        return loss, {"ce": ce.item(), "kl": kl.item(), "distill": distill.item(), "ratio": ratio.item(),
                      "kept_last": kept}


@register_recipe("dynamicvit")
class DynamicViTRecipe(Recipe):
    """DynamicViT fine-tune against the dense run. Options: rho (0.7), prune_layers (scaled
    4,7,10 of 12), w_kl (0.5), w_distill (0.5), w_ratio (2.0), gumbel_tau (1.0),
    backbone_lr_scale (0.01, as the official code: predictors train at --lr, the backbone slower)."""

    def prepare(self, model, config):
        check_keys(config, METHOD_KEYS + RECIPE_KEYS, "dynamicvit")
        recipe = {k: config.pop(k) for k in RECIPE_KEYS if k in config}
        for k, v in recipe.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (k == "gumbel_tau" and v == 0):
                raise NascompressError(f"{k} must be a number >= 0 (gumbel_tau > 0), got {v!r}")
        check_vit(model, "dynamicvit")
        record = {"name": "dynamicvit", "config": resolve_config(model, config), "recipe": recipe}
        return apply(model, record), record

    def hooks(self, model, record, *, teacher, train_cfg):
        r = record.get("recipe", {})
        return DynamicViTHooks(model, teacher, w_kl=float(r.get("w_kl", 0.5)),
                               w_distill=float(r.get("w_distill", 0.5)), w_ratio=float(r.get("w_ratio", 2.0)),
                               backbone_lr_scale=float(r.get("backbone_lr_scale", 0.01)))
