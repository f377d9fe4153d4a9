"""Hugging Face ``transformers`` ViTs in and out (the optional extra ``nascompress[hf]``).

:func:`from_transformers` turns a ``ViTForImageClassification``, a ``DeiTForImageClassification``
or ``DeiTForImageClassificationWithTeacher`` (timm's ``VisionTransformerDistilled``: :mod:`.hf_deit`)
or a ``Dinov2Model`` backbone (an object, or a local folder ``from_pretrained`` reads; never a
download) into the timm ViT nascompress works on: the same weights, the same logits (the LayerNorms
keep the model's ``layer_norm_eps``). A ``Dinov2ForImageClassification`` is refused (its head reads
the class token and the mean patch token together, which timm's head cannot).
:func:`to_transformers` writes a timm ViT back as a folder ``ViTForImageClassification.from_pretrained``
loads (a distilled one as a ``DeiTForImageClassificationWithTeacher``), where a ``ViTConfig`` can
express its shapes: one head count and head size, full Q/K/V,
one width for every block's MLP (a uniformly pruned model, or a DCS model whose blocks kept equal
widths). Uneven MLP widths, pruned heads, a Q/K narrower than V, a residual-channel gather or
a token method (EViT, ToMe ...) cannot be: refused in one line naming the shape.

Both naming schemes of ``transformers``' ViT are read and written: 4.x
(``vit.encoder.layer.N.attention.attention.query``) and 5.x (``vit.layers.N.attention.q_proj``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import Attention, Block, VisionTransformer

from ..errors import NascompressError
from ..models.layers import nascompress_modules
from ..models.build import CUSTOM_BASE, ModelSpec, build_model
from ..runs.files import Arch
from ..runs.owner import is_output
from .common import remember
from .hf_folder import check_directory, save_folder
from .hf_deit import DEIT_CLASSES, deit_weights, encoder_weights, from_deit
from .hf_weights import scheme, timm_blocks
from ..runs.io import make_arch
from ..runs.json_io import read_json


def _transformers() -> Any:
    try:
        import transformers  # optional (nascompress[hf])
    except ImportError:
        raise NascompressError("Hugging Face models need transformers: pip install 'nascompress[hf]'") from None
    return transformers


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
    layer, names = scheme(sd, root="")
    out = {
        "cls_token": sd["embeddings.cls_token"],
        "pos_embed": sd["embeddings.position_embeddings"],
        "patch_embed.proj.weight": sd["embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": sd["embeddings.patch_embeddings.projection.bias"],
        "norm.weight": sd["layernorm.weight"],
        "norm.bias": sd["layernorm.bias"],
        **timm_blocks(
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
    """The timm ViT equal to a Hugging Face ``ViTForImageClassification``, ``DeiTForImageClassification``
    / ``DeiTForImageClassificationWithTeacher`` (timm's ``VisionTransformerDistilled``, whose eval
    logits average the class and distillation heads; without the teacher's head, the class token's
    alone) or ``Dinov2Model`` (an object, or a local folder ``from_pretrained`` reads, offline):
    ``nc.from_transformers(hf_model)``; a ``Dinov2ForImageClassification`` is refused in one line.
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
            f"from_transformers converts a Hugging Face ViTForImageClassification, DeiT classifier or Dinov2Model (the "
            f"object, or a local folder save_pretrained wrote), got {type(hf).__name__}"
        )
    cfg = getattr(hf, "config", None)
    if getattr(cfg, "model_type", None) == "dinov2":
        spec, out = _from_dinov2(hf)
    elif getattr(cfg, "model_type", None) == "deit":
        spec, out = from_deit(hf)
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
        names = conf.architectures or []
        deit = next((getattr(tf, n) for n in names if n in DEIT_CLASSES), None)
        auto = deit or (tf.AutoModel if "Dinov2Model" in names else tf.AutoModelForImageClassification)
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
            f"from_transformers converts a ViTForImageClassification, a DeiT classifier or a Dinov2Model, got "
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
    layer, names = scheme(sd)
    out = {
        "cls_token": sd["vit.embeddings.cls_token"],
        "pos_embed": sd["vit.embeddings.position_embeddings"],
        "patch_embed.proj.weight": sd["vit.embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": sd["vit.embeddings.patch_embeddings.projection.bias"],
        "norm.weight": sd["vit.layernorm.weight"],
        "norm.bias": sd["vit.layernorm.bias"],
        "head.weight": sd["classifier.weight"],
        "head.bias": sd["classifier.bias"],
        **timm_blocks(
            sd,
            layer,
            names,
            cfg.num_hidden_layers,
            qkv_bias=bool(cfg.qkv_bias),
            norms=("layernorm_before", "layernorm_after"),
        ),
    }
    return spec, out


def _held_by_nascompress(name: str, m: nn.Module) -> str:
    """Why the nascompress module ``m`` (at ``name``) is a shape a ViTConfig cannot hold."""
    keep = getattr(m, "mlp_keep", None)
    if keep is not None:
        return (
            f"{name}'s MLP reads and writes {keep.numel()} of the {m.norm2.normalized_shape[0]} residual channels "
            "(DCS's residual family); a ViTConfig's MLP reads every channel"
        )
    if getattr(m, "qk_dim", None) is not None:
        return (
            f"{name} keeps {m.qk_dim} Q/K channels per head against {m.head_dim} for V; a ViTConfig's query, "
            "key and value have one head size"
        )
    if hasattr(m, "bias") and not list(m.children()):
        what = "head" if name.endswith("attn") else "hidden neuron"
        return f"{name} has no {what} left (a constant); a ViTConfig has no such block"
    return (
        f"{name} is a {type(m).__name__} (a token method: the tokens change at inference), which a ViTConfig "
        "cannot hold"
    )


def _plain_shape(model: nn.Module) -> tuple[int, str | None]:
    """The MLP width a ViTConfig would take for ``model``, or (0, the shape it cannot hold): decided
    by the shapes (one head count and head size, full Q/K/V, one MLP width), not the block classes."""
    if type(model) not in (VisionTransformer, VisionTransformerDistilled):
        return 0, f"a {type(model).__name__} (not timm's VisionTransformer or VisionTransformerDistilled)"
    if model.cls_token is None or model.global_pool != "token" or getattr(model, "num_reg_tokens", 0):
        return 0, "a model that does not classify from one class token"
    if not isinstance(model.fc_norm, nn.Identity) or not isinstance(model.norm_pre, nn.Identity):
        return 0, "a model with fc_norm or pre_norm"
    needs = nascompress_modules(model)
    if needs:
        return 0, _held_by_nascompress(needs[0], model.get_submodule(needs[0]))
    widths, C, heads = [], model.embed_dim, model.blocks[0].attn.num_heads if len(model.blocks) else 0
    for i, b in enumerate(model.blocks):
        if not isinstance(b, Block) or not isinstance(b.attn, Attention):
            return 0, f"block {i} is a {type(b).__name__} with {type(b.attn).__name__}, not timm's Block and Attention"
        a = b.attn
        if a.num_heads * a.head_dim != C or a.num_heads != heads:
            return 0, (
                f"block {i} keeps {a.num_heads} heads of {a.head_dim} channels ({a.num_heads * a.head_dim} of "
                f"hidden_size {C}); a ViTConfig has num_attention_heads ({heads}) x head size = hidden_size in "
                "every block"
            )
        if not isinstance(b.ls1, nn.Identity) or not isinstance(a.q_norm, nn.Identity):
            return 0, f"block {i} has layer scale or Q/K norms, which ViTForImageClassification has not"
        if a.gate is not None or not isinstance(a.norm, nn.Identity):
            return 0, f"block {i}'s attention is gated or normed, which ViTForImageClassification's is not"
        widths.append(b.mlp.fc1.out_features)
    if len(set(widths)) > 1:
        return 0, (f"the blocks' MLP widths differ ({widths}); a transformers ViTConfig has one intermediate_size")
    if not widths:
        return 0, "a model without blocks"
    return widths[0], None


def to_transformers(
    model: nn.Module, directory: str | Path, *, arch: Arch | dict[str, Any] | None = None, force: bool = False
) -> Path:
    """Write ``model`` (a timm ViT whose shapes a ViTConfig holds, decided by the shapes, not the
    block classes) as a folder Hugging Face's ``ViTForImageClassification.from_pretrained`` loads (a
    ``VisionTransformerDistilled``: ``DeiTForImageClassificationWithTeacher``; config.json +
    model.safetensors); the
    model's preprocessing goes into ``preprocessor_config.json`` when ``arch`` is given. Models
    that a ViTConfig cannot express are refused with the reason. An existing non-empty
    ``directory`` is replaced only with ``force`` and only when it is such a folder (written by
    to_transformers: nothing else in it); a nascompress run or output never is. The folder is
    written beside ``directory`` and moved there complete, so a failure leaves none half-written."""
    tf = _transformers()
    directory = Path(directory)
    check_directory(directory, force)
    deit = isinstance(model, VisionTransformerDistilled)
    width, why = _plain_shape(model)
    if why:
        raise NascompressError(f"cannot write this model as a transformers {'DeiT' if deit else 'ViT'}: {why}")
    pe, blk = model.patch_embed, model.blocks[0]
    typed = None if arch is None else Arch.of(arch)
    labels = typed.labels if typed is not None else None
    cfg = (tf.DeiTConfig if deit else tf.ViTConfig)(
        image_size=int(pe.img_size[0]),
        patch_size=int(pe.patch_size[0]),
        num_channels=pe.proj.in_channels,
        hidden_size=model.embed_dim,
        num_hidden_layers=len(model.blocks),
        num_attention_heads=blk.attn.num_heads,
        intermediate_size=width,
        hidden_act="gelu",
        layer_norm_eps=model.norm.eps,
        qkv_bias=blk.attn.qkv.bias is not None,
        num_labels=model.num_classes,
        **({"id2label": dict(enumerate(labels)), "label2id": {v: i for i, v in enumerate(labels)}} if labels else {}),
    )
    if pe.img_size[0] != pe.img_size[1] or pe.patch_size[0] != pe.patch_size[1]:
        raise NascompressError("cannot write this model as a transformers ViT: its images or patches are not square")
    hf = tf.DeiTForImageClassificationWithTeacher(cfg) if deit else tf.ViTForImageClassification(cfg)
    if deit:
        out = deit_weights(model, hf.state_dict())
    else:
        sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        out = {
            "vit.embeddings.cls_token": sd["cls_token"],
            "vit.embeddings.position_embeddings": sd["pos_embed"],
            "vit.embeddings.patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
            "vit.embeddings.patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
            "vit.layernorm.weight": sd["norm.weight"],
            "vit.layernorm.bias": sd["norm.bias"],
            "classifier.weight": sd["head.weight"],
            "classifier.bias": sd["head.bias"],
            **encoder_weights(sd, *scheme(hf.state_dict()), len(model.blocks), model.embed_dim),
        }
    missing = set(hf.state_dict()) - set(out)
    if missing:
        raise NascompressError(f"cannot write this model as a transformers ViT: no weights for {sorted(missing)[:3]}")
    hf.load_state_dict({k: v.contiguous().clone() for k, v in out.items()}, strict=True)
    save_folder(hf, directory, typed)
    return directory


__all__ = ["from_transformers", "to_transformers"]
