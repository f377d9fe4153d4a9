"""Deterministic splits and subsets of a dataset: views that keep batched fetching (:class:`Subset`),
labels read without loading images, seeded class-stratified subsets (:func:`stratified_indices`;
``train_limit``/``eval_limit`` never take the first N images), seeded fractional splits, and the check
that a dataset can train a classifier (:func:`check_classes`: two classes or more, each with an image
in every split).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import NascompressError


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
    return [perm[bounds[i] : bounds[i + 1]].sort().values for i in range(len(fractions))]


def limit_subset(ds: Dataset, n: int | None, seed: int) -> Dataset:
    """A seeded, class-stratified random subset of ``n`` items (all of ``ds`` if n is None or larger)."""
    if n is None or n >= len(ds):
        return ds
    return Subset(ds, stratified_indices(dataset_labels(ds), n, seed=seed))


def check_classes(classes: Sequence[str], splits: dict[str, Any], *, name: str) -> None:
    """A classifier needs at least two classes, each with an image in every split.

    Args:
        classes: the class names.
        splits: split label (as the message names it) -> its labels (a sequence of class ids).
        name: the dataset, as the message names it.
    """
    if len(classes) < 2:
        raise NascompressError(
            f"dataset {name} has {len(classes)} class{'' if len(classes) == 1 else 'es'}"
            f"{' (' + classes[0] + ')' if classes else ''}: a classifier needs at least two; add a "
            "folder of images per class"
        )
    for split, labels in splits.items():
        have = set(torch.as_tensor(labels, dtype=torch.long).tolist())
        empty = [c for i, c in enumerate(classes) if i not in have]
        if empty:
            more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
            raise NascompressError(
                f"class {empty[0]!r}{more} of dataset {name} has no image in {split}: every class "
                "needs images in every split; add images or remove the class folder"
            )
