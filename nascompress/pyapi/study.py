"""``nc.study``: an Optuna study of a search space on a model object (``nascompress search tokens`` /
``search joint``), and the picked trial's model (``nascompress materialize --study --pick``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..studies.trial_model import TrialMetrics, build_job as build_pick_job, materialize_trial
from ..studies.results import StudyRun
from ..studies.trials import SearchJob, build_job, run_search
from ..train.run import RUNTIME_SETTINGS
from ..progress import silenced
from .common import (
    ModelLike,
    StageResult,
    data_config,
    model_run,
    planned_run,
    read_result,
    setting_names,
    split_settings,
    stage_values,
)
from .workspace import Workspace

STUDY_DB = "studies.db"


@dataclass(frozen=True)
class Picked(StageResult):
    """The model of the trial a study picked, rebuilt as the trial built it; ``metrics``: its
    :class:`~nascompress.studies.trial_model.TrialMetrics`, the ``rebuilt_accuracy`` against the
    trial's recorded ``trial_accuracy``, its ``flops_ratio``."""

    METRICS = TrialMetrics


@dataclass(frozen=True)
class Study:
    """A finished study: ``summary`` (the run's :class:`~nascompress.studies.results.StudyRun`:
    ``summary.complete`` trials, the Pareto ``summary.front``, the study's name and ``storage``, ...),
    ``picked`` (the model of the trial ``pick`` chose, or None) and ``out``."""

    summary: StudyRun
    picked: Picked | None = None
    out: str | None = None


def study(
    model: ModelLike,
    data: Any = None,
    *,
    space: str = "evit",
    trials: int = 20,
    max_flops: float | None = None,
    max_latency_ms: float | None = None,
    pick: str | None = None,
    name: str = "nc",
    seed: int = 0,
    device: str = "auto",
    val: Any = None,
    out: str | Path | None = None,
    progress: bool = True,
    **settings: Any,
) -> Study:
    """Search a space's configurations on ``model`` with Optuna (``nascompress search tokens``), each
    trial applying the methods and scoring accuracy and FLOPs (or latency), then rebuild one trial.

    Args:
        model: the base every trial starts from (an ``nn.Module``, a result of this API, or a run).
        data: as :func:`nascompress.dcs.search`'s (None: the model's recorded dataset).
        space: a shipped space's name (``evit``, ``tome``, ``dynamicvit``, ``joint`` ...) or a file.
        trials: complete trials to reach.
        max_flops / max_latency_ms: the goal: accuracy under this FLOPs ratio or batch-1 latency.
        pick: the trial whose model to rebuild: ``best-under-flops=R``, ``best-under-latency=MS`` or
            ``knee``; None: ``best-under-flops=max_flops`` with a FLOPs goal, else no model.
        name: the study's name in its storage (``out/studies.db``; a temporary one without ``out``).
        out: keep the study's storage and the picked run there; the same call again continues the study.
        **settings: the command's other options (``sampler``, ``objective``, ``train_images``,
            ``eval_images``, ``finetune_epochs``, ``batch_size``, ``enqueue``, ``amp`` ...).
    """
    parts = split_settings(
        settings,
        {
            "s": [n for n in setting_names(SearchJob) if n not in ("space", "study", "storage")],
            "runtime": ("amp", "deterministic"),
        },
        what="nc.study",
    )
    cfg_data = data_config(data, val=val, seed=seed)
    with Workspace(out) as ws:
        db = ws.path(STUDY_DB) if ws.keep else ws.scratch(STUDY_DB)
        storage = f"sqlite:///{db}"
        values = stage_values(  # every setting is checked before anything is written
            SearchJob,
            {
                "space": space,
                "study": name,
                "storage": storage,
                "trials": trials,
                "max_flops": max_flops,
                "max_latency_ms": max_latency_ms,
                **parts["s"],
            },
        )
        runtime = stage_values(RUNTIME_SETTINGS, {"seed": seed, "device": device, **parts["runtime"]})
        job = build_job(planned_run(model, ws, "source"), search=values, runtime=runtime, data=cfg_data)
        model_run(model, ws, "source", data=cfg_data)  # written where the job reads it
        db.parent.mkdir(parents=True, exist_ok=True)
        with silenced(not progress):  # progress=False: a quiet library call
            summary = run_search(job, progress=progress)
        pick = pick or (f"best-under-flops={max_flops:g}" if max_flops is not None else None)
        picked = None
        if pick is not None:
            job = build_pick_job(name, ws.path("picked"), pick=pick, storage=storage)
            materialize_trial(job, force=True)
            picked = read_result(Picked, ws.path("picked"), keep=ws.keep)
        return Study(summary=summary, picked=picked, out=str(ws.root) if ws.keep else None)


__all__ = ["Study", "Picked", "study"]
