"""Honest splits: a dataset without a test split of its own (an ImageFolder with ``train/`` and
``val/`` only, or ``train/`` alone; a caller's data without ``test``) gets one carved, disjoint from
its validation split (:func:`resolve_splits`: half of ``val/``, or a share of the training images),
so that the images a run decides on (its best epoch, a study's trial, the confirm step's winner) are
never the images it reports; and the record of which images decided and which measured
(:class:`Splits`, made by :func:`splits_record`), carried by the loaded data
(``DataBundle.splits``) and written into the metrics and the pipeline's summary.

The carving is class-stratified (each class gives its share) and seeded by the run's seed
(``DataConfig.subset_seed``): every stage of a run, and ``evaluate`` on that run, carve the same
images.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.data import Dataset

from ..runs.records import TypedRecord
from .memory import is_memory
from .splits import Subset, check_classes, dataset_labels, limit_subset, split_indices

# share of the validation images carved out as the test split when a dataset has none
TEST_FRACTION = 0.5


@dataclass(frozen=True, kw_only=True)
class Splits(TypedRecord):
    """Which images decided (``decide``: the validation split) and which measured (``measure``: the
    test split): where each came from, how many, whether the test split was carved (then its
    ``seed``, its share ``fraction`` and, for an ImageFolder, its files relative to the dataset's
    root, ``measure_images``, with their digest). One split read on its own (``evaluate`` on a
    held-out folder, :mod:`nascompress.data.single`) has no ``decide`` side. A
    :class:`~nascompress.runs.records.TypedRecord`: the keys in the order they were made, a key
    absent where there is no such figure, so ``to_dict()`` is the JSON the metrics and the summary
    hold."""

    NEW_SOURCE = "the data's {name} record"

    decide: str | None = None
    measure: str
    decide_from: str | None = None
    measure_from: str
    carved: bool
    n_decide: int | None = None
    n_measure: int
    seed: int | None = None
    fraction: float | None = None
    measure_digest: str | None = None
    measure_images: list[str] | None = None

    def without_images(self) -> Splits:
        """The record without its file list (what a stage's metrics keep; the digest names them)."""
        return replace(self, measure_images=None, order=tuple(k for k in self.order if k != "measure_images"))


def _carve(labels: torch.Tensor, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of ``labels`` split into (the rest, the carved part): ``fraction`` of each class
    (rounded, at least one image of a class that has two or more, never all of them), drawn with
    ``seed``."""
    g = torch.Generator().manual_seed(seed)
    picked = []
    for c in torch.unique(labels).tolist():
        members = torch.nonzero(labels == c).flatten()
        n = len(members)
        k = 0 if n < 2 else min(n - 1, max(1, round(n * fraction)))
        picked.append(members[torch.randperm(n, generator=g)[:k]])
    carved = torch.cat(picked).sort().values
    rest = torch.ones(len(labels), dtype=torch.bool)
    rest[carved] = False
    return torch.nonzero(rest).flatten(), carved


def resolve_splits(
    cfg: Any,
    train_full: Dataset,
    train_src: Dataset,
    val: Dataset | None,
    test: Dataset | None,
    *,
    name: str,
    root: str | None,
) -> tuple[Dataset, Dataset, Dataset, Splits]:
    """The train, validation and test splits of a loaded dataset (``cfg``: its DataConfig) and their
    :func:`splits_record`: ``val`` None: carved from the training images (``val_fraction``, seeded by
    ``split_seed``, as before); ``test`` None (no test split of its own): carved too, never the
    validation images: from ``val`` given (:data:`TEST_FRACTION` of each class), or from the training
    images left after the validation split (``val_fraction`` of them, class-stratified); both test carvings
    seeded by the run's seed (``subset_seed``). Then the limits (``train_limit``, ``eval_limit``)."""
    here = (lambda part: f"{root}/{part}") if root else (lambda part: f"{name}: {part}")
    carved, fraction = test is None, None
    if val is None:  # the same split indices over two views: train transform / eval transform
        if is_memory(cfg.dataset):  # a caller's Dataset: each class gives its share (issue 69)
            tr_idx, va_idx = _carve(dataset_labels(train_full), cfg.val_fraction, cfg.split_seed)
        else:  # a built-in dataset or an ImageFolder: the split every earlier run of it had
            shares = (1 - cfg.val_fraction, cfg.val_fraction)
            tr_idx, va_idx = split_indices(len(train_full), shares, seed=cfg.split_seed)
        decide = f"{cfg.val_fraction:g} of {here('train')} (split seed {cfg.split_seed})"
        measure = here("test")
        if carved:
            labels = dataset_labels(train_full)[tr_idx]
            rest, te = _carve(labels, cfg.val_fraction, cfg.subset_seed)  # the same share of the images left
            tr_idx, te_idx = tr_idx[rest], tr_idx[te]
            test, fraction = Subset(train_full, te_idx), cfg.val_fraction
            measure = f"{cfg.val_fraction:g} of the rest of {here('train')}, class-stratified, seed {cfg.subset_seed}"
        train, val = Subset(train_src, tr_idx), Subset(train_full, va_idx)
        parts = {
            "the training split": dataset_labels(train),
            f"the validation split carved from the training images (val_fraction "
            f"{cfg.val_fraction:g}; add a val/ folder or more images)": dataset_labels(val),
        }
        if carved:
            parts["the test split carved from the training images (add a test/ folder or more images)"] = (
                dataset_labels(test)
            )
        check_classes(train_full.classes, parts, name=name)
    else:
        train, decide, measure = train_src, here("val"), here("test")
        if carved:
            rest, te = _carve(dataset_labels(val), TEST_FRACTION, cfg.subset_seed)
            val, test, fraction = Subset(val, rest), Subset(val, te), TEST_FRACTION
            measure = f"{TEST_FRACTION:g} of {here('val')}, class-stratified, seed {cfg.subset_seed}"
            check_classes(
                train_full.classes,
                {
                    f"the validation images left after a test split was carved from {decide}": dataset_labels(val),
                    f"the test split carved from {decide} (add images, or a test/ folder)": dataset_labels(test),
                },
                name=name,
            )
    train = limit_subset(train, cfg.train_limit, cfg.subset_seed)
    val = limit_subset(val, cfg.eval_limit, cfg.subset_seed)
    test = limit_subset(test, cfg.eval_limit, cfg.subset_seed)
    rec = splits_record(
        decide=decide,
        measure=measure,
        carved=carved,
        val=val,
        test=test,
        seed=cfg.subset_seed,
        root=root,
        fraction=fraction,
    )
    return train, val, test, rec


def image_paths(ds: Dataset, root: str | None) -> list[str] | None:
    """The files of an ImageFolder split (through Subset views), relative to ``root``; None for
    images in memory."""
    base, idx = ds, None
    while isinstance(base, Subset):
        idx = base.indices if idx is None else base.indices[idx]
        base = base.base
    samples = getattr(base, "samples", None)
    if samples is None:
        return None
    picked = samples if idx is None else [samples[i] for i in idx.tolist()]
    return [os.path.relpath(p, root) if root else p for p, _ in picked]


def splits_record(
    *,
    decide: str,
    measure: str,
    carved: bool,
    val: Dataset,
    test: Dataset,
    seed: int | None,
    root: str | None,
    fraction: float | None = None,
) -> Splits:
    """The :class:`Splits` record of a loaded dataset: which images decided (the validation split)
    and which measured (the test split), where each came from, how many, whether the test split was
    carved (then its seed, its share and its files, relative to the dataset's root, with their
    digest)."""
    rec = Splits.new(
        decide="val",
        measure="test",
        decide_from=decide,
        measure_from=measure,
        carved=carved,
        n_decide=len(val),
        n_measure=len(test),
    )
    if not carved:
        return rec
    rec = rec.set(seed=seed, fraction=fraction)
    files = image_paths(test, root)
    if files is None:  # images in memory: no files to name
        return rec
    return rec.set(measure_digest=hashlib.sha256("\n".join(files).encode()).hexdigest()[:16], measure_images=files)


def splits_text(rec: Splits | None) -> str:
    """One line: which images decided and which measured."""
    if rec is None:
        return ""
    how = " (carved: the dataset has no test split of its own; no decision saw these images)" if rec.carved else ""
    return (
        f"decided on {rec.n_decide} validation images ({rec.decide_from}); measured on {rec.n_measure} "
        f"test images ({rec.measure_from}){how}"
    )


__all__ = ["TEST_FRACTION", "Splits", "resolve_splits", "image_paths", "splits_record", "splits_text"]
