"""A fair zero-shot score (issue 39, item 3): every trial of a study, with a predictor stage
(DynamicViT, Sparsifiner) or training-free (EViT, ToMe), is scored on the same validation subset
after the same budget of calibration steps, and each trial's record says which it got."""

from __future__ import annotations

import copy

import optuna
import torch

from .conftest import invoke

# EViT or DynamicViT (or neither) on the tiny 2-block run: a training-free and a predictor method
GROUP_SPACE = """
format: nascompress-space/1
name: tiny-tokens
methods:
  - name: evit
    group: tokens
    optional: true
    params:
      prune_layers: [2]
      keep_rate: {kind: float, low: 0.5, high: 1.0, step: 0.1}
  - name: dynamicvit
    group: tokens
    optional: true
    params:
      prune_layers: [2]
      rho: {kind: float, low: 0.5, high: 1.0, step: 0.1}
"""
SMALL = ["--eval-images", 40, "--train-images", 40, "--batch-size", 20]


PROJECT_SPACES = {"tokens.yaml": GROUP_SPACE}  # the project fixture's (conftest)


def _complete(name):
    from nascompress.studies.inspect import load

    return [t for t in load(name)[1].trials if t.state == optuna.trial.TrialState.COMPLETE]


def _method(t):
    arch = t.user_attrs["nascompress"]["arch"]
    return arch[0]["name"] if arch else None


def test_trials_of_different_methods_record_the_same_subset_and_budget(project, tiny_run):
    from nascompress.studies.records import mixed_scoring

    r = invoke(
        "search",
        "tokens",
        tiny_run,
        "--study",
        "s",
        "--space",
        "tokens.yaml",
        "--trials",
        2,
        "--calib-steps",
        3,
        *SMALL,
    )
    assert r.exit_code == 0, r.output
    from nascompress.studies.inspect import load

    for params in (
        {"group.tokens": "evit", "evit.keep_rate": 0.6},
        {"group.tokens": "dynamicvit", "dynamicvit.rho": 0.6},
    ):
        load("s")[1].enqueue_trial(params)  # the continued study runs them first
    r = invoke(
        "search",
        "tokens",
        tiny_run,
        "--study",
        "s",
        "--space",
        "tokens.yaml",
        "--trials",
        4,
        "--calib-steps",
        3,
        *SMALL,
    )
    assert r.exit_code == 0, r.output
    done = _complete("s")
    assert len(done) == 4
    by_method = {_method(t): t.user_attrs["nascompress"]["scoring"] for t in done[2:]}
    assert {"evit", "dynamicvit"} <= set(by_method)
    subsets = {json_key(sc["eval_subset"]) for sc in by_method.values()}
    assert len(subsets) == 1 and by_method["evit"]["eval_subset"]["images"] == 40
    assert {sc["calib_budget"] for sc in by_method.values()} == {3}
    # the predictor stage took the study's budget (not the recipe's 100 steps); EViT used none of it
    assert by_method["dynamicvit"]["calib_steps"] == {"dynamicvit": 3}
    assert by_method["evit"]["calib_steps"] == {"evit": 0} and by_method["evit"]["calib_steps_total"] == 0
    assert mixed_scoring(done) == [] and {t.user_attrs["nascompress"]["scoring"]["calib_budget"] for t in done} == {3}
    # the study's record, `study show` and the report say how every trial is scored
    from nascompress.studies.inspect import show_study
    from nascompress.studies.report import build_report

    study = load("s")[1]
    assert study.user_attrs["nascompress"]["scoring"]["calib_steps"] == 3
    shown = show_study("s")
    assert (
        shown.scoring.startswith("3 calibration steps per predictor stage")
        and "40 validation images" in shown.scoring
        and by_method["evit"]["eval_subset"]["sha256"] in shown.scoring
    )
    assert shown.scoring in build_report(study, storage_display="x")
    # continuing the study with another budget or subset is refused, naming the setting; nothing runs
    r = invoke(
        "search",
        "tokens",
        tiny_run,
        "--study",
        "s",
        "--space",
        "tokens.yaml",
        "--trials",
        5,
        "--calib-steps",
        5,
        *SMALL,
    )
    assert r.exit_code == 1 and "--calib-steps 3 (this run: 5)" in r.output
    r = invoke(
        "search",
        "tokens",
        tiny_run,
        "--study",
        "s",
        "--space",
        "tokens.yaml",
        "--trials",
        5,
        "--calib-steps",
        3,
        *SMALL[:-2],
        "--batch-size",
        10,
    )
    assert r.exit_code == 1 and "--batch-size 20 (this run: 10)" in r.output
    assert len(_complete("s")) == 4


def json_key(d):
    return tuple(sorted(d.items()))


def test_a_trial_given_another_budget_shows_it_in_its_record(tmp_path, tiny_run):
    from nascompress.studies.trials import Objective, SearchJob
    from nascompress.studies.records import mixed_scoring

    (tmp_path / "s.yaml").write_text(GROUP_SPACE)
    study = optuna.create_study(directions=["maximize", "minimize"])
    params = {"group.tokens": "dynamicvit", "dynamicvit.rho": 0.6}
    for steps in (2, 4):
        job = SearchJob(
            base=str(tiny_run),
            space=str(tmp_path / "s.yaml"),
            study="x",
            trials=1,
            calib_steps=steps,
            eval_images=40,
            train_images=40,
            batch_size=20,
        )
        study.enqueue_trial(params)
        study.optimize(Objective(job), n_trials=1)
    a, b = (t.user_attrs["nascompress"]["scoring"] for t in study.trials)
    assert (a["calib_budget"], a["calib_steps"]) == (2, {"dynamicvit": 2})
    assert (b["calib_budget"], b["calib_steps"]) == (4, {"dynamicvit": 4})
    assert a["eval_subset"] == b["eval_subset"]
    odd = mixed_scoring(study.trials)
    assert len(odd) == 1 and odd[0].startswith("trial 1: calibration budget 4")
    # a trial of a study made before scoring was recorded is named too
    study.add_trial(
        optuna.trial.create_trial(
            params={}, distributions={}, values=[1.0, 1.0], user_attrs={"nascompress": {"accuracy": 1.0}}
        )
    )
    odd = mixed_scoring(study.trials)
    assert len(odd) == 2 and odd[0].startswith("trials 2: no scoring recorded")


def test_every_predictor_stage_of_a_stack_gets_the_budget(tiny_run):
    """Sparsifiner then DynamicViT: each trains its predictors ``budget`` steps (recipe defaults 100);
    budget 0 trains nothing; a keep-everything DynamicViT has nothing to train and uses 0."""
    import nascompress
    from nascompress.methods import get_method
    from nascompress.studies.scoring import calibrate_stack

    base = nascompress.load(tiny_run).eval().requires_grad_(False)
    batches = [(torch.randn(4, 1, 16, 16), torch.arange(4))]

    def stack(rho):
        model, recs = copy.deepcopy(base).requires_grad_(True), []
        for name, cfg in (
            ("sparsifiner", {"attn_keep_ratio": 0.5, "n_down": 4}),
            ("dynamicvit", {"rho": rho, "prune_layers": [2]}),
        ):
            model, rec = get_method(name).prepare_fresh(model, cfg)
            recs.append(rec)
        return model, recs

    model, recs = stack(0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    logs, steps = calibrate_stack(model, recs, teacher=base, batches=batches, budget=0)
    assert steps == {"sparsifiner": 0, "dynamicvit": 0} and logs == {}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    logs, steps = calibrate_stack(model, recs, teacher=base, batches=batches, budget=3)
    assert steps == {"sparsifiner": 3, "dynamicvit": 3} and "ce" in logs["dynamicvit"]
    assert "steps" not in logs["dynamicvit"]
    model, recs = stack(1.0)
    _, steps = calibrate_stack(model, recs, teacher=base, batches=batches, budget=3)
    assert steps == {"sparsifiner": 3, "dynamicvit": 0}
    # a trial of a study made before budgets were recorded is rebuilt as it was scored: each
    # method's recipe count over the cached batches (materialize --study)
    model, rec = get_method("dynamicvit").prepare_fresh(
        copy.deepcopy(base).requires_grad_(True), {"rho": 0.5, "prune_layers": [2]}, {"predictor_steps": 5}
    )
    _, steps = calibrate_stack(model, [rec], teacher=base, batches=batches, budget=None, cycle_to=2)
    assert steps == {"dynamicvit": 5}


def test_a_fine_tuned_trial_records_its_stages_and_epochs(tmp_path, tiny_run):
    """--finetune-epochs: every method but the last runs its predictor stage (the budget), the last is
    trained by the fine-tune itself (0 steps of the budget); the record says so."""
    from nascompress.studies.trials import Objective, SearchJob

    (tmp_path / "s.yaml").write_text("""
format: nascompress-space/1
name: stack
methods:
  - name: sparsifiner
    params: {attn_keep_ratio: 0.5, n_down: 4}
  - name: dynamicvit
    params: {prune_layers: [2], rho: 0.6}
""")
    job = SearchJob(
        base=str(tiny_run),
        space=str(tmp_path / "s.yaml"),
        study="x",
        trials=1,
        calib_steps=2,
        finetune_epochs=1,
        eval_images=40,
        train_images=40,
        batch_size=20,
    )
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.optimize(Objective(job), n_trials=1)
    sc = study.trials[0].user_attrs["nascompress"]["scoring"]
    assert sc["calib_steps"] == {"sparsifiner": 2, "dynamicvit": 0} and sc["finetune_epochs"] == 1.0
    assert (
        sc["calib_budget"] == 2 and "calib_steps" not in study.trials[0].user_attrs["nascompress_training"]["finetune"]
    )
