"""The weight names of Hugging Face ``transformers`` ViT-family encoders (ViT, DeiT, DINOv2) and
timm's ``blocks.N.*`` weights built from them (:mod:`.hf` converts the models, :mod:`.hf_deit` DeiT's)."""

from __future__ import annotations

import torch

from ..errors import NascompressError

V5 = {
    "q": "attention.q_proj",
    "k": "attention.k_proj",
    "v": "attention.v_proj",
    "o": "attention.o_proj",
    "fc1": "mlp.fc1",
    "fc2": "mlp.fc2",
}
V4 = {
    "q": "attention.attention.query",
    "k": "attention.attention.key",
    "v": "attention.attention.value",
    "o": "attention.output.dense",
    "fc1": "intermediate.dense",
    "fc2": "output.dense",
}


def scheme(sd: dict[str, torch.Tensor], root: str = "vit.") -> tuple[str, dict[str, str]]:
    """The block prefix and the layer names of a transformers state dict (5.x or 4.x naming)."""
    for layer in (f"{root}layers.{{i}}.", f"{root}encoder.layer.{{i}}."):
        if f"{layer.format(i=0)}attention.q_proj.weight" in sd:
            return layer, V5
        if f"{layer.format(i=0)}attention.attention.query.weight" in sd:
            return layer, {
                **V4,
                **({"fc1": "mlp.fc1", "fc2": "mlp.fc2"} if f"{layer.format(i=0)}mlp.fc1.weight" in sd else {}),
            }
    raise NascompressError(
        "not a transformers ViT state (no vit.layers.* or vit.encoder.layer.* attention weights); "
        "nascompress converts ViTForImageClassification, DeiT classifiers and Dinov2Model models"
    )


def timm_blocks(
    sd: dict[str, torch.Tensor],
    layer: str,
    names: dict[str, str],
    depth: int,
    *,
    qkv_bias: bool,
    norms: tuple[str, str],
    layerscale: bool = False,
) -> dict[str, torch.Tensor]:
    """timm ``blocks.N.*`` weights from a transformers encoder's."""
    out: dict[str, torch.Tensor] = {}
    for i in range(depth):
        p = layer.format(i=i)
        out[f"blocks.{i}.attn.qkv.weight"] = torch.cat([sd[f"{p}{names[c]}.weight"] for c in "qkv"])
        if qkv_bias:
            out[f"blocks.{i}.attn.qkv.bias"] = torch.cat([sd[f"{p}{names[c]}.bias"] for c in "qkv"])
        for timm_name, hf_name in (("attn.proj", "o"), ("mlp.fc1", "fc1"), ("mlp.fc2", "fc2")):
            for t in ("weight", "bias"):
                out[f"blocks.{i}.{timm_name}.{t}"] = sd[f"{p}{names[hf_name]}.{t}"]
        for timm_name, hf_name in (("norm1", norms[0]), ("norm2", norms[1])):
            for t in ("weight", "bias"):
                out[f"blocks.{i}.{timm_name}.{t}"] = sd[f"{p}{hf_name}.{t}"]
        if layerscale:
            out[f"blocks.{i}.ls1.gamma"] = sd[f"{p}layer_scale1.lambda1"]
            out[f"blocks.{i}.ls2.gamma"] = sd[f"{p}layer_scale2.lambda1"]
    return out


__all__ = ["V4", "V5", "scheme", "timm_blocks"]
