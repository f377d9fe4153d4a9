"""Hugging Face DeiT in and out: ``DeiTForImageClassification`` and
``DeiTForImageClassificationWithTeacher`` as timm's ``VisionTransformerDistilled`` (the class and
distillation tokens both attend; :mod:`.hf` dispatches here).

timm's distilled ViT predicts ``(head(cls) + head_dist(dist)) / 2`` in eval mode, which is the
with-teacher model's logits. The plain ``DeiTForImageClassification`` predicts from the class token
alone: its classifier becomes ``head`` at twice the weights and ``head_dist`` zeros, the same
logits (a doubling and a halving are exact in floating point). Written back, a distilled timm ViT
is a ``DeiTForImageClassificationWithTeacher``.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.models.deit import VisionTransformerDistilled
from torch import nn

from ..errors import NascompressError
from ..models.build import ModelSpec
from .hf_weights import scheme, timm_blocks

DISTILLED_BASE = "deit_tiny_distilled_patch16_224"  # the timm name the converted models are built from
DEIT_CLASSES = ("DeiTForImageClassification", "DeiTForImageClassificationWithTeacher")


def from_deit(hf: Any) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """The timm spec and weights of a DeiT classifier (with or without its distillation head)."""
    cfg, name = hf.config, type(hf).__name__
    teacher = hasattr(hf, "distillation_classifier")
    if name not in DEIT_CLASSES:
        raise NascompressError(
            f"from_transformers converts DeiT classifiers ({', '.join(DEIT_CLASSES)}), got {name}: a DeiT "
            "without a classification head has no logits to keep equal"
        )
    if cfg.hidden_act != "gelu" or not cfg.num_labels:
        raise NascompressError(
            f"this {name} has the {cfg.hidden_act!r} activation and {cfg.num_labels} labels; timm's DeiT uses "
            "exact GELU ('gelu') and a head of at least one class"
        )
    size, patch = cfg.image_size, cfg.patch_size
    spec = ModelSpec(
        DISTILLED_BASE,
        dict(
            img_size=size,
            patch_size=patch,
            embed_dim=cfg.hidden_size,
            depth=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            mlp_ratio=cfg.intermediate_size / cfg.hidden_size,
            num_classes=cfg.num_labels,
            in_chans=cfg.num_channels,
            qkv_bias=bool(cfg.qkv_bias),
        ),
    )
    sd = {k: v.detach().float().cpu() for k, v in hf.state_dict().items()}
    layer, names = scheme(sd, root="deit.")
    e = "deit.embeddings."
    out = {
        "cls_token": sd[f"{e}cls_token"],
        "dist_token": sd[f"{e}distillation_token"],
        "pos_embed": sd[f"{e}position_embeddings"],
        "patch_embed.proj.weight": sd[f"{e}patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": sd[f"{e}patch_embeddings.projection.bias"],
        "norm.weight": sd["deit.layernorm.weight"],
        "norm.bias": sd["deit.layernorm.bias"],
        **timm_blocks(
            sd,
            layer,
            names,
            cfg.num_hidden_layers,
            qkv_bias=bool(cfg.qkv_bias),
            norms=("layernorm_before", "layernorm_after"),
        ),
    }
    if teacher:
        for timm_name, hf_name in (("head", "cls_classifier"), ("head_dist", "distillation_classifier")):
            out[f"{timm_name}.weight"], out[f"{timm_name}.bias"] = sd[f"{hf_name}.weight"], sd[f"{hf_name}.bias"]
    else:  # (2 head(cls) + 0) / 2: the class token's logits
        out["head.weight"], out["head.bias"] = 2 * sd["classifier.weight"], 2 * sd["classifier.bias"]
        out["head_dist.weight"] = torch.zeros_like(sd["classifier.weight"])
        out["head_dist.bias"] = torch.zeros_like(sd["classifier.bias"])
    return spec, out


def deit_weights(model: nn.Module, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``DeiTForImageClassificationWithTeacher`` weights (named as in ``hf_sd``, the target
    model's own state dict) of the distilled timm ViT ``model`` (shapes checked by the caller)."""
    if not isinstance(model, VisionTransformerDistilled):
        raise NascompressError(f"a DeiT is written from timm's VisionTransformerDistilled, got {type(model).__name__}")
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    layer, names = scheme(hf_sd, root="deit.")
    e = "deit.embeddings."
    out = {
        f"{e}cls_token": sd["cls_token"],
        f"{e}distillation_token": sd["dist_token"],
        f"{e}position_embeddings": sd["pos_embed"],
        f"{e}patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
        f"{e}patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
        "deit.layernorm.weight": sd["norm.weight"],
        "deit.layernorm.bias": sd["norm.bias"],
        "cls_classifier.weight": sd["head.weight"],
        "cls_classifier.bias": sd["head.bias"],
        "distillation_classifier.weight": sd["head_dist.weight"],
        "distillation_classifier.bias": sd["head_dist.bias"],
    }
    return {**out, **encoder_weights(sd, layer, names, len(model.blocks), model.embed_dim)}


def encoder_weights(
    sd: dict[str, torch.Tensor], layer: str, names: dict[str, str], depth: int, dim: int
) -> dict[str, torch.Tensor]:
    """A transformers ViT-family encoder's weights (``layer``/``names``: :func:`scheme`'s) from timm's
    ``blocks.N.*`` in ``sd`` (q, k and v split from qkv at ``dim`` rows each)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(depth):
        p = layer.format(i=i)
        for j, c in enumerate("qkv"):
            out[f"{p}{names[c]}.weight"] = sd[f"blocks.{i}.attn.qkv.weight"][j * dim : (j + 1) * dim]
            if f"blocks.{i}.attn.qkv.bias" in sd:
                out[f"{p}{names[c]}.bias"] = sd[f"blocks.{i}.attn.qkv.bias"][j * dim : (j + 1) * dim]
        for timm_name, hf_name in (("attn.proj", "o"), ("mlp.fc1", "fc1"), ("mlp.fc2", "fc2")):
            for t in ("weight", "bias"):
                out[f"{p}{names[hf_name]}.{t}"] = sd[f"blocks.{i}.{timm_name}.{t}"]
        for timm_name, hf_name in (("norm1", "layernorm_before"), ("norm2", "layernorm_after")):
            for t in ("weight", "bias"):
                out[f"{p}{hf_name}.{t}"] = sd[f"blocks.{i}.{timm_name}.{t}"]
    return out


__all__ = ["DEIT_CLASSES", "DISTILLED_BASE", "deit_weights", "encoder_weights", "from_deit"]
