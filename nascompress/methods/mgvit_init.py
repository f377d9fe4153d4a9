"""MG-ViT's initialisation from dense weights (:mod:`.mgvit`'s ``prepare`` runs it; re-exported
there): the SGIS loaded from another dense run (:func:`load_sgis_from_run`) and the MGIS widened
from the dense blocks (:func:`init_mgis_from_dense`, as :mod:`.mgvit`'s module doc describes)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn
from torch import nn

from ..errors import NascompressError
from ..runs.io import load_typed
from ..models.weights import load_state_strict
from .mgvit_modules import MGViT

INIT_STD = 1e-3


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
