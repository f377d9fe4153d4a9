"""The method contract, tested over the registry: every method is the plain timm model when its
compression is off; every pair the registry allows, stacked with ``apply_methods``, gives the same
logits as a hand-written reference forward that composes the methods' pure functions; every pair
it does not allow is refused; loading a saved model does not import the training engine.

A new method must add its entries to ``OFF`` and ``ON`` below (the first test checks that).
"""

from __future__ import annotations

import copy
import itertools
import math
import subprocess
import sys

import pytest
import torch

from nascompress.errors import NascompressError
from nascompress.methods import apply_methods, available_methods, get_method
from nascompress.methods.dcs import DCSConfig, make_supernet, materialize
from nascompress.methods.dcs_supernet import selection
from nascompress.methods.evit import evit_prune
from nascompress.methods.sparsifiner_kernel import lowrank_attention, sparse_basis, sparse_coefficients, topk_mask
from nascompress.methods.tokens import keep_prefix_and
from nascompress.models.build import ModelSpec, build_model, input_size

from .tome_reference import merge_batch

# compression off: the model must equal plain timm
OFF = {
    "dcs": {"qk_mask": "static"},  # a fresh supernet: every gate starts open
    "uniform": {"keep": 1.0},
    "sparsifiner": {"attn_keep_ratio": 1.0},
    "evit": {"keep_rate": 1.0},
    "dynamicvit": {"rho": 1.0},
    "mgvit": {"epsilon": 1e-6},  # every image exits at the single-granularity stage: the dense model
    "mgvit-h": {"r_h": 0.0, "r_t": 1.0},  # no cell split: the dense pyramid (a pyramid model: dense_for)
    "tome": {"r": 0},
}
# compression on, for the pairs
ON = {
    "dcs": {"qk_mask": "static"},  # then random gates, materialized
    "uniform": {"keep": 0.5},
    "sparsifiner": {"attn_keep_ratio": 0.3, "n_down": 8},
    "evit": {"keep_rate": 0.5, "prune_layers": [2]},
    "dynamicvit": {"rho": 0.5, "prune_layers": [2, 3]},
    "mgvit": {"epsilon": 0.5},
    "mgvit-h": {"variant": "r", "r_h": 0.25, "r_t": 0.25, "r_pos": 0.5, "r_neg": 0.25, "epsilon": 0.5},
    "tome": {"r": 6},
}


def dense(**kw):
    torch.manual_seed(0)
    args = dict(img_size=28, patch_size=4, embed_dim=32, depth=3, num_heads=2, num_classes=10, in_chans=1)
    args.update(kw)
    return build_model(ModelSpec("vit_tiny_patch16_224", args)).eval()


def dense_for(name, **kw):
    """The dense model a method applies to: a tiny pvt_v2_b0 (64 px) for mgvit-h, else :func:`dense`."""
    if name != "mgvit-h":
        return dense(**kw)
    torch.manual_seed(0)
    return build_model(ModelSpec("pvt_v2_b0", dict(img_size=64, num_classes=10, in_chans=1))).eval()


def apply_on(model, name):
    """Apply ``name`` compressing: DCS as a materialized random selection, the rest from ON."""
    method = get_method(name)
    if name != "dcs":
        return method.prepare_fresh(model, dict(ON[name]))[0].eval()
    cfg = DCSConfig(**ON["dcs"])
    method.check_stack(model)
    sup = make_supernet(model, cfg).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for blk in sup.blocks:
            blk.dcs_alpha.copy_(torch.randn(blk.dcs_alpha.shape, generator=g))
            blk.attn.qk_mask.theta.copy_(torch.randn(blk.attn.qk_mask.theta.shape, generator=g))
    mat, _ = materialize(sup, cfg)
    mat.nc_methods = ["dcs"]
    return mat


def test_every_registered_method_has_test_configs():
    assert set(available_methods()) == set(OFF) == set(ON)


@pytest.mark.parametrize("name", sorted(OFF))
@pytest.mark.parametrize("kw", [{}, {"init_values": 0.1}])
def test_identity_when_compression_is_off(name, kw):
    if name == "mgvit-h" and kw:
        pytest.skip("a pyramid ViT has no LayerScale (init_values)")
    model = dense_for(name, **kw)
    x = torch.randn(3, 1, 64, 64) if name == "mgvit-h" else torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        ref = model(x)
        patched = get_method(name).prepare_fresh(copy.deepcopy(model), dict(OFF[name]))[0].eval()
        torch.testing.assert_close(patched(x), ref)
        if name == "mgvit":
            assert patched.inference_stats()["exit_share"] == 1.0


# ---------------------------------------------------------------------------------------------
# The reference: a plain ViT forward from the dense weights, with each method's effect composed
# by hand from its pure functions (no patched module runs here except DynamicViT's predictor).


def reference_forward(base, stacked, names, x):
    """``base``: the dense model (or the DCS/uniform-compressed one, whose selection is read from its
    own physical layers); ``stacked``: the model the registry built, read for settings only."""
    p = base.num_prefix_tokens
    t = base._pos_embed(base.patch_embed(x))
    n0 = t.shape[1] - p
    sp = [blk.attn.kernel for blk in stacked.blocks] if "sparsifiner" in names else None
    ev = stacked.evit_state if "evit" in names else None
    dv = (
        {i: blk.dvit_predictor for i, blk in enumerate(stacked.blocks) if getattr(blk, "dvit_stage", 0)}
        if "dynamicvit" in names
        else {}
    )
    ratios = stacked.dvit_state.ratios if dv else []
    tm = stacked.tome_state if "tome" in names else None
    size = t.new_ones(t.shape[0], t.shape[1])  # ToMe's token sizes
    for i, blk in enumerate(base.blocks):
        if i in dv:  # DynamicViT: keep the top tokens by the predictor's keep score
            logits = dv[i](t[:, p:])
            keep = max(1, int(ratios[len([j for j in dv if j < i])] * n0 + 1e-6))
            if keep < t.shape[1] - p:
                idx = (logits[..., 0] - logits[..., 1]).topk(keep, dim=1).indices
                t = keep_prefix_and(t, idx, p)
        a = blk.attn
        h = blk.norm1(t)
        B, N, _ = h.shape
        qkv = a.qkv(h)
        H = a.num_heads
        qk_dim = getattr(a, "qk_dim", None)
        if qk_dim is None:
            q, k, v = qkv.reshape(B, N, 3, H, a.head_dim).permute(2, 0, 3, 1, 4)
        else:  # the materialized layout: padded q/k (zero rows) then v
            S = H * qk_dim
            q, k, v = qkv.split([S, S, a.attn_dim], -1)
            q, k = (z.reshape(B, N, H, qk_dim).transpose(1, 2) for z in (q, k))
            v = v.reshape(B, N, H, a.head_dim).transpose(1, 2)
        scale = a.head_dim**-0.5
        scores = (q * scale) @ k.transpose(-2, -1)
        if tm is not None and tm.prop_attn:  # ToMe's proportional attention
            scores = scores + size.log()[:, None, None, :]
        if sp is not None:  # Sparsifiner's predicted connectivity, by its pure functions
            kern = sp[i]
            w_down, w_up = kern.w_down[..., :N], kern.w_up[..., :N]
            coef = sparse_coefficients(lowrank_attention(q, k, w_down, scale), kern.cfg.tau)
            budget = min(N, max(1, math.ceil(kern.cfg.attn_keep_ratio * N - 1e-6)))
            if budget < N:
                mask = topk_mask(coef @ sparse_basis(w_up, kern.cfg.w_thresh), budget, full_rows=p)
                scores = scores.masked_fill(~mask, float("-inf"))
        attn = scores.softmax(-1)
        o = (attn @ v).transpose(1, 2).reshape(B, N, a.attn_dim)
        t = t + blk.ls1(a.proj(o))
        if ev is not None and hasattr(stacked.blocks[i], "evit_stage"):  # EViT between the halves
            rate = ev.rates[stacked.blocks[i].evit_stage]
            n = t.shape[1] - p
            keep = max(1, math.ceil(rate * n - 1e-6))
            if keep < n:
                t = evit_prune(t, attn[:, :, 0, p:].mean(1), keep, fuse=ev.fuse_token, prefix=p)
        if tm is not None and tm.r[i] > 0:  # ToMe between the halves (the independent reference)
            t, size = merge_batch(t, k, size, tm.r[i], p)
        keep_ch = getattr(blk, "mlp_keep", None)
        if keep_ch is None:
            t = t + blk.ls2(blk.mlp(blk.norm2(t)))
        elif keep_ch.numel():
            y = blk.ls2(blk.mlp(blk.norm2(t)[..., keep_ch]))
            t = t.index_add(-1, keep_ch, y)
    return base.forward_head(base.norm(t))


ALLOWED = [(a, b) for a, b in itertools.permutations(sorted(OFF), 2) if a in get_method(b).stacks_on]
REFUSED = [(a, b) for a, b in itertools.product(sorted(OFF), repeat=2) if (a, b) not in ALLOWED]


def test_the_allowed_order():
    assert set(ALLOWED) == {
        ("dcs", "sparsifiner"),
        ("dcs", "evit"),
        ("dcs", "dynamicvit"),
        ("uniform", "sparsifiner"),
        ("uniform", "evit"),
        ("uniform", "dynamicvit"),
        ("sparsifiner", "evit"),
        ("sparsifiner", "dynamicvit"),
        ("dcs", "tome"),
        ("uniform", "tome"),
        ("sparsifiner", "tome"),
    }


@pytest.mark.parametrize("first,second", ALLOWED)
def test_allowed_pairs_equal_the_hand_composed_reference(first, second):
    x = torch.randn(3, 1, 28, 28)
    a = apply_on(dense(), first)
    both = apply_on(copy.deepcopy(a), second)
    assert both.nc_methods == [first, second]
    with torch.no_grad():
        got = both(x)
        # channel methods are physical: their model is the reference's base; the rest are composed by hand
        base = a if first in ("dcs", "uniform") else dense()
        want = reference_forward(base, both, [first, second], x)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert (got - a(x)).abs().max() > 1e-4  # the second method did not vanish


@pytest.mark.parametrize("first,second", REFUSED)
def test_refused_pairs(first, second):
    a = apply_on(dense_for(first), first)
    with pytest.raises(NascompressError, match=f"{second} cannot be applied after {first}"):
        rec = {"name": second, "config": OFF[second]}
        apply_methods(a, [rec])


def test_loading_a_saved_model_does_not_import_the_training_engine(tmp_path):
    from nascompress.runs.io import make_arch, save_model

    spec = ModelSpec(
        "vit_tiny_patch16_224",
        dict(img_size=28, patch_size=4, embed_dim=32, depth=3, num_heads=2, num_classes=10, in_chans=1),
    )
    m = apply_methods(
        dense(), [{"name": "sparsifiner", "config": ON["sparsifiner"]}, {"name": "evit", "config": ON["evit"]}]
    )
    recs = [{"name": "sparsifiner", "config": ON["sparsifiner"]}, {"name": "evit", "config": ON["evit"]}]
    save_model(
        tmp_path,
        m,
        make_arch(spec, input_spec={"img_size": [28, 28], "in_chans": 1, "mean": [0.5], "std": [0.5]}, methods=recs),
    )
    code = (
        "import sys, nascompress; m = nascompress.load(sys.argv[1]); "
        "engine = [n for n in ('nascompress.train.run', 'nascompress.train.finetune', 'nascompress.retraining.run', "
        "'nascompress.studies', 'nascompress.profiling.evaluate', 'optuna', 'typer') if n in sys.modules]; "
        "print(','.join(engine) or 'clean')"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "clean", out.stdout + out.stderr


def test_selection_helpers_are_consistent():
    sup = make_supernet(dense(), DCSConfig(qk_mask="static")).eval()
    assert all(len(b["mlp_keep"]) == 32 for b in selection(sup))  # gates start open


@pytest.mark.parametrize("name", sorted(ON))
def test_apply_methods_leaves_its_input_as_it_was(name):
    """apply_methods patches a copy: the same dense model takes a method twice (a second call used
    to find it already patched), and its own output and class do not change."""
    model = dense_for(name)
    x = torch.randn(2, *input_size(model))
    before, cls, keys = model(x), type(model), list(model.state_dict())
    rec = get_method(name).prepare_fresh(copy.deepcopy(model), dict(ON[name]))[1]  # a full record (arch.json's)
    first, second = apply_methods(model, [rec]).eval(), apply_methods(model, [rec]).eval()
    assert first is not model and second is not first
    assert type(model) is cls and list(model.state_dict()) == keys
    torch.testing.assert_close(model(x), before)
    shapes = {k: v.shape for k, v in first.state_dict().items()}  # the same architecture twice (new
    assert {k: v.shape for k, v in second.state_dict().items()} == shapes  # predictors start random)
    assert first(x).shape == before.shape
    built = apply_methods(dense_for(name), [rec], inplace=True)  # a model built for it: patched in place
    assert type(built) is type(first)
