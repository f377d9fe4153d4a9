"""The ``tokens`` stage (``stages.tokens``): an Optuna study of a search space on the model so far
(``OUT/tokens``), with ``also_dense`` the same study on the dense base too, and the trial the goal's
pick chooses across them rebuilt (``OUT/tokens/picked``). The report's ``decisions.tokens``: the
study, the trial picked and its settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ...config import setting, shared
from ...errors import NascompressError
from ...methods import get_method
from ...studies.samplers import sampler_factory
from ...studies.space_model import load_space
from ...studies.trial_model import build_job as build_pick_job
from ...studies.results import StudyRun
from ...studies.trials import STUDY_SETTINGS, GoalUnreachable, SearchJob, build_job as build_study_job, run_search
from ..base_stage import data_config, runtime_values
from ..fallback import PickedTrial, current_model, dcs_skipped, pick_across
from ...profiling.compare import dense_flops_text
from ...runs.files import find_metrics
from ...runs.run_config import find_run_config
from ..files import Pick, find_pick, find_step_marker, write_pick
from ..report_format import method_summary
from ..schema import Section, library_keys, library_values, section_error
from ..sections import data_pointers
from ..stage import PipelineStage, PlanState, ReportState, StagePlan, register_stage
from ..steps import Pipeline, SkippedStep, Step
from ..summary import Decisions, TokenMethod, TokensDecision

STUDY_DB = "studies.db"
STUDY_JOURNAL = "studies.journal"


@dataclass(frozen=True)
@library_keys(STUDY_SETTINGS, lead=("space",))
class TokensStage(Section):
    """``stages.tokens``: an Optuna search over a space file (``nascompress search tokens``) on the
    current model, then the best trial under the goal (``nascompress materialize --study --pick``).
    Keys are the study's settings (same names as the command's options, declared in the library:
    :data:`~nascompress.studies.trials.STUDY_SETTINGS`; ``study`` defaults to ``pipeline``);
    ``objective: goal`` (the default, as the command's) searches accuracy under the goal's constraint.
    ``also_dense`` (after a dcs stage): the same study runs a second time on the dense base (study
    ``<study>-dense``, token-only models), and the goal's pick takes the better of the two studies'
    picks, scored on the same images (:func:`~nascompress.pipeline.fallback.pick_across`): the pipeline
    chooses between cutting channels and tokens, both, or tokens alone."""

    also_dense: bool = setting(
        True,
        help=(
            "After a dcs stage, also search the token space on the dense base and keep the better pick "
            "(token-only against channels + tokens)."
        ),
    )
    study: str = shared(SearchJob, "study", default="pipeline")  # the pipeline's own study name

    elsewhere = {
        **data_pointers(()),
        "train_limit": "the study's training images are train_images (search tokens --train-images); "
        "the dataset's, for every stage, data.train_limit",
        "eval_limit": "the study's validation images are eval_images (search tokens --eval-images); "
        "the test images, for every stage, data.eval_limit",
    }


def plan_tokens(state: PlanState, s: Any) -> StagePlan:
    """The study steps of section ``s`` (on the model so far, and with ``also_dense`` on the base) and the pick."""
    cfg, out, ctx, base_dir, current, goal = (
        state.cfg,
        state.out,
        state.ctx,
        state.base_dir,
        state.current,
        state.cfg.goal,
    )
    try:
        space = load_space(
            s.space, model=state.dense
        )  # layers sized by (and within) a plain ViT's depth; none on a pyramid
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

    def search(force: bool, resume: bool, progress: bool = True, *, on_dense: bool = False) -> StudyRun | SkippedStep:
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
            return SkippedStep.because("the DCS stage was skipped: the first study already searched the base")
        study = dense_study if on_dense else s.study
        try:
            res = run_search(job.replace(base=str(start), study=study), progress=progress)
        except GoalUnreachable as e:
            if not on_dense:
                raise
            return SkippedStep.because(f"no token-only model reaches the goal on the dense base ({e})")
        if not res.get("finished"):
            raise NascompressError(
                f"the study {study!r} has {res.complete} of {s.trials} complete trials; "
                "rerun the same command to continue it"
            )
        return res

    def pick_best(force: bool, resume: bool) -> PickedTrial:
        marker = find_step_marker(out, "tokens_search_dense")
        ran = marker is not None and not marker.skipped
        studies = [s.study] + ([dense_study] if dense_study and ran and not dcs_skipped(out) else [])
        res = pick_across(pick, studies, force=force)
        if dense_study:  # the report's "where to cut" line
            why = None if ran or marker is None else marker.result.get("reason")
            write_pick(
                out / "tokens",
                Pick.new(
                    picked_study=res.picked_study,
                    candidates=res.candidates,
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
    return StagePlan(steps, model=out / "tokens" / "picked", storage=storage)


def decide_tokens(state: ReportState) -> dict[str, TokensDecision]:
    """``decisions.tokens``: with the stage on and a final model, the study and its pick."""
    if state.pipe.cfg.stages.tokens is None or state.final_dir is None:
        return {}
    return {"tokens": tokens_decisions(state.pipe, [m for m in state.methods if m.get("name") != "dcs"])}


def tokens_decisions(pipe: Pipeline, methods: list[Mapping[str, Any]]) -> TokensDecision:
    """The study, its trials, the trial picked and its settings, the methods in the final model, and
    after a DCS stage the pick on the DCS model against the one on the dense base."""
    out = pipe.out
    res: dict[str, Any] = {
        "study": pipe.cfg.stages.tokens.study,
        "storage": pipe.storage,
        "pick_rule": pipe.cfg.goal.pick,
        "eval_images": pipe.cfg.stages.tokens.eval_images,
        "methods": tuple(
            TokenMethod.new(name=m["name"], config=m.get("config"), summary=method_summary(m)) for m in methods
        ),
    }
    marker = find_step_marker(out, "tokens_search")
    if marker is not None:
        res["trials_complete"] = marker.result.get("complete")
        res["trials_requested"] = marker.result.get("n_trials")
    pc = find_run_config(out / "tokens" / "picked")
    m = find_metrics(out / "tokens" / "picked")
    if m is not None:
        res.update(
            picked_trial=m.get("trial"),
            trial_accuracy=m.get("trial_accuracy"),
            trial_flops_ratio=m.get("flops_ratio"),
            trial_params=m.get("params"),
        )
    if pc is not None:
        prov = pc.get("from_study") or {}
        res["params"] = prov.get("params")
        res["trial_seed"] = prov.get("seed")
    pj = find_pick(out / "tokens")
    if pj is not None:  # after a dcs stage: the pick on the DCS model against the one on the dense base
        res.update(
            picked_study=pj.picked_study,
            candidates=pj.candidates,
            dense_study=pj.dense_study,
            dense_skipped=pj.dense_skipped,
        )
        res["study"] = pj.picked_study or res["study"]
    return TokensDecision.new(**res)


def tokens_lines(decisions: Decisions) -> list[str]:
    """The tokens stage's lines in the report's decisions."""
    tok = decisions.tokens
    if tok is None:
        return []
    acc, ratio = tok.trial_accuracy, tok.trial_flops_ratio
    lines = [
        f"tokens: study {tok.study!r}, {tok.trials_complete} trials; picked trial "
        f"{tok.picked_trial} by {tok.pick_rule} ("
        + (
            ""
            if acc is None
            else f"accuracy {acc:.2f}% on the search's validation images (eval_images {tok.eval_images}), "
        )
        + ("" if ratio is None else dense_flops_text(ratio))
        + ")"
    ]
    if tok.dense_study and tok.candidates:  # where to cut: channels + tokens, or tokens alone
        parts = []
        for name, c in tok.candidates.items():
            what = "tokens only, on the dense base" if name == tok.dense_study else "on the DCS model"
            parts.append(
                f"{name!r} ({what}): "
                + (
                    f"trial {c.trial}, {c.accuracy:.2f}% at {c.flops_ratio:.3f}x"
                    if c.trial is not None
                    else "no trial meets the goal"
                )
            )
        if tok.dense_skipped:
            parts.append(f"{tok.dense_study!r} (tokens only): {tok.dense_skipped}")
        lines.append("  where to cut: " + "; ".join(parts) + f"; kept {tok.picked_study!r}")
    if tok.params:
        lines.append(
            "  params: "
            + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in tok.params.items())
        )
    lines += [f"  {m.summary}" for m in tok.methods]
    return lines


STAGE = register_stage(
    PipelineStage(
        "tokens",
        20,
        ("tokens_search", "tokens_search_dense", "tokens_pick"),
        plan=plan_tokens,
        config=TokensStage,
        compresses=True,
        decide=decide_tokens,
        report_lines=tokens_lines,
    )
)
