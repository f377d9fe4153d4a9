"""DCS head gates (whole attention heads) and block gates (whole blocks): the supernet, its
materialization and loading, the FLOPs cost (hard = the profiler's count, soft differentiable),
the magnitude baseline on these axes, the record checks and the CLI."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from timm.models.vision_transformer import Block, VisionTransformer
from typer.testing import CliRunner

import nascompress
from nascompress.dcs_search.cost import CostModel, soft_arch
from nascompress.errors import NascompressError
from nascompress.methods import get_method
from nascompress.methods.dcs_structure import ConstantAttention
from nascompress.methods.dcs import DCSConfig, make_supernet, materialize
from nascompress.methods.dcs_supernet import selection
from nascompress.models.build import build_model
from nascompress.profiling import count_flops
from nascompress.runs.io import make_arch, save_model

from .conftest import tiny_spec_3_heads

X = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(0))


def gated(qk="static", family="residual", *, align=1, depth=3, heads=True, blocks=True):
    spec = tiny_spec_3_heads(depth=depth)
    dense = build_model(spec).eval()
    cfg = DCSConfig(qk_mask=qk, mlp_gates=family, align=align, head_gates=heads, depth_gates=blocks)
    return spec, dense, cfg, make_supernet(copy.deepcopy(dense), cfg).eval()


def close_some(sup, seed=0):
    """Random MLP/Q-K gates; block 0 loses head 1, block 1 is closed, the last block loses every head."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for blk in sup.blocks:
            if blk.dcs_alpha is not None:
                blk.dcs_alpha.copy_(torch.randn(blk.dcs_alpha.shape, generator=g))
            qm = blk.attn.qk_mask
            if qm is not None and qm.mode == "static":
                qm.theta.copy_(torch.randn(qm.theta.shape, generator=g))
        heads = [b.attn.head_mask.logits for b in sup.blocks if b.attn.head_mask is not None]
        if heads:
            heads[0][1] = -2.0
            heads[-1].fill_(-2.0)
        if getattr(sup.blocks[1], "dcs_depth", None) is not None:
            sup.blocks[1].dcs_depth.fill_(-2.0)


@pytest.mark.parametrize("qk", ["static", "input", "none"])
def test_open_head_and_block_gates_are_the_dense_model(qk):
    _, dense, cfg, sup = gated(qk)
    assert len(sup.blocks[0].attn.head_mask.logits) == 3 and sup.blocks[0].dcs_depth.shape == (1,)
    torch.testing.assert_close(sup(X), dense(X), rtol=0, atol=1e-6)
    rec = selection(sup)
    assert [b["heads_keep"] for b in rec] == [[0, 1, 2]] * 3 and [b["skip"] for b in rec] == [False] * 3
    mat, _ = materialize(sup, cfg)
    torch.testing.assert_close(mat(X), dense(X), rtol=0, atol=1e-5)
    # without the new gates the record keeps its former keys
    _, _, _, plain = gated(qk, heads=False, blocks=False)
    assert all("heads_keep" not in b and "skip" not in b for b in selection(plain))


@pytest.mark.parametrize(
    "qk,family", [("static", "residual"), ("static", "hidden"), ("input", "hidden"), ("none", "none")]
)
def test_closed_heads_and_blocks_materialize_and_reload(qk, family, tmp_path):
    spec, dense, cfg, sup = gated(qk, family)
    close_some(sup)
    mat, record = materialize(sup, cfg)
    blocks = record["blocks"]
    assert [b["skip"] for b in blocks] == [False, True, False]
    assert blocks[0]["heads_keep"] == [0, 2] and blocks[2]["heads_keep"] == []
    if qk == "static":  # one Q/K selection per kept head
        assert [len(b["qk_keep"]) for b in blocks] == [2, 3, 0]
    # a shorter timm ViT of timm blocks: block 0 keeps 2 heads of the same dim, the last is a constant
    assert isinstance(mat, VisionTransformer) and len(mat.blocks) == 2
    assert all(isinstance(b, Block) for b in mat.blocks)
    a0 = mat.blocks[0].attn
    assert a0.num_heads == 2 and a0.head_dim == 16 and a0.proj.in_features == 32
    assert isinstance(mat.blocks[1].attn, ConstantAttention)
    ref = sup(X)
    assert (ref - dense(X)).abs().max() > 1e-3  # the gates changed the function
    torch.testing.assert_close(mat(X), ref, rtol=0, atol=1e-5)

    arch = make_arch(spec, input_spec={"img_size": [16, 16], "in_chans": 1, "mean": [0.5], "std": [0.5]})
    save_model(tmp_path / "mat", mat, dict(arch, methods=[record]))
    loaded = nascompress.load(tmp_path / "mat")
    assert len(loaded.blocks) == 2
    torch.testing.assert_close(loaded(X), ref, rtol=0, atol=1e-5)
    assert count_flops(loaded, X).total == count_flops(mat, X).total


@pytest.mark.parametrize("qk,family,align", [("static", "residual", 1), ("static", "hidden", 8), ("none", "hidden", 1)])
def test_hard_cost_is_the_materialized_models_count(qk, family, align):
    _, dense, cfg, sup = gated(qk, family, align=align)
    x1 = torch.zeros(1, 1, 16, 16)
    cost = CostModel.build(dense, sup, x1)
    assert cost.hard_macs(sup) == pytest.approx(count_flops(dense, x1).total, rel=1e-9)
    for seed in range(3):
        close_some(sup, seed)
        mat, _ = materialize(sup, cfg)
        assert cost.hard_macs(sup) == pytest.approx(count_flops(mat, x1).total, rel=1e-9)
    arch = soft_arch(sup, soft=False)
    assert [b["present"] for b in arch] == [1, 0, 1] and [b["heads"] for b in arch] == [2, 3, 0]
    assert all(isinstance(v, int) for b in arch for v in b.values())
    assert mat.blocks[0].attn.num_heads == 2


def test_soft_cost_is_differentiable_in_head_and_block_logits():
    _, dense, cfg, sup = gated("static", "hidden")
    cost = CostModel.build(dense, sup, torch.zeros(1, 1, 16, 16))
    with torch.no_grad():
        for b in sup.blocks:
            b.attn.head_mask.logits.fill_(0.5)
            b.dcs_depth.fill_(0.5)
    sup.train()
    sup(X)
    arch = soft_arch(sup)
    assert all(t.dim() == 0 and t.requires_grad for b in arch for t in b.values())
    cost.soft_macs(sup).backward()
    for b in sup.blocks:
        assert b.attn.head_mask.logits.grad is not None and (b.attn.head_mask.logits.grad > 0).all()
        assert b.dcs_depth.grad is not None and (b.dcs_depth.grad > 0).all()  # more open: more MACs
    assert 0 < cost.expected_macs(sup) < cost.dense


def test_magnitude_baseline_keeps_the_searched_head_and_block_counts():
    from nascompress.dcs_search.baseline import magnitude_supernet
    from nascompress.dcs_search.magnitude import Structure

    _, dense, _, _ = gated()
    x1 = torch.zeros(1, 1, 16, 16)
    base, cfg, cost, info = magnitude_supernet(
        dense, target=0.5, align=1, fill=None, x1=x1, structure=Structure(heads=[2, 3, 1], skipped=1)
    )
    assert cfg.head_gates and cfg.depth_gates and info.heads_kept == [2, 3, 1]
    assert len(info.skipped_blocks) == 1 and abs(info.flops_ratio / 0.5 - 1) < 0.05
    rec = selection(base)
    assert [len(b["heads_keep"]) for b in rec] == [2, 3, 1] and sum(b["skip"] for b in rec) == 1
    mat, _ = materialize(base, cfg)
    torch.testing.assert_close(mat(X), base(X), rtol=0, atol=1e-5)
    assert cost.hard_macs(base) == pytest.approx(count_flops(mat, x1).total, rel=1e-9)


@pytest.mark.parametrize(
    "block,msg",
    [
        ({"skip": "yes"}, "blocks[0].skip must be true or false"),
        ({"heads_keep": [0, "1"]}, "blocks[0].heads_keep must be a list of channel indices"),
        ({"heads_keep": [0], "qk_keep": [[0], [1]]}, "keeps 1 heads (heads_keep) but qk_keep lists 2"),
    ],
)
def test_a_bad_head_or_skip_record_is_one_line(block, msg):
    rec = {"name": "dcs", "config": DCSConfig(head_gates=True).to_dict(), "stage": "materialized", "blocks": [block]}
    with pytest.raises(NascompressError, match=re.escape(msg)) as e:
        get_method("dcs").check_record(rec)
    assert "\n" not in str(e.value)


def test_a_study_space_may_set_the_gates():
    from nascompress.studies.space_values import registry_method_fields

    assert {"head_gates", "depth_gates"} <= registry_method_fields("dcs")
    assert DCSConfig.user(head_gates=True, depth_gates=True).head_gates


def test_search_dcs_with_head_and_depth_gates_materializes_and_loads(tiny_run, tmp_path):
    from nascompress.cli.main import app

    def cli(*args):
        return CliRunner().invoke(app, [str(a) for a in args])

    out = tmp_path / "search"
    res = cli(
        "search", "dcs", tiny_run, "--out", out, "--head-gates", "--depth-gates", "--epochs", 1,
        "--batch-size", 16, "--train-limit", 64, "--eval-limit", 64, "--device", "cpu", "--mlp-gates", "hidden",
        "--recovery-images", 16, "--json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    arch = json.loads((out / "arch.json").read_text())["methods"][-1]
    assert arch["config"]["head_gates"] and arch["config"]["depth_gates"]
    assert all("heads_keep" in b and "skip" in b for b in arch["blocks"])
    assert "heads_kept" in json.loads((out / "metrics.json").read_text())
    mat = tmp_path / "mat"
    res = cli("materialize", out, "--out", mat, "--json")
    assert res.exit_code == 0, res.output
    m = json.loads((mat / "metrics.json").read_text())
    assert m["max_abs_logit_diff"] <= 1e-4 and "heads_kept" in m and "skipped_blocks" in m
    x = torch.randn(2, 1, 16, 16)
    torch.testing.assert_close(nascompress.load(mat)(x), nascompress.load(out)(x), rtol=0, atol=1e-4)


def test_calibration_moves_the_block_gates_one_step_then_lands_with_the_others():
    from nascompress.dcs_search.cost import calibrate

    _, dense, _, sup = gated("none", "hidden")
    cost = CostModel.build(dense, sup, torch.zeros(1, 1, 16, 16))
    close_some(sup, seed=1)
    depth = [b.dcs_depth.clone() for b in sup.blocks]
    heads = [b.attn.head_mask.logits.clone() for b in sup.blocks]
    shift = calibrate(sup, cost, 0.3)
    assert shift != 0 and abs(cost.hard_macs(sup) / cost.dense / 0.3 - 1) < 0.05
    moves = {round(float(d - b.dcs_depth), 5) for b, d in zip(sup.blocks, depth)}
    assert len(moves) == 1  # one shift for every block gate (on the scale of every gate's logits)
    assert all(torch.equal(b.attn.head_mask.logits, h - shift) for b, h in zip(sup.blocks, heads))


def test_calibration_closes_the_block_whose_gate_is_the_least_open():
    from nascompress.dcs_search.cost import calibrate

    _, dense, _, sup = gated("none", "hidden")
    cost = CostModel.build(dense, sup, torch.zeros(1, 1, 16, 16))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for b in sup.blocks:
            b.dcs_alpha.copy_(8 + torch.rand(b.dcs_alpha.shape, generator=g))
            b.attn.head_mask.logits.fill_(9.0)
            b.dcs_depth.fill_(9.5)
        sup.blocks[1].dcs_depth.fill_(1.0)  # far below every other gate: the first to go
    calibrate(sup, cost, 0.55)
    assert [bool(b.dcs_depth.item() > 0) for b in sup.blocks] == [True, False, True]
    assert abs(cost.hard_macs(sup) / cost.dense / 0.55 - 1) < 0.05


@pytest.mark.parametrize("grad", [False, True])
def test_a_block_without_heads_or_hidden_neurons_is_profiled_without_autograd(grad):
    """``profile`` counts FLOPs under no_grad: the constant attention and MLP must not hand torch's
    module tracker a parameter view without a grad_fn."""
    from torch.utils.flop_counter import FlopCounterMode

    from nascompress.methods.dcs_materialize import ConstantMLP

    x = torch.randn(2, 5, 8)
    for m in (ConstantAttention(torch.randn(8)), ConstantMLP(torch.randn(8))):
        with torch.set_grad_enabled(grad), FlopCounterMode(display=False):
            y = m(x)
        assert y.shape == (2, 5, 8) and y.requires_grad == grad
