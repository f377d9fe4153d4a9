"""DCS: Gumbel-sigmoid masks, the supernet identity, materialization equivalence, search and CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

import nascompress
from nascompress.errors import NascompressError
from nascompress.runs.io import make_arch, save_model
from nascompress.methods.dcs import DCSConfig, make_record, make_supernet, materialize
from nascompress.methods.dcs_supernet import arch_parameters, selection
from nascompress.methods.dcs_gates import gumbel_sigmoid
from nascompress.models.build import ModelSpec, build_model
from nascompress.profiling import count_flops
from nascompress.dcs_search.cost import CostModel
from nascompress.dcs_search.metrics import DCSMetrics

from .conftest import interrupted_at_selection, tiny_spec_3_heads

QK_MODES = ["input", "static", "none"]


def randomize_gates(model, *, seed: int = 0, empty_block: bool = False) -> None:
    """Random alpha/theta so that about half the channels are kept (one head keeps none)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, blk in enumerate(model.blocks):
            blk.dcs_alpha.copy_(torch.randn(blk.dcs_alpha.shape, generator=g))
            if empty_block and i == 0:
                blk.dcs_alpha.fill_(-1.0)
            qm = blk.attn.qk_mask
            th = None if qm is None else qm.theta
            if isinstance(th, torch.nn.Linear):
                th.weight.copy_(torch.randn(th.weight.shape, generator=g) * 0.2)
                th.bias.copy_(torch.randn(th.bias.shape, generator=g))
            elif isinstance(th, torch.nn.Parameter):
                th.copy_(torch.randn(th.shape, generator=g))
                th[: blk.attn.head_dim] = -1.0  # head 0 keeps no Q/K channel: uniform attention


# ---------------------------------------------------------------------------------------------
# Pure functions


def test_gumbel_sigmoid_hard_straight_through_and_deterministic():
    logits = torch.randn(1000, requires_grad=True)
    m, soft = gumbel_sigmoid(logits, tau=2.0, generator=torch.Generator().manual_seed(1))
    assert set(m.detach().unique().tolist()) <= {0.0, 1.0}
    torch.testing.assert_close(m.detach(), (soft.detach() > 0.5).float())
    m.sum().backward()
    g_st = logits.grad.clone()
    logits.grad = None
    _, soft2 = gumbel_sigmoid(logits, tau=2.0, generator=torch.Generator().manual_seed(1))
    soft2.sum().backward()
    torch.testing.assert_close(g_st, logits.grad)  # backward = the soft mask's gradient
    m3, _ = gumbel_sigmoid(logits.detach(), tau=2.0, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(m3, m.detach())  # same seed, same Gumbel samples
    m4, _ = gumbel_sigmoid(logits.detach(), tau=2.0, noise=False)
    torch.testing.assert_close(m4, (logits.detach() > 0).float())  # inference: no noise


def test_gumbel_noise_is_logistic():
    m, soft = gumbel_sigmoid(torch.full((200_000,), 1.0), tau=1.0, generator=torch.Generator().manual_seed(0))
    # P(1 + g1 - g2 > 0) = sigmoid(1) for g1 - g2 ~ Logistic(0, 1)
    assert abs(m.mean().item() - torch.sigmoid(torch.tensor(1.0)).item()) < 0.01


# ---------------------------------------------------------------------------------------------
# Supernet identity


@pytest.mark.parametrize("qk", QK_MODES)
@pytest.mark.parametrize("init_values", [None, 0.1])
def test_supernet_identity(qk, init_values):
    kw = {} if init_values is None else {"init_values": init_values}
    dense = build_model(tiny_spec_3_heads(**kw)).eval()
    x = torch.randn(3, 1, 16, 16)
    ref = dense(x)
    sup = make_supernet(copy.deepcopy(dense), DCSConfig(qk_mask=qk)).eval()
    assert set(dense.state_dict()) <= set(sup.state_dict())  # timm keys kept, new ones added
    randomize_gates(sup)
    sup.dcs_state.force_dense = True  # all masks forced to 1
    torch.testing.assert_close(sup(x), ref)
    fresh = make_supernet(copy.deepcopy(dense), DCSConfig(qk_mask=qk)).eval()  # gates start open
    torch.testing.assert_close(fresh(x), ref)


def test_supernet_masks_change_output_and_train_gradients_reach_alpha():
    sup = make_supernet(build_model(tiny_spec_3_heads()), DCSConfig(qk_mask="static", mlp_gates="residual"))
    randomize_gates(sup)
    sup.train()
    sup(torch.randn(4, 1, 16, 16)).logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in arch_parameters(sup))


@pytest.mark.parametrize("fill", [False, True])
@pytest.mark.parametrize("block0", ["random", "empty", "open"])
def test_hard_hidden_gates_compute_only_open_neurons_with_the_same_outputs_and_gradients(fill, block0, monkeypatch):
    """A hidden-gated MLP under a hard mask in training (the search's weight steps) computes only its
    open neurons (a block with every neuron open: its plain MLP): the same logits and the same weight
    gradients as the masked dense computation. Inference keeps the masked computation (the profiler
    counts the supernet's Linear modules)."""
    import nascompress.methods.dcs_supernet as dcs_mod  # where DCSBlock looks _compactable up

    torch.manual_seed(0)
    model = build_model(tiny_spec_3_heads())
    fills = [torch.randn(blk.mlp.fc1.out_features) for blk in model.blocks] if fill else None
    sup = make_supernet(model, DCSConfig(qk_mask="static", mlp_gates="hidden"), fill=fills)
    randomize_gates(sup, empty_block=block0 == "empty")
    if block0 == "open":
        with torch.no_grad():
            sup.blocks[0].dcs_alpha.fill_(1.0)
    sup.dcs_state.sample = False  # a weight step at the current architecture
    for p in arch_parameters(sup):
        p.requires_grad_(False)
    x = torch.randn(5, 1, 16, 16)
    calls = {"n": 0}
    real = dcs_mod._compactable

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    def run(compact: bool):
        monkeypatch.setattr(dcs_mod, "_compactable", counted if compact else (lambda *a, **k: False))
        sup.zero_grad(set_to_none=True)
        out = sup.train()(x)
        out.logsumexp(-1).sum().backward()
        grads = {n: p.grad.clone() for n, p in sup.named_parameters() if p.grad is not None}
        with torch.no_grad():
            ev = sup.eval()(x)
        return out.detach(), grads, ev

    masked, g_masked, ev_masked = run(False)
    compact, g_compact, ev_compact = run(True)
    assert calls["n"] == len(sup.blocks)  # the compact path ran in training only
    torch.testing.assert_close(compact, masked, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ev_compact, ev_masked, rtol=1e-5, atol=1e-5)
    assert g_compact.keys() == g_masked.keys()
    for n in g_masked:
        torch.testing.assert_close(g_compact[n], g_masked[n], rtol=1e-4, atol=1e-5, msg=n)
    closed = (sup.blocks[1].dcs_alpha <= 0).nonzero().flatten()
    assert len(closed) and g_compact["blocks.1.mlp.fc1.weight"][closed].abs().sum() == 0


# ---------------------------------------------------------------------------------------------
# Materialization


@pytest.mark.parametrize("qk", QK_MODES)
def test_materialized_equals_supernet_and_reloads(qk, tmp_path):
    spec = tiny_spec_3_heads()
    dense = build_model(spec).eval()
    cfg = DCSConfig(qk_mask=qk)
    sup = make_supernet(copy.deepcopy(dense), cfg).eval()
    randomize_gates(sup, empty_block=True)
    mat, record = materialize(sup, cfg)
    x = torch.randn(5, 1, 16, 16)
    torch.testing.assert_close(mat(x), sup(x), rtol=0, atol=1e-4)

    arch = make_arch(spec, input_spec={"img_size": [16, 16], "in_chans": 1, "mean": [0.5], "std": [0.5]})
    save_model(tmp_path / "dense", dense, arch)
    save_model(tmp_path / "mat", mat, dict(arch, methods=[record]))
    (tmp_path / "mat" / "arch.json").unlink()  # the safetensors metadata alone is enough
    reloaded = nascompress.load(tmp_path / "mat" / "model.safetensors")
    torch.testing.assert_close(reloaded(x), sup(x), rtol=0, atol=1e-4)
    save_model(tmp_path / "mat", mat, dict(arch, methods=[record]))
    torch.testing.assert_close(nascompress.load(tmp_path / "mat")(x), sup(x), rtol=0, atol=1e-4)

    n_params = sum(p.numel() for p in reloaded.parameters())
    assert n_params < sum(p.numel() for p in sup.parameters())
    size = (tmp_path / "mat" / "model.safetensors").stat().st_size
    assert n_params < sum(p.numel() for p in dense.parameters())  # even with the runtime theta Linear
    assert size < (tmp_path / "dense" / "model.safetensors").stat().st_size


@pytest.mark.parametrize("qk", QK_MODES)
def test_cost_model_matches_profiler(qk):
    dense = build_model(tiny_spec_3_heads()).eval()
    sup = make_supernet(copy.deepcopy(dense), DCSConfig(qk_mask=qk)).eval()
    x = torch.zeros(1, 1, 16, 16)
    cost = CostModel.build(dense, sup, x)
    assert cost.dense == count_flops(dense, x).total
    randomize_gates(sup, seed=3)
    mat, _ = materialize(sup, DCSConfig(qk_mask=qk))
    assert cost.hard_macs(sup) == pytest.approx(count_flops(mat, x).total, rel=1e-9)
    if qk == "input":  # the runtime theta Linear is counted: N x C x C per block
        theta = sum(17 * 48 * 48 for _ in sup.blocks)
        assert count_flops(sup, x).total == pytest.approx(cost.dense + theta)


def test_static_qk_keeps_original_scale():
    cfg = DCSConfig(qk_mask="static", mlp_gates="residual", align=1)
    sup = make_supernet(build_model(tiny_spec_3_heads()), cfg).eval()
    randomize_gates(sup, seed=1)
    mat, record = materialize(sup, cfg)
    attn = mat.blocks[1].attn
    assert attn.scale == pytest.approx(attn.head_dim**-0.5)
    assert attn.qk_counts == [len(h) for h in record["blocks"][1]["qk_keep"]]
    assert attn.qkv.out_features == 2 * attn.num_heads * attn.qk_dim + attn.attn_dim  # padded to the largest head
    assert attn.qk_dim == max(attn.qk_counts) < attn.head_dim


def test_record_round_trip_rebuilds_supernet(tmp_path):
    spec = tiny_spec_3_heads()
    cfg = DCSConfig(qk_mask="static", mlp_gates="residual")
    sup = make_supernet(build_model(spec), cfg).eval()
    randomize_gates(sup)
    arch = make_arch(
        spec,
        input_spec={"img_size": [16, 16], "in_chans": 1, "mean": [0.5], "std": [0.5]},
        methods=[make_record(sup, cfg, stage="supernet")],
    )
    save_model(tmp_path, sup, arch)
    x = torch.randn(2, 1, 16, 16)
    torch.testing.assert_close(nascompress.load(tmp_path)(x), sup(x))


# ---------------------------------------------------------------------------------------------
# The search and the CLI


def run_cli(*args):
    from nascompress.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def search_args(tiny_run, out, *extra):
    return [
        "search",
        "dcs",
        tiny_run,
        "--out",
        out,
        "--epochs",
        2,
        "--batch-size",
        32,
        "--arch-lr",
        0.05,
        "--alpha-init",
        0.5,
        "--device",
        "cpu",
        "--mlp-gates",
        "residual",
        "--align",
        1,
        *extra,
    ]


def landing_args(tiny_run, out, *extra):
    """A tiny search long enough for the controller to settle: 3 epochs of 90 steps (27 arch steps each).
    CE on the architecture steps and the target from the first step (the paper's): the distillation
    loss to this barely trained model and the ramp hold its gates open longer than 81 steps allow (the
    defaults land on the pretrained-like model of test_dcs_recovery)."""
    return [
        "search",
        "dcs",
        tiny_run,
        "--out",
        out,
        "--epochs",
        3,
        "--batch-size",
        16,
        "--train-limit",
        480,
        "--eval-limit",
        100,
        "--arch-lr",
        0.15,
        "--alpha-init",
        1.0,
        "--base-lr",
        1e-3,
        "--device",
        "cpu",
        "--no-calibrate",
        "--mlp-gates",
        "residual",
        "--align",
        1,
        "--arch-loss",
        "ce",
        "--target-ramp",
        0,
        *extra,
    ]


@pytest.fixture(scope="module")
def searched(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("dcs") / "search"
    res = run_cli(*landing_args(tiny_run, out, "--target-flops", 0.7, "--json"))
    assert res.exit_code == 0, res.output
    return out


def test_cost_gradient_reaches_every_alpha_and_theta():
    sup = make_supernet(build_model(tiny_spec_3_heads()), DCSConfig(qk_mask="static", mlp_gates="residual"))
    cost = CostModel.build(build_model(tiny_spec_3_heads()).eval(), sup, torch.zeros(1, 1, 16, 16))
    randomize_gates(sup, seed=2)
    sup.train()
    sup(torch.randn(2, 1, 16, 16))
    torch.log(cost.soft_macs(sup) / cost.dense).backward()
    for p in arch_parameters(sup):
        assert p.grad is not None and (p.grad != 0).all(), p.shape  # every channel, every head
        assert (p.grad > 0).all()  # a channel more open costs more


def test_soft_cost_tracks_the_hard_cost_as_masks_harden():
    """With the soft masks at their hard values (tau -> 0, no noise) the soft cost is the exact cost,
    up to the smooth maximum over heads (the padded Q/K width)."""
    sup = make_supernet(build_model(tiny_spec_3_heads()), DCSConfig(qk_mask="static", mlp_gates="residual", align=1))
    cost = CostModel.build(build_model(tiny_spec_3_heads()).eval(), sup, torch.zeros(1, 1, 16, 16))
    randomize_gates(sup, seed=4)
    with torch.no_grad():
        for p in arch_parameters(sup):
            p.mul_(100)  # far from the threshold: sigmoid(theta / tau) is 0 or 1
    sup.eval()
    st = sup.dcs_state
    st.soft_gates = {j: (b.dcs_alpha > 0).float() for j, b in enumerate(sup.blocks)}
    st.soft_qk = {j: (b.attn.qk_mask.theta > 0).float() for j, b in enumerate(sup.blocks)}
    assert cost.soft_macs(sup).item() == pytest.approx(cost.hard_macs(sup), rel=0.02)


def test_a_static_theta_closes_under_the_cost():
    """The cost alone (lambda log cost) closes Q/K channels: theta is pushed below the threshold."""
    from nascompress.dcs_search.cost import CostModel

    sup = make_supernet(build_model(tiny_spec_3_heads()), DCSConfig(qk_mask="static", mlp_gates=False, theta_init=0.5))
    cost = CostModel.build(build_model(tiny_spec_3_heads()).eval(), sup, torch.zeros(1, 1, 16, 16))
    theta = arch_parameters(sup)
    opt = torch.optim.Adam(theta, lr=0.05)
    sup.train()
    sup.dcs_state.tau = 1.0
    x = torch.randn(2, 1, 16, 16)
    for _ in range(40):
        sup(x)
        loss = torch.log(cost.soft_macs(sup) / cost.dense)
        opt.zero_grad()
        loss.backward()
        opt.step()
    kept = [len(h) for b in selection(sup) for h in b["qk_keep"]]
    assert min(kept) < 16 and cost.hard_macs(sup) < cost.dense  # channels closed: cheaper


def test_search_lands_on_target_by_itself_and_logs(searched):
    metrics = json.loads((searched / "metrics.json").read_text())
    assert metrics["finished"] and abs(metrics["flops_ratio"] / 0.7 - 1) <= 0.05
    assert metrics["calibrated"] is False and metrics["calibration"] is None  # no threshold shift was needed
    log = [json.loads(ln) for ln in (searched / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [0, 1, 2, 3] and log[0]["start"]
    assert log[2]["tau"] == pytest.approx(4.5 * 0.95)
    for key in ("train_ce_w", "train_ce_a", "flops_ratio", "expected_flops_ratio", "mlp_kept", "qk_kept", "lam"):
        assert key in log[1]
    arch = json.loads((searched / "arch.json").read_text())
    assert arch["methods"][-1]["stage"] == "supernet" and len(arch["methods"][-1]["blocks"]) == 2
    assert json.loads((searched / "config.json").read_text())["data"]["train_limit"] == 480
    assert log[1]["lam"] > 0  # the supernet starts above the target: lambda is steered up
    for rec in log[1:]:  # measured at the first arch-step of every epoch, and applied for that epoch
        bal = rec["grad_balance"]
        assert bal["task_grad_median"] > 0 and bal["cost_grad_median"] > 0
        assert rec["lam_scale"] == pytest.approx(max(1.0, bal["task_grad_median"] / bal["cost_grad_median"]))
    assert metrics["dense_val_top1"] == log[0]["val_top1"]
    kl = metrics["init_kl"]  # the default: auto
    assert metrics["init"] == ("activation" if kl["activation"] < 0.9 * kl["weight"] else "weight")
    assert log[1]["init"] == metrics["init"] and log[1]["init_kl"] == metrics["init_kl"] and "init" not in log[2]


def test_the_search_metrics_record_is_its_file_typed(searched, tmp_path):
    """``DCSMetrics`` reads the metrics.json a search wrote and writes it again as the same bytes; its
    readers get typed fields."""
    from nascompress.dcs_search.metrics import Comparison
    from nascompress.runs.json_io import write_json

    path = searched / "metrics.json"
    d = json.loads(path.read_text())
    m = DCSMetrics.from_dict(d, source=str(path))
    assert m.to_dict() == d and list(m.to_dict()) == list(d)
    write_json(tmp_path / "again.json", m.to_dict())
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()
    assert m.finished is True and m.flops_ratio == d["flops_ratio"] and m.val_top1 == d["val_top1"]
    assert m.cost == "flops" and m.target_flops == m.target == 0.7 and m.ratio == m.flops_ratio
    assert m.target_latency is None and m.latency_ratio is None and "latency_ratio" not in m.to_dict()
    assert isinstance(m.comparison, Comparison) and m.comparison.kept == m.kept and m.kept in ("dcs", "magnitude")
    assert m.calibrated is False and m.calibration is None and m.stopped is None
    assert m.mlp_gates == "residual" and m.mlp_kept == d["mlp_kept"] and m.qk_kept == d["qk_kept"]
    assert m.dense_val_top1 == d["dense_val_top1"] and m.extra["init"] == d["init"]  # the rest as it is


def test_materialize_cli_and_load(searched, tmp_path):
    out = tmp_path / "mat"
    res = run_cli("materialize", searched, "--out", out, "--json")
    assert res.exit_code == 0, res.output
    m = json.loads((out / "metrics.json").read_text())
    assert m["max_abs_logit_diff"] <= 1e-4 and abs(m["flops_ratio_vs_dense"] / 0.7 - 1) <= 0.05
    model = nascompress.load(out)
    sup = nascompress.load(searched)
    x = torch.randn(4, 1, 16, 16)
    torch.testing.assert_close(model(x), sup(x), rtol=0, atol=1e-4)
    assert count_flops(model, x).total == pytest.approx(m["macs"])
    data = json.loads((out / "config.json").read_text())["data"]  # the dense run's, not the search's limit
    assert data["dataset"] == "synthetic" and data["train_limit"] is None
    res = run_cli("evaluate", out, "--json")
    assert res.exit_code == 0, res.output


def test_search_resume_matches_uninterrupted(tiny_run, tmp_path, monkeypatch):
    full = tmp_path / "full"
    assert run_cli(*search_args(tiny_run, full)).exit_code == 0
    part = tmp_path / "part"
    with interrupted_at_selection(2):  # the end of the second epoch, before its checkpoint
        assert run_cli(*search_args(tiny_run, part)).exit_code == 130
    assert not (part / "metrics.json").exists()
    res = run_cli(*search_args(tiny_run, part, "--resume"))
    assert res.exit_code == 0, res.output
    a, b = nascompress.load(full).state_dict(), nascompress.load(part).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k])
    log = [json.loads(ln) for ln in (part / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [0, 1, 2]


def test_search_that_collapses_stops_with_a_message(tiny_run, tmp_path):
    out = tmp_path / "c"
    res = run_cli(*search_args(tiny_run, out, "--lr", 1.0, "--max-val-drop", 1, "--distill", 0, "--no-baseline"))
    assert res.exit_code == 1 and "the gate search stopped after epoch" in res.output
    assert "--max-val-drop 1 points" in res.output
    assert "--resume --max-val-drop 100" in res.output or "end-of-search calibration" in res.output
    metrics = out / "metrics.json"
    assert not metrics.exists()  # no finished search to materialize


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5"])
def test_bad_target_flops(tiny_run, tmp_path, value):
    out = tmp_path / "s"
    res = run_cli(*search_args(tiny_run, out, "--target-flops", value))
    assert res.exit_code == 1 and "--target-flops must be in (0, 1]" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not out.exists()


def test_materialize_refuses_unfinished_search(tiny_run, tmp_path):
    out = tmp_path / "m"
    res = run_cli("materialize", tiny_run, "--out", out)
    assert res.exit_code == 1 and "no finished DCS search" in res.output and not out.exists()


def _edited(run, arch) -> None:
    """Write an edited arch.json into a finished run: first refused as a run whose files changed
    since; then vouched for again (as if the run had written it) for the checks behind."""
    from nascompress.runs.io import METRICS_FILE, file_sha256

    (run / "arch.json").write_text(json.dumps(arch))
    with pytest.raises(nascompress.NascompressError, match="arch.json is not the file the run finished with"):
        nascompress.load(run)
    metrics = json.loads((run / METRICS_FILE).read_text())
    metrics["finished_files"]["arch.json"] = {
        "bytes": (run / "arch.json").stat().st_size,
        "sha256": file_sha256(run / "arch.json"),
    }
    (run / METRICS_FILE).write_text(json.dumps(metrics))


def test_materialize_refuses_arch_not_matching_weights(searched, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(searched, broken)
    arch = json.loads((broken / "arch.json").read_text())
    arch["methods"][-1]["blocks"][0]["mlp_keep"] = arch["methods"][-1]["blocks"][0]["mlp_keep"][1:]
    _edited(broken, arch)
    out = tmp_path / "m"
    res = run_cli("materialize", broken, "--out", out)
    assert res.exit_code == 1 and "do not match" in res.output and not out.exists()
    arch["model"]["kwargs"]["embed_dim"] = 64  # a different model altogether
    _edited(broken, arch)
    res = run_cli("materialize", broken, "--out", out)
    assert res.exit_code == 1 and "does not match the model" in res.output and not out.exists()


def test_materialized_arch_not_matching_weights(searched, tmp_path):
    import shutil

    out = tmp_path / "mat"
    assert run_cli("materialize", searched, "--out", out).exit_code == 0
    arch = json.loads((out / "arch.json").read_text())
    blocks = arch["methods"][-1]["blocks"]
    blocks[1]["mlp_keep"] = blocks[1]["mlp_keep"][:-1]
    _edited(out, arch)
    with pytest.raises(nascompress.NascompressError, match="does not match the model"):
        nascompress.load(out)
    shutil.rmtree(out)


def test_search_from_timm_name_with_local_weights(tmp_path):
    from safetensors.torch import save_file

    dense = build_model(ModelSpec("vit_tiny_patch16_224", {"img_size": 16, "num_classes": 10}))
    save_file({k: v.contiguous() for k, v in dense.state_dict().items()}, str(tmp_path / "w.safetensors"))
    out = tmp_path / "s"
    res = run_cli("search", "dcs", "vit_tiny_patch16_224", "--dataset", "synthetic", "--out", out)
    assert res.exit_code == 1 and "--weights" in res.output and not out.exists()
    res = run_cli(
        "search",
        "dcs",
        "vit_tiny_patch16_224",
        "--weights",
        tmp_path / "w.safetensors",
        "--img-size",
        16,
        "--dataset",
        "synthetic",
        "--out",
        out,
        "--epochs",
        1,
        "--train-limit",
        64,
        "--eval-limit",
        32,
        "--batch-size",
        32,
        "--lr",
        1e-9,
        "--min-lr",
        1e-10,
        "--device",
        "cpu",
    )
    assert res.exit_code == 0, res.output
    arch = json.loads((out / "arch.json").read_text())
    assert arch["model"]["name"] == "vit_tiny_patch16_224" and len(arch["methods"][0]["blocks"]) == 12
    x = torch.randn(2, 3, 16, 16)
    sup = nascompress.load(out)
    sup.dcs_state.force_dense = True
    torch.testing.assert_close(sup(x), dense.eval()(x), rtol=0, atol=1e-4)  # the weights came from the file


def test_lambda_steer_is_a_signed_pi_controller():
    from nascompress.dcs_search.cost import LambdaSteer

    s = LambdaSteer(target=0.5, integral=0.0, gain=2.0, rate=0.1, lam_max=5.0)
    # every gate still open (ratio 1): proportional push only, the integral does not wind up
    assert [s.update(1.0) for _ in range(50)] == [pytest.approx(2.0)] * 50 and s.integral == 0.0
    assert s.update(0.75) == pytest.approx(0.05 + 1.0)  # some gates closed, above target: integrates
    lams = [s.update(0.25) for _ in range(20)]  # below target: lambda falls, then turns negative (reopen)
    assert lams[0] < 1.05 and lams[-1] < 0 and all(b <= a for a, b in zip(lams, lams[1:]))
    assert all(abs(s.update(0.9)) <= 5.0 for _ in range(200)) and s.integral == 5.0  # clipped at lam_max


def test_calibrate_lands_on_target():
    from nascompress.dcs_search.cost import calibrate

    dense = build_model(tiny_spec_3_heads(depth=3)).eval()
    sup = make_supernet(copy.deepcopy(dense), DCSConfig(qk_mask="none", mlp_gates="residual")).eval()
    cost = CostModel.build(dense, sup, torch.zeros(1, 1, 16, 16))
    randomize_gates(sup, seed=5)
    calibrate(sup, cost, 0.55)
    assert abs(cost.hard_macs(sup) / cost.dense / 0.55 - 1) < 0.02


def test_calibrate_at_most_lands_at_or_just_under_the_target():
    """``at_most`` (the pipeline's goal): of the shifts, the closest at or under the target, never above;
    without it the closest either side."""
    from nascompress.dcs_search.cost import calibrate

    dense = build_model(tiny_spec_3_heads(depth=3)).eval()
    for target in (0.5, 0.61, 0.73):
        sup = make_supernet(copy.deepcopy(dense), DCSConfig(qk_mask="none", mlp_gates="residual")).eval()
        cost = CostModel.build(dense, sup, torch.zeros(1, 1, 16, 16))
        randomize_gates(sup, seed=5)
        saved = [b.dcs_alpha.clone() for b in sup.blocks]
        calibrate(sup, cost, target)
        nearest = cost.hard_macs(sup) / cost.dense
        with torch.no_grad():
            for b, a in zip(sup.blocks, saved):
                b.dcs_alpha.copy_(a)
        calibrate(sup, cost, target, at_most=True)
        under = cost.hard_macs(sup) / cost.dense
        assert under <= target and abs(under / target - 1) < 0.05, (target, under)
        assert under == nearest if nearest <= target else under < nearest


def test_search_at_most_ends_at_or_under_its_target(tiny_run, tmp_path):
    """``--at-most``: the searched architecture stands at or under the target (a search that ended just
    above it is shifted, reported as calibration with reason at_most)."""
    out = tmp_path / "r"
    # --max-calibration 0.05: wherever in its +-5% band this machine's search lands, the shift under is allowed
    res = run_cli(*landing_args(tiny_run, out, "--target-flops", 0.6, "--at-most", "--max-calibration", 0.05))
    assert res.exit_code == 0, res.output
    m = json.loads((out / "metrics.json").read_text())
    assert m["flops_ratio"] <= 0.6 and abs(m["flops_ratio"] / 0.6 - 1) <= 0.05
    assert json.loads((out / "config.json").read_text())["search"]["at_most"] is True
    if m["calibrated"]:
        assert m["calibration"]["ratio_after"] <= 0.6 < m["calibration"]["ratio_before"]
        assert m["calibration"]["reason"] in ("at_most", "off target")
        cal = DCSMetrics.from_dict(m, source="metrics.json").calibration  # typed: the same values
        assert (cal.ratio_before, cal.ratio_after, cal.move, cal.reason) == tuple(
            m["calibration"][k] for k in ("ratio_before", "ratio_after", "move", "reason")
        )
        assert cal.to_dict() == m["calibration"]


def test_round_blocks_closes_small_and_opens_nearly_full_mlps():
    from nascompress.dcs_search.cost import round_blocks

    sup = make_supernet(build_model(tiny_spec_3_heads(depth=3)), DCSConfig(qk_mask="none", mlp_gates="residual")).eval()
    with torch.no_grad():
        sup.blocks[0].dcs_alpha[:45] = -1.0  # 3 of 48 kept: closed
        sup.blocks[1].dcs_alpha[:2] = -1.0  # 46 of 48 kept: opened
        sup.blocks[2].dcs_alpha[:24] = -1.0  # half kept: left alone
    assert round_blocks(sup, 4) == {"closed": [0], "opened": [1]}
    assert [len(b["mlp_keep"]) for b in selection(sup)] == [0, 48, 24]
    mat, _ = materialize(sup, DCSConfig(qk_mask="none", mlp_gates="residual"))
    assert type(mat.blocks[1]).__name__ == "NCBlock"  # fully kept: no gather, no write-back
    x = torch.randn(2, 1, 16, 16)
    torch.testing.assert_close(mat(x), sup(x), rtol=0, atol=1e-4)


def test_search_round_mlp_leaves_no_tiny_mlp(tiny_run, tmp_path):
    out = tmp_path / "r"
    res = run_cli(*landing_args(tiny_run, out, "--target-flops", 0.6, "--round-mlp", 4))
    assert res.exit_code == 0, res.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert abs(metrics["flops_ratio"] / 0.6 - 1) <= 0.05 and not metrics["calibrated"]
    assert all(n == 0 or 4 <= n <= 32 - 4 or n == 32 for n in metrics["mlp_kept"]), metrics["mlp_kept"]


def test_grad_balance_scales_the_cost_where_ce_outweighs_it():
    """lam_scale = max(1, median |dCE/dlogit| / median |d log cost/dlogit|), from gradients alone."""
    from nascompress.dcs_search.hooks import DCSSearchHooks

    hooks = DCSSearchHooks.__new__(DCSSearchHooks)  # only what grad_balance() reads
    alpha, theta = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(2))
    hooks.arch_params = [alpha, theta]
    w = torch.tensor([1.0, 2.0, 3.0, 4.0, 50.0])  # median |dCE/dalpha, dCE/dtheta| over the 7 logits: 4
    ce = (w * alpha).sum() + (torch.tensor([-6.0, 9.0]) * theta).sum()
    cost = (0.05 * alpha).sum() + (0.05 * theta).sum()  # median 0.05
    assert hooks.grad_balance(ce, cost) == pytest.approx(4.0 / 0.05)
    assert hooks.balance == {"task_grad_median": pytest.approx(4.0), "cost_grad_median": pytest.approx(0.05)}
    assert hooks.grad_balance(0.01 * ce, cost) == 1.0  # the cost already outweighs CE: lambda as it is
    assert alpha.grad is None  # read, not accumulated


def test_search_rescued_only_by_calibration_names_the_missing_steps():
    """When the end-of-search threshold shift did the pruning (the gates never got near the target) and
    that broke the model, the message says the search lacked steps, not that an lr was too high."""
    from nascompress.dcs_search.search_config import DCSSearchConfig
    from nascompress.dcs_search.hooks import DCSSearchHooks

    hooks = DCSSearchHooks.__new__(DCSSearchHooks)  # only what check() reads
    hooks.cfg, hooks.arch_lr, hooks.epochs, hooks.log = DCSSearchConfig(target_flops=0.65), 0.3, 2, []
    start = {"epoch": 0, "val_top1": 86.05}
    hooks.check({"epoch": 1, "val_top1": 85.0, "calibration": {"ratio_before": 1.0, "alpha_shift": 5.0}}, start)
    with pytest.raises(NascompressError) as e:
        hooks.check({"epoch": 1, "val_top1": 9.55, "calibration": {"ratio_before": 1.0, "alpha_shift": 5.0}}, start)
    msg = str(e.value)
    assert "from 86.05% (the dense model) to 9.55%" in msg
    assert "move the FLOPs ratio from 1.000 to the target 0.65" in msg and "too few architecture steps" in msg
    assert "rerun the same command with force epochs 4" in msg  # the library names fields; the CLI, its options:
    from nascompress.cli.common import cli_words

    assert "rerun the same command with --force --epochs 4" in cli_words(e.value)


# ---------------------------------------------------------------------------------------------
# Gate initialisation from measured activations (pretrained models)


def test_activation_importance_ranks_dead_channels_last():
    from nascompress.methods.dcs_importance import activation_importance

    model = build_model(tiny_spec_3_heads()).eval()
    blk = model.blocks[0]
    with torch.no_grad():  # residual channel 5: LN2 emits 0 there and the MLP writes nothing to it
        blk.norm2.weight[5] = 0.0
        blk.norm2.bias[5] = 0.0
        blk.mlp.fc2.weight[5] = 0.0
        blk.mlp.fc2.bias[5] = 0.0
        blk.attn.qkv.weight[3] = 0.0  # query channel 3 of head 0: always 0
        blk.attn.qkv.bias[3] = 0.0
        blk.mlp.fc1.weight[7] = 0.0  # hidden neuron 7: fc1 row 0, bias -10: GELU(-10) ~ 0
        blk.mlp.fc1.bias[7] = -10.0
    imp = activation_importance(model, [torch.randn(8, 1, 16, 16), torch.randn(4, 1, 16, 16)])
    assert len(imp) == 2
    mlp, qk, hidden = imp[0].residual, imp[0].qk, imp[0].hidden
    assert mlp.shape == (48,) and qk.shape == (3, 16) and hidden.shape == (192,)
    assert hidden.argmin() == 7 and hidden[7] < 1e-5
    assert mlp[5] == 0 and (mlp[torch.arange(48) != 5] > 0).all()
    assert qk[0, 3] == 0 and qk.flatten().argmin() == 3
    assert model.training is False
    with pytest.raises(NascompressError, match="at least one batch"):
        activation_importance(model, [])


def test_supernet_gates_start_in_the_given_importance_order():
    model = build_model(tiny_spec_3_heads())
    from nascompress.methods.dcs_importance import ChannelImportance

    imp = [
        ChannelImportance(
            torch.arange(48, dtype=torch.float32),
            torch.arange(192, dtype=torch.float32),
            torch.arange(48, dtype=torch.float32).reshape(3, 16).flip(-1),
        )
        for _ in model.blocks
    ]
    sup = make_supernet(model, DCSConfig(qk_mask="static", mlp_gates="residual"), importance=imp)
    for blk in sup.blocks:
        assert blk.dcs_alpha.argmin() == 0 and blk.dcs_alpha.argmax() == 47
        assert (blk.dcs_alpha > 0).all()  # still every gate open: the dense model is the start
        th = blk.attn.qk_mask.theta.reshape(3, 16)
        assert (th.argmin(-1) == 15).all()
    with pytest.raises(NascompressError, match="importance has 1 blocks but the model has 2"):
        make_supernet(build_model(tiny_spec_3_heads()), DCSConfig(mlp_gates="residual"), importance=imp[:1])


def test_init_importance_auto_keeps_the_order_closer_to_dense():
    from nascompress.dcs_search.prepare import init_importance

    model = build_model(tiny_spec_3_heads()).eval()
    with torch.no_grad():  # weight magnitude misleads: channels 0-9 have a tiny LN2 gain but a large LN2 bias,
        for blk in model.blocks:  # so the MLP reads a large (constant) value there, as in DINOv2's outlier channels
            blk.norm2.weight[:10] = 0.01
            blk.norm2.bias[:10] = 5.0
    images = [torch.randn(16, 1, 16, 16)]
    imp, info = init_importance(model, images, "auto")
    kl = info.init_kl
    assert set(kl) == {"weight", "activation"} and info.init == (
        "activation" if kl["activation"] < 0.9 * kl["weight"] else "weight"
    )
    assert (imp is None) == (info.init == "weight")
    assert info.init == "activation" and kl["activation"] < kl["weight"]
    assert list(info.to_dict()) == ["init", "init_kl"]  # the keys the search's metrics get, in order
    imp, info = init_importance(model, images, "weight")
    assert imp is None and info.to_dict() == {"init": "weight"}
    act, info = init_importance(model, images, "activation")
    assert info.to_dict() == {"init": "activation"} and len(act) == 2


def test_search_records_its_init_and_refuses_a_bad_one(tiny_run, tmp_path):
    out = tmp_path / "bad"
    res = run_cli(*search_args(tiny_run, out, "--init-importance", "magnitude"))
    assert res.exit_code == 1 and "--init-importance" in res.output and "auto" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not out.exists()
    out = tmp_path / "w"
    res = run_cli(*search_args(tiny_run, out, "--init-importance", "weight", "--epochs", 1))
    assert res.exit_code == 0, res.output
    assert json.loads((out / "metrics.json").read_text())["init"] == "weight"


def test_weight_steps_train_the_hard_architecture_and_arch_steps_sample():
    """--w-gates hard: a weight step's forward is the aligned architecture the search would materialize
    (no Gumbel noise: the same output twice, equal to inference); an architecture step samples."""
    from types import SimpleNamespace

    from nascompress.dcs_search.search_config import DCSSearchConfig
    from nascompress.dcs_search.hooks import DCSSearchHooks
    from nascompress.dcs_search.teacher import StepTag

    torch.manual_seed(0)
    sup = make_supernet(build_model(tiny_spec_3_heads()), DCSConfig(qk_mask="static", mlp_gates="hidden"))
    with torch.no_grad():
        for blk in sup.blocks:  # gates at the threshold: a Gumbel sample flips about half of them
            blk.dcs_alpha.uniform_(-0.5, 0.5)
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        ref = sup.eval()(x)
    params = list(sup.parameters())
    for w_gates, sampled in (("hard", False), ("sampled", True)):
        stub = SimpleNamespace(cfg=DCSSearchConfig(w_gates=w_gates), w_params=params, arch_params=[])
        DCSSearchHooks.prepare_step(stub, sup, StepTag("w"))
        sup.train()
        with torch.no_grad():
            a, b = sup(x), sup(x)
        assert sup.dcs_state.sample is sampled
        if sampled:
            assert not torch.allclose(a, b)
        else:
            torch.testing.assert_close(a, b)
            torch.testing.assert_close(a, ref)
        DCSSearchHooks.prepare_step(stub, sup, StepTag("a"))
        assert sup.dcs_state.sample  # architecture steps always sample
    with pytest.raises(NascompressError, match="w_gates"):
        DCSSearchConfig(w_gates="soft")


@pytest.mark.parametrize("family", ["hidden", "residual"])
def test_block_sensitivity_replays_the_dense_prefix_with_the_same_result(family):
    """Probing block j runs only blocks j.. on the cached dense stream: the same KLs as full forwards."""
    import torch.nn.functional as F

    from nascompress.methods.dcs_importance import activation_stats
    from nascompress.dcs_search.family import dense_targets
    from nascompress.dcs_search.protect import SENSITIVITY_DROP, block_sensitivity

    torch.manual_seed(0)
    dense = build_model(tiny_spec_3_heads(depth=3)).eval()
    images = [torch.randn(6, 1, 16, 16), torch.randn(4, 1, 16, 16)]
    stats = activation_stats(dense, images)
    got = block_sensitivity(dense, images, stats, family)
    targets = dense_targets(dense, images)
    want = []
    probe = make_supernet(
        copy.deepcopy(dense),
        DCSConfig(qk_mask="none", mlp_gates=family, init_spread=0.0, hidden_fill="mean"),
        fill=[s.hidden_mean for s in stats],
    ).eval()
    with torch.no_grad():
        for j, (blk, s) in enumerate(zip(probe.blocks, stats)):
            imp = s.importance.mlp(family)
            blk.dcs_alpha.fill_(-1.0)
            blk.dcs_alpha[imp.topk(round((1 - SENSITIVITY_DROP) * imp.numel())).indices] = 1.0
            kl = sum(
                F.kl_div(F.log_softmax(probe(x), -1), t, log_target=True, reduction="sum").item()
                for x, t in zip(images, targets)
            )
            want.append(kl / 10)
            blk.dcs_alpha.fill_(1.0)
    assert len(got) == 3 and all(w > 0 for w in want)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-7)


def test_gates_multiply_in_the_activations_precision_under_bf16_autocast():
    """Under bf16 autocast the hidden gates and the Q/K mask (fp32 parameters) multiply bf16
    activations in bf16: an fp32 gate would promote every gated activation to fp32 and the next
    matmul would cast it back (the search's steps were 1.3x slower). The gates stay exact 0/1, so
    the forward is the one gated in fp32, cast to bf16 where the next matmul reads it."""
    torch.manual_seed(0)
    model = build_model(tiny_spec_3_heads())
    fills = [torch.randn(blk.mlp.fc1.out_features) for blk in model.blocks]
    sup = make_supernet(model, DCSConfig(qk_mask="static", mlp_gates="hidden"), fill=fills)
    randomize_gates(sup)
    sup.train()
    sup.dcs_state.sample = True  # an architecture step: the masked path, gradients to the gates
    seen = {}
    sup.blocks[0].mlp.fc2.register_forward_pre_hook(lambda m, a: seen.setdefault("fc2_in", a[0]))
    sup.blocks[0].attn.record_keys = True
    x = torch.randn(4, 1, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sup(x)
    out.float().logsumexp(-1).sum().backward()
    assert seen["fc2_in"].dtype == torch.bfloat16 and sup.blocks[0].attn.keys.dtype == torch.bfloat16
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in arch_parameters(sup))
