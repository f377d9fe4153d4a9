"""The studies' results are frozen records (:mod:`nascompress.studies.results`, the stored ones in
:mod:`nascompress.studies.records`): each round-trips its JSON, key order included, a damaged stored
record is one error line, and the front ends read their fields."""

from __future__ import annotations

import dataclasses
import json

import pytest

from nascompress.errors import NascompressError
from nascompress.studies.inspect import exported_trial, load, show_study
from nascompress.studies.records import RECORD_FIELDS, SpaceProfile, StudyInfo, TrialRecord, study_info, trial_record
from nascompress.studies.results import FrontTrial, ShowResult, StudyRun

from .conftest import invoke, patch_everywhere
from .study_toys import SPACE_INFO, fake_run, run_toy_study

RUN_KEYS = [
    "study",
    "storage",
    "n_trials",
    "complete",
    "counts",
    "metric_names",
    "directions",
    "front",
    "wall_s",
    "workers",
    "workers_note",
    "created",
    "stale_failed",
    "stale_resumed",
    "finished",
    "worker_errors",
]


def roundtrip(record, cls):
    """``record`` written as JSON and read back as ``cls``."""
    text = json.dumps(record.to_dict())
    back = cls.from_dict(json.loads(text), source="the test's file")
    assert json.dumps(back.to_dict()) == text  # the same bytes, key order included
    return back


@pytest.fixture(scope="module")
def toy_study(tmp_path_factory):
    d = tmp_path_factory.mktemp("results")
    storage = f"sqlite:///{d}/s.db"
    return run_toy_study("s", storage, 3, seed=2), storage


def test_a_study_run_is_a_frozen_record_that_round_trips_its_json(toy_study):
    res, storage = toy_study
    assert list(res.to_dict()) == RUN_KEYS and res.workers_note is None  # nulls written, in order
    assert res.complete == 3 and res.finished and res.storage == storage and res.worker_errors == ()
    assert all(isinstance(t, FrontTrial) and isinstance(t.params["x"], float) for t in res.front)
    assert roundtrip(res, StudyRun) == res
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.complete = 0
    searched = res.set(profile=SpaceProfile.new(configurations=2), enqueued=1)  # what run_search adds, last
    assert list(searched.to_dict())[-2:] == ["profile", "enqueued"] and searched.profile.configurations == 2


def test_the_stored_records_read_as_they_are_stored(toy_study):
    _, storage = toy_study
    study = load("s", storage)[1]
    t = study.trials[0]
    rec = trial_record(t)
    assert isinstance(rec, TrialRecord) and rec.to_dict() == t.user_attrs["nascompress"]
    assert list(rec.to_dict()) == list(t.user_attrs["nascompress"]) and rec.accuracy > 0 and rec.scoring is None
    assert roundtrip(rec, TrialRecord) == rec
    info = study_info(study)
    assert isinstance(info, StudyInfo) and info.to_dict() == study.user_attrs["nascompress"]
    assert info.space_hash == SPACE_INFO["space_hash"] and info.space_name == "toy" and info.objectives
    exported = exported_trial(t, ["accuracy", "flops_ratio"])
    assert exported.record == rec and exported.to_dict()["record"] == t.user_attrs["nascompress"]
    with pytest.raises(NascompressError, match=r"accuracy must be a number, got str"):
        TrialRecord.from_attrs({"nascompress": {"accuracy": "high"}})
    assert TrialRecord.from_attrs({}).to_dict() == {}  # a trial without a record
    assert TrialRecord.typed_fields() == tuple(RECORD_FIELDS)  # what record_trial writes, in its order


def test_study_show_is_a_record_and_its_json_is_the_records(toy_study, monkeypatch):
    _, storage = toy_study
    shown = show_study("s", storage)
    assert isinstance(shown, ShowResult) and shown.kind == "pareto" and shown.info.space_hash
    assert all(r.record.accuracy == r.values["accuracy"] for r in shown.trials)
    assert roundtrip(shown, ShowResult).to_dict() == shown.to_dict()
    r = invoke("study", "show", "s", "--storage", storage, "--json")
    assert r.exit_code == 0, r.output
    assert r.stdout == json.dumps(shown.to_dict(), indent=2) + "\n"


def test_the_search_command_prints_the_runs_fields(tmp_path, monkeypatch):
    import nascompress.studies.trials as trials

    run = fake_run(
        "toy",
        storage="sqlite:///x.db",
        complete=2,
        n_trials=3,
        front=[{"number": 1, "values": [1.0, 0.5], "params": {}}],
    )
    patch_everywhere(monkeypatch, trials, "run_search", lambda job, **kw: run)
    r = invoke("search", "tokens", tmp_path, "--study", "toy")
    assert r.exit_code == 0, r.output
    assert "study toy (sqlite:///x.db): 2/3 complete, 1 on the front" in r.stdout
    r = invoke("search", "tokens", tmp_path, "--study", "toy", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == run.to_dict()
