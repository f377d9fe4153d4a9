"""The training stages' results typed: what :func:`~nascompress.train.loop.fit`, the ``train`` job
(:func:`~nascompress.train.run.train`: a dense run, a linear probe, a fine-tune from a probe) and
``finetune`` (:func:`~nascompress.train.finetune.finetune`) return, and write as the run's
``metrics.json`` (:meth:`~nascompress.runs.run_dir.RunDir.finish` adds the completion mark).

- :class:`TrainMetrics`: every training run's figures (the best validation epoch, the saved model on
  the test split, the schedule, the time), a linear probe's (``linear_probe``, the chosen ``l2``,
  its grid, the split sizes) and a fine-tune's from a probe (``probe_val_top1``, ``kept_probe``,
  ``probe``: a :class:`ProbeFit`);
- :class:`ProbeFit`: a linear-probe head fitted on frozen features
  (:func:`~nascompress.train.probe.fit_probe_head`);
- :class:`FinetuneMetrics`: a token method's fine-tune (or zero-shot model): the method, its
  calibration stage, the FLOPs on the test images against the dense model's (:class:`FlopsOnTestImages`,
  :func:`~nascompress.train.finetune.flops_on_test_images`).

Each is a :class:`~nascompress.runs.records.TypedRecord` (and the metrics a
:class:`~nascompress.runs.files.RunMetrics`): the keys in the order the stage made them (an optional
key absent where the stage has no such figure; a null written stays), the rest in ``extra``, so
``to_dict()`` is the file less its completion mark, and the command's ``--json``. The retraining's
and the import's extend :class:`TrainMetrics` (:mod:`nascompress.retraining.metrics`,
:mod:`nascompress.importer.metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..data.carve import Splits
from ..runs.files import RunMetrics
from ..runs.records import TypedRecord


@dataclass(frozen=True, kw_only=True)
class ProbeFit(TypedRecord):
    """A linear-probe head fitted on the frozen backbone's features: its validation top-1 (the
    model's own head on the val features), the chosen L2 weight and the grid's rows (``l2``,
    ``train_top1``, ``val_top1``), the feature and fit times, the split sizes and the feature width
    (a fine-tune from a probe records the figures it names, in its order)."""

    NEW_SOURCE = "the fitted {name}"

    val_top1: float
    l2: float
    l2_grid: list[Any]
    feature_time_s: float | None = None
    fit_time_s: float | None = None
    n_train: int | None = None
    n_val: int | None = None
    feature_dim: int | None = None


@dataclass(frozen=True, kw_only=True)
class TrainMetrics(TypedRecord, RunMetrics):
    """A training run's metrics (:func:`~nascompress.train.loop.fit`, the ``train`` job), also the
    start of the retraining's and the fine-tune's. None: the run has no such figure."""

    NEW_SOURCE = "the training run's {name}"

    best_val_top1: float | None = None  # the saved model's validation top-1 (its epoch, the start included)
    best_epoch: int | None = None  # 0: the start was kept; None: a linear probe (no epochs)
    test_loss: float | None = None
    test_n: int | None = None  # test images (0: the saved model was not scored, fit(test=False))
    start_val_top1: float | None = None  # the starting model's validation top-1 (epoch 0)
    epochs: int | None = None
    peak_lr: float | None = None
    train_time_s: float | None = None  # the epochs' training time (not validation)
    dataset: str | None = None
    amp: str | None = None  # the precision trained in ("off" or "bf16", "auto" resolved)
    processes: int | None = None  # under torchrun: the processes, and the batch of all of them
    global_batch_size: int | None = None
    skipped_images: Mapping[str, Any] | None = None  # unreadable images left out, per folder
    splits: Splits | None = None  # which images chose the best epoch, which measured it
    # a linear probe (train --linear-probe: fit_linear_probe)
    linear_probe: bool | None = None
    l2: float | None = None
    l2_grid: list[Any] | None = None
    feature_time_s: float | None = None
    fit_time_s: float | None = None
    n_train: int | None = None
    n_val: int | None = None
    feature_dim: int | None = None
    test_time_s: float | None = None
    # a fine-tune from a linear-probe head (LP-FT: fine_tune_from_probe)
    probe_val_top1: float | None = None  # the probe as the fine-tune measures each epoch (its epoch 0)
    fine_tuned_val_top1: float | None = None  # the best fine-tuned epoch's
    kept_probe: bool | None = None  # no fine-tuned epoch beat the probe: the saved model is the probe
    probe: ProbeFit | None = None


@dataclass(frozen=True, kw_only=True)
class FinetuneMetrics(TrainMetrics):
    """A token method's fine-tune (``finetune``; a zero-shot one has ``val_top1`` and no epochs):
    :class:`TrainMetrics`' figures, the method, what its predictor-only stage measured
    (``calibration``; empty: none, or a resumed run) and the FLOPs per image of the saved model and
    of the dense one on the first ``flops_images`` test images (``flops_ratio``: theirs)."""

    zero_shot: bool | None = None
    calibration: Mapping[str, Any] | None = None
    method: str | None = None
    flops: float | None = None
    dense_flops: float | None = None
    flops_images: int | None = None


@dataclass(frozen=True, kw_only=True)
class FlopsOnTestImages(TypedRecord):
    """FLOPs per image of a method's model (``flops``) and of the dense one (``dense_flops``), averaged
    over the first ``flops_images`` test images (:func:`~nascompress.train.finetune.flops_on_test_images`),
    and their ratio (``flops_ratio``: the model's / the dense one's, below 1 is cheaper): the keys a
    fine-tune's :class:`FinetuneMetrics` ends with."""

    NEW_SOURCE = "the counted {name}"

    flops: float
    dense_flops: float
    flops_ratio: float
    flops_images: int


__all__ = ["FinetuneMetrics", "ProbeFit", "FlopsOnTestImages", "TrainMetrics"]
