"""The FlexAttention safety rule: a wrong compiled kernel never reaches the output (issue 10 §1)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from nascompress.methods import block_sparse


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    """Each test starts with no cached self-check verdicts (and leaves the process's cache alone)."""
    monkeypatch.setattr(block_sparse, "_FLEX_OK", {})


def inputs(n, bs, p, seed=0, B=2, H=2, d=16):
    torch.manual_seed(seed)
    q, k, v = torch.randn(B, n, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)  # the module's strided views
    layout = block_sparse.plan_blocks(n, p, budget=math.ceil(0.3 * n), block_size=bs)
    assert layout.sparse
    idx = block_sparse.top_blocks(torch.randn(B, H, layout.nb, layout.nb), layout.keep)
    return q, k, v, idx, layout


def safe_vs_masked(q, k, v, idx, layout):
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        got = block_sparse.flex_block_attention(q, k, v, idx, layout, scale=scale)
    torch.testing.assert_close(
        got, block_sparse.masked_block_attention(q, k, v, idx, layout, scale=scale), atol=1e-5, rtol=1e-5
    )


def flex_warnings(rec):
    return [w for w in rec if "FlexAttention disabled" in str(w.message)]


@pytest.mark.parametrize("n,bs,p", [(33, 8, 1), (64, 8, 0), (49, 24, 1)])
def test_refused_block_sizes_never_reach_the_compiled_kernel(monkeypatch, n, bs, p):
    """Blocks below 16 tokens or of 16 k + 8 (wrong on some CPUs) run the gather path without compiling."""

    def no_compile():
        raise AssertionError("the compiled flex kernel must not be built for this block size")

    monkeypatch.setattr(block_sparse, "compiled_flex_attention", no_compile)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for seed in (0, 1):
            safe_vs_masked(*inputs(n, bs, p, seed=seed))
    assert len(flex_warnings(rec)) == 1 and f"BLOCK_SIZE={bs}" in str(flex_warnings(rec)[0].message)


def test_self_check_catches_a_wrong_kernel(monkeypatch):
    """A kernel returning garbage is caught at first use: outputs stay equal to the masked path, the
    configuration is marked unusable, one warning across two calls, no second self-check."""
    calls = []

    def zeros(q, k, v, *, block_mask, scale):
        calls.append(q.shape)
        return torch.zeros_like(q)

    monkeypatch.setattr(block_sparse, "compiled_flex_attention", lambda: zeros)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for seed in (0, 1):
            q, k, v, idx, layout = inputs(65, 16, 1, seed=seed)
            safe_vs_masked(q, k, v, idx, layout)
        assert not block_sparse.flex_kernel_ok(layout, q)
    assert len(calls) == 1, "only the self-check may run the wrong kernel"
    (w,) = flex_warnings(rec)
    assert "BLOCK_SIZE=16" in str(w.message) and "self-check" in str(w.message)
    assert list(block_sparse._FLEX_OK.values()) == [False]


def test_the_real_kernel_passes_its_self_check_at_block_16():
    """The compiled kernel, its BlockMask (a short last block, two prefix tokens) and the self-check
    agree at BLOCK_SIZE 16. Failing here means flex runs the gather path on this machine: either
    make_block_mask is wrong or the kernel is (see the warning)."""
    q, k, v, idx, layout = inputs(42, 16, 2)
    assert not layout.exact
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        safe_vs_masked(q, k, v, idx, layout)
    assert not flex_warnings(rec), str(flex_warnings(rec)[0].message)
    assert block_sparse.flex_kernel_ok(layout, q)


# ---------------------------------------------------------------------------------------------
# CUDA: Inductor's flex kernel tiles each block by BLOCK_M x BLOCK_N


@pytest.mark.parametrize("n_patch,bs", [(196, 32), (784, 112), (3136, 112), (49, 16)])
def test_flex_block_sides_are_multiples_of_16(n_patch, bs):
    """DeiT-S at 224 (196 patches) took 28-token blocks, which Inductor's CUDA kernel refuses."""
    assert block_sparse.auto_block_size(n_patch, 16) == bs
    assert block_sparse.auto_block_size(196) == 28  # the gather kernel keeps its own choice
    layout = block_sparse.plan_blocks(
        n_patch + 1,
        1,
        budget=math.ceil(0.25 * (n_patch + 1)),
        multiple=block_sparse.flex_multiple("flex", None, torch.device("cpu")),
    )
    assert layout.bs == bs
    tiles = block_sparse.cuda_kernel_options(layout)
    assert (
        layout.bs % tiles["BLOCK_M"] == 0 and tiles["BLOCK_M"] == tiles["BLOCK_N"] and tiles["BLOCK_M"] >= min(16, bs)
    )


def test_an_explicit_block_size_cuda_cannot_tile_is_refused_with_one_line():
    from nascompress.errors import NascompressError

    assert block_sparse.flex_multiple("gather", 28, torch.device("cuda")) == 1
    assert block_sparse.flex_multiple("flex", 32, torch.device("cuda")) == 16
    assert block_sparse.flex_multiple("flex", 28, torch.device("cpu")) == 16  # the CPU runs 28 (self-checked)
    with pytest.raises(NascompressError, match="multiple of 16 tokens .* got block_size=28; set block_size"):
        block_sparse.flex_multiple("flex", 28, torch.device("cuda"))


def test_a_flex_model_takes_the_same_blocks_on_every_device():
    from nascompress.methods import get_method
    from nascompress.models.build import ModelSpec, build_model

    torch.manual_seed(0)
    dense = build_model(
        ModelSpec(
            "vit_tiny_patch16_224",
            dict(img_size=56, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=10, in_chans=1),
        )
    ).eval()
    model, _ = get_method("sparsifiner").prepare_fresh(
        dense, {"attn_keep_ratio": 0.25, "n_down": 8, "mode": "block", "kernel": "flex"}
    )
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.eval()(torch.randn(1, 1, 56, 56))
    layout = model.blocks[0].attn.kernel._block_stats[1]
    assert layout.bs % 16 == 0 and layout.bs == block_sparse.auto_block_size(196, 16)
