"""Sparsifiner: identity, block path == masked path, honest FLOPs, training stages, bad input."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from nascompress.errors import NascompressError
from nascompress.methods import block_sparse, get_method
from nascompress.train.finetune import split_settings
from nascompress.methods.sparsifiner import SparsifinerHooks, SparsifinerRecipe
from nascompress.methods.sparsifiner_kernel import attention_budget, masked_attention, sparse_modules, topk_mask
from nascompress.models.build import ModelSpec, build_model, custom_vit_spec
from nascompress.profiling import count_flops
from nascompress.train.config import TrainConfig

from .conftest import tiny_gray_vit


def sparsify(model, **cfg):
    return get_method("sparsifiner").apply(model, {"name": "sparsifiner", "config": cfg})


def prepare(model, settings):
    """What finetune does: split the settings into config and recipe, patch a fresh model."""
    config, recipe = split_settings("sparsifiner", dict(settings))
    return get_method("sparsifiner").prepare_fresh(model, config, recipe)


@pytest.mark.parametrize("cfg", [dict(attn_keep_ratio=1.0), dict(budget=17), dict(attn_keep_ratio=1.0, mode="block")])
def test_identity_full_budget_is_dense_timm(cfg):
    dense = tiny_gray_vit()
    x = torch.randn(3, 1, 16, 16)
    ref = dense(x)
    out = sparsify(copy.deepcopy(dense), **cfg)(x)
    torch.testing.assert_close(out, ref)


def test_masked_path_with_all_keys_equals_dense_attention():
    q, k, v = (torch.randn(2, 3, 17, 8) for _ in range(3))
    full = topk_mask(torch.randn(2, 3, 17, 17), 17)
    assert full.all()
    torch.testing.assert_close(masked_attention(q, k, v, full, scale=8**-0.5), F.scaled_dot_product_attention(q, k, v))


def test_topk_mask_keeps_budget_per_query_and_full_cls_row():
    s = torch.randn(2, 3, 50, 50)
    m = topk_mask(s, 13, full_rows=1)
    assert (m[..., 1:, :].sum(-1) == 13).all() and m[..., 0, :].all()
    best = s[..., 1:, :].topk(13, dim=-1).indices
    assert torch.gather(m[..., 1:, :], -1, best).all()


def test_sparse_attention_changes_output_and_lowers_flops():
    dense = tiny_gray_vit(img=32)  # 65 tokens; at 17 tokens the predictor costs more than it saves
    x = torch.randn(2, 1, 32, 32)
    sp = sparsify(copy.deepcopy(dense), attn_keep_ratio=0.25, n_down=8)
    assert (sp(x) - dense(x)).abs().max() > 1e-4
    assert count_flops(sp, x).blocks[0]["attn"] < count_flops(dense, x).blocks[0]["attn"]


@pytest.mark.parametrize("n,bs,p", [(50, 7, 1), (50, 8, 1), (65, 16, 1), (64, 8, 0), (66, 8, 2)])
def test_block_paths_match_masked_path(n, bs, p):
    """Gathered-blocks SDPA (from strided qkv views) and the flex entry point (compiled FlexAttention
    where ``flex_kernel_ok`` accepts it; BLOCK_SIZE 7 and 8 are refused, so the gather path) == masked
    softmax with the same block mask: prefix rows and prefix keys dense, kept patch tiles only; exact
    blocks, a short last block, no prefix token, two prefix tokens."""
    torch.manual_seed(0)
    B, H, d = 2, 2, 16
    qkv = torch.randn(B, n, 3, H, d).permute(2, 0, 3, 1, 4)  # the module's strided views
    q, k, v = qkv.unbind(0)
    layout = block_sparse.plan_blocks(n, p, budget=math.ceil(0.3 * n), block_size=bs)
    assert layout.sparse and layout.exact == ((n - p) % bs == 0)
    idx = block_sparse.top_blocks(torch.randn(B, H, layout.nb, layout.nb), layout.keep)
    mask = block_sparse.dense_block_mask(idx, layout)
    assert mask[:, :, :p].all() and mask[:, :, :, :p].all() and not mask[:, :, p:, p:].all()
    assert (mask[:, :, p:].sum(-1) >= p + layout.keep * bs - (bs - layout.last)).all()
    want = block_sparse.masked_block_attention(q, k, v, idx, layout, scale=d**-0.5)
    with torch.no_grad():
        got = block_sparse.gather_block_attention(q, k, v, idx, layout, scale=d**-0.5)
        flex = block_sparse.flex_block_attention(q, k, v, idx, layout, scale=d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex, want, atol=1e-5, rtol=1e-5)
    assert block_sparse.kept_pairs(idx, layout).sum().item() == mask.sum().item()


@pytest.mark.parametrize("kernel", ["gather", "flex"])
def test_block_inference_kernels_match_masked_path_in_the_model(kernel):
    model = sparsify(
        tiny_gray_vit(img=28, dim=32, heads=2), attn_keep_ratio=0.25, mode="block", block_size=7, kernel=kernel
    )
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        a = model(x)
        dens = model.blocks[0].attn.kernel.density
        for m in sparse_modules(model):
            m.cfg = m.cfg.replace(kernel="masked")
        b = model(x)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert dens == model.blocks[0].attn.kernel.density < 0.5


def test_block_predictor_equals_pooled_unstructured_scores():
    """predict_blocks == top blocks of S = C @ W_up (thresholded, patch rows/columns) summed over tiles."""
    from nascompress.methods.sparsifiner_kernel import lowrank_attention, sparse_basis, sparse_coefficients

    torch.manual_seed(0)
    B, H, d, r, n, bs = 2, 2, 16, 6, 50, 8
    q, k = torch.randn(B, H, n, d), torch.randn(B, H, n, d)
    w_down, w_up = torch.rand(H, r, n) / n, torch.randn(H, r, n) * 0.05
    scale, tau, wt = d**-0.5, 0.2, 1e-2
    coef = sparse_coefficients(lowrank_attention(q, k, w_down, scale), tau)
    assert (coef == 0).any() and (coef != 0).any()
    layout = block_sparse.plan_blocks(n, 1, budget=13, block_size=bs)
    s = (coef @ sparse_basis(w_up, wt))[..., 1:, 1:]  # patch rows x patch columns (n - 1 = 49)
    tiles = F.pad(s, (0, 7, 0, 7)).reshape(B, H, 7, 8, 7, 8).sum((3, 5))
    torch.testing.assert_close(
        block_sparse.block_scores(coef, block_sparse.pooled_basis(w_up, wt, layout), layout),
        tiles,
        atol=1e-6,
        rtol=1e-5,
    )
    idx = block_sparse.predict_blocks(
        q, k, w_down, block_sparse.pooled_basis(w_up, wt, layout), scale=scale, tau=tau, layout=layout
    )
    assert torch.equal(idx, block_sparse.top_blocks(tiles, layout.keep))


@pytest.mark.parametrize("n_patch,bs", [(196, 28), (784, 98), (3136, 112), (49, 7), (64, 8)])
def test_auto_block_size_divides_the_patch_count(n_patch, bs):
    assert block_sparse.auto_block_size(n_patch) == bs
    lay = block_sparse.plan_blocks(n_patch + 1, 1, budget=math.ceil(0.25 * (n_patch + 1)))
    assert lay.exact and 1 + lay.keep * lay.bs >= math.ceil(0.25 * (n_patch + 1))


def test_deit_s_mhsa_flops_reduction_at_keep_025_per_layer():
    """DeiT-S at 224, keep ratio 0.25: attention-matrix MACs (QK^T, AV, predictor) per layer.

    With tau = 0 every coefficient is non-zero, so the sparse product C @ W_up costs n * nnz(W_up)
    = n^2 per head (zero-shot W_up has one entry per column) and the count is analytic:
    dense 2 n^2 C; sparse H (2 r n d + n^2 + 2 d ((n-1) B + n)), n=197, r=32, B=50 -> -57.2%.
    """
    model = build_model(ModelSpec("deit_small_patch16_224")).eval()
    x = torch.randn(1, 3, 224, 224)
    C, n, H, d, r, B = 384, 197, 6, 64, 32, 50
    proj = 4 * n * C * C  # qkv + proj Linear layers
    dense = 2 * n * n * C  # QK^T + AV, dense (test_profiling pins the dense count)
    exact = sparsify(copy.deepcopy(model), attn_keep_ratio=0.25, tau=0.0)
    rep = count_flops(exact, x)
    want = H * (2 * r * n * d + n * n + 2 * d * ((n - 1) * B + n))
    per_layer = []
    for bs in rep.blocks:
        assert bs["attn"] - proj == pytest.approx(want)
        per_layer.append(1 - (bs["attn"] - proj) / dense)
    assert per_layer[0] == pytest.approx(0.572, abs=0.002)
    paper = sparsify(copy.deepcopy(model), attn_keep_ratio=0.25)  # tau = 0.05: data-dependent, sparser product
    rep2 = count_flops(paper, x)
    red = [1 - (b2["attn"] - proj) / dense for b2 in rep2.blocks]
    print("MHSA attention-matrix FLOPs reduction per layer (tau=0):", [round(v, 4) for v in per_layer])
    print("MHSA attention-matrix FLOPs reduction per layer (tau=0.05):", [round(v, 4) for v in red])
    print(
        "MHSA incl. qkv/proj per layer (tau=0.05):", [round(1 - b2["attn"] / (dense + proj), 4) for b2 in rep2.blocks]
    )
    assert all(0.572 - 1e-3 <= v < 0.75 for v in red)


def test_fewer_tokens_after_pruning_and_too_many_tokens():
    model = sparsify(tiny_gray_vit(), attn_keep_ratio=0.5)
    attn = model.blocks[0].attn
    x = torch.randn(2, 11, 32)  # 11 of 17 tokens left by a pruning method
    assert attn(x).shape == (2, 11, 32)
    with pytest.raises(NascompressError, match="built for 17 tokens, got 20"):
        attn(torch.randn(1, 20, 32))


def test_stacks_with_token_pruning():
    """Prune tokens at fixed layers (gather), sparsify attention everywhere."""
    model = sparsify(tiny_gray_vit(img=16, depth=3), attn_keep_ratio=0.5)
    orig = model.blocks[1].forward
    model.blocks[1].forward = lambda x, **kw: orig(x[:, :9])
    rep = count_flops(model, torch.randn(2, 1, 16, 16))
    dense = count_flops(tiny_gray_vit(img=16, depth=3), torch.randn(2, 1, 16, 16))
    assert rep.blocks[2]["attn"] < dense.blocks[2]["attn"]
    assert rep.blocks[1]["mlp"] == pytest.approx(9 * 2 * 32 * 128)


def test_save_load_roundtrip(tmp_path):
    from nascompress.runs.io import load_with_arch, make_arch, save_model

    spec = custom_vit_spec(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10, in_chans=1)
    torch.manual_seed(0)
    model = build_model(spec)
    model, rec = prepare(model, {"attn_keep_ratio": 0.5, "mode": "block", "kernel": "masked"})
    with torch.no_grad():
        model.blocks[0].attn.kernel.w_up.add_(0.1)
    arch = make_arch(spec, input_spec={"img_size": [16, 16], "in_chans": 1, "mean": [0.3], "std": [0.3]}, methods=[rec])
    save_model(tmp_path, model, arch)
    loaded, _ = load_with_arch(tmp_path)
    assert "blocks.0.attn.kernel.w_down" in loaded.state_dict() and "blocks.0.attn.qkv.weight" in loaded.state_dict()
    x = torch.randn(2, 1, 16, 16)
    torch.testing.assert_close(loaded(x), model.eval()(x))


def test_two_stage_hooks_train_the_right_parameters():
    teacher = tiny_gray_vit()
    model, rec = prepare(copy.deepcopy(teacher), {"attn_keep_ratio": 0.25, "stage1_epochs": 1, "n_down": 4})
    hooks = get_method("sparsifiner").hooks(
        model, rec, teacher=teacher.requires_grad_(False), train_cfg=TrainConfig(epochs=5, lr=None)
    )
    assert isinstance(hooks, SparsifinerHooks)
    groups = hooks.param_groups(model, TrainConfig(epochs=5, lr=None))
    pred = [g for g in groups if any(p is model.blocks[0].attn.kernel.w_down for p in g["params"])]
    assert pred[0]["lr_scale"] == SparsifinerRecipe().predictor_lr_scale
    x, y = torch.randn(4, 1, 16, 16), torch.randint(0, 10, (4,))
    model.train()
    for epoch, trained in ((0, "kernel.w_"), (1, "qkv")):
        model.zero_grad(set_to_none=True)
        hooks.on_epoch_start(model, epoch=epoch)
        loss, logs = hooks.loss(model, x, y, epoch=epoch, cfg=TrainConfig(epochs=5, lr=None))
        loss.backward()
        got = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        assert any(trained in n for n in got)
        if epoch == 0:
            assert all("kernel.w_" in n for n in got) and "l_attn" in logs and loss > 0
        else:
            assert not any("kernel.w_" in n for n in got) and {"ce", "l_token", "l_cls_distill"} <= set(logs)


def test_finetune_job_end_to_end(tiny_run, tmp_path):
    from nascompress.data import DataConfig
    from nascompress.train.finetune import FinetuneJob, finetune
    from nascompress.runs.io import load_with_arch

    data = DataConfig(dataset="synthetic", train_limit=128, eval_limit=64)
    job = FinetuneJob(
        run_dir=str(tiny_run),
        method="sparsifiner",
        config={"attn_keep_ratio": 0.5},
        recipe={"stage1_epochs": 1},
        data=data,
        train=TrainConfig(epochs=2, batch_size=64, lr=1e-4, warmup_epochs=0.0),
        out=str(tmp_path / "ft"),
    )
    metrics = finetune(job)
    model, arch = load_with_arch(tmp_path / "ft")
    assert arch["methods"][-1]["name"] == "sparsifiner" and metrics.zero_shot is False
    assert len(sparse_modules(model)) == 2
    zs = finetune(
        FinetuneJob(
            run_dir=str(tiny_run),
            method="sparsifiner",
            config={"attn_keep_ratio": 0.5},
            recipe={"stage1_steps": 3},
            data=data,
            out=str(tmp_path / "zs"),
            zero_shot=True,
        )
    )
    assert zs.zero_shot is True and "l_attn" in zs.calibration


@pytest.mark.parametrize(
    "cfg,msg",
    [
        ({"attn_keep_ratio": 0.0}, r"attn_keep_ratio must be in \(0, 1\], got 0.0"),
        ({"attn_keep_ratio": 1.5}, r"attn_keep_ratio must be in \(0, 1\], got 1.5"),
        ({"budget": 18}, r"budget 18 is larger than the token count: valid range 1..17"),
        ({"mode": "dense"}, r"mode must be one of unstructured, block, got 'dense'"),
        ({"kernel": "cuda"}, r"kernel must be one of gather, flex, masked, got 'cuda'"),
        ({"keep": 0.5}, r"unknown sparsifiner option\(s\) \['keep'\]; valid options: attn_keep_ratio"),
        ({"stage1_epochs": -1}, r"stage1_epochs must be an integer in \[0, inf\], got -1"),
    ],
)
def test_bad_input(cfg, msg):
    with pytest.raises(NascompressError, match=msg):
        prepare(tiny_gray_vit(), cfg)


def test_legacy_flex_key_maps_to_kernel():
    from nascompress.methods.sparsifiner_kernel import SparsifinerConfig

    assert SparsifinerConfig.from_dict({"mode": "block", "flex": False}).kernel == "masked"
    assert SparsifinerConfig.from_dict({"mode": "block", "flex": True}).kernel == "gather"


def test_bad_input_functions_and_non_vit():
    with pytest.raises(NascompressError, match=r"budget 20 is larger than the token count: valid range 1..17"):
        attention_budget(0.5, 17, 20)
    with pytest.raises(NascompressError, match=r"budget 5 is larger than the token count: valid range 1..4"):
        topk_mask(torch.randn(1, 1, 4, 4), 5)
    import timm

    with pytest.raises(NascompressError, match="needs a timm VisionTransformer.*got ResNet"):
        sparsify(timm.create_model("test_resnet", pretrained=False))
    model = sparsify(tiny_gray_vit(), attn_keep_ratio=0.5)
    with pytest.raises(NascompressError, match="sparsifiner cannot be applied after sparsifiner"):
        sparsify(model)


def test_stacks_with_evit():
    """Sparsifiner sparsifies attention everywhere, then EViT prunes tokens at fixed layers; the other
    order is refused (one canonical order per pair)."""
    from nascompress.methods import apply_methods

    dense = tiny_gray_vit(img=32, depth=3, dim=32, heads=2)
    x = torch.randn(2, 1, 32, 32)
    recs = [
        {"name": "sparsifiner", "config": {"attn_keep_ratio": 0.25, "n_down": 8}},
        {"name": "evit", "config": {"keep_rate": 0.5, "prune_layers": [2]}},
    ]
    model = apply_methods(copy.deepcopy(dense), recs).eval()
    with torch.no_grad():
        out = model(x)
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    rep, ref = count_flops(model, x), count_flops(dense, x)
    assert rep.blocks[2]["mlp"] < ref.blocks[2]["mlp"]  # tokens pruned before layer 3
    assert rep.blocks[0]["attn"] < ref.blocks[0]["attn"] and rep.blocks[2]["attn"] < ref.blocks[2]["attn"]
    off = [
        {"name": "sparsifiner", "config": {"attn_keep_ratio": 1.0}},
        {"name": "evit", "config": {"keep_rate": 1.0, "prune_layers": [2], "fuse_token": False}},
    ]
    with torch.no_grad():
        torch.testing.assert_close(apply_methods(copy.deepcopy(dense), off).eval()(x), dense(x))
    with pytest.raises(NascompressError, match="sparsifiner cannot be applied after evit"):
        apply_methods(copy.deepcopy(dense), recs[::-1])


def test_on_materialized_dcs_with_narrower_qk():
    """Sparsifiner on a DCS-materialized attention (q/k narrower than v): every kernel path agrees."""
    from nascompress.methods.dcs import DCSConfig, make_supernet, materialize

    sup = make_supernet(tiny_gray_vit(img=28, dim=32, heads=2), DCSConfig(qk_mask="static", align=1)).eval()
    with torch.no_grad():
        for blk in sup.blocks:
            blk.attn.qk_mask.theta.copy_(torch.randn_like(blk.attn.qk_mask.theta))
    mat, _ = materialize(sup, DCSConfig(qk_mask="static", align=1))
    assert mat.blocks[0].attn.qk_dim < mat.blocks[0].attn.head_dim
    x = torch.randn(2, 1, 28, 28)
    outs = {}
    for kernel in ("gather", "masked"):
        m = sparsify(copy.deepcopy(mat), attn_keep_ratio=0.3, mode="block", block_size=7, kernel=kernel)
        with torch.no_grad():
            outs[kernel] = m(x)
    torch.testing.assert_close(outs["gather"], outs["masked"], atol=1e-5, rtol=1e-5)


def test_stage1_attention_loss_goes_down():
    """The predictor-only stage (stage 1) lowers the reconstruction loss of the dense attention,
    and leaves the backbone untouched."""
    from nascompress.methods.sparsifiner import calibrate_predictor

    model, rec = prepare(tiny_gray_vit(img=28), {"attn_keep_ratio": 0.25, "n_down": 8})
    backbone = {k: v.clone() for k, v in model.state_dict().items() if "kernel" not in k}
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 1, 28, 28, generator=g), torch.zeros(8, dtype=torch.long)) for _ in range(3)]
    first = calibrate_predictor(model, batches[:1], steps=1, lr=1e-2)["l_attn"]
    last = calibrate_predictor(model, batches, steps=60, lr=1e-2)["l_attn"]
    assert last < 0.7 * first, (first, last)
    for k, v in model.state_dict().items():
        if k in backbone:
            torch.testing.assert_close(v, backbone[k])
