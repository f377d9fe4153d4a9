"""``nascompress retrain``: IB hooks on the shared fit loop, the CLI, the shipped model, bad input."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import asdict, replace

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import nascompress
from nascompress.data import DataConfig, load_data
from nascompress.errors import NascompressError
from nascompress.train.hooks import as_floats
from nascompress.runs.io import make_arch, save_model
from nascompress.models.build import build_model, custom_vit_spec
from nascompress.train.distill import FeatureTap
from nascompress.dcs_search.ib_hooks import IBHooks, make_input_embed
from nascompress.retraining.config import RetrainConfig
from nascompress.retraining.metrics import RetrainMetrics
from nascompress.retraining.run import RetrainJob, bound_contribution, retrain
from nascompress.train.config import TrainConfig
from nascompress.train.run import input_spec_for

from .conftest import TORCH_DEVICE, interrupted_at_epoch, tiny_spec


# a compression record whose method changes nothing (EViT at keep rate 1): retrain needs a compressed model
NOOP = {"name": "evit", "config": {"keep_rate": 1.0}}


SMALL = DataConfig(dataset="synthetic", train_limit=128, eval_limit=64)


def make_model_dir(path, *, methods=(NOOP,), num_classes: int = 10, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(tiny_spec(num_classes))
    arch = make_arch(
        tiny_spec(num_classes),
        input_spec=input_spec_for(model, "synthetic").to_dict(),
        methods=[dict(m) for m in methods],
    )
    save_model(path, model, arch)
    (path / "config.json").write_text(json.dumps({"data": asdict(SMALL)}))
    return path


def quick_job(model_dir, out, **rc):
    return RetrainJob(
        model_dir=str(model_dir),
        out=str(out),
        train=TrainConfig(
            epochs=2,
            batch_size=64,
            lr=1e-3,
            warmup_epochs=0.0,
            seed=0,
            device=TORCH_DEVICE,
            deterministic=TORCH_DEVICE.startswith("cuda"),
        ),
        retrain=RetrainConfig(**{"eta": 50.0, "warmup_frac": 0.5, **rc}),
        auto_batch=False,
    )


def test_feature_tap_is_timm_pre_logits_and_changes_nothing():
    """Identity: tapping leaves the output equal to plain timm, and the tap is forward_head(pre_logits=True)."""
    torch.manual_seed(0)
    model = build_model(tiny_spec()).eval()
    x = torch.randn(3, 1, 16, 16)
    ref = model(x)
    pre = model.forward_head(model.forward_features(x), pre_logits=True)
    tap = FeatureTap(model, "pre_logits")
    torch.testing.assert_close(model(x), ref, rtol=0, atol=0)
    torch.testing.assert_close(tap.pop(), pre, rtol=0, atol=0)
    tap.remove()
    tap = FeatureTap(model, "module:blocks.1")  # token output (B, N, C) -> token mean (B, C)
    model(x)
    torch.testing.assert_close(tap.pop(), model.blocks(model._pos_embed(model.patch_embed(x))).mean(1))
    with pytest.raises(NascompressError, match="no such submodule"):
        FeatureTap(model, "module:nope")


def test_hooks_ce_during_warmup_then_ce_plus_eta_ibb():
    data = load_data(SMALL, img_size=(16, 16))
    torch.manual_seed(0)
    model = build_model(tiny_spec())
    spec = input_spec_for(model, "synthetic")
    cfg = RetrainConfig(eta=50.0, warmup_frac=0.5)
    hooks = IBHooks(
        cfg,
        train_set=data.train,
        input_spec=spec,
        num_classes=10,
        epochs=4,
        input_embed=make_input_embed(cfg, model=model, teacher=None),
        seed=0,
    )
    assert hooks.warm == 2
    hooks.on_epoch_start(model, epoch=0)  # initial K-means of X~ and X, Q^{(0)}
    assert hooks.q.shape == (10, 10) and hooks.c_in.shape == (10, 49) and hooks.c_feat.shape == (10, 32)
    assert torch.allclose(hooks.q.sum(1), torch.ones(10))
    assert set(hooks.initial) >= {"ib", "i_xt_x", "i_xt_y", "kmeans_s", "feature_pass_s"}
    imgs, y = data.train.__getitems__(list(range(32)))
    from nascompress.data import preprocess

    x = preprocess(imgs, spec)
    tc = TrainConfig(epochs=5, lr=None, label_smoothing=0.0)
    warm_loss, warm_logs = hooks.loss(model.train(), x, y, epoch=1, cfg=tc)
    warm_logs = as_floats(warm_logs)  # logs stay on the device; fit reads them back once per epoch
    assert warm_loss.item() == pytest.approx(warm_logs["ce"], rel=1e-6) and "ibb" in warm_logs
    loss, logs = hooks.loss(model, x, y, epoch=2, cfg=tc)
    logs = as_floats(logs)
    assert loss.item() == pytest.approx(logs["ce"] + 50.0 * logs["ibb"], rel=1e-5)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # eta = 0 with log_ib: CE only in every epoch, IBB still logged
    hooks0 = IBHooks(
        replace(cfg, eta=0.0, log_ib=True),
        train_set=data.train,
        input_spec=spec,
        num_classes=10,
        epochs=4,
        input_embed=make_input_embed(cfg, model=model, teacher=None),
    )
    hooks0.on_epoch_start(model, epoch=0)
    loss0, logs0 = hooks0.loss(model, x, y, epoch=3, cfg=tc)
    logs0 = as_floats(logs0)
    assert loss0.item() == pytest.approx(logs0["ce"], rel=1e-6) and "ibb" in logs0
    # eta = 0 by default: no clustering pass at all (a CE-only retrain pays nothing for IB)
    hooks_off = IBHooks(
        replace(cfg, eta=0.0),
        train_set=data.train,
        input_spec=spec,
        num_classes=10,
        epochs=4,
        input_embed=make_input_embed(cfg, model=model, teacher=None),
    )
    hooks_off.on_epoch_start(model, epoch=0)
    assert hooks_off.c_feat is None and hooks_off.on_epoch_end(model, epoch=0) == {"ib_active": False}
    loss_off, logs_off = hooks_off.loss(model, x, y, epoch=3, cfg=tc)
    logs_off = as_floats(logs_off)
    assert loss_off.item() == pytest.approx(logs_off["ce"], rel=1e-6) and "ibb" not in logs_off
    # a linear schedule ramps the weight over the epochs after the warm-up: 25 in epoch 2, 50 in epoch 3
    ramp = IBHooks(
        replace(cfg, eta_schedule="linear"),
        train_set=data.train,
        input_spec=spec,
        num_classes=10,
        epochs=4,
        input_embed=make_input_embed(cfg, model=model, teacher=None),
    )
    ramp.on_epoch_start(model, epoch=0)
    for epoch, eta in ((1, 0.0), (2, 25.0), (3, 50.0)):
        loss_r, logs_r = ramp.loss(model, x, y, epoch=epoch, cfg=tc)
        logs_r = as_floats(logs_r)
        assert loss_r.item() == pytest.approx(logs_r["ce"] + eta * logs_r["ibb"], rel=1e-5)
        assert ramp.on_epoch_end(model, epoch=epoch)["eta_now"] == eta


@pytest.mark.parametrize(
    "schedule, warmup, epochs, expect",
    [
        ("step", 0.3, 3, [0, 50, 50]),
        ("linear", 0.3, 3, [0, 25, 50]),
        ("linear", 0.0, 4, [12.5, 25, 37.5, 50]),
        ("linear", 0.0, 1, [50]),
        ("step", 0.9, 2, [0, 50]),
    ],
)
def test_eta_schedule(schedule, warmup, epochs, expect):
    cfg = RetrainConfig(eta=50.0, warmup_frac=warmup, eta_schedule=schedule)
    assert [cfg.eta_at(e, epochs) for e in range(epochs)] == expect
    assert [RetrainConfig(eta=0.0, eta_schedule=schedule).eta_at(e, epochs) for e in range(epochs)] == [0] * epochs
    with pytest.raises(NascompressError, match="eta_schedule|eta-schedule"):
        RetrainConfig(eta_schedule="cosine")


def test_feature_distillation_matches_the_teachers_pre_logits():
    """feat_kd adds weight x mean ||s - t||^2 / ||t||^2 on the tapped feature; zero against itself."""
    data = load_data(SMALL, img_size=(16, 16))
    torch.manual_seed(0)
    model = build_model(tiny_spec())
    spec = input_spec_for(model, "synthetic")
    imgs, y = data.train.__getitems__(list(range(16)))
    from nascompress.data import preprocess

    x, tc = preprocess(imgs, spec), TrainConfig(epochs=5, lr=None, label_smoothing=0.0)
    cfg = RetrainConfig(eta=0.0, kd_alpha=0.5, feat_kd=2.0)

    def hooks_with(teacher):
        return IBHooks(
            cfg,
            train_set=data.train,
            input_spec=spec,
            num_classes=10,
            epochs=1,
            teacher=teacher,
            input_embed=make_input_embed(cfg, model=model, teacher=teacher),
        )

    same = hooks_with(copy.deepcopy(model).eval())
    loss, logs = same.loss(model.eval(), x, y, epoch=0, cfg=tc)
    logs = as_floats(logs)
    assert logs["feat_kd"] == pytest.approx(0.0, abs=1e-10) and logs["kd"] == pytest.approx(0.0, abs=1e-6)
    torch.manual_seed(1)
    teacher = build_model(tiny_spec()).eval()
    other = hooks_with(teacher)
    loss, logs = other.loss(model.train(), x, y, epoch=0, cfg=tc)
    logs = as_floats(logs)
    s = model.eval().forward_head(model.forward_features(x), pre_logits=True)
    t = teacher.forward_head(teacher.forward_features(x), pre_logits=True)
    want = ((s - t).pow(2).sum(-1) / t.pow(2).sum(-1)).mean().item()
    assert logs["feat_kd"] == pytest.approx(want, rel=1e-5) and want > 0.1
    assert loss.item() == pytest.approx(0.5 * logs["ce"] + 0.5 * logs["kd"] + 2.0 * want, rel=1e-5)
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    # off (the default): no tap on the teacher, no term
    _, logs_off = IBHooks(
        replace(cfg, feat_kd=0.0),
        train_set=data.train,
        input_spec=spec,
        num_classes=10,
        epochs=1,
        teacher=teacher,
        input_embed=make_input_embed(cfg, model=model, teacher=teacher),
    ).loss(model, x, y, epoch=0, cfg=tc)
    assert "feat_kd" not in logs_off
    with pytest.raises(NascompressError, match="feat_kd"):
        RetrainConfig(feat_kd=-1.0)


def test_cli_retrain_writes_a_model_that_loads_anywhere(tmp_path):
    from nascompress.cli.main import app

    src = make_model_dir(tmp_path / "compressed")
    teacher = make_model_dir(tmp_path / "dense", methods=(), seed=1)
    out = tmp_path / "retrained"
    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "retrain",
            str(src),
            "--out",
            str(out),
            "--dataset",
            "synthetic",
            "--epochs",
            "2",
            "--eta",
            "50",
            "--warmup-frac",
            "0.5",
            "--teacher",
            str(teacher),
            "--kd-temperature",
            "2",
            "--feat-kd",
            "1",
            "--batch-size",
            "64",
            "--lr",
            "1e-3",
            "--train-limit",
            "128",
            "--eval-limit",
            "64",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    metrics = json.loads(res.stdout[res.stdout.index("{") :])
    for f in ("model.safetensors", "arch.json", "metrics.json", "log.jsonl", "config.json"):
        assert (out / f).is_file(), f
    log = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    assert log[0]["start"]  # epoch 0: the starting model, evaluated before training
    log = log[1:]
    assert [r["ib_active"] for r in log] == [False, True]
    for r in log:
        for k in (
            "train_ce",
            "train_ibb",
            "train_kd",
            "train_feat_kd",
            "ib",
            "i_xt_x",
            "i_xt_y",
            "train_top1_eval",
            "val_top1",
            "kmeans_s",
            "epoch_time_s",
        ):
            assert k in r, k
    arch = json.loads((out / "arch.json").read_text())
    assert arch["methods"] == [NOOP]
    assert "pre_logits" in arch["retrain"]["learned_feature"] and "image" in arch["retrain"]["input_feature"]
    assert arch["retrain"]["kd"] is True
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["nascompress_arch"]) == arch
    assert metrics["test_top1"] == json.loads((out / "metrics.json").read_text())["test_top1"]
    assert metrics["kd"] is True and metrics["warm_epochs"] == 1 and metrics["final"]["ib"] == log[-1]["ib"]
    # ship only OUT_DIR: it loads with one library call and one CLI call, without the source runs
    shipped = tmp_path / "elsewhere" / "model"
    shutil.copytree(out, shipped)
    shutil.rmtree(src)
    shutil.rmtree(teacher)
    shutil.rmtree(out)
    model = nascompress.load(shipped)
    x = torch.randn(2, 1, 16, 16)
    assert model(x).shape == (2, 10)
    res = runner.invoke(app, ["evaluate", str(shipped), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["top1"] == pytest.approx(metrics["test_top1"])


def test_resume_replays_an_interrupted_run(tmp_path):
    src = make_model_dir(tmp_path / "compressed")
    full = retrain(quick_job(src, tmp_path / "full"))
    job = quick_job(src, tmp_path / "cut")
    with interrupted_at_epoch(IBHooks), pytest.raises(KeyboardInterrupt):
        retrain(job)
    assert len((tmp_path / "cut" / "log.jsonl").read_text().splitlines()) == 2  # the start + epoch 1
    resumed = retrain(replace(job, train=replace(job.train, epochs=99)), resume=True)  # config.json wins
    assert resumed.epochs == 2
    a, b = nascompress.load(tmp_path / "full"), nascompress.load(tmp_path / "cut")
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(va, vb, msg=ka)
    assert resumed.final["ib"] == pytest.approx(full.final["ib"], rel=1e-4)
    # what the bound contributed: the start and the warm-up epoch (CE only) against the epoch with the bound
    log = [json.loads(ln) for ln in (tmp_path / "full" / "log.jsonl").read_text().splitlines()]
    bc = full.bound_contribution
    assert bc.best_val_without_bound == max(r["val_top1"] for r in log[:2])
    assert bc.best_val_with_bound == log[2]["val_top1"]
    assert bc.change == pytest.approx(bc.best_val_with_bound - bc.best_val_without_bound)
    assert resumed.bound_contribution == bc


def test_the_default_retraining_has_no_bound_and_records_none():
    # measured (bench/dcs_generalise.py ib units): the bound did not help, so the default is CE (+ KD) only
    assert RetrainConfig().eta == 0.0
    assert bound_contribution(
        [{"epoch": 0, "start": True, "val_top1": 50.0}, {"epoch": 1, "val_top1": 60.0, "ib_active": False}]
    ).to_dict() == {"best_val_without_bound": 60.0, "best_val_with_bound": None, "change": None}


@pytest.mark.parametrize(
    "args,match",
    [
        (["--eta", "-1"], r"--eta must be in \[0, inf\]"),
        (["--warmup-frac", "1.0"], r"--warmup-frac must be in \[0, 1\)"),
        (["--warmup-frac", "-0.1"], r"--warmup-frac must be in \[0, 1\)"),
        (["--feat-kd", "-1"], r"--feat-kd must be in \[0, inf\]"),
        (["--feat-kd", "1"], "--feat-kd distils from a teacher's features; give the dense run with --teacher"),
    ],
)
def test_cli_rejects_bad_options_and_writes_nothing(tmp_path, args, match):
    from nascompress.cli.main import app

    src = make_model_dir(tmp_path / "compressed")
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["retrain", str(src), "--out", str(out), "--dataset", "synthetic", *args])
    assert res.exit_code == 1
    assert len(res.stderr.strip().splitlines()) == 1
    import re

    assert re.search(match, res.stderr), res.stderr
    assert not out.exists()


def test_bad_models_and_datasets_write_nothing(tmp_path):
    out = tmp_path / "out"  # a dense model is retrained (tests/test_honest_splits.py)
    five = make_model_dir(tmp_path / "five", num_classes=5)
    with pytest.raises(NascompressError, match="has 5 classes but dataset synthetic has 10"):
        retrain(quick_job(five, out))
    assert not out.exists()
    src = make_model_dir(tmp_path / "compressed")
    with pytest.raises(NascompressError, match="teacher .* has 5 classes"):
        retrain(replace(quick_job(src, out), teacher=str(five)))
    wide = tmp_path / "wide"  # a teacher whose pre-logits feature is 48 wide against the model's 32
    torch.manual_seed(0)
    wspec = custom_vit_spec(img_size=16, patch_size=4, embed_dim=48, depth=2, num_heads=2, num_classes=10, in_chans=1)
    wmodel = build_model(wspec)
    save_model(wide, wmodel, make_arch(wspec, input_spec=input_spec_for(wmodel, "synthetic").to_dict()))
    with pytest.raises(
        NascompressError, match="feat_kd: the model's pre_logits feature has 32 values but the teacher's 48"
    ):
        retrain(replace(quick_job(src, out, feat_kd=1.0), teacher=str(wide)))
    retrain(replace(quick_job(src, tmp_path / "logits_only"), teacher=str(wide)))  # without --feat-kd it is fine
    with pytest.raises(NascompressError, match="does not exist"):
        retrain(quick_job(tmp_path / "missing", out))
    with pytest.raises(NascompressError, match="no such submodule"):
        retrain(quick_job(src, out, feature_tap="module:nope"))
    assert not out.exists()
    with pytest.raises(NascompressError, match="nothing to resume"):
        retrain(quick_job(src, out), resume=True)


def test_retrains_a_materialized_dcs_model_and_keeps_its_shapes(tmp_path):
    """Any compressed model: a tiny materialized DCS model (issue 3's format) retrains and ships."""
    from nascompress.methods import dcs

    torch.manual_seed(0)
    cfg = dcs.DCSConfig(qk_mask="static")
    supernet = dcs.make_supernet(build_model(tiny_spec()), cfg)
    with torch.no_grad():
        for blk in supernet.blocks:
            blk.dcs_alpha[::2] = -3.0  # drop half the MLP channels
            blk.attn.qk_mask.theta.view(-1)[::4] = -3.0  # and a quarter of the Q/K channels
    model, record = dcs.materialize(supernet, cfg)
    arch = make_arch(tiny_spec(), input_spec=input_spec_for(model, "synthetic").to_dict(), methods=[record])
    src = tmp_path / "dcs_mat"
    save_model(src, model, arch)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in build_model(tiny_spec()).parameters())
    job = replace(quick_job(src, tmp_path / "out"), data=SMALL, train=replace(quick_job(src, "x").train, epochs=1))
    metrics = retrain(job)
    assert metrics.methods == ["dcs"]
    shipped = nascompress.load(tmp_path / "out")
    assert {k: tuple(v.shape) for k, v in shipped.state_dict().items()} == shapes


def test_patch_embed_input_feature_is_a_frozen_copy():
    torch.manual_seed(0)
    model = build_model(tiny_spec())
    x = torch.randn(4, 1, 16, 16)
    embed = make_input_embed(RetrainConfig(input_tap="patch_embed"), model=model, teacher=None)
    before = embed(x)
    assert before.shape == (4, 32)
    torch.testing.assert_close(before, model.patch_embed(x).mean(1))
    with torch.no_grad():
        model.patch_embed.proj.weight.add_(1.0)  # training the student must not move X
    torch.testing.assert_close(embed(x), before, rtol=0, atol=0)
    img = make_input_embed(RetrainConfig(input_pool=4), model=model, teacher=None)(x)
    torch.testing.assert_close(img, torch.nn.functional.avg_pool2d(x, 4).flatten(1))


def test_cli_retrain_with_the_bound_off_prints_no_ib_loss(tmp_path):
    """--teacher with eta 0 (the default): no "IB loss nan"; the test image count is printed."""
    from nascompress.cli.main import app

    src = make_model_dir(tmp_path / "compressed")
    teacher = make_model_dir(tmp_path / "dense", methods=(), seed=1)
    res = CliRunner().invoke(
        app,
        [
            "retrain",
            str(src),
            "--out",
            str(tmp_path / "r"),
            "--dataset",
            "synthetic",
            "--epochs",
            "1",
            "--teacher",
            str(teacher),
            "--batch-size",
            "64",
            "--train-limit",
            "64",
            "--eval-limit",
            "32",
        ],
    )
    assert res.exit_code == 0, res.output
    line = res.stdout.strip().splitlines()[-1]
    assert "nan" not in line.lower() and "IB loss" not in line and "(32 images)" in line, line
    from nascompress.cli.retrain import ib_text

    assert ib_text(RetrainMetrics.new(eta=50.0, final={"ib": 0.25})) == "  IB loss 0.2500"
    off, nan = RetrainMetrics.new(eta=0.0, final={"ib": 0.25}), RetrainMetrics.new(eta=5.0, final={"ib": float("nan")})
    assert ib_text(off) == ib_text(nan) == ""
