"""How raw images become model input: the input spec recorded in ``arch.json`` (:class:`InputSpec`),
the per-dataset normalisation, batched resizing and normalising (:func:`preprocess`, the one place
that normalises), timm's ImageFolder transforms (:func:`folder_transform`) and the same evaluation
transform as explicit steps for code without torch (:func:`eval_steps`).

Images reach the model as float tensors (B, C, H, W), resized to the model's ``img_size``,
converted to its ``in_chans`` (grey repeated to 3 channels, RGB averaged to 1) and normalised
with the mean/std of the spec. In-memory uint8 datasets are resized whole in :func:`preprocess`
(``crop_pct`` does not apply); ImageFolder images are cropped by timm's transforms, which end in a
uint8 (C, H, W) tensor (``normalize=False``): evaluation resizes the shorter side to
``int(size / crop_pct)`` and centre-crops (``crop_mode`` included); training is RandomResizedCrop
(scale 0.08-1, ratio 3/4-4/3) + horizontal flip with colour jitter OFF (the runs here are short
fine-tunes of pretrained models on small datasets, where jitter mostly costs accuracy and CPU time;
timm turns it off too whenever RandAugment is on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.data import create_transform
from torchvision import transforms

from ..errors import NascompressError
from .. import _compat  # noqa: F401  (torchvision's CPU fix, before torchvision is used)
from ..limits import check_limit

FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530
DIGITS_MEAN, DIGITS_STD = 0.3057, 0.3763  # scikit-learn's digits scaled to [0, 1] (measured on its training split)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# resize modes both paths implement alike: torch's F.interpolate (batched) and PIL (ImageFolder)
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
CROP_MODES = ("center", "squash", "border")
AUGMENTS = ("none", "light", "default")  # the ImageFolder training augmentation (DataConfig.augment)


def check_input(interpolation: str | None, crop_pct: float | None, crop_mode: str | None) -> None:
    if interpolation is not None and interpolation not in INTERPOLATIONS:
        raise NascompressError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got {interpolation!r}")
    if crop_pct is not None and not (isinstance(crop_pct, (int, float)) and 0 < crop_pct <= 1):
        raise NascompressError(f"crop_pct must be in (0, 1], got {crop_pct!r}")
    if crop_mode is not None and crop_mode not in CROP_MODES:
        raise NascompressError(f"crop_mode must be one of {', '.join(CROP_MODES)}, got {crop_mode!r}")


def _number_list(v: Any) -> bool:
    return (
        isinstance(v, list)
        and bool(v)
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
    )


MIN_STD = 1e-6  # the smallest std of a recorded normalisation (a pixel in [0, 1] over it stays finite)
MAX_MEAN = 1e6  # the largest |mean|


def check_input_section(inp: Any, *, source: str, model: dict[str, Any] | None = None) -> None:
    """Check the ``input`` section of an arch read from a file, in one line naming ``source``:
    ``img_size`` [H, W] of positive integers, ``in_chans`` a positive integer, ``mean``/``std`` finite
    (``std`` >= :data:`MIN_STD`, ``|mean|`` <= :data:`MAX_MEAN`: normalised pixels stay finite) with
    1 or ``in_chans`` values; against ``model`` (the geometry of the model the arch builds,
    :func:`~nascompress.models.build.model_size`: ``img_size``, ``patch_size``, ``in_chans``, ``prefix``,
    with ``dynamic`` for ``dynamic_img_size``): the same channels, and the model's image size (or,
    dynamic, a multiple of the patch within the token limit)."""

    def bad(what: str) -> NascompressError:
        return NascompressError(
            f"{source}: input {what}; the file was not written by nascompress or was edited: "
            "fix its input section (or write it again with the command that made it)"
        )

    if not isinstance(inp, dict):
        raise bad(f"must be an object with img_size, in_chans, mean and std, got {type(inp).__name__}")
    size, chans = inp.get("img_size"), inp.get("in_chans")
    if not (isinstance(size, list) and len(size) == 2 and all(type(v) is int and v > 0 for v in size)):
        raise bad(f"img_size must be [H, W] of positive integers, got {size!r}")
    if type(chans) is not int or chans < 1:
        raise bad(f"in_chans must be a positive integer, got {chans!r}")
    for name in ("mean", "std"):
        v = inp.get(name)
        if not _number_list(v) or len(v) not in (1, chans):
            raise bad(f"{name} must be a list of 1 or {chans} (in_chans) finite numbers, got {v!r}")
    if any(s <= 0 for s in inp["std"]):
        raise bad(f"std values must be positive, got {inp['std']!r}")
    if any(s < MIN_STD for s in inp["std"]) or any(abs(m) > MAX_MEAN for m in inp["mean"]):
        raise bad(  # normalised pixels would overflow to inf: the model's outputs NaN
            f"std values must be at least {MIN_STD:g} and mean values within +-{MAX_MEAN:g} "
            f"(pixels are in [0, 1]), got mean {inp['mean']!r}, std {inp['std']!r}"
        )
    try:
        check_input(inp.get("interpolation"), inp.get("crop_pct"), inp.get("crop_mode"))
    except NascompressError as e:
        raise bad(str(e)) from None
    if model is None:
        return
    if chans != model["in_chans"]:
        raise bad(f"in_chans is {chans} but the model (and its weights) take {model['in_chans']} channels")
    (h, w), (ph, pw) = size, model["patch_size"]
    if not model.get("dynamic"):
        if (h, w) != tuple(model["img_size"]):
            raise bad(f"img_size is {size} but the model takes {list(model['img_size'])}")
        return
    if h % ph or w % pw:
        raise bad(f"img_size {size} is not a multiple of the model's patch size {[ph, pw]}")
    check_limit(
        "max_model_tokens",
        (h // ph) * (w // pw) + model.get("prefix", 1),
        f"{source}: input img_size {size}'s tokens per image",
        fix="check its input section",
    )


@dataclass(frozen=True)
class InputSpec:
    """How raw images become model input. Recorded in arch.json as ``input``: everything
    preprocessing needs, so a saved model is usable without its dataset.

    Args:
        img_size: (H, W) the model takes.
        in_chans: channels the model takes (grey images are repeated, RGB averaged to match).
        mean / std: per-channel normalisation of [0, 1] pixels (one value is broadcast).
        interpolation: resize filter, ``bilinear`` (the default, and what every run before these
            fields used), ``bicubic`` or ``nearest``.
        crop_pct: evaluation crop of ImageFolder images: the shorter side is resized to
            ``int(size / crop_pct)``, then centre-cropped to ``size`` (timm's eval transform).
        crop_mode: timm's ``center``, ``squash`` or ``border``.
    """

    img_size: tuple[int, int]
    in_chans: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str = "bilinear"
    crop_pct: float = 1.0
    crop_mode: str = "center"

    def __post_init__(self) -> None:
        check_input(self.interpolation, self.crop_pct, self.crop_mode)
        for name, v in (("mean", self.mean), ("std", self.std)):
            if len(v) not in (1, self.in_chans):
                raise NascompressError(f"{name} has {len(v)} values but the model takes {self.in_chans} channels")
        if any(not s > 0 for s in self.std):
            raise NascompressError(f"std values must be positive, got {list(self.std)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "img_size": list(self.img_size),
            "in_chans": self.in_chans,
            "mean": list(self.mean),
            "std": list(self.std),
            "interpolation": self.interpolation,
            "crop_pct": self.crop_pct,
            "crop_mode": self.crop_mode,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "InputSpec":
        """Also reads arch.json files written before interpolation/crop_pct/crop_mode existed."""
        return cls(
            tuple(int(v) for v in d["img_size"]),
            int(d["in_chans"]),
            tuple(d["mean"]),
            tuple(d["std"]),
            interpolation=d.get("interpolation", "bilinear"),
            crop_pct=float(d.get("crop_pct", 1.0)),
            crop_mode=d.get("crop_mode", "center"),
        )


def default_norm(dataset: str, in_chans: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if dataset in ("fashion-mnist", "synthetic"):
        return (FMNIST_MEAN,) * in_chans, (FMNIST_STD,) * in_chans
    if dataset == "digits":
        return (DIGITS_MEAN,) * in_chans, (DIGITS_STD,) * in_chans
    if in_chans == 3:
        return IMAGENET_MEAN, IMAGENET_STD
    return (0.5,) * in_chans, (0.5,) * in_chans


def resize(x: torch.Tensor, size: tuple[int, int], interpolation: str) -> torch.Tensor:
    """Resize float images in [0, 1] (B, C, H, W) as PIL does (what timm's ImageFolder path uses).

    Bilinear and bicubic use torch's antialiased kernels in both directions: they follow PIL's
    filters (measured on a 28 -> 112 px image: bicubic differs from PIL by 0.26/255 on average
    with antialias, 3.8/255 without, since the plain kernel uses another cubic coefficient), and
    they are what makes shrinking alias-free. Bicubic overshoots at edges, so it is clamped to
    [0, 1]. ``nearest`` is ``nearest-exact`` (PIL's pixel centres; plain ``nearest`` is shifted).
    """
    if interpolation == "nearest":
        return F.interpolate(x, size=size, mode="nearest-exact")
    x = F.interpolate(x, size=size, mode=interpolation, align_corners=False, antialias=True)
    return x.clamp_(0.0, 1.0) if interpolation == "bicubic" else x


def preprocess(images: torch.Tensor, spec: InputSpec) -> torch.Tensor:
    """uint8 (B, C, H, W) or float in [0, 1] -> normalised float (B, spec.in_chans, *img_size).

    Images not already at ``spec.img_size`` are resized whole with ``spec.interpolation``
    (:func:`resize`); ImageFolder batches arrive at the right size (cropped by their transform).
    Runs on the images' device: move the uint8 batch to the GPU first (a quarter of the bytes of
    float32) and the resizing and normalising happen there.
    """
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    c = x.shape[1]
    if c != spec.in_chans:
        if c == 1:
            x = x.expand(-1, spec.in_chans, -1, -1)
        elif spec.in_chans == 1:
            x = x.mean(dim=1, keepdim=True)
        else:
            raise NascompressError(f"images have {c} channels but the model expects {spec.in_chans}")
    if tuple(x.shape[-2:]) != tuple(spec.img_size):
        x = resize(x, tuple(spec.img_size), spec.interpolation)
    mean = torch.tensor(spec.mean, dtype=x.dtype).view(1, -1, 1, 1).to(x.device, non_blocking=True)
    std = torch.tensor(spec.std, dtype=x.dtype).view(1, -1, 1, 1).to(x.device, non_blocking=True)
    return (x - mean) / std


def folder_transform(spec: InputSpec | None, *, train: bool, augment: str = "default") -> Any:
    """timm's ImageFolder transform for ``spec``, ending in a uint8 (C, H, W) tensor, unnormalised.

    ``train`` with ``augment`` (:data:`AUGMENTS`) ``default``: RandomResizedCrop to ``spec.img_size``
    (timm's scale 0.08-1) + horizontal flip (colour jitter off; see the module docstring); ``light``:
    RandomResizedCrop at scale 0.5-1, no flip; ``none``, or not ``train``: resize the shorter side
    to ``int(size / crop_pct)`` and centre-crop. Without a spec the image is only converted (native size).
    """
    if spec is None:
        return transforms.PILToTensor()
    if augment not in AUGMENTS:
        raise NascompressError(f"augment must be one of {', '.join(AUGMENTS)}, got {augment!r}")
    if train and augment != "none":
        light = augment == "light"
        return create_transform(
            tuple(spec.img_size),
            is_training=True,
            interpolation=spec.interpolation,
            hflip=0.0 if light else 0.5,
            scale=(0.5, 1.0) if light else None,
            color_jitter=None,
            normalize=False,
        )
    return create_transform(
        tuple(spec.img_size),
        is_training=False,
        interpolation=spec.interpolation,
        crop_pct=spec.crop_pct,
        crop_mode=spec.crop_mode,
        normalize=False,
    )


def eval_steps(spec: InputSpec) -> list[dict[str, Any]]:
    """The evaluation transform of ``spec`` as explicit steps (an export's sidecar), for code without
    timm or torch: exactly what :func:`folder_transform` (timm's eval transform) and
    :func:`preprocess` do to an image file. In-memory datasets (Fashion-MNIST) were square images
    resized whole, which these steps also do for a square image."""
    h, w = spec.img_size
    scale = (math.floor(h / spec.crop_pct), math.floor(w / spec.crop_pct))  # timm: floor(size / crop_pct)
    steps: list[dict[str, Any]] = [
        {"op": "decode", "mode": "RGB", "dtype": "uint8", "note": "8-bit RGB (a grey image repeated to 3 channels)"}
    ]
    if spec.crop_mode == "squash":
        steps.append(
            {
                "op": "resize",
                "size": list(scale),
                "interpolation": spec.interpolation,
                "note": "to exactly (height, width), PIL's filter of that name (antialiased)",
            }
        )
    elif spec.crop_mode == "center" and scale[0] == scale[1]:
        steps.append(
            {
                "op": "resize",
                "shorter_side": scale[0],
                "interpolation": spec.interpolation,
                "note": "shorter side to shorter_side, longer side to int(shorter_side * long / short) "
                "(truncated), PIL's filter of that name (antialiased)",
            }
        )
    else:
        steps.append(
            {
                "op": "resize_keep_ratio",
                "size": list(scale),
                "interpolation": spec.interpolation,
                "longest": 1.0 if spec.crop_mode == "border" else 0.0,
                "note": "timm.data.ResizeKeepRatio (aspect kept; border: fit the longest side)",
            }
        )
    steps.append(
        {
            "op": "center_crop",
            "size": [h, w],
            "note": "top = round((H - height) / 2), left = round((W - width) / 2)"
            + ("; pad with the mean colour where smaller" if spec.crop_mode == "border" else ""),
        }
    )
    steps.append({"op": "scale", "factor": 1 / 255, "note": "to float32 in [0, 1]"})
    if spec.in_chans == 1:
        steps.append({"op": "to_grey", "note": "mean of the R, G, B channels"})
    steps.append(
        {"op": "normalize", "mean": list(spec.mean), "std": list(spec.std), "note": "(x - mean) / std per channel"}
    )
    steps.append({"op": "layout", "to": "NCHW", "note": "channels first, a batch dimension in front"})
    return steps
