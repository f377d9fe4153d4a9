"""A study as ONE self-contained HTML file (works offline: plotly's JavaScript is inlined once).

Sections: the study's record (space, base run, dataset, command), the Pareto front in objective
space (``optuna.visualization.plot_pareto_front``, 2-3 objectives, div ``#pareto-objectives``),
accuracy vs FLOPs ratio and vs latency from the trial records when those are not already the
objectives (``#front-flops``, ``#front-latency``), the optimization history and the parameter
importances of every objective (``target=``), and an HTML table of the front (or best trials).
Parts that a tiny study cannot have (importances need 2 complete trials whose parameters vary)
are replaced by a note.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import math
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import optuna
from optuna.trial import FrozenTrial, TrialState
import plotly.graph_objects as go

from .inspect import (
    check_out,
    count_summary,
    directions,
    format_value,
    load,
    metric_names,
    show_columns,
    trial_row,
    varying_columns,
)
from ..runs.out_dir import refuse_overwriting_inputs
from .front_plot import COLOURS, FrontMarks, front_figure
from .records import StudyInfo, feasible, mixed_scoring, pareto_front, scoring_summary, study_info, trial_record
from nascompress.runs.json_io import atomic_path

REPORT_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1150px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}dl{display:grid;grid-template-columns:max-content auto;gap:2px 12px}dt{font-weight:600}
dd{margin:0}.note{color:#666;font-style:italic}code{font-size:.9em}
"""


def write_report(name: str, *, out: str | Path, storage: str | None = None, force: bool = False) -> Path:
    """Write a study's HTML report (atomically).

    Args:
        name: the study name.
        out: the HTML file to write.
        storage: a ``--storage`` value, or None for the project's default files.
        force: overwrite an existing file.
    """
    out = check_out(out, force=force)
    spec, study = load(name, storage)
    refuse_overwriting_inputs(out, (spec.path,))  # the study's own file (even with --force)
    text = build_report(study, storage_display=spec.display)
    with atomic_path(out) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return out


class _Figures:
    """Collects figure fragments; the first one carries plotly.js."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.has_js = False

    def add(self, div_id: str, fig: Any) -> None:
        self.parts.append(
            fig.to_html(
                full_html=False,
                include_plotlyjs=not self.has_js,
                div_id=div_id,
                config={"displaylogo": False, "responsive": True},
            )
        )
        self.has_js = True

    def note(self, text: str) -> None:
        self.parts.append(f'<p class="note">{html.escape(text)}</p>')

    def heading(self, text: str) -> None:
        self.parts.append(f"<h2>{html.escape(text)}</h2>")


def _record_front(trials: Sequence[FrozenTrial], x_key: str, x_label: str, marks: FrontMarks | None) -> Any | None:
    """Accuracy (up) vs a record field (down) over the complete trials, front highlighted."""
    return front_figure(
        trials,
        x=lambda t: getattr(trial_record(t), x_key),
        y=lambda t: trial_record(t).accuracy,
        x_label=x_label,
        y_label="accuracy (%)",
        minimize=(True, False),
        axis=x_key,
        marks=marks,
        title=f"Accuracy vs {x_label} (trial records)",
    )


def _objective_front(trials: Sequence[FrozenTrial], names: list[str], dirs: list[str], marks: FrontMarks | None) -> Any:
    """The front in objective space: two objectives as :func:`front_figure` (a minimized one on x),
    three in 3-D with the same colours."""
    if len(names) == 2:
        i, j = (1, 0) if dirs[1] == "minimize" and dirs[0] != "minimize" else (0, 1)
        return front_figure(
            trials,
            x=lambda t: t.values[i] if t.values else None,
            y=lambda t: t.values[j] if t.values else None,
            x_label=names[i],
            y_label=names[j],
            minimize=(dirs[i] == "minimize", dirs[j] == "minimize"),
            axis=names[i],
            marks=marks,
            title="Pareto front (objectives)",
        )
    front = {t.number for t in pareto_front(trials, dirs)}
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.values and len(t.values) == 3]
    fig = go.Figure()
    for name, pick, colour in (
        ("trial over the constraint", lambda t: not feasible(t), COLOURS["infeasible"]),
        ("trial", lambda t: feasible(t) and t.number not in front, COLOURS["trial"]),
        ("Pareto front", lambda t: t.number in front, COLOURS["front"]),
    ):
        sel = [t for t in done if pick(t)]
        if sel:
            fig.add_trace(
                go.Scatter3d(
                    x=[t.values[0] for t in sel],
                    y=[t.values[1] for t in sel],
                    z=[t.values[2] for t in sel],
                    mode="markers",
                    name=name,
                    text=[f"trial {t.number}" for t in sel],
                    marker={"color": colour, "size": 5},
                )
            )
    fig.update_layout(
        title="Pareto front (objectives)",
        template="plotly_white",
        showlegend=True,
        scene={"xaxis_title": names[0], "yaxis_title": names[1], "zaxis_title": names[2]},
        legend={"orientation": "h", "yanchor": "top", "y": -0.05, "xanchor": "left", "x": 0},
        modebar={"orientation": "v"},
    )
    return fig


def _target(i: int) -> Callable[[FrozenTrial], float]:
    return lambda t: t.values[i]


def build_report(study: optuna.Study, *, storage_display: str, marks: FrontMarks | None = None) -> str:
    """The report's HTML text (see the module docstring); ``marks``: the models and the goal a
    pipeline's report draws on the fronts (:class:`~nascompress.studies.front_plot.FrontMarks`)."""
    names, dirs = metric_names(study), directions(study)
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    info = study_info(study)
    figs = _Figures()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _front_section(figs, trials, complete, names, dirs, marks)
        _history_section(figs, study, complete, names)
        _importance_section(figs, study, complete, names)
    table = _table_html(trials, names, dirs)
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    rec = info or StudyInfo.new()
    meta = [
        ("storage", storage_display),
        ("objectives", ", ".join(f"{n} ({d})" for n, d in zip(names, dirs))),
        ("trials", count_summary(counts)),
        ("created", rec.created),
        ("search space", _space_line(info)),
        ("base run", rec.base_run),
        ("dataset", rec.dataset),
        ("command", rec.command),
        ("sampler", rec.sampler),
        ("seed", rec.seed),
        ("scoring", scoring_summary(info, complete)),
        ("trials scored otherwise", "; ".join(mixed_scoring(complete))),
        ("report written", _dt.datetime.now().astimezone().isoformat(timespec="seconds")),
        ("optuna", optuna.__version__),
    ]
    dl = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd>" for k, v in meta if v not in (None, ""))
    title = f"nascompress study {study.study_name}"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f'<link rel="icon" href="data:,"><style>{REPORT_CSS}</style></head><body>'
        f"<h1>{html.escape(title)}</h1><dl>{dl}</dl>{''.join(figs.parts)}{table}</body></html>\n"
    )


def _space_line(info: StudyInfo | None) -> str | None:
    """The report's search-space line: the space's name and hash (``?``: not recorded)."""
    if info is None:
        return None
    name = (info.space or {}).get("name", "?")
    return f"{name} (hash {'?' if info.space_hash is None else info.space_hash})"


def front_figures(
    trials: Sequence[FrozenTrial], names: list[str], dirs: list[str], marks: FrontMarks | None = None
) -> list[tuple[str, Any]]:
    """The fronts as (div id, figure): in objective space (2 or 3 objectives), and accuracy against
    the FLOPs ratio and the latency from the trial records where those are not the objectives; the
    report's, and the ones ``study dashboard`` adds beside optuna-dashboard's own plots."""
    figs: list[tuple[str, Any]] = []
    if not any(t.state == TrialState.COMPLETE for t in trials):
        return figs
    if 2 <= len(dirs) <= 3:
        figs.append(("pareto-objectives", _objective_front(trials, names, dirs, marks)))
    pair = set(names) if len(names) == 2 else set()
    if pair != {"accuracy", "flops_ratio"}:
        figs.append(("front-flops", _record_front(trials, "flops_ratio", "FLOPs ratio (x the dense FLOPs)", marks)))
    if pair != {"accuracy", "latency_ms"} and any(trial_record(t).latency_ms is not None for t in trials):
        figs.append(("front-latency", _record_front(trials, "latency_ms", "latency (ms)", marks)))
    return [(div, fig) for div, fig in figs if fig is not None]


def _front_section(
    figs: _Figures,
    trials: Sequence[FrozenTrial],
    complete: Sequence[FrozenTrial],
    names: list[str],
    dirs: list[str],
    marks: FrontMarks | None,
) -> None:
    figs.heading("Pareto front")
    if not complete:
        figs.note("No complete trials yet: nothing to plot.")
        return
    if len(dirs) > 3:
        figs.note(f"{len(dirs)} objectives: the objective-space Pareto plot needs 2 or 3.")
    for div, fig in front_figures(trials, names, dirs, marks):
        figs.add(div, fig)


def _history_section(figs: _Figures, study: optuna.Study, complete: Sequence[FrozenTrial], names: list[str]) -> None:
    figs.heading("Optimization history")
    if not complete:
        figs.note("No complete trials yet.")
        return
    for i, n in enumerate(names):
        target = _target(i) if len(names) > 1 else None
        figs.add(f"history-{i}", optuna.visualization.plot_optimization_history(study, target=target, target_name=n))


def _importance_section(figs: _Figures, study: optuna.Study, complete: Sequence[FrozenTrial], names: list[str]) -> None:
    figs.heading("Parameter importances")
    varying = [
        p for p in {k for t in complete for k in t.params} if len({json.dumps(t.params.get(p)) for t in complete}) > 1
    ]
    if len(complete) < 2 or not varying:
        figs.note(
            f"Skipped: importances need at least 2 complete trials whose parameters vary "
            f"(this study has {len(complete)} complete)."
        )
        return
    for i, n in enumerate(names):
        target = _target(i) if len(names) > 1 else None
        try:
            fig = optuna.visualization.plot_param_importances(study, target=target, target_name=n)
        except Exception as e:  # e.g. no parameter present in every complete trial
            figs.note(f"Importances for {n} skipped: {type(e).__name__}: {e}")
            continue
        figs.add(f"importance-{i}", fig)


def _table_html(trials: Sequence[FrozenTrial], names: list[str], dirs: list[str]) -> str:
    if len(dirs) > 1:
        shown = pareto_front(trials, dirs)
        heading = f"Pareto front ({len(shown)} trials)"
    else:
        sign = -1.0 if dirs[0] == "maximize" else 1.0
        feas = [
            t
            for t in trials
            if t.state == TrialState.COMPLETE
            and t.values
            and not math.isnan(t.values[0])
            and all(v <= 0 for v in t.constraints.values())
        ]
        shown = sorted(feas, key=lambda t: (sign * t.values[0], t.number))[:20]
        heading = f"Best trials ({len(shown)})"
    rows = [trial_row(t, names) for t in shown]
    varying = varying_columns(rows)
    extra = show_columns(names, rows)
    head = ["trial"] + varying + names + [c.replace("_", " ") for c in extra]
    body = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(format_value(v))}</td>"
            for v in [r.number]
            + [r.params.get(p) for p in varying]
            + [r.values.get(n) for n in names]
            + [getattr(r.record, c) for c in extra]
        )
        + "</tr>"
        for r in rows
    )
    table = (
        (
            f'<table id="front-table"><thead><tr>{"".join(f"<th>{html.escape(h)}</th>" for h in head)}</tr></thead>'
            f"<tbody>{body}</tbody></table>"
        )
        if rows
        else '<p class="note">No complete trials yet.</p>'
    )
    return f"<h2>{html.escape(heading)}</h2>{table}"
