"""The one run-directory helper (nascompress.runs.run_dir.RunDir) and that every job uses it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from nascompress.errors import NascompressError, SettingError
from nascompress.runs.io import run_state
from nascompress.runs.run_dir import RunDir

PKG = Path(__file__).resolve().parents[1] / "nascompress"


def test_prepare_checks_without_creating_and_refuses_a_used_directory(tmp_path):
    out = tmp_path / "a" / "run"
    RunDir.prepare(out)
    assert not out.exists() and not out.parent.exists()  # a refused or failed job leaves nothing behind
    out.mkdir(parents=True)
    (out / "old.txt").write_text("x")
    with pytest.raises(NascompressError, match="force to overwrite it or resume"):
        RunDir.prepare(out)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NascompressError, match="is not a directory"):
        RunDir.prepare(tmp_path / "file", force=True)


def test_create_records_the_config_force_empties_resume_keeps(tmp_path):
    out = tmp_path / "run"
    run = RunDir.prepare(out)
    assert run.create({"a": 1}) == out and json.loads((out / "config.json").read_text()) == {"a": 1}
    (out / "keep.txt").write_text("x")
    RunDir.prepare(out, resume=True).create({"a": 2})
    assert (out / "keep.txt").exists() and json.loads((out / "config.json").read_text()) == {"a": 2}
    with pytest.raises(SettingError, match=r"holds files nascompress did not write \(keep.txt\)"):
        RunDir.prepare(out, force=True)  # force replaces nascompress's files, never the user's
    assert (out / "keep.txt").read_text() == "x"
    (out / "keep.txt").unlink()
    RunDir.prepare(out, force=True).create({"a": 3})
    assert sorted(p.name for p in out.iterdir()) == [".nascompress", "config.json"]


def test_finish_marks_the_run_complete_and_returns_the_metrics(tmp_path):
    run = RunDir.prepare(tmp_path / "run")
    run.create({})
    assert run_state(run.path) != "complete"
    assert run.finish({"test_top1": 50.0}) == {"test_top1": 50.0}
    assert run_state(run.path) == "complete"
    assert json.loads((run.path / "metrics.json").read_text())["finished"] is True


def test_recorded_reads_the_job_of_an_earlier_run(tmp_path):
    from nascompress.dcs_search.materialize import MaterializeJob

    with pytest.raises(NascompressError, match="nothing to resume"):
        RunDir.recorded(tmp_path, MaterializeJob, "nascompress materialize")
    (tmp_path / "config.json").write_text(json.dumps({"search_dir": "s", "out": "elsewhere"}))
    job = RunDir.recorded(tmp_path, MaterializeJob, "nascompress materialize")
    assert job.search_dir == "s" and job.out == str(tmp_path)


# The life-cycle functions RunDir wraps; only run_dir.py calls them, and train_loop's fit (a training
# run's mark written inside the loop, where a full disk gets the resume advice).
LIFE_CYCLE = {"prepare_out_dir", "create_out_dir", "recorded_job", "finish_run"}
ALLOWED = {
    "runs/run_dir.py": LIFE_CYCLE,
    "train/loop.py": {"finish_run"},
    "runs/out_dir.py": LIFE_CYCLE,
    "runs/io.py": LIFE_CYCLE,
}  # where they are defined


def test_every_job_goes_through_the_run_directory_helper():
    found = []
    for p in sorted(PKG.rglob("*.py")):
        allowed = ALLOWED.get(p.relative_to(PKG).as_posix(), set())
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in LIFE_CYCLE and name not in allowed:
                    found.append(f"{p.relative_to(PKG)}:{node.lineno} {name}")
    assert found == []
