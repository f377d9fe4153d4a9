"""A trial taken over after its worker died mid-suggestion gets the parameters an uninterrupted run
would have given it (the sampler is seeded per trial and, for independent draws, per parameter)."""

from __future__ import annotations

import warnings

import optuna
import pytest

from nascompress.studies.seeding import ParamSeeded, Seeding, default_sampler


def _params(trial: optuna.Trial, n: int = 3) -> list[float]:
    return [trial.suggest_float(f"p{i}", 0.0, 1.0) for i in range(n)]


def _run(killed_at: int | None, suggested_before_kill: int = 1, n_trials: int = 14) -> list[list[float]]:
    study = optuna.create_study()
    seeding = Seeding(default_sampler, 7)
    out = []
    for number in range(n_trials):
        seeding.reseed(study, study.get_trials(deepcopy=False))
        trial = study.ask()
        if number == killed_at:
            _params(trial, suggested_before_kill)  # the worker dies after its first suggestions
            seeding.reseed(study, study.get_trials(deepcopy=False))
            trial = optuna.Trial(study, trial._trial_id)  # taken over in place (loop.work)
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


def test_a_trial_killed_between_ask_and_its_first_beat_is_run_again_in_its_place(tmp_path):
    """kill -9 right after ``study.ask()`` leaves a RUNNING trial with no owner. The rerun must not
    ask past it (the next trial would draw its parameters under another number): it waits until the
    trial counts as dead (``grace_period``) and runs it in its own place."""
    from functools import partial

    from nascompress.studies import run_study
    from tests.study_toys import SPACE_INFO, TWO, toy_factory

    def run(db, n, **kw):
        return run_study(
            study_name="s",
            storage=f"sqlite:///{db}",
            objective_factory=partial(toy_factory),
            n_trials=n,
            space_info=SPACE_INFO,
            seed=3,
            progress=False,
            **TWO,
            **kw,
        )

    def trials(db):
        study = optuna.load_study(study_name="s", storage=f"sqlite:///{db}")
        return [(t.number, t.state.name, t.params, t.values) for t in study.get_trials(deepcopy=False)]

    run(tmp_path / "a.db", 5)
    run(tmp_path / "b.db", 2)
    killed = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'b.db'}").ask()  # no beat follows
    assert killed.number == 2
    summary = run(tmp_path / "b.db", 5, heartbeat_interval=0.2, grace_period=1.0)
    assert summary.complete == 5
    assert trials(tmp_path / "b.db") == trials(tmp_path / "a.db")


def test_two_runs_workers_of_one_index_asking_at_once_draw_apart():
    """Two separate runs of one study each number their workers from 0. Their workers 0 reading the
    study at the same moment (the same trials told) must still draw different parameters: the
    later trial counts the earlier one among those ahead of it."""
    storage = optuna.storages.InMemoryStorage()
    first = optuna.create_study(study_name="s", storage=storage)
    second = optuna.load_study(study_name="s", storage=storage)  # the other run's handle
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):  # some trials told, so the shared snapshot is not the empty study
            Seeding(default_sampler, 3).reseed(first, first.get_trials(deepcopy=False))
            t = first.ask()
            first.tell(t, sum(_params(t)))
        snapshot = first.get_trials(deepcopy=False)
        Seeding(default_sampler, 3, 0).reseed(first, snapshot)
        Seeding(default_sampler, 3, 0).reseed(second, snapshot)  # read before the other's trial existed
        ta, tb = first.ask(), second.ask()
        assert (ta.number, tb.number) == (2, 3)
        assert _params(ta) != _params(tb)
