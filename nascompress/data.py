"""Real datasets (Fashion-MNIST from the Debian package, any ImageFolder directory), the
deterministic splits, and batched preprocessing to a model's input size.

Images reach the model as float tensors (B, C, H, W), resized to the model's ``img_size``,
converted to its ``in_chans`` (grey repeated to 3 channels, RGB averaged to 1) and normalised
with the mean/std recorded in ``arch.json``'s ``input`` section (:class:`InputSpec`).
:func:`preprocess` is the one place that normalises.

Two loading paths:

* in-memory uint8 datasets (Fashion-MNIST, synthetic): whole batches are resized at once in
  :func:`preprocess` with the spec's interpolation (the whole image; ``crop_pct`` does not apply),
  no augmentation;
* ImageFolder: timm's conventions, built with ``timm.data.create_transform`` but ending in a uint8
  (C, H, W) tensor (``normalize=False``). Evaluation splits: resize the shorter side to
  ``int(size / crop_pct)`` with the spec's interpolation, then centre-crop to ``size`` (timm's eval
  transform, ``crop_mode`` included). The training split: timm's training transform,
  RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3) + horizontal flip, with colour jitter OFF: the
  runs here are short fine-tunes of pretrained models on small datasets, where jitter mostly costs
  accuracy and CPU time (timm turns it off too whenever RandAugment is on). Images are decoded in
  DataLoader workers (:attr:`DataConfig.num_workers`).

Limits (``train_limit``, ``eval_limit``) take a seeded, class-stratified random subset
(:func:`stratified_indices`), never the first N images.

Datasets that cannot train a classifier are refused before anything runs, in one line: fewer than
two classes, or a class with no image in a split (train/, val/, test/ or the validation split
carved from train/). ImageFolder images are checked once when a dataset is loaded
(:func:`scan_images`: every file is decoded the way the loader will, JPEGs at a reduced size, in
parallel threads): an unreadable file is named and refused, or with ``skip_bad_images``
(``--skip-bad-images``) left out and counted (``DataBundle.extra["skipped_images"]``). Files whose
extension is not an image's are not part of an ImageFolder and are ignored.
"""
from __future__ import annotations

import copy
import gzip
import math
import os
import struct
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, Dataset

from .config import Config, check_int, check_settings, setting
from .limits import SEED_MAX
from .errors import NascompressError

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
DATASET_KEYWORDS = ("fashion-mnist", "digits", "lfw-faces", "synthetic")  # dataset names that are not a path
IN_MEMORY = DATASET_KEYWORDS  # datasets held as uint8 tensors (batched preprocessing, no augmentation)
BUILTIN_DATASETS = "fashion-mnist, digits, lfw-faces"  # the real ones, as error messages name them
FMNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                  "Sneaker", "Bag", "Ankle boot"]
FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530
DIGITS_MEAN, DIGITS_STD = 0.3057, 0.3763  # scikit-learn's digits scaled to [0, 1] (measured on its training split)
DIGITS_TEST = 0.25  # share of scikit-learn's digits held out as the test split (it ships no split)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# resize modes both paths implement alike: torch's F.interpolate (batched) and PIL (ImageFolder)
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
CROP_MODES = ("center", "squash", "border")


def _check_input(interpolation: str | None, crop_pct: float | None, crop_mode: str | None) -> None:
    if interpolation is not None and interpolation not in INTERPOLATIONS:
        raise NascompressError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got {interpolation!r}")
    if crop_pct is not None and not (isinstance(crop_pct, (int, float)) and 0 < crop_pct <= 1):
        raise NascompressError(f"crop_pct must be in (0, 1], got {crop_pct!r}")
    if crop_mode is not None and crop_mode not in CROP_MODES:
        raise NascompressError(f"crop_mode must be one of {', '.join(CROP_MODES)}, got {crop_mode!r}")


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
        _check_input(self.interpolation, self.crop_pct, self.crop_mode)
        for name, v in (("mean", self.mean), ("std", self.std)):
            if len(v) not in (1, self.in_chans):
                raise NascompressError(f"{name} has {len(v)} values but the model takes {self.in_chans} channels")
        if any(not s > 0 for s in self.std):
            raise NascompressError(f"std values must be positive, got {list(self.std)}")

    def to_dict(self) -> dict[str, Any]:
        return {"img_size": list(self.img_size), "in_chans": self.in_chans, "mean": list(self.mean),
                "std": list(self.std), "interpolation": self.interpolation, "crop_pct": self.crop_pct,
                "crop_mode": self.crop_mode}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "InputSpec":
        """Also reads arch.json files written before interpolation/crop_pct/crop_mode existed."""
        return cls(tuple(int(v) for v in d["img_size"]), int(d["in_chans"]), tuple(d["mean"]), tuple(d["std"]),
                   interpolation=d.get("interpolation", "bilinear"), crop_pct=float(d.get("crop_pct", 1.0)),
                   crop_mode=d.get("crop_mode", "center"))


@dataclass(frozen=True)
class InputOverrides(Config):
    """Explicit preprocessing choices (``--mean``/``--std``/``--interpolation``/``--crop-pct``) that
    win over the pretrained config and the dataset defaults; None keeps the resolved value."""

    mean: tuple[float, ...] | None = setting(None, help=(
        "Normalisation mean, comma-separated (default: the weights' pretrained config, else the dataset's)."))
    std: tuple[float, ...] | None = setting(None, help="Normalisation std, comma-separated (default: as --mean).")
    interpolation: str | None = setting(None, choices=INTERPOLATIONS, help=(
        "Resize filter: bilinear, bicubic or nearest (default: as --mean)."))
    crop_pct: float | None = setting(None, lo=0, hi=1, lo_open=True, help=(
        "ImageFolder eval crop: resize to size/crop_pct, centre-crop (default: as --mean)."))
    crop_mode: str | None = None

    def __post_init__(self) -> None:
        check_settings(self)  # every setting() against its declaration
        _check_input(None, None, self.crop_mode)


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


class TensorImageDataset(Dataset):
    """Images held in memory as uint8 (N, C, H, W); batches are fetched and resized at once."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, classes: Sequence[str]):
        assert images.ndim == 4 and images.dtype == torch.uint8, "images must be uint8 (N, C, H, W)"
        self.images, self.labels, self.classes = images, labels.long(), list(classes)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.as_tensor(idx, dtype=torch.long)
        return self.images[i], self.labels[i]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


class Subset(Dataset):
    """A view of ``base`` at ``indices`` that keeps batched fetching."""

    def __init__(self, base: Dataset, indices: torch.Tensor):
        self.base, self.indices = base, torch.as_tensor(indices, dtype=torch.long)
        self.classes = base.classes
        if hasattr(base, "num_workers"):  # a view of a loaded split keeps its loader workers
            self.num_workers = base.num_workers

    def __len__(self) -> int:
        return len(self.indices)

    def __getitems__(self, idx: list[int]):
        mapped = self.indices[torch.as_tensor(idx, dtype=torch.long)].tolist()
        if hasattr(self.base, "__getitems__"):
            return self.base.__getitems__(mapped)
        return [self.base[j] for j in mapped]

    def __getitem__(self, i: int):
        return self.base[int(self.indices[i])]


def dataset_labels(ds: Dataset) -> torch.Tensor:
    """The label of every item of ``ds`` as a LongTensor, without loading any image.

    Reads ``.labels`` (:class:`TensorImageDataset`) or ``.targets`` (torchvision's ImageFolder)
    and maps through :class:`Subset` (and ``torch.utils.data.Subset``) views.
    """
    if isinstance(ds, Subset):
        return dataset_labels(ds.base)[ds.indices]
    if isinstance(ds, torch.utils.data.Subset):
        return dataset_labels(ds.dataset)[torch.as_tensor(ds.indices, dtype=torch.long)]
    for attr in ("labels", "targets"):
        if hasattr(ds, attr):
            return torch.as_tensor(getattr(ds, attr), dtype=torch.long)
    raise TypeError(f"{type(ds).__name__} has no labels or targets attribute to stratify by")


def stratified_indices(labels: torch.Tensor, n: int, *, seed: int) -> torch.Tensor:
    """``n`` indices of ``labels`` drawn at random within each class, sorted ascending.

    Each class gets its share of ``n`` in proportion to its count, rounded by largest remainder
    (so the total is exactly ``n``; ties go to the lower class id). The same (labels, n, seed)
    always gives the same indices. ``n`` must not exceed ``len(labels)``.
    """
    total = len(labels)
    assert 0 <= n <= total, f"cannot draw {n} of {total} items"
    classes, counts = torch.unique(labels, return_counts=True)
    quota, rem = counts * n // total, counts * n % total
    extra = n - int(quota.sum())
    order = sorted(range(len(classes)), key=lambda i: (-int(rem[i]), i))
    for i in order[:extra]:
        quota[i] += 1
    g = torch.Generator().manual_seed(seed)
    picked = []
    for c, k in zip(classes.tolist(), quota.tolist()):
        members = torch.nonzero(labels == c).flatten()
        picked.append(members[torch.randperm(len(members), generator=g)[:k]])
    return torch.cat(picked).sort().values


def split_indices(n: int, fractions: Sequence[float], *, seed: int) -> list[torch.Tensor]:
    """Deterministically split ``range(n)`` into parts of the given fractions (summing to 1).

    The same (n, fractions, seed) always gives the same parts; used for the held-out
    validation split and for DCS's 70/30 weights/architecture split.
    """
    if abs(sum(fractions) - 1.0) > 1e-6 or any(f <= 0 for f in fractions):
        raise ValueError(f"fractions must be positive and sum to 1, got {list(fractions)}")
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    bounds = np.round(np.cumsum([0.0, *fractions]) * n).astype(int)
    return [perm[bounds[i]:bounds[i + 1]].sort().values for i in range(len(fractions))]


def _read_idx(path: Path, header: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if header == 16:
        n, h, w = struct.unpack(">III", raw[4:16])
        return np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(n, 1, h, w)
    return np.frombuffer(raw, dtype=np.uint8, offset=8)


def load_fashion_mnist(root: Path = FMNIST_DIR) -> tuple[TensorImageDataset, TensorImageDataset]:
    """(train 60k, test 10k) from the IDX gzip files of Debian's dataset-fashion-mnist."""
    files = {k: root / f"{k}-ubyte.gz" for k in ("train-images-idx3", "train-labels-idx1", "t10k-images-idx3", "t10k-labels-idx1")}
    missing = [p for p in files.values() if not p.is_file()]
    if missing:
        raise NascompressError(
            f"Fashion-MNIST not found ({missing[0]} is missing); install it with "
            "'apt-get update && apt-get install -y dataset-fashion-mnist' or pass --data-dir")
    try:
        parts = {k: torch.from_numpy(_read_idx(p, 16 if "images" in k else 8).copy()) for k, p in files.items()}
    except (OSError, EOFError, struct.error, ValueError) as e:
        raise NascompressError(f"Fashion-MNIST files in {root} are corrupt ({e}); reinstall dataset-fashion-mnist") from e
    return (TensorImageDataset(parts["train-images-idx3"], parts["train-labels-idx1"], FMNIST_CLASSES),
            TensorImageDataset(parts["t10k-images-idx3"], parts["t10k-labels-idx1"], FMNIST_CLASSES))


def load_digits_dataset(seed: int = 0) -> tuple[TensorImageDataset, TensorImageDataset]:
    """(train, test) from scikit-learn's bundled digits (1,797 8x8 grey images, 10 classes, no
    download): a fixed class-stratified ``DIGITS_TEST`` share is the test split. Pixel values 0-16
    are scaled to 0-255."""
    from sklearn.datasets import load_digits

    d = load_digits()
    imgs = torch.from_numpy((d.images * (255.0 / 16.0)).round().astype("uint8"))[:, None]  # (N, 1, 8, 8)
    labels = torch.from_numpy(d.target.astype("int64"))
    test_idx = set(stratified_indices(labels, int(round(DIGITS_TEST * len(labels))), seed=seed).tolist())
    tr = [i for i in range(len(labels)) if i not in test_idx]
    te = sorted(test_idx)
    classes = [str(c) for c in range(10)]
    return (TensorImageDataset(imgs[tr], labels[tr], classes), TensorImageDataset(imgs[te], labels[te], classes))


def load_lfw_faces_dataset(seed: int = 0) -> tuple[TensorImageDataset, TensorImageDataset]:
    """(train, test) from the Labeled Faces in the Wild subset that scikit-image ships
    (``skimage.data.lfw_subset``: 200 grey 25x25 photographs, 100 faces then 100 non-faces, no
    download): a fixed class-stratified ``DIGITS_TEST`` share is the test split. Another domain
    than the handwriting and product photos of the other built-ins (photographs, 2 classes)."""
    try:
        from skimage.data import lfw_subset
    except ImportError:
        raise NascompressError("the lfw-faces dataset is read from scikit-image's bundled data: "
                               "pip install 'scikit-image>=0.24,<1' (or nascompress[datasets])") from None
    x = lfw_subset()  # (200, 25, 25) floats in [0, 1]
    imgs = torch.from_numpy((x * 255.0).round().clip(0, 255).astype("uint8"))[:, None]
    labels = torch.cat([torch.zeros(100, dtype=torch.long), torch.ones(len(x) - 100, dtype=torch.long)])
    test_idx = set(stratified_indices(labels, int(round(DIGITS_TEST * len(labels))), seed=seed).tolist())
    tr = [i for i in range(len(labels)) if i not in test_idx]
    te = sorted(test_idx)
    classes = ["face", "non-face"]
    return (TensorImageDataset(imgs[tr], labels[tr], classes), TensorImageDataset(imgs[te], labels[te], classes))


def keep_classes(ds: Dataset | None, keep: Sequence[int]) -> Dataset | None:
    """``ds`` (a split as loaded: in-memory images or an ImageFolder) with only the classes at
    indices ``keep``, relabelled 0..len(keep)-1 in that order."""
    if ds is None:
        return None
    new = {old: i for i, old in enumerate(keep)}
    names = [ds.classes[k] for k in keep]
    if isinstance(ds, TensorImageDataset):
        sel = torch.isin(ds.labels, torch.as_tensor(list(keep)))
        labels = torch.as_tensor([new[int(v)] for v in ds.labels[sel]], dtype=torch.long)
        return TensorImageDataset(ds.images[sel], labels, names)
    out = copy.copy(ds)  # torchvision's ImageFolder: (path, target) samples
    out.samples = [(p, new[t]) for p, t in ds.samples if t in new]
    out.imgs, out.targets = out.samples, [t for _, t in out.samples]
    out.classes, out.class_to_idx = names, {c: i for i, c in enumerate(names)}
    return out


def class_indices(spec: str, classes: Sequence[str]) -> list[int]:
    """The class indices ``spec`` names: comma-separated class names or indices, in the order given."""
    out: list[int] = []
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        if tok in classes:
            k = list(classes).index(tok)
        elif tok.isdigit() and int(tok) < len(classes):
            k = int(tok)
        else:
            raise NascompressError(f"--classes names {tok!r}, which is not a class of this dataset; its classes: "
                                   f"{', '.join(classes)} (or their indices 0-{len(classes) - 1})")
        if k in out:
            raise NascompressError(f"--classes names class {classes[k]!r} twice")
        out.append(k)
    if len(out) < 2:
        raise NascompressError(f"--classes must keep at least 2 classes, got {spec!r}")
    return out


def synthetic_dataset(n: int, *, num_classes: int = 10, size: int = 16, channels: int = 1, seed: int = 0) -> TensorImageDataset:
    """Learnable toy images for unit tests only: a class-specific pattern plus noise."""
    g = torch.Generator().manual_seed(seed)
    protos = (torch.rand(num_classes, channels, size, size, generator=torch.Generator().manual_seed(1234)) > 0.5).float()
    labels = torch.arange(n) % num_classes
    noise = torch.rand(n, channels, size, size, generator=g)
    imgs = ((protos[labels] * 0.6 + noise * 0.4) * 255).clamp(0, 255).to(torch.uint8)
    return TensorImageDataset(imgs, labels, [f"class{i}" for i in range(num_classes)])


def folder_transform(spec: InputSpec | None, *, train: bool) -> Any:
    """timm's ImageFolder transform for ``spec``, ending in a uint8 (C, H, W) tensor, unnormalised.

    ``train``: RandomResizedCrop to ``spec.img_size`` + horizontal flip (colour jitter off; see the
    module docstring); else resize the shorter side to ``int(size / crop_pct)`` and centre-crop.
    Without a spec the image is only converted (native size).
    """
    from . import _compat  # noqa: F401  (before torchvision)

    if spec is None:
        from torchvision import transforms

        return transforms.PILToTensor()
    from timm.data import create_transform

    if train:
        return create_transform(tuple(spec.img_size), is_training=True, interpolation=spec.interpolation,
                                hflip=0.5, color_jitter=None, normalize=False)
    return create_transform(tuple(spec.img_size), is_training=False, interpolation=spec.interpolation,
                            crop_pct=spec.crop_pct, crop_mode=spec.crop_mode, normalize=False)


def eval_steps(spec: InputSpec) -> list[dict[str, Any]]:
    """The evaluation transform of ``spec`` as explicit steps (an export's sidecar), for code without
    timm or torch: exactly what :func:`folder_transform` (timm's eval transform) and
    :func:`preprocess` do to an image file. In-memory datasets (Fashion-MNIST) were square images
    resized whole, which these steps also do for a square image."""
    h, w = spec.img_size
    scale = (math.floor(h / spec.crop_pct), math.floor(w / spec.crop_pct))  # timm: floor(size / crop_pct)
    steps: list[dict[str, Any]] = [{"op": "decode", "mode": "RGB", "dtype": "uint8",
                                    "note": "8-bit RGB (a grey image repeated to 3 channels)"}]
    if spec.crop_mode == "squash":
        steps.append({"op": "resize", "size": list(scale), "interpolation": spec.interpolation,
                      "note": "to exactly (height, width), PIL's filter of that name (antialiased)"})
    elif spec.crop_mode == "center" and scale[0] == scale[1]:
        steps.append({"op": "resize", "shorter_side": scale[0], "interpolation": spec.interpolation,
                      "note": "shorter side to shorter_side, longer side to int(shorter_side * long / short) "
                              "(truncated), PIL's filter of that name (antialiased)"})
    else:
        steps.append({"op": "resize_keep_ratio", "size": list(scale), "interpolation": spec.interpolation,
                      "longest": 1.0 if spec.crop_mode == "border" else 0.0,
                      "note": "timm.data.ResizeKeepRatio (aspect kept; border: fit the longest side)"})
    steps.append({"op": "center_crop", "size": [h, w],
                  "note": "top = round((H - height) / 2), left = round((W - width) / 2)"
                          + ("; pad with the mean colour where smaller" if spec.crop_mode == "border" else "")})
    steps.append({"op": "scale", "factor": 1 / 255, "note": "to float32 in [0, 1]"})
    if spec.in_chans == 1:
        steps.append({"op": "to_grey", "note": "mean of the R, G, B channels"})
    steps.append({"op": "normalize", "mean": list(spec.mean), "std": list(spec.std),
                  "note": "(x - mean) / std per channel"})
    steps.append({"op": "layout", "to": "NCHW", "note": "channels first, a batch dimension in front"})
    return steps


def _walk_class(folder: str) -> list[str]:
    """The image files under class folder ``folder`` in torchvision's order (folders by path, files
    by name), symlinks followed, hidden files and folders (``.ipynb_checkpoints``) left out. A link
    back to a folder that contains it (a loop) or a second way into one folder is refused in one
    line, instead of walking forever."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    top = os.path.realpath(folder)
    seen: dict[str, str] = {}
    found: list[tuple[str, list[str]]] = []
    stack = [folder]
    while stack:
        d = stack.pop()
        real = os.path.realpath(d)
        if d != folder and (top == real or top.startswith(real.rstrip(os.sep) + os.sep)):
            raise NascompressError(f"{d} is a symlink to {real}, a folder that contains it (a loop): remove the link "
                                   "from the dataset")
        if real in seen:
            raise NascompressError(f"{d} leads to {real}, already read as {seen[real]} (two links to one folder, or a "
                                   "loop): remove one of them from the dataset")
        seen[real] = d
        files, dirs = [], []
        try:
            entries = list(os.scandir(d))
        except OSError as e:
            raise NascompressError(f"cannot read dataset folder {d}: {e.strerror or e}") from None
        for e in entries:
            if e.name.startswith("."):
                continue
            try:
                is_dir = e.is_dir(follow_symlinks=True)
            except OSError:
                is_dir = False
            if is_dir:
                dirs.append(e.path)
            elif e.name.lower().endswith(IMG_EXTENSIONS):
                files.append(e.name)
        found.append((d, sorted(files)))
        stack.extend(dirs)
    return [os.path.join(d, f) for d, files in sorted(found) for f in files]


def folder_classes(directory: str | Path) -> list[str]:
    """The class folders of an ImageFolder split, sorted: its sub-folders (links followed) but the
    hidden ones (``.ipynb_checkpoints``); two that are one folder (a link to another class) are
    refused in one line."""
    try:
        entries = [e for e in os.scandir(directory) if not e.name.startswith(".") and e.is_dir()]
    except OSError as e:
        raise NascompressError(f"cannot read dataset folder {directory}: {e.strerror or e}") from None
    classes = sorted(e.name for e in entries)
    real: dict[str, str] = {}
    for c in classes:
        r = os.path.realpath(os.path.join(directory, c))
        if r in real:
            raise NascompressError(f"class folders {real[r]!r} and {c!r} of {directory} are the same folder ({r}; one "
                                   "is a link to the other): remove one, a class must be one folder")
        real[r] = c
    return classes


_FOLDER_CLASS: list[type] = []


def _folder_class() -> type:
    """torchvision's ImageFolder with :func:`_walk_class` finding its classes and files (made on
    first use: torchvision is imported after :mod:`nascompress._compat`)."""
    if _FOLDER_CLASS:
        return _FOLDER_CLASS[0]
    from . import _compat  # noqa: F401
    from torchvision import datasets

    class _Folder(datasets.ImageFolder):
        @staticmethod
        def find_classes(directory: Any) -> tuple[list[str], dict[str, int]]:
            classes = folder_classes(directory)
            if not classes:
                raise NascompressError(f"{directory} is not an ImageFolder directory with one folder per class "
                                       "(it has no class folder)")
            return classes, {c: i for i, c in enumerate(classes)}

        @staticmethod
        def make_dataset(directory: Any, class_to_idx: dict[str, int], extensions: Any = None,
                         is_valid_file: Any = None, allow_empty: bool = False) -> list[tuple[str, int]]:
            return [(p, class_to_idx[c]) for c in sorted(class_to_idx)
                    for p in _walk_class(os.path.join(str(directory), c))]

    _Folder.__module__, _Folder.__qualname__ = __name__, "_Folder"  # picklable (DataLoader workers)
    _FOLDER_CLASS.append(_Folder)
    return _Folder


def __getattr__(name: str) -> Any:  # nascompress.data._Folder, for pickle in a worker process
    if name == "_Folder":
        return _folder_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _image_folder(path: Path, transform: Any) -> Dataset:
    """An ImageFolder over ``path`` (:func:`_folder_class`): hidden folders are no class, a class
    folder that is a link to another one is refused, links are followed without loops."""
    # empty class folders are allowed here and refused by check_classes, naming the class
    return _folder_class()(str(path), transform=transform, allow_empty=True)


TOO_LARGE = "too large"


def _unreadable(path: str, max_pixels: int | None = None) -> str | None:
    """Why the image at ``path`` cannot be read as the loader reads it (None: it can); an image
    above ``max_pixels`` (default: the limit :mod:`nascompress.limits` sets) is refused from its
    header, before it is decoded."""
    from PIL import Image

    from .limits import env_name, limits

    max_pixels = max_pixels or limits().max_image_pixels
    big = (f"{TOO_LARGE}: {{}} pixels, above the limit of {max_pixels:,} (max_image_pixels); shrink it, or raise "
           f"the limit with {env_name('max_image_pixels')}=N")
    try:
        with Image.open(path) as im:
            w, h = im.size
            if w * h > max_pixels:
                return big.format(f"{w}x{h} = {w * h:,}")
            if im.format == "JPEG":
                im.draft("RGB", (1, 1))  # decode at 1/8 scale: every byte is still read, 64x less work
            im.load()
        return None
    except Image.DecompressionBombError:  # above PIL's own limit: refused by Image.open from the header
        return big.format(f"more than {2 * (Image.MAX_IMAGE_PIXELS or 0):,}")
    except Exception as e:  # noqa: BLE001 (PIL raises OSError, SyntaxError, ValueError...)
        msg = str(e).split(" <", 1)[0] if "cannot identify image file" in str(e) else str(e)
        return msg or "it cannot be decoded"


_SCANNED: dict[tuple[str, int, int, int], str | None] = {}  # (path, size, mtime, max pixels) -> reason: a file is decoded once per process
_REPORTED: set[str] = set()  # folders whose skipped images were reported (once per process)


def _stat_key(path: str, max_pixels: int) -> tuple[str, int, int, int]:
    try:
        st = os.stat(path)
        return path, st.st_size, st.st_mtime_ns, max_pixels
    except OSError:
        return path, -1, -1, max_pixels


def scan_images(paths: Sequence[str], *, workers: int | None = None) -> dict[str, str]:
    """The unreadable images among ``paths`` (path -> reason), each decoded once as the loader
    would (JPEGs at 1/8 scale), in ``workers`` threads (default ``min(8, cpu count)``). Results are
    kept for the process (keyed by path, size and modification time), so the stages of one
    pipeline scan a dataset once."""
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image

    from .limits import limits

    # the size check below replaces PIL's warning (a raw DecompressionBombWarning on the terminal)
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    max_pixels = limits().max_image_pixels
    keys = [_stat_key(p, max_pixels) for p in paths]
    todo = [k for k in keys if k not in _SCANNED]
    if todo:
        workers = workers or min(8, os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for k, r in zip(todo, pool.map(partial(_unreadable, max_pixels=max_pixels), [k[0] for k in todo],
                                           chunksize=64)):
                _SCANNED[k] = r
    return {k[0]: _SCANNED[k] for k in keys if _SCANNED[k] is not None}


def _drop_bad(ds: Any, where: Path, *, skip: bool, skipped: dict[str, int]) -> None:
    """Scan an ImageFolder's files; refuse unreadable ones in one line, or (``skip``) leave them out."""
    bad = scan_images([p for p, _ in ds.samples])
    if not bad:
        return
    first, why = next(iter(bad.items()))
    if not skip:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        what = "image" if why.startswith(TOO_LARGE) else "unreadable image"
        raise NascompressError(f"{what} {first} ({why}){more} in {where}: fix or remove it, or pass "
                               "--skip-bad-images to leave unreadable images out")
    ds.samples = [s for s in ds.samples if s[0] not in bad]
    ds.imgs, ds.targets = ds.samples, [t for _, t in ds.samples]
    skipped[str(where)] = len(bad)
    if str(where) in _REPORTED:
        return
    _REPORTED.add(str(where))
    from .progress import console

    console.print(f"skipped {len(bad)} unreadable image(s) in {where} (--skip-bad-images), e.g. {first}: {why}",
                  highlight=False, style="yellow")


def check_classes(classes: Sequence[str], splits: dict[str, Any], *, name: str) -> None:
    """A classifier needs at least two classes, each with an image in every split.

    Args:
        classes: the class names.
        splits: split label (as the message names it) -> its labels (a sequence of class ids).
        name: the dataset, as the message names it.
    """
    if len(classes) < 2:
        raise NascompressError(f"dataset {name} has {len(classes)} class{'' if len(classes) == 1 else 'es'}"
                               f"{' (' + classes[0] + ')' if classes else ''}: a classifier needs at least two; add a "
                               "folder of images per class")
    for split, labels in splits.items():
        have = set(torch.as_tensor(labels, dtype=torch.long).tolist())
        empty = [c for i, c in enumerate(classes) if i not in have]
        if empty:
            more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
            raise NascompressError(f"class {empty[0]!r}{more} of dataset {name} has no image in {split}: every class "
                                   "needs images in every split; add images or remove the class folder")


def _view(ds: Dataset, transform: Any) -> Dataset:
    """The same ImageFolder (same files, same order) read through another transform."""
    other = copy.copy(ds)
    other.transform = transform
    return other


@dataclass(frozen=True)
class DataConfig:
    """Which dataset and which splits.

    Args:
        dataset: ``fashion-mnist`` (default, real), ``digits`` (scikit-learn's bundled 8x8
            digits, real), a path to an ImageFolder root holding ``train/`` (and optionally
            ``val/``, ``test/``), or ``synthetic`` (unit tests).
        data_dir: where Fashion-MNIST's IDX files are.
        val_fraction: share of train carved out as a held-out validation split when the
            dataset has none.
        split_seed: seed of that split (fixed, independent of the run's seed).
        train_limit / eval_limit: use only N train / val and test images (quick runs): a
            class-stratified random subset drawn with ``subset_seed`` (:func:`stratified_indices`).
        subset_seed: seed of those subsets (the CLI sets it from the command's ``--seed``).
        num_workers: DataLoader worker processes for the splits (decoding images); None: up to 4
            (``min(4, os.cpu_count())``) for ImageFolder, 0 for in-memory datasets. Applied by
            :func:`make_loader` to every loader over the splits unless it is given its own.
        skip_bad_images: leave unreadable ImageFolder images out (counted) instead of refusing
            the dataset (:func:`scan_images`).
        classes: keep only these classes (comma-separated names or indices; :func:`class_indices`),
            relabelled 0..k-1 in the order given, in every split (:func:`keep_classes`); None: all.
    """

    # Fields declared with setting() are the user's: `train` options and `data` keys of the pipeline
    # file (a path there is resolved against the file's directory, but for the keywords).
    dataset: str = setting("fashion-mnist", path=True, keywords=DATASET_KEYWORDS, help=(
        "'fashion-mnist', 'digits' (scikit-learn's bundled 8x8 digits) or an ImageFolder root with train/ (val/, test/)."))
    data_dir: str = setting(str(FMNIST_DIR), path=True, help="Where Fashion-MNIST's IDX files are.")
    val_fraction: float = setting(0.1, lo=0, hi=1, lo_open=True, hi_open=True, help=(
        "Share of train held out for validation."))
    split_seed: int = 0
    train_limit: int | None = setting(None, lo=1, help=(
        "Use N training images (a class-stratified random subset drawn with --seed)."))
    eval_limit: int | None = setting(None, lo=1, help="Use N val/test images (class-stratified, drawn with --seed).")
    subset_seed: int = 0
    num_workers: int | None = setting(None, lo=0, help=(
        "DataLoader workers (default: up to 4 for ImageFolder, 0 in memory)."))
    skip_bad_images: bool = setting(False, help=(
        "ImageFolder: leave unreadable images out (counted) instead of refusing the dataset."))
    classes: str | None = setting(None, help=(
        "Keep only these classes (comma-separated names or indices, e.g. 0,1,2,3,4), relabelled in that order."))

    def __post_init__(self) -> None:
        check_settings(self)  # every setting() against its declaration
        # paths are kept absolute (a run's config.json records them: evaluate/finetune/--resume from
        # another directory read the same data)
        for name in ("dataset", "data_dir"):
            v = getattr(self, name)
            if isinstance(v, str) and v not in DATASET_KEYWORDS:
                object.__setattr__(self, name, os.path.abspath(os.path.expanduser(v)))
        check_int("--seed", self.subset_seed, 0, SEED_MAX)  # the subsets' seed is the command's --seed


@dataclass
class DataBundle:
    train: Dataset
    val: Dataset
    test: Dataset
    classes: list[str]
    name: str
    native_channels: int
    native_size: tuple[int, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def split(self, name: str) -> Dataset:
        if name not in ("train", "val", "test"):
            raise NascompressError(f"unknown split {name!r}; use train, val or test")
        return getattr(self, name)


def _limit(ds: Dataset, n: int | None, seed: int) -> Dataset:
    """A seeded, class-stratified random subset of ``n`` items (all of ``ds`` if n is None or larger)."""
    if n is None or n >= len(ds):
        return ds
    return Subset(ds, stratified_indices(dataset_labels(ds), n, seed=seed))


def load_data(cfg: DataConfig, *, img_size: tuple[int, int] | None = None, spec: InputSpec | None = None,
              augment: bool = True) -> DataBundle:
    """Load the dataset ``cfg`` names, with a deterministic held-out validation split.

    Args:
        cfg: which dataset, splits, limits and workers.
        img_size: the model's input size (ImageFolder images are resized/cropped to it while
            loading; in-memory images keep their size and :func:`preprocess` resizes batches).
        spec: the model's preprocessing; gives ImageFolder its size, interpolation and eval crop
            (preferred over ``img_size``, which then defaults to ``spec.img_size``).
        augment: give an ImageFolder training split timm's training transform (False: the eval
            transform, e.g. for extracting features).
    """
    if spec is None and img_size is not None:  # old callers: only a size; timm's defaults otherwise
        spec = InputSpec(tuple(img_size), 3, (0.5,), (0.5,))
    workers = cfg.num_workers
    skipped: dict[str, int] = {}
    if cfg.dataset == "fashion-mnist":
        train_full, test = load_fashion_mnist(Path(cfg.data_dir))
        val = None
        name, channels, size = "fashion-mnist", 1, (28, 28)
    elif cfg.dataset == "digits":
        train_full, test = load_digits_dataset(cfg.split_seed)
        val = None
        name, channels, size = "digits", 1, (8, 8)
    elif cfg.dataset == "lfw-faces":
        train_full, test = load_lfw_faces_dataset(cfg.split_seed)
        val = None
        name, channels, size = "lfw-faces", 1, (25, 25)
    elif cfg.dataset == "synthetic":
        train_full = synthetic_dataset(600, seed=cfg.split_seed)
        test = synthetic_dataset(200, seed=cfg.split_seed + 1)
        val = None
        name, channels, size = "synthetic", 1, (16, 16)
    else:
        root = Path(cfg.dataset)
        if not root.is_dir():
            raise NascompressError(f"dataset {cfg.dataset} does not exist (neither a built-in dataset "
                                   f"({BUILTIN_DATASETS}) nor an existing directory); if the data moved, give its new "
                                   "place with --dataset PATH")
        if not (root / "train").is_dir():
            raise NascompressError(f"ImageFolder dataset {root} has no train/ folder (expected {root}/train/<class>/*.png)")
        eval_tf = folder_transform(spec, train=False)
        train_tf = folder_transform(spec, train=augment)
        # the train split's images seen as evaluation images (a val split carved from train/)
        train_full = _image_folder(root / "train", eval_tf)
        val = _image_folder(root / "val", eval_tf) if (root / "val").is_dir() else None
        test = _image_folder(root / "test", eval_tf) if (root / "test").is_dir() else val
        for part, ds in (("val", val), ("test", test)):
            if ds is not None and ds.classes != train_full.classes:
                raise NascompressError(f"{root}/{part} has classes {ds.classes} but train has {train_full.classes}")
        if len(train_full) == 0:
            raise NascompressError(f"{root}/train holds no images")
        for part, ds in (("train", train_full), ("val", val), ("test", test if test is not val else None)):
            if ds is not None:
                _drop_bad(ds, root / part, skip=cfg.skip_bad_images, skipped=skipped)
        check_classes(train_full.classes, {f"{root}/{p}": ds.targets for p, ds in
                                           (("train", train_full), ("val", val), ("test", test)) if ds is not None},
                      name=str(root))
        name, channels, size = str(root), 3, None  # ImageFolder decodes every image to RGB
        if workers is None:
            workers = min(4, os.cpu_count() or 1)
    if cfg.classes is not None:
        keep = class_indices(cfg.classes, train_full.classes)
        test_is_val_split = test is val
        train_full, val = keep_classes(train_full, keep), keep_classes(val, keep)
        test = val if test_is_val_split else keep_classes(test, keep)
    train_src = train_full if cfg.dataset in IN_MEMORY else _view(train_full, train_tf)
    if val is None:  # the same split indices over two views: train transform / eval transform
        tr_idx, va_idx = split_indices(len(train_full), (1 - cfg.val_fraction, cfg.val_fraction), seed=cfg.split_seed)
        train, val = Subset(train_src, tr_idx), Subset(train_full, va_idx)
        check_classes(train_full.classes, {"the training split": dataset_labels(train),
                                           f"the validation split carved from the training images (val_fraction "
                                           f"{cfg.val_fraction:g}; add a val/ folder or more images)": dataset_labels(val)},
                      name=name)
    else:
        train = train_src
    test_is_val = test is None or test is val
    train = _limit(train, cfg.train_limit, cfg.subset_seed)
    val = _limit(val, cfg.eval_limit, cfg.subset_seed)
    test = val if test_is_val else _limit(test, cfg.eval_limit, cfg.subset_seed)
    for ds in (train, val, test):
        ds.num_workers = workers or 0  # read by make_loader (see DataConfig.num_workers)
    return DataBundle(train=train, val=val, test=test, classes=list(train_full.classes), name=name,
                      native_channels=channels, native_size=size,
                      extra={"skipped_images": skipped} if skipped else {})


def _batched_collate(batch):
    # Datasets with __getitems__ already return (images, labels); ImageFolder returns a list.
    if isinstance(batch, tuple):
        return batch
    xs, ys = zip(*batch)
    return torch.stack(xs), torch.as_tensor(ys)


def make_loader(ds: Dataset, *, batch_size: int, shuffle: bool, seed: int = 0, epoch: int = 0,
                drop_last: bool = False, num_workers: int | None = None,
                shard: tuple[int, int] = (0, 1), pin_memory: bool = False) -> DataLoader:
    """A DataLoader whose order depends only on (seed, epoch): resuming replays the same order.

    ``shard=(rank, world)`` (data-parallel training, :mod:`nascompress.distributed`): this rank's
    part of that order, every ``world``-th item from ``rank``, the order first cut to a multiple of
    ``world`` so that every rank gets as many items (and batches).

    ``num_workers`` None (the default) takes the ``num_workers`` attribute that :func:`load_data`
    sets on every split (from :attr:`DataConfig.num_workers`: worker processes for ImageFolder,
    none for in-memory datasets), else 0; so every loader over a split decodes images in
    parallel without its caller knowing. With workers, their random augmentation draws are
    seeded from (seed, epoch) too. ``pin_memory``: batches in page-locked memory, for non-blocking
    copies to a GPU (set by the callers that train or evaluate on CUDA).
    """
    if num_workers is None:
        num_workers = int(getattr(ds, "num_workers", 0) or 0)
    if shuffle:
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(len(ds), generator=g).tolist()
    else:
        order = list(range(len(ds)))
    rank, world = shard
    if world > 1:
        order = order[:len(order) - len(order) % world][rank::world]
    sampler = BatchSampler(order, batch_size=batch_size, drop_last=drop_last)
    extra: dict[str, Any] = {}
    if num_workers > 0:  # (without workers the generator is not passed: the global RNG stream stays as before)
        extra["generator"] = torch.Generator().manual_seed(seed * 100_003 + epoch + 7_919 + rank * 1_000_003)
    return DataLoader(ds, batch_sampler=sampler, collate_fn=_batched_collate, num_workers=num_workers,
                      pin_memory=pin_memory and torch.cuda.is_available(), **extra)
