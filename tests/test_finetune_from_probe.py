"""Fine-tuning pretrained weights with a new head starts from a fitted linear probe (LP-FT), records
the probe beside the fine-tuned model, and keeps the probe when fine-tuning ends below it."""

from __future__ import annotations

import json

import pytest

from .conftest import invoke

TINY = (
    "--dataset digits --img-size 8 --patch-size 2 --embed-dim 16 --depth 1 --num-heads 1 --in-chans 1 "
    "--train-limit 128 --eval-limit 64 --batch-size 32"
).split()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny ViT 'pretrained' by one quick dense run; its weights file."""
    out = tmp_path_factory.mktemp("pre") / "pre"
    res = invoke("train", *TINY, "--epochs", "2", "--lr", "3e-3", "--out", out)
    assert res.exit_code == 0, res.output
    return out / "model.safetensors"


def fine_tune(weights, out, *extra):
    res = invoke("train", *TINY, "--weights", weights, "--reset-head", "--epochs", "1", "--out", out, *extra)
    assert res.exit_code == 0, res.output
    metrics = json.loads((out / "metrics.json").read_text())
    log = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    return res.output + res.stderr, metrics, log


def test_reset_head_fine_tunes_from_a_fitted_probe(pretrained, tmp_path, monkeypatch):
    monkeypatch.setenv("NASCOMPRESS_PROGRESS", "plain")  # the suite turns the lines said off
    output, m, log = fine_tune(pretrained, tmp_path / "ft")
    assert "from a linear-probe head" in output
    # epoch 0, the start of the fine-tune, is the probe: its head fitted on the frozen features
    assert log[0]["start"] and m["probe_val_top1"] == log[0]["val_top1"]
    assert m["probe"]["val_top1"] == pytest.approx(m["probe_val_top1"], abs=1e-6)
    assert m["probe"]["l2"] in [r["l2"] for r in m["probe"]["l2_grid"]]
    assert m["probe_val_top1"] > 20.0  # far above chance (10 classes): not a random head
    assert m["fine_tuned_val_top1"] == max(r["val_top1"] for r in log[1:])
    assert m["best_val_top1"] == max(m["probe_val_top1"], m["fine_tuned_val_top1"])
    assert m["kept_probe"] == (m["best_epoch"] == 0)


def test_the_guard_keeps_the_probe_when_fine_tuning_fails(pretrained, tmp_path, monkeypatch):
    monkeypatch.setenv("NASCOMPRESS_PROGRESS", "plain")
    output, m, _ = fine_tune(pretrained, tmp_path / "ft", "--lr", "10")  # a learning rate that wrecks it
    assert m["kept_probe"] is True and m["best_epoch"] == 0
    assert m["fine_tuned_val_top1"] < m["probe_val_top1"] == m["best_val_top1"]
    assert "kept the probe" in output
    # the saved model is the probe: evaluated again it scores the probe's val top-1
    res = invoke("evaluate", tmp_path / "ft", "--split", "val")
    assert res.exit_code == 0, res.output
    assert f"{m['probe_val_top1']:.2f}%" in res.output


def test_a_run_recorded_before_lp_ft_resumes_with_its_random_head():
    from nascompress.models.build import custom_vit_spec
    from nascompress.train.run import TrainJob

    job = TrainJob(
        model=custom_vit_spec(img_size=8, patch_size=2, embed_dim=16, depth=1, num_heads=1, num_classes=10), weights="w"
    )
    assert job.probe_start and not job.from_probe  # no reset_head: the weights' own head is kept
    old = {k: v for k, v in job.to_dict().items() if k != "probe_start"}
    assert TrainJob.from_dict({**old, "reset_head": True}).from_probe is False
    new = TrainJob.from_dict({**job.to_dict(), "reset_head": True})
    assert new.from_probe is True
