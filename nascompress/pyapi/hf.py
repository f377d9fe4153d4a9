"""Hugging Face ``transformers`` ViTs in and out (the optional extra ``nascompress[hf]``).

:func:`from_transformers` turns a ``ViTForImageClassification`` or a ``Dinov2Model`` backbone (an
object, or a local folder
``from_pretrained`` reads; never a download) into the timm ``VisionTransformer`` nascompress works
on: the same weights, the same logits (the LayerNorms keep the model's ``layer_norm_eps``).
:func:`to_transformers` writes a timm ViT back as a folder ``ViTForImageClassification.from_pretrained``
loads, where a ``ViTConfig`` can express it: one width for every block's MLP, full Q/K/V, a plain
timm block. A model whose blocks were pruned to uneven widths (a DCS model) or that drops tokens
at inference (EViT, ToMe ...) cannot be, and is refused in one line saying which.

Both naming schemes of ``transformers``' ViT are read and written: 4.x
(``vit.encoder.layer.N.attention.attention.query``) and 5.x (``vit.layers.N.attention.q_proj``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from timm.models.vision_transformer import Attention, Block, VisionTransformer

from ..errors import NascompressError
from ..models import CUSTOM_BASE, ModelSpec, build_model
from ..runs.files import Arch
from ..runs.owner import is_output
from .common import remember
from .hf_folder import check_directory, save_folder
from ..runs.io import make_arch
from ..utils import read_json

_V5 = {
    "q": "attention.q_proj",
    "k": "attention.k_proj",
    "v": "attention.v_proj",
    "o": "attention.o_proj",
    "fc1": "mlp.fc1",
    "fc2": "mlp.fc2",
}
_V4 = {
    "q": "attention.attention.query",
    "k": "attention.attention.key",
    "v": "attention.attention.value",
    "o": "attention.output.dense",
    "fc1": "intermediate.dense",
    "fc2": "output.dense",
}


def _transformers() -> Any:
    try:
        import transformers  # optional (nascompress[hf])
    except ImportError:
        raise NascompressError("Hugging Face models need transformers: pip install 'nascompress[hf]'") from None
    return transformers


def _scheme(sd: dict[str, torch.Tensor], root: str = "vit.") -> tuple[str, dict[str, str]]:
    """The block prefix and the layer names of a transformers state dict (5.x or 4.x naming)."""
    for layer in (f"{root}layers.{{i}}.", f"{root}encoder.layer.{{i}}."):
        if f"{layer.format(i=0)}attention.q_proj.weight" in sd:
            return layer, _V5
        if f"{layer.format(i=0)}attention.attention.query.weight" in sd:
            return layer, {
                **_V4,
                **({"fc1": "mlp.fc1", "fc2": "mlp.fc2"} if f"{layer.format(i=0)}mlp.fc1.weight" in sd else {}),
            }
    raise NascompressError(
        "not a transformers ViT state (no vit.layers.* or vit.encoder.layer.* attention weights); "
        "nascompress converts ViTForImageClassification and Dinov2Model models"
    )


def _timm_blocks(
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


def _from_dinov2(hf: Any) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """A ``Dinov2Model`` (the backbone, no head): timm's ViT with layer scale and ``num_classes=0``,
    whose output is the pooled class token (the model's ``pooler_output``)."""
    cfg = hf.config
    if hasattr(hf, "classifier") or not hasattr(hf, "embeddings"):
        raise NascompressError(
            f"from_transformers converts a Dinov2Model backbone, got {type(hf).__name__}: its "
            "classifier reads the class token and the mean patch token together, which timm's "
            "ViT head does not; convert its backbone (model.dinov2) and train a head"
        )
    if cfg.use_swiglu_ffn or cfg.hidden_act != "gelu":
        raise NascompressError(
            "this DINOv2 uses a SwiGLU MLP or another activation than GELU; nascompress converts "
            "the GELU ones (ViT-S/B/L)"
        )
    size, patch = cfg.image_size, cfg.patch_size
    spec = ModelSpec(
        CUSTOM_BASE,
        dict(
            img_size=size,
            patch_size=patch,
            embed_dim=cfg.hidden_size,
            depth=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            mlp_ratio=float(cfg.mlp_ratio),
            num_classes=0,
            in_chans=cfg.num_channels,
            qkv_bias=bool(cfg.qkv_bias),
            init_values=float(cfg.layerscale_value),
        ),
    )
    sd = {k: v.detach().float().cpu() for k, v in hf.state_dict().items()}
    layer, names = _scheme(sd, root="")
    out = {
        "cls_token": sd["embeddings.cls_token"],
        "pos_embed": sd["embeddings.position_embeddings"],
        "patch_embed.proj.weight": sd["embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": sd["embeddings.patch_embeddings.projection.bias"],
        "norm.weight": sd["layernorm.weight"],
        "norm.bias": sd["layernorm.bias"],
        **_timm_blocks(
            sd,
            layer,
            names,
            cfg.num_hidden_layers,
            qkv_bias=bool(cfg.qkv_bias),
            norms=("norm1", "norm2"),
            layerscale=True,
        ),
    }
    return spec, out


def from_transformers(model_or_dir: Any) -> nn.Module:
    """The timm ViT equal to a Hugging Face ``ViTForImageClassification`` or ``Dinov2Model`` (an
    object, or a local folder ``from_pretrained`` reads, offline): ``nc.from_transformers(hf_model)``.
    Its logits are the ViT's (``pixel_values`` in, the same preprocessing); a ``Dinov2Model`` becomes a
    headless timm ViT with layer scale whose output is the model's ``pooler_output`` (the normed class
    token), for a head to be trained on (its images at the config's ``image_size``). The LayerNorms
    keep the model's ``layer_norm_eps`` (1e-12 for ViT); a saved and reloaded copy has timm's 1e-6,
    which moves the logits by about 1e-6. Preprocessing is the caller's: the arch records the image
    processor's mean/std when a folder holds a ``preprocessor_config.json``, else none (mean 0, std 1)."""
    tf = _transformers()
    hf, norm = model_or_dir, {}
    if isinstance(model_or_dir, (str, Path)):
        hf, norm = _read_folder(tf, Path(model_or_dir))
    if not isinstance(hf, tf.PreTrainedModel):
        if isinstance(hf, VisionTransformer):
            raise NascompressError(
                f"from_transformers converts Hugging Face models; this {type(hf).__name__} is timm's "
                "already: give it to nascompress as it is"
            )
        raise NascompressError(
            f"from_transformers converts a Hugging Face ViTForImageClassification or Dinov2Model (the "
            f"object, or a local folder save_pretrained wrote), got {type(hf).__name__}"
        )
    cfg = getattr(hf, "config", None)
    if getattr(cfg, "model_type", None) == "dinov2":
        spec, out = _from_dinov2(hf)
    else:
        spec, out = _from_vit(hf)
    model = build_model(spec)
    model.load_state_dict(out, strict=True)
    for m in model.modules():  # Hugging Face's epsilon (1e-12), not timm's 1e-6: the same logits
        if isinstance(m, nn.LayerNorm):
            m.eps = float(cfg.layer_norm_eps)
    size, c = cfg.image_size, cfg.num_channels
    mean = tuple(norm.get("image_mean") or (0.0,) * c) if norm.get("do_normalize", True) else (0.0,) * c
    std = tuple(norm.get("image_std") or (1.0,) * c) if norm.get("do_normalize", True) else (1.0,) * c
    h, w = (size, size) if isinstance(size, int) else size
    arch = make_arch(
        spec,
        input_spec={
            "img_size": [h, w],
            "in_chans": c,
            "mean": list(mean),
            "std": list(std),
            "interpolation": "bilinear",
            "crop_pct": 1.0,
            "crop_mode": "center",
        },
        labels=[cfg.id2label[i] for i in range(cfg.num_labels)]
        if spec.kwargs["num_classes"] and cfg.id2label
        else None,
    )
    return remember(model.eval(), arch)


def _read_folder(tf: Any, d: Path) -> tuple[Any, dict[str, Any]]:
    """The transformers model saved in the local folder ``d`` and its image processor's settings
    (``preprocessor_config.json``, else none); anything else is refused in one line."""
    if not d.is_dir():
        raise NascompressError(f"{d} is not a local folder (nascompress never downloads a model)")
    if is_output(d):
        raise NascompressError(
            f"{d} is a nascompress run or output, not a Hugging Face folder: load its model with "
            f"nascompress.load({str(d)!r})"
        )
    if not (d / "config.json").is_file():
        raise NascompressError(
            f"{d} holds no config.json: it is not a Hugging Face model folder (one that "
            "model.save_pretrained(folder) writes)"
        )
    pre = d / "preprocessor_config.json"
    norm = read_json(pre) if pre.is_file() else {}
    try:
        conf = tf.AutoConfig.from_pretrained(str(d), local_files_only=True)
        auto = tf.AutoModel if "Dinov2Model" in (conf.architectures or []) else tf.AutoModelForImageClassification
        return auto.from_pretrained(str(d), local_files_only=True), norm if isinstance(norm, dict) else {}
    except (ValueError, OSError, KeyError) as e:  # transformers' words for a folder it cannot read
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise NascompressError(
            f"{d} is not a Hugging Face ViT or DINOv2 folder transformers can read ({why}); give the "
            "folder save_pretrained wrote, or the model object"
        ) from None


def _from_vit(hf: Any) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """A ``ViTForImageClassification``: timm's plain ViT, class-token head."""
    cfg = hf.config
    if getattr(cfg, "model_type", None) != "vit" or not hasattr(hf, "classifier"):
        raise NascompressError(
            f"from_transformers converts a ViTForImageClassification or a Dinov2Model, got "
            f"{type(hf).__name__} (model_type {getattr(cfg, 'model_type', None)!r})"
        )
    if cfg.hidden_act != "gelu":
        raise NascompressError(f"this ViT uses the {cfg.hidden_act!r} activation; timm's ViT uses exact GELU ('gelu')")
    size, patch = cfg.image_size, cfg.patch_size
    spec = ModelSpec(
        CUSTOM_BASE,
        dict(
            img_size=size if isinstance(size, int) else list(size),
            patch_size=patch if isinstance(patch, int) else list(patch),
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
    layer, names = _scheme(sd)
    out = {
        "cls_token": sd["vit.embeddings.cls_token"],
        "pos_embed": sd["vit.embeddings.position_embeddings"],
        "patch_embed.proj.weight": sd["vit.embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": sd["vit.embeddings.patch_embeddings.projection.bias"],
        "norm.weight": sd["vit.layernorm.weight"],
        "norm.bias": sd["vit.layernorm.bias"],
        "head.weight": sd["classifier.weight"],
        "head.bias": sd["classifier.bias"],
        **_timm_blocks(
            sd,
            layer,
            names,
            cfg.num_hidden_layers,
            qkv_bias=bool(cfg.qkv_bias),
            norms=("layernorm_before", "layernorm_after"),
        ),
    }
    return spec, out


def _plain_shape(model: nn.Module) -> tuple[int, str | None]:
    """The MLP width a ViTConfig would take for ``model``, or (0, why it cannot express it)."""
    if type(model) is not VisionTransformer:
        return 0, f"a {type(model).__name__} (not a plain timm VisionTransformer)"
    if model.cls_token is None or model.global_pool != "token" or getattr(model, "num_reg_tokens", 0):
        return 0, "a model that does not classify from one class token"
    if not isinstance(model.fc_norm, nn.Identity) or not isinstance(model.norm_pre, nn.Identity):
        return 0, "a model with fc_norm or pre_norm"
    widths = []
    for i, b in enumerate(model.blocks):
        if type(b) is not Block or type(b.attn) is not Attention:
            return 0, (
                f"block {i} is a {type(b).__name__} with {type(b.attn).__name__}: its channels or tokens were "
                "pruned (DCS gathers uneven Q/K and MLP widths per block, token methods drop tokens at "
                "inference), which a transformers ViTConfig (one hidden_size, one intermediate_size, full "
                "attention) cannot express; use nascompress.export.onnx or nascompress.load instead"
            )
        if not isinstance(b.ls1, nn.Identity) or not isinstance(b.attn.q_norm, nn.Identity):
            return 0, f"block {i} has layer scale or Q/K norms, which ViTForImageClassification has not"
        widths.append(b.mlp.fc1.out_features)
    if len(set(widths)) > 1:
        return 0, (f"the blocks' MLP widths differ ({widths}); a transformers ViTConfig has one intermediate_size")
    return widths[0], None


def to_transformers(
    model: nn.Module, directory: str | Path, *, arch: dict[str, Any] | None = None, force: bool = False
) -> Path:
    """Write ``model`` (a timm ViT of plain blocks) as a folder Hugging Face's
    ``ViTForImageClassification.from_pretrained`` loads (config.json + model.safetensors); the
    model's preprocessing goes into ``preprocessor_config.json`` when ``arch`` is given. Models
    that a ViTConfig cannot express are refused with the reason. An existing non-empty
    ``directory`` is replaced only with ``force`` and only when it is such a folder (written by
    to_transformers: nothing else in it); a nascompress run or output never is. The folder is
    written beside ``directory`` and moved there complete, so a failure leaves none half-written."""
    tf = _transformers()
    directory = Path(directory)
    check_directory(directory, force)
    width, why = _plain_shape(model)
    if why:
        raise NascompressError(f"cannot write this model as a transformers ViT: {why}")
    pe, blk = model.patch_embed, model.blocks[0]
    eps = model.norm.eps
    typed = None if arch is None else Arch.of(arch)
    labels = typed.labels if typed is not None else None
    cfg = tf.ViTConfig(
        image_size=int(pe.img_size[0]),
        patch_size=int(pe.patch_size[0]),
        num_channels=pe.proj.in_channels,
        hidden_size=model.embed_dim,
        num_hidden_layers=len(model.blocks),
        num_attention_heads=blk.attn.num_heads,
        intermediate_size=width,
        hidden_act="gelu",
        layer_norm_eps=eps,
        qkv_bias=blk.attn.qkv.bias is not None,
        num_labels=model.num_classes,
        **({"id2label": dict(enumerate(labels)), "label2id": {v: i for i, v in enumerate(labels)}} if labels else {}),
    )
    if pe.img_size[0] != pe.img_size[1] or pe.patch_size[0] != pe.patch_size[1]:
        raise NascompressError("cannot write this model as a transformers ViT: its images or patches are not square")
    hf = tf.ViTForImageClassification(cfg)
    layer, names = _scheme(hf.state_dict())
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    d = model.embed_dim
    out = {
        "vit.embeddings.cls_token": sd["cls_token"],
        "vit.embeddings.position_embeddings": sd["pos_embed"],
        "vit.embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
        "vit.embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
        "vit.layernorm.weight": sd["norm.weight"],
        "vit.layernorm.bias": sd["norm.bias"],
        "classifier.weight": sd["head.weight"],
        "classifier.bias": sd["head.bias"],
    }
    for i in range(len(model.blocks)):
        p = layer.format(i=i)
        for j, c in enumerate("qkv"):
            out[f"{p}{names[c]}.weight"] = sd[f"blocks.{i}.attn.qkv.weight"][j * d : (j + 1) * d]
            if cfg.qkv_bias:
                out[f"{p}{names[c]}.bias"] = sd[f"blocks.{i}.attn.qkv.bias"][j * d : (j + 1) * d]
        for timm_name, hf_name in (("attn.proj", "o"), ("mlp.fc1", "fc1"), ("mlp.fc2", "fc2")):
            for t in ("weight", "bias"):
                out[f"{p}{names[hf_name]}.{t}"] = sd[f"blocks.{i}.{timm_name}.{t}"]
        for timm_name, hf_name in (("norm1", "layernorm_before"), ("norm2", "layernorm_after")):
            for t in ("weight", "bias"):
                out[f"{p}{hf_name}.{t}"] = sd[f"blocks.{i}.{timm_name}.{t}"]
    missing = set(hf.state_dict()) - set(out)
    if missing:
        raise NascompressError(f"cannot write this model as a transformers ViT: no weights for {sorted(missing)[:3]}")
    hf.load_state_dict({k: v.contiguous().clone() for k, v in out.items()}, strict=True)
    save_folder(hf, directory, typed)
    return directory


__all__ = ["from_transformers", "to_transformers"]
