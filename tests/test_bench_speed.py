"""bench/speed.py runs end to end in its quick mode on a tiny geometry and writes its JSON: every row with
its method, settings, FLOPs ratio, speed-up and realized share (= speed-up x FLOPs ratio); the --gpu preset's
code path (compiled rows, the time guard) runs on a CPU. No timing is asserted."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import speed  # noqa: E402

ROW_KEYS = {"model", "method", "settings", "dtype", "batch", "mode", "flops_ratio", "ms", "dense_ms", "speedup"}


def _finite_positive(v) -> bool:
    return isinstance(v, float) and math.isfinite(v) and v > 0


def _check_rows(run: dict) -> None:
    assert run["rows"], run.get("failed")
    for row in run["rows"]:
        assert ROW_KEYS | {"realized_share"} <= set(row), row
        for k in ("flops_ratio", "ms", "dense_ms", "speedup", "realized_share"):
            assert _finite_positive(row[k]), (k, row)
        assert row["speedup"] == pytest.approx(row["dense_ms"] / row["ms"])
        assert row["realized_share"] == pytest.approx(row["speedup"] * row["flops_ratio"])
        assert row["flops_ratio"] == pytest.approx(run["flops_ratio"][row["model"]])


def test_quick_eager_run_writes_every_row(tmp_path, monkeypatch):
    monkeypatch.setenv("NASCOMPRESS_CACHE", str(tmp_path / "cache"))  # the latency table's cache
    out = tmp_path / "speed.json"
    methods = "dcs_0.6x,uniform_0.6x,evit_0.7,tome,torch_pruning_0.6x"
    speed.main(["--model", "tiny", "--quick", "--dtypes", "fp32", "--batches", "1", "--methods", methods,
                "--predict", "on", "--out", str(out)])  # fmt: skip
    data = json.loads(out.read_text())
    assert {"command", "machine", "runs"} <= set(data) and data["machine"].get("cpu")
    run = data["runs"]["tiny"]
    assert run["weights"] == "random" and "token_methods" in run["notes"]
    assert run["flops_ratio"]["dense"] == 1.0
    assert 0.5 < run["flops_ratio"]["dcs_0.6x"] < 0.7 and 0.5 < run["flops_ratio"]["uniform_0.6x"] < 0.7
    _check_rows(run)
    rows = {r["model"]: r for r in run["rows"]}
    assert set(rows) == set(methods.split(",")) - set(run["build_errors"])
    assert rows["dcs_0.6x"]["method"] == "dcs" and "hidden_kept" in rows["dcs_0.6x"]["settings"]
    if "torch_pruning_0.6x" in run["build_errors"]:
        assert run["torch_pruning"] == "not installed"
    else:
        assert run["torch_pruning"][0].isdigit()  # its version
    # the predictor's error on the channel-pruned rows (the latency table of this geometry)
    assert isinstance(run["predictor"]["fp32_batch_1"], dict), run["predictor"]
    assert math.isfinite(rows["dcs_0.6x"]["predictor_error"]) and rows["dcs_0.6x"]["predicted_ms"] > 0
    # a token method: the table prices the tokens each block sees (one forward); sparse attention it does not
    assert math.isfinite(rows["evit_0.7"]["predictor_error"]) and rows["evit_0.7"]["predicted_ms"] > 0
    assert all("predictor_error" not in r for k, r in rows.items() if k.startswith("sparsifiner"))


def test_gpu_preset_code_path_runs_on_a_cpu(tmp_path):
    out = tmp_path / "speed.json"
    speed.main(["--gpu", "--device", "cpu", "--quick", "--model", "tiny", "--methods", "dcs_0.6x,mgvit",
                "--batches", "1,2", "--dtypes", "fp32", "--out", str(out)])  # fmt: skip
    run = json.loads(out.read_text())["runs"]["tiny"]
    assert run["compile"] is True and run["compile_backend"] == "eager"
    modes = {(r["mode"], r["batch"]) for r in run["rows"] if r["model"] == "dcs_0.6x"}
    assert modes == {("eager", 1), ("eager", 2), ("compiled", 1), ("compiled", 2)}
    assert "mgvit" in run["build_errors"]  # 16 px does not divide its 7x7 grid: recorded, not a crash
    assert run["predictor"]["fp32_batch_1"].startswith("off")  # a time budget: no table is measured
    assert isinstance(run["skipped"], list) and run["compile_s"]
    _check_rows(run)


def test_the_time_guard_skips_what_does_not_fit():
    g = speed.Guard(10.0)
    assert g.fits("a", 1.0) and not g.fits("b", 1e6)
    assert len(g.skipped) == 1 and g.skipped[0].startswith("b: skipped by the time guard")
    assert speed.Guard(None).fits("c", 1e9)


def test_settings_text_and_slug():
    assert speed.settings_text({"share": 0.46, "hidden_kept": [184] * 6, "qk": [8, 16]}) == (
        "share 0.46, hidden_kept 184x6, qk 8-16"
    )
    assert speed.slug("AMD EPYC 7B13") == "amd-epyc-7b13" and speed.slug("NVIDIA H200") == "nvidia-h200"
