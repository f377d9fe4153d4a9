"""The ``dcs`` stage (``stages.dcs``): the DCS channel search to the goal (or its latency target), then
its channels gathered into a smaller model (``OUT/dcs_search``, ``OUT/dcs_mat``); on a collapse once
more at a milder target, then the pipeline goes on without it (:mod:`nascompress.pipeline.fallback`)."""

from __future__ import annotations

from typing import Any

from ...dcs_search.latency_cost import latency_target
from ...dcs_search.materialize import build_job as build_mat_job, materialize_search
from ...dcs_search.run import build_job as build_dcs_job
from ...dcs_search.search_config import SEARCH_TRAIN_SETTINGS, DCSSearchConfig
from ...errors import NascompressError
from ...methods.dcs import SEARCH_DCS_SETTINGS
from ...models.layers import require_vit
from ...runs.io import load_with_arch
from ...runtime import resolve_device
from ..base_stage import data_config, runtime_values
from ..fallback import dcs_skipped, milder_target, run_dcs_with_fallback
from ..schema import library_values, section_error
from ..stage import PipelineStage, PlanState, StagePlan, register_stage
from ..steps import Step


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
            f"{s.latency_batch}: goal.max_latency_ms is a batch-1 latency; give stages.dcs.target_latency instead",
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

    def materialize(force: bool, resume: bool) -> dict[str, Any]:
        if dcs_skipped(out):
            return {"skipped": True, "reason": "the DCS search collapsed twice; the pipeline goes on without DCS"}
        return materialize_search(mat, force=force)

    def search(force: bool, resume: bool) -> dict[str, Any]:
        the = job
        if from_goal:  # the goal's milliseconds as a ratio of the base's latency predicted on this device
            ratio = latency_target(
                load_with_arch(base_dir, map_location="cpu")[0],
                goal.max_latency_ms,
                device=resolve_device(cfg.device),
                dtype=s.latency_dtype,
                batch=1,
                align=job.method.align,
            )
            the = job.replace(search=job.search.replace(target_latency=ratio))
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
    steps = [
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


STAGE = register_stage(
    PipelineStage("dcs", 10, ("dcs_search", "dcs_mat"), section=lambda cfg: cfg.stages.dcs, plan=plan_dcs)
)
