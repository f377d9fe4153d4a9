"""Sparsifiner: instance-dependent sparse attention from a low-rank connectivity predictor.

Per layer and head (METHODS.md section 4, seed 002)::

    A_down = softmax(Q (W_down K)^T / sqrt(d))      W_down (n_down, n) projects the TOKEN axis
    C      = A_down where A_down > tau, else 0      sparse coefficients
    S      = C @ W_up                               W_up (n_down, n), entries |w| <= w_thresh zeroed
    M      = top-B of each row of S,  B = ceil(attn_keep_ratio * n)
    out    = masked-softmax attention over M

Readings (where the paper or the official code leave a choice):
    - W_down / W_up are per layer AND per head, shape (H, n_down, n) (the official code shares
      them across heads; per-head costs no extra FLOPs). Q and K enter A_down at full head dim
      (the official code adds a channel-reducing Linear; the paper's Eq. 1 has none).
    - CLS (prefix) query rows attend to every key, as in the official code. A coefficient row
      whose entries are all <= tau keeps its largest entry, so no row of S is empty.
    - Fewer tokens than the model was built for (token pruning before this layer): the first n
      columns of W_down / W_up are used (position in the pruned sequence; trainable in stage 2).
    - Zero-shot init (no training): W_down averages the keys of n_down spatial regions (CLS is its
      own region) and W_up spreads each region's coefficient back over its tokens (1/|region|),
      so S[i, j] ~ the attention of query i to the mean key of j's region.
    - The method is a kernel (:class:`SparsifinerKernel`) in :class:`~nascompress.models.layers.NCAttention`:
      it sees the q/k/v the attention computed (a DCS Q/K mask or a materialized Q/K width under
      it is honoured; q/k and v may have different head dims).
    - FLOPs (``last_macs``): predictor (W_down K, Q K_down^T, the nnz-based sparse product
      C @ W_up) + (d_qk + d_v) nnz(M) for QK^T and AV (the paper's accounting for a sparse kernel; on a
      CPU the unstructured path runs as a dense masked SDPA and saves no time). The block mode
      reports what it really computes: predictor, pooled tile scores, kept tiles, CLS rows.
    - Training (two stages, :class:`SparsifinerHooks`): stage 1 trains W_down/W_up on the
      un-thresholded product A_down @ W_up (the official code does the same) with dense attention;
      thresholds apply whenever the mask is predicted (eval, stage 2).
    - ``mode="block"`` (``block_sparse``): the patch tokens are cut into blocks, CLS rows and CLS keys stay
      dense, scores are pooled over (query block, key block) tiles (the same S summed over tiles,
      never built at n x n), and each query block keeps its top key blocks per head. At inference
      (no grad) ``kernel="gather"`` gathers each query block's kept keys straight from the qkv
      memory into one fused SDPA, ``kernel="flex"`` runs compiled FlexAttention on a BlockMask
      built from the block indices; training and ``kernel="masked"`` use the same mask in the
      masked path (all three tested equal). MACs/density are computed when read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Config, check_settings, field_name, setting
from ..errors import NascompressError
from ..train.hooks import TrainHooks, features_and_logits, kl_to_teacher, own_group, param_groups, short_stage
from ..models.layers import to_core
from . import Method, TrainOverrides, register_method
from .sparsifiner_kernel import (
    SparsifinerConfig,
    SparsifinerKernel,
    attention_budget,
    region_init,
    sparse_modules,
)


# ---------------------------------------------------------------------------------------------
# Training recipe (stage 1: predictor only, L_attn; stage 2: backbone, L_cls + L_token + L_cls_distill)


@dataclass(frozen=True)
class SparsifinerRecipe(Config):
    """Sparsifiner's two-stage training (the paper's weights).

    Args:
        stage1_epochs: epochs of stage 1 (backbone frozen, dense attention, predictor trained on
            the attention reconstruction loss); the rest is stage 2.
        stage1_steps: steps of stage 1 before a zero-shot save (``--zero-shot``).
        predictor_lr_scale: the predictor's lr relative to the backbone's.
        lambda_attn / lambda_token / lambda_cls_distill: loss weights (stage 1 / stage 2).
    """

    stage1_epochs: int = setting(
        1,
        lo=0,
        help=(
            "Epochs of stage 1 (backbone frozen, dense attention, the predictor trained to reconstruct the "
            "attention); the rest is stage 2."
        ),
    )
    stage1_steps: int = setting(100, lo=0, help="Steps of stage 1 before a zero-shot model (--zero-shot).")
    predictor_lr_scale: float = setting(10.0, lo=0, help="The predictor's lr relative to the backbone's.")
    lambda_attn: float = setting(1.0, lo=0, help="Weight of the attention reconstruction loss (stage 1).")
    lambda_token: float = setting(0.5, lo=0, help="Weight of the final tokens' MSE to the dense teacher's (stage 2).")
    lambda_cls_distill: float = setting(
        0.5, lo=0, help=("Weight of KL(student || dense teacher) on the logits (stage 2).")
    )

    def __post_init__(self) -> None:
        check_settings(self, name=field_name)  # every setting() against its declaration


PREDICTOR = ".kernel.w_"


def _stage1(model: nn.Module, on: bool) -> None:
    """Stage 1: only the predictor trains (dense attention, reconstruction loss); stage 2: the rest."""
    for name, p in model.named_parameters():
        p.requires_grad_((PREDICTOR in name) == on)
    for m in sparse_modules(model):
        m.recon = on


def _stage1_loss(model: nn.Module, x: torch.Tensor, lambda_attn: float) -> tuple[torch.Tensor, dict[str, Any]]:
    model(x)
    mods = sparse_modules(model)
    l_attn = sum(m.recon_loss for m in mods) / len(mods)
    return lambda_attn * l_attn, {"l_attn": l_attn.detach()}


class SparsifinerHooks(TrainHooks):
    """Epochs < stage1_epochs: backbone frozen, dense attention, loss = lambda_attn * L_attn
    (mean over layers of the per-image sum of squared errors, as the official code sums); the
    frozen dense student's attention IS the teacher's there, so no teacher forward is needed.
    Later epochs: predictor frozen (its mask carries no gradient), loss = CE + lambda_token *
    MSE(final tokens, teacher's) + lambda_cls_distill * KL(student || teacher logits).
    """

    def __init__(self, teacher: nn.Module, recipe: SparsifinerRecipe):
        self.teacher, self.r = teacher, recipe

    def param_groups(self, model: nn.Module, cfg: Any) -> list[dict[str, Any]]:
        for p in model.parameters():
            p.requires_grad_(True)
        groups = param_groups(model, weight_decay=cfg.weight_decay, layer_decay=cfg.layer_decay)
        pred = [p for n, p in model.named_parameters() if PREDICTOR in n]
        # the predictor trains at predictor_lr_scale x lr, with weight decay (its sparsity)
        return own_group(groups, pred, weight_decay=cfg.weight_decay, lr_scale=self.r.predictor_lr_scale)

    def on_epoch_start(self, model: nn.Module, *, epoch: int) -> None:
        _stage1(model, epoch < self.r.stage1_epochs)

    def loss(self, model, x, y, *, epoch, cfg, tag=None):
        if epoch < self.r.stage1_epochs:
            return _stage1_loss(model, x, self.r.lambda_attn)
        feats, logits, t_feats, t_logits = features_and_logits(model, self.teacher, x)
        ce = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
        kl = kl_to_teacher(logits, t_logits)
        p = int(getattr(model, "num_prefix_tokens", 1))
        # token pruning stacked before: token sets differ, so only the prefix (CLS) tokens are compared
        tok = F.mse_loss(feats, t_feats) if feats.shape == t_feats.shape else F.mse_loss(feats[:, :p], t_feats[:, :p])
        loss = ce + self.r.lambda_token * tok + self.r.lambda_cls_distill * kl
        return loss, {"ce": ce.detach(), "l_token": tok.detach(), "l_cls_distill": kl.detach()}

    def on_epoch_end(self, model: nn.Module, *, epoch: int) -> dict[str, Any]:
        stage = 1 if epoch < self.r.stage1_epochs else 2
        _stage1(model, False)
        for p in model.parameters():
            p.requires_grad_(True)
        mods = sparse_modules(model)
        thr = mods[0].cfg.w_thresh if mods else 0.0
        nz = sum(int((m.w_up.abs() > thr).sum()) for m in mods)
        tot = sum(m.w_up.numel() for m in mods)
        return {"stage": stage, "w_up_density": nz / max(tot, 1)}


def calibrate_predictor(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    recipe: SparsifinerRecipe | None = None,
    lr: float = 1e-3,
    steps: int | None = None,
) -> dict[str, float]:
    """Stage 1 alone, for a zero-shot model: the predictors learn to reconstruct the dense
    attention (backbone frozen). Returns the mean L_attn of the last 10 steps; eval mode after."""
    r = recipe or SparsifinerRecipe()
    if not sparse_modules(model):
        return {}
    _stage1(model, True)
    try:
        return short_stage(
            model,
            [p for n, p in model.named_parameters() if PREDICTOR in n],
            batches,
            lambda x, y: _stage1_loss(model, x, 1.0),
            steps=r.stage1_steps if steps is None else steps,
            lr=lr,
        )
    finally:
        _stage1(model, False)
        for p in model.parameters():
            p.requires_grad_(True)


# ---------------------------------------------------------------------------------------------
# The method


@register_method
class Sparsifiner(Method):
    token_stage = True
    name = "sparsifiner"
    summary = "instance-dependent sparse attention from a low-rank connectivity predictor (Wei et al. 2023)"
    config_cls = SparsifinerConfig
    recipe_cls = SparsifinerRecipe
    train_overrides = TrainOverrides(base_lr=1e-4, warmup_epochs=0.2, epochs=2)
    stacks_on = frozenset({"dcs", "uniform"})
    off_config = {"attn_keep_ratio": 1.0}
    paper_config = {"attn_keep_ratio": 0.25}
    calibrates = True

    def resolve(self, model: nn.Module, cfg: SparsifinerConfig) -> SparsifinerConfig:
        to_core(model, method="sparsifiner")
        n = int(model.patch_embed.num_patches) + int(model.num_prefix_tokens)
        if cfg.budget is not None:
            attention_budget(cfg.attn_keep_ratio, n, cfg.budget)
        for i, blk in enumerate(model.blocks):
            if blk.attn.kernel is not None:
                raise NascompressError(
                    f"blocks.{i}.attn already has a {type(blk.attn.kernel).__name__}; apply sparsifiner once"
                )
        return cfg

    def check_record(self, record: dict[str, Any]) -> None:
        super().check_record(record)
        n = record.get("n_tokens")
        for key in ("n_tokens", "n_down"):  # what prepare recorded: the tokens and the low-rank size used
            v = record.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= (n or v)):
                got = v if isinstance(v, (int, float)) else type(v).__name__
                raise NascompressError(f"{key} must be a whole number of tokens in [1, n_tokens], got {got}")

    def patch(self, model: nn.Module, cfg: SparsifinerConfig, record: dict[str, Any]) -> nn.Module:
        prefix = int(model.num_prefix_tokens)
        grid = tuple(model.patch_embed.grid_size) if getattr(model.patch_embed, "grid_size", None) else None
        n = int(model.patch_embed.num_patches) + prefix
        if "n_tokens" in record and int(record["n_tokens"]) != n:
            raise NascompressError(
                f"the sparsifiner record was made for {record['n_tokens']} tokens, the model has {n}"
            )
        r = min(cfg.n_down, n)
        w_down, w_up = region_init(n, r, prefix=prefix, grid=grid)
        for blk in model.blocks:
            attn = blk.attn
            H, dev = attn.num_heads, attn.qkv.weight.device
            attn.kernel = SparsifinerKernel(
                cfg, w_down.expand(H, -1, -1).clone().to(dev), w_up.expand(H, -1, -1).clone().to(dev), prefix
            )
        return model

    def prepare(self, model, cfg, recipe):
        record = self.make_record(cfg, recipe)
        model = self.patch(model, cfg, record)
        n = int(model.patch_embed.num_patches) + int(model.num_prefix_tokens)
        record.update(n_tokens=n, n_down=min(cfg.n_down, n))
        return model, record

    def hooks(self, model, record, *, teacher, train_cfg):
        return SparsifinerHooks(teacher, SparsifinerRecipe.from_dict(record.get("recipe", {})))

    def calibrate(self, model, record, *, teacher, batches, steps=None):
        """Stage 1 alone: the region-initialised predictor learns the dense attention."""
        return calibrate_predictor(
            model, batches, recipe=SparsifinerRecipe.from_dict(record.get("recipe", {})), steps=steps
        )


__all__ = ["Sparsifiner", "SparsifinerRecipe", "SparsifinerHooks", "calibrate_predictor"]
