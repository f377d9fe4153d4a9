"""What the studies' functions hand on, as frozen records read by field: a run's summary
(:class:`StudyRun`, of :func:`~nascompress.studies.runner.run_study` and
:func:`~nascompress.studies.trials.run_search`: its Pareto front as :class:`FrontTrial`, its
workers' errors as :class:`WorkerError`), the study listing (:class:`StudyRow`, a single-objective
study's :class:`BestTrial`), a study shown (:class:`ShowResult`, its rows :class:`TrialRow` with the
record columns :class:`TrialColumns`) and a study exported (:class:`StudyExport`, each trial an
:class:`ExportedTrial`).

Each is a :class:`~nascompress.studies.records.StudyRecord` (a
:class:`~nascompress.runs.records.TypedRecord`): made in memory with ``.new(...)``, its keys in the
order given, so ``r.to_dict()`` is what ``search --json``, ``study list|show --json`` and
``study export --format json`` write, and ``from_dict`` reads it back. The records a study's storage
holds (a trial's, the study's) are in :mod:`nascompress.studies.records`.
"""

from __future__ import annotations

from typing import Any, Mapping

from .records import SpaceProfile, StudyInfo, StudyRecord, TrialRecord, study_record


@study_record
class FrontTrial(StudyRecord):
    """A trial of the Pareto front: its number, objective values and parameters."""

    number: int
    values: list[float]
    params: Mapping[str, Any]


@study_record
class WorkerError(StudyRecord):
    """The error a worker process stopped with."""

    worker: int
    error: str


@study_record
class StudyRun(StudyRecord):
    """A study run to its trials (:func:`~nascompress.studies.runner.run_study`): the study, its
    storage (masked), the COMPLETE trials asked for (``n_trials``) and reached, the trials by state,
    the objectives, the Pareto front, the wall time, the workers run (and why fewer than asked), whether
    this call created the study, the trials failed for good (``stale_failed``) and run again in place
    (``stale_resumed``), whether it reached ``n_trials`` and the workers' errors; with
    :func:`~nascompress.studies.trials.run_search` also the space's ``profile`` and the configurations
    ``enqueued`` first."""

    study: str
    storage: str
    n_trials: int
    complete: int
    counts: Mapping[str, int]
    metric_names: list[str]
    directions: list[str]
    front: tuple[FrontTrial, ...] = ()
    wall_s: float
    workers: int
    workers_note: str | None = None
    created: bool
    stale_failed: list[int]
    stale_resumed: list[int]
    finished: bool
    worker_errors: tuple[WorkerError, ...] = ()
    profile: SpaceProfile | None = None
    enqueued: int | None = None


@study_record
class BestTrial(StudyRecord):
    """A single-objective study's best trial: its number and value."""

    number: int
    value: float


@study_record
class StudyRow(StudyRecord):
    """One study of ``study list``: name, storage (masked), objectives and directions, trials by
    state, when it was created, its space's name and sampler (None: not recorded), and its ``best``
    trial (single objective) or ``front_size`` (multi-objective)."""

    name: str
    storage: str
    metric_names: list[str]
    directions: list[str]
    counts: Mapping[str, int]
    created: str | None = None
    space: str | None = None
    sampler: str | None = None
    best: BestTrial | None = None
    front_size: int | None = None


@study_record
class TrialColumns(StudyRecord):
    """The record columns ``study show`` shows of a trial (:data:`~nascompress.studies.inspect.RECORD_COLUMNS`):
    FLOPs ratio, parameter count, accuracy, latency and throughput (None: not recorded)."""

    flops_ratio: float | None = None
    params: int | None = None
    accuracy: float | None = None
    latency_ms: float | None = None
    throughput: float | None = None


@study_record
class TrialRow(StudyRecord):
    """A trial as ``study show`` lists it: number, values by objective name, parameters and record columns."""

    number: int
    values: Mapping[str, float]
    params: Mapping[str, Any]
    record: TrialColumns


@study_record
class ShowResult(StudyRecord):
    """``study show``: a study's Pareto front (``kind`` ``pareto``) or best trials (``best``), with its
    storage, objectives, trials by state, record (``info``; empty when none), the parameters that differ
    across the shown trials (``varying``), the rows, the one line saying how every trial is scored
    (``scoring``, or None) and a line per complete trial scored otherwise."""

    study: str
    storage: str
    metric_names: list[str]
    directions: list[str]
    kind: str
    counts: Mapping[str, int]
    info: StudyInfo
    varying: list[str]
    trials: tuple[TrialRow, ...] = ()
    scoring: str | None = None
    scored_otherwise: list[str]


@study_record
class ExportedTrial(StudyRecord):
    """One trial of ``study export``: number, state, times, values by objective name, parameters,
    record, constraints, and what failed or released it."""

    number: int
    state: str
    datetime_start: str | None = None
    datetime_complete: str | None = None
    duration_s: float | None = None
    values: Mapping[str, float] | None = None
    params: Mapping[str, Any]
    record: TrialRecord
    constraints: Mapping[str, float]
    error: str | None = None
    fail_reason: str | None = None
    retry_of: int | None = None
    surplus: bool


@study_record
class StudyExport(StudyRecord):
    """``study export --format json``: the study, its storage (masked), objectives, record and every trial."""

    study: str
    storage: str
    metric_names: list[str]
    directions: list[str]
    info: StudyInfo
    trials: tuple[ExportedTrial, ...] = ()


__all__ = [
    "BestTrial",
    "ExportedTrial",
    "FrontTrial",
    "ShowResult",
    "StudyExport",
    "StudyRow",
    "StudyRun",
    "TrialColumns",
    "TrialRow",
    "WorkerError",
]
