"""A study whose DCS search collapses in one trial records that trial as failed, with its reason, and
goes on; only failures in a row stop it, listing each reason. A DCS trial records the materialized
channels and the gate family the search chose."""

from __future__ import annotations

import optuna

import nascompress.dcs_search.search as search_dcs_module

from .conftest import invoke, patch_everywhere

DCS_SPACE = """
format: nascompress-space/1
name: tiny-dcs
methods:
  - name: dcs
    params:
      target_flops: {kind: categorical, choices: [0.6, 0.9]}
      qk_mask: static
      max_val_drop: 100
"""
SMALL = ["--eval-images", 60, "--train-images", 60, "--calib-steps", 3, "--batch-size", 30, "--no-enqueue"]


PROJECT_SPACES = {"dcs.yaml": DCS_SPACE}  # the project fixture's (conftest)


def collapse_at(monkeypatch, targets):
    real = search_dcs_module.run_dcs_search  # a trial's search runs in memory

    def fake(job, *args, **kwargs):
        if job.search.target_flops in targets:
            raise search_dcs_module.SearchCollapsed(f"the search collapsed at {job.search.target_flops}")
        return real(job, *args, **kwargs)

    patch_everywhere(monkeypatch, search_dcs_module, "run_dcs_search", fake)


def trials(name):
    from nascompress.studies.inspect import load

    return load(name)[1].trials


def test_a_collapsing_dcs_trial_fails_and_the_study_goes_on(project, tiny_run, monkeypatch):
    collapse_at(monkeypatch, {0.6})
    r = invoke("search", "joint", tiny_run, "--study", "d", "--space", "dcs.yaml", "--trials", 2, *SMALL)
    assert r.exit_code == 0, r.output
    ts = trials("d")
    done = [t for t in ts if t.state == optuna.trial.TrialState.COMPLETE]
    failed = [t for t in ts if t.state == optuna.trial.TrialState.FAIL]
    assert len(done) == 2 and all(t.params["dcs.target_flops"] == 0.9 for t in done)
    assert all(t.user_attrs["nascompress_error"] == "the search collapsed at 0.6" for t in failed)
    assert "trial" in r.output and "fail" in r.output
    rec = done[0].user_attrs["nascompress"]["arch"][0]
    assert rec["name"] == "dcs" and rec["stage"] == "materialized"
    family = rec["config"]["mlp_gates"]
    assert family in ("residual", "hidden")  # the probe's choice, never "auto"
    key = "hidden_keep" if family == "hidden" else "mlp_keep"
    assert all(b[key] is not None for b in rec["blocks"]) and all(b["qk_keep"] for b in rec["blocks"])


def test_failures_in_a_row_stop_the_study_with_their_reasons(project, tiny_run, monkeypatch):
    collapse_at(monkeypatch, {0.6, 0.9})
    r = invoke("search", "joint", tiny_run, "--study", "e", "--space", "dcs.yaml", "--trials", 2, *SMALL)
    assert r.exit_code == 1
    assert "3 trials in a row failed (trial 0: the search collapsed at" in r.output
    assert len([t for t in trials("e") if t.state == optuna.trial.TrialState.FAIL]) == 3
