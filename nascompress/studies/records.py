"""Trial and study records: the attribute keys nascompress stores in Optuna trials and studies,
:func:`record_trial` / :func:`trial_record` / :func:`study_info`, and the Pareto front of a study."""
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
RECORD_FIELDS: dict[str, type] = {"arch": list, "params_changed": dict, "flops": float, "flops_ratio": float,
                                  "params": int, "accuracy": float, "latency_ms": float, "throughput": float,
                                  "wall_s": float, "seed": int}
_NULLABLE = {"latency_ms", "throughput"}


def record_trial(trial: Any, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into the trial's record ``trial.user_attrs["nascompress"]`` and store it.

    Args:
        trial: a live ``optuna.Trial`` (or anything with ``user_attrs``/``set_user_attr``).
        **fields: any of ``arch`` (list of method records), ``params_changed`` (dict),
            ``flops`` (MACs per image), ``flops_ratio``, ``params`` (int), ``accuracy``
            (percent), ``latency_ms`` / ``throughput`` (float or None), ``wall_s``, ``seed``.

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


def _feasible(t: FrozenTrial) -> bool:
    return all(v <= 0.0 for v in t.constraints.values())


def pareto_front(trials: Sequence[FrozenTrial], directions: Sequence[Any]) -> list[FrozenTrial]:
    """The feasible non-dominated COMPLETE trials, by trial number (single objective: the best one).

    Args:
        trials: any trials (others than COMPLETE are ignored).
        directions: ``StudyDirection`` values or ``"maximize"``/``"minimize"`` strings.
    """
    signs = [1.0 if str(getattr(d, "name", d)).lower() == "minimize" else -1.0 for d in directions]
    pts = [(t, [s * v for s, v in zip(signs, t.values)]) for t in trials
           if t.state == TrialState.COMPLETE and t.values is not None and len(t.values) == len(signs)
           and _feasible(t) and not any(math.isnan(v) for v in t.values)]
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
