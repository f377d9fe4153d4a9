"""A trial taken over after its worker died mid-suggestion gets the parameters an uninterrupted run
would have given it (the sampler is seeded per trial and, for independent draws, per parameter)."""
from __future__ import annotations

import warnings

import optuna
import pytest

from nascompress.studies.seeding import ParamSeeded, _Seeding, default_sampler


def _params(trial: optuna.Trial, n: int = 3) -> list[float]:
    return [trial.suggest_float(f"p{i}", 0.0, 1.0) for i in range(n)]


def _run(killed_at: int | None, suggested_before_kill: int = 1, n_trials: int = 14) -> list[list[float]]:
    study = optuna.create_study()
    seeding = _Seeding(default_sampler, 7)
    out = []
    for number in range(n_trials):
        seeding.reseed(study, study.get_trials(deepcopy=False))
        trial = study.ask()
        if number == killed_at:
            _params(trial, suggested_before_kill)  # the worker dies after its first suggestions
            seeding.reseed(study, study.get_trials(deepcopy=False))
            trial = optuna.Trial(study, trial._trial_id)  # taken over in place (runner._work)
        p = _params(trial)
        out.append(p)
        study.tell(trial, sum(x * x for x in p))
    return out


@pytest.mark.parametrize("killed_at", [3, 12])  # TPE's random start-up phase, then its multivariate phase
def test_a_trial_taken_over_mid_suggestion_gets_the_uninterrupted_parameters(killed_at):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _run(killed_at) == _run(None)


def test_independent_draws_depend_on_the_parameter_not_on_the_order():
    study = optuna.create_study()
    dist = optuna.distributions.FloatDistribution(0.0, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = ParamSeeded(default_sampler, 5), ParamSeeded(default_sampler, 5)
        ft = study.ask()._cached_frozen_trial
        first = [a.sample_independent(study, ft, n, dist) for n in ("x", "y")]
        second = [b.sample_independent(study, ft, n, dist) for n in ("y", "x")][::-1]
    assert first == second and first[0] != first[1]
