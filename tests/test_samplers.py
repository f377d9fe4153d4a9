"""``--sampler``: every sampler the search offers (tpe, gp, nsga2, qmc, grid) gives the same trials
for the same seed, and a study stopped and rerun continues the sequence of an uninterrupted one;
gp refuses a space that is not numeric in one line; grid takes the space's spread points in
order; the sampler is recorded in the study and a study keeps its sampler."""

from __future__ import annotations

import functools
import json

import optuna
import pytest

from nascompress.errors import NascompressError
from nascompress.studies.grid import POINT_KEY
from nascompress.studies.space_model import Space
from nascompress.studies.samplers import SAMPLERS, make_sampler, sampler_factory
from nascompress.studies import run_study

from .conftest import invoke

NUMERIC = {
    "format": "nascompress-space/1",
    "name": "numeric",
    "methods": [
        {
            "name": "toy",
            "params": {"x": {"kind": "float", "low": 0.0, "high": 1.0}, "n": {"kind": "int", "low": 0, "high": 8}},
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
                "mode": {"kind": "categorical", "choices": ["a", "b"]},
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
                "layers": {"kind": "layers", "range": [1, 4], "size": [1, 2]},
                "rate": {
                    "kind": "per_layer",
                    "layers": "layers",
                    "value": {"kind": "float", "low": 0.5, "high": 1.0, "step": 0.1},
                },
            },
        }
    ],
}


def _objective(space_dict: dict, trial: optuna.Trial) -> tuple[float, float]:
    cfg = Space.from_dict(space_dict, method_fields=None).suggest(trial)[0]["config"]
    x, n = cfg.get("x", 0.5), cfg.get("n", 4)
    rate = cfg.get("rate", [1.0])
    rate = rate if isinstance(rate, list) else [rate]
    cost = 0.2 + 0.5 * x + 0.03 * n + 0.1 * sum(rate) / len(rate)
    return 60.0 + 30.0 * x - (n - 3) ** 2 * 0.5 + (1.5 if cfg.get("mode") == "b" else 0.0), cost


def _factory(space_dict: dict):
    return functools.partial(_objective, space_dict)


def run(
    tmp_path, name: str, kind: str, n: int, seed: int, space_dict: dict = NUMERIC, trials: int = 14, enqueue=()
) -> list[dict]:
    space = Space.from_dict(space_dict, method_fields=None)
    storage = f"sqlite:///{tmp_path / 'samplers.db'}"
    run_study(
        study_name=name,
        storage=storage,
        objective_factory=functools.partial(_factory, space_dict),
        n_trials=n,
        directions=["maximize", "minimize"],
        metric_names=["accuracy", "flops_ratio"],
        space_info={"space": space.to_dict(), "space_hash": space.hash(), "sampler": kind},
        sampler_factory=sampler_factory(kind, space, seed, trials=trials),
        seed=seed,
        enqueue=list(enqueue),
        progress=False,
    )
    study = optuna.load_study(study_name=name, storage=storage)
    return [t.params for t in sorted(study.trials, key=lambda t: t.number)]


@pytest.mark.parametrize("kind,n,cut", [("tpe", 12, 5), ("gp", 12, 10), ("qmc", 6, 3), ("grid", 6, 3)])
def test_same_seed_same_trials_and_resume_continues_the_sequence(tmp_path, kind, n, cut):
    """A study stopped after ``cut`` trials and rerun to ``n`` proposes what an uninterrupted one
    does (TPE and GP past their 10 random start-up trials). NSGA-II past its first generation:
    tests/test_studies.py::test_sigkill_resume_continues_the_same_sequence (killed mid-trial)."""
    whole = run(tmp_path, "whole", kind, n, seed=3)
    assert len(whole) == n and len({json.dumps(p, sort_keys=True) for p in whole}) == n
    run(tmp_path, "cut", kind, cut, seed=3)
    assert run(tmp_path, "cut", kind, n, seed=3) == whole
    if kind == "qmc":
        assert run(tmp_path, "other", kind, n, seed=4) != whole


def test_every_sampler_is_offered():
    assert set(SAMPLERS) == {"tpe", "gp", "nsga2", "qmc", "grid"}
    tpe = make_sampler("tpe", 0)
    assert isinstance(tpe, optuna.samplers.TPESampler) and tpe._multivariate
    assert isinstance(make_sampler("gp", 0), optuna.samplers.GPSampler)
    assert isinstance(make_sampler("nsga2", 0), optuna.samplers.NSGAIISampler)
    with pytest.raises(NascompressError, match="unknown sampler 'cma'"):
        make_sampler("cma", 0)
    with pytest.raises(NascompressError, match="sampler must be one of"):
        sampler_factory("cma", Space.from_dict(NUMERIC, method_fields=None), 0)


@pytest.mark.parametrize(
    "space_dict,why",
    [
        (MIXED, "toy.mode is categorical (2 choices)"),
        (CONDITIONAL, "exists only when toy.layers has at least 2 layers"),
    ],
)
def test_gp_refuses_a_space_that_is_not_numeric_in_one_line(space_dict, why):
    with pytest.raises(NascompressError) as e:
        sampler_factory("gp", Space.from_dict(space_dict, method_fields=None), 0)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("sampler gp needs a space of numeric parameters") and why in msg
    assert "use sampler tpe" in msg


def test_grid_takes_the_spread_points_in_order_on_any_space(tmp_path):
    space = Space.from_dict(CONDITIONAL, method_fields=None)
    points = space.grid(6)
    assert len(points) == 6
    # an enqueued configuration equal to the third point: that point is not taken twice
    got = run(tmp_path, "g", "grid", 8, seed=0, space_dict=CONDITIONAL, trials=6, enqueue=[points[2]])
    assert got[0] == points[2] and got[1:6] == [points[0], points[1], points[3], points[4], points[5]]
    assert len(got) == 8  # the grid is exhausted: the last trials are random, nothing fails
    study = optuna.load_study(study_name="g", storage=f"sqlite:///{tmp_path / 'samplers.db'}")
    assert [POINT_KEY in t.system_attrs for t in study.trials] == [False] + [True] * 5 + [False] * 2


def test_the_sampler_is_recorded_and_a_study_keeps_it(tmp_path, tiny_run, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tome.yaml").write_text(
        "format: nascompress-space/1\nname: tiny-tome\nmethods:\n"
        "  - name: tome\n    params:\n      r: {kind: int, low: 0, high: 6}\n"
    )
    small = ["--train-images", 64, "--eval-images", 64, "--calib-steps", 0, "--batch-size", 32]
    r = invoke(
        "search", "tokens", tiny_run, "--study", "s", "--space", "tome.yaml", "--trials", 4, "--sampler", "gp", *small
    )
    assert r.exit_code == 0, r.output
    r = invoke("study", "list", "--json")
    assert r.exit_code == 0, r.output
    assert [s["sampler"] for s in json.loads(r.stdout) if s["name"] == "s"] == ["gp"]
    r = invoke(
        "search", "tokens", tiny_run, "--study", "s", "--space", "tome.yaml", "--trials", 5, "--sampler", "tpe", *small
    )
    assert r.exit_code == 1
    assert "study 's' in" in r.output and "was created with sampler 'gp' and this run asks for 'tpe'" in r.output
    r = invoke(
        "search", "tokens", tiny_run, "--study", "j", "--space", "tome.yaml", "--sampler", "gp", "--trials", 2, *small
    )
    assert r.exit_code == 0, r.output  # an int-only space is numeric
    (tmp_path / "cat.yaml").write_text(
        "format: nascompress-space/1\nname: cat\nmethods:\n  - name: tome\n"
        "    params:\n      r: {kind: int, low: 0, high: 6}\n"
        "      prop_attn: {kind: categorical, choices: [true, false]}\n"
    )
    r = invoke("search", "tokens", tiny_run, "--study", "c", "--space", "cat.yaml", "--sampler", "gp")
    assert r.exit_code == 1 and "sampler gp needs a space of numeric parameters" in r.output
    assert "tome.prop_attn is categorical (2 choices)" in r.output
