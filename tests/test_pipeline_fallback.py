"""The pipeline never aborts on a collapsing DCS stage: it retries at a milder target, then goes on
without DCS, and says so (summary.json, report.html); a resumed run takes the same way."""

from __future__ import annotations

import json

import pytest
import yaml

import nascompress.pipeline.fallback as fallback_module
import nascompress.dcs_search.run as search_dcs_module
from nascompress.dcs_search.hooks import SearchCollapsed
from nascompress.pipeline.fallback import milder_target

from .conftest import TINY_EVIT_SPACE, invoke


def config(tiny_run, *, tokens: bool = True, target: float = 0.6) -> dict:
    stages = {
        "dcs": {
            "target_flops": target,
            "epochs": 1,
            "batch_size": 32,
            "alpha_init": 0.5,
            "arch_lr": 0.15,
            "mlp_gates": "residual",
            "align": 1,
        }
    }
    if tokens:
        stages["tokens"] = {
            "space": "space.yaml",
            "trials": 2,
            "eval_images": 40,
            "train_images": 40,
            "calib_steps": 2,
            "batch_size": 20,
        }
    stages["retrain"] = {"epochs": 1, "eta": 0, "batch_size": 32}
    return {
        "format": "nascompress-pipeline/1",
        "seed": 0,
        "device": "cpu",
        "data": {"dataset": "synthetic"},
        "base": {"run": str(tiny_run)},
        "goal": {"max_flops": 0.75 if tokens else 0.9},
        "stages": stages,
        "report": {"latency": False},
    }


def write(tmp_path, cfg: dict):
    (tmp_path / "space.yaml").write_text(TINY_EVIT_SPACE)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture()
def collapse_below(monkeypatch):
    """Make every DCS search with a target below ``limit`` collapse (as a real collapse does: the
    search raises SearchCollapsed after its first epoch)."""
    calls = []

    def arm(limit: float):
        real = search_dcs_module.search_dcs

        def fake(job, *, force=False, resume=False):
            calls.append(job.search.target_flops)
            if job.search.target_flops < limit:
                raise SearchCollapsed(f"the search collapsed (test, target {job.search.target_flops})")
            return real(job, force=force, resume=resume)

        monkeypatch.setattr(fallback_module, "search_dcs", fake)  # where the pipeline looks it up
        return calls

    return arm


def test_milder_target_is_halfway_to_dense():
    assert milder_target(0.6) == 0.8 and milder_target(0.7) == 0.85 and milder_target(1.0) == 1.0


def test_collapse_then_milder_target(tiny_run, tmp_path, collapse_below):
    calls = collapse_below(0.7)
    r = invoke("pipeline", write(tmp_path, config(tiny_run)), "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert calls == [0.6, 0.8]
    assert "collapsed" in r.output and "retried at 0.8x" in r.output
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    dcs = s["decisions"]["dcs"]
    assert dcs["dcs_outcome"] == "milder" and dcs["planned_target"] == 0.6 and dcs["dcs_target"] == 0.8
    assert dcs["target_flops"] == 0.8 and "target 0.6" in dcs["dcs_reason"]
    assert s["final"] is not None and "dcs" in s["final"]["methods"]
    assert "retried at 0.8x" in (tmp_path / "out" / "report.html").read_text()


def test_collapse_twice_goes_on_without_dcs_and_says_so(tiny_run, tmp_path, collapse_below):
    calls = collapse_below(1.0)
    out = tmp_path / "out"
    r = invoke("pipeline", write(tmp_path, config(tiny_run)), "--out", out)
    assert r.exit_code == 0, r.output
    assert calls == [0.6, 0.8] and "goes on without DCS" in r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["decisions"]["dcs"]["dcs_outcome"] == "skipped"
    assert s["final"]["methods"] == ["evit"]  # the token study ran on the dense base
    study_base = json.loads((out / "tokens" / "picked" / "config.json").read_text())["from_study"]["search"]["base"]
    assert study_base == str(tiny_run.resolve())
    assert "went on without DCS" in (out / "report.html").read_text()
    # a rerun skips every finished step, the skipped DCS stage included (no search runs again)
    calls.clear()
    r = invoke("pipeline", write(tmp_path, config(tiny_run)), "--out", out, "--json")
    assert r.exit_code == 0, r.output
    assert calls == [] and json.loads(r.stdout)["this_run"]["ran"] == []


def test_no_model_at_all_is_stated(tiny_run, tmp_path, collapse_below):
    collapse_below(1.0)
    out = tmp_path / "out"
    r = invoke("pipeline", write(tmp_path, config(tiny_run, tokens=False, target=0.85)), "--out", out)
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["final"] is None and s["goal"]["met"] is False
    assert s["goal"]["statement"].startswith("no compressed model could be made: target 0.85:")
    assert "NOT met: no compressed model could be made" in r.output
    assert "retrain" not in s["decisions"]


def test_no_fallback_fails_the_stage(tiny_run, tmp_path, collapse_below):
    calls = collapse_below(1.0)
    cfg = config(tiny_run)
    cfg["stages"]["dcs"]["on_collapse"] = "stop"
    r = invoke("pipeline", write(tmp_path, cfg), "--out", tmp_path / "out")
    assert r.exit_code == 1 and "the search collapsed (test, target 0.6)" in r.output and calls == [0.6]
