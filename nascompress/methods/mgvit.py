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

The modules are :mod:`.mgvit_modules`'s and the initialisation :mod:`.mgvit_init`'s (re-exported here).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..config import Config, check_int, check_range, check_settings, field_name, setting
from ..errors import NascompressError, SettingError
from ..train.hooks import TrainHooks
from ..models.layers import DEFAULT_ALIGN, NCAttention, to_core
from . import Method, TrainOverrides, register_method
from .mgvit_ops import mgis_token_schedule, num_mgis_tokens
from ..models.build import is_pyramid
from ..profiling.records import EpsilonSweep
from .mgvit_init import init_mgis_from_dense, load_sgis_from_run
from .mgvit_modules import MGIS, MGViT

PAPER_PPSM_LAYERS, PAPER_DEPTH = (3, 7, 10), 12


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
    token_stage = True
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
def sweep_model(model: MGViT, batches: Any, *, epsilons: list[float]) -> EpsilonSweep:
    """Accuracy / SGIS-exit share / mean MACs per image for each epsilon, from one pass over the
    preprocessed ``batches`` (x, y) (SGIS and MGIS run on every image once; each epsilon then
    picks per image): a :class:`~nascompress.profiling.records.SweepRow` per epsilon, the images,
    SGIS's and MGIS's own top-1 and the stages' MACs (its ``split`` and ``dataset`` unset)."""
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
    return EpsilonSweep.new(rows=rows, n=n, sgis_top1=100.0 * s_ok / max(n, 1), mgis_top1=100.0 * m_ok / max(n, 1), **f)


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
    "MGViTHooks",
    "sweep_model",
    "parse_epsilons",
    "default_ppsm_layers",
    "default_feat_dim",
]
