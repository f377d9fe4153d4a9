"""The pipeline's summary (``OUT/summary.json``) as frozen records: what
:func:`nascompress.pipeline.report.write_summary` measures and decides, and what the report, the
command's printout and ``nc.compress`` read, by field.

:class:`Summary` holds the dense base and the final model (:class:`ModelResult`), their
:class:`Comparison`, the :class:`Goal`, the int8 rows
(:class:`~nascompress.deploy.int8_rows.Int8Section`, declared where they are made), every stage's
decisions (:class:`Decisions`), the stage log (:class:`StageRow`), the data splits
(:class:`~nascompress.data.carve.Splits`, declared where they are made) and the dense reference
(:class:`DenseReference`). Each record is a :class:`~nascompress.runs.files.Record`: the
keys it types as fields, any other key kept as it is, the file's key order kept, so a summary read
and written again is the same bytes; a record made in memory (:meth:`SummaryPart.new`) writes its
keys in the order they are given. Each field's check on reading follows its annotation
(:class:`~nascompress.runs.records.TypedRecord`): a damaged file is one NascompressError line.
:mod:`nascompress.pipeline.files` reads and writes the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..data.carve import Splits
from ..deploy.int8_rows import Int8Section
from ..runs.records import TypedRecord

SUMMARY_FORMAT = "nascompress-pipeline-summary/1"


class SummaryPart(TypedRecord):
    """A record of the summary; a subclass's ``CHECKS`` follow its annotations
    (:class:`~nascompress.runs.records.TypedRecord`)."""

    NEW_SOURCE = "the summary's {name}"


def _part(cls: type) -> type:
    return dataclass(frozen=True, kw_only=True)(cls)


@_part
class ModelResult(SummaryPart):
    """The dense base or the final model on the report's test images, counted and timed."""

    run: str | None = None
    test_top1: float | None = None
    test_loss: float | None = None
    test_n: int | None = None
    params: int | None = None
    file_bytes: int | None = None
    macs: float | None = None
    methods: Any = None
    latency_ms: float | None = None
    latency_batch: int | None = None
    throughput: float | None = None
    throughput_batch: int | None = None
    latency_ms_compiled: float | None = None
    throughput_compiled: float | None = None


@_part
class Comparison(SummaryPart):
    """The final model against the dense base (:mod:`nascompress.profiling.compare`'s convention:
    ratios below 1 are smaller, speed-ups above 1 faster)."""

    top1_change: float | None = None
    test_n: int | None = None
    file_ratio: float | None = None
    flops_ratio: float | None = None
    params_ratio: float | None = None
    latency_speedup: float | None = None
    throughput_speedup: float | None = None
    latency_speedup_compiled: float | None = None
    throughput_speedup_compiled: float | None = None


@_part
class Goal(SummaryPart):
    """The goal (FLOPs or latency), the final model's value against it, whether it is met (at the
    printed precision: :mod:`nascompress.pipeline.goal`), by how much it was missed and why."""

    max_flops: float | None = None
    max_latency_ms: float | None = None
    value: float | None = None
    met: bool | None = None
    missed_by: float | None = None
    statement: str | None = None


@_part
class BaseDecision(SummaryPart):
    """The dense base: how it was made, its run, its test top-1 on the report's images (and, as
    ``trained_*``, the one its training measured)."""

    kind: str | None = None
    run: str | None = None
    test_top1: float | None = None
    test_n: int | None = None
    trained_test_top1: float | None = None
    trained_test_n: int | None = None


@_part
class DcsBlock(SummaryPart):
    """One block's widths kept by the DCS stage (``qk_kept``: per head, None: all)."""

    block: int
    mlp_kept: int
    mlp_total: int
    qk_kept: Any = None
    heads: int | None = None
    head_dim: int | None = None


@_part
class DcsDecision(SummaryPart):
    """The DCS stage's decisions: its gate family, the widths kept per block, the search's landing
    (from its ``metrics.json``), why the searched model was kept, and a fallback (``dcs_outcome``)."""

    in_final_model: bool | None = None
    config: Mapping[str, Any] | None = None
    mlp_gates: str | None = None
    blocks: tuple[DcsBlock, ...] | None = None
    mlp_kept_total: int | None = None
    mlp_total: int | None = None
    target_flops: float | None = None
    flops_ratio: float | None = None
    cost: str | None = None
    target_latency: float | None = None
    latency_ratio: float | None = None
    calibrated: Any = None
    calibration_move: float | None = None
    at_target_share: float | None = None
    val_top1: float | None = None
    family_reason: str | None = None
    kept_reason: str | None = None
    dcs_outcome: str | None = None
    dcs_target: float | None = None
    planned_target: float | None = None
    dcs_reason: str | None = None


@_part
class TokenMethod(SummaryPart):
    """A token/attention method of the final model: its settings and their one-line summary."""

    name: str | None = None
    config: Mapping[str, Any] | None = None
    summary: str


@_part
class Candidate(SummaryPart):
    """A study's best trial under the goal, one of the candidates the pick chose from (``trial`` None:
    none meets the goal)."""

    trial: int | None = None
    accuracy: float | None = None
    flops_ratio: float | None = None


@_part
class TokensDecision(SummaryPart):
    """The tokens stage: its study, how many trials, the trial picked (and by which rule), its
    settings, the methods in the final model, and after a DCS stage the pick on the DCS model against
    the one on the dense base (``candidates``)."""

    study: str | None = None
    pick_rule: str | None = None
    eval_images: int | None = None
    methods: tuple[TokenMethod, ...] = ()
    trials_complete: int | None = None
    picked_trial: int | None = None
    trial_accuracy: float | None = None
    trial_flops_ratio: float | None = None
    params: Mapping[str, Any] | None = None
    picked_study: str | None = None
    candidates: Mapping[str, Candidate] | None = None
    dense_study: str | None = None
    dense_skipped: str | None = None


@_part
class ConfirmDecision(SummaryPart):
    """The confirm step's result: the pick checked against the channel-only model at the full budget:
    which was kept and why, both models' FLOPs and validation records (or why the check did not run:
    ``skipped``)."""

    skipped: bool | None = None
    kept: str | None = None
    pick_kind: str | None = None
    pick_flops_ratio: float | None = None
    channel_flops_ratio: float | None = None
    pick_val_top1: float | None = None
    pick_val_loss: float | None = None
    pick_test_top1: float | None = None
    channel_val_top1: float | None = None
    channel_val_loss: float | None = None
    channel_test_top1: float | None = None
    reason: str | None = None


@_part
class RetrainDecision(SummaryPart):
    """The retraining of the kept model: its recipe, teacher and best epoch's test top-1."""

    epochs: int | None = None
    eta: float | None = None
    warm_epochs: int | None = None
    feat_kd: Any = None
    batch_size: int | None = None
    best_epoch: int | None = None
    test_top1: float | None = None
    test_n: int | None = None
    teacher: Any = None


@_part
class MethodLine(SummaryPart):
    """A method of the final model as one line."""

    name: str | None = None
    summary: str | None = None


@_part
class Decisions(SummaryPart):
    """Every stage's decisions (None: the pipeline has no such stage, or it decided nothing)."""

    base: BaseDecision | None = None
    dcs: DcsDecision | None = None
    tokens: TokensDecision | None = None
    confirm: ConfirmDecision | None = None
    retrain: RetrainDecision | None = None
    methods: tuple[MethodLine, ...] = ()


@_part
class StageRow(SummaryPart):
    """One step of the pipeline: what it did, its directory, how long it took (None: not finished)."""

    step: str
    what: str | None = None
    dir: str | None = None
    seconds: float | None = None
    finished: str | None = None


@_part
class DenseReference(SummaryPart):
    """The dense base retrained with the retrain stage's recipe and teacher, on the report's test
    images, and the compressed model against it."""

    run: str
    test_top1: float
    test_loss: float | None = None
    test_n: int
    best_val_top1: float | None = None
    teacher: Any = None
    final_top1_change: float | None = None


@_part
class ThisRun(SummaryPart):
    """What :func:`~nascompress.pipeline.run_pipeline` did this time (not written to the file)."""

    resumed: bool
    ran: Any
    skipped: Any


@_part
class Summary(SummaryPart):
    """``summary.json``: the pipeline's result against the dense base (``final`` None: no compressed
    model could be made), its goal, decisions, stages and data splits; ``this_run`` only in what
    :func:`~nascompress.pipeline.run_pipeline` returns."""

    format: str | None = None
    config: str | None = None
    source: str | None = None
    out: str | None = None
    seed: int | None = None
    device: str | None = None
    dtype: str | None = None
    dataset: str | None = None
    goal: Goal | None = None
    dense: ModelResult | None = None
    final: ModelResult | None = None
    comparison: Comparison | None = None
    int8: Int8Section | None = None
    decisions: Decisions | None = None
    stages: tuple[StageRow, ...] = ()
    written: str | None = None
    splits: Splits | None = None
    dense_reference: DenseReference | None = None
    report: str | None = None
    this_run: ThisRun | None = None


__all__ = [
    "SUMMARY_FORMAT",
    "BaseDecision",
    "Candidate",
    "Comparison",
    "ConfirmDecision",
    "DcsBlock",
    "DcsDecision",
    "Decisions",
    "DenseReference",
    "Goal",
    "MethodLine",
    "ModelResult",
    "RetrainDecision",
    "StageRow",
    "Summary",
    "SummaryPart",
    "ThisRun",
    "TokenMethod",
    "TokensDecision",
]
