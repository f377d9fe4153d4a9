"""ToMe: the dense model at r = 0, parity with an independent reference of the paper's algorithm
(tests/tome_reference.py), prefix tokens kept, sizes conserved, the matching cost in the FLOPs,
the stacking order, save/load, bad input and the CLI (zero-shot and fine-tuned)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from nascompress.errors import NascompressError
from nascompress.methods import apply_methods, get_method
from nascompress.methods.tome import bipartite_soft_matching, merge_wavg, token_counts
from nascompress.profiling.flops import count_flops
from nascompress.train.metrics import FinetuneMetrics

from .conftest import invoke, tiny_rgb_vit
from .tome_reference import merge_batch, tome_forward


def tome(model, **config):
    return get_method("tome").apply(model, {"name": "tome", "config": config})


@pytest.mark.parametrize("kw", [{}, {"init_values": 0.1, "qk_norm": True}, {"reg_tokens": 3}])
def test_r_zero_is_the_dense_model(kw):
    dense = tiny_rgb_vit(**kw)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(tome(copy.deepcopy(dense), r=0)(x), dense(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "kw,config",
    [
        ({}, {"r": 6}),
        ({}, {"r": [20, 3, 0, 5]}),  # a per-layer schedule; 20 is clipped to half the patch tokens
        ({"init_values": 0.1, "qk_norm": True}, {"r": 4, "merge_layers": [2, 3]}),
        ({"reg_tokens": 3}, {"r": 7}),  # four prefix tokens, two in each matching set
        ({"class_token": True, "reg_tokens": 1}, {"r": 9, "prop_attn": False}),
    ],
)
def test_equals_the_reference_algorithm(kw, config):
    dense = tiny_rgb_vit(**kw)
    model = tome(copy.deepcopy(dense), **config)
    st = model.tome_state
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        got = model(x)
        want = tome_forward(dense, x, list(st.r), prop_attn=config.get("prop_attn", True))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - dense(x)).abs().max() > 1e-3  # merging changed the output


def test_matching_and_merge_against_the_reference_per_image():
    g = torch.Generator().manual_seed(1)
    B, H, N, C, d, prefix = 3, 2, 21, 8, 5, 3
    x, keys = torch.randn(B, N, C, generator=g), torch.randn(B, H, N, d, generator=g)
    size = torch.randint(1, 4, (B, N, 1), generator=g).float()
    for r in (1, 5, 9, 30):
        m = bipartite_soft_matching(keys.mean(1), r, prefix=prefix)
        got, got_size = merge_wavg(x, size, m, prefix=prefix)
        want, want_size = merge_batch(x, keys, size[..., 0], r, prefix)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_size[..., 0], want_size)
        assert got.shape[1] == N - min(r, (N - prefix) // 2)


def test_prefix_tokens_are_never_merged_and_sizes_are_conserved():
    g = torch.Generator().manual_seed(2)
    x, metric = torch.randn(2, 30, 4, generator=g), torch.randn(2, 30, 6, generator=g)
    metric[:, :5] = metric[:, 5:10]  # prefix keys identical to patch keys: the most similar pairs
    for prefix in (0, 1, 2, 5):
        m = bipartite_soft_matching(metric, 100, prefix=prefix)
        assert int(m.src.min()) >= (prefix + 1) // 2 and int(m.dst.min()) >= prefix // 2
        out, size = merge_wavg(x, None, m, prefix=prefix)
        torch.testing.assert_close(out[:, :prefix], x[:, :prefix])
        assert out.shape[1] == 30 - (30 - prefix) // 2 and torch.all(size.sum(1) == 30)
        torch.testing.assert_close((out * size).sum(1), x.sum(1))  # size-weighted means conserve the sum
    assert bipartite_soft_matching(metric, 0) is None and bipartite_soft_matching(metric[:, :2], 5) is None


def test_flops_count_the_merged_tokens_and_the_matching():
    model = tome(tiny_rgb_vit(), r=8)
    x = torch.randn(2, 3, 32, 32)
    rep, dense = count_flops(model, x), count_flops(tiny_rgb_vit(), x)
    n = token_counts(65, model.tome_state.r)
    assert n == [65, 57, 49, 41]
    C, H, d = 32, 2, 16
    for i, blk in enumerate(rep.blocks):
        N = n[i]
        bias = 0 if i == 0 else N + H * N * N  # proportional attention once tokens are merged
        na, nb, out = (N + 1) // 2, N // 2, N - 8
        match = N * H * d + 2 * N * d + na * nb * d + 2 * out * N + out * N * C
        assert blk["other"] == bias + match
        assert blk["attn"] == N * C * 3 * C + 2 * H * N * N * d + N * C * C
    assert rep.total < dense.total and rep.blocks[0]["mlp"] == dense.blocks[0]["mlp"] * 57 / 65


def test_stacking_order():
    from nascompress.methods.uniform import UniformConfig  # noqa: F401  (registers uniform)

    base = get_method("uniform").prepare_fresh(tiny_rgb_vit(), {"keep": 0.5})[0]
    both = get_method("tome").prepare_fresh(base, {"r": 4})[0]
    assert both.nc_methods == ["uniform", "tome"]
    with pytest.raises(NascompressError, match="uniform cannot be applied after tome"):
        get_method("uniform").prepare_fresh(tome(tiny_rgb_vit(), r=4), {"keep": 0.5})
    with pytest.raises(NascompressError, match="evit cannot be applied after tome"):
        apply_methods(tome(tiny_rgb_vit(), r=4), [{"name": "evit", "config": {"keep_rate": 0.5}}])
    with pytest.raises(NascompressError, match="tome cannot be applied after evit"):
        apply_methods(
            tiny_rgb_vit(), [{"name": "evit", "config": {"keep_rate": 0.5}}, {"name": "tome", "config": {"r": 2}}]
        )


def test_save_and_load(tmp_path):
    from nascompress.runs.io import load, make_arch, save_model
    from nascompress.models.build import custom_vit_spec

    spec = custom_vit_spec(img_size=32, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=10)
    model, rec = get_method("tome").prepare_fresh(tiny_rgb_vit(), {"r": [3, 2], "merge_layers": [1, 3]})
    assert rec["config"] == {"r": [3, 2], "merge_layers": [1, 3], "prop_attn": True}
    save_model(
        tmp_path,
        model,
        make_arch(
            spec, input_spec={"img_size": [32, 32], "in_chans": 3, "mean": [0.5] * 3, "std": [0.5] * 3}, methods=[rec]
        ),
    )
    back = load(tmp_path)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(back(x), model(x))
    assert back.tome_state.r == (3, 0, 2, 0)


@pytest.mark.parametrize(
    "config,msg",
    [
        ({"r": -1}, r"r must be a whole number of tokens >= 0"),
        ({"r": 1.5}, r"r must be a whole number of tokens >= 0"),
        ({"r": [1, 2]}, r"r has 2 values but there are 4 merging layers"),
        ({"r": 2, "merge_layers": [5]}, r"merge_layers \[5\] outside the model's depth: valid layers are 1..4"),
        ({"bogus": 1}, r"unknown tome setting\(s\) bogus"),
    ],
)
def test_bad_config(config, msg):
    with pytest.raises(NascompressError, match=msg):
        tome(tiny_rgb_vit(), **config)


def test_needs_a_class_token_model():
    with pytest.raises(NascompressError, match="tome needs a model whose head reads the class token"):
        tome(tiny_rgb_vit(global_pool="avg"), r=2)


def test_cli_finetune_zero_shot_and_train(tmp_path, tiny_run):
    zs = tmp_path / "zs"
    r = invoke("finetune", tiny_run, "--method", "tome", "--r", "4", "--zero-shot", "--out", zs, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["zero_shot"] is True
    arch = json.loads((zs / "arch.json").read_text())
    assert arch["methods"][-1] == {
        "name": "tome",
        "config": {"r": 4, "merge_layers": [1, 2], "prop_attn": True},
        "recipe": {"distill": 0.0},
    }
    ft = tmp_path / "ft"
    r = invoke(
        "finetune",
        tiny_run,
        "--method",
        "tome",
        "--r",
        "4,2",
        "--epochs",
        "1",
        "--opt",
        "distill=0.5",
        "--out",
        ft,
        "--json",
    )
    assert r.exit_code == 0, r.output
    log = [json.loads(ln) for ln in (ft / "log.jsonl").read_text().splitlines()]
    assert log[0]["start"] and "train_kl" in log[1]
    r = invoke("evaluate", ft, "--json")
    assert r.exit_code == 0, r.output
    r = invoke("finetune", tiny_run, "--method", "tome", "--r", "-3", "--out", tmp_path / "bad")
    assert r.exit_code == 1 and "r must be a whole number of tokens >= 0" in r.output
    assert not (tmp_path / "bad").exists()


def test_the_shipped_spaces_apply_their_methods_in_an_allowed_order():
    """Every configuration of the shipped spaces that offer ToMe is a stack the registry allows
    (joint.yaml listed Sparsifiner after the token methods, which Sparsifiner refuses)."""
    from types import SimpleNamespace

    import optuna

    from nascompress.studies.space_model import load_space

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for name in ("joint", "tome"):  # the shipped spaces, for the default 6-block ViT (only its blocks are read)
        space = load_space(name, model=SimpleNamespace(blocks=[None] * 6))
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        seen = set()
        for _ in range(40):
            trial = study.ask()
            names = [r["name"] for r in space.suggest(trial)]
            study.tell(trial, 0.0)
            seen.add(tuple(names))
            for i, n in enumerate(names):
                assert set(names[:i]) <= get_method(n).stacks_on, names
        assert any("tome" in s for s in seen)


def test_cli_finetune_reports_flops(tmp_path, tiny_run):
    """--zero-shot (and a fine-tune) report the model's FLOPs against the dense model's, on stdout and
    in metrics.json."""
    zs = tmp_path / "zs"
    r = invoke("finetune", tiny_run, "--method", "tome", "--r", "4", "--zero-shot", "--out", zs, "--json")
    assert r.exit_code == 0, r.output
    m = FinetuneMetrics.from_dict(json.loads(r.stdout), source="finetune --json")
    assert 0 < m.flops < m.dense_flops and m.flops_ratio == pytest.approx(m.flops / m.dense_flops)
    written = FinetuneMetrics.from_dict(json.loads((zs / "metrics.json").read_text()), source="metrics.json")
    assert m.flops_images > 0 and written.flops == m.flops
    assert list(m.to_dict())[-5:] == ["method", "flops", "dense_flops", "flops_ratio", "flops_images"]
    r = invoke("finetune", tiny_run, "--method", "tome", "--r", "4", "--zero-shot", "--out", tmp_path / "zs2")
    assert r.exit_code == 0, r.output
    assert f"{m.flops_ratio:.3f}x the dense FLOPs (mean of {m.flops_images} test images)" in r.stdout
