"""The DCS search's latency cost (issue 65): ``search dcs --cost latency --target-latency R`` steers the
latency predicted from the device's table (a hand-made table here: arithmetic, never a speed)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from nascompress.dcs_search import latency_cost as latency_cost_module
from nascompress.dcs_search.cost import CostModel
from nascompress.dcs_search.latency_cost import LatencyCost
from nascompress.dcs_search.search_config import DCSSearchConfig
from nascompress.errors import SettingError
from nascompress.methods.dcs import DCSConfig, make_supernet, materialize
from nascompress.models.build import build_model
from nascompress.profiling import geometry_of, latency_table_build, predict_latency
from nascompress.profiling.latency_table import LatencyTable

from .conftest import hand_latency_table, invoke, tiny_spec_3_heads

X1 = torch.zeros(1, 1, 16, 16)


def hand_table(geometry, *, align: int = 1) -> LatencyTable:
    return hand_latency_table(geometry, align=align)


def supernet(family="hidden", *, heads=True, blocks=True):
    dense = build_model(tiny_spec_3_heads(depth=3)).eval()
    cfg = DCSConfig(qk_mask="static", mlp_gates=family, align=1, head_gates=heads, depth_gates=blocks)
    return dense, cfg, make_supernet(copy.deepcopy(dense), cfg).eval()


def close_some(sup):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for blk in sup.blocks:
            blk.dcs_alpha.copy_(torch.randn(blk.dcs_alpha.shape, generator=g))
            blk.attn.qk_mask.theta.copy_(torch.randn(blk.attn.qk_mask.theta.shape, generator=g))
        sup.blocks[0].attn.head_mask.logits[1] = -2.0
        sup.blocks[1].dcs_depth.fill_(-2.0)


def test_the_hard_latency_is_the_materialized_models_prediction():
    dense, cfg, sup = supernet()
    table = hand_table(geometry_of(dense))
    cost = LatencyCost.build(CostModel.build(dense, sup, X1), sup, table)
    assert cost.dense == pytest.approx(predict_latency(table, dense), rel=1e-9)
    assert cost.hard_macs(sup) == pytest.approx(cost.dense, rel=1e-9)  # every gate open
    close_some(sup)
    mat, _ = materialize(sup, cfg)
    assert len(mat.blocks) == 2  # block 1 closed
    assert cost.hard_macs(sup) == pytest.approx(predict_latency(table, mat), rel=1e-9)
    assert cost.hard_macs(sup) < cost.dense


def test_the_soft_latency_is_differentiable_in_every_gate():
    dense, _, sup = supernet()
    cost = LatencyCost.build(CostModel.build(dense, sup, X1), sup, hand_table(geometry_of(dense)))
    sup.train()
    sup.dcs_state.tau = 1.0
    sup(torch.randn(2, 1, 16, 16))
    soft = cost.soft_macs(sup)
    assert soft.requires_grad and 0 < float(soft.detach()) <= cost.dense * 1.001
    soft.backward()
    blk = sup.blocks[0]
    for name, p in (("hidden", blk.dcs_alpha), ("heads", blk.attn.head_mask.logits), ("block", blk.dcs_depth)):
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, name
    assert 0 < cost.expected_macs(sup) <= cost.dense * 1.001


def test_the_residual_family_is_refused_in_one_line():
    dense, _, sup = supernet("residual")
    with pytest.raises(SettingError, match="mlp_gates") as e:
        LatencyCost.build(CostModel.build(dense, sup, X1), sup, hand_table(geometry_of(dense)))
    assert "\n" not in str(e.value)


def test_cost_and_target_are_checked_together():
    assert DCSSearchConfig(cost="latency", target_latency=0.6).target == 0.6
    assert DCSSearchConfig(target_flops=0.7).target == 0.7
    with pytest.raises(SettingError, match="target_latency"):
        DCSSearchConfig(cost="latency", target_flops=0.6)
    with pytest.raises(SettingError, match="cost"):
        DCSSearchConfig(target_latency=0.6)


def test_search_dcs_cost_latency_end_to_end(tiny_run, tmp_path, monkeypatch):
    """The search reads the device's table (a hand-made one here), records the predicted latency,
    and the materialized model is what it predicted."""
    seen = []

    def table_for(geometry, *, device, dtype, batch, align):
        seen.append((dtype, batch))
        return hand_table(geometry, align=align)

    monkeypatch.setattr(latency_cost_module, "latency_table", table_for)
    out = tmp_path / "search"
    args = [
        "search", "dcs", tiny_run, "--out", out, "--cost", "latency", "--latency-batch", 4, "--head-gates",
        "--depth-gates", "--epochs", 1, "--batch-size", 16, "--train-limit", 64, "--eval-limit", 64,
        "--device", "cpu", "--recovery-images", 16, "--json",
    ]  # fmt: skip
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    assert seen == [("fp32", 4)]
    m = json.loads((out / "metrics.json").read_text())
    assert m["cost"] == "latency" and m["mlp_gates"] == "hidden"
    assert 0 < m["latency_ratio"] <= 1.0001 and m["latency_ms"] == pytest.approx(
        m["latency_ratio"] * m["dense_latency_ms"]
    )
    res = invoke("materialize", out, "--out", tmp_path / "mat", "--json")
    assert res.exit_code == 0, res.output


def test_a_latency_target_with_the_flops_cost_is_one_line(tiny_run, tmp_path):
    res = invoke("search", "dcs", tiny_run, "--out", tmp_path / "s", "--target-latency", "0.6")
    assert res.exit_code == 1 and "--cost latency" in res.output and "Traceback" not in res.output


def test_the_pipeline_plans_a_latency_search_and_checks_its_target(tmp_path):
    from nascompress.pipeline.plan import plan

    from .test_pipeline import tiny_config, write_config

    cfg = tiny_config()
    del cfg["stages"]["dcs"]["target_flops"]
    cfg["stages"]["dcs"]["cost"] = "latency"  # without target_latency
    path = write_config(tmp_path, cfg)
    r = invoke("pipeline", path, "--out", tmp_path / "out")
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert "stages.dcs.target_latency" in r.output and not (tmp_path / "out").exists()
    cfg["stages"]["dcs"]["target_latency"] = 0.7
    path = write_config(tmp_path, cfg)
    pipe = plan(path, out=tmp_path / "out", seed=0)
    search = next(s for s in pipe.steps if s.name == "dcs_search")
    assert "0.7x the dense predicted latency" in search.describe and not (tmp_path / "out").exists()


def test_goal_max_latency_ms_sets_the_latency_target(tmp_path, monkeypatch):
    """Without stages.dcs.target_latency the goal's milliseconds are the target: the ratio is
    ``max_latency_ms`` over the base's latency measured now (the table's speed re-anchored: a table
    cached when the machine ran twice as fast does not halve the goal), at most 1; the pipeline's
    ``latency_goal`` step records it and the search runs at it; a batch other than 1 is refused
    (the goal is a batch-1 latency)."""
    from types import SimpleNamespace

    from nascompress.dcs_search.latency_cost import LatencyGoal, latency_target
    import nascompress.pipeline.stages.dcs as dcs_stage
    from nascompress.pipeline.plan import plan

    from .test_pipeline import tiny_config, write_config

    dense = build_model(tiny_spec_3_heads(depth=3)).eval()

    def table_for(geometry, *, device, dtype, batch, align):
        return hand_table(geometry, align=align)

    monkeypatch.setattr(latency_cost_module, "latency_table", table_for)
    dense_ms = float(predict_latency(hand_table(geometry_of(dense)), dense))
    monkeypatch.setattr(latency_table_build, "measured_ms", lambda model, table, **kw: 2 * dense_ms)
    kw = dict(device="cpu", dtype="fp32", batch=1, align=1)
    goal = latency_target(dense, 0.5 * dense_ms, **kw)
    assert goal.ratio == pytest.approx(0.25, abs=1e-4) and goal.anchor == pytest.approx(2.0)
    assert goal.table_dense_ms == pytest.approx(dense_ms) and goal.dense_ms == pytest.approx(2 * dense_ms)
    assert latency_target(dense, 3 * dense_ms, **kw).ratio == 1.0

    cfg = tiny_config()
    del cfg["stages"]["dcs"]["target_flops"]
    cfg["stages"]["dcs"]["cost"] = "latency"
    cfg["goal"] = {"max_latency_ms": 2.5}
    pipe = plan(write_config(tmp_path, cfg), out=tmp_path / "out", seed=0)
    names = [s.name for s in pipe.steps]
    assert names.index("latency_goal") == names.index("dcs_search") - 1
    set_goal = next(s for s in pipe.steps if s.name == "latency_goal")
    search = next(s for s in pipe.steps if s.name == "dcs_search")
    assert "2.5 ms of predicted latency (goal.max_latency_ms)" in search.describe
    ran = []
    monkeypatch.setattr(dcs_stage, "load_with_arch", lambda *a, **k: (dense, None))
    monkeypatch.setattr(
        dcs_stage,
        "latency_target",
        lambda m, ms, **k: LatencyGoal.new(
            max_latency_ms=ms,
            dense_ms=10.0,
            table_dense_ms=8.0,
            anchor=1.25,
            ratio=round(ms / 10, 4),
            dtype="fp32",
            batch=1,
        ),
    )
    recorded = set_goal.run(False, False)
    assert recorded.ratio == 0.25
    monkeypatch.setattr(dcs_stage, "find_step_marker", lambda out, name: SimpleNamespace(result=recorded.to_dict()))
    monkeypatch.setattr(
        dcs_stage, "run_dcs_with_fallback", lambda job, **k: ran.append(job.search.target_latency) or {}
    )
    search.run(False, False)
    assert ran == [0.25]

    cfg["stages"]["dcs"]["latency_batch"] = 4
    r = invoke("pipeline", write_config(tmp_path, cfg), "--out", tmp_path / "out2")
    assert r.exit_code == 1 and "stages.dcs.latency_batch" in r.output and "batch-1" in r.output, r.output


def test_a_latency_goal_pipeline_records_its_ratio_once_and_resumes_with_it(tmp_path, monkeypatch):
    """End to end: ``goal.max_latency_ms`` with the latency cost runs the ``latency_goal`` step (the
    dense base timed now; here a fixed 10 ms), whose marker holds the ratio; the search lands at it,
    and a second run of the finished pipeline measures nothing again."""
    from .test_pipeline import tiny_config, write_config

    monkeypatch.setattr(latency_cost_module, "latency_table", lambda g, **k: hand_table(g, align=k["align"]))
    timed = []

    def measured(model, table, **kw):
        timed.append(float(predict_latency(table, model)))
        return 10.0

    monkeypatch.setattr(latency_table_build, "measured_ms", measured)
    cfg = tiny_config()
    del cfg["stages"]["dcs"]["target_flops"], cfg["stages"]["tokens"], cfg["export"]
    cfg["stages"]["dcs"].update(cost="latency", epochs=1)
    cfg["goal"] = {"max_latency_ms": 8.0}
    path = write_config(tmp_path, cfg)
    out = tmp_path / "out"
    r = invoke("pipeline", path, "--out", out)
    assert r.exit_code == 0, r.output
    goal = json.loads((out / "done" / "latency_goal.json").read_text())["result"]
    assert goal["ratio"] == 0.8 and goal["dense_ms"] == 10.0 and goal["anchor"] == pytest.approx(10.0 / timed[0])
    m = json.loads((out / "dcs_search" / "metrics.json").read_text())
    assert m["target_latency"] == 0.8
    r = invoke("pipeline", path, "--out", out)
    assert r.exit_code == 0, r.output
    assert len(timed) == 1  # the recorded ratio, not a new measurement
