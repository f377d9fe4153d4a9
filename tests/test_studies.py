"""Studies: storage rules, the crash-safe multi-worker runner, inspection, report, dashboard.

PostgreSQL and Chromium tests start real services (tests/services.py); without them these tests
skip with one line, or fail when NASCOMPRESS_REQUIRE_SERVICES=1 (CI).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from functools import partial

import optuna
import pytest
import torch
from optuna.trial import TrialState

from nascompress.errors import NascompressError
from nascompress.studies import (
    fail_stale_trials,
    mask_url,
    open_storage,
    parse_storage,
    record_trial,
    run_study,
    stale_trials,
)
from nascompress.studies.records import FAIL_REASON_KEY, RETRIES_KEY, WORKER_KEY
from nascompress.studies.storage import resolve_run_storage
from tests import services
from tests.study_toys import SPACE_INFO, TWO, toy_factory, toy_sampler, toy_values
from tests.study_toys import run_toy_study as run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
optuna.logging.set_verbosity(optuna.logging.WARNING)


def trials_of(name: str, storage: str) -> list[optuna.trial.FrozenTrial]:
    st = open_storage(parse_storage(storage), create=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study = optuna.load_study(study_name=name, storage=st)
    return study.get_trials(deepcopy=False)


def key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


def assert_no_duplicates(trials):
    done = [key(t.params) for t in trials if t.state == TrialState.COMPLETE]
    assert len(done) == len(set(done)), "a configuration ran twice"


@pytest.fixture(scope="session")
def pg():
    with services.postgres() as server:
        yield server


# ----------------------------------------------------------------------------------------------
# Storage


def test_parse_and_mask():
    assert mask_url("postgresql://u:s3cret@db:5432/x") == "postgresql://u:***@db:5432/x"
    assert parse_storage("postgresql://u:s3cret@db/x").display == "postgresql://u:***@db/x"
    assert parse_storage("journal:a/b.journal").path.name == "b.journal"
    assert parse_storage("sqlite:///x.db").kind == "sqlite"
    for bad, msg in (
        ("mysql://u:pw@h/db", "not a storage nascompress knows"),
        ("sqlite://x.db", "three slashes"),
        ("sqlite:///:memory:", "in-memory"),
    ):
        with pytest.raises(NascompressError, match=msg) as e:
            parse_storage(bad)
        assert "pw" not in str(e.value)


def test_storage_choice_for_workers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_run_storage(None, study_name="s", workers=1).path.name == "nascompress-studies.db"
    assert resolve_run_storage(None, study_name="s", workers=2).path.name == "nascompress-studies.journal"
    with pytest.raises(
        NascompressError, match="SQLite, which is not safe for 2 concurrent workers: use storage journal:PATH"
    ):
        resolve_run_storage(f"sqlite:///{tmp_path}/x.db", study_name="s", workers=2)
    run("in-db", None, 1)
    with pytest.raises(NascompressError, match="lives in nascompress-studies.db .*continue it with workers 1"):
        resolve_run_storage(None, study_name="in-db", workers=2)
    assert not (tmp_path / "nascompress-studies.journal").exists()


def test_unreachable_postgres_is_one_line():
    port = services.free_port()  # nothing listens there
    with pytest.raises(NascompressError) as e:
        open_storage(parse_storage(f"postgresql://u:hunter2@127.0.0.1:{port}/db"))
    msg = str(e.value)
    assert f"PostgreSQL at 127.0.0.1:{port}: connection refused" in msg and "hunter2" not in msg
    assert "\n" not in msg


def test_postgres_auth_and_database_errors(pg):
    with pytest.raises(NascompressError, match="authentication failed for user nascompress") as e:
        open_storage(parse_storage(pg.url.replace(pg.password, "wrongpass")))
    assert "wrongpass" not in str(e.value) and pg.password not in str(e.value)
    with pytest.raises(NascompressError, match="unknown database nodb"):
        open_storage(parse_storage(pg.url.rsplit("/", 1)[0] + "/nodb"))


# ----------------------------------------------------------------------------------------------
# Records


def test_record_trial_validates_and_merges():
    study = optuna.create_study()
    t = study.ask()
    record_trial(t, accuracy=81, flops_ratio=0.5)
    rec = record_trial(t, params=1234, latency_ms=None, arch=[{"name": "evit", "config": {"keep_rate": 0.7}}])
    assert rec.accuracy == 81.0 and rec.params == 1234 and rec.latency_ms is None and rec.wall_s is None
    assert rec.to_dict() == {
        "accuracy": 81.0,
        "flops_ratio": 0.5,
        "params": 1234,
        "latency_ms": None,
        "arch": [{"name": "evit", "config": {"keep_rate": 0.7}}],
    }
    assert t.user_attrs["nascompress"] == rec.to_dict()
    with pytest.raises(TypeError, match="unknown field 'acc'"):
        record_trial(t, acc=1.0)
    with pytest.raises(TypeError, match="params must be an integer"):
        record_trial(t, params=1.5)


# ----------------------------------------------------------------------------------------------
# Runner


def _killed_mid_trial(tmp_path, kw: dict, hang_at: int) -> dict:
    """Run ``python -m tests.study_toys`` with ``kw`` and SIGKILL it while trial ``hang_at`` runs;
    returns the killed trial's params."""
    markers = tmp_path / "markers"
    markers.mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.study_toys",
            json.dumps({**kw, "toy": {"marker_dir": str(markers), "hang_at": hang_at}}),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert services.wait_until(lambda: (markers / f"start-{hang_at}").exists() or proc.poll() is not None, 120)
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    killed = json.loads((markers / f"start-{hang_at}").read_text())
    return {"x": killed["x"], "mode": killed["mode"]}


def _sequence(trials) -> list[tuple]:
    return [(t.number, t.state.name, t.params, t.values) for t in sorted(trials, key=lambda t: t.number)]


def test_sigkill_mid_trial_then_resume_sqlite(tmp_path, monkeypatch):
    """(a) A run killed with SIGKILL mid-trial loses nothing; the rerun takes the killed trial over in
    its place and ends with the trials an uninterrupted run has."""
    kw = {
        "study_name": "kill",
        "storage": None,
        "n_trials": 6,
        "seed": 3,
        "space_info": SPACE_INFO,
        "enqueue": [{"x": 0.5, "mode": "a"}],
        "heartbeat_interval": 1.0,
        **TWO,
    }
    killed = _killed_mid_trial(tmp_path, kw, hang_at=3)
    storage = f"sqlite:///{tmp_path}/nascompress-studies.db"
    before = {t.number: t for t in trials_of("kill", storage)}
    assert [before[i].state for i in range(4)] == [TrialState.COMPLETE] * 3 + [TrialState.RUNNING]
    assert before[3].params == killed

    monkeypatch.chdir(tmp_path)
    summary = run_study(objective_factory=toy_factory, progress=False, **kw)
    assert summary.stale_resumed == [3] and summary.stale_failed == []
    assert summary.complete == 6 and summary.finished
    after = trials_of("kill", storage)
    by_num = {t.number: t for t in after}
    for i in range(3):  # finished trials intact
        assert by_num[i].state == TrialState.COMPLETE and by_num[i].values == before[i].values
    assert by_num[3].state == TrialState.COMPLETE and by_num[3].params == killed  # run again, in place
    assert by_num[3].user_attrs[RETRIES_KEY] == 1 and len(after) == 6
    assert_no_duplicates(after)
    assert sum(t.params == {"x": 0.5, "mode": "a"} for t in after) == 1  # the enqueued config ran once
    assert all(t.values == list(toy_values(t.params["x"], t.params["mode"])) for t in after)
    # the same trials, numbers and values as an uninterrupted run
    ref = tmp_path / "ref"
    ref.mkdir()
    monkeypatch.chdir(ref)
    run_study(objective_factory=toy_factory, progress=False, **kw)
    assert _sequence(after) == _sequence(trials_of("kill", f"sqlite:///{ref}/nascompress-studies.db"))


@pytest.mark.parametrize("sampler,n,hang_at", [("nsga2", 26, 23), ("tpe", 14, 12)])
def test_sigkill_resume_continues_the_same_sequence(tmp_path, monkeypatch, sampler, n, hang_at):
    """The search's own samplers (NSGA-II past its first generation of 20, TPE past its 10 random
    startup trials): kill -9 mid-trial, rerun = the uninterrupted study, trial for trial."""
    kw = {
        "study_name": "seq",
        "storage": None,
        "n_trials": n,
        "seed": 11,
        "space_info": SPACE_INFO,
        "enqueue": [{"x": 0.5, "mode": "a"}],
        "heartbeat_interval": 1.0,
        **TWO,
    }
    killed = _killed_mid_trial(tmp_path, {**kw, "sampler": sampler}, hang_at=hang_at)
    monkeypatch.chdir(tmp_path)
    run_study(objective_factory=toy_factory, sampler_factory=toy_sampler(sampler), progress=False, **kw)
    ref = tmp_path / "ref"
    ref.mkdir()
    monkeypatch.chdir(ref)
    run_study(objective_factory=toy_factory, sampler_factory=toy_sampler(sampler), progress=False, **kw)
    resumed = trials_of("seq", f"sqlite:///{tmp_path}/nascompress-studies.db")
    assert [t.params for t in resumed if t.number == hang_at] == [killed]
    assert _sequence(resumed) == _sequence(trials_of("seq", f"sqlite:///{ref}/nascompress-studies.db"))


def _two_workers(name: str, storage: str | None, tmp_path):
    ready = tmp_path / f"ready-{name}"
    ready.mkdir()
    enqueue = [{"x": 0.0, "mode": "a"}, {"x": 1.0, "mode": "b"}, {"x": 0.25, "mode": "a"}]
    summary = run(
        name,
        storage,
        8,
        workers=2,
        seed=5,
        enqueue=enqueue,
        objective_factory=partial(toy_factory, sleep=0.15, ready=(str(ready), 2)),
    )
    assert summary.complete == 8 and summary.finished and not summary.worker_errors
    return summary, enqueue


def _check_two_workers(trials, enqueue):
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 8
    assert not [t for t in trials if t.state in (TrialState.FAIL, TrialState.RUNNING, TrialState.WAITING)]
    assert_no_duplicates(trials)
    for cfg in enqueue:  # each enqueued config ran exactly once
        assert sum(t.params == cfg and t.state == TrialState.COMPLETE for t in trials) == 1
    pids = {t.system_attrs[WORKER_KEY]["pid"] for t in trials if t.state == TrialState.COMPLETE}
    assert len(pids) == 2 and os.getpid() not in pids
    # the two workers split this machine's torch threads instead of each taking all of them
    assert {t.user_attrs["torch_threads"] for t in trials if t.state == TrialState.COMPLETE} == {
        max(1, torch.get_num_threads() // 2)
    }


def test_two_workers_postgres(pg, tmp_path):
    """(b) Two worker processes on one PostgreSQL study: no duplicated or lost trials."""
    summary, enqueue = _two_workers("pg-two", pg.url, tmp_path)
    assert pg.password not in json.dumps(summary.to_dict())
    _check_two_workers(trials_of("pg-two", pg.url), enqueue)


def test_two_workers_default_storage_uses_journal(tmp_path, monkeypatch):
    """(c) workers=2 with the default storage runs in the project's journal file."""
    monkeypatch.chdir(tmp_path)
    summary, enqueue = _two_workers("local-two", None, tmp_path)
    assert summary.storage == f"journal:{tmp_path}/nascompress-studies.journal"
    assert not (tmp_path / "nascompress-studies.db").exists()
    _check_two_workers(trials_of("local-two", summary.storage), enqueue)


def test_space_change_is_refused(tmp_path):
    """(d) The same study name with another search space is refused, naming both and the difference."""
    storage = f"sqlite:///{tmp_path}/s.db"
    run("sp", storage, 2)
    other = json.loads(json.dumps(SPACE_INFO))
    other["space"]["name"] = "toy2"
    other["space"]["methods"][0]["params"]["x"]["high"] = 2.0
    other["space_hash"] = "otherhash0000000"
    with pytest.raises(NascompressError) as e:
        run_study(
            study_name="sp",
            storage=storage,
            n_trials=4,
            objective_factory=toy_factory,
            space_info=other,
            progress=False,
            **TWO,
        )
    msg = str(e.value)
    assert "'toy' (hash toyhash000000000)" in msg and "'toy2' (hash otherhash0000000)" in msg
    assert "methods[0].params.x.high" in msg
    with pytest.raises(NascompressError, match="optimizes"):
        run_study(
            study_name="sp",
            storage=storage,
            n_trials=4,
            objective_factory=toy_factory,
            space_info=SPACE_INFO,
            progress=False,
            directions=["maximize"],
            metric_names=["accuracy"],
        )
    assert len(trials_of("sp", storage)) == 2


def test_same_seed_same_trials_and_resume_reproducible(tmp_path):
    """(e) The sampler is rebuilt from the seed: same seed, same params (fresh and resumed)."""
    storage = f"sqlite:///{tmp_path}/r.db"
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        run(name, storage, 5, seed=seed)
    params = {n: [t.params for t in trials_of(n, storage)] for n in "abc"}
    assert params["a"] == params["b"] != params["c"]
    for name in "ab":
        run(name, storage, 9, seed=7)  # resume: the sampler is rebuilt from (seed, trials told)
    run("d", storage, 9, seed=7)  # the same 9 trials without a restart
    a, b, d = ([t.params for t in trials_of(n, storage)] for n in "abd")
    assert a == b == d and len(a) == 9
    assert_no_duplicates(trials_of("a", storage))


def test_stale_trials_by_heartbeat_and_dead_pid(tmp_path):
    storage = open_storage(parse_storage(f"sqlite:///{tmp_path}/h.db"))
    study = optuna.create_study(study_name="hb", storage=storage)
    dead = subprocess.Popen(["true"])
    dead.wait()

    def running(worker):
        t = study.ask()
        t.suggest_float("x", 0, 1)
        if worker:
            study._storage.set_trial_system_attr(t._trial_id, WORKER_KEY, worker)
        return t

    old = running({"host": "elsewhere", "pid": 1, "pid_start": None, "beat": time.time() - 1000})
    fresh = running({"host": "elsewhere", "pid": 1, "pid_start": None, "beat": time.time()})
    gone = running({"host": socket.gethostname(), "pid": dead.pid, "pid_start": None, "beat": time.time()})
    released = running({"host": "elsewhere", "pid": 1, "pid_start": None, "beat": time.time(), "released": True})
    assert [t.number for t in stale_trials(study, grace_period=60)] == [old.number, gone.number, released.number]
    assert fail_stale_trials(study, grace_period=60) == []  # stale trials are taken over, not failed
    # a trial whose worker died max_retries times already is failed (a configuration that kills its process)
    study._storage.set_trial_user_attr(gone._trial_id, RETRIES_KEY, 2)
    study._storage.set_trial_user_attr(released._trial_id, RETRIES_KEY, 2)  # a Ctrl-C does not count
    assert fail_stale_trials(study, grace_period=60, max_retries=2) == [gone.number]
    states = {t.number: t.state for t in study.trials}
    assert (
        states[gone.number] == TrialState.FAIL
        and "died 3 times" in study.trials[gone.number].system_attrs[FAIL_REASON_KEY]
    )
    assert states[old.number] == states[fresh.number] == states[released.number] == TrialState.RUNNING


def test_interrupt_releases_the_trial_then_resume_runs_it_in_place(tmp_path):
    storage = f"sqlite:///{tmp_path}/i.db"
    with pytest.raises(KeyboardInterrupt):
        run("int", storage, 5, objective_factory=partial(toy_factory, fail="interrupt"))
    t2 = next(t for t in trials_of("int", storage) if t.number == 2)
    assert t2.state == TrialState.RUNNING and t2.system_attrs[WORKER_KEY]["released"]
    summary = run("int", storage, 5)
    assert summary.complete == 5 and summary.stale_resumed == [2]
    after = trials_of("int", storage)
    assert len(after) == 5 and after[2].params == t2.params and after[2].state == TrialState.COMPLETE
    assert RETRIES_KEY not in after[2].user_attrs  # a Ctrl-C is not the trial's fault
    run("int-ref", storage, 5)
    assert [t.params for t in after] == [t.params for t in trials_of("int-ref", storage)]


def test_failing_objective_stops_after_max_failures(tmp_path):
    storage = f"sqlite:///{tmp_path}/f.db"
    with pytest.raises(
        NascompressError,
        match=r"3 trials in a row failed \(trial 0: RuntimeError: toy failure; "
        r"trial 1: RuntimeError: toy failure; trial 2: RuntimeError: toy",
    ):
        run("fail", storage, 5, objective_factory=partial(toy_factory, fail="always"))
    trials = trials_of("fail", storage)
    assert [t.state for t in trials] == [TrialState.FAIL] * 3
    assert trials[0].user_attrs["nascompress_error"] == "RuntimeError: toy failure"


def test_a_failing_trial_is_recorded_and_the_study_goes_on(tmp_path):
    """A trial whose objective raises (a DCS search that collapsed: a NascompressError) is FAIL with its
    reason; the next trials run and the study reaches its complete trials."""
    storage = f"sqlite:///{tmp_path}/c.db"
    summary = run("coll", storage, 4, objective_factory=partial(toy_factory, fail="collapse_odd"))
    assert summary.complete == 4 and summary.counts["FAIL"] == 3
    failed = [t for t in trials_of("coll", storage) if t.state == TrialState.FAIL]
    assert [t.number for t in failed] == [1, 3, 5]
    assert failed[0].user_attrs["nascompress_error"] == "the search collapsed in trial 1"
    with pytest.raises(NascompressError) as e:  # only failures in a row stop it, each reason listed
        run("coll2", storage, 4, objective_factory=partial(toy_factory, fail="collapse"))
    assert (
        "3 trials in a row failed (trial 0: the search collapsed in trial 0; trial 1: the search collapsed "
        "in trial 1; trial 2: the search collapsed in trial 2)" in str(e.value)
    )


def test_json_progress_and_enqueue_only_when_new(tmp_path, capsys):
    storage = f"sqlite:///{tmp_path}/j.db"
    run("js", storage, 3, json_progress=True, progress=True, enqueue=[{"x": 0.5, "mode": "b"}])
    out, err = capsys.readouterr()
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x["number"] for x in lines] == [0, 1, 2] and lines[-1]["complete"] == 3 and lines[0]["n_trials"] == 3
    assert lines[0]["params"] == {"x": 0.5, "mode": "b"} and lines[0]["values"]["accuracy"] == 78.5
    assert err == ""
    run("js", storage, 4, enqueue=[{"x": 0.9, "mode": "a"}])  # not new: nothing is enqueued
    assert all(t.params != {"x": 0.9, "mode": "a"} for t in trials_of("js", storage))


# ----------------------------------------------------------------------------------------------
# Inspection, report, dashboard


def cli(*args):
    import typer
    from typer.testing import CliRunner

    from nascompress.cli.study import register

    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    return CliRunner().invoke(app, [str(a) for a in args])


def test_list_show_export(project_with_studies, monkeypatch):
    monkeypatch.chdir(project_with_studies)
    r = cli("study", "list", "--json")
    assert r.exit_code == 0, r.output
    rows = {x["name"]: x for x in json.loads(r.stdout)}
    assert set(rows) == {"multi", "single", "tiny", "journaled"}
    assert rows["multi"]["counts"]["COMPLETE"] == 6 and rows["multi"]["front_size"] >= 1
    assert rows["single"]["best"]["value"] == max(
        t.values[0] for t in trials_of("single", f"sqlite:///{project_with_studies}/nascompress-studies.db")
    )
    assert rows["journaled"]["storage"].startswith("journal:")
    assert cli("study", "list").exit_code == 0
    r = cli("study", "show", "multi", "--json")
    shown = json.loads(r.stdout)
    assert shown["kind"] == "pareto" and shown["varying"] in (["x", "mode"], ["x"])
    assert all(r["record"]["accuracy"] == r["values"]["accuracy"] for r in shown["trials"])
    r = cli("study", "show", "single")
    assert r.exit_code == 0 and "best 4 trials" in r.stdout
    out = project_with_studies / "multi.csv"
    assert cli("study", "export", "multi", "--out", out).exit_code == 0
    head = out.read_text().splitlines()
    assert len(head) == 7 and head[0].startswith("number,state,") and "values.accuracy" in head[0]
    r = cli("study", "export", "multi", "--out", out, "--format", "json")
    assert r.exit_code == 1 and "already exists; pass --force" in r.output
    assert cli("study", "export", "multi", "--out", out, "--format", "json", "--force").exit_code == 0
    data = json.loads(out.read_text())
    assert len(data["trials"]) == 6 and data["trials"][0]["record"]["accuracy"] > 0
    assert data["info"]["space_hash"] == SPACE_INFO["space_hash"]


def test_bad_input_is_one_line_and_writes_nothing(project_with_studies, monkeypatch, tmp_path):
    monkeypatch.chdir(project_with_studies)
    r = cli("study", "show", "nope")
    assert r.exit_code == 1
    assert "no study named 'nope'" in r.output and "studies there: journaled, multi, single, tiny" in r.output
    for cmd in (("export", "nope", "--out", tmp_path / "x.csv"), ("report", "nope", "--out", tmp_path / "x.html")):
        r = cli("study", *cmd)
        assert r.exit_code == 1 and "no study named" in r.output
    r = cli("study", "report", "multi", "--out", tmp_path / "missing" / "r.html")
    assert r.exit_code == 1 and "does not exist" in r.output
    r = cli("study", "list", "--storage", f"sqlite:///{tmp_path}/none.db")
    assert r.exit_code == 1 and "does not exist" in r.output
    assert list(tmp_path.iterdir()) == []
    monkeypatch.chdir(tmp_path)
    r = cli("study", "show", "multi")
    assert r.exit_code == 1 and "no studies yet" in r.output
    assert list(tmp_path.iterdir()) == []


def test_report_is_self_contained(project_with_studies, monkeypatch):
    monkeypatch.chdir(project_with_studies)
    assert cli("study", "report", "multi", "--out", "multi.html").exit_code == 0
    html = (project_with_studies / "multi.html").read_text()
    assert html.count("plotly.js v") == 1 and "<script src=" not in html  # inlined once, nothing fetched
    for div in (
        "pareto-objectives",
        "history-0",
        "history-1",
        "importance-0",
        "importance-1",
        "front-latency",
        "front-table",
    ):
        assert f'id="{div}"' in html
    assert 'id="front-flops"' not in html  # accuracy vs FLOPs ratio is already the objective plot
    assert cli("study", "report", "tiny", "--out", "tiny.html").exit_code == 0
    tiny = (project_with_studies / "tiny.html").read_text()
    assert "importances need at least 2 complete trials" in tiny and 'id="pareto-objectives"' in tiny
    assert cli("study", "report", "single", "--out", "single.html").exit_code == 0
    single = (project_with_studies / "single.html").read_text()
    assert 'id="front-flops"' in single and "Best trials (4)" in single


def test_report_in_headless_chromium(project_with_studies, tmp_path):
    from nascompress.studies.report import write_report

    cwd = os.getcwd()
    os.chdir(project_with_studies)
    try:
        write_report("multi", out=tmp_path / "report.html")
    finally:
        os.chdir(cwd)
    from selenium.webdriver.common.by import By

    n_complete = 6
    with services.serve_dir(tmp_path) as base, services.chromium() as driver:
        driver.get(f"{base}/report.html")
        sel = "#pareto-objectives g.points path.point"
        assert services.wait_until(lambda: len(driver.find_elements(By.CSS_SELECTOR, sel)) >= n_complete, 60)
        assert len(driver.find_elements(By.CSS_SELECTOR, sel)) == n_complete
        assert driver.find_elements(By.CSS_SELECTOR, "#history-0 g.points path.point")
        rows = driver.find_elements(By.CSS_SELECTOR, "#front-table tbody tr")
        assert len(rows) >= 1
        driver.save_screenshot(str(tmp_path / "report.png"))
        assert driver.js_errors() == []
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_dashboard_serves_and_stops(project_with_studies, monkeypatch):
    from nascompress.studies.dashboard import start_dashboard

    monkeypatch.chdir(project_with_studies)
    for name, snapshot in (("multi", True), ("journaled", False)):
        h = start_dashboard(name, port=0)
        try:
            assert h.url.startswith("http://127.0.0.1:") and (h.snapshot is not None) == snapshot
            base = h.url.rsplit("/dashboard/", 1)[0]
            data = json.load(urllib.request.urlopen(f"{base}/api/studies", timeout=30))
            assert name in [s["study_name"] for s in data["study_summaries"]]
            assert urllib.request.urlopen(h.study_url, timeout=30).status == 200
        finally:
            h.stop()
        assert not services.port_open("127.0.0.1", h.port)
        assert h.snapshot is None or not h.snapshot.exists()
    with pytest.raises(NascompressError, match="no study named 'nope'"):
        start_dashboard("nope")


def test_worker_whose_trial_was_taken_over_keeps_going(tmp_path):
    """A live but silent worker whose trial another worker failed as stale drops that result and goes on."""
    storage = f"sqlite:///{tmp_path}/t.db"

    def factory():
        def objective(trial):
            x = trial.suggest_float("x", 0.0, 1.0)
            mode = trial.suggest_categorical("mode", ["a", "b"])
            if trial.number == 1:  # another worker declares this trial stale and fails it meanwhile
                st = trial.study._storage
                st.set_trial_system_attr(trial._trial_id, FAIL_REASON_KEY, "stale (test)")
                st.set_trial_state_values(trial._trial_id, TrialState.FAIL)
                record_trial(trial, accuracy=1.0)  # raises: the trial is finished
            return toy_values(x, mode)

        return objective

    summary = run("taken", storage, 3, objective_factory=factory)
    assert summary.complete == 3
    assert [t.state for t in trials_of("taken", storage)][:2] == [TrialState.COMPLETE, TrialState.FAIL]


def test_missing_service_skips_or_fails(monkeypatch):
    monkeypatch.setattr(services, "REQUIRE", False)
    with pytest.raises(pytest.skip.Exception, match="no such service"):
        services.unavailable("no such service")
    monkeypatch.setattr(services, "REQUIRE", True)
    with pytest.raises(pytest.fail.Exception, match="NASCOMPRESS_REQUIRE_SERVICES=1"):
        services.unavailable("no such service")


def test_piped_tables_are_not_cut(project_with_studies, monkeypatch, capsys):
    """Not a terminal (CliRunner, ``| cat``): every column and value in full, nothing cut at 80
    columns, no two columns shown under the same cut name."""
    from nascompress.cli.common import out
    from nascompress.studies.inspect import render_show
    from nascompress.studies.results import ShowResult

    monkeypatch.chdir(project_with_studies)
    r = cli("study", "show", "multi")
    assert r.exit_code == 0 and "…" not in r.stdout, r.output
    params = {"evit.keep_rate": 0.7, "evit.keep_layers": "3,6,9", "tome.r": 8, "dynamicvit.keep_ratio": 0.5}
    result = ShowResult.new(
        study="tok",
        kind="pareto",
        metric_names=["accuracy", "flops_ratio"],
        directions=["maximize", "minimize"],
        varying=list(params),
        counts={"COMPLETE": 1},
        info={},
        storage="sqlite:////a/rather/long/path/to/the/project/directory/nascompress-studies.db",
        trials=[
            {
                "number": 0,
                "params": params,
                "values": {"accuracy": 81.25, "flops_ratio": 0.5},
                "record": {"params": 5_000_000, "latency_ms": 1.5, "run": "/a/long/run/directory/x"},
            }
        ],
        scored_otherwise=[],
    )
    out.print(render_show(result))
    text = capsys.readouterr().out
    assert "…" not in text, text
    header = next(ln for ln in text.splitlines() if "accuracy ↑" in ln)
    for col in (*params, "flops_ratio ↓"):
        assert col in header, header
    assert any(result.storage in ln for ln in text.splitlines())  # the path whole, on one line


def figure_traces(page: str, div: str) -> list[dict]:
    """The traces of the plotly figure drawn into ``div`` of an HTML page."""
    import re

    m = re.search(r'Plotly\.newPlot\(\s*"' + re.escape(div) + r'",\s*(\[.*?\]),\s*\{', page, re.S)
    assert m, f"no figure {div}"
    return json.loads(m.group(1))


def test_report_front_colours_trials_by_kind_with_one_legend(project_with_studies, monkeypatch, tmp_path):
    """The front is not coloured by trial number (no colour bar, no colour scale): trials, the front
    and the trials over a constraint are each one named trace of one colour; the toolbar is vertical."""
    from nascompress.studies.front_plot import COLOURS
    from nascompress.studies.report import front_figures

    monkeypatch.chdir(project_with_studies)
    assert cli("study", "report", "multi", "--out", tmp_path / "m.html").exit_code == 0
    traces = figure_traces((tmp_path / "m.html").read_text(), "pareto-objectives")
    assert "Pareto front" in [t.get("name") for t in traces]
    for t in traces:
        marker = t.get("marker") or {}
        assert "colorbar" not in marker and "colorscale" not in marker and isinstance(marker.get("color"), str), t
    # a study with a constraint: the trials over it grey crosses, the front among the others only
    study = optuna.create_study(directions=["maximize", "minimize"])
    for x in (0.2, 0.5, 0.9):
        t = study.ask()
        t.set_constraint("flops", x - 0.6)
        study.tell(t, [70 + 20 * x, x])
    ((_, fig),) = front_figures(study.get_trials(), ["accuracy", "flops_ratio"], ["maximize", "minimize"])
    by_name = {tr.name: tr for tr in fig.data}
    assert list(by_name["trial over the constraint"].x) == [0.9]
    assert list(by_name["Pareto front"].x) == [0.2, 0.5] and by_name["Pareto front"].marker.color == COLOURS["front"]
    assert fig.layout.modebar.orientation == "v" and fig.layout.legend.orientation == "h"


def test_dashboard_shows_the_reports_front_and_writes_only_its_snapshot(project_with_studies, monkeypatch):
    from nascompress.studies.dashboard import DASHBOARD_CSS, start_dashboard

    monkeypatch.chdir(project_with_studies)
    h = start_dashboard("multi", port=0)
    try:
        base = h.url.rsplit("/dashboard/", 1)[0]
        study_id = h.study_url.rsplit("/", 1)[1]
        detail = json.load(urllib.request.urlopen(f"{base}/api/studies/{study_id}?after=0", timeout=30))
        figs = {g["id"]: json.loads(g["graph_object"]) for g in detail["plotly_graph_objects"]}
        assert "nascompress-pareto-objectives" in figs
        names = [t.get("name") for t in figs["nascompress-pareto-objectives"]["data"]]
        assert "Pareto front" in names
        page = urllib.request.urlopen(h.study_url, timeout=30).read().decode()  # the toolbar: shown on hover
        assert f"<style>{DASHBOARD_CSS}</style></head>" in page and "modebar{opacity:0" in DASHBOARD_CSS
    finally:
        h.stop()
    study = optuna.load_study(study_name="multi", storage=f"sqlite:///{project_with_studies}/nascompress-studies.db")
    attrs = study._storage.get_study_system_attrs(study._study_id)
    assert not any(k.startswith("dashboard:") for k in attrs)  # the user's storage: untouched
