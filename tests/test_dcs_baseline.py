"""The baseline inside the DCS search: a search that falls apart ends with the magnitude-pruned model
(exit 0, the reason recorded, reproducible from the seed); every piece of advice the search gives runs
as written; the magnitude rule itself."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from types import SimpleNamespace

import pytest
import torch

from nascompress.dcs_search.metrics import DCSMetrics
from nascompress.runs.io import load_with_arch

from .conftest import invoke

# a search whose weights blow up (lr 1.0) and whose guard stops it after epoch 1, mid-ramp (off target)
# the target at once (--target-ramp 0: epoch 1, in which it arrives, is not judged) and a learning rate
# that wrecks the weights: epoch 2 runs at the target from its start, far below the dense model, and stops
COLLAPSE = ["--lr", 1.0, "--max-val-drop", 1, "--distill", 0, "--target-flops", 0.6, "--target-ramp", 0, "--epochs", 4]


def search_args(run, out, *extra):
    return [
        "search",
        "dcs",
        run,
        "--out",
        out,
        "--epochs",
        2,
        "--batch-size",
        32,
        "--arch-lr",
        0.05,
        "--device",
        "cpu",
        "--align",
        1,
        "--recovery-images",
        64,
        *extra,
    ]


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_collapsing_search_ends_with_a_model_not_an_error(tiny_run, tmp_path):
    """A search the guard stops (at its target) ends like a finished one: the better of it and the
    magnitude baseline after the same recovery, exit 0, the advice to go on printed and working."""
    out = tmp_path / "c"
    res = invoke(*search_args(tiny_run, out, *COLLAPSE))
    assert res.exit_code == 0, res.output
    assert "--resume --max-val-drop 100" in res.output  # how to let the gates go on instead
    m = json.loads((out / "metrics.json").read_text())
    stop = m["stopped"]["epoch"]
    assert stop >= 2 and f"the gate search stopped after epoch {stop}" in m["stopped"]["reason"]
    cmp = m["comparison"]
    assert cmp["dcs"]["eligible"] and cmp["magnitude"]["eligible"]  # stopped at its target: it competes
    best = max(("dcs", "magnitude"), key=lambda k: (cmp[k]["val_top1"], k == "dcs"))  # ties: the searched model
    assert m["kept"] == best and cmp[best]["val_top1"] == m["val_top1"] and "kept: kept the" in res.output
    assert abs(m["flops_ratio"] / 0.6 - 1) <= 0.05 and m["mlp_gates"] == "hidden" and m["test_n"] > 0
    assert cmp["recovery"]["steps"] == 2
    typed = DCSMetrics.from_dict(m, source="metrics.json")  # the file typed: the same keys in the same order
    assert typed.to_dict() == m and list(typed.to_dict()) == list(m)
    assert typed.stopped.epoch == stop and typed.stopped.reason == m["stopped"]["reason"]
    assert typed.stopped.extra["continue"] == m["stopped"]["continue"]  # how the run directory goes on
    assert typed.kept == typed.comparison.kept == best and typed.comparison.margin_pt == cmp["margin_pt"]
    # the kept model is the run's model: materialize gathers it and reproduces it
    mat = tmp_path / "mat"
    res = invoke("materialize", out, "--out", mat, "--json")
    assert res.exit_code == 0, res.output
    assert abs(json.loads(res.output)["flops_ratio_vs_dense"] / 0.6 - 1) <= 0.05
    # reproducible from the seed: the same command gives the same weights and the same choice
    again = tmp_path / "again"
    assert invoke(*search_args(tiny_run, again, *COLLAPSE)).exit_code == 0
    assert sha(again / "model.safetensors") == sha(out / "model.safetensors")
    assert json.loads((again / "metrics.json").read_text())["comparison"] == cmp

    # the advice it printed, run as written: the gates go on from the epoch they stopped at
    res = invoke(*search_args(tiny_run, out, *COLLAPSE), "--resume", "--max-val-drop", 100)
    assert res.exit_code == 0, res.output
    m2 = json.loads((out / "metrics.json").read_text())
    assert m2["stopped"] is None
    log = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [0, 1, 2, 3, 4]  # the epochs up to the stop kept, the rest added
    assert m2["kept"] in ("dcs", "magnitude") and m2["comparison"]["dcs"]["eligible"]


def test_without_the_baseline_a_collapse_is_an_error_whose_advice_runs(tiny_run, tmp_path):
    out = tmp_path / "c"
    res = invoke(*search_args(tiny_run, out, *COLLAPSE, "--no-baseline"))
    assert res.exit_code == 1
    assert "the gate search stopped after epoch" in res.output
    assert "rerun the same command with --resume --max-val-drop 100" in res.output
    assert not (out / "metrics.json").exists()
    res = invoke(*search_args(tiny_run, out, *COLLAPSE, "--no-baseline"), "--resume", "--max-val-drop", 100)
    assert res.exit_code == 0, res.output
    m = json.loads((out / "metrics.json").read_text())
    epochs = [json.loads(ln)["epoch"] for ln in (out / "log.jsonl").read_text().splitlines()]
    assert m["kept"] == "dcs" and epochs == [0, 1, 2, 3, 4]


def test_other_changed_settings_are_still_refused_on_resume(tiny_run, tmp_path):
    out = tmp_path / "c"
    assert invoke(*search_args(tiny_run, out, *COLLAPSE)).exit_code == 0
    res = invoke(*search_args(tiny_run, out, *COLLAPSE), "--resume", "--max-val-drop", 100, "--lam", 0.3)
    assert res.exit_code == 1 and "search.lam 0.3 (recorded 0.2)" in res.output


def test_an_off_target_search_advice_runs_as_written(tiny_run, tmp_path):
    """Gates that barely move and no projection end far above the target; the advice (the projection)
    lands it."""
    args = ["--target-flops", 0.5, "--budget", "steer", "--arch-lr", 1e-5, "--max-val-drop", 100, "--no-baseline"]
    out = tmp_path / "o"
    res = invoke(*search_args(tiny_run, out, *args))
    assert res.exit_code == 1 and "untrained cut" in res.output
    assert "rerun the same command with --force --budget project" in res.output
    res = invoke(*search_args(tiny_run, out, *args), "--force", "--budget", "project")
    assert res.exit_code == 0, res.output
    assert abs(json.loads((out / "metrics.json").read_text())["flops_ratio"] / 0.5 - 1) <= 0.05
    # with the baseline (the default) the same off-target search ends with the baseline's model, exit 0
    res = invoke(*search_args(tiny_run, tmp_path / "b", *args[:-1]))
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert m["kept"] == "magnitude" and "outside 0.5" in m["comparison"]["reason"]


def test_the_magnitude_rule_is_global_and_lands_on_the_target(tiny_run):
    from nascompress.dcs_search.magnitude import magnitude_scores
    from nascompress.dcs_search.baseline import magnitude_supernet
    from nascompress.methods.dcs import materialize
    from nascompress.methods.dcs_supernet import selection
    from nascompress.profiling import count_flops

    dense, _ = load_with_arch(tiny_run)
    dense.eval()
    x = torch.zeros(1, 1, 16, 16)
    sn, cfg, cost, info = magnitude_supernet(copy.deepcopy(dense), target=0.8, align=1, fill=None, x1=x)
    assert abs(info.flops_ratio / 0.8 - 1) <= 0.02
    # one threshold over every block, on mean-normalized scores: a kept neuron never scores below a closed one
    scores = magnitude_scores(dense)
    kept = [set(b["hidden_keep"]) for b in selection(sn)]
    lo_kept = min(float(s[i]) for s, k in zip(scores, kept) for i in k)
    hi_closed = max((float(s[i]) for s, k in zip(scores, kept) for i in range(s.numel()) if i not in k), default=0.0)
    assert hi_closed <= lo_kept
    assert [len(k) for k in kept] == info.hidden_kept
    model, _ = materialize(sn, cfg)
    xs = torch.randn(4, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(xs), sn.eval()(xs), rtol=1e-4, atol=1e-5)  # materialized = supernet
    assert count_flops(model, x).total / count_flops(dense, x).total == pytest.approx(info.flops_ratio, rel=1e-6)


def test_the_guard_lets_a_search_recover_after_its_ramp():
    """The user's run of the issue (DINOv2 ViT-S/14 probe at 0.6x, 2,000 images, 4 epochs, ramp 0.5):
    92.0% -> 64.6 (target moving) / 63.2 (the target reached at the epoch's end) / 77.3 / 89.1. The former
    guard stopped it after epoch 2 (at the target, 28.8 > 15); an epoch that did not start at the target is
    not judged (the digits probe fell 98.5 -> 59.3% in epoch 1: twice the limit stopped it there), and one at
    the target only when validation is not rising."""
    from nascompress.dcs_search.search_config import DCSSearchConfig
    from nascompress.dcs_search.hooks import DCSSearchHooks, SearchCollapsed

    def hooks(**cfg):
        return SimpleNamespace(cfg=DCSSearchConfig(**cfg), epochs=4, log=[])

    h = hooks(target_flops=0.6)
    start = {"epoch": 0, "start": True, "val_top1": 92.0}
    h.log.append(start)
    for rec in (
        {"epoch": 1, "val_top1": 64.6, "target_now": 0.8},
        {"epoch": 2, "val_top1": 63.2, "target_now": 0.6},
        {"epoch": 3, "val_top1": 77.3, "target_now": 0.6},
        {"epoch": 4, "val_top1": 89.1, "target_now": 0.6},
    ):
        h.log.append(rec)
        DCSSearchHooks.check(h, rec, start)  # never stops
    # at the target for a whole epoch, 15+ points down and not rising: stopped
    h.log[-1] = {"epoch": 4, "val_top1": 70.0, "target_now": 0.6}
    with pytest.raises(SearchCollapsed, match="more than max_val_drop 15 points, and not rising"):
        DCSSearchHooks.check(h, h.log[-1], start)
    # while the architecture still moves, and in the epoch where it arrives: not judged, however deep the dip
    h = hooks(target_flops=0.6)
    h.log += [start, {"epoch": 1, "val_top1": 10.0, "target_now": 0.8}]
    DCSSearchHooks.check(h, h.log[-1], start)
    h.log.append({"epoch": 2, "val_top1": 9.0, "target_now": 0.6})
    DCSSearchHooks.check(h, h.log[-1], start)
    h.log.append({"epoch": 3, "val_top1": 8.0, "target_now": 0.6})  # a whole epoch at the target: judged
    with pytest.raises(SearchCollapsed, match="more than max_val_drop 15 points, and not rising"):
        DCSSearchHooks.check(h, h.log[-1], start)
    h = hooks(target_flops=None)  # no target, no ramp: the limit itself
    h.log += [start, {"epoch": 1, "val_top1": 65.0}]
    with pytest.raises(SearchCollapsed, match="more than max_val_drop 15 points"):
        DCSSearchHooks.check(h, h.log[-1], start)


def test_library_search_keeps_the_better_model_in_memory(tiny_run):
    """``run_dcs_search`` (what study trials call) returns the kept supernet and a job whose method
    materializes it."""
    from nascompress.data import DataConfig, InputSpec, load_data
    from nascompress.methods.dcs import DCSConfig, materialize
    from nascompress.dcs_search.search_config import DCSSearchConfig, DCSSearchJob, search_train_config
    from nascompress.dcs_search.search import run_dcs_search

    dense, arch = load_with_arch(tiny_run)
    data = load_data(DataConfig(dataset="synthetic"), spec=InputSpec.from_dict(arch["input"]))
    job = DCSSearchJob(
        source=str(tiny_run),
        out="",
        method=DCSConfig(),  # the residual gates
        # gates that barely move and no projection: the search ends off its target, the baseline is kept
        search=DCSSearchConfig(
            target_flops=0.5,
            budget="steer",
            max_val_drop=100,
            distill=0,
            arch_lr=1e-5,
            recovery_images=64,
            auto_batch=False,
        ),
        train=search_train_config(epochs=2, batch_size=32, device="cpu"),
    )
    res = run_dcs_search(job, dense.requires_grad_(True), arch, data)
    assert res.metrics.kept == "magnitude" and res.job.method.mlp_gates == "hidden"
    assert res.metrics.comparison.kept == "magnitude" and "outside 0.5" in res.metrics.comparison.reason
    model, _ = materialize(res.supernet, res.job.method)
    assert abs(res.metrics.flops_ratio / 0.5 - 1) <= 0.05 and model is not None


def test_a_kill_after_the_guard_stopped_the_gates_resumes_to_the_same_end(tiny_run, tmp_path, monkeypatch):
    """A kill -9 between the guard's stop and the run's end (the comparison): a plain --resume ends as the
    uninterrupted run did (the last recorded epoch is judged again), not by training the gates on."""
    from nascompress.dcs_search import baseline as dcs_baseline

    ref = tmp_path / "ref"
    assert invoke(*search_args(tiny_run, ref, *COLLAPSE)).exit_code == 0
    out = tmp_path / "c"

    def killed(*a, **k):
        raise KeyboardInterrupt  # stands for the kill: the process dies in the comparison

    real = dcs_baseline.choose
    monkeypatch.setattr(dcs_baseline, "choose", killed)
    assert invoke(*search_args(tiny_run, out, *COLLAPSE)).exit_code != 0
    assert not (out / "metrics.json").exists()
    monkeypatch.setattr(dcs_baseline, "choose", real)
    res = invoke(*search_args(tiny_run, out, *COLLAPSE), "--resume")
    assert res.exit_code == 0, res.output
    assert sha(out / "model.safetensors") == sha(ref / "model.safetensors")
    log = [json.loads(ln)["epoch"] for ln in (out / "log.jsonl").read_text().splitlines()]
    stop = json.loads((ref / "metrics.json").read_text())["stopped"]["epoch"]
    assert log == list(range(stop + 1)) and json.loads((out / "metrics.json").read_text())["stopped"]["epoch"] == stop


def test_a_recovery_that_costs_the_searched_model_is_undone(tiny_run):
    """The recovery is for the comparison; a candidate whose validation it lowered competes, and is kept,
    with its state from before (the kept model is never worse than the search's end)."""
    from nascompress.data import DataConfig, InputSpec, load_data
    from nascompress.methods.dcs import DCSConfig, make_supernet
    from nascompress.dcs_search.baseline import Candidate, Recovery, choose
    from nascompress.dcs_search.cost import CostModel
    from nascompress.profiling.records import Evaluation

    dense, arch = load_with_arch(tiny_run)
    dense.eval()
    spec = InputSpec.from_dict(arch["input"])
    data = load_data(DataConfig(dataset="synthetic", train_limit=64, eval_limit=64), spec=spec)
    sn = make_supernet(copy.deepcopy(dense), DCSConfig(mlp_gates="hidden", qk_mask="static", align=1))
    cost = CostModel.build(dense, sn, torch.zeros(1, 1, 16, 16))
    before = {k: v.clone() for k, v in sn.state_dict().items()}
    pre = Evaluation.new(top1=100.0, loss=0.0, n=64)
    c = Candidate("dcs", sn, DCSConfig(mlp_gates="hidden", align=1), 1.0, cost, pre_eval=pre)
    rec = Recovery(steps=4, batch_size=16, lr=5.0, seed=0, distill=0.0, feat_distill=0.0)  # an lr that breaks it
    kept, record = choose([c], dense, data, spec, rec, torch.device("cpu"), eval_batch_size=64)
    assert kept is c and record.dcs.state == "before recovery" and record.dcs.val_recovered < 100.0
    assert record.kept == "dcs" and record.margin_pt is None and record.recovery.images == 4 * 16
    assert kept.val_top1 == 100.0 and all(torch.equal(v, before[k]) for k, v in sn.state_dict().items())


@pytest.mark.parametrize("feat_distill", [0.0, 0.5])
def test_the_recovery_reads_the_searchs_teacher_cache(tiny_run, feat_distill):
    """The recovery of a candidate reads the dense model's outputs from the search's cache (no teacher
    forward) and trains as the recovery that runs the teacher does: the same batches, the same targets."""
    from nascompress.data import DataConfig, InputSpec, load_data
    from nascompress.methods.dcs import DCSConfig, make_supernet
    from nascompress.dcs_search.baseline import Recovery, recover
    from nascompress.dcs_search.teacher import TeacherCache

    dense, arch = load_with_arch(tiny_run)
    dense.eval().requires_grad_(False)
    spec = InputSpec.from_dict(arch["input"])
    data = load_data(DataConfig(dataset="synthetic", train_limit=64, eval_limit=32), spec=spec)
    cpu = torch.device("cpu")
    cache = TeacherCache.build(dense, data.train, spec, device=cpu, feat=feat_distill > 0)
    rec = Recovery(steps=6, batch_size=16, lr=1e-3, seed=0, distill=1.0, feat_distill=feat_distill)
    sn = make_supernet(copy.deepcopy(dense), DCSConfig(mlp_gates="hidden", qk_mask="static", align=1))
    models, calls = [], []
    dense.register_forward_hook(lambda *a: calls.append(1))
    for teacher in (None, cache):
        m = copy.deepcopy(sn)
        calls.clear()
        torch.manual_seed(0)
        logs = recover(m, dense, data, spec, rec, cpu, teacher)
        models.append(m)
        assert logs.kl > 0 and (feat_distill == 0 or logs.feat > 0) and logs.steps == rec.steps
        assert len(calls) == (rec.steps if teacher is None else 0)
    for (k, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=k)
    assert any(not torch.equal(a, b) for a, b in zip(models[0].state_dict().values(), sn.state_dict().values()))


def test_without_a_test_split_the_kept_models_validation_is_its_test(tiny_run, tmp_path, monkeypatch):
    """Where the test split is the validation split (an ImageFolder with val/ only), the kept model's
    test figures are its validation figures of the comparison, not a second pass over the same images."""
    from nascompress.data import DataConfig, InputSpec, load_data
    from nascompress.dcs_search import search as dcs_search_mod
    from nascompress.methods.dcs import DCSConfig
    from nascompress.dcs_search.search_config import DCSSearchConfig, DCSSearchJob, search_train_config
    from nascompress.dcs_search.search import run_dcs_search

    dense, arch = load_with_arch(tiny_run)
    data = load_data(
        DataConfig(dataset="synthetic", train_limit=64, eval_limit=32), spec=InputSpec.from_dict(arch["input"])
    )
    data = dataclasses.replace(data, test=data.val)  # as load_data gives an ImageFolder with no test/
    assert data.test is data.val
    job = DCSSearchJob(
        source=str(tiny_run),
        out="",
        method=DCSConfig(mlp_gates="hidden", align=1),
        search=DCSSearchConfig(target_flops=0.7, target_ramp=0, arch_lr=0.05, recovery_images=32, auto_batch=False),
        train=search_train_config(epochs=2, batch_size=16, device="cpu"),
    )
    passes = []
    real = dcs_search_mod.evaluate
    monkeypatch.setattr(dcs_search_mod, "evaluate", lambda *a, **k: passes.append(1) or real(*a, **k))
    res = run_dcs_search(job, dense.requires_grad_(True), arch, data)
    kept = getattr(res.metrics.comparison, res.metrics.kept)  # the kept candidate's record
    assert not passes  # recovered: the comparison's validation; before the recovery: the search's last one
    assert res.metrics.test_top1 == kept.val_top1 and res.metrics.get("test_n") == 32
