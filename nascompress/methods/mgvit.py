"""MG-ViT (seed 004): two-stage multi-granularity inference with early exit and PPSM.

A dense timm ViT becomes an :class:`MGViT` (its ``__class__`` is swapped, its state-dict keys kept
as the single-granularity stage SGIS) plus a new submodule ``mgis`` (the multi-granularity stage):

* **SGIS** runs the dense ViT on the image split into a ``grid x grid`` coarse grid (7x7). The image
  is resampled to ``grid * P`` pixels (P = the patch embedding's size; for a 28 px, patch-4 ViT with
  grid 7 this is the identity) and the position embedding is read at the coarse patch centres.
  An image whose top softmax probability exceeds ``epsilon`` exits here.
* **MGIS**: the coarse patches are ranked by the global class attention (CASR, lambda 0.98 from
  layer 3) into head / middle / tail; head patches are split 3x3, middle 2x2, tail kept.
  *Sub-patches reach the one patch embedding by resampling*: the image is resampled to
  ``s * grid * P`` pixels for s = 3 / 2 / 1, so every fine / medium / coarse sub-patch is exactly
  P x P pixels (bilinear, antialiased when shrinking; for the 28 px Fashion-MNIST ViT: 84 / 56 / 28 px
  images, 4 px sub-patches). Only the selected sub-patches are embedded (one conv call on the
  gathered patches). Each sub-patch's position embedding is the dense position grid bilinearly
  sampled at the sub-patch's centre. Feature reuse: the SGIS output tokens of head and middle
  patches go through ``MLP(C -> C')`` and are copied to their sub-patches, tail tokens get zeros;
  concatenated, the MGIS width is ``C + C'``. Tokens are ordered head, middle, tail (attention is
  permutation invariant; positions come from the embeddings).
* **PPSM** before the attention of the chosen MGIS layers (1-based, default 3, 7, 10 of 12 scaled
  to the depth, at least 2): tokens ranked by the MGIS's own running CASR (of the previous layers;
  merged tokens carry the sum of their scores) and slimmed with the value vectors of the
  previous layer's attention (see :func:`mgvit_ops.ppsm`).

Early exit is batched: SGIS runs on the whole batch, MGIS only on the rows that did not exit, with
fixed token counts per stage (no per-image loop). Training uses epsilon = 1 and the loss
``CE(D^M, y) + KL(D^M || D^S)`` (the MGIS distribution, detached, is SGIS's target).

MGIS init from the dense run (:func:`init_mgis_from_dense`): the first C channels of every MGIS
weight copy the dense weights (each head's first C/H dims hold the dense head, queries rescaled for
the larger head dim); the C' extra channels start as N(0, 1e-3^2) weights, zero biases and unit
norm gains, so at init MGIS computes about what the dense ViT computes on the multi-granularity
tokens while every new weight still gets gradients. The feature-reuse MLP has timm's default init.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from timm.models.vision_transformer import Block, VisionTransformer, checkpoint_filter_fn
from torch import nn

from ..config import Config, check_int, check_range, check_settings, field_name, setting
from ..errors import NascompressError, SettingError
from ..hooks import TrainHooks
from ..layers import DEFAULT_ALIGN, NCAttention, NCBlock, core_attention, to_core
from . import Method, TrainOverrides, register_method
from .mgvit_ops import (
    HEAD_SPLIT,
    MIDDLE_SPLIT,
    casr_update,
    gather_tokens,
    mgis_token_schedule,
    num_mgis_tokens,
    patchify,
    ppsm,
    ppsm_macs,
    resample_grid,
    split_groups,
    subpatch_index,
)
from .mgvit_ops import resample_image as _resample
from ..models import is_pyramid
from ..weights import load_state_strict
from ..runs.io import load_typed
from ..profiling.flops import count_flops

PAPER_PPSM_LAYERS, PAPER_DEPTH = (3, 7, 10), 12
INIT_STD = 1e-3


def default_ppsm_layers(depth: int) -> list[int]:
    """The paper's PPSM layers 3, 7, 10 of 12 scaled to ``depth`` (1-based, at least layer 2)."""
    if depth < 2:
        return []
    return sorted({min(depth, max(2, round(layer * depth / PAPER_DEPTH))) for layer in PAPER_PPSM_LAYERS})


def default_feat_dim(dim: int, heads: int, align: int = 1) -> int:
    """C' = C / 8 rounded up so that the MGIS width C + C' splits into the heads and every width it
    makes is a multiple of ``align``: C' itself and, where C allows it, the MGIS head dim (C + C') / H.

    The paper does not state C'; with C' = C / 8 = 48 on DeiT-S the FLOP count of MG-ViT at
    epsilon = 1 is 3.94 G, the paper's 3.9 G (Table 2); C / 4 would give 4.58 G. ``align=1`` gives
    the smallest multiple of the head count >= C / 8 (what MG-ViT used before alignment existed).
    """
    lo = max(1, math.ceil(dim / 8))

    def ok(c: int, head_dim_too: bool) -> bool:
        return c % align == 0 and (dim + c) % heads == 0 and (not head_dim_too or ((dim + c) // heads) % align == 0)

    for head_dim_too in (True, False):  # an aligned MGIS head dim where C allows one, else C' alone
        c = next((c for c in range(lo, lo + heads * align * align + 1) if ok(c, head_dim_too)), None)
        if c is not None:
            return c
    return heads * math.ceil(dim / 8 / heads)


@dataclass(frozen=True)
class MGViTConfig(Config):
    """MG-ViT settings (recorded in arch.json; defaults are the paper's).

    Args:
        r_h / r_t: shares of the coarse patches split 3x3 (head) / kept coarse (tail).
        r_pos / r_neg: PPSM's positive (kept) / negative (merged) shares.
        ppsm_layers: 1-based MGIS layers with a PPSM before their attention (default 3, 7, 10 of 12 scaled).
        epsilon: early-exit threshold on SGIS's top softmax probability (1: always MGIS).
        feat_dim: C', the feature-reuse width (default C / 8 rounded up to the heads and ``align``).
        align: C' (and, where the width allows, the MGIS head dim) is a multiple of this (1: C / 8
            rounded to the heads only, as before alignment existed).
        grid: the coarse grid side (7: 7 x 7 patches).
        lam / casr_start: CASR's decay and first layer.
    """

    r_h: float = setting(0.1, lo=0, hi=1, help="MG-ViT head ratio r_h (coarse patches split 3x3).")
    r_t: float = setting(0.4, lo=0, hi=1, help="MG-ViT tail ratio r_t (coarse patches kept coarse).")
    r_pos: float = setting(0.5, lo=0, hi=1, help="MG-ViT PPSM positive ratio r_pos.")
    r_neg: float = setting(0.1, lo=0, hi=1, help="MG-ViT PPSM negative ratio r_neg.")
    ppsm_layers: tuple[int, ...] | None = setting(
        None, help=("MG-ViT PPSM layers, 1-based (default scaled from 3,7,10 of 12).")
    )
    epsilon: float = setting(1.0, lo=0, hi=1, lo_open=True, help="MG-ViT early-exit threshold in (0, 1].")
    feat_dim: int | None = None
    align: int = setting(
        DEFAULT_ALIGN,
        lo=1,
        help=("Round every width a method makes up to a multiple of this (8: GPU-friendly; 1: off)."),
    )
    grid: int = 7
    lam: float = 0.98
    casr_start: int = 3

    def __post_init__(self) -> None:
        check_settings(self, name=field_name)  # every setting() against its declaration; below: the rest
        check_range("lam", self.lam, 0, 1)
        if self.r_h + self.r_t > 1:
            raise NascompressError(
                f"r_h + r_t must be at most 1, got r_h={self.r_h} + r_t={self.r_t} = {self.r_h + self.r_t:g}"
            )
        if self.r_pos + self.r_neg > 1:
            raise NascompressError(
                f"r_pos + r_neg must be at most 1, got r_pos={self.r_pos} + r_neg={self.r_neg} = "
                f"{self.r_pos + self.r_neg:g}"
            )
        check_int("grid", self.grid, 1)
        check_int("casr_start", self.casr_start, 1)
        if self.feat_dim is not None:
            check_int("feat_dim", self.feat_dim, 1)


@dataclass(frozen=True)
class MGViTRecipe(Config):
    """MG-ViT training: epsilon = 1, CE(MGIS) + KL(SGIS || MGIS).

    Args:
        sgis_run: start the SGIS from another dense run of the same width, depth and patch size
            (its position grid resampled); the MGIS starts from the run being compressed.
    """

    sgis_run: str | None = None


def resolve_config(cfg: MGViTConfig, model: VisionTransformer) -> MGViTConfig:
    """``cfg`` checked against ``model``, model-dependent defaults filled in."""
    depth, dim, heads = len(model.blocks), model.embed_dim, model.blocks[0].attn.num_heads
    layers = (
        default_ppsm_layers(depth)
        if cfg.ppsm_layers is None
        else [cfg.ppsm_layers]
        if isinstance(cfg.ppsm_layers, int)
        else list(cfg.ppsm_layers)
    )  # one layer: 5 or [5]
    for layer in layers:
        if not isinstance(layer, int) or not 2 <= layer <= depth:
            raise NascompressError(
                f"PPSM layer {layer!r} is outside the depth: layers are 1-based and must be in "
                f"2..{depth} (PPSM needs the class attention of an earlier layer)"
            )
    fd = default_feat_dim(dim, heads, cfg.align) if cfg.feat_dim is None else cfg.feat_dim
    if (dim + fd) % heads:
        raise NascompressError(
            f"feat_dim (C') must be a positive int with C + C' = {dim} + C' divisible by the {heads} heads, got {fd!r}"
        )
    img = model.patch_embed.img_size
    if img[0] != img[1] or img[0] % cfg.grid:
        raise SettingError(
            f"image size {img[0]}x{img[1]} is not divisible by the coarse grid {cfg.grid}; "
            f"pick a grid that divides {img[0]} (e.g. {{opt}} grid=7 for 28 or 224)"
        )
    return cfg.replace(ppsm_layers=tuple(sorted(set(layers))), feat_dim=fd)


def _recording(attn: NCAttention, on: bool) -> None:
    """CASR reads the class-token attention row each layer computes (O(N d), fused SDPA kept)."""
    attn.record_cls = on


class PPSM(nn.Module):
    """The slimming module as a (parameter-free) module so the FLOP counter sees its work.
    ``merge_scatter``: :func:`~nascompress.methods.mgvit_ops.match_merge`'s form (export swaps in False)."""

    merge_scatter = True

    def __init__(self, r_pos: float, r_neg: float):
        super().__init__()
        self.r_pos, self.r_neg = r_pos, r_neg

    def forward(self, x: torch.Tensor, score: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, n, D) patch tokens, score (B, n), values (B, n, D) -> slimmed tokens and scores."""
        return ppsm(x, score, values, self.r_pos, self.r_neg, scatter=self.merge_scatter)

    def matmul_macs(self, inputs: tuple, output: Any) -> float:
        x = inputs[0]
        return ppsm_macs(x.shape[0], x.shape[1], x.shape[2], self.r_pos, self.r_neg)


class MGIS(nn.Module):
    """The multi-granularity stage: its own patch embedding, position grid, feature reuse and ViT."""

    def __init__(
        self,
        *,
        in_chans: int,
        patch: int,
        dim: int,
        extra: int,
        depth: int,
        heads: int,
        mlp_ratio: float,
        qkv_bias: bool,
        num_classes: int,
        pos_grid: int,
        ln_eps: float,
        ppsm_layers: list[int],
        r_pos: float,
        r_neg: float,
    ):
        super().__init__()
        norm = partial(nn.LayerNorm, eps=ln_eps)
        self.proj = nn.Conv2d(in_chans, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim + extra))
        self.pos_embed = nn.Parameter(torch.randn(1, pos_grid * pos_grid, dim) * 0.02)
        self.reuse_norm = norm(dim)
        self.reuse = Mlp(dim, hidden_features=dim, out_features=extra)
        self.blocks = nn.ModuleList(
            Block(dim + extra, heads, mlp_ratio, qkv_bias=qkv_bias, norm_layer=norm) for _ in range(depth)
        )
        for layer, b in enumerate(self.blocks, 1):
            b.__class__ = NCBlock
            core_attention(b.attn)
            b.attn.record_cls = True
            b.attn.record_values = (layer + 1) in ppsm_layers  # PPSM merges by the previous layer's values
        self.ppsm = nn.ModuleDict({str(layer): PPSM(r_pos, r_neg) for layer in ppsm_layers})
        self.norm = norm(dim + extra)
        self.head = nn.Linear(dim + extra, num_classes)


class MGViT(VisionTransformer):
    """A timm VisionTransformer (the SGIS) with an MGIS stage and early exit. See the module doc."""

    mg: dict[str, Any]
    compile_note = (
        "MG-ViT is timed eager only: its early exit sends a data-dependent subset of the batch "
        "through the MGIS stage, so its shapes change with the input (no static graph)"
    )

    def _sgis(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, C, H, W) -> SGIS logits (B, classes), output patch tokens (B, N, C), CASR (B, N)."""
        g, P, pg = self.mg["grid"], self.patch_embed.patch_size[0], self.patch_embed.grid_size[0]
        t = self.patch_embed.norm(self.patch_embed.proj(_resample(x, g * P)).flatten(2).transpose(1, 2))
        pos = self.pos_embed
        t = torch.cat(
            [(self.cls_token + pos[:, :1]).expand(t.shape[0], -1, -1), t + resample_grid(pos[:, 1:], pg, g)], 1
        )
        t = self.norm_pre(self.pos_drop(t))
        casr = None
        for layer, blk in enumerate(self.blocks, 1):
            t = blk(t)
            if blk.attn.record_cls:
                casr = casr_update(
                    casr,
                    blk.attn.cls_attention()[:, :, 1:].mean(1),
                    layer=layer,
                    start=self.mg["casr_start"],
                    lam=self.mg["lam"],
                )
        t = self.norm(t)
        return self.forward_head(t), t[:, 1:], casr

    def _mgis(self, x: torch.Tensor, s_tokens: torch.Tensor, casr: torch.Tensor) -> torch.Tensor:
        """MGIS logits (B, classes) from the images, SGIS output patch tokens and SGIS CASR."""
        m, mg = self.mgis, self.mg
        g, P, pg = mg["grid"], self.patch_embed.patch_size[0], self.patch_embed.grid_size[0]
        B = x.shape[0]
        groups = split_groups(casr, mg["r_h"], mg["r_t"])
        pix, pos = [], []
        for idx, s in zip(groups, (HEAD_SPLIT, MIDDLE_SPLIT, 1)):
            if idx.shape[1] == 0:
                continue
            sub = subpatch_index(idx, g, s)
            patches = patchify(_resample(x, s * g * P), P).flatten(2)  # (B, (s g)^2, Cin P P)
            pix.append(gather_tokens(patches, sub))
            pos.append(gather_tokens(resample_grid(m.pos_embed, pg, s * g).expand(B, -1, -1), sub))
        pix = torch.cat(pix, 1)
        K = pix.shape[1]
        emb = m.proj(pix.reshape(B * K, -1, P, P)).reshape(B, K, -1) + torch.cat(pos, 1)
        head, mid, tail = groups
        fr = m.reuse(m.reuse_norm(gather_tokens(s_tokens, torch.cat([head, mid], 1))))
        n_h = head.shape[1]
        fr = torch.cat(
            [
                fr[:, :n_h].repeat_interleave(HEAD_SPLIT**2, 1),
                fr[:, n_h:].repeat_interleave(MIDDLE_SPLIT**2, 1),
                fr.new_zeros(B, tail.shape[1], fr.shape[-1]),
            ],
            1,
        )
        t = torch.cat([m.cls_token.expand(B, -1, -1), torch.cat([emb, fr], -1)], 1)
        score = values = None
        for layer, blk in enumerate(m.blocks, 1):
            if str(layer) in m.ppsm:
                patches, score = m.ppsm[str(layer)](t[:, 1:], score, values[:, 1:])
                t = torch.cat([t[:, :1], patches], 1)
            t = blk(t)
            if str(layer + 1) in m.ppsm:
                values = blk.attn.values.transpose(1, 2).flatten(2)  # (B, N, H * hd)
            score = casr_update(
                score, blk.attn.cls_attention()[:, :, 1:].mean(1), layer=layer, start=mg["casr_start"], lam=mg["lam"]
            )
        return m.head(m.norm(t)[:, 0])

    def forward_both(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(SGIS logits, MGIS logits) for every image (epsilon = 1, as in training)."""
        s_logits, s_tokens, casr = self._sgis(x)
        return s_logits, self._mgis(x, s_tokens, casr)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, classes): SGIS, then MGIS for the images whose top probability <= epsilon.

        In training mode every image goes through MGIS (epsilon = 1) and MGIS logits are returned.
        """
        if self.training:
            return self.forward_both(x)[1]
        s_logits, s_tokens, casr = self._sgis(x)
        force = getattr(self, "_mg_force", None)
        if force is None:
            stay = s_logits.softmax(-1).amax(-1) <= self.mg["epsilon"]
        else:
            stay = torch.full_like(s_logits[:, 0], force == "mgis", dtype=torch.bool)
        idx = stay.nonzero().squeeze(1)
        out = s_logits.clone()
        if idx.numel():
            out[idx] = self._mgis(x[idx], s_tokens[idx], casr[idx]).to(out.dtype)
        if force is None:
            st = self.__dict__.setdefault("_mg_stats", {"n": 0, "exit": 0})
            st["n"] += x.shape[0]
            st["exit"] += x.shape[0] - idx.numel()
        return out

    # ---- statistics for evaluate -----------------------------------------------------------
    def stage_flops(self) -> dict[str, float]:
        """Per-image MACs of SGIS alone and of SGIS + MGIS (token counts are input independent)."""
        cache = self.__dict__.get("_mg_flops")
        if cache is None:
            p = next(self.parameters())
            x = torch.randn(
                1, self.patch_embed.proj.in_channels, *self.patch_embed.img_size, device=p.device, dtype=p.dtype
            )
            cache = {}
            for mode in ("sgis", "mgis"):
                self._mg_force = mode
                try:
                    cache[mode] = count_flops(self, x).total
                finally:
                    self._mg_force = None
            cache = {
                "sgis_flops": cache["sgis"],
                "mgis_flops": cache["mgis"] - cache["sgis"],
                "ppsm_flops": self.ppsm_flops(),
            }
            self.__dict__["_mg_flops"] = cache
        return dict(cache)

    def ppsm_flops(self) -> float:
        """Per-image MACs of the PPSM modules (similarity matmul and merges)."""
        mg = self.mg
        n = num_mgis_tokens(mg["grid"] ** 2, mg["r_h"], mg["r_t"])
        sched = mgis_token_schedule(n, len(self.mgis.blocks), mg["ppsm_layers"], mg["r_pos"], mg["r_neg"])
        dim = self.mgis.cls_token.shape[-1]
        ins = [n] + [s - 1 for s in sched]  # patch tokens entering layer l is sched[l-2]-1 (layer 1: n)
        return sum(ppsm_macs(1, ins[layer - 1], dim, mg["r_pos"], mg["r_neg"]) for layer in mg["ppsm_layers"])

    def reset_inference_stats(self) -> None:
        self.__dict__["_mg_stats"] = {"n": 0, "exit": 0}

    def inference_stats(self) -> dict[str, float]:
        """Share of images that exited at SGIS since the last reset, and the mean MACs per image."""
        st = self.__dict__.get("_mg_stats", {"n": 0, "exit": 0})
        share = st["exit"] / max(st["n"], 1)
        f = self.stage_flops()
        mean = f["sgis_flops"] + (1 - share) * f["mgis_flops"]
        return {"epsilon": self.mg["epsilon"], "exit_share": share, "mean_flops": mean, "mean_gflops": mean / 1e9, **f}


def _check_plain_vit(model: nn.Module) -> None:
    if is_pyramid(model):
        raise SettingError(
            f"mgvit needs a plain timm ViT, but this run holds a pyramid ViT "
            f"({type(model).__name__}); use {{method}} mgvit-h (Hierarchical MG-ViT) for it"
        )
    if not isinstance(model, VisionTransformer):
        raise NascompressError(f"mgvit needs a timm VisionTransformer (vit_*, deit_*), got {type(model).__name__}")
    reasons = []
    if model.cls_token is None or model.global_pool != "token":
        reasons.append(
            f"it needs a class token read by the head (class_token={model.cls_token is not None}, "
            f"global_pool={model.global_pool!r})"
        )
    if model.num_prefix_tokens != 1:
        reasons.append(
            f"it needs exactly one prefix token, this model has {model.num_prefix_tokens} (register or "
            "distillation tokens)"
        )
    if model.no_embed_class or model.pos_embed is None:
        reasons.append("it needs a position embedding that includes the class token")
    if not (isinstance(model.norm_pre, nn.Identity) and isinstance(model.fc_norm, nn.Identity)):
        reasons.append("it needs no pre-norm and no fc_norm")
    if not all(isinstance(b.attn.q_norm, nn.Identity) and isinstance(b.attn.norm, nn.Identity) for b in model.blocks):
        reasons.append("it does not support qk-norm or scale-norm attention")
    if not (
        model.patch_embed.patch_size[0] == model.patch_embed.patch_size[1]
        and model.patch_embed.grid_size[0] == model.patch_embed.grid_size[1]
    ):
        reasons.append("it needs square patches and a square grid")
    if reasons:
        raise NascompressError("mgvit supports plain timm ViTs only: " + "; ".join(reasons))
    to_core(model, method="mgvit")


def _build(model: VisionTransformer, c: MGViTConfig) -> "MGViT":
    """Turn a dense timm ViT into an :class:`MGViT` (random MGIS init)."""
    blk = model.blocks[0]
    dim, heads = model.embed_dim, blk.attn.num_heads
    for layer, b in enumerate(model.blocks, 1):
        _recording(b.attn, layer >= min(c.casr_start, len(model.blocks)))
    model.mgis = MGIS(
        in_chans=model.patch_embed.proj.in_channels,
        patch=model.patch_embed.patch_size[0],
        dim=dim,
        extra=c.feat_dim,
        depth=len(model.blocks),
        heads=heads,
        mlp_ratio=blk.mlp.fc1.out_features / dim,
        qkv_bias=blk.attn.qkv.bias is not None,
        num_classes=model.num_classes,
        pos_grid=model.patch_embed.grid_size[0],
        ln_eps=getattr(model.norm, "eps", 1e-6),
        ppsm_layers=list(c.ppsm_layers),
        r_pos=c.r_pos,
        r_neg=c.r_neg,
    ).to(model.pos_embed.device)
    model.__class__ = MGViT
    model.mg = c.to_dict()
    return model


@register_method
class MGViTMethod(Method):
    name = "mgvit"
    summary = "two-stage multi-granularity inference with early exit and PPSM (seed 004)"
    config_cls = MGViTConfig
    recipe_cls = MGViTRecipe
    train_overrides = TrainOverrides(base_lr=5e-4, warmup_epochs=0.2, epochs=2)
    stacks_on = frozenset()  # it replaces the model class and widens every block: alone only
    off_config = None
    paper_config = {}

    def resolve(self, model: nn.Module, cfg: MGViTConfig) -> MGViTConfig:
        _check_plain_vit(model)
        return resolve_config(cfg, model)

    def patch(self, model: nn.Module, cfg: MGViTConfig, record: dict[str, Any]) -> nn.Module:
        return _build(model, cfg)

    def prepare(self, model: nn.Module, cfg: MGViTConfig, recipe: MGViTRecipe | None):
        """Both stages start from the dense run, or the SGIS from ``recipe.sgis_run``."""
        if cfg.feat_dim % cfg.align:  # a new model only: records written before align existed still load
            raise NascompressError(
                f"feat_dim (C') {cfg.feat_dim} is not a multiple of align {cfg.align}; give an "
                f"aligned feat_dim, leave it out (the default is aligned) or set align=1"
            )
        recipe = recipe or MGViTRecipe()
        source = None  # MGIS starts from the run's dense weights: the SGIS's own unless sgis_run replaces them
        if recipe.sgis_run is not None:
            source = copy.deepcopy(model)
            load_sgis_from_run(model, recipe.sgis_run)
        record = self.make_record(cfg, recipe)
        model = _build(model, cfg)
        init_mgis_from_dense(model, source=source)
        n = num_mgis_tokens(cfg.grid**2, cfg.r_h, cfg.r_t)
        sched = mgis_token_schedule(n, len(model.blocks), list(cfg.ppsm_layers), cfg.r_pos, cfg.r_neg)
        record.update(mgis_patch_tokens=n, mgis_tokens_per_layer=sched, width=model.embed_dim + cfg.feat_dim)
        return model, record

    def hooks(self, model, record, *, teacher, train_cfg):
        return MGViTHooks()


@torch.no_grad()
def _widen(
    new: nn.Module, old: nn.Module, out_idx: torch.Tensor | None, in_idx: torch.Tensor | None, scale: float = 1.0
) -> None:
    """Copy ``old``'s weight into rows ``out_idx`` x columns ``in_idx`` of ``new``; other entries small/zero."""
    if isinstance(new, nn.LayerNorm):
        new.weight.fill_(1.0)
        new.bias.zero_()
        new.weight[out_idx] = old.weight
        new.bias[out_idx] = old.bias
        return
    new.weight.normal_(0.0, INIT_STD)
    new.weight[out_idx[:, None], in_idx[None, :]] = old.weight * scale
    if new.bias is not None:
        new.bias.zero_()
        if old.bias is not None:
            new.bias[out_idx] = old.bias * scale


def load_sgis_from_run(model: VisionTransformer, run: str | Path) -> None:
    """Load the dense weights of another nascompress run of the same width and depth into ``model``
    (the future SGIS); its position embedding is resampled to ``model``'s grid, as timm does.

    E.g. a 28 px Fashion-MNIST run as the SGIS of an MG-ViT built on a 56 px run: the 7x7 coarse
    grid of the 56 px image is then exactly what that run was trained on.
    """
    if not Path(run).exists():
        raise NascompressError(f"sgis_run {run} does not exist; give a dense run directory made by `nascompress train`")
    other, arch = load_typed(run)
    if arch.methods:
        names = list(arch.method_names)
        raise NascompressError(
            f"sgis_run {run} is not a dense run (it applies {names}); pass a run made by `nascompress train`"
        )
    if (
        not isinstance(other, VisionTransformer)
        or other.embed_dim != model.embed_dim
        or len(other.blocks) != len(model.blocks)
        or other.patch_embed.patch_size != model.patch_embed.patch_size
    ):
        raise NascompressError(
            f"sgis_run {run} does not match the model: it needs the same width, depth and patch size "
            f"(got width {getattr(other, 'embed_dim', '?')}, depth {len(getattr(other, 'blocks', []))})"
        )
    sd = checkpoint_filter_fn(other.state_dict(), model)
    load_state_strict(model, sd, source=f"sgis_run {run}")


@torch.no_grad()
def init_mgis_from_dense(model: MGViT, source: VisionTransformer | None = None) -> None:
    """Initialise MGIS from dense weights (``source``, default the SGIS) as the module docstring describes."""
    src = model if source is None else source
    m, C, X = model.mgis, model.embed_dim, model.mg["feat_dim"]
    H = src.blocks[0].attn.num_heads
    hd_o, hd_n = C // H, (C + X) // H
    chan = torch.arange(C)
    amap = (torch.arange(H)[:, None] * hd_n + torch.arange(hd_o)[None]).flatten()
    qscale = math.sqrt(hd_n / hd_o)
    m.proj.load_state_dict(src.patch_embed.proj.state_dict())
    m.pos_embed.copy_(src.pos_embed[:, 1:])
    m.cls_token.zero_()
    m.cls_token[..., :C] = src.cls_token + src.pos_embed[:, :1]
    for nb, ob in zip(m.blocks, src.blocks):
        _widen(nb.norm1, ob.norm1, chan, None)
        _widen(nb.norm2, ob.norm2, chan, None)
        qkv_out = torch.cat([j * (C + X) + amap for j in range(3)])
        _widen(nb.attn.qkv, ob.attn.qkv, qkv_out, chan)
        nb.attn.qkv.weight[amap] *= qscale
        if nb.attn.qkv.bias is not None:
            nb.attn.qkv.bias[amap] *= qscale
        _widen(nb.attn.proj, ob.attn.proj, chan, amap)
        hid = torch.arange(ob.mlp.fc1.out_features)
        _widen(nb.mlp.fc1, ob.mlp.fc1, hid, chan)
        _widen(nb.mlp.fc2, ob.mlp.fc2, chan, hid)
        for ls, lin in ((ob.ls1, nb.attn.proj), (ob.ls2, nb.mlp.fc2)):  # fold timm LayerScale into the copy
            if hasattr(ls, "gamma"):
                lin.weight[chan] *= ls.gamma[:, None]
                if lin.bias is not None:
                    lin.bias[chan] *= ls.gamma
    _widen(m.norm, src.norm, chan, None)
    _widen(m.head, src.head, torch.arange(src.num_classes), chan)


class MGViTHooks(TrainHooks):
    """Loss = CE(D^M, y) + KL(D^M || D^S), every image through both stages (epsilon = 1)."""

    def loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epoch: int, cfg: Any, tag: Any = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        s_logits, m_logits = model.forward_both(x)
        ce = F.cross_entropy(m_logits, y, label_smoothing=cfg.label_smoothing)
        kl = F.kl_div(
            s_logits.log_softmax(-1), m_logits.detach().log_softmax(-1), log_target=True, reduction="batchmean"
        )
        return ce + kl, {"ce_mgis": ce.detach(), "kl_sgis": kl.detach()}


@torch.no_grad()
def sweep_model(model: MGViT, batches: Any, *, epsilons: list[float]) -> dict[str, Any]:
    """Accuracy / SGIS-exit share / mean MACs per image for each epsilon, from one pass over the
    preprocessed ``batches`` (x, y) (SGIS and MGIS run on every image once; each epsilon then
    picks per image)."""
    for e in epsilons:
        check_range("epsilon", e, 0, 1, lo_open=True)
    model.eval()
    device = next(model.parameters()).device
    eps = torch.tensor(epsilons, device=device)[:, None]
    correct = torch.zeros(len(epsilons), device=device)
    exits = torch.zeros(len(epsilons), device=device)
    s_ok = m_ok = n = 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        s, mm = model.forward_both(x)
        conf, sp, mp = s.softmax(-1).amax(-1), s.argmax(-1), mm.argmax(-1)
        ex = conf[None] > eps  # (E, B)
        correct += torch.where(ex, sp[None], mp[None]).eq(y[None]).sum(1)
        exits += ex.sum(1)
        s_ok += (sp == y).sum().item()
        m_ok += (mp == y).sum().item()
        n += len(y)
    f = model.stage_flops()
    rows = []
    for i, e in enumerate(epsilons):
        share = exits[i].item() / max(n, 1)
        if hasattr(model, "mean_flops"):  # mgvit-h: at epsilon 1 no SGIS runs
            mean = model.mean_flops(share, e)
        else:
            mean = f["sgis_flops"] + (1 - share) * f["mgis_flops"]
        rows.append(
            {
                "epsilon": e,
                "top1": 100.0 * correct[i].item() / max(n, 1),
                "exit_share": share,
                "mean_flops": mean,
                "mean_gflops": mean / 1e9,
            }
        )
    return {"rows": rows, "n": n, "sgis_top1": 100.0 * s_ok / max(n, 1), "mgis_top1": 100.0 * m_ok / max(n, 1), **f}


def parse_epsilons(text: str) -> list[float]:
    """'0.5,0.7,1' -> [0.5, 0.7, 1.0]; each must be in (0, 1]."""
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SettingError(f"{{epsilon}} must be comma-separated numbers in (0, 1], got {text!r}") from None
    if not vals:
        raise SettingError("{epsilon} needs at least one value, e.g. {epsilon} 0.5,0.7,0.9,1")
    for e in vals:
        check_range("epsilon", e, 0, 1, lo_open=True)
    return vals


__all__ = [
    "MGViTMethod",
    "MGViTConfig",
    "MGViTRecipe",
    "MGViT",
    "MGIS",
    "PPSM",
    "MGViTHooks",
    "init_mgis_from_dense",
    "load_sgis_from_run",
    "sweep_model",
    "parse_epsilons",
    "default_ppsm_layers",
    "default_feat_dim",
]
