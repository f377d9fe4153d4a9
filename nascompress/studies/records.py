"""Trial and study records: the attribute keys nascompress stores in Optuna trials and studies,
:func:`record_trial` / :func:`trial_record` / :func:`study_info`, the Pareto front of a study, and
how its trials were scored (:func:`scoring_summary`, :func:`mixed_scoring`)."""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

import optuna
from optuna.trial import FrozenTrial, TrialState

RECORD_KEY = "nascompress"
WORKER_KEY = "nascompress:worker"
FAIL_REASON_KEY = "nascompress:fail_reason"
SURPLUS_KEY = "nascompress:surplus"
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


def record_trial(trial: Any, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into the trial's record ``trial.user_attrs["nascompress"]`` and store it.

    Args:
        trial: a live ``optuna.Trial`` (or anything with ``user_attrs``/``set_user_attr``).
        **fields: any of ``arch`` (list of method records), ``params_changed`` (dict),
            ``flops`` (MACs per image), ``flops_ratio``, ``params`` (int), ``accuracy``
            (percent), ``latency_ms`` / ``throughput`` (float or None), ``latency`` (how
            ``latency_ms`` was found: ``{"source": "predicted" | "measured", "predicted_ms": ...,
            "measured_ms": ...}``, or None), ``wall_s``, ``seed``,
            ``scoring`` (dict: the calibration budget and validation subset the trial was scored
            with, :func:`nascompress.studies.scoring.trial_scoring`).

    Returns:
        The merged record.
    """
    rec = dict(trial.user_attrs.get(RECORD_KEY) or {})
    for k, v in fields.items():
        if k not in RECORD_FIELDS:
            raise TypeError(f"record_trial() got an unknown field {k!r}; fields: {', '.join(RECORD_FIELDS)}")
        tp = RECORD_FIELDS[k]
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
    return rec


def trial_record(trial: FrozenTrial) -> dict[str, Any]:
    """The trial's nascompress record (empty if it has none)."""
    rec = trial.user_attrs.get(RECORD_KEY)
    return dict(rec) if isinstance(rec, Mapping) else {}


def study_info(study: optuna.Study) -> dict[str, Any]:
    """The study's nascompress record ``study.user_attrs["nascompress"]`` (empty if none)."""
    info = study.user_attrs.get(RECORD_KEY)
    return dict(info) if isinstance(info, Mapping) else {}


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
        number, sc = t.number, trial_record(t).get("scoring")
        if not isinstance(sc, Mapping):
            unrecorded.append(number)
            continue
        key = (sc.get("calib_budget"), sc.get("finetune_epochs"), (sc.get("eval_subset") or {}).get("sha256"))
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


def scoring_summary(info: Mapping[str, Any], trials: Sequence[FrozenTrial]) -> str | None:
    """One line: the calibration budget and validation subset the study scores every trial with
    (its record's ``scoring``, the subset's fingerprint from its first scored trial); None when the
    study recorded none."""
    sc = info.get("scoring")
    if not isinstance(sc, Mapping):
        return None
    subset = (
        next(
            (
                trial_record(t)["scoring"].get("eval_subset")
                for t in sorted(trials, key=lambda t: t.number)
                if isinstance(trial_record(t).get("scoring"), Mapping)
            ),
            None,
        )
        or {}
    )
    ft = sc.get("finetune_epochs") or 0
    line = (
        f"{sc.get('calib_steps')} calibration steps per predictor stage (training-free methods: 0), "
        f"{subset.get('images', sc.get('eval_images'))} validation images (seed {sc.get('seed')}"
        + (f", subset {subset['sha256']}" if subset.get("sha256") else "")
        + ")"
    )
    return line + (f", {ft:g} fine-tune epochs per trial" if ft else ", zero-shot")
