"""``--sampler qmc``: Optuna's QMCSampler (scrambled Sobol' points) over an unconditional space.

How it fits the study runner (:mod:`nascompress.studies.runner`), which rebuilds its sampler
before every trial as ``factory(per-trial seed)`` (:class:`~nascompress.studies.runner.ParamSeeded`):

- A QMCSampler seeded with the per-trial seed would scramble a new sequence for every trial, and
  Optuna's sample counter (a study system attr keyed by the seed) would start again at point 0
  each time: the trials' points would be no more even than random ones. Here the scrambling is
  seeded from the *study's* seed (bound into the factory by
  :func:`nascompress.studies.trials.sampler_factory`), so every trial, worker and rerun reads the
  same sequence; the per-trial seed drives only the independent sampler, which the space's
  parameters never reach.
- Trial ``n`` takes point ``n`` of the sequence, instead of Optuna's counter: the counter is a
  read-then-write that two workers can interleave (the same point twice), and a trial taken over
  before it had drawn its params would advance it a second time. By trial number, successive
  trials take successive points, a resumed study continues the sequence exactly as an
  uninterrupted one, and workers never share a point. Enqueued trials keep their fixed params
  (their points go unused).
- The search space is given up front (:meth:`Space.distributions
  <nascompress.studies.space_model.Space.distributions>`) rather than inferred from the first
  finished trial, so the first trial is a QMC point too. A conditional space has no such fixed
  set and is refused before the study starts.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Mapping

import optuna
from optuna.distributions import BaseDistribution
from optuna.exceptions import ExperimentalWarning
from optuna.samplers import QMCSampler, RandomSampler


class SpaceQMCSampler(QMCSampler):
    """A scrambled Sobol' QMCSampler over fixed ``distributions``, trial ``n`` at point ``n``.

    Args:
        distributions: the space's Optuna distributions (single-valued ones are left out: Optuna
            never samples them).
        seed: scrambles the sequence (the study's seed).
        independent_seed: seeds the independent sampler (RandomSampler).
    """

    def __init__(self, distributions: Mapping[str, BaseDistribution], *, seed: int, independent_seed: int) -> None:
        super().__init__(
            qmc_type="sobol",
            scramble=True,
            seed=seed,
            independent_sampler=RandomSampler(seed=independent_seed),
            warn_asynchronous_seeding=False,
            warn_independent_sampling=False,
        )
        self._space = {name: d for name, d in distributions.items() if not d.single()}
        self._trial = threading.local()

    def infer_relative_search_space(self, study: optuna.Study, trial: Any) -> dict[str, BaseDistribution]:
        return dict(self._space)

    def sample_relative(
        self, study: optuna.Study, trial: Any, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        self._trial.number = trial.number
        try:
            return super().sample_relative(study, trial, search_space)
        finally:
            del self._trial.number

    def _find_sample_id(self, study: optuna.Study, search_space: dict[str, BaseDistribution]) -> int:
        # Optuna's: a counter in the study's system attrs (see the module docstring); here the trial number
        return self._trial.number


def qmc_sampler(distributions: Mapping[str, BaseDistribution], *, study_seed: int, seed: int) -> SpaceQMCSampler:
    """A :class:`SpaceQMCSampler` scrambled by ``study_seed``, its independent draws seeded by ``seed``
    (the runner's per-trial seed). Only QMCSampler's ExperimentalWarning is silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        return SpaceQMCSampler(distributions, seed=study_seed, independent_seed=seed)


def points(distributions: Mapping[str, BaseDistribution], n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """The first ``n`` points of the scrambled Sobol' sequence over ``distributions``, as Optuna
    params (an in-memory study asked ``n`` times: Optuna maps each point into its distribution,
    log scales, steps and categories included). Duplicate points (small discrete spaces) are
    merged, so fewer than ``n`` may come back."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    fixed = {name: d for name, d in distributions.items() if d.single()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        study = optuna.create_study(sampler=qmc_sampler(distributions, study_seed=seed, seed=seed))
    out: list[dict[str, Any]] = []
    for _ in range(n):
        trial = study.ask(dict(distributions))
        params = {**{k: d.to_external_repr(0) for k, d in fixed.items()}, **trial.params}
        study.tell(trial, 0.0)
        params = {name: params[name] for name in distributions}
        if params not in out:
            out.append(params)
    return out


__all__ = ["SpaceQMCSampler", "qmc_sampler", "points"]
