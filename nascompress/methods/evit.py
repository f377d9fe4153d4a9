"""EViT: keep the tokens the class token attends to most, fuse the rest into one token.

Paper: Liang et al. 2022, "Not All Patches are What You Need" (seed 000, METHODS.md section 2).
At each pruning layer, after the attention residual and before the MLP, the patch tokens are
ranked by the head-averaged class-token attention row that the block's attention computed (read
from :class:`~nascompress.models.layers.NCAttention`'s class-token recorder, so DCS masks and sparse
kernels underneath are what is ranked, and fused SDPA is kept); ``ceil(keep_rate * n)`` are kept
in score order and the others are fused into one extra token ``sum_i a_i x_i`` (weights not
renormalized, as in the seed's code). Prefix tokens (class, distillation, registers) are kept.
``keep_rate`` is one rate for every pruning layer or one per layer (a per-layer schedule).

Record (``arch.json``)::

    {"name": "evit", "config": {"keep_rate": 0.7, "prune_layers": [4, 7, 10], "fuse_token": true},
     "recipe": {"shrink_start_epoch": 0, "shrink_epochs": null, ...}}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Config, check_bool, check_settings, field_name, setting
from ..errors import NascompressError
from ..train.hooks import TrainHooks, features_and_logits, kl_to_teacher
from . import Method, TrainOverrides, register_method
from .tokens import ceil_keep, distill_setting, keep_prefix_and, patched_class, per_layer, token_layers


# ---------------------------------------------------------------------------------------------
# Pure tensor functions
# ---------------------------------------------------------------------------------------------
def evit_prune(x: torch.Tensor, scores: torch.Tensor, keep: int, *, fuse: bool = True, prefix: int = 1) -> torch.Tensor:
    """Keep the ``keep`` top-scored patch tokens (score order) and fuse the rest.

    Args:
        x: (B, N, C) tokens, the ``prefix`` tokens first.
        scores: (B, N - prefix) attention of the class token to each patch token (head mean).
        keep: number of patch tokens kept, 1 <= keep <= N - prefix (N - prefix: ``x`` itself,
            nothing to prune).
        fuse: append the fused token ``sum_{i not kept} scores_i * x_i`` (not renormalized).
    Returns:
        (B, prefix + keep (+1 if fuse and keep < N - prefix), C).

    The inference path in few kernels: one ``topk`` (no full sort: the tokens not kept need no
    order), one gather of the kept tokens, and the fused token as one matmul of the scores with the
    kept ones zeroed (no second gather; the sum runs over the tokens in position order).
    """
    if keep >= x.shape[1] - prefix:
        return x
    idx = scores.topk(keep, dim=1).indices  # (B, keep), score order
    kept = keep_prefix_and(x, idx, prefix)  # (B, prefix + keep, C)
    if not fuse:
        return kept
    w = scores.scatter(1, idx, 0.0).unsqueeze(1)  # (B, 1, n): a_i for the tokens not kept, 0 for the kept
    return torch.cat([kept, w @ x[:, prefix:]], dim=1)  # fused (B, 1, C) = sum_i a_i x_i


def fused_token_hard(x: torch.Tensor, scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The fused token of :func:`evit_prune` by masking: x (B, M, C), scores (B, M) -> (B, C)."""
    rank = (scores.unsqueeze(1) > scores.unsqueeze(2)).sum(-1)  # (B, M): tokens scored higher
    out = (rank >= keep).to(x.dtype)
    return torch.einsum("bm,bm,bmc->bc", out, scores, x)


def fused_token_linearized(x: torch.Tensor, scores: torch.Tensor, keep: int, temperature: float) -> torch.Tensor:
    """The seed's linearized fused token, the step function h replaced by a sigmoid.

    ExtraToken = sum_i h(sum_{j != i} h(a_j - a_i) - k + 1/2) * a_i * x_i with h(z) = sigmoid(z / t).
    Reading: the inner sum counts the tokens scored above token i (j = i is left out, h(0) is
    ambiguous); the 1/2 offset puts the outer step between the integer counts k - 1 (kept) and
    k (fused). As t -> 0 this equals :func:`fused_token_hard` for distinct scores.

    Args:
        x: (B, M, C) patch tokens; scores: (B, M); keep: k; temperature: t > 0.
    Returns:
        (B, C), differentiable in ``scores`` and ``x``.
    """
    M = scores.shape[1]
    diff = scores.unsqueeze(1) - scores.unsqueeze(2)  # (B, i, j) = a_j - a_i
    above = torch.sigmoid(diff / temperature) * (1 - torch.eye(M, dtype=x.dtype, device=x.device))
    out = torch.sigmoid((above.sum(-1) - keep + 0.5) / temperature)  # (B, M)
    return torch.einsum("bm,bm,bmc->bc", out, scores, x)


def shrink_at(progress_epochs: float, *, start: float, length: float) -> float:
    """The official EViT schedule as a fraction s of the way from no pruning (1) to the target (0):
    1 until ``start`` epochs, then a cosine down to 0 over ``length`` epochs. The keep rate of a
    layer is ``base + (1 - base) * s``. ``progress_epochs`` may be fractional (per step)."""
    if progress_epochs < start:
        return 1.0
    if length <= 0 or progress_epochs >= start + length:
        return 0.0
    return 0.5 * (1 + math.cos(math.pi * (progress_epochs - start) / length))


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EViTConfig(Config):
    """EViT settings (recorded in arch.json).

    Args:
        keep_rate: share of the patch tokens kept at each pruning layer, in (0, 1]: one number, or
            one per pruning layer (a per-layer schedule).
        prune_layers: 1-based layers after whose attention tokens are pruned (default: 4, 7, 10 of
            12 scaled to the depth).
        fuse_token: fuse the pruned tokens into one extra token (the paper's default).
    """

    keep_rate: float | tuple[float, ...] = setting(
        0.7,
        lo=0,
        hi=1,
        lo_open=True,
        help=("EViT keep rate kappa in (0, 1] (one value, or one per pruning layer: 0.9,0.7,0.5)."),
    )
    prune_layers: tuple[int, ...] | None = setting(
        None, help=("Token pruning layers, 1-based, e.g. 4,7,10 (default: scaled from 4,7,10 of 12).")
    )
    fuse_token: bool = True

    def __post_init__(self) -> None:
        check_settings(self, name=field_name)  # every setting() against its declaration
        check_bool("fuse_token", self.fuse_token)


@dataclass(frozen=True)
class EViTRecipe(Config):
    """EViT fine-tuning. As the official fine-tune of a pretrained model: the target keep rate from
    the start (measured on DINOv2: 84.25% against 82.6% with the cosine shrink over half of a
    1-epoch budget), no teacher.

    Args:
        shrink_start_epoch: epochs trained at keep rate 1 first.
        shrink_epochs: length of the official cosine from 1 to the target (0: the target from the
            start, the default; None: half the epochs, the schedule of training from scratch).
            Validation and the saved model always use the target.
        linearized_temperature: train with the seed's linearized fused token (sigmoid steps).
        distill: weight of KL(student || dense teacher) added to CE (the paper uses none: 0).
    """

    shrink_start_epoch: float = setting(0.0, lo=0, help="Epochs trained at keep rate 1 before the keep rate shrinks.")
    shrink_epochs: float | None = setting(
        0.0,
        lo=0,
        help=(
            "Epochs of the cosine shrink of the keep rate from 1 to the target (0: the target from the start; "
            "--opt shrink_epochs=null: half the epochs). Validation and the saved model use the target."
        ),
    )
    linearized_temperature: float | None = setting(
        None,
        lo=0,
        lo_open=True,
        help=("Train with a linearized fused token (sigmoid steps) at this temperature (default: off)."),
    )
    distill: float = distill_setting()

    def __post_init__(self) -> None:
        check_settings(self, name=field_name)  # every setting() against its declaration


# ---------------------------------------------------------------------------------------------
# Patch
# ---------------------------------------------------------------------------------------------
@dataclass
class EViTState:
    """Shared by the patched blocks of one model; the recipe's schedule moves ``shrink``."""

    rates: tuple[float, ...]  # target keep rate per pruning layer
    prefix: int = 1
    fuse_token: bool = True
    shrink: float = 0.0  # 0: the target rates; 1: no pruning (the schedule's start)
    fuse_temperature: float | None = None  # training only: the linearized (sigmoid) fused token

    def rate(self, stage: int) -> float:
        base = self.rates[stage]
        return base + (1.0 - base) * self.shrink


class EViTBlock:
    """Mixin over the block's class (:class:`~nascompress.models.layers.NCBlock` or a DCS block): EViT.

    Modifications: between the block's own two residual halves the patch tokens are ranked by
    the class-token attention row its attention recorded and reduced by :func:`evit_prune`.
    """

    evit_state: EViTState
    evit_stage: int

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        x = self.attn_half(x, attn_mask=attn_mask, is_causal=is_causal)
        st = self.evit_state
        p = st.prefix
        n = x.shape[1] - p
        keep = ceil_keep(st.rate(self.evit_stage), n)
        if keep < n:
            scores = self.attn.cls_attention().mean(dim=1)[:, p:]  # (B, n)
            pruned = evit_prune(x, scores, keep, fuse=st.fuse_token, prefix=p)
            if self.training and st.fuse_token and st.fuse_temperature:
                soft = fused_token_linearized(x[:, p:], scores, keep, st.fuse_temperature)
                pruned = torch.cat([pruned[:, :-1], soft.unsqueeze(1)], dim=1)
            x = pruned
        self.attn._cls_inputs = None
        return self.mlp_half(x)


@register_method
class EViT(Method):
    token_stage = True
    name = "evit"
    summary = "keep the tokens the class token attends to most, fuse the rest (Liang et al. 2022)"
    config_cls = EViTConfig
    recipe_cls = EViTRecipe
    # official fine-tune: 2e-5 per 512 for 30 epochs; a short budget needs a larger step
    train_overrides = TrainOverrides(base_lr=1e-4, warmup_epochs=0.2, epochs=2)
    stacks_on = frozenset({"dcs", "uniform", "sparsifiner"})
    off_config = {"keep_rate": 1.0}
    paper_config = {"keep_rate": 0.7}

    def resolve(self, model: nn.Module, cfg: EViTConfig) -> EViTConfig:
        layers = token_layers(model, "evit", cfg.prune_layers)
        per_layer(cfg.keep_rate, len(layers), "keep_rate")
        return cfg.replace(prune_layers=tuple(layers))

    def patch(self, model: nn.Module, cfg: EViTConfig, record: dict[str, Any]) -> nn.Module:
        layers = list(cfg.prune_layers)
        state = EViTState(
            rates=per_layer(cfg.keep_rate, len(layers), "keep_rate"),
            prefix=int(model.num_prefix_tokens),
            fuse_token=cfg.fuse_token,
        )
        for stage, layer in enumerate(layers):
            blk = model.blocks[layer - 1]
            if isinstance(blk, EViTBlock):
                raise NascompressError(f"evit is already applied to blocks.{layer - 1}")
            blk.__class__ = patched_class(type(blk), EViTBlock, "EViT")
            blk.evit_state, blk.evit_stage = state, stage
            # a layer kept at rate 1 never ranks (its rate stays 1 under the schedule): nothing to record
            blk.attn.record_cls = blk.attn.record_cls or state.rates[stage] < 1
        model.evit_state = state
        return model

    def hooks(self, model, record, *, teacher, train_cfg):
        r = EViTRecipe.from_dict(record.get("recipe", {}))
        length = train_cfg.epochs / 2 if r.shrink_epochs is None else r.shrink_epochs
        return EViTHooks(
            model,
            teacher,
            start=r.shrink_start_epoch,
            length=length,
            temperature=r.linearized_temperature,
            distill=r.distill,
        )


# ---------------------------------------------------------------------------------------------
# Fine-tuning recipe
# ---------------------------------------------------------------------------------------------
class EViTHooks(TrainHooks):
    """CE (+ distill * KL to the dense teacher) with the official keep-rate schedule, per step."""

    def __init__(
        self,
        model: nn.Module,
        teacher: nn.Module | None,
        *,
        start: float,
        length: float,
        temperature: float | None = None,
        distill: float = 0.0,
    ):
        self.start, self.length, self.teacher, self.distill = start, length, teacher, distill
        self.state: EViTState = model.evit_state
        self.state.fuse_temperature = temperature
        self._step = 0

    def on_epoch_start(self, model: nn.Module, *, epoch: int) -> None:
        self._step = 0

    def loss(self, model, x, y, *, epoch: int, cfg, tag=None):
        spe = self.steps_per_epoch or 0
        self.state.shrink = shrink_at(epoch + (self._step / spe if spe else 0.0), start=self.start, length=self.length)
        self._step += 1
        logs: dict[str, Any] = {"keep_rate": self.state.rate(0)}
        if self.distill > 0 and self.teacher is not None:
            _, logits, _, t_logits = features_and_logits(model, self.teacher, x)
            kl = kl_to_teacher(logits, t_logits)
            logs["kl"] = kl.detach()
        else:
            logits, kl = model(x), None
        ce = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
        logs["ce"] = ce.detach()
        return (ce if kl is None else ce + self.distill * kl), logs

    def on_epoch_end(self, model: nn.Module, *, epoch: int) -> dict[str, Any]:
        return {"keep_rate_end": self.state.rate(0)}

    def before_eval(self, model: nn.Module) -> None:
        self.state.shrink = 0.0  # validate and save at the target rates


__all__ = [
    "EViT",
    "EViTConfig",
    "EViTRecipe",
    "EViTState",
    "EViTBlock",
    "evit_prune",
    "fused_token_hard",
    "fused_token_linearized",
    "shrink_at",
]
