"""A subset of a dataset's classes (``--classes``): which classes a spec names (:func:`class_indices`)
and a split with only those, relabelled in the order named (:func:`keep_classes`), for in-memory
datasets and ImageFolders alike."""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch.utils.data import Dataset

from .sources import TensorImageDataset
from ..errors import SettingError


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
            raise SettingError(
                f"{{classes}} names {tok!r}, which is not a class of this dataset; its classes: "
                f"{', '.join(classes)} (or their indices 0-{len(classes) - 1})"
            )
        if k in out:
            raise SettingError(f"{{classes}} names class {classes[k]!r} twice")
        out.append(k)
    if len(out) < 2:
        raise SettingError(f"{{classes}} must keep at least 2 classes, got {spec!r}")
    return out
