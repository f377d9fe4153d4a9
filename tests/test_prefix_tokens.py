"""Models with register tokens, a distillation token or no class token: every method is either
correct on them or refuses them with the reason (never a tensor-size crash)."""

from __future__ import annotations

import copy

import pytest
import torch

from nascompress.errors import NascompressError
from nascompress.methods import get_method
from nascompress.models.build import ModelSpec, build_model

ARGS = dict(img_size=32, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=10)


def model(name="vit_tiny_patch16_224", **kw):
    torch.manual_seed(0)
    return build_model(ModelSpec(name, dict(ARGS, **kw))).eval()


REGISTERS = dict(reg_tokens=3)  # 1 class + 3 register tokens
DISTILLED = "deit_tiny_distilled_patch16_224"  # class + distillation token


@pytest.mark.parametrize("kind", ["registers", "distilled"])
@pytest.mark.parametrize(
    "method,off,on",
    [
        ("evit", {"keep_rate": 1.0}, {"keep_rate": 0.5, "prune_layers": [2, 3]}),
        ("dynamicvit", {"rho": 1.0}, {"rho": 0.5, "prune_layers": [2, 3]}),
        ("tome", {"r": 0}, {"r": 6, "merge_layers": [2, 3]}),
    ],
)
def test_token_pruning_keeps_every_prefix_token(kind, method, off, on):
    dense = model(**REGISTERS) if kind == "registers" else model(DISTILLED)
    p = dense.num_prefix_tokens
    assert p == (4 if kind == "registers" else 2)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        same = get_method(method).prepare_fresh(copy.deepcopy(dense), dict(off))[0].eval()
        torch.testing.assert_close(same(x), dense(x))  # compression off: the plain model
        pruned = get_method(method).prepare_fresh(copy.deepcopy(dense), dict(on))[0].eval()
        seen = []
        pruned.blocks[3].register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
        out = pruned(x)
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    tokens = seen[0]
    assert tokens.shape[1] < dense.patch_embed.num_patches + p  # tokens were pruned
    # the prefix tokens are still the first p tokens: the same as the dense model's before block 4
    ref = []
    dense.blocks[1].register_forward_pre_hook(lambda m, a: ref.append(a[0].detach().clone()))
    with torch.no_grad():
        dense(x)
    with torch.no_grad():  # blocks 1 (0-based) is before any pruning: prefix tokens identical there
        pruned_in = []
        pruned.blocks[1].register_forward_pre_hook(lambda m, a: pruned_in.append(a[0].detach().clone()))
        pruned(x)
    torch.testing.assert_close(pruned_in[0][:, :p], ref[0][:, :p])


@pytest.mark.parametrize("method", ["evit", "dynamicvit", "tome"])
def test_token_pruning_refuses_models_without_a_class_token_head(method):
    with pytest.raises(NascompressError, match="no class token"):
        get_method(method).prepare_fresh(model(class_token=False, global_pool="avg"), {})
    with pytest.raises(NascompressError, match="pools 'avg'"):
        get_method(method).prepare_fresh(model(global_pool="avg"), {})


@pytest.mark.parametrize("kw", [REGISTERS, dict(class_token=False, global_pool="avg"), dict(global_pool="avg")])
@pytest.mark.parametrize("mode", ["unstructured", "block"])
def test_sparsifiner_works_with_any_prefix(kw, mode):
    dense = model(**kw)
    x = torch.randn(2, 3, 32, 32)
    cfg = {"mode": mode, "n_down": 8, "kernel": "masked"}
    with torch.no_grad():
        same = get_method("sparsifiner").prepare_fresh(copy.deepcopy(dense), dict(cfg, attn_keep_ratio=1.0))[0].eval()
        torch.testing.assert_close(same(x), dense(x))
        sp = get_method("sparsifiner").prepare_fresh(copy.deepcopy(dense), dict(cfg, attn_keep_ratio=0.3))[0].eval()
        out = sp(x)
        assert torch.isfinite(out).all() and (out - dense(x)).abs().max() > 1e-5
        kernel = sp.blocks[0].attn.kernel
        assert kernel.prefix == dense.num_prefix_tokens and kernel.density < 0.7
        if mode == "block":  # the gathered inference path equals the masked one, prefix rows included
            for blk in sp.blocks:
                blk.attn.kernel.cfg = blk.attn.kernel.cfg.replace(kernel="gather")
            torch.testing.assert_close(sp(x), out, atol=1e-5, rtol=1e-5)


def test_dcs_works_with_registers_and_average_pooling():
    from nascompress.methods.dcs import DCSConfig, make_supernet, materialize

    for kw in (REGISTERS, dict(class_token=False, global_pool="avg")):
        dense = model(**kw)
        sup = make_supernet(copy.deepcopy(dense), DCSConfig(qk_mask="static")).eval()
        x = torch.randn(2, 3, 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(sup(x), dense(x))
            for blk in sup.blocks:
                blk.dcs_alpha.copy_(torch.randn_like(blk.dcs_alpha))
            mat, _ = materialize(sup, DCSConfig(qk_mask="static"))
            torch.testing.assert_close(mat(x), sup(x), atol=1e-5, rtol=1e-5)
