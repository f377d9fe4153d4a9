"""The built-in datasets, held in memory as uint8 tensors (:class:`TensorImageDataset`: batches are
fetched and resized at once, no augmentation): Fashion-MNIST from the Debian package's IDX files,
scikit-learn's bundled digits and scikit-image's LFW faces (each with a fixed stratified test split),
and learnable synthetic images for unit tests.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .splits import stratified_indices
from ..errors import NascompressError, SettingError

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
MEMORY_PREFIX = "python:"  # the names of the datasets the Python API holds in memory (nascompress.data.memory)
MEMORY_DATASETS: dict[str, Any] = {}  # such a name -> its splits (a MemorySplits), this process only


class DatasetKeywords(tuple):
    """The dataset names that are not a path: the built-in ones, and the in-memory datasets the
    Python API registered in this process (:data:`MEMORY_DATASETS`, names ``python:<fingerprint>``)."""

    def __contains__(self, name: object) -> bool:
        return tuple.__contains__(self, name) or (isinstance(name, str) and name in MEMORY_DATASETS)


DATASET_KEYWORDS = DatasetKeywords(("fashion-mnist", "digits", "lfw-faces", "synthetic"))  # names that are not a path
IN_MEMORY = DATASET_KEYWORDS  # datasets held as uint8 tensors (batched preprocessing, no augmentation)
BUILTIN_DATASETS = "fashion-mnist, digits, lfw-faces"  # the real ones, as error messages name them
FMNIST_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
DIGITS_TEST = 0.25  # share of scikit-learn's digits held out as the test split (it ships no split)


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


def _read_idx(path: Path, header: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if header == 16:
        n, h, w = struct.unpack(">III", raw[4:16])
        return np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(n, 1, h, w)
    return np.frombuffer(raw, dtype=np.uint8, offset=8)


def load_fashion_mnist(root: Path = FMNIST_DIR) -> tuple[TensorImageDataset, TensorImageDataset]:
    """(train 60k, test 10k) from the IDX gzip files of Debian's dataset-fashion-mnist."""
    files = {
        k: root / f"{k}-ubyte.gz"
        for k in ("train-images-idx3", "train-labels-idx1", "t10k-images-idx3", "t10k-labels-idx1")
    }
    missing = [p for p in files.values() if not p.is_file()]
    if missing:
        raise SettingError(
            f"Fashion-MNIST not found ({missing[0]} is missing); install it with "
            "'apt-get update && apt-get install -y dataset-fashion-mnist' or pass {data_dir}"
        )
    try:
        parts = {k: torch.from_numpy(_read_idx(p, 16 if "images" in k else 8).copy()) for k, p in files.items()}
    except (OSError, EOFError, struct.error, ValueError) as e:
        raise NascompressError(
            f"Fashion-MNIST files in {root} are corrupt ({e}); reinstall dataset-fashion-mnist"
        ) from e
    return (
        TensorImageDataset(parts["train-images-idx3"], parts["train-labels-idx1"], FMNIST_CLASSES),
        TensorImageDataset(parts["t10k-images-idx3"], parts["t10k-labels-idx1"], FMNIST_CLASSES),
    )


def fixed_test_split(
    imgs: torch.Tensor, labels: torch.Tensor, classes: list[str], *, seed: int
) -> tuple[TensorImageDataset, TensorImageDataset]:
    """(train, test) of a dataset that ships no split: a fixed class-stratified ``DIGITS_TEST`` share
    (drawn with ``seed``) is the test split, the rest in their order the training split."""
    test_idx = set(stratified_indices(labels, int(round(DIGITS_TEST * len(labels))), seed=seed).tolist())
    tr = [i for i in range(len(labels)) if i not in test_idx]
    te = sorted(test_idx)
    return TensorImageDataset(imgs[tr], labels[tr], classes), TensorImageDataset(imgs[te], labels[te], classes)


def load_digits_dataset(seed: int = 0) -> tuple[TensorImageDataset, TensorImageDataset]:
    """(train, test) from scikit-learn's bundled digits (1,797 8x8 grey images, 10 classes, no
    download): a fixed class-stratified ``DIGITS_TEST`` share is the test split. Pixel values 0-16
    are scaled to 0-255."""
    from sklearn.datasets import load_digits  # only the `digits` dataset; ~40 ms at start-up

    d = load_digits()
    imgs = torch.from_numpy((d.images * (255.0 / 16.0)).round().astype("uint8"))[:, None]  # (N, 1, 8, 8)
    labels = torch.from_numpy(d.target.astype("int64"))
    classes = [str(c) for c in range(10)]
    return fixed_test_split(imgs, labels, classes, seed=seed)


def load_lfw_faces_dataset(seed: int = 0) -> tuple[TensorImageDataset, TensorImageDataset]:
    """(train, test) from the Labeled Faces in the Wild subset that scikit-image ships
    (``skimage.data.lfw_subset``: 200 grey 25x25 photographs, 100 faces then 100 non-faces, no
    download): a fixed class-stratified ``DIGITS_TEST`` share is the test split. Another domain
    than the handwriting and product photos of the other built-ins (photographs, 2 classes)."""
    try:
        from skimage.data import lfw_subset  # optional (nascompress[datasets])
    except ImportError:
        raise NascompressError(
            "the lfw-faces dataset is read from scikit-image's bundled data: "
            "pip install 'scikit-image>=0.24,<1' (or nascompress[datasets])"
        ) from None
    x = lfw_subset()  # (200, 25, 25) floats in [0, 1]
    imgs = torch.from_numpy((x * 255.0).round().clip(0, 255).astype("uint8"))[:, None]
    labels = torch.cat([torch.zeros(100, dtype=torch.long), torch.ones(len(x) - 100, dtype=torch.long)])
    classes = ["face", "non-face"]
    return fixed_test_split(imgs, labels, classes, seed=seed)


def synthetic_dataset(
    n: int, *, num_classes: int = 10, size: int = 16, channels: int = 1, seed: int = 0
) -> TensorImageDataset:
    """Learnable toy images for unit tests only: a class-specific pattern plus noise."""
    g = torch.Generator().manual_seed(seed)
    protos = (
        torch.rand(num_classes, channels, size, size, generator=torch.Generator().manual_seed(1234)) > 0.5
    ).float()
    labels = torch.arange(n) % num_classes
    noise = torch.rand(n, channels, size, size, generator=g)
    imgs = ((protos[labels] * 0.6 + noise * 0.4) * 255).clamp(0, 255).to(torch.uint8)
    return TensorImageDataset(imgs, labels, [f"class{i}" for i in range(num_classes)])
