"""A study's latency (issue 65): trials' batch-1 latency predicted from the device's latency table (a
hand-made one here: arithmetic, never a speed) and measured only for the finalists, the trials the
study could pick."""

from __future__ import annotations

from types import SimpleNamespace

import optuna
import pytest
import torch

from nascompress.profiling import block_tokens, geometry_of, latency_table_build, predict_latency
from nascompress.profiling.latency_table import LatencyTable
from nascompress.studies import trial_context
from nascompress.studies.trial_context import is_finalist

from .conftest import hand_latency_table, TINY_EVIT_SPACE, invoke

SMALL = ["--eval-images", 60, "--train-images", 60, "--calib-steps", 3, "--batch-size", 30]
PROJECT_SPACES = {"evit.yaml": TINY_EVIT_SPACE}


def hand_table(geometry, *, align: int = 8) -> LatencyTable:
    return hand_latency_table(geometry, align=align)


@pytest.fixture()
def hand(monkeypatch):
    """The hand-made table in place of the device's, and a count of the measurements."""
    measured = []

    def fake_measure(models, shape, **kw):
        measured.append(len(models))
        return [{"latency_ms": 2.0, "throughput": 100.0}, {"latency_ms": 1.5, "throughput": 150.0}]

    monkeypatch.setattr(trial_context, "latency_table", lambda geometry, **kw: hand_table(geometry))
    monkeypatch.setattr(trial_context, "measure", fake_measure)
    # the anchor: the dense model "timed now" at 1.5x the table's prediction (the machine slowed down)
    monkeypatch.setattr(latency_table_build, "measured_ms", lambda m, table, **kw: 1.5 * predict_latency(table, m))
    return measured


def records(name):
    from nascompress.studies.inspect import load

    study = load(name)[1]
    return [t.user_attrs["nascompress"] for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]


def test_trials_latency_is_predicted_and_measured_for_finalists(project, tiny_run, hand):
    r = invoke(
        "search", "tokens", tiny_run, "--study", "lat", "--space", "evit.yaml", "--trials", 6,
        "--max-latency", 100, *SMALL,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    recs = records("lat")
    assert len(recs) == 6
    sources = [rec["latency"]["source"] for rec in recs]
    assert all(rec["latency"]["predicted_ms"] > 0 for rec in recs)
    assert sources[0] == "measured"  # the first trial: nothing to beat yet
    assert len(hand) == sources.count("measured") < len(recs)  # the others: only while they could be picked
    for rec in recs:
        lat = rec["latency"]
        want = lat["measured_ms"] if lat["source"] == "measured" else lat["predicted_ms"]
        assert rec["latency_ms"] == pytest.approx(want)
    best = max(recs, key=lambda rec: rec["accuracy"])
    assert best["latency"]["source"] == "measured"  # what a pick would take was measured
    from nascompress.studies.inspect import load

    anchor = load("lat")[1].user_attrs["nascompress:latency_anchor"]
    assert anchor["anchor"] == pytest.approx(1.5) and anchor["dense_ms"] == pytest.approx(
        1.5 * anchor["table_dense_ms"]
    )


def test_the_anchor_is_the_studys_and_a_resume_reads_it(project, tiny_run, hand, monkeypatch):
    """The predicted milliseconds are scaled by the dense model timed once for the study (stored in it):
    a later run of the same study reads that anchor and times nothing, so its trials' predictions are
    on the scale of the first run's."""
    from nascompress.studies.inspect import load

    args = ["search", "tokens", tiny_run, "--study", "an", "--space", "evit.yaml", "--max-latency", 100, *SMALL]
    assert invoke(*args, "--trials", 2).exit_code == 0
    timed = []
    monkeypatch.setattr(latency_table_build, "measured_ms", lambda m, table, **kw: timed.append(1) or 99.0)
    r = invoke(*args, "--trials", 4)
    assert r.exit_code == 0, r.output
    assert timed == [] and load("an")[1].user_attrs["nascompress:latency_anchor"]["anchor"] == pytest.approx(1.5)
    assert len(records("an")) == 4


def test_latency_source_measured_measures_every_trial(project, tiny_run, hand):
    r = invoke(
        "search", "tokens", tiny_run, "--study", "m", "--space", "evit.yaml", "--trials", 3,
        "--max-latency", 100, "--latency-source", "measured", *SMALL,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    recs = records("m")
    assert len(hand) == 3 and all(rec["latency"]["source"] == "measured" for rec in recs)


def test_the_prediction_reads_the_tokens_a_token_method_keeps(tiny_run):
    import nascompress
    from nascompress.methods import apply_methods

    base = nascompress.load(tiny_run)
    table = hand_table(geometry_of(base))
    x = torch.zeros(1, 1, 16, 16)
    full = block_tokens(base, x)
    assert all(a == m == full[0][0] for a, m in full)
    pruned = apply_methods(base, [{"name": "evit", "config": {"prune_layers": [1], "keep_rate": [0.5]}}])
    kept = block_tokens(pruned, x)
    assert kept[0][1] < kept[0][0] and kept[-1][0] < full[-1][0]  # EViT drops tokens between attention and MLP
    assert predict_latency(table, pruned, x=x) < predict_latency(table, base, x=x)


def test_who_is_a_finalist():
    def study(*recs):
        trials = [SimpleNamespace(state=optuna.trial.TrialState.COMPLETE, user_attrs={"nascompress": r}) for r in recs]
        return SimpleNamespace(get_trials=lambda deepcopy: trials)

    done = study({"accuracy": 80.0, "latency_ms": 1.0}, {"accuracy": 90.0, "latency_ms": 3.0})
    constrained = SimpleNamespace(max_latency_ms=2.0)
    assert is_finalist(constrained, done, 85.0, 1.9)  # beats the best trial under the bound
    assert not is_finalist(constrained, done, 75.0, 1.9)
    assert not is_finalist(constrained, done, 95.0, 2.0 * 1.2)  # predicted well over the bound
    assert is_finalist(constrained, done, 95.0, 2.0 * 1.1)  # near it: measured to decide
    front = SimpleNamespace(max_latency_ms=None)
    assert is_finalist(front, done, 85.0, 2.0) and not is_finalist(front, done, 85.0, 3.5)
    assert is_finalist(front, None, 10.0, 9.0)
