"""Progress of a running study: a rich live view on stderr, or one JSON line per finished trial."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from optuna.trial import FrozenTrial, TrialState
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .records import ERROR_KEY, FAIL_REASON_KEY, SURPLUS_KEY, pareto_front, trial_record
from nascompress.progress import console

FLOPS_BUCKETS = (0.5, 0.6, 0.7, 0.8, 0.9)


def _bucket(r: float) -> str:
    edges = FLOPS_BUCKETS
    if r <= edges[0]:
        return f"<={edges[0]:g}"
    for lo, hi in zip(edges, edges[1:]):
        if r <= hi:
            return f"{lo:g}-{hi:g}"
    return f">{edges[-1]:g}"


def _bucket_labels() -> list[str]:
    e = FLOPS_BUCKETS
    return [f"<={e[0]:g}"] + [f"{lo:g}-{hi:g}" for lo, hi in zip(e, e[1:])] + [f">{e[-1]:g}"]


def _duration(t: FrozenTrial) -> float | None:
    wall_s = trial_record(t).wall_s
    if isinstance(wall_s, (int, float)):
        return float(wall_s)
    if t.datetime_start and t.datetime_complete:
        return (t.datetime_complete - t.datetime_start).total_seconds()
    return None


@dataclass(frozen=True)
class _Progress:
    """What the live view shows: trials by state, the Pareto front, the best accuracy per FLOPs-ratio
    bucket and the mean time per trial (None: no complete trial timed yet)."""

    counts: dict[str, int] = field(default_factory=dict)
    front: list[FrozenTrial] = field(default_factory=list)
    buckets: dict[str, float] = field(default_factory=dict)
    mean_s: float | None = None


class Display:
    """Live progress on stderr, or JSON lines on stdout (one per finished trial)."""

    def __init__(
        self,
        *,
        study_name: str,
        n_trials: int,
        directions: Sequence[str],
        metric_names: Sequence[str],
        rich: bool,
        json_lines: bool,
        finished_before: set[int],
    ) -> None:
        self.name = study_name
        self.n = n_trials
        self.directions = list(directions)
        self.metric_names = list(metric_names)
        self.rich = rich and not json_lines
        self.json_lines = json_lines
        self.seen = set(finished_before)
        self.t0 = time.time()
        self.state = _Progress()
        self.live: Any = None

    def __enter__(self) -> Display:
        if self.rich:
            self.live = Live(get_renderable=self._render, console=console, refresh_per_second=2, transient=False)
            self.live.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.stop()
            if not self.live.console.is_terminal:  # a log file: its last render ends without a newline
                self.live.console.line()

    def update(self, trials: Sequence[FrozenTrial]) -> None:
        counts: dict[str, int] = {}
        for t in trials:
            counts[t.state.name] = counts.get(t.state.name, 0) + 1
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        front = pareto_front(complete, self.directions)
        buckets: dict[str, float] = {}
        for t in complete:
            rec = trial_record(t)
            acc, ratio = rec.accuracy, rec.flops_ratio
            if isinstance(acc, (int, float)) and isinstance(ratio, (int, float)):
                b = _bucket(float(ratio))
                buckets[b] = max(buckets.get(b, -math.inf), float(acc))
        durs = [d for d in (_duration(t) for t in complete) if d is not None]
        self.state = _Progress(counts, front, buckets, sum(durs) / len(durs) if durs else None)
        for t in sorted(trials, key=lambda t: t.number):
            if t.state.is_finished() and t.number not in self.seen:
                self.seen.add(t.number)
                if not t.system_attrs.get(SURPLUS_KEY):
                    self._finished(t)
        if self.live is not None:
            self.live.refresh()

    def _finished(self, t: FrozenTrial) -> None:
        c = self.state.counts
        if self.json_lines:
            line = {
                "event": "trial",
                "study": self.name,
                "number": t.number,
                "state": t.state.name,
                "values": dict(zip(self.metric_names, t.values)) if t.values else None,
                "params": t.params,
                "record": {k: v for k, v in trial_record(t).to_dict().items() if k != "arch"},
                "error": t.user_attrs.get(ERROR_KEY) or t.system_attrs.get(FAIL_REASON_KEY),
                "complete": c.get("COMPLETE", 0),
                "n_trials": self.n,
                "running": c.get("RUNNING", 0),
                "failed": c.get("FAIL", 0),
                "front_size": len(self.state.front),
                "elapsed_s": round(time.time() - self.t0, 3),
            }
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
        elif self.rich:
            if t.state == TrialState.COMPLETE and t.values:
                vals = "  ".join(f"{n} {v:.4g}" for n, v in zip(self.metric_names, t.values))
                d = _duration(t)
                console.print(
                    f"trial {t.number} complete  {vals}" + (f"  ({d:.1f} s)" if d is not None else ""), highlight=False
                )
            else:
                why = t.user_attrs.get(ERROR_KEY) or t.system_attrs.get(FAIL_REASON_KEY) or ""
                console.print(
                    f"trial {t.number} {t.state.name.lower()}" + (f": {why}" if why else ""),
                    highlight=False,
                    style="yellow" if t.state == TrialState.FAIL else None,
                )

    def _render(self) -> Any:
        s = self.state
        c = s.counts
        g = Table.grid(padding=(0, 2))
        head = Text.assemble(
            (f"study {self.name}", "bold"),
            f"  {c.get('COMPLETE', 0)}/{self.n} complete",
            f"  {c.get('RUNNING', 0)} running",
            f"  {c.get('FAIL', 0)} failed",
        )
        if len(self.directions) > 1:
            head.append(f"  Pareto front {len(s.front)}")
        elif s.front:
            head.append(f"  best {self.metric_names[0]} {s.front[0].values[0]:.4g}")
        if s.mean_s is not None:
            head.append(f"  {s.mean_s:.1f} s/trial")
        head.append(f"  elapsed {time.time() - self.t0:.0f} s")
        g.add_row(head)
        if s.buckets:
            parts = [f"{b} {s.buckets[b]:.2f}" if b in s.buckets else f"{b} -" for b in _bucket_labels()]
            g.add_row(Text("best accuracy by FLOPs ratio: " + " | ".join(parts)))
        return g
