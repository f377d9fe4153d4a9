"""The Pareto-front plot of a study's report: one colour scheme and one legend.

Trials are drawn by what they are, never coloured by trial number: the trials over a constraint
(grey crosses), the other trials (blue), the Pareto front (red, joined), and, where a pipeline's
report gives them (:class:`FrontMarks`), the picked trial (a gold star), the dense base (a black
diamond), the final model (a green square) and the goal (a dashed line). The legend sits under the
plot and plotly's toolbar stands on its right edge: neither covers the title or the points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from optuna.trial import FrozenTrial, TrialState
import plotly.graph_objects as go

from .records import feasible

COLOURS = {
    "trial": "#6f9fd8",
    "infeasible": "#b5b5b5",
    "front": "#d62728",
    "picked": "#f2b705",
    "dense": "#111111",
    "final": "#2ca02c",
    "goal": "#555555",
}


@dataclass(frozen=True)
class Mark:
    """A model drawn on the front: ``label`` (the legend's text), at (``x``, ``y``)."""

    label: str
    x: float
    y: float


@dataclass(frozen=True)
class FrontMarks:
    """What a pipeline's report marks on its study's fronts, by the x axis's record key
    (``flops_ratio``, ``latency_ms``): the dense base and the final model (``dense``/``final``:
    key -> :class:`Mark`), the goal (key -> (value, label)) and the picked trial's number."""

    picked: int | None = None
    dense: dict[str, Mark] = field(default_factory=dict)
    final: dict[str, Mark] = field(default_factory=dict)
    goal: dict[str, tuple[float, str]] = field(default_factory=dict)


def front_figure(
    trials: Sequence[FrozenTrial],
    *,
    x: Callable[[FrozenTrial], Any],
    y: Callable[[FrozenTrial], Any],
    x_label: str,
    y_label: str,
    minimize: tuple[bool, bool],
    title: str,
    marks: FrontMarks | None = None,
    axis: str | None = None,
) -> Any | None:
    """A 2-D front: ``x``/``y`` read a trial's two values (``minimize``: each axis's direction);
    ``axis``: the record key of the x axis, to look up ``marks``. None when no trial has both."""
    pts = []
    for t in trials:
        if t.state != TrialState.COMPLETE:
            continue
        xv, yv = x(t), y(t)
        if isinstance(xv, (int, float)) and isinstance(yv, (int, float)) and not (math.isnan(xv) or math.isnan(yv)):
            pts.append((t.number, float(xv), float(yv), feasible(t)))
    if not pts:
        return None
    sx, sy = (1 if minimize[0] else -1), (1 if minimize[1] else -1)
    within = [p for p in pts if p[3]]
    front = [
        p
        for p in within
        if not any(sx * q[1] <= sx * p[1] and sy * q[2] <= sy * p[2] and (q[1], q[2]) != (p[1], p[2]) for q in within)
    ]
    front.sort(key=lambda p: p[1])
    rest = [p for p in within if p not in front]
    over = [p for p in pts if not p[3]]

    def scatter(points: list[tuple], name: str, **kw: Any) -> Any:
        return go.Scatter(
            x=[p[1] for p in points],
            y=[p[2] for p in points],
            name=name,
            text=[f"trial {p[0]}" for p in points],
            hovertemplate="%{text}: (%{x:.4g}, %{y:.4g})",
            **kw,
        )

    fig = go.Figure()
    if over:
        fig.add_trace(
            scatter(
                over,
                "trial over the constraint",
                mode="markers",
                marker={"color": COLOURS["infeasible"], "symbol": "x", "size": 8},
            )
        )
    if rest:
        fig.add_trace(scatter(rest, "trial", mode="markers", marker={"color": COLOURS["trial"], "size": 8}))
    fig.add_trace(
        scatter(
            front,
            "Pareto front",
            mode="markers+lines",
            line={"dash": "dot", "color": COLOURS["front"]},
            marker={"color": COLOURS["front"], "size": 10},
        )
    )
    marks = marks or FrontMarks()
    picked = [p for p in pts if p[0] == marks.picked]
    if picked:
        fig.add_trace(
            scatter(
                picked,
                f"picked: trial {marks.picked}",
                mode="markers",
                marker={
                    "color": COLOURS["picked"],
                    "symbol": "star",
                    "size": 20,
                    "line": {"color": "#222222", "width": 1},
                },
            )
        )
    for kind, symbol in (("dense", "diamond"), ("final", "square")):
        m = getattr(marks, kind).get(axis)
        if m is not None:
            fig.add_trace(
                go.Scatter(
                    x=[m.x],
                    y=[m.y],
                    name=m.label,
                    mode="markers",
                    hovertemplate=m.label,
                    marker={
                        "color": COLOURS[kind],
                        "symbol": symbol,
                        "size": 13,
                        "line": {"color": "#ffffff", "width": 1},
                    },
                )
            )
    if axis in marks.goal:
        value, label = marks.goal[axis]
        fig.add_trace(
            go.Scatter(
                x=[value, value],
                y=_y_span(fig),
                name=label,
                mode="lines",
                hoverinfo="name",
                line={"color": COLOURS["goal"], "dash": "dash", "width": 2},
            )
        )
    if marks.dense or marks.final:  # the models' accuracy is their test top-1, the trials' the search's
        title += "<br><sub>trials: accuracy on the search's validation images; models: test top-1</sub>"
    # the toolbar stands beside the plot (vertical), not over its title in a narrow card (optuna-dashboard)
    fig.update_layout(
        title=title,
        xaxis_title=x_label,
        yaxis_title=y_label,
        template="plotly_white",
        showlegend=True,
        legend={"orientation": "h", "yanchor": "top", "y": -0.2, "xanchor": "left", "x": 0},
        margin={"t": 70, "b": 110},
        modebar={"orientation": "v"},
    )
    return fig


def _y_span(fig: Any) -> list[float]:
    """The y range the figure's points cover, padded: the goal line's extent."""
    ys = [v for tr in fig.data for v in (tr.y or ()) if isinstance(v, (int, float))]
    lo, hi = min(ys), max(ys)
    pad = 0.05 * (hi - lo or 1.0)
    return [lo - pad, hi + pad]


__all__ = ["COLOURS", "FrontMarks", "Mark", "front_figure"]
