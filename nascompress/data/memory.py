"""A caller's own data in memory (the Python API, :mod:`nascompress.pyapi`): any map-style
``torch.utils.data.Dataset`` of ``(image tensor, label)`` pairs, or a ``DataLoader`` over one,
registered under a name (``python:<fingerprint>``) that :class:`~nascompress.data.DataConfig` and
:func:`~nascompress.data.load_data` read like a built-in dataset's, so every stage (the same
functions the commands run) loads it as it loads Fashion-MNIST.

The images are the caller's: already decoded, resized and normalised as their model expects
(float ``(C, H, W)`` tensors; uint8 ones are scaled to [0, 1]). The models made from such data
record an identity normalisation (mean 0, std 1: :func:`caller_input`), and the run's data section
names the registered dataset, so that a reader knows the preprocessing was the caller's. A name
lives in the process that registered it; the same data registered again (e.g. to continue a run
with ``out=``) gets the same name: the fingerprint is the splits' lengths, types and a few items.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .sources import MEMORY_DATASETS, MEMORY_PREFIX
from ..errors import NascompressError


class CallerDataset(Dataset):
    """A caller's map-style dataset seen as nascompress's splits are: ``labels`` (read once),
    ``classes``, and items ``(float or uint8 image tensor (C, H, W), int label)``."""

    def __init__(self, base: Dataset, *, classes: Sequence[str] | None = None, what: str = "the dataset"):
        if isinstance(base, IterableDataset) or not hasattr(base, "__getitem__") or not hasattr(base, "__len__"):
            raise NascompressError(
                f"{what} must be a map-style torch Dataset (with __len__ and __getitem__) of "
                f"(image tensor, label) pairs, got {type(base).__name__}"
            )
        if len(base) == 0:
            raise NascompressError(f"{what} holds no images")
        self.base, self.what = base, what
        labels = getattr(base, "targets", None)
        if labels is None:
            labels = [self._label(self._item(i)[1]) for i in range(len(base))]
        self.labels = torch.as_tensor(list(labels), dtype=torch.long)
        self.classes = list(classes) if classes is not None else list(getattr(base, "classes", None) or [])
        if not self.classes:
            self.classes = [str(i) for i in range(int(self.labels.max()) + 1)]
        self.shape = tuple(self._item(0)[0].shape)

    def _item(self, i: int) -> tuple[torch.Tensor, Any]:
        item = self.base[i]
        if not isinstance(item, (tuple, list)) or len(item) < 2:
            raise NascompressError(
                f"{self.what} must give (image tensor, label) pairs; item {i} is a {type(item).__name__}"
            )
        x = item[0]
        if not isinstance(x, torch.Tensor) or x.ndim != 3:
            raise NascompressError(
                f"{self.what} gives {type(x).__name__} images; give (C, H, W) tensors (the "
                "preprocessing is the caller's: e.g. a torchvision transform ending in ToTensor "
                "and Normalize)"
            )
        return x, item[1]

    @staticmethod
    def _label(y: Any) -> int:
        return int(y.item() if isinstance(y, torch.Tensor) else y)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = self._item(int(i))
        return x, self._label(y)

    def __getitems__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch at once, as the built-in datasets give it: (images (B, C, H, W), labels (B,))."""
        items = [self._item(int(i)) for i in idx]
        try:
            images = torch.stack([x for x, _ in items])
        except RuntimeError:
            raise NascompressError(
                f"{self.what} gives images of different shapes; give them at one size "
                "(the preprocessing is the caller's)"
            ) from None
        return images, torch.as_tensor([self._label(y) for _, y in items], dtype=torch.long)


@dataclass(frozen=True)
class MemorySplits:
    """A registered dataset: train, and val / test where the caller gave them (None: carved from
    train / the validation split, as for the built-in datasets)."""

    train: CallerDataset
    val: CallerDataset | None
    test: CallerDataset | None
    in_chans: int
    size: tuple[int, int]

    @property
    def classes(self) -> list[str]:
        return self.train.classes


def as_dataset(data: Any, what: str) -> Dataset:
    """The map-style dataset of ``data`` (a Dataset, or a DataLoader over one)."""
    return data.dataset if isinstance(data, DataLoader) else data


def _fingerprint(ds: CallerDataset) -> str:
    h = hashlib.sha256(f"{type(ds.base).__qualname__}:{len(ds)}:{ds.classes}".encode())
    h.update(ds.labels.numpy().tobytes())
    for i in sorted({0, len(ds) // 2, len(ds) - 1}):
        h.update(ds[i][0].detach().cpu().contiguous().float().numpy().tobytes())
    return h.hexdigest()[:16]


def register_dataset(train: Any, val: Any = None, test: Any = None, *, classes: Sequence[str] | None = None) -> str:
    """Register the caller's splits; returns the dataset name a DataConfig takes (``python:...``).
    ``val`` None: a validation split is carved from ``train`` (``DataConfig.val_fraction``);
    ``test`` None: the validation split is the test split."""
    tr = CallerDataset(as_dataset(train, "train"), classes=classes, what="train")
    splits = [tr]
    for name, d in (("val", val), ("test", test)):
        splits.append(None if d is None else CallerDataset(as_dataset(d, name), classes=tr.classes, what=name))
    va, te = splits[1], splits[2]
    for name, d in (("val", va), ("test", te)):
        if d is not None and d.shape != tr.shape:
            raise NascompressError(f"{name} images have shape {d.shape} but train's have {tr.shape}")
        if d is not None and int(d.labels.max()) >= len(tr.classes):
            raise NascompressError(f"{name} has label {int(d.labels.max())} but train has {len(tr.classes)} classes")
    key = hashlib.sha256("/".join(_fingerprint(d) if d is not None else "-" for d in splits).encode()).hexdigest()[:16]
    name = f"{MEMORY_PREFIX}{key}"
    if name not in MEMORY_DATASETS:
        MEMORY_DATASETS[name] = MemorySplits(tr, va, te, in_chans=tr.shape[0], size=(tr.shape[1], tr.shape[2]))
    return name


def memory_splits(name: str) -> MemorySplits:
    """The splits registered as ``name``; a name of another process is refused in one line."""
    if name not in MEMORY_DATASETS:
        raise NascompressError(
            f"dataset {name} was held in memory by the Python API in another process; pass the "
            "same Dataset again (nascompress.compress(..., train=...)) to use it"
        )
    return MEMORY_DATASETS[name]


def is_memory(name: str) -> bool:
    """A name the Python API gives an in-memory dataset (registered in this process or not)."""
    return isinstance(name, str) and name.startswith(MEMORY_PREFIX)


def caller_input(in_chans: int) -> dict[str, Any]:
    """The preprocessing recorded for a model trained on the caller's tensors: none (mean 0,
    std 1, the whole image; images of another size are resized bilinearly)."""
    return {
        "mean": (0.0,) * in_chans,
        "std": (1.0,) * in_chans,
        "interpolation": "bilinear",
        "crop_pct": 1.0,
        "crop_mode": "center",
    }


__all__ = ["CallerDataset", "MemorySplits", "register_dataset", "memory_splits", "is_memory", "caller_input"]
