"""``nascompress search tokens|joint`` on the tiny run, and ``materialize --study``: trials built
through the method contract, the reference configurations first, resume, constraints, rebuilding
a trial's model exactly, and bad input."""

from __future__ import annotations

import json

import optuna
import pytest
import torch

import nascompress

from .conftest import TINY_EVIT_SPACE, invoke

EVIT_SPACE = TINY_EVIT_SPACE
JOINT_SPACE = """
format: nascompress-space/1
name: tiny-joint
methods:
  - name: sparsifiner
    optional: true
    params:
      attn_keep_ratio: {kind: float, low: 0.3, high: 1.0, step: 0.1}
      n_down: 4
  - name: dynamicvit
    params:
      prune_layers: [2]
      rho: {kind: float, low: 0.4, high: 1.0, step: 0.1}
"""
SMALL = ["--eval-images", 60, "--train-images", 60, "--calib-steps", 3, "--batch-size", 30]


PROJECT_SPACES = {"evit.yaml": EVIT_SPACE, "joint.yaml": JOINT_SPACE}  # the project fixture's (conftest)


def load_study(name):
    from nascompress.studies.inspect import load

    return load(name)[1]


def test_search_tokens_runs_the_reference_configurations_first_and_resumes(project, tiny_run):
    r = invoke("search", "tokens", tiny_run, "--study", "s", "--space", "evit.yaml", "--trials", 5, *SMALL)
    assert r.exit_code == 0, r.output
    study = load_study("s")
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 5 and list(study.metric_names) == ["accuracy", "flops_ratio"]
    first, second = done[0].user_attrs["nascompress"], done[1].user_attrs["nascompress"]
    # trial 0: the uncompressed configuration (keep rate 1 at the scaled layers), built as what it is, the
    # base without EViT; trial 1: the paper's (0.7)
    rates = [v for k, v in done[0].params.items() if "keep_rate" in k]
    assert rates and all(v == 1.0 for v in rates) and first["flops_ratio"] == pytest.approx(1.0)
    assert first["arch"] == [], first["arch"]
    assert second["arch"][0]["config"]["keep_rate"] == [0.7, 0.7] and second["flops_ratio"] < 0.9
    base_acc = first["accuracy"]
    info = study.user_attrs["nascompress"]
    assert info["job"]["trials"] == 5 and info["space"]["name"] == "tiny-evit" and info["profile"]["configurations"] > 0
    for t in done:
        rec = t.user_attrs["nascompress"]
        assert {"arch", "flops", "params", "accuracy", "wall_s", "seed"} <= set(rec)
    # resume: the same command with more trials continues the study, finished trials untouched
    r = invoke("search", "tokens", tiny_run, "--study", "s", "--space", "evit.yaml", "--trials", 7, *SMALL)
    assert r.exit_code == 0, r.output
    study = load_study("s")
    done2 = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert (
        len(done2) == 7
        and done2[0].values == done[0].values
        and done2[0].user_attrs["nascompress"]["accuracy"] == base_acc
    )
    # another space under the same name is refused, nothing changes
    (project / "other.yaml").write_text(EVIT_SPACE.replace("high: 1.0", "high: 0.9"))
    r = invoke("search", "tokens", tiny_run, "--study", "s", "--space", "other.yaml", "--trials", 9, *SMALL)
    assert r.exit_code == 1 and "keeps one search space" in r.output
    assert len(load_study("s").trials) == len(study.trials)


def test_materialize_a_trial_reproduces_its_accuracy(project, tiny_run):
    """Zero-shot trials of DynamicViT (+ optional Sparsifiner) train their predictors first; the
    rebuilt model (same configuration, seed, predictor stage) scores exactly what the trial did."""
    r = invoke("search", "joint", tiny_run, "--study", "j", "--space", "joint.yaml", "--trials", 4, *SMALL)
    assert r.exit_code == 0, r.output
    study = load_study("j")
    trial = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE][-1]
    assert any(k.startswith("calibration_dynamicvit") for k in trial.user_attrs["nascompress_training"])
    out = project / "mat"
    r = invoke("materialize", "--study", "j", "--trial", trial.number, "--out", out, "--json")
    assert r.exit_code == 0, r.output
    m = json.loads(r.stdout)
    assert m["rebuilt_accuracy"] == m["trial_accuracy"] == trial.user_attrs["nascompress"]["accuracy"]
    arch = json.loads((out / "arch.json").read_text())
    assert [x["name"] for x in arch["methods"]] == [x["name"] for x in trial.user_attrs["nascompress"]["arch"]]
    model = nascompress.load(out)
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 10)
    for cmd in (["evaluate", out, "--json"], ["profile", out, "--no-latency", "--json"]):
        r = invoke(*cmd)
        assert r.exit_code == 0, r.output


def test_pick_rules_and_bad_input(project, tiny_run):
    r = invoke("search", "tokens", tiny_run, "--study", "p", "--space", "evit.yaml", "--trials", 5, *SMALL)
    assert r.exit_code == 0, r.output
    study = load_study("p")
    ratios = {t.number: t.user_attrs["nascompress"]["flops_ratio"] for t in study.trials}
    out = project / "best"
    r = invoke("materialize", "--study", "p", "--pick", "best-under-flops=0.95", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    assert ratios[json.loads(r.stdout)["trial"]] <= 0.95
    r = invoke("materialize", "--study", "p", "--pick", "knee", "--out", project / "knee")
    assert r.exit_code == 0, r.output
    # a rule no trial satisfies names the closest trial, nothing is written
    r = invoke("materialize", "--study", "p", "--pick", "best-under-flops=0.01", "--out", project / "none")
    cheapest = min(ratios, key=ratios.get)
    assert r.exit_code == 1 and f"the closest is trial {cheapest}" in r.output and not (project / "none").exists()
    # a study that does not exist lists the ones that do
    r = invoke("materialize", "--study", "nope", "--trial", 0, "--out", project / "x")
    assert r.exit_code == 1 and "no study named 'nope'" in r.output and "p" in r.output
    # a trial that is not complete
    failed = study.ask()
    study.tell(failed, state=optuna.trial.TrialState.FAIL)
    r = invoke("materialize", "--study", "p", "--trial", failed.number, "--out", project / "x")
    assert r.exit_code == 1 and "is FAIL, not COMPLETE" in r.output and not (project / "x").exists()
    r = invoke("materialize", "--study", "p", "--pick", "best-under-speed=3", "--out", project / "x")
    assert r.exit_code == 1 and "the rule must be one of" in r.output


def test_max_flops_is_a_constraint(project, tiny_run):
    r = invoke(
        "search", "tokens", tiny_run, "--study", "c", "--space", "evit.yaml", "--trials", 4, "--max-flops", 0.8, *SMALL
    )
    assert r.exit_code == 0, r.output
    study = load_study("c")
    assert len(study.directions) == 1 and list(study.metric_names) == ["accuracy"]
    for t in study.trials:
        if t.state == optuna.trial.TrialState.COMPLETE:
            c = t.system_attrs["constraints:flops"] if "constraints:flops" in t.system_attrs else None
            assert c == pytest.approx(t.user_attrs["nascompress"]["flops_ratio"] - 0.8)
    r = invoke(
        "search",
        "tokens",
        tiny_run,
        "--study",
        "c2",
        "--space",
        "evit.yaml",
        "--trials",
        2,
        "--max-flops",
        0.05,
        *SMALL,
    )
    assert r.exit_code == 1 and "no configuration of space 'tiny-evit' reaches --max-flops 0.05" in r.output


@pytest.mark.parametrize(
    "args,match",
    [
        (["--workers", 0], "--workers must be an integer in [1, 1024], got 0"),
        (["--space", "missing.yaml"], "missing.yaml"),
        (["--objective", "speed"], "--objective must be one of goal, flops, latency, throughput"),
    ],
)
def test_bad_search_input(project, tiny_run, args, match):
    r = invoke("search", "tokens", tiny_run, "--study", "b", "--space", "evit.yaml", *args)
    assert r.exit_code == 1 and match in r.output
    assert not (project / "nascompress-studies.db").exists()


def test_space_beyond_the_model_depth_and_a_non_vit_base(project, tiny_run, tmp_path):
    (project / "deep.yaml").write_text(EVIT_SPACE.replace("range: [1, 2]", "range: [2, 5]"))
    r = invoke("search", "tokens", tiny_run, "--study", "d", "--space", "deep.yaml")
    assert r.exit_code == 1 and "beyond the model's depth 2" in r.output
    # without --space, from a directory that is not the checkout: the shipped evit space is read
    # (layers 2 to the last block but one: none on this 2-block model), not a missing ./search_spaces/evit.yaml
    r = invoke("search", "tokens", tiny_run, "--study", "d")
    assert r.exit_code == 1 and "selects no layer of this 2-block model" in r.output and "evit.yaml" in r.output
    notvit = tmp_path / "resnet"
    notvit.mkdir()
    (notvit / "model.safetensors").write_bytes(b"")
    inp = {"img_size": [32, 32], "in_chans": 3, "mean": [0.5], "std": [0.5]}
    (notvit / "arch.json").write_text(
        json.dumps(
            {"format": "nascompress-arch/2", "input": inp, "model": {"name": "resnet18", "kwargs": {}}, "methods": []}
        )
    )
    r = invoke("search", "tokens", notvit, "--study", "d", "--space", "evit.yaml")
    assert r.exit_code == 1 and "not a timm VisionTransformer" in r.output
    assert not (project / "nascompress-studies.db").exists()


def test_qmc_sampler_searches_an_unconditional_space_and_refuses_a_conditional_one(project, tiny_run):
    (project / "flat.yaml").write_text(JOINT_SPACE.split("  - name: dynamicvit")[0].replace("    optional: true\n", ""))
    r = invoke(
        "search",
        "tokens",
        tiny_run,
        "--study",
        "q",
        "--space",
        "flat.yaml",
        "--trials",
        3,
        "--sampler",
        "qmc",
        "--seed",
        4,
        "--no-enqueue",
        *SMALL,
    )
    assert r.exit_code == 0, r.output
    study = load_study("q")
    assert len({t.params["sparsifiner.attn_keep_ratio"] for t in study.trials}) == 3
    r = invoke("search", "tokens", tiny_run, "--study", "q2", "--space", "joint.yaml", "--sampler", "qmc")
    assert r.exit_code == 1 and "sampler qmc needs a space without conditional parameters" in r.output
    assert "sparsifiner.attn_keep_ratio (methods[0].params.attn_keep_ratio) exists only when sparsifiner.on" in r.output
    assert "q2" not in optuna.get_all_study_names(f"sqlite:///{project / 'nascompress-studies.db'}")


DCS_TOKENS_SPACE = """
format: nascompress-space/1
name: tiny-dcs-tokens
methods:
  - name: dcs
    params:
      target_flops: {kind: categorical, choices: [0.8]}
      qk_mask: static
      max_val_drop: 100
  - name: dynamicvit
    params:
      prune_layers: [2]
      rho: {kind: float, low: 0.5, high: 0.9, step: 0.2}
"""


def test_a_dcs_stage_is_searched_once_per_worker_and_reused(project, tiny_run):
    """Trials with the same DCS settings reuse the worker's first search (the study's seed); the later
    stages start from the same random state either way, so a reused trial rebuilds exactly."""
    (project / "dt.yaml").write_text(DCS_TOKENS_SPACE)
    r = invoke(
        "search", "joint", tiny_run, "--study", "dt", "--space", "dt.yaml", "--trials", 3, "--no-enqueue", *SMALL
    )
    assert r.exit_code == 0, r.output
    done = [t for t in load_study("dt").trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 3
    dcs = [t.user_attrs["nascompress_training"]["dcs"] for t in done]
    assert [d["reused"] for d in dcs] == [False, True, True] and len({d["seed"] for d in dcs}) == 1
    assert all(t.user_attrs["nascompress"]["scoring"]["dcs_seed"] == dcs[0]["seed"] for t in done)
    channels = [t.user_attrs["nascompress"]["arch"][0]["blocks"] for t in done]
    assert channels[1] == channels[0] == channels[2]
    # a reused trial (a fresh worker searches again) scores what the study recorded
    trial = done[-1]
    r = invoke("materialize", "--study", "dt", "--trial", trial.number, "--out", project / "mat", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["rebuilt_accuracy"] == trial.user_attrs["nascompress"]["accuracy"]


def test_a_reused_dcs_stage_builds_the_same_trial_as_a_fresh_search(project, tiny_run):
    """Same records and seed: the second build reuses the memo's channels and its DynamicViT predictors
    (initialised from the random state after the DCS stage) come out bit-identical."""
    from nascompress.studies.trial_build import build_trial
    from nascompress.studies.trials import SearchJob
    from nascompress.studies.trial_context import TrialContext

    (project / "dt.yaml").write_text(DCS_TOKENS_SPACE)
    ctx = TrialContext(
        SearchJob(
            base=str(tiny_run),
            space="dt.yaml",
            study="x",
            eval_images=60,
            train_images=60,
            calib_steps=3,
            batch_size=30,
        )
    )
    records = ctx.space.records({"dcs.target_flops": 0.8, "dynamicvit.rho": 0.7})
    built = [build_trial(ctx, records, seed=5, dcs_seed=0) for _ in range(2)]
    assert [b.training["dcs"]["reused"] for b in built] == [False, True] and [b.dcs_seed for b in built] == [0, 0]
    first, second = (b.model.state_dict() for b in built)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert built[0].applied == built[1].applied


def test_a_dcs_target_of_1_is_no_channel_cut(project, tiny_run):
    """The DCS target is a study parameter from 1.0 (the channels stay: a token-only model, no search) down:
    a trial at 1.0 builds the dense base with its token method, and records why."""
    from nascompress.studies.trial_build import build_trial
    from nascompress.studies.trials import SearchJob
    from nascompress.studies.trial_context import TrialContext

    (project / "dt.yaml").write_text(DCS_TOKENS_SPACE.replace("choices: [0.8]", "choices: [0.8, 1.0]"))
    ctx = TrialContext(
        SearchJob(
            base=str(tiny_run),
            space="dt.yaml",
            study="x",
            eval_images=60,
            train_images=60,
            calib_steps=3,
            batch_size=30,
        )
    )
    built = build_trial(ctx, ctx.space.records({"dcs.target_flops": 1.0, "dynamicvit.rho": 0.7}), seed=5, dcs_seed=0)
    model = built.model
    assert [r["name"] for r in built.applied] == ["dynamicvit"] and "skipped" in built.training["dcs"]
    assert built.dcs_seed is None
    assert not ctx.dcs_memo  # no search ran
    x = torch.randn(2, 1, 16, 16, device=model.patch_embed.proj.weight.device)  # the job's device (TORCH_DEVICE)
    assert model.patch_embed.proj.weight.shape == ctx.base.patch_embed.proj.weight.shape
    assert all(b.mlp.fc1.out_features == c.mlp.fc1.out_features for b, c in zip(model.blocks, ctx.base.blocks))
    assert model.eval()(x).shape == (2, 10)
