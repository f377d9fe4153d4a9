"""Planning a pipeline: every stage's job built (and so validated) before anything runs, as
:class:`Step` objects of a :class:`Pipeline` (:func:`plan`)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from ..errors import NascompressError
from ..resources import resolve_file
from .config_io import load_config
from .schema import SchemaContext, library_config, library_values, section_error
from .sections import PipelineConfig
from ..pipeline_files import PICK_FILE, Pick, find_step_marker, write_pick  # noqa: F401  (PICK_FILE: kept importable here)
from ..utils import resolve_device
from ..export import export_run
from ..layers import require_vit
from ..methods import get_method
from ..methods.dcs import SEARCH_DCS_SETTINGS
from ..retraining import RETRAIN_TRAIN_SETTINGS, RetrainConfig, build_job, retrain
from ..dcs_search.search_config import SEARCH_TRAIN_SETTINGS, DCSSearchConfig
from ..dcs_search.run import build_job as build_dcs_job
from ..dcs_search.latency_cost import latency_target
from ..dcs_search.materialize import build_job as build_mat_job, materialize_search
from ..search.space import load_space
from ..search.trial_model import build_job as build_pick_job
from ..search.trials import STUDY_SETTINGS, GoalUnreachable, build_job as build_study_job, run_search, sampler_factory
from . import confirm
from .dense_reference import NEEDS_RETRAIN, dense_reference_step
from ..runs.files import find_metrics
from ..runs.io import load_with_arch
from .fallback import current_model, dcs_skipped, milder_target, pick_across, run_dcs_with_fallback
from .report import write_summary
from .steps import Pipeline, Step
from .base_stage import check_data, data_config, plan_base, runtime_values

# PICK_FILE (tokens/pick.json): each study's pick and which one was kept (pipeline_files)
STUDY_DB = "studies.db"
STUDY_JOURNAL = "studies.journal"
STEPS = (
    "base",
    "dcs_search",
    "dcs_mat",
    "tokens_search",
    "tokens_search_dense",
    "tokens_pick",
    "retrain",
    "confirm",  # then "retrain_dense" with report.dense_reference (dense_reference.py)
    "export",
    "report",
)


def _plan_dcs(cfg: PipelineConfig, out: Path, ctx: SchemaContext, base_dir: Path) -> list[Step]:
    s, goal = cfg.stages.dcs, cfg.goal
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
    return [
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


def _plan_tokens(
    cfg: PipelineConfig, out: Path, ctx: SchemaContext, current: Path, dense: Any, base_dir: Path
) -> tuple[list[Step], str]:
    s, goal = cfg.stages.tokens, cfg.goal
    try:
        space = load_space(s.space, model=dense)  # layers sized by (and within) a plain ViT's depth; none on a pyramid
    except NascompressError as e:
        raise ctx.err("stages.tokens.space", str(e)) from None
    try:
        sampler_factory(s.sampler, space, cfg.seed, trials=s.trials)  # qmc/gp on what they cannot search: refused now
    except NascompressError as e:
        raise ctx.err("stages.tokens.sampler", str(e)) from None
    names = [m.name for m in space.methods]
    if cfg.stages.dcs is not None:
        if "dcs" in names:
            raise ctx.err(
                "stages.tokens.space", f"space {s.space} searches dcs, but the dcs stage already ran: drop one of them"
            )
        cannot = [n for n in names if "dcs" not in get_method(n).stacks_on]
        if cannot:
            raise ctx.err(
                "stages.tokens.space",
                f"{', '.join(cannot)} cannot follow the dcs stage (it stacks on "
                f"{', '.join(sorted(get_method(cannot[0]).stacks_on)) or 'nothing'})",
            )
    if goal.max_latency_ms is not None and s.objective == "flops":
        raise ctx.err(
            "stages.tokens.objective",
            "flops trials record no latency, but the goal is max_latency_ms: use goal, latency or throughput",
        )
    storage = f"sqlite:///{out.resolve() / STUDY_DB}" if s.workers == 1 else f"journal:{out.resolve() / STUDY_JOURNAL}"
    try:
        constrained = s.objective == "goal"  # the goal is the study's constraint
        job = build_study_job(
            current,
            search={
                **library_values(s, STUDY_SETTINGS),
                "study": s.study,
                "storage": storage,
                "max_flops": goal.max_flops if constrained else None,
                "max_latency_ms": goal.max_latency_ms if constrained else None,
            },
            runtime=runtime_values(cfg),
            data=data_config(cfg),
        )
        pick = build_pick_job(s.study, out / "tokens" / "picked", pick=goal.pick, storage=storage)
    except NascompressError as e:
        raise section_error(ctx, "stages.tokens", s, e) from None

    # after a dcs stage the same space is also searched on the dense base (token-only models) and the
    # goal's pick compares both studies: the pipeline chooses where to cut
    dense_study = f"{s.study}-dense" if cfg.stages.dcs is not None and s.also_dense else None

    def search(force: bool, resume: bool, progress: bool = True, *, on_dense: bool = False) -> dict[str, Any]:
        (out / "tokens" / ("dense" if on_dense else "")).mkdir(parents=True, exist_ok=True)
        start = (
            base_dir
            if on_dense
            else current_model(
                out, base_dir=base_dir, dcs=cfg.stages.dcs is not None, tokens=True, retrain=False, upto="tokens"
            )
        )
        if on_dense and start == current_model(
            out, base_dir=base_dir, dcs=True, tokens=True, retrain=False, upto="tokens"
        ):
            return {"skipped": True, "reason": "the DCS stage was skipped: the first study already searched the base"}
        study = dense_study if on_dense else s.study
        try:
            res = run_search(job.replace(base=str(start), study=study), progress=progress)
        except GoalUnreachable as e:
            if not on_dense:
                raise
            return {"skipped": True, "reason": f"no token-only model reaches the goal on the dense base ({e})"}
        if not res.get("finished"):
            raise NascompressError(
                f"the study {study!r} has {res['complete']} of {s.trials} complete trials; "
                "rerun the same command to continue it"
            )
        return res

    def pick_best(force: bool, resume: bool) -> dict[str, Any]:
        marker = find_step_marker(out, "tokens_search_dense")
        ran = marker is not None and not marker.skipped
        studies = [s.study] + ([dense_study] if dense_study and ran and not dcs_skipped(out) else [])
        res = pick_across(pick, studies, force=force)
        if dense_study:  # the report's "where to cut" line
            why = None if ran or marker is None else marker.result.get("reason")
            write_pick(
                out / "tokens",
                Pick.new(
                    picked_study=res["picked_study"],
                    candidates=res["candidates"],
                    dense_study=dense_study,
                    dense_skipped=why,
                ),
            )
        return res

    steps = [
        Step(
            "tokens_search",
            out / "tokens",
            "study",
            search,
            outputs=(),
            describe=f"search {space.name} ({s.trials} trials, study {s.study!r} in {STUDY_DB})",
        )
    ]
    if dense_study:
        steps.append(
            Step(
                "tokens_search_dense",
                out / "tokens" / "dense",
                "study",  # its own folder (a first run is not "continuing")
                lambda force, resume, progress=True: search(force, resume, progress, on_dense=True),
                outputs=(),
                describe=f"search {space.name} on the dense base too ({s.trials} trials, "
                f"study {dense_study!r}: token-only models)",
            )
        )
    steps.append(
        Step(
            "tokens_pick",
            out / "tokens" / "picked",
            "redo",
            pick_best,
            outputs=("tokens/picked/model.safetensors", "tokens/picked/metrics.json"),
            describe=f"rebuild the trial picked by {goal.pick}"
            + (f", the better of studies {s.study!r} and {dense_study!r}" if dense_study else ""),
        )
    )
    return steps, storage


def _plan_retrain(cfg: PipelineConfig, out: Path, ctx: SchemaContext, current: Path, base_dir: Path) -> list[Step]:
    s = cfg.stages.retrain
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

    def run(force: bool, resume: bool) -> dict[str, Any]:
        start = current_model(
            out,
            base_dir=base_dir,
            dcs=cfg.stages.dcs is not None,
            tokens=cfg.stages.tokens is not None,
            retrain=True,
            upto="retrain",
        )
        if start is None:
            return {"skipped": True, "reason": "no compressed model to retrain (the DCS stage was skipped)"}
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
        return steps + tail

    def check(force: bool, resume: bool) -> dict[str, Any]:
        if dcs_skipped(out):
            return {"skipped": True, "reason": "the DCS stage was skipped: no channel-only model"}
        kind, ratio = confirm.pick_kind(out), confirm.channel_only_flops(out)
        reason = confirm.why_not(kind, ratio, cfg.goal.max_flops)
        if reason is not None:
            return {"skipped": True, "reason": reason, "kept": "pick"}
        retrain(
            job.replace(model_dir=str(out / "dcs_mat"), out=str(out / confirm.CHANNEL_DIR)), force=force, resume=resume
        )
        picked = find_metrics(out / "tokens" / "picked") or {}
        return confirm.decide(out, kind, {"pick": picked.get("flops_ratio"), "channel": ratio})

    steps.append(
        Step(
            "confirm",
            out / confirm.CHANNEL_DIR,
            "train",
            check,
            outputs=(f"{confirm.CHANNEL_DIR}/model.safetensors", f"{confirm.CHANNEL_DIR}/metrics.json"),
            describe="when the pick cuts tokens: retrain the channel-only model too (if it meets the goal) and "
            "keep the better of the two on validation",
        )
    )
    return steps + tail


def _plan_export(cfg: PipelineConfig, out: Path, base_dir: Path) -> Step:
    s = cfg.export
    target, ec = out / "export" / s.filename, s.config(seed=cfg.seed)

    def run(force: bool, resume: bool) -> dict[str, Any]:
        st = cfg.stages
        final = current_model(
            out,
            base_dir=base_dir,
            dcs=st.dcs is not None,
            tokens=st.tokens is not None,
            retrain=st.retrain is not None,
            upto="final",
        )  # after a DCS fallback: what was made
        # no compressed model (the DCS stage was skipped and nothing else compresses): the base is exported
        # (int8: calibrated and checked on the pipeline's data)
        return export_run(final or base_dir, out=target, config=ec, force=True, data=data_config(cfg))["verification"]

    return Step(
        "export",
        out / "export",
        "redo",  # the step owns OUT/export: an earlier attempt is replaced
        run,
        outputs=(f"export/{s.filename}", f"export/{s.filename}.json"),
        describe=f"export the final model as {s.format} (export/{s.filename}), checked against PyTorch"
        + (f"; quantized ({s.quantize}) and checked on the validation split" if s.quantize != "none" else ""),
    )


def plan(config: str | Path, *, out: str | Path, seed: int | None = None) -> Pipeline:
    """Validate ``config`` completely (schema, files, models, space, every stage's job) and return
    the pipeline for ``out``. Reads files, writes nothing."""
    config = resolve_file(config, what="config file")  # a path, or a shipped config's name
    cfg = load_config(config, seed=seed)
    ctx = SchemaContext(str(config), Path(os.path.abspath(config)).parent)
    try:
        resolve_device(cfg.device)
    except NascompressError as e:
        raise ctx.err("device", str(e)) from None
    out = Path(os.path.abspath(out))
    n_classes = check_data(cfg, ctx)
    base_step, base_dir, dense = plan_base(cfg, out, ctx, n_classes)
    steps = [base_step]
    current = base_dir
    if cfg.stages.dcs is not None:
        try:
            require_vit(dense, "DCS")
        except NascompressError as e:
            raise ctx.err(
                "stages.dcs", f"{e}: drop stages.dcs (a pyramid ViT's stage is tokens, with search_spaces/mgvit-h.yaml)"
            ) from None
        steps += _plan_dcs(cfg, out, ctx, base_dir)
        current = out / "dcs_mat"
    storage = None
    if cfg.stages.tokens is not None:
        tok, storage = _plan_tokens(cfg, out, ctx, current, dense, base_dir)
        steps += tok
        current = out / "tokens" / "picked"
    if cfg.stages.retrain is not None:
        steps += _plan_retrain(cfg, out, ctx, current, base_dir)
        current = out / "final"
    elif cfg.report.dense_reference:
        raise ctx.err("report.dense_reference", NEEDS_RETRAIN)
    if cfg.export is not None:
        needs = ("onnx", "onnxruntime") if cfg.export.format == "onnx" else ()
        missing = [m for m in needs if importlib.util.find_spec(m) is None]
        if missing:  # refused now, not after every training stage
            raise ctx.err(
                "export",
                f"format onnx needs {' and '.join(missing)}: pip install 'nascompress[export]', "
                "or drop the export section",
            )
        steps.append(_plan_export(cfg, out, base_dir))
    pipe = Pipeline(
        cfg=cfg,
        out=out,
        source=str(config),
        steps=steps,
        base_dir=base_dir,
        final_dir=current,
        storage=storage,
        data=data_config(cfg),
    )

    def report(force: bool, resume: bool) -> dict[str, Any]:
        return write_summary(pipe)

    steps.append(
        Step(
            "report",
            None,
            "redo",
            report,
            outputs=("summary.json", "report.html"),
            describe="compare with the dense base; write summary.json and report.html",
        )
    )
    return pipe
