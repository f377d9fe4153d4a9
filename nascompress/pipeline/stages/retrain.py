"""The ``retrain`` stage (``stages.retrain``): the compressed model retrained, distilling from the base
(``OUT/final``); with ``confirm_pick`` the channel-only model retrained too and the better kept
(:mod:`nascompress.pipeline.confirm`), and with ``report.dense_reference`` the dense base retrained with
the same recipe (:mod:`nascompress.pipeline.dense_reference`). The report's ``decisions.confirm`` and
``decisions.retrain``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...config import setting
from ...errors import NascompressError
from ...retraining.config import RetrainConfig
from ...retraining.metrics import RetrainMetrics
from ...retraining.run import RETRAIN_TRAIN_SETTINGS, build_job, retrain
from ...runs.files import find_metrics
from ..base_stage import data_config, runtime_values
from ..confirm import CHANNEL_DIR, channel_only_flops, decide, pick_kind, why_not
from ..dense_reference import NEEDS_RETRAIN, dense_reference_step
from ..fallback import current_model, dcs_skipped
from ..files import find_step_marker
from ..report_format import on_images
from ..schema import Section, check_lr_pair, library_config, library_keys, library_values, section_error
from ..sections import STAGE_DATA_SETTINGS, data_pointers
from ..stage import PipelineStage, PlanState, ReportState, StagePlan, register_stage
from ..steps import SkippedStep, Step
from ..summary import ConfirmDecision, Decisions, RetrainDecision


@dataclass(frozen=True)
@library_keys(
    RetrainConfig,
    RETRAIN_TRAIN_SETTINGS,
    STAGE_DATA_SETTINGS,
    lead=("epochs", "eta", "warmup_frac", "distil_from", *STAGE_DATA_SETTINGS.names),
)
class RetrainStage(Section):
    """``stages.retrain``: final training of the compressed model (``nascompress retrain``). Keys are
    retrain's settings (same names): every user-facing field of
    :class:`~nascompress.retraining.run.RetrainConfig` (``feat_kd`` null: 1 with the base as teacher) and its
    training settings (:data:`~nascompress.retraining.run.RETRAIN_TRAIN_SETTINGS`; null: the recipe's,
    ``batch_size`` null: from the training images), declared in the library with their checks, and
    the keys below: ``distil_from`` (the dense ``base`` or ``none``: the pipeline's choice of teacher
    among its own runs; the command's ``--teacher`` is a run directory), ``confirm_pick`` (the
    ``confirm`` step: :mod:`nascompress.pipeline.confirm`) and the data's ``train_limit`` for this
    stage."""

    distil_from: str = setting(
        "base", choices=("base", "none"), help=("base: distil from the dense base (the teacher); none: no teacher.")
    )
    confirm_pick: bool = setting(
        True,
        help=(
            "When the pick cuts tokens and the DCS stage's channel-only model meets the FLOPs goal by itself, "
            "retrain that one too with the same recipe and keep the better of the two on validation "
            "(the token study scores its trials on few images; this checks its pick at the full budget)."
        ),
    )
    renamed = {"teacher": ("distil_from", None)}
    elsewhere = data_pointers()

    def __post_init__(self) -> None:
        check_lr_pair(self)


def plan_retrain(state: PlanState, s: Any) -> StagePlan:
    """The retrain step of section ``s``, and the confirm and dense-reference steps it brings."""
    cfg, out, ctx, base_dir, current = state.cfg, state.out, state.ctx, state.base_dir, state.current
    try:
        job = build_job(
            current,
            out / "final",
            retrain=library_config(s, RetrainConfig),
            train={**library_values(s, RETRAIN_TRAIN_SETTINGS), **runtime_values(cfg)},
            data=data_config(cfg, train_limit=s.train_limit),
            teacher=base_dir if s.distil_from == "base" else None,
        )
    except NascompressError as e:  # the teacher is distil_from's choice: the base
        raise section_error(ctx, "stages.retrain", s, e, names={"teacher": "distil_from: base"}) from None

    def run(force: bool, resume: bool) -> RetrainMetrics | SkippedStep:
        start = current_model(
            out,
            base_dir=base_dir,
            dcs=cfg.stages.dcs is not None,
            tokens=cfg.stages.tokens is not None,
            retrain=True,
            upto="retrain",
        )
        if start is None:
            return SkippedStep.because("no compressed model to retrain (the DCS stage was skipped)")
        return retrain(job.replace(model_dir=str(start)), force=force, resume=resume)

    steps = [
        Step(
            "retrain",
            out / "final",
            "train",
            run,
            outputs=("final/model.safetensors", "final/metrics.json"),
            describe=f"retrain the compressed model ({s.epochs} epochs, eta {s.eta:g}"
            f"{', teacher: the base' if s.distil_from == 'base' else ''})",
        )
    ]
    # report.dense_reference: the dense base retrained with this job's recipe and teacher, its own step
    tail = [dense_reference_step(job, out, base_dir)] if cfg.report.dense_reference else []
    if not (s.confirm_pick and cfg.stages.dcs is not None and cfg.stages.tokens is not None):
        return StagePlan(steps + tail, model=out / "final")

    def check(force: bool, resume: bool) -> ConfirmDecision:
        if dcs_skipped(out):
            return ConfirmDecision.new(skipped=True, reason="the DCS stage was skipped: no channel-only model")
        kind, ratio = pick_kind(out), channel_only_flops(out)
        reason = why_not(kind, ratio, cfg.goal.max_flops)
        if reason is not None:
            return ConfirmDecision.new(skipped=True, reason=reason, kept="pick")
        retrain(job.replace(model_dir=str(out / "dcs_mat"), out=str(out / CHANNEL_DIR)), force=force, resume=resume)
        picked = find_metrics(out / "tokens" / "picked")
        return decide(out, kind, pick_flops=None if picked is None else picked.flops_ratio, channel_flops=ratio)

    steps.append(
        Step(
            "confirm",
            out / CHANNEL_DIR,
            "train",
            check,
            outputs=(f"{CHANNEL_DIR}/model.safetensors", f"{CHANNEL_DIR}/metrics.json"),
            describe="when the pick cuts tokens: retrain the channel-only model too (if it meets the goal) and "
            "keep the better of the two on validation",
        )
    )
    return StagePlan(steps + tail, model=out / "final")


def check_without_retrain(state: PlanState) -> None:
    """``report.dense_reference`` retrains the base with this stage's recipe: refused without it."""
    if state.cfg.report.dense_reference:
        raise state.ctx.err("report.dense_reference", NEEDS_RETRAIN)


# the retraining's record in summary.json (from the kept run's metrics.json)
_RETRAIN_KEYS = (
    "epochs eta warm_epochs kd feat_kd batch_size peak_lr start_val_top1 best_val_top1 best_epoch test_top1 test_n "
    "train_time_s"
).split()


def decide_retrain(state: ReportState) -> dict[str, Any]:
    """``decisions.confirm`` (the pick checked against the channel-only model at the full budget, where
    that step ran) and ``decisions.retrain`` (the kept model's recipe and result, with the stage on)."""
    cfg, out, final_dir = state.pipe.cfg, state.pipe.out, state.final_dir
    found: dict[str, Any] = {}
    check = find_step_marker(out, "confirm")
    if check is not None:
        found["confirm"] = ConfirmDecision.new(**check.result)
    kept_runs = (out / "final", out / CHANNEL_DIR)
    r = find_metrics(final_dir) if cfg.stages.retrain is not None and final_dir in kept_runs else None
    if r is not None:
        found["retrain"] = RetrainDecision.new(
            **{k: r.get(k) for k in _RETRAIN_KEYS}, teacher=cfg.stages.retrain.distil_from
        )
    return found


def retrain_lines(decisions: Decisions) -> list[str]:
    """The confirm step's line and the retraining's in the report's decisions."""
    return [*_confirm_lines(decisions.confirm), *_retrain_lines(decisions.retrain)]


def _confirm_lines(ck: ConfirmDecision | None) -> list[str]:
    if ck is None or not ck.to_dict():  # (a confirm step that recorded nothing)
        return []
    return [f"confirm: not run ({ck.reason})" if ck.skipped else f"confirm: {ck.reason}"]


def _retrain_lines(rt: RetrainDecision | None) -> list[str]:
    if rt is None:
        return []
    extra = "" if rt.batch_size is None else f", batch {rt.batch_size}, feature KD {rt.feat_kd}"
    warm = f" ({rt.warm_epochs} CE-only)" if rt.eta else ""  # epochs before the IB bound joins
    return [
        f"retrain: {rt.epochs} epochs, eta {rt.eta:g}{warm}, teacher "
        f"{rt.teacher}{extra}, best epoch {rt.best_epoch}, test top-1 {rt.test_top1:.2f}%"
        f"{on_images(rt.test_n)}"
    ]


STAGE = register_stage(
    PipelineStage(
        "retrain",
        30,
        ("retrain", "confirm"),
        plan=plan_retrain,
        config=RetrainStage,
        when_off=check_without_retrain,
        decide=decide_retrain,
        report_lines=retrain_lines,
    )
)
