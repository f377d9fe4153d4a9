"""Trial and study records: the attribute keys nascompress stores in Optuna trials and studies, the
records it keeps there read as frozen records (:class:`TrialRecord`, ``trial.user_attrs["nascompress"]``,
with its :class:`TrialScoring` and :class:`LatencyNote`; :class:`StudyInfo`,
``study.user_attrs["nascompress"]``, with its :class:`SpaceProfile` and :class:`StudyScoring`), :func:`record_trial` /
:func:`trial_record` / :func:`study_info`, the Pareto front of a study, and how its trials were
scored (:func:`scoring_summary`, :func:`mixed_scoring`).

Each record is a :class:`~nascompress.runs.records.TypedRecord`: its fields checked as their
annotations say, any other key kept, the stored key order kept, so ``r.to_dict()`` is the stored
dict; a record nascompress did not write (a study of another tool) reads with its fields None.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import optuna
from optuna.trial import FrozenTrial, TrialState

from ..runs.files import Record
from ..runs.records import TypedRecord

RECORD_KEY = "nascompress"
WORKER_KEY = "nascompress:worker"
FAIL_REASON_KEY = "nascompress:fail_reason"
SURPLUS_KEY = "nascompress:surplus"
ANCHOR_KEY = "nascompress:latency_anchor"  # the study's: the dense model timed beside its latency table
RETRIES_KEY = "nascompress_retries"
RETRY_OF_KEY = "nascompress_retry_of"
ERROR_KEY = "nascompress_error"
RECORD_FIELDS: dict[str, type] = {
    "arch": list,
    "params_changed": dict,
    "flops": float,
    "flops_ratio": float,
    "params": int,
    "accuracy": float,
    "latency_ms": float,
    "latency": dict,
    "throughput": float,
    "wall_s": float,
    "seed": int,
    "scoring": dict,
}
_NULLABLE = {"latency_ms", "latency", "throughput"}


class StudyRecord(TypedRecord):
    """A record of the studies (kept in a study's storage or handed on by its functions); a
    subclass's checks follow its annotations (:class:`~nascompress.runs.records.TypedRecord`)."""

    NEW_SOURCE = "the study's {name}"


def study_record(cls: type) -> type:
    """``cls`` as a frozen keyword-only dataclass (the studies' records)."""
    return dataclass(frozen=True, kw_only=True)(cls)


@study_record
class LatencyNote(StudyRecord):
    """How a trial's ``latency_ms`` was found: ``source`` ``predicted`` (from the device's latency
    table) or ``measured``, the ``predicted_ms`` and the ``measured_ms`` (a measured trial)."""

    source: str | None = None
    predicted_ms: float | None = None
    measured_ms: float | None = None


@study_record
class EvalSubset(StudyRecord):
    """The identity of the validation subset a trial was scored on
    (:func:`~nascompress.studies.scoring.subset_fingerprint`)."""

    images: int | None = None
    seed: int | None = None
    sha256: str | None = None


@study_record
class TrialScoring(StudyRecord):
    """How one trial was scored (:func:`~nascompress.studies.scoring.trial_scoring`): the calibration
    budget per predictor stage, the steps taken by method and in all, the validation subset, the
    fine-tune epochs and the seed of its DCS search (a ``dcs`` entry)."""

    calib_budget: int | None = None
    calib_steps: Mapping[str, int] | None = None
    calib_steps_total: int | None = None
    eval_subset: EvalSubset | None = None
    finetune_epochs: float | None = None
    dcs_seed: int | None = None


@study_record
class TrialRecord(StudyRecord):
    """A trial's record ``trial.user_attrs["nascompress"]`` (:func:`record_trial` writes it, field by
    field as :data:`RECORD_FIELDS` types them): the method records as applied (``arch``), the
    parameters that changed, FLOPs, FLOPs ratio, parameter count, accuracy (percent), latency (ms,
    and how it was found), throughput, wall time, seed and scoring; a field not recorded is None."""

    arch: list[Any] | None = None
    params_changed: Mapping[str, Any] | None = None
    flops: float | None = None
    flops_ratio: float | None = None
    params: int | None = None
    accuracy: float | None = None
    latency_ms: float | None = None
    latency: LatencyNote | None = None
    throughput: float | None = None
    wall_s: float | None = None
    seed: int | None = None
    scoring: TrialScoring | None = None

    @classmethod
    def from_attrs(cls, user_attrs: Mapping[str, Any], *, source: str = "a trial's record") -> TrialRecord:
        """The record in a trial's ``user_attrs`` (as Optuna stores them); empty when it has none."""
        rec = user_attrs.get(RECORD_KEY)
        return cls.from_dict(rec if isinstance(rec, Mapping) else {}, source=source)


@study_record
class SpaceProfile(StudyRecord):
    """FLOPs ratio and parameters over a space's spread configurations, built without training
    (:func:`~nascompress.studies.space_reference.space_profile`): min / median / max, and whether
    the study's ``max_flops`` is reachable; empty (every field None) when no configuration could be built."""

    configurations: int | None = None
    flops_ratio_min: float | None = None
    flops_ratio_median: float | None = None
    flops_ratio_max: float | None = None
    params_min: int | None = None
    params_max: int | None = None
    max_flops_satisfiable: bool | None = None


@study_record
class StudyScoring(StudyRecord):
    """The scoring settings every trial of a study gets (:func:`~nascompress.studies.scoring.study_scoring`,
    the study record's ``scoring``: the search job's options of the same names; a study keeps them):
    predictor-stage steps, training and validation images, batch size, fine-tune epochs, the per-trial
    DCS search's epochs and the seed (None: not recorded)."""

    calib_steps: int | None = None
    train_images: int | None = None
    eval_images: int | None = None
    batch_size: int | None = None
    finetune_epochs: float | None = None
    dcs_epochs: int | None = None
    seed: int | None = None


@study_record
class StudyInfo(StudyRecord):
    """A study's record ``study.user_attrs["nascompress"]`` (written once, when the study is
    created): the search space (its dict and hash), the sampler, the base run and its weights'
    fingerprint, the dataset, the search job, the space's profile, the scoring settings every trial
    gets (:class:`StudyScoring`), the objectives, the seed, when it was created and the command."""

    space: Mapping[str, Any] | None = None
    space_hash: str | None = None
    sampler: str | None = None
    base_run: str | None = None
    base_fingerprint: str | None = None
    dataset: str | None = None
    job: Mapping[str, Any] | None = None
    profile: SpaceProfile | None = None
    scoring: StudyScoring | None = None
    objectives: list[str] | None = None
    seed: int | None = None
    created: str | None = None
    command: str | None = None

    @property
    def space_name(self) -> str | None:
        """The search space's name (None: not recorded)."""
        return None if self.space is None else self.space.get("name")


def record_trial(trial: Any, **fields: Any) -> TrialRecord:
    """Merge ``fields`` into the trial's record ``trial.user_attrs["nascompress"]`` and store it.

    Args:
        trial: a live ``optuna.Trial`` (or anything with ``user_attrs``/``set_user_attr``).
        **fields: any of ``arch`` (list of method records), ``params_changed`` (dict),
            ``flops`` (MACs per image), ``flops_ratio``, ``params`` (int), ``accuracy``
            (percent), ``latency_ms`` / ``throughput`` (float or None), ``latency`` (how
            ``latency_ms`` was found: a :class:`LatencyNote` or its dict ``{"source": "predicted" |
            "measured", "predicted_ms": ..., "measured_ms": ...}``, or None), ``wall_s``, ``seed``,
            ``scoring`` (a :class:`TrialScoring` or its dict: the calibration budget and validation
            subset the trial was scored with, :func:`nascompress.studies.scoring.trial_scoring`).

    Returns:
        The merged record.
    """
    rec = dict(trial.user_attrs.get(RECORD_KEY) or {})
    for k, v in fields.items():
        if k not in RECORD_FIELDS:
            raise TypeError(f"record_trial() got an unknown field {k!r}; fields: {', '.join(RECORD_FIELDS)}")
        tp = RECORD_FIELDS[k]
        if isinstance(v, Record):
            v = v.to_dict()
        if v is None and k in _NULLABLE:
            rec[k] = None
        elif tp is float:
            rec[k] = float(v)
        elif tp is int:
            if isinstance(v, bool) or int(v) != v:
                raise TypeError(f"record_trial(): {k} must be an integer, got {v!r}")
            rec[k] = int(v)
        elif tp is list:
            if not isinstance(v, (list, tuple)):
                raise TypeError(f"record_trial(): {k} must be a list of method records, got {type(v).__name__}")
            rec[k] = json.loads(json.dumps(list(v)))
        else:
            if not isinstance(v, Mapping):
                raise TypeError(f"record_trial(): {k} must be a dict, got {type(v).__name__}")
            rec[k] = json.loads(json.dumps(dict(v)))
    trial.set_user_attr(RECORD_KEY, rec)
    return TrialRecord.from_dict(rec, source="the trial's record")


def trial_record(trial: FrozenTrial) -> TrialRecord:
    """The trial's nascompress record (:class:`TrialRecord`; every field None if it has none)."""
    return TrialRecord.from_attrs(trial.user_attrs, source=f"trial {trial.number}'s record")


def study_info(study: optuna.Study) -> StudyInfo | None:
    """The study's nascompress record ``study.user_attrs["nascompress"]`` (None if it has none)."""
    info = study.user_attrs.get(RECORD_KEY)
    if not isinstance(info, Mapping) or not info:
        return None
    return StudyInfo.from_dict(info, source=f"study {study.study_name!r}'s record")


def feasible(t: FrozenTrial) -> bool:
    """Whether a trial is within its constraints (a trial without constraints always is)."""
    return all(v <= 0.0 for v in t.constraints.values())


def pareto_front(trials: Sequence[FrozenTrial], directions: Sequence[Any]) -> list[FrozenTrial]:
    """The feasible non-dominated COMPLETE trials, by trial number (single objective: the best one).

    Args:
        trials: any trials (others than COMPLETE are ignored).
        directions: ``StudyDirection`` values or ``"maximize"``/``"minimize"`` strings.
    """
    signs = [1.0 if str(getattr(d, "name", d)).lower() == "minimize" else -1.0 for d in directions]
    pts = [
        (t, [s * v for s, v in zip(signs, t.values)])
        for t in trials
        if t.state == TrialState.COMPLETE
        and t.values is not None
        and len(t.values) == len(signs)
        and feasible(t)
        and not any(math.isnan(v) for v in t.values)
    ]
    if not pts:
        return []
    if len(signs) == 1:
        return [min(pts, key=lambda p: (p[1][0], p[0].number))[0]]
    front = []
    for t, a in pts:
        dominated = any(all(x <= y for x, y in zip(b, a)) and any(x < y for x, y in zip(b, a)) for _, b in pts)
        if not dominated:
            front.append(t)
    return sorted(front, key=lambda t: t.number)


def mixed_scoring(trials: Sequence[FrozenTrial]) -> list[str]:
    """Lines naming the trials whose calibration budget, fine-tune epochs or validation subset
    (their records' ``scoring``) differ from the study's first scored trial; empty when every
    trial was scored alike (or none recorded it)."""
    first: tuple[int, Any] | None = None
    odd: list[str] = []
    unrecorded: list[int] = []
    for t in sorted(trials, key=lambda t: t.number):
        number, sc = t.number, trial_record(t).scoring
        if sc is None:
            unrecorded.append(number)
            continue
        key = (sc.calib_budget, sc.finetune_epochs, None if sc.eval_subset is None else sc.eval_subset.sha256)
        if first is None:
            first = (number, key)
        elif key != first[1]:
            odd.append(
                f"trial {number}: calibration budget {key[0]}, fine-tune epochs {key[1]}, validation subset "
                f"{key[2]} (trial {first[0]}: {first[1][0]}, {first[1][1]}, {first[1][2]})"
            )
    if first is not None and unrecorded:  # a study continued across the change that records scoring
        odd.insert(
            0,
            f"trials {', '.join(map(str, unrecorded))}: no scoring recorded (scored before budgets were "
            "recorded: each predictor stage ran its recipe's step count)",
        )
    return odd


def scoring_summary(info: StudyInfo | None, trials: Sequence[FrozenTrial]) -> str | None:
    """One line: the calibration budget and validation subset the study scores every trial with
    (its record's ``scoring``, the subset's fingerprint from its first scored trial); None when the
    study recorded none."""
    sc = None if info is None else info.scoring
    if sc is None:
        return None
    scored = (trial_record(t).scoring for t in sorted(trials, key=lambda t: t.number))
    subset = next((s.eval_subset for s in scored if s is not None), None) or EvalSubset()
    images = subset.images if subset.images is not None else sc.eval_images
    ft = sc.finetune_epochs or 0
    line = (
        f"{sc.calib_steps} calibration steps per predictor stage (training-free methods: 0), "
        f"{images} validation images (seed {sc.seed}" + (f", subset {subset.sha256}" if subset.sha256 else "") + ")"
    )
    return line + (f", {ft:g} fine-tune epochs per trial" if ft else ", zero-shot")
