"""Which dataset and which splits (:class:`DataConfig`), and loading them (:func:`load_data`): the
built-in datasets or an ImageFolder directory, with a deterministic held-out validation split.

The parts, one module each (their names are importable from here too):

* :mod:`nascompress.data.input`: how raw images become model input (:class:`InputSpec`,
  :func:`preprocess`, the one place that normalises; timm's ImageFolder transforms);
* :mod:`nascompress.data.sources`: the in-memory datasets (Fashion-MNIST from the Debian package,
  scikit-learn's digits, scikit-image's LFW faces, synthetic images for tests);
* :mod:`nascompress.data.classes`: a subset of the classes (``--classes``);
* :mod:`nascompress.data.folders`: ImageFolder directories, every image checked once when loaded;
* :mod:`nascompress.data.splits`: seeded splits and class-stratified subsets, and the check that a
  dataset can train a classifier;
* :mod:`nascompress.data.carve`: a test split carved for a dataset without one (never the validation
  images), and the record of which images decided and which measured (``DataBundle.splits``);
* :mod:`nascompress.data.single`: one split for ``evaluate``, also from a folder holding only it;
* :mod:`nascompress.data.loader`: batches in an order that depends only on (seed, epoch);
* :mod:`nascompress.data.choose`: the DataConfig a command or a Python API call runs on
  (:func:`~nascompress.data.choose.data_config_for`: the run's recorded data, a named dataset, the
  command's limits and seed), the one rule every front end calls.

Two loading paths:

* in-memory uint8 datasets (Fashion-MNIST, synthetic): whole batches are resized at once in
  :func:`preprocess` with the spec's interpolation (the whole image; ``crop_pct`` does not apply),
  no augmentation;
* ImageFolder: timm's conventions (:func:`folder_transform`), images decoded in DataLoader workers
  (:attr:`DataConfig.num_workers`).

Limits (``train_limit``, ``eval_limit``) take a seeded, class-stratified random subset
(:func:`stratified_indices`), never the first N images.

Datasets that cannot train a classifier are refused before anything runs, in one line: fewer than
two classes, or a class with no image in a split (train/, val/, test/ or the validation split
carved from train/). An unreadable ImageFolder image is named and refused, or with
``skip_bad_images`` (``--skip-bad-images``) left out and counted
(``DataBundle.extra["skipped_images"]``).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import Dataset

from .. import runtime

from ..config import Config, check_field, check_int, check_settings, setting
from .carve import Splits, resolve_splits
from .classes import class_indices, keep_classes
from .folders import TOO_LARGE, drop_bad_images, folder_classes, image_folder, scan_images, with_transform
from .input import (
    AUGMENTS,
    CROP_MODES,
    DIGITS_MEAN,
    DIGITS_STD,
    FMNIST_MEAN,
    FMNIST_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    INTERPOLATIONS,
    InputSpec,
    check_input,
    default_norm,
    eval_steps,
    folder_transform,
    preprocess,
    resize,
)
from .loader import Indexed, collate_batch, make_loader
from .memory import is_memory, memory_splits
from .sources import (
    BUILTIN_DATASETS,
    DATASET_KEYWORDS,
    DIGITS_TEST,
    FMNIST_CLASSES,
    FMNIST_DIR,
    IN_MEMORY,
    TensorImageDataset,
    load_digits_dataset,
    load_fashion_mnist,
    load_lfw_faces_dataset,
    synthetic_dataset,
)
from .splits import Subset, check_classes, dataset_labels, split_indices, stratified_indices
from ..errors import NascompressError, SettingError
from ..limits import MAX_IMAGES, MAX_WORKERS, SEED_MAX


__all__ = [
    "AUGMENTS",
    "BUILTIN_DATASETS",
    "count_classes",
    "CROP_MODES",
    "DATASET_KEYWORDS",
    "DIGITS_MEAN",
    "DIGITS_STD",
    "DIGITS_TEST",
    "FMNIST_CLASSES",
    "FMNIST_DIR",
    "FMNIST_MEAN",
    "FMNIST_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "INTERPOLATIONS",
    "IN_MEMORY",
    "TOO_LARGE",
    "DataBundle",
    "DataConfig",
    "InputOverrides",
    "InputSpec",
    "Indexed",
    "Subset",
    "TensorImageDataset",
    "check_classes",
    "class_indices",
    "dataset_labels",
    "default_norm",
    "eval_steps",
    "folder_classes",
    "folder_transform",
    "keep_classes",
    "load_data",
    "load_digits_dataset",
    "load_fashion_mnist",
    "load_lfw_faces_dataset",
    "collate_batch",
    "make_loader",
    "preprocess",
    "dataset_paths",
    "training_batches",
    "resize",
    "scan_images",
    "split_indices",
    "stratified_indices",
    "synthetic_dataset",
]


@dataclass(frozen=True)
class InputOverrides(Config):
    """Explicit preprocessing choices (``--mean``/``--std``/``--interpolation``/``--crop-pct``) that
    win over the pretrained config and the dataset defaults; None keeps the resolved value."""

    mean: tuple[float, ...] | None = setting(
        None,
        help=("Normalisation mean, comma-separated (default: the weights' pretrained config, else the dataset's)."),
    )
    std: tuple[float, ...] | None = setting(None, help="Normalisation std, comma-separated (default: as --mean).")
    interpolation: str | None = setting(
        None, choices=INTERPOLATIONS, help=("Resize filter: bilinear, bicubic or nearest (default: as --mean).")
    )
    crop_pct: float | None = setting(
        None,
        lo=0,
        hi=1,
        lo_open=True,
        help=("ImageFolder eval crop: resize to size/crop_pct, centre-crop (default: as --mean)."),
    )
    crop_mode: str | None = None

    def __post_init__(self) -> None:
        check_settings(self)  # every setting() against its declaration
        check_input(None, None, self.crop_mode)


@dataclass(frozen=True)
class DataConfig:
    """Which dataset and which splits.

    Args:
        dataset: ``fashion-mnist`` (default, real), ``digits`` (scikit-learn's bundled 8x8
            digits, real), a path to an ImageFolder root holding ``train/`` (and optionally
            ``val/``, ``test/``; without ``test/`` a test split is carved, :mod:`.carve`), or
            ``synthetic`` (unit tests).
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
        augment: the ImageFolder training split's augmentation (:data:`AUGMENTS`,
            :func:`folder_transform`); in-memory datasets are never augmented.
    """

    # Fields declared with setting() are the user's: `train` options and `data` keys of the pipeline
    # file (a path there is resolved against the file's directory, but for the keywords).
    dataset: str = setting(
        "fashion-mnist",
        path=True,
        keywords=DATASET_KEYWORDS,
        help=(
            "'fashion-mnist', 'digits' (scikit-learn's bundled 8x8 digits) or an ImageFolder root with "
            "train/ (val/, test/)."
        ),
    )
    data_dir: str = setting(str(FMNIST_DIR), path=True, help="Where Fashion-MNIST's IDX files are.")
    val_fraction: float = setting(
        0.1, lo=0, hi=1, lo_open=True, hi_open=True, help=("Share of train held out for validation.")
    )
    split_seed: int = 0
    train_limit: int | None = setting(
        None, lo=1, hi=MAX_IMAGES, help=("Use N training images (a class-stratified random subset drawn with --seed).")
    )
    eval_limit: int | None = setting(
        None, lo=1, hi=MAX_IMAGES, help=("Use N val/test images (class-stratified, drawn with --seed).")
    )
    subset_seed: int = 0
    num_workers: int | None = setting(
        None, lo=0, hi=MAX_WORKERS, help=("DataLoader workers (default: up to 4 for ImageFolder, 0 in memory).")
    )
    skip_bad_images: bool = setting(
        False, help=("ImageFolder: leave unreadable images out (counted) instead of refusing the dataset.")
    )
    classes: str | None = setting(
        None,
        help=("Keep only these classes (comma-separated names or indices, e.g. 0,1,2,3,4), relabelled in that order."),
    )
    augment: str = setting(
        "default",
        choices=AUGMENTS,
        help=(
            "ImageFolder training images: default (timm's RandomResizedCrop + horizontal flip), light (a milder "
            "crop, scale 0.5-1, no flip) or none (the evaluation resize and centre crop)."
        ),
    )

    def __post_init__(self) -> None:
        check_settings(self)  # every setting() against its declaration
        # paths are kept absolute (a run's config.json records them: evaluate/finetune/--resume from
        # another directory read the same data)
        for name in ("dataset", "data_dir"):
            v = getattr(self, name)
            if isinstance(v, str) and v not in DATASET_KEYWORDS and not is_memory(v):
                object.__setattr__(self, name, os.path.abspath(os.path.expanduser(v)))
        check_field("seed", check_int, self.subset_seed, 0, SEED_MAX)  # the subsets' seed is the run's seed


def count_classes(data: DataConfig) -> int:
    """Number of classes of a dataset without loading its images."""
    if data.classes is not None:  # a subset: as many as it names (checked against the classes when loaded)
        return len([t for t in data.classes.split(",") if t.strip()])
    if is_memory(data.dataset):  # a caller's Dataset (the Python API)
        return len(memory_splits(data.dataset).classes)
    if data.dataset in DATASET_KEYWORDS:
        return 2 if data.dataset == "lfw-faces" else 10
    train = Path(data.dataset) / "train"
    if not train.is_dir():
        raise SettingError(
            f"dataset {data.dataset} is neither a built-in dataset ({BUILTIN_DATASETS}) nor a "
            "directory with train/; give an ImageFolder root (train/<class>/*.png) with {dataset} PATH"
        )
    classes = folder_classes(train)  # as the loader finds them (hidden folders are no class)
    if len(classes) < 2:  # (the images are checked when the data is loaded: data.check_classes, scan_images)
        check_classes(classes, {}, name=data.dataset)
    return len(classes)


@dataclass
class DataBundle:
    train: Dataset
    val: Dataset
    test: Dataset
    classes: list[str]
    name: str
    native_channels: int
    native_size: tuple[int, int] | None = None
    splits: Splits | None = None  # which images decide and which measure (data.carve)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def split(self, name: str) -> Dataset:
        if name not in ("train", "val", "test"):
            raise NascompressError(f"unknown split {name!r}; use train, val or test")
        return getattr(self, name)


def load_data(
    cfg: DataConfig, *, img_size: tuple[int, int] | None = None, spec: InputSpec | None = None, augment: bool = True
) -> DataBundle:
    """Load the dataset ``cfg`` names, with a deterministic held-out validation split.

    Args:
        cfg: which dataset, splits, limits and workers.
        img_size: the model's input size (ImageFolder images are resized/cropped to it while
            loading; in-memory images keep their size and :func:`preprocess` resizes batches).
        spec: the model's preprocessing; gives ImageFolder its size, interpolation and eval crop
            (preferred over ``img_size``, which then defaults to ``spec.img_size``).
        augment: give an ImageFolder training split its training transform, ``cfg.augment``'s
            (False: the eval transform, e.g. for extracting features).
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
    elif is_memory(cfg.dataset):  # a caller's Dataset (the Python API): its own splits, its preprocessing
        mem = memory_splits(cfg.dataset, spec)  # (images of the model's channels and size)
        train_full, val, test = mem.train, mem.val, mem.test
        name, channels, size = cfg.dataset, mem.in_chans, mem.size
    else:
        root = Path(cfg.dataset)
        if not root.is_dir():
            raise SettingError(
                f"dataset {cfg.dataset} does not exist (neither a built-in dataset "
                f"({BUILTIN_DATASETS}) nor an existing directory); if the data moved, give its new "
                "place with {dataset} PATH"
            )
        if not (root / "train").is_dir():
            raise NascompressError(
                f"ImageFolder dataset {root} has no train/ folder (expected {root}/train/<class>/*.png)"
            )
        eval_tf = folder_transform(spec, train=False)
        train_tf = folder_transform(spec, train=augment, augment=cfg.augment)
        # the train split's images seen as evaluation images (a val split carved from train/)
        train_full = image_folder(root / "train", eval_tf)
        val = image_folder(root / "val", eval_tf) if (root / "val").is_dir() else None
        test = image_folder(root / "test", eval_tf) if (root / "test").is_dir() else val
        for part, ds in (("val", val), ("test", test)):
            if ds is not None and ds.classes != train_full.classes:
                raise NascompressError(f"{root}/{part} has classes {ds.classes} but train has {train_full.classes}")
        if len(train_full) == 0:
            raise NascompressError(f"{root}/train holds no images")
        for part, ds in (("train", train_full), ("val", val), ("test", test if test is not val else None)):
            if ds is not None:
                drop_bad_images(ds, root / part, skip=cfg.skip_bad_images, skipped=skipped)
        check_classes(
            train_full.classes,
            {
                f"{root}/{p}": ds.targets
                for p, ds in (("train", train_full), ("val", val), ("test", test))
                if ds is not None
            },
            name=str(root),
        )
        name, channels, size = str(root), 3, None  # ImageFolder decodes every image to RGB
        if workers is None:
            workers = min(4, os.cpu_count() or 1)
    if cfg.classes is not None:
        keep = class_indices(cfg.classes, train_full.classes)
        test_is_val_split = test is val
        train_full, val = keep_classes(train_full, keep), keep_classes(val, keep)
        test = val if test_is_val_split else keep_classes(test, keep)
    train_src = train_full if cfg.dataset in IN_MEMORY else with_transform(train_full, train_tf)
    folder = cfg.dataset not in IN_MEMORY and not is_memory(cfg.dataset)  # an ImageFolder
    train, val, test, splits = resolve_splits(
        cfg, train_full, train_src, val, None if test is val else test, name=name, root=name if folder else None
    )
    for ds in (train, val, test):
        ds.num_workers = workers or 0  # read by make_loader (see DataConfig.num_workers)
    # the training images are fixed (the same tensor every epoch) unless an ImageFolder's transform augments them
    fixed = cfg.dataset in IN_MEMORY or cfg.dataset == "synthetic" or not augment or cfg.augment == "none"
    return DataBundle(
        train=train,
        val=val,
        test=test,
        classes=list(train_full.classes),
        name=name,
        native_channels=channels,
        native_size=size,
        splits=splits,
        extra={**({"skipped_images": skipped} if skipped else {}), "fixed_train_images": fixed},
    )


def training_batches(
    data: DataBundle, spec: InputSpec, *, batch_size: int, seed: int, device: torch.device, indexed: bool = False
) -> Iterator[tuple[torch.Tensor, ...]]:
    """An endless stream of preprocessed training batches (x, y) on ``device``, shuffled per epoch from
    ``seed`` (a method's predictor-only stage, the DCS search's recovery of its candidates); with
    ``indexed``, (x, y, idx): the images' indices in the training split (the same batches)."""
    train = Indexed(data.train) if indexed else data.train
    for epoch in itertools.count():
        for imgs, labels, *idx in make_loader(
            train, batch_size=batch_size, shuffle=True, seed=seed, epoch=epoch, pin_memory=device.type == "cuda"
        ):
            yield preprocess(runtime.to_device(imgs, device), spec), runtime.to_device(labels, device), *idx


def dataset_paths(cfg: DataConfig | None) -> tuple[str, ...]:
    """The folders a data config reads (its ImageFolder root, its Fashion-MNIST folder): inputs an
    output must not be (:func:`~nascompress.runs.out_dir.refuse_overwriting_inputs`)."""
    if cfg is None:
        return ()
    if cfg.dataset == "fashion-mnist":
        return (cfg.data_dir,)
    return () if cfg.dataset in DATASET_KEYWORDS else (cfg.dataset,)
