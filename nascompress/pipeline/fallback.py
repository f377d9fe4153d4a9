"""The pipeline's answer to a stage that fails: nothing aborts on one bad stage.

A DCS search that collapses (:class:`~nascompress.dcs_search.search.SearchCollapsed`: validation fell more
than ``max_val_drop`` below the dense model) is retried once at a milder target, halfway between
the planned one and 1.0; if that collapses too, the pipeline goes on without DCS (the token stage
then searches the dense base) and says so. Which way the stage went is kept in its marker
(``OUT/done/dcs_search.json``: ``result.dcs_outcome`` is ``planned``, ``milder`` or ``skipped``,
with the target used and the reasons: :class:`DcsOutcome`), so a resumed pipeline takes the same
way; the later steps ask :func:`dcs_outcome` for the model they start from (:func:`current_model`).

The token stage's pick (:func:`pick_across`, :func:`pick_or_closest`) is a :class:`PickedTrial`: the
rebuilt trial's metrics, each study's pick and whether the goal was met.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..runs.records import TypedRecord
from ..runs.run_config import find_run_config
from .files import find_step_marker, step_marker_path
from ..errors import NascompressError
from ..dcs_search.hooks import SearchCollapsed
from ..dcs_search.metrics import DCSMetrics
from ..dcs_search.run import search_dcs
from ..studies.trial_model import TrialMetrics, materialize_trial, parse_pick, pick_trial
from ..studies.inspect import load
from ..studies.records import trial_record
from .confirm import CHANNEL_DIR
from .summary import Candidate

OUTCOMES = ("planned", "milder", "skipped")


@dataclass(frozen=True, kw_only=True)
class DcsOutcome(TypedRecord, DCSMetrics):
    """The DCS stage's result (:func:`run_dcs_with_fallback`; its marker's ``result``, scalars only:
    :func:`dcs_outcome`): the search's metrics (none when skipped) and which way the stage went
    (``dcs_outcome``: one of :data:`OUTCOMES`), the target it searched at (None: skipped), the planned
    one and why a search collapsed (``dcs_reason``; None: none did)."""

    NEW_SOURCE = "the DCS stage's {name}"

    skipped: bool | None = None  # True: both searches collapsed, the pipeline goes on without DCS
    dcs_outcome: str | None = None
    dcs_target: float | None = None
    planned_target: float | None = None
    dcs_reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class PickedTrial(TrialMetrics):
    """The goal's pick rebuilt (:func:`pick_or_closest`, :func:`pick_across`: the ``tokens_pick`` step's
    result): the rebuilt trial's metrics; ``goal_unmet``: no trial met the goal, the closest was taken
    (why); across studies, the study kept (``picked_study``) and each study's pick (``candidates``)."""

    NEW_SOURCE = "the pick's {name}"

    goal_unmet: str | None = None
    picked_study: str | None = None
    candidates: Mapping[str, Candidate] | None = None


def milder_target(target: float) -> float:
    """The retry's target (FLOPs or latency ratio): halfway from ``target`` to the dense model (0.6 -> 0.8)."""
    return round(target + (1.0 - target) / 2, 4)


def run_dcs_with_fallback(job: Any, *, force: bool, resume: bool, fallback: bool = True) -> DcsOutcome:
    """Run the DCS search ``job``; on a collapse retry once at :func:`milder_target`, and if that
    collapses too return an outcome ``skipped`` instead of raising. A resumed step continues the
    attempt its ``config.json`` records (the retry, if it had started)."""
    key = "target_latency" if job.search.cost == "latency" else "target_flops"  # the ratio the search lands at
    planned = getattr(job.search, key)
    mild = job.replace(search=job.search.replace(**{key: milder_target(planned)}))
    attempts = [("planned", job)] + ([("milder", mild)] if fallback else [])
    start = 0
    cfg = find_run_config(job.out) if resume and fallback else None
    if cfg is not None:
        recorded = (cfg.get("search") or {}).get(key)
        start = 1 if recorded is not None and abs(recorded - planned) > 1e-9 else 0
    reasons: list[str] = []
    for i, (name, j) in enumerate(attempts[start:], start):
        try:
            metrics = search_dcs(j, force=force or i > start, resume=resume and i == start)
        except SearchCollapsed as e:
            reasons.append(f"target {j.search.target:g}: {e.reason}")  # what happened (its keys' names)
            if not fallback:
                raise
            continue
        return DcsOutcome.new(
            **{
                **metrics.to_dict(),
                "dcs_outcome": name,
                "dcs_target": j.search.target,
                "planned_target": planned,
                "dcs_reason": " | ".join(reasons) or None,
            }
        )
    return DcsOutcome.new(
        skipped=True,
        dcs_outcome="skipped",
        dcs_target=None,
        planned_target=planned,
        dcs_reason=" | ".join(reasons),
    )


def dcs_outcome(out: Path) -> DcsOutcome | None:
    """The recorded result of the DCS stage (``dcs_outcome``, ``dcs_target``, ``dcs_reason``, the
    search's scalars), or None if it has not finished (or the pipeline has no DCS stage)."""
    marker = find_step_marker(out, "dcs_search")
    source = f"{step_marker_path(out, 'dcs_search')}: result"
    return None if marker is None else DcsOutcome.from_dict(marker.result, source=source)


def dcs_skipped(out: Path) -> bool:
    res = dcs_outcome(out)
    return res is not None and bool(res.skipped)


def kept_channel_only(out: Path) -> bool:
    """Whether the ``confirm`` step kept the channel-only model over the pick (:mod:`.confirm`)."""
    marker = find_step_marker(out, "confirm")
    return marker is not None and marker.result.get("kept") == "channel-only"


def current_model(out: Path, *, base_dir: Path, dcs: bool, tokens: bool, retrain: bool, upto: str) -> Path | None:
    """The model the step ``upto`` (``tokens``, ``retrain`` or ``final``) starts from or the
    pipeline ends with, following the DCS outcome and the ``confirm`` step's choice; None: no
    compressed model was made."""
    out = Path(out)
    current: Path | None = base_dir
    compressed = False
    if dcs and not dcs_skipped(out):
        current, compressed = out / "dcs_mat", True
    if upto == "tokens":
        return current
    if tokens:
        current, compressed = out / "tokens" / "picked", True
    if upto == "retrain":
        return current if compressed else None
    if retrain and compressed:
        current = out / (CHANNEL_DIR if kept_channel_only(out) else "final")
    return current if compressed else None


def pick_or_closest(job: Any, *, force: bool) -> PickedTrial:
    """Rebuild the trial the goal's rule picks (``job``: a TrialMaterializeJob); when no trial meets
    the goal, rebuild the complete trial closest to it (lowest FLOPs ratio or latency) instead of
    stopping, and say so (``goal_unmet``): the report then states that no model met the goal."""
    try:
        return PickedTrial.new(**materialize_trial(job, force=force).to_dict())
    except NascompressError as e:
        if "no complete trial has" not in str(e):
            raise
        reason = str(e)
    rule, _ = parse_pick(job.pick)
    key = "flops_ratio" if rule == "best-under-flops" else "latency_ms"
    _, study = load(job.study, job.storage)
    done = [
        (trial_record(t).get(key), t.number) for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"
    ]
    closest = min((v, n) for v, n in done if v is not None)[1]
    res = materialize_trial(job.replace(pick=None, trial=closest), force=force)
    return PickedTrial.new(**res.to_dict(), goal_unmet=f"{reason}; the closest trial was taken")


def pick_across(job: Any, studies: list[str], *, force: bool) -> PickedTrial:
    """The goal's pick over several studies of one storage (the token study on the DCS model and on the
    dense base): each study's pick (:func:`~nascompress.studies.trial_model.pick_trial`), the most accurate
    of them rebuilt (:func:`pick_or_closest`; ties: the fewer FLOPs, then the first study: on images that
    every candidate gets right, the cheaper model is the better one). Trials of all the studies are scored on
    the same evaluation images (their ``eval_subset`` fingerprint, checked). Without a trial meeting the
    goal in any study, the first study's closest trial, as :func:`pick_or_closest`. Returns the rebuilt
    run's metrics with ``picked_study`` and ``candidates`` (each study's pick, a
    :class:`~nascompress.pipeline.summary.Candidate`: trial, accuracy, FLOPs)."""
    rule, value = parse_pick(job.pick)
    candidates: dict[str, Candidate] = {}
    subsets = set()
    for name in studies:
        _, study = load(name, job.storage)
        try:
            t = pick_trial(study, rule, value)
        except NascompressError as e:
            candidates[name] = Candidate.new(trial=None, note=str(e))
            continue
        rec = trial_record(t)
        subsets.add(str((rec.get("scoring") or {}).get("eval_subset")))
        candidates[name] = Candidate.new(
            trial=t.number,
            accuracy=rec.get("accuracy"),
            flops_ratio=rec.get("flops_ratio"),
            latency_ms=rec.get("latency_ms"),
            params=dict(t.params),
        )
    if len(subsets) > 1:
        raise NascompressError(
            f"the studies {', '.join(studies)} scored their trials on different images; rerun "
            "them with the same data, eval_images and seed"
        )
    scored = [
        (c.accuracy, -(c.flops_ratio if c.flops_ratio is not None else math.inf), -i, n)
        for i, (n, c) in enumerate(candidates.items())
        if c.accuracy is not None
    ]
    chosen = max(scored)[-1] if scored else studies[0]
    res = pick_or_closest(job.replace(study=chosen), force=force)
    return res.set(picked_study=chosen, candidates=candidates)


__all__ = [
    "DcsOutcome",
    "PickedTrial",
    "pick_across",
    "pick_or_closest",
    "milder_target",
    "run_dcs_with_fallback",
    "dcs_outcome",
    "dcs_skipped",
    "current_model",
    "kept_channel_only",
    "OUTCOMES",
]
