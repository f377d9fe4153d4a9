"""``--sampler qmc``: Optuna's QMCSampler through the study runner (rebuilt before every trial by
``ParamSeeded``): successive trials take successive points of one scrambled Sobol' sequence, the same
seed gives the same trials, a resumed study continues the sequence, a conditional space is refused."""

from __future__ import annotations

import functools
import math
import pickle

import optuna
import pytest

from nascompress.errors import NascompressError
from nascompress.studies.space_model import Space
from nascompress.studies.samplers import make_sampler, sampler_factory
from nascompress.studies import run_study

TWO_D = {
    "format": "nascompress-space/1",
    "name": "square",
    "methods": [
        {
            "name": "toy",
            "params": {
                "x": {"kind": "float", "low": 0.0, "high": 1.0},
                "y": {"kind": "float", "low": 0.0, "high": 1.0},
            },
        }
    ],
}
MIXED = {
    "format": "nascompress-space/1",
    "name": "mixed",
    "methods": [
        {
            "name": "toy",
            "params": {
                "x": {"kind": "float", "low": 0.0, "high": 1.0},
                "n": {"kind": "int", "low": 1, "high": 9, "step": 2},
                "mode": {"kind": "categorical", "choices": ["a", "b", "c"]},
                "layers": {"kind": "layers", "range": [1, 4], "size": 2},
                "rate": {
                    "kind": "per_layer",
                    "layers": "layers",
                    "value": {"kind": "float", "low": 0.5, "high": 1.0, "step": 0.1},
                },
            },
        }
    ],
}
CONDITIONAL = {
    "format": "nascompress-space/1",
    "name": "cond",
    "methods": [
        {
            "name": "toy",
            "params": {
                "mode": {"kind": "categorical", "choices": ["a", "b"]},
                "k": {"kind": "int", "low": 1, "high": 4, "when": {"mode": "b"}},
            },
        }
    ],
}


def _objective(space_dict: dict, trial: optuna.Trial) -> float:
    Space.from_dict(space_dict, method_fields=None).suggest(trial)
    return float(trial.number)


def _objective_factory(space_dict: dict):
    return functools.partial(_objective, space_dict)


def run(tmp_path, name: str, space_dict: dict, n: int, seed: int) -> list[dict]:
    space = Space.from_dict(space_dict, method_fields=None)
    run_study(
        study_name=name,
        storage=f"sqlite:///{tmp_path / (name + '.db')}",
        objective_factory=functools.partial(_objective_factory, space_dict),
        n_trials=n,
        directions=["maximize"],
        metric_names=["value"],
        space_info={"space": space.to_dict(), "space_hash": space.hash()},
        sampler_factory=sampler_factory("qmc", space, seed),
        seed=seed,
        progress=False,
    )
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / (name + '.db')}")
    attrs = study._storage.get_study_system_attrs(study._study_id)
    assert not any(k.startswith("qmc:") for k in attrs)  # points by trial number, not by Optuna's counter
    return [t.params for t in sorted(study.trials, key=lambda t: t.number)]


def test_qmc_trials_are_successive_points_of_one_sequence(tmp_path):
    """16 trials on the unit square: the first 16 points of a 2-D (scrambled) Sobol' sequence put
    one point in each cell of the 4 x 4 grid, and one in each of 16 strips along each axis; sixteen
    independent random points almost never do (a sampler rebuilt with a new scramble per trial)."""
    params = run(tmp_path, "sq", TWO_D, 16, seed=3)
    xs, ys = [p["toy.x"] for p in params], [p["toy.y"] for p in params]
    assert sorted(math.floor(v * 16) for v in xs) == list(range(16))
    assert sorted(math.floor(v * 16) for v in ys) == list(range(16))
    assert len({(math.floor(x * 4), math.floor(y * 4)) for x, y in zip(xs, ys)}) == 16


def test_qmc_same_seed_same_trials_and_resume_continues_the_sequence(tmp_path):
    space = Space.from_dict(MIXED, method_fields=None)
    a = run(tmp_path, "a", MIXED, 10, seed=7)
    assert len(a) == 10 and len({tuple(sorted(p.items())) for p in a}) == 10
    for p in a:
        assert set(p) == set(space.distributions())
        assert space.params_for(space.records(p)) == p
    assert run(tmp_path, "b", MIXED, 10, seed=7) == a
    assert run(tmp_path, "c", MIXED, 10, seed=8) != a
    run(tmp_path, "d", MIXED, 4, seed=7)
    assert run(tmp_path, "d", MIXED, 10, seed=7) == a  # the rerun continues where it stopped


def test_qmc_on_a_conditional_space_is_refused_in_one_line():
    space = Space.from_dict(CONDITIONAL, method_fields=None)
    with pytest.raises(NascompressError) as e:
        sampler_factory("qmc", space, 0)
    assert "\n" not in str(e.value)
    assert "sampler qmc needs a space without conditional parameters" in str(e.value)
    assert "toy.k (methods[0].params.k) exists only when mode is 'b'" in str(e.value)
    assert isinstance(sampler_factory("tpe", space, 0)(1), optuna.samplers.TPESampler)  # the others take it
    with pytest.raises(NascompressError, match="needs the study's seed and the space's distributions"):
        make_sampler("qmc", 0)


def test_qmc_factory_is_picklable_and_silences_only_the_experimental_warning(recwarn):
    factory = sampler_factory("qmc", Space.from_dict(TWO_D, method_fields=None), 5)
    sampler = pickle.loads(pickle.dumps(factory))(123)
    assert isinstance(sampler, optuna.samplers.QMCSampler)
    assert not [w for w in recwarn if issubclass(w.category, optuna.exceptions.ExperimentalWarning)]
