"""A DCS search that collapses with the paper's settings on a pretrained-like model is recovered by the
mechanisms for pretrained models (the family probe, mean fill, distillation, the progressive target)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from nascompress.data import DataConfig
from nascompress.runs.io import finish_run, load_with_arch, save_model
from nascompress.models.build import build_model, custom_vit_spec
from nascompress.train.config import TrainConfig
from nascompress.train.run import TrainJob, train

from .conftest import invoke

SPEC = dict(img_size=16, patch_size=4, embed_dim=32, depth=3, num_heads=2, num_classes=10, in_chans=1)
# the paper's search: residual gates, CE on the architecture steps, the target at once, no distillation,
# no protection, weight-magnitude order, no fill
PAPER = [
    "--mlp-gates",
    "residual",
    "--arch-loss",
    "ce",
    "--target-ramp",
    0,
    "--protect-ratio",
    0,
    "--no-block-weights",
    "--distill",
    0,
    "--feat-distill",
    0,
    "--init-importance",
    "weight",
    "--hidden-fill",
    "zero",
]


@pytest.fixture(scope="module")
def pretrained_like(tmp_path_factory):
    """A trained model with the redundancy of a pretrained one: a small ViT trained to (near) 100%,
    widened to twice the MLP hidden width with idle neurons (fc1 bias -10: GELU ~ 0), which leaves
    its function unchanged. Every residual channel carries what it learned; half its hidden neurons
    carry nothing."""
    d = tmp_path_factory.mktemp("pretrained_like")
    spec = custom_vit_spec(**SPEC)
    train(
        TrainJob(
            model=spec,
            data=DataConfig(dataset="synthetic"),
            out=str(d / "small"),
            train=TrainConfig(epochs=6, batch_size=32, lr=2e-3, seed=0),
        )
    )
    small, arch = load_with_arch(d / "small")
    wide_spec = custom_vit_spec(**SPEC, mlp_ratio=8.0)
    wide = build_model(wide_spec)
    sd = wide.state_dict()
    with torch.no_grad():
        for k, v in small.state_dict().items():
            if "mlp.fc1" in k:
                sd[k].zero_()[: v.shape[0]] = v
                if k.endswith("bias"):
                    sd[k][v.shape[0] :] = -10.0
            elif "mlp.fc2.weight" in k:
                sd[k].zero_()[:, : v.shape[1]] = v
            else:
                sd[k].copy_(v)
    wide.load_state_dict(sd)
    x = torch.randn(4, 1, 16, 16)
    torch.testing.assert_close(wide.eval()(x), small.eval()(x))
    save_model(d / "base", wide, dict(arch, model=wide_spec.to_dict()))
    shutil.copy(d / "small" / "config.json", d / "base" / "config.json")
    finish_run(d / "base", json.loads((d / "small" / "metrics.json").read_text()))  # a finished run, of its own files
    return d / "base"


def search(base, out, *extra):
    return invoke(
        "search",
        "dcs",
        base,
        "--out",
        out,
        "--epochs",
        2,
        "--train-limit",
        480,
        "--eval-limit",
        200,
        "--device",
        "cpu",
        "--target-flops",
        0.45,
        "--max-val-drop",
        5,
        "--json",
        *extra,
    )


# the former weight recipe of the search: a pretrained-safe lr (1e-4 per 512 images) with layer decay 0.75,
# which leaves the weights all but frozen while the gates close channels
FROZEN = ["--base-lr", 1e-4, "--layer-decay", 0.75]


def test_a_dip_that_recovers_is_not_stopped(pretrained_like, tmp_path):
    """The issue's symptom on data the repo has: the paper's search with frozen-ish weights cuts to 0.45x
    at once and dips 100% -> 93.3% after epoch 1, then recovers to 100% in epoch 2. The former guard judged
    epoch 1 (at the target by its end) by --max-val-drop 5 and stopped a search about to recover; an epoch
    that did not start at the target is not judged."""
    r = search(pretrained_like, tmp_path / "paper", *PAPER, *FROZEN, "--no-baseline")
    assert r.exit_code == 0, r.output
    log = [json.loads(ln) for ln in (tmp_path / "paper" / "log.jsonl").read_text().splitlines()]
    assert log[0]["val_top1"] - log[1]["val_top1"] > 5  # the dip the former guard stopped at
    assert log[2]["val_top1"] > log[1]["val_top1"] and log[1]["target_now"] == pytest.approx(0.45)
    m = json.loads((tmp_path / "paper" / "metrics.json").read_text())
    assert m["stopped"] is None and m["dense_val_top1"] - m["val_top1"] <= 5


def test_collapsing_search_is_recovered_by_the_pretrained_mechanisms(pretrained_like, tmp_path):
    # weights that train at the search's default lr follow the cut, even under the paper's settings
    r = search(pretrained_like, tmp_path / "paper_lr", *PAPER)
    assert r.exit_code == 0, r.output
    r = search(pretrained_like, tmp_path / "default")
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "default" / "metrics.json").read_text())
    assert m["mlp_gates"] == "hidden" and m["family_kl"]["hidden"] < m["family_kl"]["residual"]
    assert abs(m["flops_ratio"] / 0.45 - 1) <= 0.05
    assert m["dense_val_top1"] - m["val_top1"] <= 2.0  # the model survives the search
    log = [json.loads(ln) for ln in (tmp_path / "default" / "log.jsonl").read_text().splitlines()]
    assert log[1]["target_now"] < 1.0 and log[-1]["target_now"] == pytest.approx(0.45)  # the moving target
    assert "train_feat_w" in log[1] and "train_kl_a" in log[1]  # distillation on both kinds of step
    # the search reaches its target while it trains (the projection), so the end-of-search guard moves
    # nothing untrained: a calibration move above 0.02 fails this test
    assert m["budget"] == "project" and m["calibration_move"] <= 0.02
    assert m["at_target_share"] >= 0.4 and m["projections"] > 0
    assert abs(log[-1]["flops_ratio"] / 0.45 - 1) <= 0.05 and abs(log[-2]["flops_ratio"] / 0.45 - 1) <= 0.05


def test_an_off_target_search_is_a_failed_search_not_an_untrained_cut(pretrained_like, tmp_path):
    # gates that barely move (tiny arch lr) and no projection: the search ends far above its target; the
    # guard refuses the large untrained threshold shift instead of applying it
    r = search(
        pretrained_like,
        tmp_path / "steer",
        "--budget",
        "steer",
        "--arch-lr",
        1e-5,
        "--max-val-drop",
        100,
        "--no-baseline",
    )
    assert r.exit_code == 1
    assert "untrained cut" in r.output and "--max-calibration 0.02" in r.output
    assert not (tmp_path / "steer" / "metrics.json").exists()  # not a finished search
    # the same with a guard that allows the cut: applied and reported
    r = search(
        pretrained_like,
        tmp_path / "allowed",
        "--budget",
        "steer",
        "--arch-lr",
        1e-5,
        "--max-val-drop",
        100,
        "--max-calibration",
        1,
    )
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "allowed" / "metrics.json").read_text())
    assert m["calibrated"] and m["calibration_move"] > 0.02 and abs(m["flops_ratio"] / 0.45 - 1) <= 0.05
