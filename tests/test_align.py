"""Hardware-aligned widths (uniform pruning, MG-ViT's C', search spaces) and the Q/K layout of
narrowed heads (packed vs zero-padded to V's head dim): same outputs, FLOPs counted as computed."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import nascompress  # noqa: F401  (torchvision fix before timm)
from nascompress.errors import NascompressError
from nascompress.models.layers import aligned_width, core_attention, qk_layout_summary, qk_pads, set_qk_layout
from nascompress.methods import apply_methods, get_method
from nascompress.methods.dcs import DCSConfig, make_supernet, materialize
from nascompress.models.slicing import slice_qk
from nascompress.methods.mgvit import default_feat_dim
from nascompress.methods.uniform import UniformConfig, keep_for_flops
from nascompress.models.build import ModelSpec, build_model
from nascompress.profiling import count_flops
from nascompress.studies.space_model import Space


def vit(embed_dim=96, heads=3, depth=2, img=16):
    torch.manual_seed(0)
    return build_model(
        ModelSpec(
            "vit_tiny_patch16_224",
            dict(
                img_size=img,
                patch_size=4,
                embed_dim=embed_dim,
                depth=depth,
                num_heads=heads,
                num_classes=10,
                in_chans=1,
            ),
        )
    ).eval()


# ---------------------------------------------------------------------------------------------
# Uniform pruning


@pytest.mark.parametrize("align,hidden,qk", [(8, 232, 24), (1, 231, 20), (64, 256, 32)])
def test_uniform_widths_are_aligned_and_align_1_keeps_the_exact_shares(align, hidden, qk):
    # 96 wide, 3 heads (head dim 32), MLP 384: keep 0.6 asks for ceil(230.4) = 231 and ceil(19.2) = 20
    model, record = get_method("uniform").prepare_fresh(vit(), UniformConfig(keep=0.6, align=align))
    assert record["config"]["align"] == align
    for blk, rec in zip(model.blocks, record["blocks"]):
        assert blk.mlp.fc1.out_features == len(rec["hidden_keep"]) == hidden
        assert blk.attn.qk_dim == qk and blk.attn.qk_counts == [qk] * 3
        assert blk.attn.qkv.out_features == 2 * 3 * qk + 96  # no padding rows: every head keeps the same count


def test_uniform_record_without_align_rebuilds_the_recorded_widths():
    """arch.json records written before align existed (keep 0.6: 231 / 20 channels) load unchanged."""
    model, record = get_method("uniform").prepare_fresh(vit(), UniformConfig(keep=0.6, align=1))
    old = copy.deepcopy(record)
    del old["config"]["align"]
    rebuilt = apply_methods(vit(), [old])
    rebuilt.load_state_dict(model.state_dict())
    x = torch.randn(2, 1, 16, 16)
    torch.testing.assert_close(rebuilt(x), model(x))
    assert rebuilt.blocks[0].mlp.fc1.out_features == 231


@pytest.mark.parametrize("align", [8, 1])
def test_keep_for_flops_lands_with_aligned_widths(align):
    dense = vit()
    x = torch.randn(1, 1, 16, 16)
    keep = keep_for_flops(dense, 0.6, x, align=align)
    model, _ = get_method("uniform").prepare_fresh(copy.deepcopy(dense), UniformConfig(keep=keep, align=align))
    ratio = count_flops(model, x).total / count_flops(dense, x).total
    widths = [b.mlp.fc1.out_features for b in model.blocks] + [b.attn.qk_dim for b in model.blocks]
    assert all(w % align == 0 for w in widths)
    # the nearest step: one aligned step of the MLP hidden width moves the ratio by < 0.02 here
    assert abs(ratio - 0.6) < (0.002 if align == 1 else 0.02)


# ---------------------------------------------------------------------------------------------
# MG-ViT's C'


@pytest.mark.parametrize("dim,heads", [(384, 6), (96, 3), (32, 2), (768, 12), (48, 3)])
def test_mgvit_feat_dim_is_aligned_and_align_1_is_the_old_rule(dim, heads):
    old = heads * math.ceil(dim / 8 / heads)
    assert default_feat_dim(dim, heads, 1) == old
    c = default_feat_dim(dim, heads, 8)
    assert c >= dim / 8 and c % 8 == 0 and (dim + c) % heads == 0 and ((dim + c) // heads) % 8 == 0
    assert default_feat_dim(384, 6, 8) == 48  # DeiT-S: the paper's C / 8 is already aligned


def test_mgvit_refuses_an_unaligned_feat_dim_but_loads_old_records():
    dense = vit(embed_dim=96, heads=3, img=28)
    model, record = get_method("mgvit").prepare_fresh(copy.deepcopy(dense), {"align": 8})
    assert record["config"]["feat_dim"] == 24 and record["config"]["align"] == 8
    assert model.mgis.cls_token.shape[-1] == 120
    with pytest.raises(NascompressError, match="feat_dim .C'. 12 is not a multiple of align 8"):
        get_method("mgvit").prepare_fresh(copy.deepcopy(dense), {"feat_dim": 12})
    model1, record1 = get_method("mgvit").prepare_fresh(copy.deepcopy(dense), {"align": 1})
    assert record1["config"]["feat_dim"] == 12  # the width before alignment existed
    old = copy.deepcopy(record1)
    del old["config"]["align"]  # an arch.json written before align: rebuilt at its recorded C'
    rebuilt = apply_methods(copy.deepcopy(dense), [old])
    assert rebuilt.mgis.cls_token.shape[-1] == 108


# ---------------------------------------------------------------------------------------------
# Search spaces


def space_with(params: dict) -> dict:
    return {"format": "nascompress-space/1", "name": "t", "methods": [{"name": "mgvit", "params": params}]}


def test_space_width_values_must_be_aligned():
    Space.from_dict(space_with({"feat_dim": {"kind": "int", "low": 16, "high": 64, "step": 8}}))
    Space.from_dict(space_with({"feat_dim": {"kind": "categorical", "choices": [24, 48]}}))
    Space.from_dict(space_with({"align": 1, "feat_dim": {"kind": "int", "low": 12, "high": 60, "step": 4}}))
    with pytest.raises(NascompressError, match=r"methods\[0\]\.params\.feat_dim: feat_dim is a width .* 12 is not"):
        Space.from_dict(space_with({"feat_dim": {"kind": "int", "low": 12, "high": 60, "step": 4}}))
    with pytest.raises(NascompressError, match="multiples of align 8"):
        Space.from_dict(space_with({"align": {"kind": "categorical", "choices": [1, 8]}, "feat_dim": 12}))


# ---------------------------------------------------------------------------------------------
# slice_qk's padded width and the Q/K layout


def narrowed(seed=0, width=None):
    """A DCS-materialized model with random per-head Q/K counts (8-channel heads, 16 wide)."""
    torch.manual_seed(seed)
    dense = vit(embed_dim=48, heads=3)
    cfg = DCSConfig(qk_mask="static", align=1)  # the layouts of unaligned counts (align 8 would fill 16-wide heads)
    sup = make_supernet(copy.deepcopy(dense), cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for blk in sup.blocks:
            blk.attn.qk_mask.theta.copy_(torch.randn(blk.attn.qk_mask.theta.shape, generator=g))
    mat, _ = materialize(sup, cfg)
    return sup, mat


def test_slice_qk_pads_to_the_given_width():
    a = core_attention(vit(embed_dim=48, heads=3).blocks[0].attn)
    b = copy.deepcopy(a)
    keep = [[0, 1, 2], [3, 4, 5, 6, 7], [1]]
    slice_qk(a, keep)
    slice_qk(b, keep, width=aligned_width(5, align=8, full=16))
    assert (a.qk_dim, b.qk_dim) == (5, 8) and b.qk_counts == [3, 5, 1]
    x = torch.randn(2, 9, 48)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=1e-6)
    with pytest.raises(NascompressError, match="padded Q/K width 4 must hold the largest kept count 5"):
        slice_qk(core_attention(vit(embed_dim=48, heads=3).blocks[0].attn), keep, width=4)


def test_layouts_give_the_supernet_output_and_flops_count_the_padding():
    sup, mat = narrowed()
    x = torch.randn(3, 1, 16, 16)
    ref = sup(x)
    flops = {}
    for layout in ("packed", "pad", "auto"):
        set_qk_layout(mat, layout)
        torch.testing.assert_close(mat(x), ref, rtol=0, atol=1e-4)  # materialized == supernet in every layout
        flops[layout] = count_flops(mat, x[:1]).total
    n = 17  # 16 patches + CLS
    extra = sum(3 * n * n * (b.attn.head_dim - b.attn.qk_dim) for b in mat.blocks)
    assert extra > 0 and flops["pad"] - flops["packed"] == pytest.approx(extra)
    assert flops["auto"] == flops["pad"]  # auto pads on the CPU (bench/qk_layout.py)
    assert qk_layout_summary(mat, x) == {"pad": 2, "packed": 0}
    set_qk_layout(mat, "packed")
    assert qk_layout_summary(mat, x) == {"pad": 0, "packed": 2}
    with pytest.raises(NascompressError, match="qk_layout must be one of auto, packed, pad"):
        set_qk_layout(mat, "flash")


def test_padded_layout_runs_the_fused_cpu_kernel():
    """On the CPU torch's fused kernel needs one head dim: padded q/k reach it, packed ones do not."""
    from unittest import mock

    import torch.nn.functional as F

    _, mat = narrowed(seed=1)
    x = torch.randn(2, 1, 16, 16)
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[-1], v.shape[-1]))
        return real(q, k, v, **kw)

    for layout in ("pad", "packed"):
        set_qk_layout(mat, layout)
        seen.clear()
        with mock.patch.object(F, "scaled_dot_product_attention", spy):
            mat(x)
        same = all(dq == dv for dq, dv in seen)
        assert same == (layout == "pad"), (layout, seen)


def test_qk_pads_rule():
    f32, bf16 = torch.float32, torch.bfloat16
    assert not qk_pads("auto", qk_dim=16, head_dim=64, device_type="cuda", dtype=bf16)  # cuDNN / mem-efficient
    assert qk_pads("auto", qk_dim=12, head_dim=64, device_type="cuda", dtype=bf16)  # not a multiple of 8
    assert not qk_pads("auto", qk_dim=12, head_dim=64, device_type="cuda", dtype=f32)  # fp32 mem-efficient: 4
    assert qk_pads("auto", qk_dim=10, head_dim=64, device_type="cuda", dtype=f32)
    assert qk_pads("auto", qk_dim=16, head_dim=64, device_type="cpu", dtype=f32)
    assert not qk_pads("packed", qk_dim=10, head_dim=64, device_type="cpu", dtype=f32)
    assert qk_pads("pad", qk_dim=16, head_dim=64, device_type="cuda", dtype=bf16)
    assert not qk_pads("pad", qk_dim=64, head_dim=64, device_type="cpu", dtype=f32)
