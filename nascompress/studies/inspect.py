"""Look at studies: list them, show a study's Pareto front (or best trials), export every trial.

Read-only except for the export file (written atomically, never over an existing file without
``force``). Studies are looked up in both default files of the project directory
(``nascompress-studies.db`` and ``nascompress-studies.journal``) unless a storage is given.
"""

from __future__ import annotations

import csv
import io
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.table import Table

from nascompress.config import check_settings, setting
from nascompress.errors import NascompressError, SettingError
from nascompress.runs.json_io import atomic_path
from nascompress.runs.out_dir import refuse_overwriting_inputs

from .records import (
    ERROR_KEY,
    FAIL_REASON_KEY,
    RECORD_FIELDS,
    RETRY_OF_KEY,
    SURPLUS_KEY,
    mixed_scoring,
    pareto_front,
    scoring_summary,
    study_info,
    trial_record,
)
from .results import BestTrial, ExportedTrial, ShowResult, StudyExport, StudyRow, TrialColumns, TrialRow
from .storage_url import StorageSpec
from .storage import existing_storages, find_study

if TYPE_CHECKING:
    from optuna.storages import BaseStorage
    from rich.table import Table

RECORD_COLUMNS = ("flops_ratio", "params", "accuracy", "latency_ms", "throughput")
# a CSV text cell starting with one of these is prefixed with ' (numbers are written as they are)
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def load(name: str, storage: str | None = None) -> tuple[StorageSpec, optuna.Study]:
    """Find and load a study (one clear error if it or its storage is missing).

    Args:
        name: the study name.
        storage: a ``--storage`` value, or None for the project's default files.
    """
    spec, st = find_study(name, storage)
    return spec, _load(name, st)


def _load(name: str, st: BaseStorage) -> optuna.Study:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return optuna.load_study(study_name=name, storage=st, sampler=optuna.samplers.RandomSampler(seed=0))


def metric_names(study: optuna.Study) -> list[str]:
    """The objective names (``value`` / ``value0``, ``value1``, ... when none were set)."""
    names = study.metric_names
    if names:
        return list(names)
    n = len(study.directions)
    return ["value"] if n == 1 else [f"value{i}" for i in range(n)]


def directions(study: optuna.Study) -> list[str]:
    return [d.name.lower() for d in study.directions]


def _counts(trials: Sequence[FrozenTrial]) -> dict[str, int]:
    out = {
        s.name: 0
        for s in (TrialState.COMPLETE, TrialState.FAIL, TrialState.RUNNING, TrialState.WAITING, TrialState.PRUNED)
    }
    for t in trials:
        out[t.state.name] = out.get(t.state.name, 0) + 1
    return out


def _created(study: optuna.Study, trials: Sequence[FrozenTrial]) -> str | None:
    info = study_info(study)
    if info is not None and info.created:
        return str(info.created)
    starts = [t.datetime_start for t in trials if t.datetime_start is not None]
    return min(starts).isoformat(timespec="seconds") if starts else None


def list_studies(storage: str | None = None) -> list[StudyRow]:
    """Every study in the storage (default: both default files of the working directory).

    Args:
        storage: a ``--storage`` value, or None.

    Returns:
        A :class:`~nascompress.studies.results.StudyRow` per study: ``name``, ``storage``
        (masked), ``metric_names``, ``directions``, ``counts`` (by state), ``created``, ``space``,
        ``sampler`` (None: not recorded), ``best`` (single objective: number and value) or
        ``front_size`` (multi-objective).
    """
    rows = []
    for spec, st in existing_storages(storage):
        for fs in sorted(st.get_all_studies(), key=lambda s: s.study_name):
            study = _load(fs.study_name, st)
            trials = study.get_trials(deepcopy=False)
            dirs = directions(study)
            front = pareto_front(trials, dirs)
            info = study_info(study)
            single = len(dirs) == 1
            rows.append(
                StudyRow.new(
                    name=fs.study_name,
                    storage=spec.display,
                    metric_names=metric_names(study),
                    directions=dirs,
                    counts=_counts(trials),
                    created=_created(study, trials),
                    space=None if info is None else info.space_name,
                    sampler=None if info is None else info.sampler,
                    best=BestTrial.new(number=front[0].number, value=front[0].values[0]) if single and front else None,
                    front_size=None if single else len(front),
                )
            )
    return rows


def trial_row(t: FrozenTrial, names: Sequence[str]) -> TrialRow:
    """A trial as ``study show`` lists it (:class:`~nascompress.studies.results.TrialRow`)."""
    rec = trial_record(t)
    return TrialRow.new(
        number=t.number,
        values=dict(zip(names, t.values)) if t.values else {},
        params=dict(t.params),
        record=TrialColumns.new(**{k: getattr(rec, k) for k in RECORD_COLUMNS}),
    )


def varying_columns(rows: Sequence[TrialRow]) -> list[str]:
    """The parameters whose values differ across ``rows``, in the order they first appear."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r.params if k not in keys]
    return [k for k in keys if len({json.dumps(r.params.get(k)) for r in rows}) > 1]


@dataclass(frozen=True)
class ShowSettings:
    """``nascompress study show``'s settings."""

    limit: int = setting(20, lo=1, help="Single objective: show the best N trials.")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class ExportSettings:
    """``nascompress study export``'s settings."""

    format: str = setting("csv", choices=("csv", "json"), help="csv or json.")

    def __post_init__(self) -> None:
        check_settings(self)


def show_study(name: str, storage: str | None = None, *, limit: int = ShowSettings.limit) -> ShowResult:
    """A study's Pareto front (multi-objective) or best trials (single objective).

    Args:
        name: the study name.
        storage: a ``--storage`` value, or None for the project's default files.
        limit: at most this many best trials of a single-objective study.

    Returns:
        A :class:`~nascompress.studies.results.ShowResult`: ``study``, ``storage``,
        ``metric_names``, ``directions``, ``kind`` (``pareto`` or ``best``), ``counts``, ``info``
        (the study's record), ``varying`` (params that differ across the shown trials), ``trials``
        (rows: ``number``, ``values`` by objective name, ``params``, ``record`` with flops_ratio,
        params (the parameter count), accuracy, latency_ms, throughput), ``scoring`` (one line: the
        calibration budget and validation subset every trial is scored with, or None) and
        ``scored_otherwise`` (a line per complete trial scored differently).
    """
    spec, study = load(name, storage)
    trials = study.get_trials(deepcopy=False)
    names, dirs = metric_names(study), directions(study)
    if len(dirs) > 1:
        shown = pareto_front(trials, dirs)
        kind = "pareto"
        by_ratio = all(isinstance(trial_record(t).flops_ratio, (int, float)) for t in shown)
        shown.sort(key=lambda t: (trial_record(t).flops_ratio if by_ratio else t.values[1], t.number))
    else:
        sign = -1.0 if dirs[0] == "maximize" else 1.0
        feas = [
            t
            for t in trials
            if t.state == TrialState.COMPLETE
            and t.values
            and all(v <= 0 for v in t.constraints.values())
            and not math.isnan(t.values[0])
        ]
        shown = sorted(feas, key=lambda t: (sign * t.values[0], t.number))[:limit]
        kind = "best"
    rows = [trial_row(t, names) for t in shown]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    info = study_info(study)
    return ShowResult.new(
        study=name,
        storage=spec.display,
        metric_names=names,
        directions=dirs,
        kind=kind,
        counts=_counts(trials),
        info=info or {},
        varying=varying_columns(rows),
        trials=rows,
        scoring=scoring_summary(info, complete),
        scored_otherwise=mixed_scoring(complete),
    )


def format_value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and abs(v) >= 10_000:
        return f"{v:,}"
    return str(v)


def show_columns(metric_names: Sequence[str], rows: Sequence[TrialRow]) -> list[str]:
    """The record columns worth showing: recorded somewhere and not already an objective."""
    return [c for c in RECORD_COLUMNS if c not in metric_names and any(getattr(r.record, c) is not None for r in rows)]


def render_show(result: ShowResult) -> Table:
    """:func:`show_study`'s result as a rich table."""
    names = result.metric_names
    title = (
        f"{result.study}: Pareto front, {len(result.trials)} trials"
        if result.kind == "pareto"
        else f"{result.study}: best {len(result.trials)} trials"
    )
    arrows = {"maximize": "↑", "minimize": "↓"}
    caption = f"{result.storage}  {count_summary(result.counts)}"
    if result.scoring:
        caption += f"\nscored with {result.scoring}"
    for line in result.scored_otherwise or []:
        caption += f"\nscored otherwise: {line}"
    table = Table(title=title, caption=caption)
    table.add_column("trial", justify="right")
    # a narrow terminal folds a long name or value onto more lines: none is cut to a shared prefix
    for p in result.varying:
        table.add_column(p, justify="right", overflow="fold")
    for n, d in zip(names, result.directions):
        table.add_column(f"{n} {arrows[d]}", justify="right", overflow="fold")
    extra = show_columns(names, result.trials)
    for c in extra:
        table.add_column(c.replace("_", " "), justify="right", overflow="fold")
    for r in result.trials:
        table.add_row(
            str(r.number),
            *[format_value(r.params.get(p)) for p in result.varying],
            *[format_value(r.values.get(n)) for n in names],
            *[format_value(getattr(r.record, c)) for c in extra],
        )
    return table


def count_summary(counts: Mapping[str, int]) -> str:
    parts = [
        f"{counts.get('COMPLETE', 0)} complete",
        f"{counts.get('FAIL', 0)} failed",
        f"{counts.get('RUNNING', 0)} running",
    ]
    parts += [f"{counts[k]} {k.lower()}" for k in ("WAITING", "PRUNED") if counts.get(k)]
    return ", ".join(parts)


# ----------------------------------------------------------------------------------------------
# Export


def exported_trial(t: FrozenTrial, names: Sequence[str]) -> ExportedTrial:
    """One trial as ``study export`` writes it (:class:`~nascompress.studies.results.ExportedTrial`):
    number, state, times, values, params, record, constraints, what failed or released it."""
    dur = (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_start and t.datetime_complete else None
    return ExportedTrial.new(
        number=t.number,
        state=t.state.name,
        datetime_start=t.datetime_start.isoformat() if t.datetime_start else None,
        datetime_complete=t.datetime_complete.isoformat() if t.datetime_complete else None,
        duration_s=dur,
        values=dict(zip(names, t.values)) if t.values else None,
        params=dict(t.params),
        record=trial_record(t),
        constraints=dict(t.constraints),
        error=t.user_attrs.get(ERROR_KEY),
        fail_reason=t.system_attrs.get(FAIL_REASON_KEY),
        retry_of=t.user_attrs.get(RETRY_OF_KEY),
        surplus=bool(t.system_attrs.get(SURPLUS_KEY)),
    )


def check_out(out: str | Path, *, force: bool) -> Path:
    """Refuse an existing output file (without force), one that is no regular file (a device such
    as ``/dev/full``, a FIFO: even with force, which would replace it) or a missing directory,
    before any work."""
    out = Path(out)
    if out.is_dir():
        raise NascompressError(f"{out} is a directory; give a file name")
    if out.exists() and not out.is_file():
        kind = "a named pipe (FIFO)" if out.is_fifo() else "a device or socket"
        raise SettingError(f"{out} is {kind}, not a regular file; choose another {{out}} (a file name)")
    if out.exists() and not force:
        raise SettingError(f"{out} already exists; pass {{force}} to overwrite it")
    if not out.parent.is_dir():
        raise SettingError(f"directory {out.parent} does not exist; create it or choose another {{out}}")
    return out


def export_study(name: str, *, fmt: str, out: str | Path, storage: str | None = None, force: bool = False) -> Path:
    """Write every trial of a study to a CSV or JSON file (atomically).

    Args:
        name: the study name.
        fmt: ``csv`` or ``json``.
        out: the file to write.
        storage: a ``--storage`` value, or None for the project's default files.
        force: overwrite an existing file.
    """
    if fmt not in ("csv", "json"):
        raise SettingError(f"{{format}} must be csv or json, got {fmt!r}")
    out = check_out(out, force=force)
    spec, study = load(name, storage)
    refuse_overwriting_inputs(out, (spec.path,))  # the study's own file (even with --force)
    names = metric_names(study)
    trials = [exported_trial(t, names) for t in study.get_trials(deepcopy=False)]
    if fmt == "json":
        export = StudyExport.new(
            study=name,
            storage=spec.display,
            metric_names=names,
            directions=directions(study),
            info=study_info(study) or {},
            trials=trials,
        )
        text = json.dumps(export.to_dict(), indent=2) + "\n"
    else:
        text = _csv(trials, names)
    with atomic_path(out) as tmp:
        tmp.write_text(text)
    return out


def _csv(trials: Sequence[ExportedTrial], names: Sequence[str]) -> str:
    params: list[str] = []
    cons: list[str] = []
    for t in trials:
        params += [k for k in t.params if k not in params]
        cons += [k for k in t.constraints if k not in cons]
    head = (
        ["number", "state", "datetime_start", "datetime_complete", "duration_s"]
        + [f"values.{n}" for n in names]
        + [f"params.{p}" for p in params]
        + [f"record.{f}" for f in RECORD_FIELDS]
        + [f"constraints.{c}" for c in cons]
        + ["error", "fail_reason", "retry_of", "surplus"]
    )
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(head)

    def cell(v: Any) -> Any:
        if isinstance(v, (list, dict)):
            return json.dumps(v)
        if isinstance(v, str) and v.startswith(FORMULA_STARTS):
            return "'" + v  # a spreadsheet would run it as a formula (CSV injection, OWASP)
        return "" if v is None else v

    for t in trials:
        vals = t.values or {}
        rec = t.record.to_dict()  # the record's fields as stored (a nested record as its dict)
        w.writerow(
            [t.number, t.state, cell(t.datetime_start), cell(t.datetime_complete), cell(t.duration_s)]
            + [cell(vals.get(n)) for n in names]
            + [cell(t.params.get(p)) for p in params]
            + [cell(rec.get(f)) for f in RECORD_FIELDS]
            + [cell(t.constraints.get(c)) for c in cons]
            + [cell(t.error), cell(t.fail_reason), cell(t.retry_of), t.surplus]
        )
    return buf.getvalue()
