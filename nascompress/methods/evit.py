"""EViT: keep the tokens the CLS token attends to most, fuse the rest into one token.

Paper: Liang et al. 2022, "Not All Patches are What You Need" (seed 000, METHODS.md section 2).
At each pruning layer, after the attention residual and before the MLP, the non-CLS tokens are
ranked by the head-averaged CLS attention; ``ceil(keep_rate * (N - 1))`` are kept in score
order and the others are fused into one extra token ``sum_i a_i x_i`` (weights not
renormalized, as in the seed's code). The CLS row is computed beside the block's own
attention (O(N d), from the q/k it produced), so fused SDPA is kept.

Record (``arch.json``)::

    {"name": "evit", "config": {"keep_rate": 0.7, "prune_layers": [4, 7, 10], "fuse_token": true},
     "recipe": {"shrink_start_epoch": 0, "shrink_epochs": ...}}
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import NascompressError
from ..finetune import Recipe, register_recipe
from ..train import TrainConfig, TrainHooks
from . import register_method
from .tokens import (ClsScore, QKCapture, ceil_keep, check_keys, check_layers, check_rate, check_vit,
                     gather_tokens, keep_cls_and, mlp_residual, patched_class, scale_layers)

METHOD_KEYS = ("keep_rate", "prune_layers", "fuse_token")
RECIPE_KEYS = ("shrink_start_epoch", "shrink_epochs", "linearized_temperature")


# ---------------------------------------------------------------------------------------------
# Pure tensor functions
# ---------------------------------------------------------------------------------------------
def evit_prune(x: torch.Tensor, scores: torch.Tensor, keep: int, *, fuse: bool = True) -> torch.Tensor:
    """Keep the ``keep`` top-scored non-CLS tokens (score order) and fuse the rest.

    Args:
        x: (B, N, C) tokens, CLS at index 0.
        scores: (B, N - 1) attention of CLS to each non-CLS token (head mean).
        keep: number of non-CLS tokens kept, 1 <= keep <= N - 1.
        fuse: append the fused token ``sum_{i not kept} scores_i * x_i`` (not renormalized).
    Returns:
        (B, 1 + keep (+1 if fuse and keep < N - 1), C).
    """
    n = x.shape[1] - 1
    order = scores.argsort(dim=1, descending=True)  # (B, N-1)
    kept = keep_cls_and(x, order[:, :keep])  # (B, 1 + keep, C)
    if not fuse or keep >= n:
        return kept
    rest = order[:, keep:]
    w = torch.gather(scores, 1, rest).unsqueeze(1)  # (B, 1, N-1-keep)
    fused = w @ gather_tokens(x, rest + 1)  # (B, 1, C) = sum_i a_i x_i
    return torch.cat([kept, fused], dim=1)


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
        x: (B, M, C) non-CLS tokens; scores: (B, M); keep: k; temperature: t > 0.
    Returns:
        (B, C), differentiable in ``scores`` and ``x``.
    """
    M = scores.shape[1]
    diff = scores.unsqueeze(1) - scores.unsqueeze(2)  # (B, i, j) = a_j - a_i
    above = torch.sigmoid(diff / temperature) * (1 - torch.eye(M, dtype=x.dtype, device=x.device))
    out = torch.sigmoid((above.sum(-1) - keep + 0.5) / temperature)  # (B, M)
    return torch.einsum("bm,bm,bmc->bc", out, scores, x)


def keep_rate_at(progress_epochs: float, *, base: float, start: float, length: float) -> float:
    """The official EViT schedule: 1 until ``start`` epochs, then cosine down to ``base`` over
    ``length`` epochs, then ``base``. ``progress_epochs`` may be fractional (per step)."""
    if progress_epochs < start:
        return 1.0
    if length <= 0 or progress_epochs >= start + length:
        return base
    t = (progress_epochs - start) / length
    return base + (1.0 - base) * 0.5 * (1 + math.cos(math.pi * t))


# ---------------------------------------------------------------------------------------------
# Patch
# ---------------------------------------------------------------------------------------------
@dataclass
class EViTState:
    """Shared by the patched blocks of one model; the recipe's schedule changes ``keep_rate``."""

    keep_rate: float
    fuse_token: bool = True
    fuse_temperature: float | None = None  # training only: the linearized (sigmoid) fused token


class EViTBlock(QKCapture):
    """Mixin over the block's class (timm Block, timm 1.0.31, or a DCS block): EViT pruning.

    Modifications: after ``x + ls1(attn(norm1(x)))`` the tokens are ranked by the CLS
    attention row (from the q/k the block's own ``attn`` computed) and reduced by
    :func:`evit_prune`; then the block's own MLP half (:func:`tokens.mlp_residual`).
    """

    evit_state: EViTState
    evit_score: ClsScore

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
        q, k = self._pop_qk()
        st = self.evit_state
        n = x.shape[1] - 1
        keep = ceil_keep(st.keep_rate, n)
        if keep < n:
            scores = self.evit_score(q, k, self.attn.scale)[:, 1:]  # (B, N-1)
            pruned = evit_prune(x, scores, keep, fuse=st.fuse_token)
            if self.training and st.fuse_token and st.fuse_temperature:
                soft = fused_token_linearized(x[:, 1:], scores, keep, st.fuse_temperature)
                pruned = torch.cat([pruned[:, :-1], soft.unsqueeze(1)], dim=1)
            x = pruned
        return mlp_residual(self, x)


def _check_bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise NascompressError(f"{name} must be true or false, got {v!r}")
    return v


def resolve_config(model: nn.Module, config: dict[str, Any]) -> dict[str, Any]:
    """Validate EViT settings against ``model`` and fill the defaults."""
    check_keys(config, METHOD_KEYS, "evit")
    depth = len(model.blocks)
    layers = config.get("prune_layers")
    return {
        "keep_rate": check_rate(config.get("keep_rate", 0.7), "keep_rate"),
        "prune_layers": scale_layers(depth) if layers is None else check_layers(layers, depth),
        "fuse_token": _check_bool(config.get("fuse_token", True), "fuse_token"),
    }


@register_method("evit")
def apply(model: nn.Module, record: dict[str, Any]) -> nn.Module:
    """Patch the pruning blocks of a timm ViT in place (no new parameters)."""
    check_vit(model, "evit")
    cfg = resolve_config(model, dict(record.get("config", {})))
    state = EViTState(keep_rate=cfg["keep_rate"], fuse_token=cfg["fuse_token"])
    for layer in cfg["prune_layers"]:
        blk = model.blocks[layer - 1]
        if isinstance(blk, EViTBlock):
            raise NascompressError(f"evit is already applied to blocks.{layer - 1}")
        blk.__class__ = patched_class(type(blk), EViTBlock, "EViT")
        blk.evit_state = state
        blk.evit_score = ClsScore()
        blk._install_qk_capture()
    model.evit_state = state
    return model


# ---------------------------------------------------------------------------------------------
# Fine-tuning recipe
# ---------------------------------------------------------------------------------------------
class EViTHooks(TrainHooks):
    """Cross-entropy training with the official keep-rate schedule, evaluated per step."""

    def __init__(self, model: nn.Module, *, base: float, start: float, length: float,
                 temperature: float | None = None):
        self.base, self.start, self.length = base, start, length
        self.state: EViTState = model.evit_state
        self.state.fuse_temperature = temperature
        self._step = 0

    def on_epoch_start(self, model: nn.Module, *, epoch: int) -> None:
        self._step = 0
        self.state.keep_rate = keep_rate_at(epoch, base=self.base, start=self.start, length=self.length)

    def loss(self, model, x, y, *, epoch: int, cfg: TrainConfig):
        spe = getattr(self, "steps_per_epoch", 0) or 0
        progress = epoch + (self._step / spe if spe else 0.0)
        self.state.keep_rate = keep_rate_at(progress, base=self.base, start=self.start, length=self.length)
        self._step += 1
        logits = model(x)
        loss = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
        return loss, {"ce": loss.item(), "keep_rate": self.state.keep_rate}

    def on_epoch_end(self, model: nn.Module, *, epoch: int) -> dict[str, Any]:
        rate = self.state.keep_rate
        self.state.keep_rate = self.base  # validate and save at the target rate
        return {"keep_rate_end": rate}


@register_recipe("evit")
class EViTRecipe(Recipe):
    """EViT fine-tune. Options: keep_rate (0.7), prune_layers (scaled 4,7,10 of 12), fuse_token
    (true), shrink_start_epoch (0: rate 1 before it), shrink_epochs (cosine length; default half
    the training epochs, fractional allowed; 0 = constant keep_rate from the start),
    linearized_temperature (none: train with the hard fused token; t > 0: the linearized fused
    token of :func:`fused_token_linearized` in training, hard at inference)."""

    def prepare(self, model, config):
        check_keys(config, METHOD_KEYS + RECIPE_KEYS, "evit")
        recipe = {k: config.pop(k) for k in RECIPE_KEYS if k in config}
        for k, v in recipe.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0
                                  or (k == "linearized_temperature" and v == 0)):
                raise NascompressError(f"{k} must be a number >= 0 (temperature > 0), got {v!r}")
        check_vit(model, "evit")
        record = {"name": "evit", "config": resolve_config(model, config), "recipe": recipe}
        return apply(model, record), record

    def hooks(self, model, record, *, teacher, train_cfg):
        r = record.get("recipe", {})
        length = r.get("shrink_epochs")
        length = train_cfg.epochs / 2 if length is None else float(length)
        t = r.get("linearized_temperature")
        return EViTHooks(model, base=record["config"]["keep_rate"], start=float(r.get("shrink_start_epoch", 0)),
                         length=length, temperature=None if t is None else float(t))

