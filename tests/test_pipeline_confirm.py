"""The pipeline's ``confirm`` step: a pick that cuts tokens is retrained beside the channel-only model
of the DCS stage (when that one meets the goal by itself), and the better of the two on validation is
the model the pipeline ends with: exported, reported and recorded."""

from __future__ import annotations

import dataclasses
import json

import pytest

import nascompress
from nascompress.pipeline import confirm

from .conftest import invoke
from .test_pipeline import tiny_config, write_config

# EViT that always drops tokens (keep rate at most 0.9): every pick cuts tokens
ALWAYS_CUTS = """
format: nascompress-space/1
name: tiny-evit-cuts
methods:
  - name: evit
    params:
      prune_layers: {kind: layers, range: [1, 2], size: [1, 1]}
      keep_rate: {kind: per_layer, layers: prune_layers, value: {kind: float, low: 0.5, high: 0.9, step: 0.1}}
"""


@pytest.mark.parametrize(
    "pick, channel, kept",
    [
        ({"val_top1": 90.0, "val_loss": 0.5}, {"val_top1": 90.5, "val_loss": 0.9}, "channel-only"),
        ({"val_top1": 90.5, "val_loss": 0.9}, {"val_top1": 90.0, "val_loss": 0.1}, "pick"),
        ({"val_top1": 100.0, "val_loss": 0.30}, {"val_top1": 100.0, "val_loss": 0.20}, "channel-only"),  # tie: loss
        ({"val_top1": 100.0, "val_loss": 0.20}, {"val_top1": 100.0, "val_loss": 0.30}, "pick"),
        ({"val_top1": 100.0, "val_loss": 0.20}, {"val_top1": 100.0, "val_loss": 0.20}, "pick"),  # tie of both
        ({"val_top1": 100.0, "val_loss": None}, {"val_top1": 100.0, "val_loss": 0.1}, "pick"),  # no loss to compare
    ],
)
def test_the_better_on_validation(pick, channel, kept):
    pick, channel = confirm.ValidationRecord(**pick), confirm.ValidationRecord(**channel)
    assert confirm.better_on_validation(pick, channel) == kept


def test_when_the_check_runs(tmp_path):
    """A token-only pick is checked only when the channel-only model meets a FLOPs goal by itself; each
    other case is one line naming why not."""
    from nascompress.pipeline.files import Pick, write_pick
    from nascompress.runs.json_io import write_json

    (tmp_path / "tokens").mkdir()
    (tmp_path / "dcs_mat").mkdir()
    write_pick(
        tmp_path / "tokens", Pick.new(picked_study="s-dense", candidates={}, dense_study="s-dense", dense_skipped=None)
    )
    kind = confirm.pick_kind(tmp_path)
    assert kind == "token-only"

    def why_not(max_flops):
        return confirm.why_not(kind, confirm.channel_only_flops(tmp_path), max_flops)

    assert "the goal is a latency" in why_not(None)
    assert "does not meet the goal" in why_not(0.6)  # no channel-only model measured
    write_json(tmp_path / "dcs_mat" / "metrics.json", {"flops_ratio_vs_dense": 0.6047})
    assert why_not(0.6) == (
        "the channel-only model (0.6047x) does not meet the goal (0.6x) by itself (above it by 0.0047x)"
    )
    write_json(tmp_path / "dcs_mat" / "metrics.json", {"flops_ratio_vs_dense": 0.59997})
    assert why_not(0.6) is None
    assert confirm.why_not("channel-only", 0.59997, 0.6) == "the pick is the channel-only model itself"
    run = tmp_path / "final"
    run.mkdir()
    write_json(run / "metrics.json", {"best_val_top1": 90.5, "best_epoch": 2, "test_top1": 90.1})
    log = [{"epoch": 0, "start": True, "val_top1": 88.0, "val_loss": 0.5}]
    log += [{"epoch": e, "val_top1": v, "val_loss": loss} for e, v, loss in ((1, 90.0, 0.4), (2, 90.5, 0.3))]
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    assert confirm.validation_record(run) == confirm.ValidationRecord(val_top1=90.5, val_loss=0.3, test_top1=90.1)


def _cfg(**retrain):
    cfg = tiny_config()
    cfg["stages"]["tokens"].pop("also_dense")  # the default: the dense base's study too
    cfg["stages"]["dcs"].update(target_flops=cfg["goal"]["max_flops"], at_most=True, max_calibration=0.05)
    cfg["stages"]["retrain"].update(retrain)
    return cfg


def _write(tmp_path, cfg):
    path = write_config(tmp_path, cfg)
    (tmp_path / "space.yaml").write_text(ALWAYS_CUTS)
    return path


def test_a_pick_that_cuts_tokens_is_checked_against_the_channel_only_model(tmp_path, monkeypatch):
    """Forced to keep the channel-only model, the pipeline ends with it: the summary, report, export and
    a rerun (complete, skipped) follow the step's record; both validation records are the runs' own."""
    monkeypatch.setattr(confirm, "better_on_validation", lambda pick, channel: "channel-only")
    out = tmp_path / "out"
    path = _write(tmp_path, _cfg())
    r = invoke("pipeline", path, "--out", out)
    assert r.exit_code == 0, r.output
    marker = json.loads((out / "done" / "confirm.json").read_text())["result"]
    if marker.get("skipped"):  # the DCS stage fell back: no channel-only model to compare (a tiny search)
        pytest.skip(marker["reason"])
    assert marker["kept"] == "channel-only" and marker["pick_kind"] in ("stacked", "token-only")
    assert marker["channel_flops_ratio"] <= 0.75 and marker["pick_flops_ratio"] <= 0.75
    for who, run in (("pick", out / "final"), ("channel", out / confirm.CHANNEL_DIR)):
        rec = dataclasses.asdict(confirm.validation_record(run))
        assert rec["val_loss"] is not None
        assert {k: marker[f"{who}_{k}"] for k in rec} == rec
    s = json.loads((out / "summary.json").read_text())
    assert s["final"]["run"] == str(out / confirm.CHANNEL_DIR) and s["decisions"]["confirm"]["kept"] == "channel-only"
    assert [m["name"] for m in json.loads((out / confirm.CHANNEL_DIR / "arch.json").read_text())["methods"]] == ["dcs"]
    assert s["decisions"]["dcs"]["in_final_model"] is True
    assert s["decisions"]["retrain"]["test_top1"] == marker["channel_test_top1"]
    assert "confirm: kept the channel-only model after the same retraining" in (out / "report.html").read_text()
    side = json.loads((out / "export" / "model.pt2.json").read_text())
    assert [m["name"] for m in side["methods"]] == ["dcs"]  # the exported model is the kept one
    assert nascompress.load(out / confirm.CHANNEL_DIR) is not None
    again = invoke("pipeline", path, "--out", out)
    assert again.exit_code == 0 and "confirm: complete, skipped" in again.output, again.output
    assert json.loads((out / "summary.json").read_text())["final"]["run"] == str(out / confirm.CHANNEL_DIR)


def test_without_confirm_pick_the_retrained_pick_is_the_final_model(tmp_path):
    out = tmp_path / "out"
    r = invoke("pipeline", _write(tmp_path, _cfg(confirm_pick=False)), "--out", out)
    assert r.exit_code == 0, r.output
    assert not (out / "done" / "confirm.json").exists() and not (out / confirm.CHANNEL_DIR).exists()
    s = json.loads((out / "summary.json").read_text())
    assert s["final"]["run"] == str(out / "final") and "confirm" not in s["decisions"]
