"""Building timm ViTs from a spec (loading weights into them strictly: :mod:`nascompress.models.weights`).

A model is described by a :class:`ModelSpec` (a timm name plus build kwargs). Weights never
come from a hub: ``pretrained=False`` always, and weights are loaded from local files.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

from .. import _compat  # noqa: F401  (must run before timm imports torchvision)

import timm
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from timm.data import resolve_data_config
from timm.models.pvt_v2 import PyramidVisionTransformerV2

from ..config import check_settings, setting
from ..errors import NascompressError, SettingError
from ..limits import check_limit

# The base timm entry used for a custom small ViT; every size comes from the overrides.
CUSTOM_BASE = "vit_tiny_patch16_224"
# timm modules whose models are VisionTransformer instances (checked again after building).
_VIT_MODULES = {"vision_transformer", "deit"}
# every model of this timm module embeds patches with a CNN stem (HybridEmbed): refused
_HYBRID_MODULE = "vision_transformer_hybrid"
# pyramid ViTs (PVT v2): built for dense training and for the pyramid method (mgvit-h) only; they take
# any input size, so the spec's img_size is recorded on the model (``nc_img_size``), not passed to timm
PYRAMID_MODULES = {"pvt_v2"}
# the pyramid models nascompress builds: PVT v2 b0..b5 (spatial-reduction attention; the linear
# variant pvt_v2_b2_li pools keys to a fixed 7x7 grid and is not supported)
PYRAMID_NAMES = tuple(f"pvt_v2_b{i}" for i in range(6))


# The timm build settings a model spec (and so ``arch.json``'s ``model.kwargs``) may hold: what
# nascompress itself writes (the custom ViT's shape, ``--img-size``/``--num-classes``/``--in-chans``
# of train, import and search) and the ViT variants' own switches (prefix tokens, pooling, norms).
# Anything else is refused: the kwargs go straight to ``timm.create_model``, and a file must never
# make timm open another file (``checkpoint_path``), fetch a config (``pretrained_cfg_overlay``) or
# resolve a name to code (``act_layer``, ``norm_layer``, ``block_fn``).
def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _size(v: Any) -> bool:  # an int or an (H, W) pair
    return _pos_int(v) or (isinstance(v, (list, tuple)) and len(v) == 2 and all(_pos_int(x) for x in v))


def _pos_float(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


GLOBAL_POOLS = ("", "avg", "avgmax", "max", "token", "map")
MODEL_KWARGS: dict[str, tuple[str, Any]] = {
    "img_size": ("a positive integer or [H, W]", _size),
    "patch_size": ("a positive integer or [H, W]", _size),
    "embed_dim": ("a positive integer", _pos_int),
    "depth": ("a positive integer", _pos_int),
    "num_heads": ("a positive integer", _pos_int),
    "num_classes": (
        "an integer >= 0 (0: no head)",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    ),
    "in_chans": ("a positive integer", _pos_int),
    "mlp_ratio": ("a positive number", _pos_float),
    "global_pool": (f"one of {', '.join(repr(g) for g in GLOBAL_POOLS)}", lambda v: v in GLOBAL_POOLS),
    "class_token": ("true or false", lambda v: isinstance(v, bool)),
    "reg_tokens": ("an integer >= 0", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "no_embed_class": ("true or false", lambda v: isinstance(v, bool)),
    "qkv_bias": ("true or false", lambda v: isinstance(v, bool)),
    "qk_norm": ("true or false", lambda v: isinstance(v, bool)),
    "fc_norm": ("true, false or null", lambda v: v is None or isinstance(v, bool)),
    "pre_norm": ("true or false", lambda v: isinstance(v, bool)),
    "init_values": ("a positive number or null", lambda v: v is None or _pos_float(v)),
    "dynamic_img_size": ("true or false", lambda v: isinstance(v, bool)),
}


def check_model_kwargs(kwargs: Any, *, source: str = "the model settings") -> dict[str, Any]:
    """Refuse build settings outside :data:`MODEL_KWARGS` (or of the wrong type), naming the key.

    Args:
        kwargs: ``ModelSpec.kwargs`` (e.g. ``arch.json``'s ``model.kwargs``).
        source: what held them, for the message (a file name).
    """
    if not isinstance(kwargs, dict):
        raise NascompressError(f"{source}: model kwargs must be a mapping of settings, got {type(kwargs).__name__}")
    for k, v in kwargs.items():
        if k not in MODEL_KWARGS:
            raise NascompressError(
                f"{source}: model setting {k!r} is not one nascompress accepts "
                f"({', '.join(MODEL_KWARGS)}); the file was not written by nascompress or was "
                "edited: remove the setting"
            )
        what, ok = MODEL_KWARGS[k]
        if not ok(v):
            raise NascompressError(f"{source}: model setting {k} must be {what}, got {v!r}")
    return kwargs


# the build settings that size a model (the rest are switches): counted by model_size before building
_SIZE_KEYS = (
    "img_size",
    "patch_size",
    "embed_dim",
    "depth",
    "mlp_ratio",
    "num_classes",
    "in_chans",
    "reg_tokens",
    "class_token",
    "num_heads",
)


def _pair(v: Any) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


@lru_cache(maxsize=64)
def _default_shape(name: str, switches: tuple[tuple[str, Any], ...]) -> dict[str, Any] | None:
    """The size settings of timm ViT ``name`` built with its own defaults (on the meta device:
    nothing is allocated); None for a name that is no timm ViT (refused by :func:`build_model`)."""
    try:
        if not timm.is_model(timm.models.split_model_name_tag(name)[0]):
            return None
        with torch.device("meta"):
            m = timm.create_model(name, pretrained=False, **dict(switches))
        m.patch_embed.proj, m.blocks[0].mlp.fc1  # noqa: B018 (a plain ViT, else refused when built)
    except Exception:  # noqa: BLE001 (any other model or setting is refused by build_model, in words)
        return None
    return {
        "img_size": tuple(m.patch_embed.img_size),
        "patch_size": tuple(m.patch_embed.patch_size),
        "embed_dim": m.embed_dim,
        "depth": len(m.blocks),
        "mlp_ratio": m.blocks[0].mlp.fc1.out_features / m.embed_dim if len(m.blocks) else 4.0,
        "num_classes": m.num_classes,
        "in_chans": m.patch_embed.proj.in_channels,
        "prefix": m.num_prefix_tokens,
    }


def model_size(spec: "ModelSpec") -> dict[str, int] | None:
    """``{"params", "depth", "tokens", "img_size", "patch_size", "in_chans", "prefix"}`` of the ViT
    ``spec`` builds, counted from its settings (weights of the blocks, patch embedding, position
    embedding and head; norms and biases left out, so a slight undercount) without building it;
    None for a name that is no timm ViT. The settings must have passed :func:`check_model_kwargs`."""
    kw = spec.kwargs
    switches = tuple(sorted((k, v) for k, v in kw.items() if k not in _SIZE_KEYS and not isinstance(v, list)))
    base = _default_shape(spec.name, switches) if any(k not in kw for k in _SIZE_KEYS[:7]) else {}
    if base is None:
        return None
    get = lambda k: kw[k] if k in kw else base[k]  # noqa: E731
    (ih, iw), (ph, pw) = _pair(get("img_size")), _pair(get("patch_size"))
    d, depth = int(get("embed_dim")), int(get("depth"))
    hidden = int(d * float(get("mlp_ratio")))
    if "class_token" in kw or "reg_tokens" in kw or not base:
        prefix = int(kw.get("class_token", True)) + int(kw.get("reg_tokens", 0))
    else:
        prefix = base["prefix"]
    tokens = (ih // max(ph, 1)) * (iw // max(pw, 1)) + prefix
    params = (
        depth * (4 * d * d + 2 * d * hidden)
        + int(get("in_chans")) * ph * pw * d
        + tokens * d
        + d * int(get("num_classes"))
    )
    return {
        "params": params,
        "depth": depth,
        "tokens": tokens,
        "img_size": (ih, iw),
        "patch_size": (ph, pw),
        "in_chans": int(get("in_chans")),
        "prefix": prefix,
    }


def check_model_size(spec: "ModelSpec", *, source: str = "the model settings") -> None:
    """Refuse a model too large to build (:mod:`nascompress.limits`) before anything is allocated:
    a model file must not be able to exhaust the machine."""
    size = model_size(spec)
    if size is None:
        return
    fix = (
        "the file was not written by nascompress or was edited: check its model settings"
        if source != "the model settings"
        else "choose a smaller model"
    )
    for name, key, what in (
        ("max_model_depth", "depth", "depth (blocks)"),
        ("max_model_tokens", "tokens", "tokens per image"),
        ("max_model_params", "params", "parameter count"),
    ):
        check_limit(name, size[key], f"{source}: model {spec.name}'s {what}", fix=fix)


@dataclass(frozen=True)
class ModelSpec:
    """What is needed to rebuild a timm model: its registered name and build kwargs.

    Args:
        name: a timm model name (``vit_*``, ``deit_*`` ...).
        kwargs: keyword overrides passed to ``timm.create_model`` (num_classes, img_size,
            in_chans, patch_size, embed_dim, depth, num_heads, ...): only the settings of
            :data:`MODEL_KWARGS` (checked by :func:`build_model`).
    """

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        return cls(name=d["name"], kwargs=dict(d.get("kwargs", {})))


def custom_vit_spec(
    *,
    img_size: int,
    patch_size: int,
    embed_dim: int,
    depth: int,
    num_heads: int,
    num_classes: int,
    in_chans: int = 3,
    mlp_ratio: float = 4.0,
) -> ModelSpec:
    """A small plain ViT of the given shape (built from timm's VisionTransformer)."""
    if embed_dim % num_heads:
        raise SettingError(f"{{embed_dim}} {embed_dim} must be divisible by {{num_heads}} {num_heads}")
    if img_size % patch_size:
        raise SettingError(f"{{img_size}} {img_size} must be divisible by {{patch_size}} {patch_size}")
    return ModelSpec(
        CUSTOM_BASE,
        dict(
            img_size=img_size,
            patch_size=patch_size,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            num_classes=num_classes,
            in_chans=in_chans,
        ),
    )


def _check_name(name: str) -> str:
    """Check a timm name (``arch`` or ``arch.tag``); return the architecture without the tag.

    The pretrained tag (e.g. ``vit_base_patch16_clip_224.openai``) only selects the pretrained
    config (mean/std, interpolation, crop) that preprocessing is taken from.
    """
    arch, tag = timm.models.split_model_name_tag(name)
    if not timm.is_model(arch):
        known = timm.list_models("vit_*") + timm.list_models("deit_*")
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see timm.list_models('vit_*')"
        raise NascompressError(f"unknown model name {name!r}{hint}")
    if tag:
        tags = [n.split(".", 1)[1] for n in timm.list_pretrained(f"{arch}.*")]
        if tag not in tags:
            raise NascompressError(
                f"unknown pretrained tag {tag!r} for {arch}; known tags: {', '.join(tags) or 'none'}"
            )
    return arch


def _hybrid_message(name: str, stem: str) -> str:
    return (
        f"hybrid ViTs with a CNN stem are not supported: {name} embeds patches with a {stem} (timm HybridEmbed), "
        "which nascompress cannot profile or compress; use a plain patch-embedding ViT (vit_*_patch*, deit_*)"
    )


def is_pyramid(model: nn.Module) -> bool:
    """A pyramid ViT (timm PVT v2) rather than a plain VisionTransformer."""
    return isinstance(model, PyramidVisionTransformerV2)


def _build_pyramid(spec: ModelSpec, arch: str) -> nn.Module:
    if arch not in PYRAMID_NAMES:
        raise NascompressError(
            f"{spec.name} is not supported: of the pyramid ViTs nascompress builds "
            f"{', '.join(PYRAMID_NAMES)} (spatial-reduction attention)"
        )
    kwargs = dict(spec.kwargs)
    img = kwargs.pop("img_size", 224)
    img = (img, img) if isinstance(img, int) else tuple(img)
    bad = sorted(set(kwargs) - {"num_classes", "in_chans"})
    if bad:
        raise NascompressError(
            f"cannot build {spec.name} with {', '.join(bad)}: a pyramid ViT takes only img_size, "
            "num_classes and in_chans (its shape is the timm name's)"
        )
    model = timm.create_model(spec.name, pretrained=False, **kwargs)
    model.nc_img_size = img
    return model


def build_model(spec: ModelSpec) -> nn.Module:
    """Build ``spec`` with random init (never downloads): a timm VisionTransformer, or a pyramid
    ViT of :data:`PYRAMID_NAMES`. Raises for other and hybrid models and for build settings
    outside :data:`MODEL_KWARGS`."""
    check_model_kwargs(spec.kwargs)
    if not isinstance(spec.name, str):
        raise NascompressError(f"the model name must be a timm name, got {spec.name!r}")
    arch = _check_name(spec.name)
    module = timm.models._registry._model_to_module.get(arch)
    if module in PYRAMID_MODULES:
        return _build_pyramid(spec, arch)
    if module == _HYBRID_MODULE:
        raise NascompressError(_hybrid_message(spec.name, "ResNet stem"))
    if module not in _VIT_MODULES:
        raise NascompressError(
            f"{spec.name} is not a timm VisionTransformer (it comes from timm.models.{module}); "
            "nascompress supports ViT-family models (vit_*, deit_*) and the pyramid ViTs pvt_v2_b0..b5"
        )
    check_model_size(spec)
    try:
        model = timm.create_model(spec.name, pretrained=False, **spec.kwargs)
    except (TypeError, ValueError, AssertionError, RuntimeError) as e:
        raise NascompressError(f"cannot build {spec.name} with {spec.kwargs}: {e}") from e
    if not isinstance(model, VisionTransformer):
        raise NascompressError(
            f"{spec.name} is a {type(model).__name__}, not a timm VisionTransformer; "
            "nascompress supports ViT-family models (vit_*, deit_*)"
        )
    if getattr(model.patch_embed, "backbone", None) is not None:  # HybridEmbed, wherever it is registered
        raise NascompressError(_hybrid_message(spec.name, type(model.patch_embed.backbone).__name__))
    return model


def input_size(model: nn.Module) -> tuple[int, int, int]:
    """(C, H, W) expected by the model's patch embedding (a pyramid ViT: the size it was built for)."""
    pe = model.patch_embed
    if is_pyramid(model):
        return (pe.proj.in_channels, *model.nc_img_size)
    return (pe.proj.in_channels, *pe.img_size)


def pretrained_data_config(model: nn.Module) -> dict[str, Any]:
    """Mean, std, interpolation, crop_pct and crop_mode from the timm model's pretrained config
    (``timm.data.resolve_data_config``; the config of the name's tag, or timm's default tag).
    The input size is not taken from it: it is the model's own (:func:`input_size`)."""
    cfg = resolve_data_config({}, model=model)
    interp = cfg["interpolation"] if cfg["interpolation"] in ("bilinear", "bicubic", "nearest") else "bicubic"
    return {
        "mean": tuple(cfg["mean"]),
        "std": tuple(cfg["std"]),
        "interpolation": interp,
        "crop_pct": float(cfg["crop_pct"]),
        "crop_mode": cfg["crop_mode"],
    }


# ---------------------------------------------------------------------------------------------
# The model a user asks a command (train, profile) or the pipeline (base.train) to build

# the small custom ViT's shape, where neither a timm name nor the option gives one
CUSTOM_VIT = {"img_size": 28, "patch_size": 4, "embed_dim": 96, "depth": 6, "num_heads": 3, "in_chans": 1}


def _shape_help(what: str, name: str, extra: str = "") -> str:
    return f"{what} (custom ViT default {CUSTOM_VIT[name]}{extra})."


@dataclass(frozen=True)
class ModelShape:
    """A timm ``model`` with shape overrides, or (``model`` None) the small custom ViT, whose shape
    defaults are :data:`CUSTOM_VIT`: ``nascompress train`` / ``profile`` options and ``base.train``
    keys. ``num_classes`` None: the caller's (the dataset's)."""

    model: str | None = setting(None, help="timm model name (vit_*, deit_*); default: a small custom ViT.")
    img_size: int | None = setting(None, lo=1, help=_shape_help("Input size", "img_size"))
    patch_size: int | None = setting(None, lo=1, help=_shape_help("Patch size", "patch_size"))
    embed_dim: int | None = setting(None, lo=1, help=_shape_help("Width", "embed_dim"))
    depth: int | None = setting(None, lo=1, help=_shape_help("Blocks", "depth"))
    num_heads: int | None = setting(None, lo=1, help=_shape_help("Heads", "num_heads"))
    in_chans: int | None = setting(
        None, lo=1, help=_shape_help("Input channels", "in_chans", "; grey images are repeated for 3")
    )
    num_classes: int | None = setting(None, lo=1, help="Classes (default: the dataset's).")

    def __post_init__(self) -> None:
        check_settings(self)

    def spec(self, num_classes: int) -> ModelSpec:
        """The model to build, with ``num_classes`` where the shape gives none."""
        n = self.num_classes if self.num_classes is not None else num_classes
        given = {k: getattr(self, k) for k in CUSTOM_VIT if getattr(self, k) is not None}
        if self.model is None:
            return custom_vit_spec(**{**CUSTOM_VIT, **given}, num_classes=n)
        return ModelSpec(self.model, dict(given, num_classes=n))
