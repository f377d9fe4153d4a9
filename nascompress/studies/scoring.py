"""How a study's trials are scored, the same for every trial whatever its methods.

A zero-shot trial of a method with a predictor stage (DynamicViT, Sparsifiner: :attr:`Method.calibrates`)
trains its new predictors before it is evaluated; a training-free one (EViT, ToMe) is evaluated as
built. So that a study does not prefer a method only because it is cheaper to score, every trial
of one study gets

* the same **calibration budget**: ``calib_steps`` optimizer steps of each method's predictor-only
  stage (on the same cached training batches, in the same order); a training-free method uses 0
  of it, a method configured to keep everything (DynamicViT at rho 1) trains nothing and uses 0;
* the same **validation subset**: ``eval_images`` class-balanced images drawn with the study's
  seed, identified by a fingerprint of their indices in the dataset and their labels.

:func:`study_scoring` is what a study fixes (stored in the study's record and checked when it is
continued: a study keeps one scoring); :func:`trial_scoring` is what one trial got (stored in its
record, ``scoring``), so a trial scored otherwise is visible in ``study show`` / ``export`` / ``report``.
The study runner refuses to continue a study with other scoring settings
(:func:`nascompress.studies.run_study`, the study record's ``scoring``).
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from ..methods import get_method
from .records import EvalSubset, StudyScoring, TrialScoring

# the SearchJob fields that decide a trial's score besides its configuration (a study keeps them)
SCORING_FIELDS = ("calib_steps", "train_images", "eval_images", "batch_size", "finetune_epochs", "dcs_epochs", "seed")


def study_scoring(job: Any) -> StudyScoring:
    """The scoring settings every trial of ``job``'s study gets (:class:`~nascompress.studies.records.StudyScoring`:
    ``job``'s :data:`SCORING_FIELDS`, in that order)."""
    return StudyScoring.new(**{k: getattr(job, k) for k in SCORING_FIELDS})


def _root_indices(ds: Dataset) -> tuple[Dataset, torch.Tensor]:
    """The dataset under any nesting of ``Subset`` and the indices into it that ``ds`` holds, in order."""
    idx: torch.Tensor | None = None
    while isinstance(ds, Subset):
        cur = torch.as_tensor(ds.indices, dtype=torch.long)
        idx = cur if idx is None else cur[idx]
        ds = ds.dataset
    return ds, (torch.arange(len(ds)) if idx is None else idx)


def subset_fingerprint(ds: Dataset, labels: torch.Tensor, *, seed: int) -> EvalSubset:
    """The identity of an evaluation subset (:class:`~nascompress.studies.records.EvalSubset`): its
    ``images``, ``seed`` and ``sha256``, the hash (16 hex
    digits) over the images' indices in the underlying dataset (through nested subsets), its
    size, and the labels in evaluation order. The same subset of the same data gives the same
    fingerprint on every worker and host."""
    root, idx = _root_indices(ds)
    labels = torch.as_tensor(labels, dtype=torch.long).flatten()
    h = hashlib.sha256()
    h.update(f"{type(root).__name__}:{len(root)}:{len(idx)}:".encode())
    h.update(idx.to(torch.int64).numpy().tobytes())
    h.update(labels.to(torch.int64).numpy().tobytes())
    return EvalSubset.new(images=int(len(labels)), seed=int(seed), sha256=h.hexdigest()[:16])


def calibrate_stack(
    model: nn.Module,
    applied: Sequence[dict[str, Any]],
    *,
    teacher: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    budget: int | None,
    cycle_to: int | None = None,
) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """Run the predictor-only stage of every method of ``applied`` that has one, ``budget`` steps
    each over ``batches`` (cycled). ``budget`` None: each method's recipe count over ``cycle_to``
    cached batches (how studies scored trials before budgets were recorded; rebuilding such trials).

    Returns:
        (logs by method name (methods that logged), optimizer steps taken by method name: 0 for
        training-free methods and for stages with nothing to train).
    """
    logs: dict[str, dict[str, float]] = {}
    steps: dict[str, int] = {}
    n = budget if budget is not None else (cycle_to or 0)
    for rec in applied:
        method = get_method(rec["name"])
        if not method.calibrates or n <= 0:
            steps[rec["name"]] = 0
            continue
        out = dict(method.calibrate(model, rec, teacher=teacher, batches=_cycle(batches, n), steps=budget))
        steps[rec["name"]] = int(out.pop("steps", 0))
        if out:
            logs[rec["name"]] = out
    return logs, steps


def _cycle(batches: Sequence[Any], steps: int) -> list[Any]:
    """``steps`` batches, cycling through the cached list."""
    return [batches[i % len(batches)] for i in range(steps)] if batches else []


def trial_scoring(
    *, budget: int, steps: Mapping[str, int], eval_subset: EvalSubset, finetune_epochs: float = 0.0
) -> TrialScoring:
    """One trial's ``scoring`` record (:class:`~nascompress.studies.records.TrialScoring`):
    ``calib_budget`` (steps per method with a predictor stage), ``calib_steps`` (steps taken, by
    method), ``calib_steps_total``, ``eval_subset`` (:func:`subset_fingerprint`) and ``finetune_epochs``."""
    return TrialScoring.new(
        calib_budget=int(budget),
        calib_steps={k: int(v) for k, v in steps.items()},
        calib_steps_total=int(sum(steps.values())),
        eval_subset=eval_subset,
        finetune_epochs=float(finetune_epochs),
    )


__all__ = ["SCORING_FIELDS", "study_scoring", "subset_fingerprint", "calibrate_stack", "trial_scoring"]
