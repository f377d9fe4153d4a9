"""The retraining's results typed: :class:`RetrainMetrics`, what
:func:`~nascompress.retraining.run.run_retrain` returns as ``RetrainResult.metrics`` and
:func:`~nascompress.retraining.run.retrain` returns and writes as the run's ``metrics.json`` (its
completion mark added: :meth:`~nascompress.runs.run_dir.RunDir.finish`), with what the IB bound
contributed (:class:`BoundContribution`).

The style of :mod:`nascompress.train.metrics`, whose :class:`~nascompress.train.metrics.TrainMetrics`
it extends: the keys in the order the retraining made them, the rest in ``extra``, so ``to_dict()``
is the file less its completion mark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..runs.records import TypedRecord
from ..train.metrics import TrainMetrics


@dataclass(frozen=True, kw_only=True)
class BoundContribution(TypedRecord):
    """What the IB bound contributed to a retraining: the best validation top-1 of the epochs on CE
    (+ KD) only (the start and the warm-up) against the best of the epochs the bound was in, and the
    change (None where one side has no epoch)."""

    NEW_SOURCE = "the retraining's {name}"

    best_val_without_bound: float | None = None
    best_val_with_bound: float | None = None
    change: float | None = None


@dataclass(frozen=True, kw_only=True)
class RetrainMetrics(TrainMetrics):
    """A retraining's metrics: :class:`~nascompress.train.metrics.TrainMetrics`' figures, the model
    retrained (``source_model``, its ``methods``), the recipe (``eta`` ... ``batch_size``), the IB
    features read (``learned_feature``, ``input_feature``), the last epoch's and the start's IB
    figures (``final``, ``initial``), the mean epoch, K-means and feature-pass times, and, with the
    bound on (eta > 0), what it contributed."""

    NEW_SOURCE = "the retraining's {name}"

    source_model: str | None = None
    methods: list[str] | None = None  # the retrained model's methods ([]: a dense model)
    eta: float | None = None
    warmup_frac: float | None = None
    eta_schedule: str | None = None
    warm_epochs: int | None = None
    kd: bool | None = None  # distilled from a teacher
    feat_kd: float | None = None
    batch_size: int | None = None
    learned_feature: str | None = None
    input_feature: str | None = None
    final: Mapping[str, Any] | None = None  # the last epoch's IB, CE, IBB, train and val top-1 (those logged)
    initial: Mapping[str, Any] | None = None  # the IB figures before training
    epoch_time_s_mean: float | None = None
    kmeans_s_mean: float | None = None
    feature_pass_s_mean: float | None = None
    kmeans_vs_epoch: float | None = None  # K-means time over epoch time (None: no epoch time)
    bound_contribution: BoundContribution | None = None


__all__ = ["BoundContribution", "RetrainMetrics"]
