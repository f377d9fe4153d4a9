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

from .inspect import (check_out, count_summary, directions, format_value, load, metric_names, show_columns, trial_row,
                      varying_columns)
from ..utils import refuse_overwriting_inputs
from .records import mixed_scoring, pareto_front, scoring_summary, study_info, trial_record

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
    from nascompress.utils import atomic_path

    with atomic_path(out) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return out


class _Figures:
    """Collects figure fragments; the first one carries plotly.js."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.has_js = False

    def add(self, div_id: str, fig: Any) -> None:
        self.parts.append(fig.to_html(full_html=False, include_plotlyjs=not self.has_js, div_id=div_id,
                                      config={"displaylogo": False, "responsive": True}))
        self.has_js = True

    def note(self, text: str) -> None:
        self.parts.append(f'<p class="note">{html.escape(text)}</p>')

    def heading(self, text: str) -> None:
        self.parts.append(f"<h2>{html.escape(text)}</h2>")


def _record_front(trials: Sequence[FrozenTrial], x_key: str, x_label: str) -> Any | None:
    """Accuracy (up) vs a record field (down) over the complete trials, front highlighted."""
    import plotly.graph_objects as go

    pts = []
    for t in trials:
        rec = trial_record(t)
        acc, x = rec.get("accuracy"), rec.get(x_key)
        if t.state == TrialState.COMPLETE and isinstance(acc, (int, float)) and isinstance(x, (int, float)):
            pts.append((t.number, float(x), float(acc)))
    if not pts:
        return None
    front = [p for p in pts if not any(q[1] <= p[1] and q[2] >= p[2] and (q[1] < p[1] or q[2] > p[2]) for q in pts)]
    front.sort(key=lambda p: p[1])
    rest = [p for p in pts if p not in front]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[p[1] for p in rest], y=[p[2] for p in rest], mode="markers", name="Trial",
                             text=[f"trial {p[0]}" for p in rest], marker={"color": "#9bb8d3"}))
    fig.add_trace(go.Scatter(x=[p[1] for p in front], y=[p[2] for p in front], mode="markers+lines",
                             name="Pareto front", text=[f"trial {p[0]}" for p in front],
                             marker={"color": "#d62728", "size": 9}, line={"dash": "dot"}))
    fig.update_layout(title=f"Accuracy vs {x_label} (trial records)", xaxis_title=x_label,
                      yaxis_title="accuracy (%)", template="plotly_white")
    return fig


def _target(i: int) -> Callable[[FrozenTrial], float]:
    return lambda t: t.values[i]


def build_report(study: optuna.Study, *, storage_display: str) -> str:
    """The report's HTML text (see the module docstring)."""
    names, dirs = metric_names(study), directions(study)
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    info = study_info(study)
    figs = _Figures()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _front_section(figs, study, trials, complete, names, dirs)
        _history_section(figs, study, complete, names)
        _importance_section(figs, study, complete, names)
    table = _table_html(trials, names, dirs)
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    space = info.get("space") or {}
    meta = [("storage", storage_display), ("objectives", ", ".join(f"{n} ({d})" for n, d in zip(names, dirs))),
            ("trials", count_summary(counts)), ("created", info.get("created")),
            ("search space", f"{space.get('name', '?')} (hash {info.get('space_hash', '?')})" if info else None),
            ("base run", info.get("base_run")), ("dataset", info.get("dataset")), ("command", info.get("command")),
            ("sampler", info.get("sampler")), ("seed", info.get("seed")),
            ("scoring", scoring_summary(info, complete)),
            ("trials scored otherwise", "; ".join(mixed_scoring(complete))),
            ("report written", _dt.datetime.now().astimezone().isoformat(timespec="seconds")),
            ("optuna", optuna.__version__)]
    dl = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd>" for k, v in meta if v not in (None, ""))
    title = f"nascompress study {study.study_name}"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<link rel="icon" href="data:,"><style>{REPORT_CSS}</style></head><body>'
            f"<h1>{html.escape(title)}</h1><dl>{dl}</dl>{''.join(figs.parts)}{table}</body></html>\n")


def _front_section(figs: _Figures, study: optuna.Study, trials: Sequence[FrozenTrial],
                   complete: Sequence[FrozenTrial], names: list[str], dirs: list[str]) -> None:
    figs.heading("Pareto front")
    if not complete:
        figs.note("No complete trials yet: nothing to plot.")
        return
    if 2 <= len(dirs) <= 3:
        figs.add("pareto-objectives", optuna.visualization.plot_pareto_front(study, target_names=names))
    elif len(dirs) > 3:
        figs.note(f"{len(dirs)} objectives: the objective-space Pareto plot needs 2 or 3.")
    pair = set(names) if len(names) == 2 else set()
    if pair != {"accuracy", "flops_ratio"}:
        fig = _record_front(trials, "flops_ratio", "FLOPs ratio")
        if fig is not None:
            figs.add("front-flops", fig)
    if pair != {"accuracy", "latency_ms"} and any(trial_record(t).get("latency_ms") is not None for t in complete):
        fig = _record_front(trials, "latency_ms", "latency (ms)")
        if fig is not None:
            figs.add("front-latency", fig)


def _history_section(figs: _Figures, study: optuna.Study, complete: Sequence[FrozenTrial], names: list[str]) -> None:
    figs.heading("Optimization history")
    if not complete:
        figs.note("No complete trials yet.")
        return
    for i, n in enumerate(names):
        target = _target(i) if len(names) > 1 else None
        figs.add(f"history-{i}", optuna.visualization.plot_optimization_history(study, target=target, target_name=n))


def _importance_section(figs: _Figures, study: optuna.Study, complete: Sequence[FrozenTrial],
                        names: list[str]) -> None:
    figs.heading("Parameter importances")
    varying = [p for p in {k for t in complete for k in t.params}
               if len({json.dumps(t.params.get(p)) for t in complete}) > 1]
    if len(complete) < 2 or not varying:
        figs.note(f"Skipped: importances need at least 2 complete trials whose parameters vary "
                  f"(this study has {len(complete)} complete).")
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
        feas = [t for t in trials if t.state == TrialState.COMPLETE and t.values and not math.isnan(t.values[0])
                and all(v <= 0 for v in t.constraints.values())]
        shown = sorted(feas, key=lambda t: (sign * t.values[0], t.number))[:20]
        heading = f"Best trials ({len(shown)})"
    rows = [trial_row(t, names) for t in shown]
    result = {"metric_names": names, "trials": rows}
    varying = varying_columns(rows)
    extra = show_columns(result)
    head = ["trial"] + varying + names + [c.replace("_", " ") for c in extra]
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(format_value(v))}</td>" for v in
                         [r["number"]] + [r["params"].get(p) for p in varying] + [r["values"].get(n) for n in names]
                         + [r["record"].get(c) for c in extra]) + "</tr>" for r in rows)
    table = (f'<table id="front-table"><thead><tr>{"".join(f"<th>{html.escape(h)}</th>" for h in head)}</tr></thead>'
             f"<tbody>{body}</tbody></table>") if rows else '<p class="note">No complete trials yet.</p>'
    return f"<h2>{html.escape(heading)}</h2>{table}"
