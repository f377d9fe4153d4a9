"""The ``dcs`` stage (``stages.dcs``): the DCS channel search to the goal (or its latency target), then
its channels gathered into a smaller model (``OUT/dcs_search``, ``OUT/dcs_mat``); on a collapse once
more at a milder target, then the pipeline goes on without it (:mod:`nascompress.pipeline.fallback`).
The report's ``decisions.dcs``: the widths kept per block and how the search landed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ...config import setting
from ...dcs_search.align import known_align
from ...dcs_search.latency_cost import LatencyGoal, latency_target
from ...dcs_search.materialize import build_job as build_mat_job, materialize_search
from ...dcs_search.metrics import MaterializeMetrics
from ...dcs_search.run import build_job as build_dcs_job
from ...dcs_search.search_config import SEARCH_TRAIN_SETTINGS, DCSSearchConfig
from ...errors import NascompressError
from ...methods.dcs import SEARCH_DCS_SETTINGS
from ...models.layers import require_vit
from ...runs.io import load_with_arch
from ...runtime import resolve_device
from ..base_stage import data_config, runtime_values
from ...runs.files import find_metrics
from ..files import find_step_marker
from ..fallback import DcsOutcome, dcs_outcome, dcs_skipped, milder_target, run_dcs_with_fallback
from ..schema import Key, Section, check_lr_pair, library_keys, library_values, section_error
from ..sections import STAGE_DATA_SETTINGS, data_pointers
from ..stage import PipelineStage, PlanState, ReportState, StagePlan, register_stage
from ..steps import SkippedStep, Step
from ..summary import DcsBlock, DcsDecision, Decisions


@dataclass(frozen=True)
@library_keys(
    DCSSearchConfig,
    SEARCH_DCS_SETTINGS,
    SEARCH_TRAIN_SETTINGS,
    STAGE_DATA_SETTINGS,
    lead=("target_flops", *SEARCH_TRAIN_SETTINGS.names, *STAGE_DATA_SETTINGS.names),
)
class DCSStage(Section):
    """``stages.dcs``: DCS channel search (``nascompress search dcs``), then materialize. Keys are
    the search's settings (same names): every user-facing field of
    :class:`~nascompress.dcs_search.search_config.DCSSearchConfig` and :class:`~nascompress.methods.dcs.DCSConfig`,
    the search's training settings (:data:`~nascompress.dcs_search.search_config.SEARCH_TRAIN_SETTINGS`; null: the
    recipe's, ``batch_size`` null: from the training images), all declared in the library with their
    checks (:func:`~nascompress.pipeline.schema.library_keys`), and the keys below (the data's
    ``train_limit`` for this stage, and the pipeline's own ``on_collapse``). With ``on_collapse: retry``
    a search that collapses is retried once at a milder target, then skipped
    (:mod:`nascompress.pipeline.fallback`); ``stop`` fails the stage."""

    on_collapse: str = setting(
        "retry",
        choices=("retry", "stop"),
        help=(
            "retry: a search that collapses runs once more at a milder target, then the pipeline goes on "
            "without DCS; stop: the stage fails."
        ),
    )
    renamed = {"fallback": ("on_collapse", {True: "retry", False: "stop"})}
    elsewhere = data_pointers()

    def __post_init__(self) -> None:
        check_lr_pair(self)


def plan_dcs(state: PlanState, s: Any) -> StagePlan:
    """The search and materialize steps of section ``s``."""
    cfg, out, ctx, base_dir, goal = state.cfg, state.out, state.ctx, state.base_dir, state.cfg.goal
    try:
        require_vit(state.dense, "DCS")
    except NascompressError as e:
        raise ctx.err(
            "stages.dcs", f"{e}: drop stages.dcs (a pyramid ViT's stage is tokens, with search_spaces/mgvit-h.yaml)"
        ) from None
    latency = s.cost == "latency"  # the search steers its predicted latency
    target = s.target_flops if s.target_flops is not None or latency else goal.max_flops
    from_goal = latency and s.target_latency is None and goal.max_latency_ms is not None  # ratio: at run time
    if latency and s.target_latency is None and not from_goal:
        raise ctx.err(
            "stages.dcs.target_latency",
            "required with cost latency unless goal.max_latency_ms gives it (the ratio of the dense model's "
            "predicted latency to land at)",
        )
    if from_goal and s.latency_batch != 1:
        raise ctx.err(
            "stages.dcs.latency_batch",
            f"{s.latency_batch}: ",
            Key("goal.max_latency_ms"),
            " is a batch-1 latency; give ",
            Key("stages.dcs.target_latency"),
            " instead",
        )
    if target is None and not latency:
        raise ctx.err(
            "stages.dcs.target_flops",
            "required when the goal is a latency (the FLOPs ratio the channel search should land at)",
        )
    if not latency and cfg.stages.tokens is None and goal.max_flops is not None and target > goal.max_flops:
        raise ctx.err(
            "stages.dcs.target_flops",
            f"{target:g} is above goal.max_flops {goal.max_flops:g} and no tokens stage follows to close the gap",
        )
    try:
        job = build_dcs_job(
            base_dir,
            out / "dcs_search",
            search={**library_values(s, DCSSearchConfig), "target_flops": None if latency else target},
            method=library_values(s, SEARCH_DCS_SETTINGS),
            train={**library_values(s, SEARCH_TRAIN_SETTINGS), **runtime_values(cfg)},
            data=data_config(cfg, train_limit=s.train_limit),
        )
        mat = build_mat_job(out / "dcs_search", out / "dcs_mat", seed=cfg.seed)
    except NascompressError as e:
        raise section_error(ctx, "stages.dcs", s, e) from None

    def materialize(force: bool, resume: bool) -> MaterializeMetrics | SkippedStep:
        if dcs_skipped(out):
            return SkippedStep.because("the DCS search collapsed twice; the pipeline goes on without DCS")
        return materialize_search(mat, force=force)

    def set_goal(force: bool, resume: bool) -> LatencyGoal:
        return latency_target(
            load_with_arch(base_dir, map_location="cpu")[0],
            goal.max_latency_ms,
            device=resolve_device(cfg.device),
            dtype=s.latency_dtype,
            batch=1,
            align=known_align(job.method.align),  # (auto: the search chooses it later; the dense prediction)
        )

    def search(force: bool, resume: bool) -> DcsOutcome:
        the = job
        if from_goal:  # the goal's milliseconds as the ratio the latency_goal step measured (its marker)
            marker = find_step_marker(out, "latency_goal")
            if marker is None:
                raise NascompressError(f"{out}: the latency_goal step has not run; run the pipeline again")
            set_at = LatencyGoal.from_dict(marker.result, source=f"{out}: the latency_goal step's result")
            the = job.replace(search=job.search.replace(target_latency=set_at.ratio))
        return run_dcs_with_fallback(the, force=force, resume=resume, fallback=again)

    again = s.on_collapse == "retry"
    what = "predicted latency" if latency else "FLOPs"
    if from_goal:
        aim = f"{goal.max_latency_ms:g} ms of {what} (goal.max_latency_ms)"
        retry = "; on a collapse once more halfway to the dense latency, then without DCS" if again else ""
    else:
        ratio = s.target_latency if latency else target  # the ratio the search lands at, and of what
        aim = f"{ratio:g}x the dense {what}"
        retry = f"; on a collapse once more at {milder_target(ratio):g}x, then without DCS" if again else ""
    steps = []
    if from_goal:
        about = f"{goal.max_latency_ms:g} ms as a ratio of the dense model's latency measured now"
        steps.append(Step("latency_goal", None, "redo", set_goal, describe=about))
    steps += [
        Step(
            "dcs_search",
            out / "dcs_search",
            "train",
            search,
            outputs=("dcs_search/model.safetensors", "dcs_search/metrics.json"),
            describe=f"DCS channel search to {aim} ({s.epochs} epochs{retry})",
        ),
        Step(
            "dcs_mat",
            out / "dcs_mat",
            "redo",
            materialize,
            outputs=("dcs_mat/model.safetensors", "dcs_mat/metrics.json"),
            describe="materialize the searched channels",
        ),
    ]
    return StagePlan(steps, model=out / "dcs_mat")


DCS_METRICS = (  # what the report reads of the DCS search's metrics.json
    "target_flops",
    "flops_ratio",
    "cost",
    "target_latency",
    "latency_ratio",
    "latency_ms",
    "dense_latency_ms",
    "heads_kept",
    "skipped_blocks",
    "calibrated",
    "calibration",
    "calibration_move",
    "budget",
    "at_target_share",
    "val_top1",
    "dense_val_top1",
    "lam",
    "search_time_s",
    "train_images",
    "batch_size",
    "family_reason",
    "family_kl",
    "protected",
    "block_weights",
    "kept",
    "stopped",
)


def decide_dcs(state: ReportState) -> dict[str, DcsDecision]:
    """``decisions.dcs``: with the stage on, or where no compressed model could be made (its
    search was skipped), what it decided (:func:`dcs_decisions`)."""
    if state.final_dir is not None and state.pipe.cfg.stages.dcs is None:
        return {}
    dcs_rec = next((m for m in state.methods if m.get("name") == "dcs"), None)
    return {"dcs": dcs_decisions(state.pipe.out, dcs_rec, state.dense)}


def dcs_decisions(out: Path, dcs_rec: Mapping[str, Any] | None, dense: Any) -> DcsDecision:
    """The DCS stage's decisions: its gate family (and why), widths kept per block, how it landed
    and whether it fell back (a milder target, or skipped); ``in_final_model``: False where the final model
    is a token-only pick on the dense base (the search's landing is still recorded)."""
    res: dict[str, Any] = {"in_final_model": dcs_rec is not None}
    if dcs_rec is not None:
        family = (dcs_rec.get("config") or {}).get("mlp_gates", "residual")
        family = {True: "residual", False: "none"}.get(family, family)
        blocks = []
        for j, (blk, b) in enumerate(zip(dense.blocks, dcs_rec.get("blocks") or [])):
            hidden = family == "hidden"
            c = blk.mlp.fc1.out_features if hidden else blk.mlp.fc1.in_features
            keep = b.get("hidden_keep") if hidden else b.get("mlp_keep")
            blocks.append(
                DcsBlock.new(
                    block=j + 1,
                    mlp_kept=c if keep is None else len(keep),
                    mlp_total=c,
                    qk_kept=None if b.get("qk_keep") is None else [len(h) for h in b["qk_keep"]],
                    heads=blk.attn.num_heads,
                    head_dim=blk.attn.head_dim,
                )
            )
        res.update(
            config=dcs_rec.get("config"),
            mlp_gates=family,
            blocks=tuple(blocks),
            mlp_kept_total=sum(b.mlp_kept for b in blocks),
            mlp_total=sum(b.mlp_total for b in blocks),
        )
    sm = find_metrics(out / "dcs_search")
    if sm is not None:
        res.update({k: sm.get(k) for k in DCS_METRICS})
        res["kept_reason"] = (sm.get("comparison") or {}).get("reason")
    outcome = dcs_outcome(out)
    if outcome is not None:
        fell = {
            "dcs_outcome": outcome.dcs_outcome,
            "dcs_target": outcome.dcs_target,
            "planned_target": outcome.planned_target,
            "dcs_reason": outcome.dcs_reason,
        }
        res.update({k: v for k, v in fell.items() if v is not None})
    return DcsDecision.new(**res)


def dcs_lines(decisions: Decisions) -> list[str]:
    """The DCS stage's lines in the report's decisions."""
    dcs = decisions.dcs
    if dcs is None:
        return []
    if dcs.dcs_outcome == "skipped":
        return [
            f"dcs: the search collapsed at the planned target {dcs.planned_target}x and at the milder "
            f"one; the pipeline went on without DCS ({dcs.dcs_reason})"
        ]
    if dcs.blocks is None:
        if dcs.in_final_model is False and dcs.flops_ratio is not None:
            val = "" if dcs.val_top1 is None else f", validation top-1 {dcs.val_top1:.2f}%"
            return [
                f"dcs: target {dcs.target_flops}x the dense FLOPs, landed at {dcs.flops_ratio:.3f}x{val}; "
                "not in the final model: the pick across the token studies took a token-only model of the dense base"
            ]
        return []
    move = dcs.calibration_move
    cal = (
        (" (threshold calibrated)" if move is None else f" (threshold calibrated by {move:.3f})")
        if dcs.calibrated
        else ""
    )
    if dcs.at_target_share is not None:
        cal += f", at the target for {dcs.at_target_share:.0%} of the search"
    ratio = f", landed at {dcs.flops_ratio:.3f}x{cal}" if dcs.flops_ratio is not None else ""
    what = "hidden neurons" if dcs.mlp_gates == "hidden" else "residual channels"
    if dcs.cost == "latency":  # the search steered its predicted latency; the FLOPs follow
        lat = dcs.latency_ratio
        ratio = (f", landed at {lat:.3f}x predicted{cal}" if lat is not None else "") + (
            f" ({dcs.flops_ratio:.3f}x the FLOPs)" if dcs.flops_ratio is not None else ""
        )
        target = f"target {dcs.target_latency}x the dense latency"
    else:
        target = f"target {dcs.target_flops}x the dense FLOPs"
    lines = [
        f"dcs: {target}{ratio}; MLP {what} kept "
        f"{dcs.mlp_kept_total} of {dcs.mlp_total}; Q/K mask {dcs.config.get('qk_mask')}"
    ]
    if dcs.family_reason:
        lines.append(f"  MLP gates {dcs.family_reason}")
    if dcs.kept_reason:  # the searched model against the magnitude baseline at the same FLOPs
        lines.append(f"  {dcs.kept_reason}")
    if dcs.dcs_outcome == "milder":
        lines.append(
            f"  the search at the planned target {dcs.planned_target}x collapsed; retried at "
            f"{dcs.dcs_target}x ({dcs.dcs_reason})"
        )
    return lines


STAGE = register_stage(
    PipelineStage(
        "dcs",
        10,
        ("dcs_search", "dcs_mat"),
        plan=plan_dcs,
        config=DCSStage,
        compresses=True,
        decide=decide_dcs,
        report_lines=dcs_lines,
    )
)
