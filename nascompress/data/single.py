"""One split of a dataset, for measuring a saved model (``nascompress evaluate``): :func:`load_split`.

A dataset :func:`~nascompress.data.load_data` loads (a built-in one, an ImageFolder root with
``train/``) gives its split as loaded there: the same images, the same carved test split. A folder
without ``train/`` is a held-out set on its own: its ``val/`` or ``test/`` folder (the one the split
names), or, holding neither ``train/``, ``val/`` nor ``test/``, a plain directory of class folders,
read as the split asked for. Its classes are matched to the model's by name when the model records
them (a folder may hold only some of them), else by count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from torch.utils.data import Dataset

from ..errors import NascompressError, SettingError, literal
from . import DATASET_KEYWORDS, DataConfig, InputSpec, load_data
from .carve import Splits
from .classes import class_indices, keep_classes
from .folders import drop_bad_images, image_folder
from .input import folder_transform
from .memory import is_memory
from .splits import check_classes, limit_subset

SPLIT_FOLDERS = ("train", "val", "test")


@dataclass
class EvalSplit:
    """One split and where it came from: ``splits`` records which images it is (the data's
    :class:`~nascompress.data.carve.Splits`, without its file list, or the folder read)."""

    dataset: Dataset
    name: str
    classes: list[str]
    splits: Splits | None

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def load_split(cfg: DataConfig, split: str, *, spec: InputSpec, labels: Sequence[str] | None = None) -> EvalSplit:
    """The split ``split`` (train, val or test) of ``cfg``'s dataset, preprocessed for ``spec``.

    Args:
        cfg: the dataset (its ``eval_limit``, ``subset_seed``, ``classes``, ``skip_bad_images`` apply).
        split: train, val or test.
        spec: the model's input.
        labels: the model's class names (its arch's), to match a held-out folder's classes by name.
    """
    root = Path(cfg.dataset)
    plain = cfg.dataset in DATASET_KEYWORDS or is_memory(cfg.dataset) or not root.is_dir()
    if plain or (root / "train").is_dir():
        b = load_data(cfg, spec=spec, augment=False)
        rec = None if b.splits is None else b.splits.without_images()
        return EvalSplit(b.split(split), b.name, list(b.classes), rec)
    folder = _held_out_folder(root, split)
    ds = image_folder(folder, folder_transform(spec, train=False))
    drop_bad_images(ds, folder, skip=cfg.skip_bad_images, skipped={})
    if cfg.classes is not None:
        ds = keep_classes(ds, class_indices(cfg.classes, ds.classes))
    if labels:
        ds = _as_model_classes(ds, list(labels), folder)
    check_classes(list(ds.classes), {}, name=str(folder))
    if not len(ds):
        raise NascompressError(f"{folder} holds no images")
    ds = limit_subset(ds, cfg.eval_limit, cfg.subset_seed)
    ds.num_workers = cfg.num_workers if cfg.num_workers is not None else min(4, os.cpu_count() or 1)
    rec = Splits.new(measure=split, measure_from=str(folder), carved=False, n_measure=len(ds))
    return EvalSplit(ds, str(root), list(ds.classes), rec)


def _held_out_folder(root: Path, split: str) -> Path:
    """The folder a dataset without ``train/`` holds ``split`` in (one line when it has none)."""
    present = [p for p in SPLIT_FOLDERS if (root / p).is_dir()]
    if split == "train":
        raise SettingError(
            f"ImageFolder dataset {literal(str(root))} has no train/ folder (expected {literal(str(root))}/train/"
            "<class>/*.png); evaluate one of its held-out splits with {split} val or {split} test"
        )
    if (root / split).is_dir():
        return root / split
    if present:
        other = " or ".join(f"{{split}} {p}" for p in present)
        raise SettingError(
            f"{literal(str(root))} has no {split}/ folder (it holds {', '.join(present)}/): evaluate it with {other}"
        )
    return root  # a plain directory of class folders: the held-out images themselves


def _as_model_classes(ds: Any, labels: list[str], folder: Path) -> Any:
    """``ds`` labelled as the model's classes (``labels``, by name): a folder may hold some of them."""
    if list(ds.classes) == labels:
        return ds
    unknown = [c for c in ds.classes if c not in labels]
    if unknown:
        raise NascompressError(
            f"class folder {unknown[0]!r} of {folder} is not one of the model's classes ({', '.join(labels)}); "
            "evaluate a folder of the classes the model was trained on"
        )
    index = {c: labels.index(c) for c in ds.classes}
    ds.samples = [(p, index[ds.classes[t]]) for p, t in ds.samples]
    ds.imgs, ds.targets = ds.samples, [t for _, t in ds.samples]
    ds.classes, ds.class_to_idx = list(labels), {c: i for i, c in enumerate(labels)}
    return ds


__all__ = ["EvalSplit", "SPLIT_FOLDERS", "load_split"]
