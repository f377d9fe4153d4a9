"""``--sampler grid``: the space's spread configurations (:meth:`Space.grid
<nascompress.studies.space_model.Space.grid>`), one per trial, in their order.

The points are fixed before the study starts (``--trials`` of them: Optuna's QMC points for an
unconditional space, a rank-1 lattice for a conditional one; fewer where the space has fewer
distinct configurations), so the grid works on every space, conditional ones included.

How it fits the study runner, which rebuilds its sampler before every trial
(:class:`~nascompress.studies.seeding.ParamSeeded`): when a trial starts, it takes the first point
that no other trial of the study holds (its params, or the point it was given if it has drawn none
yet), and keeps it in the trial's system attrs; every parameter is then answered from that point.
The choice depends only on the study's trials, so a resumed study continues the sequence exactly
as an uninterrupted one, and a trial taken over after its worker died keeps its point. Enqueued
trials keep their fixed params (a point equal to one of them counts as held). Once every point is
held, the remaining trials are random (seeded per trial by the runner). Two workers that start
trials at the same moment may take the same point (as with Optuna's GridSampler).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.trial import FrozenTrial, TrialState

from .records import SURPLUS_KEY

POINT_KEY = "nascompress:grid_point"


def _key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


class GridPointSampler(BaseSampler):
    """Trial by trial, the first of ``points`` (Optuna params) no other trial holds.

    Args:
        points: the configurations, in order (e.g. ``Space.grid(n)``).
        seed: seeds the random sampler used once every point is held.
    """

    def __init__(self, points: Sequence[dict[str, Any]], *, seed: int | None = None) -> None:
        self._points = [dict(p) for p in points]
        self._random = RandomSampler(seed=seed)

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        return {}

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if POINT_KEY in trial.system_attrs or "fixed_params" in trial.system_attrs:
            return  # a trial taken over keeps its point; an enqueued one its params
        held = set()
        for t in study.get_trials(deepcopy=False):
            if t.number == trial.number or t.system_attrs.get(SURPLUS_KEY):
                continue
            point = t.system_attrs.get(POINT_KEY) or t.system_attrs.get("fixed_params")
            held.add(_key(point if point is not None else t.params))
        for p in self._points:
            if _key(p) not in held:
                study._storage.set_trial_system_attr(trial._trial_id, POINT_KEY, p)
                return

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        point = trial.system_attrs.get(POINT_KEY)
        if point is not None and param_name in point:
            return point[param_name]
        return self._random.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(
        self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None
    ) -> None:
        self._random.after_trial(study, trial, state, values)


__all__ = ["GridPointSampler", "POINT_KEY"]
