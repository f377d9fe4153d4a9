"""Hierarchical MG-ViT (seed 004, sections 4.1-4.3, appendix 7.1-7.2) on timm's PVT v2 (b0..b5).

A dense :class:`~timm.models.pvt_v2.PyramidVisionTransformerV2` becomes an :class:`MGPVT` (its
``__class__`` swapped, its state-dict keys kept) with one new "MG Transformer" layer (``mg_layer``,
Table 6: H_MG heads, MLP ratio E_MG) that refines the head and middle patches with proxy tokens:

* **Coarse grid.** PVT v2's spatial-reduction attention reduces the keys of every stage to the same
  grid, the image in 32 px cells (stride 4 x reduction 8 in stage 1, 8 x 4, 16 x 2, 32 x 1): at
  224 px this is the paper's 7 x 7 grid of 32 px patches. These cells are the coarse patches; the
  image side must be a multiple of 32 (``stride x sr_ratio`` of stage 1).
* **Ranking (the CASR of a model without class token).** A PVT classifies the *mean* of its last
  tokens, so the class-attention row of a ViT has an exact counterpart: the mean over queries (and
  heads) of an attention matrix, ``a_j = mean_i A_ij``, is the weight with which key j enters the
  mean-pooled output of the layer (``mean_i sum_j A_ij v_j = sum_j a_j v_j``), as ``A_cls,j`` is the
  weight of token j in a ViT's class token. Stage 1's keys are the coarse cells, so ``a`` ranks them
  directly; it is accumulated over the stage-1 layers before the MG layer with CASR's recursion
  (``lam`` 0.98 from layer ``casr_start``, Eq. 6). The ranking is read in the MG pass's own stage 1,
  before the MG layer, so dense outputs (which run no SGIS) have it at no extra cost.
* **Sub-splitting.** ``N_h = floor(N r_h + 0.5)`` head cells, ``N_t`` tail cells (Eq. 7); every
  stage-1 token of a head cell is split 3 x 3, of a middle cell 2 x 2, tail cells stay. The fine
  / medium tokens come from the dense model's own overlapping patch embedding (same weights and
  norm) run on the image resampled 3x / 2x, only on the selected cells (a crop per cell), plus a
  learned sub-position embedding (9 and 4 vectors, zero at init).
* **Proxy tokens (Eq. 16/17).** Each split stage-1 token is its group's proxy: the group
  ``[fine tokens, proxy]`` passes through the MG layer (attention inside the group, then the MLP),
  and the proxy's output replaces the token, ``T' = (1 - m) T_ori + m T'_pro`` with ``m`` = 1 on
  head and middle cells. Only the proxy's output is read afterwards, so only its query and its MLP
  are computed (the fine tokens' outputs would be discarded: the same result, fewer FLOPs).
  The layer sits at the end of stage 1, before its norm, so the stage-1 map (H/4) already holds the
  refinement and stages 2-4 see the dense model's regular grid: the feature maps have the dense
  model's shapes (``forward_features`` / ``forward_intermediates``, timm's NCHW conventions).
* **Variants.** ``a`` adds the MG layer after stage 1's layers; its output projections start at
  zero, so at init -A computes exactly the dense model. ``r`` replaces stage 1's last layer with it
  (same capacity; the MG layer starts from that layer's weights, without its depth-wise conv and
  spatial reduction, which a group of tokens has no grid for).
* **SGIS and early exit (classification).** The SGIS is the same network without the MG layer on
  the image resampled by ``sgis_scale`` (default 1/2: a quarter of the tokens, the paper's "fewer
  patches"); an image whose top SGIS probability exceeds ``epsilon`` exits with the SGIS logits,
  the others run the MG pass. With ``epsilon`` = 1 no image can exit and the SGIS is skipped.
  Dense outputs never exit. Training: every image through both, ``CE(D^M, y) + KL(D^M || D^S)``
  (MG-ViT's loss; the SGIS shares the weights, so it is the same network trained at two scales).
  The recipe's ``kl_weight`` scales the KL term; 0 trains the MG pass alone (no SGIS pass), for a
  model used without early exit.

* **PPSM inside the proxy groups (``r_pos`` / ``r_neg``; off by default: 1 / 0).** Plain MG-ViT's
  three-way decision slimming cannot merge the pyramid's stage-1 tokens (the later stages'
  downsampling and spatial reduction need the regular grid; Table 6 has no PPSM), but it can slim
  the only irregular token set there is: the finer tokens of each proxy's group, which serve the
  MG layer as keys and values only. The split (head and middle) cells, in ranking order, are cut
  as PPSM cuts its tokens (:func:`~nascompress.methods.mgvit_ops.ppsm_counts` of the split cells):
  the top ``r_pos`` share is *positive* (every group keeps its 9 / 4 finer tokens), the bottom
  ``r_neg`` share *negative* (each group's finer tokens are merged into one, their average), the
  rest *boundary* (each group's finer tokens are match-merged: in row-major order they alternate
  into sets A and B, each A token joins its most cosine-similar B token, 9 -> 4 and 4 -> 2 tokens).
  PPSM's rules, applied per group: a proxy attends only to its own patch's tokens (Eq. 16), so
  the negative tokens become one token per group rather than one per image, and the similarity is
  taken on the finer tokens themselves (they have no earlier layer whose values PPSM would use).
  Every proxy still stands for its stage-1 token, so the grid, the feature maps and Eq. 17 are
  unchanged; the saving is the MG layer's keys and values (norm, ``kv`` projection and attention
  over fewer tokens), the merges' cost is counted (the sub-token embeddings are computed in full).

Not carried over from plain MG-ViT: feature reuse by widening (the pyramid's widths must stay the
dense ones for its weights and its feature maps), and PPSM on the pyramid's own tokens (above).

The modules are :mod:`.mgvit_h_modules`'s (re-exported here).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.models.pvt_v2 import PyramidVisionTransformerV2
from torch import nn

from ..config import Config, check_int, check_range, check_settings, field_name, setting
from ..errors import NascompressError, SettingError
from . import Method, TrainOverrides, register_method
from ..train.hooks import TrainHooks
from .mgvit_ops import HEAD_SPLIT, MIDDLE_SPLIT, ppsm_counts, split_counts
from ..models.build import PYRAMID_NAMES
from .mgvit_h_modules import MGPVT, GroupSlim, MGLayer, RankingAttention, SubEmbed, group_domains, slimmed_tokens

PAPER_MG_HEADS = 8
VARIANTS = ("a", "r")


@dataclass(frozen=True)
class MGViTHConfig(Config):
    """Hierarchical MG-ViT settings (recorded in arch.json; defaults are the paper's).

    Args:
        variant: ``a`` (MG layer added after stage 1) or ``r`` (it replaces stage 1's last layer).
        r_h / r_t: shares of the coarse cells split 3x3 (head) / kept (tail).
        r_pos / r_neg: PPSM's positive / negative shares of the split cells, applied to the finer
            tokens of their proxy groups (module doc; 1 / 0: off).
        epsilon: early-exit threshold on SGIS's top softmax probability (1: no exit, no SGIS pass).
        mg_heads: H_MG, the MG layer's heads (default 8, the paper's, or the largest divisor of
            stage 1's width below it).
        mg_mlp_ratio: E_MG (default stage 1's MLP ratio: 8 for b0..b4, the paper's).
        sgis_scale: the SGIS's image size relative to the model's (rounded down to whole 32 px
            cells, at least one).
        lam / casr_start: CASR's decay and first layer (of stage 1).
    """

    variant: str = setting(
        "a",
        choices=VARIANTS,
        help=("Hierarchical MG-ViT variant: a (MG layer added after stage 1) or r (replaces stage 1's last layer)."),
    )
    r_h: float = setting(0.1, lo=0, hi=1, help="MG-ViT head ratio r_h (coarse patches split 3x3).")
    r_t: float = setting(0.4, lo=0, hi=1, help="MG-ViT tail ratio r_t (coarse patches kept coarse).")
    epsilon: float = setting(1.0, lo=0, hi=1, lo_open=True, help="MG-ViT early-exit threshold in (0, 1].")
    r_pos: float = setting(
        1.0,
        lo=0,
        hi=1,
        help=("mgvit-h: PPSM positive share of the split cells (their proxy groups keep every finer token)."),
    )
    r_neg: float = setting(
        0.0,
        lo=0,
        hi=1,
        help=("mgvit-h: PPSM negative share of the split cells (each proxy group's finer tokens merged into one)."),
    )
    mg_heads: int | None = None
    mg_mlp_ratio: float | None = None
    sgis_scale: float = 0.5
    lam: float = 0.98
    casr_start: int = 3

    def __post_init__(self) -> None:
        check_settings(self, name=field_name)  # every setting() against its declaration; below: the rest
        check_range("lam", self.lam, 0, 1)
        for a, b in (("r_h", "r_t"), ("r_pos", "r_neg")):
            va, vb = getattr(self, a), getattr(self, b)
            if va + vb > 1:
                raise NascompressError(f"{a} + {b} must be at most 1, got {a}={va} + {b}={vb} = {va + vb:g}")
        check_range("sgis_scale", self.sgis_scale, 0, 1, lo_open=True)
        check_int("casr_start", self.casr_start, 1)
        if self.mg_heads is not None:
            check_int("mg_heads", self.mg_heads, 1)
        if self.mg_mlp_ratio is not None:
            check_range("mg_mlp_ratio", self.mg_mlp_ratio, 0, None, lo_open=True)


@dataclass(frozen=True)
class MGViTHRecipe(Config):
    """Hierarchical MG-ViT training: ``CE(MG pass) + kl_weight * KL(MG pass || SGIS)``.

    Args:
        kl_weight: weight of the SGIS's KL term (1: the paper's loss). The SGIS shares the network's
            weights, so this term also trains the full-size pass to serve the half-size image; 0 trains
            the MG pass alone (the SGIS is not run), for a model used without early exit (epsilon 1).
    """

    kl_weight: float = setting(
        1.0, lo=0, help=("mgvit-h: weight of the SGIS's KL term (1: the paper's loss; 0: train the MG pass alone).")
    )

    def __post_init__(self) -> None:
        check_settings(self, name=field_name)  # every setting() against its declaration


class MGViTHHooks(TrainHooks):
    """``CE(D^M, y) + kl_weight * KL(D^M || D^S)`` (MG-ViT's loss at weight 1); with ``kl_weight`` 0
    the SGIS is not run."""

    def __init__(self, kl_weight: float = 1.0):
        self.kl_weight = kl_weight

    def loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epoch: int, cfg: Any, tag: Any = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if self.kl_weight == 0:
            ce = F.cross_entropy(model(x), y, label_smoothing=cfg.label_smoothing)
            return ce, {"ce_mgis": ce.detach()}
        s_logits, m_logits = model.forward_both(x)
        ce = F.cross_entropy(m_logits, y, label_smoothing=cfg.label_smoothing)
        kl = F.kl_div(
            s_logits.log_softmax(-1), m_logits.detach().log_softmax(-1), log_target=True, reduction="batchmean"
        )
        return ce + self.kl_weight * kl, {"ce_mgis": ce.detach(), "kl_sgis": kl.detach()}


def _stage1_shape(model: PyramidVisionTransformerV2) -> tuple[int, int, int, int]:
    """(stem stride, stage-1 spatial reduction, stage-1 width, stage-1 depth)."""
    blk = model.stages[0].blocks[0]
    return model.patch_embed.proj.stride[0], blk.attn.sr.kernel_size[0], blk.attn.dim, len(model.stages[0].blocks)


def _check_pyramid(model: nn.Module) -> None:
    if not isinstance(model, PyramidVisionTransformerV2):
        raise SettingError(
            f"mgvit-h needs a pyramid ViT ({', '.join(PYRAMID_NAMES)}), got "
            f"{type(model).__name__}; use {{method}} mgvit for a plain ViT"
        )
    attn = model.stages[0].blocks[0].attn
    if attn.pool is not None or attn.sr is None:
        raise NascompressError(
            "mgvit-h needs spatial-reduction attention in stage 1 (pvt_v2_b0..b5); the linear "
            "variant pools its keys to a fixed grid, which has no coarse cells"
        )


def default_mg_heads(dim: int) -> int:
    """The paper's H_MG = 8, or the largest divisor of the stage-1 width below 8."""
    return max(h for h in range(1, PAPER_MG_HEADS + 1) if dim % h == 0)


def sgis_size(img: int, cell: int, scale: float) -> int:
    """The SGIS's image side: ``img * scale`` rounded down to whole coarse cells, at least one."""
    return max(1, math.floor(img * scale / cell + 1e-9)) * cell


def resolve_config(cfg: MGViTHConfig, model: PyramidVisionTransformerV2) -> MGViTHConfig:
    """``cfg`` checked against ``model``, model-dependent defaults filled in."""
    stride, sr, dim, depth = _stage1_shape(model)
    cell = stride * sr
    h, w = model.nc_img_size
    if h != w or h % cell:
        raise NascompressError(
            f"image size {h}x{w} cannot be split into mgvit-h's coarse grid of {cell} px cells "
            f"(stem stride {stride} x stage-1 spatial reduction {sr}): use a square image whose "
            f"side is a multiple of {cell} (e.g. {max(cell, h // cell * cell)})"
        )
    if cfg.variant == "r" and depth < 2:
        raise NascompressError(
            f"variant r replaces one of stage 1's {depth} layer(s) and needs one before the MG "
            "layer to rank the cells; use variant a"
        )
    heads = default_mg_heads(dim) if cfg.mg_heads is None else cfg.mg_heads
    if dim % heads:
        raise NascompressError(f"mg_heads {heads} does not divide stage 1's width {dim}")
    ratio = model.stages[0].blocks[0].mlp.fc1.out_features / dim if cfg.mg_mlp_ratio is None else cfg.mg_mlp_ratio
    return cfg.replace(mg_heads=heads, mg_mlp_ratio=float(ratio))


def _build(model: PyramidVisionTransformerV2, c: MGViTHConfig) -> MGPVT:
    """Turn a dense PVT v2 into an :class:`MGPVT` (the MG layer at its default init)."""
    stride, sr, dim, _ = _stage1_shape(model)
    blocks = model.stages[0].blocks
    if c.variant == "r":
        del blocks[len(blocks) - 1]
    for b in blocks:
        b.attn.__class__ = RankingAttention
    ref = blocks[0]
    dev = model.patch_embed.proj.weight.device
    model.mg_layer = MGLayer(
        dim, c.mg_heads, c.mg_mlp_ratio, qkv_bias=ref.attn.q.bias is not None, eps=getattr(ref.norm1, "eps", 1e-6)
    ).to(dev)
    model.mg_embed = SubEmbed()
    model.mg_slim = GroupSlim()
    model.mg_pos_head = nn.Parameter(torch.zeros(HEAD_SPLIT**2, dim, device=dev))
    model.mg_pos_middle = nn.Parameter(torch.zeros(MIDDLE_SPLIT**2, dim, device=dev))
    model.__class__ = MGPVT
    cell = stride * sr
    model.mg = dict(
        c.to_dict(),
        cell_tokens=sr,
        cell_px=cell,
        grid=model.nc_img_size[0] // cell,
        sgis_size=sgis_size(model.nc_img_size[0], cell, c.sgis_scale),
    )
    return model


@torch.no_grad()
def init_mg_layer(layer: MGLayer, block: nn.Module, *, zero_out: bool) -> None:
    """Start the MG layer from a stage-1 layer of the dense run: norms, q, kv, fc1 (and, with
    ``zero_out`` False, proj and fc2) copied; with ``zero_out`` the two output projections start at
    zero, so the proxy's output is the token itself (-A then computes the dense model)."""
    layer.norm1.load_state_dict(block.norm1.state_dict())
    layer.norm2.load_state_dict(block.norm2.state_dict())
    layer.q.load_state_dict(block.attn.q.state_dict())
    layer.kv.load_state_dict(block.attn.kv.state_dict())
    if layer.mlp.fc1.weight.shape == block.mlp.fc1.weight.shape:
        layer.mlp.fc1.load_state_dict(block.mlp.fc1.state_dict())
        if not zero_out:
            layer.mlp.fc2.load_state_dict(block.mlp.fc2.state_dict())
    if zero_out:
        for lin in (layer.proj, layer.mlp.fc2):
            lin.weight.zero_()
            lin.bias.zero_()
    else:
        layer.proj.load_state_dict(block.attn.proj.state_dict())


@register_method
class MGViTHMethod(Method):
    token_stage = True
    name = "mgvit-h"
    summary = "Hierarchical MG-ViT on a pyramid ViT (PVT v2): proxy tokens, variants a / r, early exit (seed 004)"
    config_cls = MGViTHConfig
    recipe_cls = MGViTHRecipe
    train_overrides = TrainOverrides(base_lr=5e-4, warmup_epochs=0.2, epochs=2)
    stacks_on = frozenset()
    model_kind = "pyramid"
    off_config = {"variant": "a", "r_h": 0.0, "r_t": 1.0, "epsilon": 1.0}
    paper_config = {}

    def resolve(self, model: nn.Module, cfg: MGViTHConfig) -> MGViTHConfig:
        _check_pyramid(model)
        return resolve_config(cfg, model)

    def patch(self, model: nn.Module, cfg: MGViTHConfig, record: dict[str, Any]) -> nn.Module:
        return _build(model, cfg)

    def prepare(self, model: nn.Module, cfg: MGViTHConfig, recipe: MGViTHRecipe | None):
        """From the dense run: its weights kept, the MG layer started from stage 1's last layer."""
        source = copy.deepcopy(model.stages[0].blocks[-1])
        record = self.make_record(cfg, recipe)
        model = _build(model, cfg)
        init_mg_layer(model.mg_layer, source, zero_out=cfg.variant == "a")
        n = model.mg["grid"] ** 2
        n_h, n_m, n_t = split_counts(n, cfg.r_h, cfg.r_t)
        r2 = model.mg["cell_tokens"] ** 2
        n_pos, n_b, n_neg = ppsm_counts(n_h + n_m, cfg.r_pos, cfg.r_neg)
        group = sum(
            (hi - lo) * (slimmed_tokens(s * s, dom) + 1)
            for first, k, s in ((0, n_h, HEAD_SPLIT), (n_h, n_m, MIDDLE_SPLIT))
            for lo, hi, dom in group_domains(first, k, n_h + n_m, model.mg)
        )
        record.update(
            coarse_grid=model.mg["grid"],
            cells_split=[n_h, n_m, n_t],
            sgis_size=model.mg["sgis_size"],
            ppsm_cells=[n_pos, n_b, n_neg],
            mg_group_tokens=r2 * group,
        )
        return model, record

    def hooks(self, model, record, *, teacher, train_cfg):
        return MGViTHHooks(MGViTHRecipe.from_dict(record.get("recipe") or {}, what="mgvit-h recipe").kl_weight)


__all__ = [
    "MGViTHMethod",
    "MGViTHConfig",
    "MGViTHRecipe",
    "MGViTHHooks",
    "init_mg_layer",
    "resolve_config",
    "default_mg_heads",
    "sgis_size",
]
