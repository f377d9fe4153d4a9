"""DynamicViT: identity at rho 1, masked training == physical dropping for the same decisions,
the masked-softmax gradient, losses, paper FLOPs on DeiT-S, save/load, bad input and the CLI."""

from __future__ import annotations

import copy
import json

import pytest
import timm
import torch
from torch import nn

import nascompress.methods.dynamicvit as dv
from nascompress.errors import NascompressError
from nascompress.methods import get_method

from .conftest import invoke, tiny_rgb_vit


def dvit(model, **config):
    return get_method("dynamicvit").apply(model, {"name": "dynamicvit", "config": config})


@pytest.mark.parametrize("kw", [{}, {"init_values": 0.1, "qk_norm": True}])
def test_identity_rho_one(kw):
    dense = tiny_rgb_vit(**kw)
    model = dvit(copy.deepcopy(dense), rho=1.0, prune_layers=[1, 2, 4])
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense(x))
        model.train(), dense.train()
        torch.testing.assert_close(model(x), dense(x))


@pytest.mark.parametrize("kw", [{}, {"init_values": 0.1, "qk_norm": True}])
def test_masked_training_equals_physical_drop(kw, monkeypatch):
    """Given the same (top-k) decisions, masking in the softmax == dropping the tokens."""
    rho, n0 = 0.7, 64
    model = dvit(tiny_rgb_vit(**kw), rho=rho, prune_layers=[2, 3, 4])
    counts = iter([dv.keep_count(rho**s, n0) for s in (1, 2, 3)])

    def topk_keep(logits, prev, *, tau=1.0):
        score = (logits[..., 0] - logits[..., 1]).masked_fill(prev == 0, float("-inf"))
        idx = score.topk(next(counts), dim=1).indices
        return torch.zeros_like(prev).scatter(1, idx, 1.0)

    monkeypatch.setattr(dv, "gumbel_keep", topk_keep)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        dropped = model.eval()(x)
        assert model.dvit_state.kept == [44, 31, 21]
        masked = model.train()(x)
    assert [int(d.sum(1)[0]) for d in model.dvit_state.decisions] == [44, 31, 21]
    torch.testing.assert_close(masked, dropped, rtol=1e-3, atol=1e-3)


def test_policy_bias_gradient_matches_multiplicative_softmax():
    g = torch.Generator().manual_seed(0)
    B, N = 2, 7
    P = torch.randn(B, 1, N, N, generator=g)
    pol = torch.rand(B, N, generator=g)
    pol[:, 3] = 0.0  # a masked token still gets the multiplicative form's gradient
    p1, p2 = pol.clone().requires_grad_(True), pol.clone().requires_grad_(True)
    w = torch.randn(B, 1, N, N, generator=g)
    a = (P + dv.policy_attn_bias(p1)).softmax(-1)
    eye = torch.eye(N)
    G = p2[:, None, None, :] * (1 - eye) + eye
    e = P.exp() * G
    b = e / e.sum(-1, keepdim=True)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    (a * w).sum().backward()
    (b * w).sum().backward()
    assert p2.grad[:, 3].abs().min() > 1e-4
    torch.testing.assert_close(p1.grad, p2.grad, atol=1e-4, rtol=1e-3)


def test_training_decisions_are_cumulative_and_losses_backprop():
    teacher = tiny_rgb_vit()
    model = dvit(copy.deepcopy(teacher), rho=0.5, prune_layers=[2, 3, 4]).train()
    hooks = dv.DynamicViTHooks(model, teacher.eval().requires_grad_(False), dv.DynamicViTRecipe())
    from nascompress.train.config import TrainConfig

    x, y = torch.randn(4, 3, 32, 32), torch.arange(4)
    loss, logs = hooks.loss(model, x, y, epoch=0, cfg=TrainConfig(epochs=1, lr=None))
    d = model.dvit_state.decisions
    assert len(d) == 3 and all(((a - b) >= 0).all() for a, b in zip(d, d[1:]))  # never re-kept
    assert set(torch.cat(d).unique().tolist()) <= {0.0, 1.0}
    loss.backward()
    assert model.blocks[1].dvit_predictor.out[-1].weight.grad.abs().sum() > 0
    assert set(logs) >= {"ce", "kl", "distill", "ratio"}


def test_predictor_split_first_layer_matches_concatenation():
    p = dv.ScorePredictor(32)
    x, pol = torch.randn(2, 9, 32), (torch.rand(2, 9) > 0.3).float()
    z = p.inp(x)
    g = (z[..., 16:] * pol[..., None]).sum(1, keepdim=True) / pol.sum(1)[:, None, None]
    ref = p.out(torch.cat([z[..., :16], g.expand(-1, 9, -1)], -1))
    torch.testing.assert_close(p(x, pol), ref)
    from nascompress.profiling.flops import count_flops

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = p

        def forward(self, x):
            return self.p(x)

    total = count_flops(Wrap(), x).total  # per image
    assert total == 9 * (32 * 32 + 16 * 16 + 16 * 8 + 8 * 2) + 16 * 16


def test_loss_functions():
    d = [torch.tensor([[1.0, 1.0, 0.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0, 0.0]])]
    assert dv.ratio_loss(d, [0.5, 0.5]).item() == pytest.approx((0 + 0.25**2) / 2)
    t, s = torch.zeros(1, 4, 2), torch.ones(1, 4, 2)
    s[0, 2:] = 5.0  # dropped tokens do not count
    assert dv.token_distill_loss(s, t, torch.tensor([[1.0, 1.0, 0.0, 0.0]])).item() == pytest.approx(1.0)
    logits = torch.randn(3, 5)
    assert dv.kl_to_teacher(logits, logits).abs().item() < 1e-6


def test_deit_small_flops_match_paper():
    from nascompress.profiling.flops import count_flops

    model = dvit(timm.create_model("deit_small_patch16_224", pretrained=False), rho=0.7)
    rep = count_flops(model, torch.randn(1, 3, 224, 224))
    assert model.dvit_state.kept == [137, 96, 67]
    assert abs(rep.gflops - 2.9) / 2.9 < 0.03, rep.gflops
    assert rep.blocks[3]["other"] > 0  # the predictor's cost is counted


def test_save_load_roundtrip(tmp_path):
    from nascompress.runs.io import load, make_arch, save_model
    from nascompress.models.build import ModelSpec

    spec = ModelSpec(
        "vit_tiny_patch16_224", dict(img_size=32, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=10)
    )
    model = dvit(tiny_rgb_vit(), rho=0.6)
    rec = {"name": "dynamicvit", "config": {"rho": 0.6, "prune_layers": [1, 2, 3]}}
    save_model(
        tmp_path,
        model,
        make_arch(
            spec, input_spec={"img_size": [32, 32], "in_chans": 3, "mean": [0.5] * 3, "std": [0.5] * 3}, methods=[rec]
        ),
    )
    loaded = load(tmp_path)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))
    keys = set(loaded.state_dict())
    assert set(tiny_rgb_vit().state_dict()) < keys and "blocks.0.dvit_predictor.out.4.weight" in keys


@pytest.mark.parametrize(
    "config,pattern",
    [
        ({"rho": 0}, r"rho must be in \(0, 1\], got 0"),
        ({"rho": 1.2}, r"rho must be in \(0, 1\], got 1.2"),
        ({"prune_layers": [0]}, r"valid layers are 1..4"),
        ({"prune_layers": [2, 9]}, r"\[9\] outside the model's depth: valid layers are 1..4"),
        ({"keep_rate": 0.5}, r"unknown dynamicvit setting\(s\) keep_rate; valid: rho, prune_layers"),
        ({"rho": [0.7, 1.5]}, r"rho must be in \(0, 1\], got 1.5"),
        ({"rho": [0.7, 0.5], "prune_layers": [1, 2, 3]}, r"rho has 2 per-stage rates but there are 3 pruning layers"),
    ],
)
def test_bad_config(config, pattern):
    with pytest.raises(NascompressError, match=pattern):
        dvit(tiny_rgb_vit(), **config)


def test_non_vit_rejected():
    with pytest.raises(NascompressError, match="needs a timm VisionTransformer"):
        dvit(nn.Sequential(nn.Linear(2, 2)), rho=0.5)


def test_cli_finetune_zero_shot_and_train(tmp_path, tiny_run):
    zs = tmp_path / "zs"
    r = invoke(
        "finetune",
        tiny_run,
        "--method",
        "dynamicvit",
        "--rho",
        "0.5",
        "--zero-shot",
        "--out",
        zs,
        "--opt",
        "predictor_steps=5",
        "--json",
    )
    assert r.exit_code == 0, r.output
    assert "kl" in json.loads(r.stdout)["calibration"]  # the predictor-only stage ran before the save
    ft = tmp_path / "ft"
    r = invoke(
        "finetune",
        tiny_run,
        "--method",
        "dynamicvit",
        "--rho",
        "0.5",
        "--epochs",
        "1",
        "--out",
        ft,
        "--opt",
        "w_ratio=4",
        "--json",
    )
    assert r.exit_code == 0, r.output
    arch = json.loads((ft / "arch.json").read_text())
    assert arch["methods"][-1]["config"] == {"rho": 0.5, "prune_layers": [1, 2]}
    log = [json.loads(ln) for ln in (ft / "log.jsonl").read_text().splitlines()]
    assert log[0]["start"] and {"train_ratio", "train_kl", "train_distill"} <= set(log[1])
    r = invoke("profile", ft, "--compare", tiny_run, "--no-latency", "--json")
    assert r.exit_code == 0, r.output
    r = invoke("finetune", tiny_run, "--method", "dynamicvit", "--rho", "0", "--out", tmp_path / "bad")
    assert r.exit_code == 1 and "rho must be in (0, 1], got 0" in r.output
    r = invoke("finetune", tiny_run, "--method", "dynamicvit", "--prune-layers", "1,5", "--out", tmp_path / "bad")
    assert r.exit_code == 1 and "valid layers are 1..2" in r.output
    r = invoke("finetune", tiny_run, "--method", "dynamicvit", "--keep-rate", "0.5", "--out", tmp_path / "bad")
    assert r.exit_code == 1 and "--keep-rate is not a dynamicvit option (it belongs to evit)" in r.output
    assert not (tmp_path / "bad").exists()


def test_stacks_on_dcs():
    from nascompress.methods.dcs import DCSConfig, make_supernet

    base = make_supernet(tiny_rgb_vit(), DCSConfig(qk_mask="input")).eval()
    x = torch.randn(2, 3, 32, 32)
    same = dvit(copy.deepcopy(base), rho=1.0)
    with torch.no_grad():
        torch.testing.assert_close(same(x), base(x))
    pruned = dvit(copy.deepcopy(base), rho=0.5)
    with torch.no_grad():
        assert pruned(x).shape == (2, 10)
    pruned.train()
    pruned(x).sum().backward()  # masked training through the DCS attention
    assert pruned.blocks[1].dvit_predictor.out[-1].weight.grad is not None


def test_deepcopy_after_training_forward():
    model = dvit(tiny_rgb_vit(), rho=0.5).train()
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    clone = copy.deepcopy(model).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(clone(x), model.eval()(x))
    assert clone.blocks[1].dvit_state is clone.dvit_state is not model.dvit_state


@pytest.mark.parametrize("mode", ["unstructured", "block"])
def test_stacks_on_sparsifiner(mode):
    """DynamicViT over Sparsifiner: the training policy mask is ANDed with the sparse mask (masked
    path, gradients reach the predictors); inference drops tokens and runs the sparse attention."""
    from nascompress.methods.sparsifiner_kernel import SparsifinerKernel, combine_masks

    base = (
        get_method("sparsifiner")
        .apply(tiny_rgb_vit(), {"name": "sparsifiner", "config": {"attn_keep_ratio": 0.5, "mode": mode, "n_down": 8}})
        .eval()
    )
    kernel = base.blocks[0].attn.kernel
    assert isinstance(kernel, SparsifinerKernel)
    q, k, v = torch.randn(3, 2, 2, 65, 16).unbind(0)
    bias = torch.zeros(2, 1, 65, 65)
    bias[:, :, :, 5] = -1e4  # key 5 off for every query, as a dropped token
    with torch.no_grad():
        free = kernel(q, k, v, scale=0.25)
        both = kernel(q, k, v, attn_mask=bias, scale=0.25)
        assert (free - both).abs().max() > 1e-4
        torch.testing.assert_close(kernel(q, k, v, attn_mask=torch.zeros(2, 1, 65, 65), scale=0.25), free)
    mask = torch.ones(2, 2, 65, 65, dtype=torch.bool)
    mask[..., 7] = False
    assert torch.equal(combine_masks(mask, bias)[..., 5], torch.full((2, 2, 65), -1e4))
    assert combine_masks(mask, bias)[..., 7].isinf().all()
    x = torch.randn(2, 3, 32, 32)
    pruned = dvit(copy.deepcopy(base), rho=0.5)
    with torch.no_grad():
        assert pruned(x).shape == (2, 10)
    pruned.train()
    pruned(x).sum().backward()
    assert pruned.blocks[1].dvit_predictor.out[-1].weight.grad.abs().sum() > 0


def test_per_stage_rates_multiply():
    model = dvit(tiny_rgb_vit(), rho=[0.8, 0.5, 1.0], prune_layers=[2, 3, 4]).eval()
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    assert model.dvit_state.kept == [int(0.8 * 64), int(0.4 * 64), int(0.4 * 64)]


def test_ratio_loss_drives_the_kept_ratio():
    """Trained on the ratio loss alone, the predictors' Gumbel decisions approach rho^s."""
    model = dvit(tiny_rgb_vit(depth=2), rho=0.3, prune_layers=[1]).train()
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if "dvit_predictor" in n], lr=3e-3)
    x = torch.randn(8, 3, 32, 32)
    kept = []
    for _ in range(120):
        model(x)
        d = model.dvit_state.decisions
        loss = dv.ratio_loss(d, [0.3])
        opt.zero_grad()
        loss.backward()
        opt.step()
        kept.append(d[0].mean().item())
    assert kept[0] > 0.4  # a fresh predictor keeps about half
    assert abs(sum(kept[-20:]) / 20 - 0.3) < 0.05, kept[-20:]


def test_predictor_only_stage_lowers_its_loss_and_freezes_the_backbone():
    teacher = tiny_rgb_vit().requires_grad_(False)
    model = dvit(copy.deepcopy(teacher), rho=0.25, prune_layers=[2, 3])
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(4)]
    backbone = {k: v.clone() for k, v in model.state_dict().items() if "dvit_predictor" not in k}
    r = dv.DynamicViTRecipe()

    def losses():  # the same Gumbel noise before and after
        model.train()
        out = []
        for i, (x, y) in enumerate(batches):
            torch.manual_seed(100 + i)
            loss, logs = dv.dynamicvit_loss(model, teacher, x, y, r)
            out.append((loss.item(), float(logs["ratio"])))
        return [sum(v) / len(v) for v in zip(*out)]

    before = losses()
    dv.calibrate_predictors(model, teacher, batches, steps=60, lr=3e-3)
    assert not model.training and all(p.requires_grad for p in model.parameters())
    for k, v in model.state_dict().items():
        if k in backbone:
            torch.testing.assert_close(v, backbone[k])  # the backbone did not move
    after = losses()
    assert after[0] < before[0] and after[1] < 0.5 * before[1], (before, after)
