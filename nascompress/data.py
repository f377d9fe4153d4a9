"""Real datasets (Fashion-MNIST from the Debian package, any ImageFolder directory), the
deterministic splits, and batched preprocessing to a model's input size.

Images reach the model as float tensors (B, C, H, W), resized to the model's ``img_size``,
converted to its ``in_chans`` (grey repeated to 3 channels, RGB averaged to 1) and normalised
with the mean/std recorded in ``arch.json``'s ``input`` section.
"""
from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, Dataset

from .errors import NascompressError

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FMNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                  "Sneaker", "Bag", "Ankle boot"]
FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class InputSpec:
    """How raw images become model input. Recorded in arch.json as ``input``."""

    img_size: tuple[int, int]
    in_chans: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"img_size": list(self.img_size), "in_chans": self.in_chans, "mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "InputSpec":
        return cls(tuple(d["img_size"]), int(d["in_chans"]), tuple(d["mean"]), tuple(d["std"]))


def default_norm(dataset: str, in_chans: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if dataset in ("fashion-mnist", "synthetic"):
        return (FMNIST_MEAN,) * in_chans, (FMNIST_STD,) * in_chans
    if in_chans == 3:
        return IMAGENET_MEAN, IMAGENET_STD
    return (0.5,) * in_chans, (0.5,) * in_chans


def preprocess(images: torch.Tensor, spec: InputSpec) -> torch.Tensor:
    """uint8 (B, C, H, W) or float in [0, 1] -> normalised float (B, spec.in_chans, *img_size)."""
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
        x = F.interpolate(x, size=tuple(spec.img_size), mode="bilinear", align_corners=False, antialias=True)
    mean = torch.tensor(spec.mean, dtype=x.dtype).view(1, -1, 1, 1)
    std = torch.tensor(spec.std, dtype=x.dtype).view(1, -1, 1, 1)
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

    def __len__(self) -> int:
        return len(self.indices)

    def __getitems__(self, idx: list[int]):
        mapped = self.indices[torch.as_tensor(idx, dtype=torch.long)].tolist()
        if hasattr(self.base, "__getitems__"):
            return self.base.__getitems__(mapped)
        return [self.base[j] for j in mapped]

    def __getitem__(self, i: int):
        return self.base[int(self.indices[i])]


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


def synthetic_dataset(n: int, *, num_classes: int = 10, size: int = 16, channels: int = 1, seed: int = 0) -> TensorImageDataset:
    """Learnable toy images for unit tests only: a class-specific pattern plus noise."""
    g = torch.Generator().manual_seed(seed)
    protos = (torch.rand(num_classes, channels, size, size, generator=torch.Generator().manual_seed(1234)) > 0.5).float()
    labels = torch.arange(n) % num_classes
    noise = torch.rand(n, channels, size, size, generator=g)
    imgs = ((protos[labels] * 0.6 + noise * 0.4) * 255).clamp(0, 255).to(torch.uint8)
    return TensorImageDataset(imgs, labels, [f"class{i}" for i in range(num_classes)])


def _image_folder(path: Path, spec_size: tuple[int, int] | None) -> Dataset:
    from torchvision import datasets, transforms

    from . import _compat  # noqa: F401

    tfm = [transforms.PILToTensor()]
    if spec_size is not None:
        tfm.insert(0, transforms.Resize(spec_size))
    try:
        ds = datasets.ImageFolder(str(path), transform=transforms.Compose(tfm))
    except (FileNotFoundError, RuntimeError) as e:
        raise NascompressError(f"{path} is not an ImageFolder directory with one folder per class ({e})") from e
    return ds


@dataclass(frozen=True)
class DataConfig:
    """Which dataset and which splits.

    Args:
        dataset: ``fashion-mnist`` (default, real), a path to an ImageFolder root holding
            ``train/`` (and optionally ``val/``, ``test/``), or ``synthetic`` (unit tests).
        data_dir: where Fashion-MNIST's IDX files are.
        val_fraction: share of train carved out as a held-out validation split when the
            dataset has none.
        split_seed: seed of that split (fixed, independent of the run's seed).
        train_limit / eval_limit: use only the first N train / evaluation images (quick runs).
    """

    dataset: str = "fashion-mnist"
    data_dir: str = str(FMNIST_DIR)
    val_fraction: float = 0.1
    split_seed: int = 0
    train_limit: int | None = None
    eval_limit: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.val_fraction < 1:
            raise NascompressError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")


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


def _limit(ds: Dataset, n: int | None) -> Dataset:
    return ds if n is None or n >= len(ds) else Subset(ds, torch.arange(n))


def load_data(cfg: DataConfig, *, img_size: tuple[int, int] | None = None) -> DataBundle:
    """Load the dataset ``cfg`` names, with a deterministic held-out validation split."""
    if cfg.dataset == "fashion-mnist":
        train_full, test = load_fashion_mnist(Path(cfg.data_dir))
        val = None
        name, channels, size = "fashion-mnist", 1, (28, 28)
    elif cfg.dataset == "synthetic":
        train_full = synthetic_dataset(600, seed=cfg.split_seed)
        test = synthetic_dataset(200, seed=cfg.split_seed + 1)
        val = None
        name, channels, size = "synthetic", 1, (16, 16)
    else:
        root = Path(cfg.dataset)
        if not root.is_dir():
            raise NascompressError(f"dataset {cfg.dataset!r} is neither 'fashion-mnist' nor an existing directory")
        if not (root / "train").is_dir():
            raise NascompressError(f"ImageFolder dataset {root} has no train/ folder (expected {root}/train/<class>/*.png)")
        train_full = _image_folder(root / "train", img_size)
        val = _image_folder(root / "val", img_size) if (root / "val").is_dir() else None
        test = _image_folder(root / "test", img_size) if (root / "test").is_dir() else val
        for part, ds in (("val", val), ("test", test)):
            if ds is not None and ds.classes != train_full.classes:
                raise NascompressError(f"{root}/{part} has classes {ds.classes} but train has {train_full.classes}")
        x0, _ = train_full[0]
        name, channels, size = str(root), int(x0.shape[0]), None
    if val is None:
        tr_idx, va_idx = split_indices(len(train_full), (1 - cfg.val_fraction, cfg.val_fraction), seed=cfg.split_seed)
        train, val = Subset(train_full, tr_idx), Subset(train_full, va_idx)
    else:
        train = train_full
    if test is None:
        test = val
    return DataBundle(train=_limit(train, cfg.train_limit), val=_limit(val, cfg.eval_limit),
                      test=_limit(test, cfg.eval_limit), classes=list(train_full.classes), name=name,
                      native_channels=channels, native_size=size)


def _batched_collate(batch):
    # Datasets with __getitems__ already return (images, labels); ImageFolder returns a list.
    if isinstance(batch, tuple):
        return batch
    xs, ys = zip(*batch)
    return torch.stack(xs), torch.as_tensor(ys)


def make_loader(ds: Dataset, *, batch_size: int, shuffle: bool, seed: int = 0, epoch: int = 0,
                drop_last: bool = False, num_workers: int = 0) -> DataLoader:
    """A DataLoader whose order depends only on (seed, epoch): resuming replays the same order."""
    if shuffle:
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(len(ds), generator=g).tolist()
    else:
        order = list(range(len(ds)))
    sampler = BatchSampler(order, batch_size=batch_size, drop_last=drop_last)
    return DataLoader(ds, batch_sampler=sampler, collate_fn=_batched_collate, num_workers=num_workers)
