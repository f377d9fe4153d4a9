"""EViT: identity at keep_rate 1, the pruned block against a direct reference, the linearized
fused token, paper FLOPs on DeiT-S, save/load, the schedule, bad input and the CLI."""

from __future__ import annotations

import copy
import json
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from nascompress.errors import NascompressError
from nascompress.methods import get_method
from nascompress.methods.evit import evit_prune, fused_token_hard, fused_token_linearized, shrink_at
from nascompress.methods.tokens import scale_layers

from .conftest import interrupted_at_epoch, invoke, tiny_rgb_vit


def evit(model, **config):
    return get_method("evit").apply(model, {"name": "evit", "config": config})


@pytest.mark.parametrize("kw", [{}, {"init_values": 0.1, "qk_norm": True}])
def test_identity_keep_rate_one(kw):
    dense = tiny_rgb_vit(**kw)
    pruned = evit(copy.deepcopy(dense), keep_rate=1.0, prune_layers=[1, 2, 3, 4])
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(pruned(x), dense(x))


def reference_block(blk, x, keep):
    """Seed code on an explicit attention matrix (non-fused), one block."""
    a = blk.attn
    B, N, C = x.shape
    h = blk.norm1(x)
    qkv = a.qkv(h).reshape(B, N, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = a.q_norm(q), a.k_norm(k)
    attn = ((q * a.scale) @ k.transpose(-2, -1)).softmax(-1)
    o = a.proj((attn @ v).transpose(1, 2).reshape(B, N, C))
    x = x + blk.ls1(o)
    cls_attn = attn[:, :, 0, 1:].mean(dim=1)
    _, idx = torch.topk(cls_attn, keep, dim=1, largest=True, sorted=True)
    non_cls = x[:, 1:]
    kept = torch.stack([non_cls[b, idx[b]] for b in range(B)])
    mask = torch.ones(B, N - 1, dtype=torch.bool)
    mask[torch.arange(B)[:, None], idx] = False
    extra = torch.stack([(non_cls[b][mask[b]] * cls_attn[b][mask[b]][:, None]).sum(0) for b in range(B)])
    x = torch.cat([x[:, :1], kept, extra[:, None]], dim=1)
    return x + blk.ls2(blk.mlp(blk.norm2(x)))


@pytest.mark.parametrize("kw", [{}, {"init_values": 0.1, "qk_norm": True}])
def test_pruned_block_matches_reference(kw):
    model = tiny_rgb_vit(**kw)
    blk_ref = copy.deepcopy(model.blocks[1])
    evit(model, keep_rate=0.5, prune_layers=[2])
    x = torch.randn(2, 65, 32)
    with torch.no_grad():
        out = model.blocks[1](x)
        ref = reference_block(blk_ref, x, keep=32)
    assert out.shape == (2, 1 + 32 + 1, 32)
    torch.testing.assert_close(out, ref)


def test_token_counts_and_training_backward():
    model = evit(tiny_rgb_vit(), keep_rate=0.7)  # depth 4 -> layers [1, 2, 3]
    assert scale_layers(4) == [1, 2, 3] and scale_layers(12) == [4, 7, 10] and scale_layers(6) == [2, 4, 5]
    shapes = []
    model.norm.register_forward_hook(lambda m, i, o: shapes.append(o.shape[1]))
    n = 64
    for _ in range(3):
        n = math.ceil(0.7 * n) + 1  # kept + fused (the previous fused token is a candidate)
    model.train()
    loss = F.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.arange(4))
    loss.backward()
    assert shapes == [1 + n]
    assert model.blocks[0].attn.qkv.weight.grad is not None


def test_linearized_fused_token_converges_to_hard():
    g = torch.Generator().manual_seed(0)
    B, M, C, k = 2, 12, 8, 5
    x = torch.randn(B, M, C, generator=g)
    # distinct scores with gaps >= 1e-2
    scores = torch.stack([torch.randperm(M, generator=g) for _ in range(B)]).float() / 100 + 0.01
    hard = fused_token_hard(x, scores, k)
    # the same fused token as the pruning path
    full = torch.cat([torch.zeros(B, 1, C), x], 1)
    torch.testing.assert_close(evit_prune(full, scores, k)[:, -1], hard)
    errs = [(fused_token_linearized(x, scores, k, t) - hard).abs().max().item() for t in (1.0, 1e-1, 1e-2, 1e-3, 1e-4)]
    assert all(a >= b for a, b in zip(errs, errs[1:])), errs
    assert errs[0] > 1e-2 and errs[-1] < 1e-6, errs
    s = scores.clone().requires_grad_(True)
    fused_token_linearized(x, s, k, 0.05).sum().backward()
    assert s.grad.abs().sum() > 0


def test_deit_small_flops_match_paper():
    from nascompress.profiling import flops as fl

    model = timm.create_model("deit_small_patch16_224", pretrained=False).eval()
    x = torch.randn(1, 3, 224, 224)
    evit(model, keep_rate=0.7, prune_layers=[4, 7, 10])
    rep = fl.count_flops(model, x)
    assert abs(rep.gflops - 3.0) / 3.0 < 0.03, rep.gflops
    assert [blk["attn"] > 0 for blk in rep.blocks] == [True] * 12


def test_save_load_roundtrip(tmp_path):
    from nascompress.runs.io import load, make_arch, save_model
    from nascompress.models.build import ModelSpec

    spec = ModelSpec(
        "vit_tiny_patch16_224", dict(img_size=32, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=10)
    )
    model = evit(tiny_rgb_vit(), keep_rate=0.6)
    rec = {"name": "evit", "config": {"keep_rate": 0.6, "prune_layers": [1, 2, 3], "fuse_token": True}}
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
    assert set(loaded.state_dict()) == set(tiny_rgb_vit().state_dict())


def test_keep_rate_schedule():
    # shrink s: 1 = no pruning, 0 = the target; keep rate = base + (1 - base) * s
    assert shrink_at(0.5, start=1, length=2) == 1.0
    assert shrink_at(1.0, start=1, length=2) == pytest.approx(1.0)
    assert shrink_at(2.0, start=1, length=2) == pytest.approx(0.5)
    assert shrink_at(3.0, start=1, length=2) == pytest.approx(0.0)
    assert shrink_at(9.0, start=1, length=2) == 0.0
    assert shrink_at(0.0, start=0, length=0) == 0.0


def test_per_layer_keep_rates():
    model = evit(tiny_rgb_vit(), keep_rate=[0.9, 0.5], prune_layers=[1, 3])
    counts = []
    for blk in model.blocks:
        blk.register_forward_hook(lambda m, i, o: counts.append(o.shape[1]))
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    n1 = math.ceil(0.9 * 64) + 1  # kept + fused
    assert counts == [1 + n1, 1 + n1, 1 + math.ceil(0.5 * n1) + 1, 1 + math.ceil(0.5 * n1) + 1]
    with pytest.raises(NascompressError, match="keep_rate has 3 values but there are 2 pruning layers"):
        evit(tiny_rgb_vit(), keep_rate=[0.9, 0.7, 0.5], prune_layers=[1, 3])


def test_refuses_a_foreign_attention():
    """An attention class nascompress does not know is refused, never silently overridden."""
    dense = tiny_rgb_vit()
    for blk in dense.blocks:
        blk.attn.__class__ = ForeignAttention
    with pytest.raises(NascompressError, match="blocks.0.attn is a ForeignAttention"):
        evit(dense, keep_rate=0.5)


class ForeignAttention(timm.layers.Attention):
    """Stand-in for another library's attention subclass."""


@pytest.mark.parametrize(
    "config,pattern",
    [
        ({"keep_rate": 1.5}, r"keep_rate must be in \(0, 1\], got 1.5"),
        ({"keep_rate": 0}, r"keep_rate must be in \(0, 1\], got 0"),
        ({"prune_layers": [0, 2]}, r"\[0\] outside the model's depth: valid layers are 1..4"),
        ({"prune_layers": [5]}, r"valid layers are 1..4"),
        ({"prune_layers": [3, 2]}, r"strictly increasing"),
        ({"bogus": 1}, r"unknown evit setting\(s\) bogus; valid: keep_rate"),
    ],
)
def test_bad_config(config, pattern):
    with pytest.raises(NascompressError, match=pattern):
        evit(tiny_rgb_vit(), **config)


def test_non_vit_rejected():
    with pytest.raises(NascompressError, match="needs a timm VisionTransformer"):
        evit(nn.Sequential(nn.Linear(2, 2)), keep_rate=0.5)


def test_cli_finetune_zero_shot_and_train(tmp_path, tiny_run):
    zs = tmp_path / "zs"
    r = invoke("finetune", tiny_run, "--method", "evit", "--keep-rate", "0.5", "--zero-shot", "--out", zs, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["zero_shot"] is True
    arch = json.loads((zs / "arch.json").read_text())
    assert arch["methods"][-1]["name"] == "evit" and arch["methods"][-1]["config"]["keep_rate"] == 0.5
    ft = tmp_path / "ft"
    r = invoke(
        "finetune",
        tiny_run,
        "--method",
        "evit",
        "--keep-rate",
        "0.5",
        "--epochs",
        "1",
        "--opt",
        "shrink_epochs=0.5",
        "--out",
        ft,
        "--json",
    )
    assert r.exit_code == 0, r.output
    log = [json.loads(ln) for ln in (ft / "log.jsonl").read_text().splitlines()]
    assert log[0]["start"] and log[0]["epoch"] == 0  # the starting (zero-shot) model, evaluated first
    assert 0.5 < log[1]["train_keep_rate"] < 1.0  # mean over the epoch: cosine half, then 0.5
    r = invoke("evaluate", ft, "--json")
    assert r.exit_code == 0, r.output
    r = invoke("finetune", tiny_run, "--method", "evit", "--keep-rate", "1.5", "--out", tmp_path / "bad")
    assert r.exit_code == 1 and "keep_rate must be in (0, 1], got 1.5" in r.output
    assert not (tmp_path / "bad").exists()


def _dcs_model(kind):
    """A DCS supernet (input Q/K masks, MLP gates) or a materialized one (static masks), eval."""
    from nascompress.methods.dcs import DCSConfig, make_supernet, materialize

    torch.manual_seed(1)
    if kind == "dcs_supernet":
        return make_supernet(tiny_rgb_vit(), DCSConfig(qk_mask="input")).eval()
    cfg = DCSConfig(qk_mask="static")
    sup = make_supernet(tiny_rgb_vit(), cfg).eval()
    with torch.no_grad():
        for name, p in sup.named_parameters():
            if "dcs_" in name:
                p.copy_(torch.randn_like(p))  # close about half of the channels
    return materialize(sup, cfg)[0]


@pytest.mark.parametrize("kind", ["dcs_supernet", "dcs_materialized", "sparsifiner"])
def test_stacks_on_other_methods(kind):
    from nascompress.profiling.flops import count_flops

    if kind == "sparsifiner":
        base = (
            get_method("sparsifiner")
            .apply(tiny_rgb_vit(), {"name": "sparsifiner", "config": {"attn_keep_ratio": 0.5}})
            .eval()
        )
    else:
        base = _dcs_model(kind)
    x = torch.randn(2, 3, 32, 32)
    same = evit(copy.deepcopy(base), keep_rate=1.0)
    pruned = evit(copy.deepcopy(base), keep_rate=0.5)
    with torch.no_grad():
        torch.testing.assert_close(same(x), base(x))
        assert pruned(x).shape == (2, 10)
    assert count_flops(pruned, x).total < 0.75 * count_flops(base, x).total


def test_linearized_fused_token_in_training():
    model = evit(tiny_rgb_vit(), keep_rate=0.5, prune_layers=[2])
    ref = copy.deepcopy(model)
    model.evit_state.fuse_temperature = 1e-6  # a near-step sigmoid: the hard token
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model.train()(x), ref.train()(x), rtol=1e-4, atol=1e-4)
    model.evit_state.fuse_temperature = 0.5
    out = model(x)
    assert not torch.allclose(out, ref(x), atol=1e-4)
    out.sum().backward()
    with torch.no_grad():  # inference always uses the hard token
        torch.testing.assert_close(model.eval()(x), ref.eval()(x))


def test_finetune_resume_continues_the_recorded_job(tmp_path, tiny_run):
    """--resume continues the job recorded in OUT/config.json (changed settings are refused, naming
    them) and ends where an uninterrupted run ends."""
    import nascompress
    from nascompress.methods.evit import EViTHooks

    args = ["finetune", tiny_run, "--method", "evit", "--keep-rate", "0.5", "--epochs", "2", "--train-limit", "128"]
    assert invoke(*args, "--out", tmp_path / "full").exit_code == 0
    with interrupted_at_epoch(EViTHooks):
        assert invoke(*args, "--out", tmp_path / "cut").exit_code == 130
    r = invoke(
        "finetune",
        tiny_run,
        "--method",
        "evit",
        "--keep-rate",
        "0.9",
        "--epochs",
        "5",
        "--out",
        tmp_path / "cut",
        "--resume",
        "--json",
    )
    assert r.exit_code == 1 and "config.keep_rate 0.9 (recorded 0.5); train.epochs 5 (recorded 2)" in r.output, r.output
    r = invoke("finetune", tiny_run, "--method", "evit", "--out", tmp_path / "cut", "--resume", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["epochs"] == 2
    arch = json.loads((tmp_path / "cut" / "arch.json").read_text())
    assert arch["methods"][-1]["config"]["keep_rate"] == 0.5
    a = nascompress.load(tmp_path / "full" / "last.safetensors").state_dict()
    b = nascompress.load(tmp_path / "cut" / "last.safetensors").state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k])
