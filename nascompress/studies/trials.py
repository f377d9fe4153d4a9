"""``nascompress search tokens|joint``: the Optuna outer loop over a search-space file.

Each trial builds the configured model from a base run (dense, imported or DCS-materialized):
the space's methods are applied in order through the method contract (a ``dcs`` entry first runs
a short DCS search at the trial's FLOPs target and materializes it); methods with new
predictors (DynamicViT, Sparsifiner) then run their short predictor-only stage (backbone frozen,
distilled to the base), unless the trial fine-tunes (``finetune_epochs``: a short fine-tune with
the recipe of the last method of the stack). Objectives: top-1 on a fixed, class-balanced subset
of the validation split, and the FLOPs ratio against the uncompressed model (or the latency /
throughput measured on this device, interleaved with the uncompressed model and cached per
architecture). With ``max_flops`` / ``max_latency_ms`` the study is single-objective (accuracy)
under that constraint (Optuna's ``trial.set_constraint``), and fine-tuned trials feed a pruner.

Cheap trials: each worker loads the base model and the data once (validation and calibration
images preprocessed into tensors once); a zero-shot trial only patches, calibrates and evaluates.
A ``dcs`` entry's search runs with the study's seed, not the trial's, so the same DCS settings give
the same channels in every trial: each worker searches them once and reuses the result (the
search is the expensive part of a joint trial, and its target takes a few values only), and the
random state is reset after it, so the later stages do not depend on whether it was reused.

The uncompressed configuration and the papers' configurations are enqueued first (where the
space can express them). Everything needed to rebuild a trial is stored in the study: the job
(``study.user_attrs``), each trial's method records and seed (:func:`build_trial` rebuilds it).
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import optuna

from ..config import Config, StageSettings, check_settings, setting
from ..limits import MAX_BATCH, MAX_EPOCHS, MAX_IMAGES, MAX_ITERS, MAX_STEPS, MAX_WORKERS
from ..data import DataConfig, InputSpec
from ..errors import NascompressError, SettingError, words
from ..yaml_io import resolve_file
from ..runs.io import load_typed
from ..models.build import build_model
from ..profiling import count_flops
from .scoring import study_scoring, trial_scoring
from .samplers import SAMPLERS, sampler_factory
from .space_model import load_space
from .space_reference import reference_configs, space_profile
from .results import StudyRun
from .trial_context import Speed, TrialContext, base_fingerprint, run_data
from .trial_build import build_trial, trial_seed
from .. import runtime
from ..progress import console
from . import record_trial, run_study
from ..train.config import TrainConfig

LATENCY_SOURCES = ("predicted", "measured")
SECOND_OBJECTIVES = {
    "flops": ("flops_ratio", "minimize"),
    "latency": ("latency_ms", "minimize"),
    "throughput": ("throughput", "maximize"),
}
OBJECTIVES = ("goal", *SECOND_OBJECTIVES)
STORAGE_HELP = (
    "Where the studies live: sqlite:///FILE, journal:FILE or postgresql://USER:PASS@HOST:PORT/DB "
    "(default: ./nascompress-studies.db; with several --workers ./nascompress-studies.journal)."
)
FINETUNE_EPOCHS_HELP = "0: none; else fine-tune with the last method's recipe for this many epochs."


class GoalUnreachable(SettingError):
    """No configuration of the space reaches the study's ``max_flops`` on this base (nothing is run)."""


@dataclass(frozen=True)
class SearchJob(Config):
    """``nascompress search tokens|joint``: what is searched, how each trial is scored, where it is stored.

    Args:
        base: the run every trial starts from (dense, imported or DCS-materialized).
        space: a search-space file, or the name of a shipped space (``evit``: ``nascompress/search_spaces/evit.yaml``).
        study: the study name (an existing study is continued).
        storage: ``sqlite:///...``, ``journal:PATH`` or ``postgresql://...`` (default: the project's files).
        trials: complete trials the study should reach.
        workers: worker processes on this machine sharing the study.
        objective: ``goal`` (the default): accuracy alone under ``max_flops`` / ``max_latency_ms``,
            or, without a constraint, accuracy x FLOPs; else the second objective next to accuracy:
            ``flops`` (ratio to the uncompressed model), ``latency`` (ms at batch 1 on ``device``) or
            ``throughput`` (images/s at batch 64).
        max_flops / max_latency_ms: single-objective accuracy under this constraint (``objective`` goal).
        sampler: ``tpe`` (the default: multivariate, multi-objective TPE; the best mean
            hypervolume at 30 trials in ``bench/samplers.py``), ``nsga2`` (NSGA-II, population 20),
            ``gp`` (Optuna's GPSampler; spaces of numeric parameters only), ``qmc`` (scrambled
            Sobol' points, spaces without conditional parameters; :mod:`nascompress.studies.qmc`)
            or ``grid`` (the space's ``trials`` spread configurations in order;
            :mod:`nascompress.studies.grid`). Recorded in the study; a study keeps its sampler.
        finetune_epochs: 0 (zero-shot, after the predictor-only stage) or a short fine-tune per trial
            (whole epochs, as ``nascompress materialize --study --finetune-epochs``).
        train_images: class-balanced training images for the predictor stage and fine-tunes.
        eval_images: class-balanced validation images accuracy is measured on.
        calib_steps: steps of the predictor-only stage (DynamicViT, Sparsifiner) of a zero-shot trial.
        dcs_epochs: epochs of the per-trial DCS search (spaces with a ``dcs`` entry).
        enqueue: run the uncompressed and the papers' configurations first.
        seed: drives the samplers, the data subsets and every trial's training.
        amp / deterministic: every trial's training (predictor stages, fine-tunes, DCS searches), as
            :class:`~nascompress.train.run.TrainConfig`'s.
    """

    base: str
    space: str = setting(
        path=True,
        shipped="search space",
        help=(
            "Search-space file, or the name of a shipped space (evit, joint, tome, ...; nascompress/search_spaces/)."
        ),
    )
    study: str = setting(help="Study name; an existing study is continued.")
    storage: str | None = setting(None, help=STORAGE_HELP)
    trials: int = setting(50, help="Complete trials the study should reach.", lo=1, limit="max_trials")
    workers: int = setting(1, help="Worker processes on this machine sharing the study.", lo=1, hi=MAX_WORKERS)
    objective: str = setting(
        "goal",
        choices=OBJECTIVES,
        help=(
            "goal: accuracy alone under the constraint (--max-flops or --max-latency; a pipeline's goal), or "
            "accuracy x FLOPs without one; flops, latency or throughput: a Pareto front of accuracy and that."
        ),
    )
    max_flops: float | None = setting(
        None,
        lo=0,
        hi=1,
        lo_open=True,
        help=("Single objective: accuracy with FLOPs <= this ratio of the uncompressed model."),
    )
    max_latency_ms: float | None = setting(
        None,
        lo=0,
        lo_open=True,
        option="--max-latency",
        help=("Single objective: accuracy with batch-1 latency <= this many ms on --device."),
    )
    sampler: str = setting(
        "tpe",
        help="tpe (multivariate), nsga2, gp (GPSampler; numeric spaces), qmc (scrambled "
        "Sobol' points; spaces without conditional parameters) or grid (the "
        "space's spread configurations in order).",
        choices=SAMPLERS,
    )
    finetune_epochs: int = setting(0, help=FINETUNE_EPOCHS_HELP, lo=0, hi=MAX_EPOCHS)
    train_images: int = setting(
        2000, help="Class-balanced training images for predictor stages and fine-tunes.", lo=1, hi=MAX_IMAGES
    )
    eval_images: int = setting(
        2000, help="Class-balanced validation images accuracy is measured on.", lo=1, hi=MAX_IMAGES
    )
    calib_steps: int = setting(
        50, help="Steps of the predictor-only stage (DynamicViT, Sparsifiner).", lo=0, hi=MAX_STEPS
    )
    batch_size: int = setting(
        64, help="Images per batch of the trials' evaluation, predictor stages and fine-tunes.", lo=1, hi=MAX_BATCH
    )
    dcs_epochs: int = setting(
        1, help="Epochs of the per-trial DCS search (spaces with a dcs entry).", lo=1, hi=MAX_EPOCHS
    )
    latency_iters: int = setting(
        10, help="Timed repetitions (median) of a trial's latency/throughput.", lo=1, hi=MAX_ITERS
    )
    latency_source: str = setting(
        "predicted",
        choices=LATENCY_SOURCES,
        help=(
            "How a trial's batch-1 latency is found: predicted from this device's latency table (built once, "
            "cached) and measured only for the finalists, the trials that could be picked; or measured for "
            "every trial."
        ),
    )
    enqueue: bool = setting(
        True, help="Do not run the uncompressed and paper configurations first.", flag="--no-enqueue"
    )
    data: DataConfig | None = None
    seed: int = 0
    device: str = "auto"
    amp: str = "auto"
    deterministic: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.finetune_epochs, float) and self.finetune_epochs.is_integer():
            object.__setattr__(self, "finetune_epochs", int(self.finetune_epochs))  # a job recorded when it was a float
        check_settings(self)  # every setting() against its declaration
        # the run settings are TrainConfig's (RUNTIME_SETTINGS: the trials train with them), checked there
        TrainConfig(seed=self.seed, device=self.device, amp=self.amp, deterministic=self.deterministic)
        if self.max_flops is not None and self.max_latency_ms is not None:
            raise SettingError("give {max_flops} or {max_latency_ms}, not both")
        if self.constrained and self.objective != "goal":
            raise SettingError(
                f"{{objective}} {self.objective} is a Pareto front; with {{max_flops}} or {{max_latency_ms}} "
                "the study is single-objective: leave {objective} at goal"
            )

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> "SearchJob":
        """A recorded job; one recorded when a constraint overrode ``--objective flops`` reads as ``goal``."""
        flops = d.get("objective") == "flops" and (
            d.get("max_flops") is not None or d.get("max_latency_ms") is not None
        )
        return cls.from_dict(dict(d, objective="goal") if flops else d)

    @property
    def constrained(self) -> bool:
        return self.max_flops is not None or self.max_latency_ms is not None

    def objectives(self) -> tuple[list[str], list[str]]:
        """(metric names, directions)."""
        if self.constrained:
            return ["accuracy"], ["maximize"]
        name, direction = SECOND_OBJECTIVES[self.second_objective]
        return ["accuracy", name], ["maximize", direction]

    @property
    def second_objective(self) -> str:
        """The second objective of a two-objective study (``goal`` without a constraint: flops)."""
        return "flops" if self.objective == "goal" else self.objective

    def needs_speed(self) -> bool:
        return self.max_latency_ms is not None or (not self.constrained and self.second_objective != "flops")


# The settings of a study's trials: ``search tokens|joint``'s options (every user-facing field of
# SearchJob) and the pipeline's ``stages.tokens`` keys (these, and the pipeline's own study name)
STUDY_SETTINGS = StageSettings(
    SearchJob,
    (
        "space",
        "trials",
        "workers",
        "objective",
        "sampler",
        "finetune_epochs",
        "train_images",
        "eval_images",
        "calib_steps",
        "batch_size",
        "dcs_epochs",
        "latency_iters",
        "latency_source",
        "enqueue",
    ),
)


def build_job(
    base: str | Path, *, search: Mapping[str, Any], runtime: Mapping[str, Any], data: DataConfig | None = None
) -> SearchJob:
    """The study job of ``nascompress search tokens|joint``, of a pipeline's ``stages.tokens`` and of
    ``nc.study`` (the one place it is built): ``search``: the values of :class:`SearchJob`'s settings
    (the space, the study's name and storage, its constraint, :data:`STUDY_SETTINGS`'); ``runtime``:
    :data:`~nascompress.train.run.RUNTIME_SETTINGS`'; ``data``: the dataset (None: the base run's)."""
    return SearchJob(**search, **runtime, base=str(base), data=data)


# ---------------------------------------------------------------------------------------------
# The objective


def arch_key(records: list[dict[str, Any]]) -> str:
    return json.dumps(records, sort_keys=True)


class Objective:
    """``objective(trial)`` of one worker (its :class:`TrialContext` is built on the first trial)."""

    def __init__(self, job: SearchJob):
        self.job = job
        self.ctx: TrialContext | None = None

    def __call__(self, trial: Any) -> Any:
        job = self.job
        if self.ctx is None:
            self.ctx = TrialContext(job)
        ctx = self.ctx
        t0 = time.perf_counter()
        records = ctx.space.suggest(trial)
        seed = trial_seed(job.seed, trial.number)
        report = None
        if job.constrained and job.finetune_epochs > 0:

            def report(epoch: int, value: float) -> None:
                trial.report(value, epoch)
                if trial.should_prune():
                    raise optuna.TrialPruned(f"pruned after epoch {epoch} at {value:.2f}%")

        with runtime.configured(ctx.device, deterministic=job.deterministic):
            built = build_trial(ctx, records, seed=seed, report=report, dcs_seed=job.seed)
            acc = ctx.accuracy(built.model)
        applied = built.applied
        rep = count_flops(built.model, ctx.flops_x)
        ratio = rep.total / ctx.dense_flops
        speed = (
            ctx.speed(
                built.model, arch_key(applied), methods=[m["name"] for m in applied], accuracy=acc, study=trial.study
            )
            if job.needs_speed()
            else Speed()
        )
        scoring = trial_scoring(
            budget=job.calib_steps,
            steps=built.calib_steps,
            eval_subset=ctx.eval_subset,
            finetune_epochs=job.finetune_epochs,
        )
        if built.dcs_seed is not None:
            scoring = scoring.set(dcs_seed=built.dcs_seed)
        record_trial(
            trial,
            arch=applied,
            params_changed=dict(trial.params),
            flops=rep.total,
            flops_ratio=ratio,
            params=rep.params,
            accuracy=acc,
            latency_ms=speed.latency_ms,
            latency=speed.latency,
            throughput=speed.throughput,
            wall_s=time.perf_counter() - t0,
            seed=seed,
            scoring=scoring,
        )
        if built.training:
            trial.set_user_attr("nascompress_training", json.loads(json.dumps(built.training)))
        if job.max_flops is not None:
            trial.set_constraint("flops", ratio - job.max_flops)
            return acc
        if job.max_latency_ms is not None:
            trial.set_constraint("latency", speed.latency_ms - job.max_latency_ms)
            return acc
        second = {"flops": ratio, "latency": speed.latency_ms, "throughput": speed.throughput}
        return acc, second[job.second_objective]


def make_objective(job_dict: dict[str, Any]) -> Objective:
    """The picklable objective factory of :func:`nascompress.studies.run_study` (one per worker)."""
    return Objective(SearchJob.from_record(job_dict))


# ---------------------------------------------------------------------------------------------
# The job


def run_search(job: SearchJob, *, progress: bool = True, json_progress: bool = False) -> StudyRun:
    """Create or continue the study of ``job`` and run it to ``job.trials`` complete trials.

    Everything is checked (space file, base run, storage) before the study is created. Returns
    the run's :class:`~nascompress.studies.results.StudyRun` with the space's ``profile`` and the
    number of configurations ``enqueued`` first.
    """
    runtime.prepare_deterministic(job.deterministic)
    base_path = Path(job.base)
    if not base_path.exists():
        raise NascompressError(
            f"base run {job.base} does not exist; give a run directory (train, import or materialize)"
        )
    base, arch = load_typed(job.base)
    space = load_space(job.space, model=base)  # layer ranges sized by the base's depth, checked against it
    factory = sampler_factory(
        job.sampler, space, job.seed, trials=job.trials
    )  # qmc/gp on what they cannot search: refused here
    spec = InputSpec.from_dict(dict(arch.input))
    torch.manual_seed(job.seed)
    x = torch.randn(4, spec.in_chans, *spec.img_size)
    dense = count_flops(build_model(arch.spec).eval(), x).total
    profile = space_profile({"x": x, "dense_flops": dense}, space, base, max_flops=job.max_flops)
    if job.max_flops is not None and profile.max_flops_satisfiable is False:
        raise GoalUnreachable(
            f"no configuration of space {space.name!r} reaches {{max_flops}} {job.max_flops}: its "
            f"cheapest sampled configuration is {profile.flops_ratio_min:.3f}x; widen the space"
        )
    if progress and profile.configurations:
        console.print(
            f"space {space.name}: FLOPs ratio {profile.flops_ratio_min:.3f} - {profile.flops_ratio_max:.3f} "
            f"(median {profile.flops_ratio_median:.3f}), params {profile.params_min:,} - "
            f"{profile.params_max:,} over {profile.configurations} spread configurations"
            + ("" if job.max_flops is None else words(f"; {{max_flops}} {job.max_flops:g} is reachable")),
            highlight=False,
        )
    enqueue = [p for _, p in reference_configs(space, base)] if job.enqueue else []
    metric_names, directions = job.objectives()
    recorded = job.replace(
        base=str(base_path.resolve()), space=str(resolve_file(job.space, what="search space").resolve())
    )
    job_dict = recorded.to_dict()
    info = {
        "space": space.to_dict(),
        "space_hash": space.hash(),
        "sampler": job.sampler,
        "base_run": recorded.base,
        "base_fingerprint": base_fingerprint(job.base),
        "dataset": (job.data or run_data(job.base)).dataset,
        "job": job_dict,
        "profile": profile.to_dict(),
        "scoring": study_scoring(job),
    }
    summary = run_study(
        study_name=job.study,
        storage=job.storage,
        objective_factory=functools.partial(make_objective, job_dict),
        n_trials=job.trials,
        directions=directions,
        metric_names=metric_names,
        space_info=info,
        sampler_factory=factory,
        seed=job.seed,
        workers=job.workers,
        enqueue=enqueue,
        progress=progress,
        json_progress=json_progress,
    )
    return summary.set(profile=profile, enqueued=len(enqueue))


__all__ = ["SearchJob", "build_job", "Objective", "run_search", "make_objective"]
