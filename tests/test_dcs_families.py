"""DCS gate families (residual, hidden), aligned widths, mean fill, protected gates, the family probe,
the progressive target and the pre-search measurements: identity, equivalence, alignment, round trip."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import nascompress
from nascompress.errors import NascompressError
from nascompress.runs.io import make_arch, save_model
from nascompress.methods.dcs import DCSConfig, make_record, make_supernet, materialize
from nascompress.methods.dcs_importance import activation_stats
from nascompress.methods.dcs_gates import aligned_mask, protect_gates
from nascompress.methods.dcs_supernet import arch_parameters, selection
from nascompress.models.build import build_model
from nascompress.profiling import count_flops
from nascompress.dcs_search.cost import CostModel, calibrate

from .conftest import tiny_spec_3_heads

FAMILIES = ["residual", "hidden"]
INPUT = {"img_size": [16, 16], "in_chans": 1, "mean": [0.5], "std": [0.5]}


def random_gates(model, *, seed: int = 0, empty_block: bool = False) -> None:
    """Random logits: about half the gates kept; with ``empty_block`` block 0 keeps no MLP gate."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, blk in enumerate(model.blocks):
            blk.dcs_alpha.copy_(torch.randn(blk.dcs_alpha.shape, generator=g))
            if empty_block and i == 0:
                blk.dcs_alpha.fill_(-1.0)
            th = blk.attn.qk_mask.theta
            th.copy_(torch.randn(th.shape, generator=g))


def widths(model) -> list[int]:
    """Every gated width of a materialized model: MLP hidden or residual widths, Q/K counts per head."""
    out = []
    for blk in model.blocks:
        out += [
            blk.mlp.fc1.out_features if hasattr(blk.mlp, "fc1") else 0,
            blk.mlp.fc1.in_features if hasattr(blk.mlp, "fc1") else 0,
        ]
        out += list(blk.attn.qk_counts or [])
    return out


# ---------------------------------------------------------------------------------------------
# Pure functions


def test_aligned_mask_widens_to_the_alignment_with_the_next_logits():
    logits = torch.tensor(
        [
            [3.0, -0.5, 2.0, -2.0, -0.1, 1.0, -3.0, -1.0],  # 3 positive -> 4: + the next (-0.1)
            [-1.0] * 8,  # none -> 0
            [1.0] * 7 + [-1.0],
        ]
    )  # 7 -> 8 (full)
    m = aligned_mask(logits, align=4)
    assert m.sum(-1).tolist() == [4, 0, 8]
    assert m[0].tolist() == [1, 0, 1, 0, 1, 1, 0, 0]
    assert torch.equal(aligned_mask(logits, align=1), (logits > 0).float())


@pytest.mark.parametrize("family", FAMILIES)
def test_identity_gates_open_is_plain_timm(family):
    for kw in ({}, {"init_values": 0.1}):  # with and without LayerScale
        dense = build_model(tiny_spec_3_heads(**kw)).eval()
        x = torch.randn(3, 1, 16, 16)
        sup = make_supernet(copy.deepcopy(dense), DCSConfig(mlp_gates=family)).eval()  # every gate starts open
        torch.testing.assert_close(sup(x), dense(x))
        random_gates(sup)
        sup.dcs_state.force_dense = True
        torch.testing.assert_close(sup(x), dense(x))


@pytest.mark.parametrize("family,fill", [("residual", "zero"), ("hidden", "zero"), ("hidden", "mean")])
@pytest.mark.parametrize("align", [1, 8])
def test_materialized_equals_masked_supernet_and_reloads(family, align, fill, tmp_path):
    spec = tiny_spec_3_heads(init_values=0.1)
    dense = build_model(spec).eval()
    cfg = DCSConfig(qk_mask="static", mlp_gates=family, align=align, hidden_fill=fill)
    means = [torch.rand(192) for _ in dense.blocks]  # the dense model's mean hidden activations (here: any)
    sup = make_supernet(copy.deepcopy(dense), cfg, fill=means).eval()
    random_gates(sup, empty_block=True)
    mat, record = materialize(sup, cfg)
    x = torch.randn(5, 1, 16, 16)
    torch.testing.assert_close(mat(x), sup(x), rtol=0, atol=1e-4)
    key = "hidden_keep" if family == "hidden" else "mlp_keep"
    assert all(
        b[key] is not None and b["hidden_keep" if key == "mlp_keep" else "mlp_keep"] is None for b in record["blocks"]
    )
    full = 192 if family == "hidden" else 48
    for b in record["blocks"]:  # every kept width is 0, full or a multiple of align
        assert len(b[key]) in (0, full) or len(b[key]) % align == 0
        assert all(len(h) in (0, 16) or len(h) % align == 0 for h in b["qk_keep"])
    assert len(record["blocks"][0][key]) == 0  # an MLP with nothing kept
    assert count_flops(mat, x[:1]).total < count_flops(dense, x[:1]).total
    arch = make_arch(spec, input_spec=INPUT, methods=[record])
    save_model(tmp_path / "mat", mat, arch)
    reloaded = nascompress.load(tmp_path / "mat")
    torch.testing.assert_close(reloaded(x), sup(x), rtol=0, atol=1e-4)
    assert json.loads((tmp_path / "mat" / "arch.json").read_text())["methods"][0]["config"]["mlp_gates"] == family
    # the supernet record round-trips too (the fill buffer is in its state dict)
    save_model(
        tmp_path / "sup", sup, make_arch(spec, input_spec=INPUT, methods=[make_record(sup, cfg, stage="supernet")])
    )
    torch.testing.assert_close(nascompress.load(tmp_path / "sup")(x), sup(x))


def test_hidden_materialization_is_a_plain_block_with_fewer_neurons():
    cfg = DCSConfig(qk_mask="none", mlp_gates="hidden", align=8)
    sup = make_supernet(build_model(tiny_spec_3_heads()), cfg).eval()
    with torch.no_grad():
        sup.blocks[0].dcs_alpha[:100] = -1.0  # 92 of 192 kept -> 96 (aligned up)
    mat, record = materialize(sup, cfg)
    blk = mat.blocks[0]
    assert type(blk).__name__ == "NCBlock" and blk.mlp.fc1.out_features == 96 == blk.mlp.fc2.in_features
    assert blk.mlp.fc1.in_features == 48 == blk.mlp.fc2.out_features  # the residual stream is untouched
    assert len(record["blocks"][0]["hidden_keep"]) == 96 and record["blocks"][1]["hidden_keep"] == list(range(192))


def test_mean_fill_keeps_the_mlp_output_unbiased():
    """A closed hidden neuron filled with its mean changes the MLP's output less than a zeroed one:
    E||(h - c) W||^2 = E||(h - mu) W||^2 + ||(mu - c) W||^2 is smallest at c = mu (on the same images)."""
    dense = build_model(tiny_spec_3_heads()).eval()
    x = torch.randn(32, 1, 16, 16)
    stats = activation_stats(dense, [x])
    h0 = dense.patch_embed(x)
    h0 = dense.blocks[0].attn_half(dense.norm_pre(dense._pos_embed(h0)))  # what block 0's MLP half reads
    ref = dense.blocks[0].mlp_half(h0)
    errs = {}
    for fill in ("zero", "mean"):
        cfg = DCSConfig(qk_mask="none", mlp_gates="hidden", hidden_fill=fill, init_spread=0, align=1)
        sup = make_supernet(copy.deepcopy(dense), cfg, fill=[s.hidden_mean for s in stats]).eval()
        with torch.no_grad():
            blk = sup.blocks[0]
            blk.dcs_alpha.fill_(-1.0)
            blk.dcs_alpha[stats[0].importance.hidden.topk(96).indices] = 1.0
            errs[fill] = (blk.mlp_half(h0) - ref).pow(2).mean().item()
    assert errs["mean"] < errs["zero"]


def test_hidden_gates_refuse_an_mlp_they_cannot_gate():
    model = build_model(tiny_spec_3_heads())
    model.blocks[1].mlp.norm = torch.nn.LayerNorm(192)
    with pytest.raises(NascompressError, match="mlp_gates hidden needs timm's plain Mlp"):
        make_supernet(model, DCSConfig(mlp_gates="hidden"))
    with pytest.raises(NascompressError, match="chosen by the search"):
        make_supernet(build_model(tiny_spec_3_heads()), DCSConfig(mlp_gates="auto"))


def test_old_records_read_as_before():
    """Records written before the families (mlp_gates true/false, no align) load unchanged."""
    assert DCSConfig.from_dict({"qk_mask": "static", "mlp_gates": True}).mlp_gates == "residual"
    assert DCSConfig.from_dict({"qk_mask": "static", "mlp_gates": False}).mlp_gates == "none"
    spec = tiny_spec_3_heads()
    cfg = DCSConfig(qk_mask="static", align=1)
    sup = make_supernet(build_model(spec), cfg).eval()
    random_gates(sup, seed=3)
    _, record = materialize(sup, cfg)
    record["config"].pop("align")
    record["config"]["mlp_gates"] = True
    for b in record["blocks"]:
        b.pop("hidden_keep")
    from nascompress.runs.io import build_from_arch

    model = build_from_arch(make_arch(spec, input_spec=INPUT, methods=[record]))
    assert [b.mlp.fc1.in_features for b in model.blocks] == [len(b["mlp_keep"]) or 48 for b in record["blocks"]]


# ---------------------------------------------------------------------------------------------
# Cost model, protection, calibration


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("align", [1, 8])
def test_cost_model_counts_the_aligned_widths_like_the_profiler(family, align):
    dense = build_model(tiny_spec_3_heads()).eval()
    cfg = DCSConfig(qk_mask="static", mlp_gates=family, align=align)
    sup = make_supernet(copy.deepcopy(dense), cfg).eval()
    x = torch.zeros(1, 1, 16, 16)
    cost = CostModel.build(dense, sup, x)
    assert cost.hard_macs(sup) == pytest.approx(cost.dense)
    for seed in range(3):
        random_gates(sup, seed=seed)
        mat, _ = materialize(sup, cfg)
        assert cost.hard_macs(sup) == pytest.approx(count_flops(mat, x).total, rel=1e-6)


def test_block_weights_scale_the_soft_cost_only():
    dense = build_model(tiny_spec_3_heads()).eval()
    sup = make_supernet(copy.deepcopy(dense), DCSConfig(qk_mask="static", mlp_gates="hidden"))
    cost = CostModel.build(dense, sup, torch.zeros(1, 1, 16, 16), weights=[0.25, 4.0])
    random_gates(sup)
    sup.train()
    sup(torch.randn(2, 1, 16, 16))
    grads = [
        torch.autograd.grad(
            torch.log(cost.soft_macs(sup, weighted=True) / cost.dense_weighted), blk.dcs_alpha, retain_graph=True
        )[0]
        .abs()
        .mean()
        for blk in sup.blocks
    ]
    assert grads[1] > 4 * grads[0]  # the heavier block's gates feel more of the cost
    plain = CostModel.build(dense, sup, torch.zeros(1, 1, 16, 16))
    assert cost.hard_macs(sup.eval()) == plain.hard_macs(sup)  # the real FLOPs are never weighted


def test_protected_gates_stay_open_through_training_and_calibration():
    dense = build_model(tiny_spec_3_heads()).eval()
    sup = make_supernet(copy.deepcopy(dense), DCSConfig(qk_mask="none", mlp_gates="residual", align=1))
    mask = torch.zeros(48, dtype=torch.bool)
    mask[[3, 17]] = True
    protect_gates(sup.blocks[0], mask)
    opt = torch.optim.Adam(arch_parameters(sup), lr=0.5)
    sup.train()
    for _ in range(20):  # a loss that wants every gate closed
        loss = sum(blk.dcs_alpha.sum() for blk in sup.blocks)
        opt.zero_grad()
        loss.backward()
        opt.step()
    alpha = sup.blocks[0].dcs_alpha.detach()
    assert (alpha[mask] == 30.0).all() and (alpha[~mask] < 5).all()
    cost = CostModel.build(dense, sup, torch.zeros(1, 1, 16, 16))
    calibrate(sup.eval(), cost, 0.5)
    keep = selection(sup)[0]["mlp_keep"]
    assert 3 in keep and 17 in keep


def test_the_protected_gates_hook_follows_the_model_to_another_device():
    # a search builds its supernet on the CPU and trains it on CUDA: the hook must not keep a CPU mask
    # (it did, and the main job failed on a GPU); the meta device stands in for CUDA here
    sup = make_supernet(
        build_model(tiny_spec_3_heads()).eval(), DCSConfig(qk_mask="none", mlp_gates="residual", align=1)
    )
    mask = torch.zeros(48, dtype=torch.bool)
    mask[[3, 17]] = True
    protect_gates(sup.blocks[0], mask)
    (hook,) = sup.blocks[0].dcs_alpha._backward_hooks.values()
    out = hook(torch.ones(48, device="meta"))
    assert out.device.type == "meta" and out.shape == (48,)
    assert hook(torch.ones(48))[mask].eq(0).all() and hook(torch.ones(48))[~mask].eq(1).all()


def test_outlier_gates_find_massive_activations():
    from nascompress.dcs_search.protect import cost_weights, outlier_gates

    model = build_model(tiny_spec_3_heads()).eval()
    with torch.no_grad():  # residual channel 5 carries a massive value into block 1 (as in DINOv2)
        model.blocks[0].mlp.fc2.bias[5] = 500.0
        model.blocks[0].mlp.fc1.bias[9] = 30.0  # hidden neuron 9 of block 0 fires far above the rest
    stats = activation_stats(model, [torch.randn(8, 1, 16, 16)])
    res = outlier_gates(stats, "residual", ratio=20)
    assert res[1].nonzero().flatten().tolist() == [5] and not res[0].any()
    hid = outlier_gates(stats, "hidden", ratio=20)
    assert 9 in hid[0].nonzero().flatten().tolist()
    assert int(outlier_gates(stats, "hidden", ratio=0.0, max_share=0.05)[0].sum()) == int(0.05 * 192)  # capped
    w = cost_weights([1.0, 4.0, 0.25, 1.0])
    assert w[1] == pytest.approx(0.5) and w[2] == pytest.approx(2.0) and w[0] == 1.0


# ---------------------------------------------------------------------------------------------
# Probe, schedule


def test_family_probe_prefers_the_family_that_keeps_the_model_alive():
    """A model that depends on a few residual channels (massive activations) loses them under the
    residual family's pruning; its hidden neurons are redundant: the probe chooses hidden, and says why."""
    from nascompress.dcs_search.family import choose_family

    torch.manual_seed(0)
    model = build_model(tiny_spec_3_heads()).eval()
    with torch.no_grad():
        for blk in model.blocks:
            blk.mlp.fc1.weight[96:] = blk.mlp.fc1.weight[:96]  # every hidden neuron has a twin: redundant
            blk.mlp.fc1.bias[96:] = blk.mlp.fc1.bias[:96]
            blk.mlp.fc2.weight[:, :96] *= 0.5
            blk.mlp.fc2.weight[:, 96:] = blk.mlp.fc2.weight[:, :96]
    images = [torch.randn(16, 1, 16, 16)]
    stats = activation_stats(model, images)
    family, info = choose_family(model, images, stats, target=0.7, align=8, hidden_fill="mean")
    assert family == "hidden" and info.family_kl["hidden"] < info.family_kl["residual"]
    assert info.family_reason.startswith("hidden: ") and "KL" in info.family_reason
    assert 0 < info.family_shares[1] < info.family_shares[0] < 1


def test_progressive_target_moves_from_dense_to_the_target():
    from nascompress.dcs_search.search_config import DCSSearchConfig

    cfg = DCSSearchConfig(target_flops=0.6, target_ramp=0.5)
    assert cfg.target_at(0.0) == 1.0 and cfg.target_at(0.25) == pytest.approx(0.8)
    assert cfg.target_at(0.5) == pytest.approx(0.6) == cfg.target_at(0.9)
    assert DCSSearchConfig(target_flops=0.6, target_ramp=0).target_at(0.0) == 0.6
    assert DCSSearchConfig().target_at(0.3) is None
    with pytest.raises(NascompressError, match="arch_loss kd distils"):
        DCSSearchConfig(distill=0, feat_distill=0)


def test_auto_batch_gives_enough_steps():
    from nascompress.train.auto_batch import auto_batch_size

    assert [auto_batch_size(n) for n in (100, 2000, 3300, 6400, 12800, 54000)] == [16, 16, 32, 64, 128, 128]
