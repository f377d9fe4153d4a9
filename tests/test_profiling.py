"""FLOPs as the papers count them (attention matmuls included), checked against the papers' figures."""

from __future__ import annotations

import pytest
import torch

from nascompress.models.build import ModelSpec, build_model, custom_vit_spec
from nascompress.profiling import count_flops, flop_counter_macs, time_models, time_models_by_threads
from nascompress.profiling.flops import thop_macs


@pytest.mark.parametrize("name,gflops", [("deit_small_patch16_224", 4.6), ("deit_tiny_patch16_224", 1.25)])
def test_deit_flops_match_papers(name, gflops):
    model = build_model(ModelSpec(name))
    rep = count_flops(model, torch.randn(1, 3, 224, 224))
    assert rep.gflops == pytest.approx(gflops, rel=0.02)
    # per block: attention = qkv + proj + 2*N^2*C, MLP = 8*N*C^2 (N=197)
    C, N = model.embed_dim, 197
    assert rep.blocks[0]["attn"] == pytest.approx(4 * N * C * C + 2 * N * N * C)
    assert rep.blocks[0]["mlp"] == pytest.approx(8 * N * C * C)


def test_analytic_count_equals_flop_counter_mode():
    model = build_model(
        custom_vit_spec(img_size=32, patch_size=4, embed_dim=48, depth=3, num_heads=3, num_classes=10, in_chans=3)
    )
    x = torch.randn(2, 3, 32, 32)
    assert count_flops(model, x).total == pytest.approx(flop_counter_macs(model, x), rel=1e-9)


def test_flops_follow_real_token_count():
    """Tokens dropped in a forward are not counted: the counter reads real input shapes."""
    model = build_model(
        custom_vit_spec(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10, in_chans=1)
    )
    full = count_flops(model, torch.randn(1, 1, 32, 32))
    orig = model.blocks[1].forward
    model.blocks[1].forward = lambda x, **kw: orig(x[:, :33])  # keep CLS + 32 of 64 patches
    half = count_flops(model, torch.randn(1, 1, 32, 32))
    C = 32
    assert half.blocks[1]["mlp"] == pytest.approx(8 * 33 * C * C)
    assert half.blocks[1]["attn"] == pytest.approx(4 * 33 * C * C + 2 * 33 * 33 * C)
    assert half.blocks[0] == full.blocks[0]


def test_time_models_interleaved_medians():
    calls = []

    def a(x):
        calls.append("a")

    def b(x):
        calls.append("b")

    t = time_models([a, b], torch.zeros(1), warmup=1, iters=4)
    assert len(t) == 2 and all(v >= 0 for v in t)
    assert calls[2:] == ["a", "b", "b", "a", "a", "b", "b", "a"]  # rotating order


def test_time_models_by_threads_runs_each_count_at_its_threads_and_restores_torch():
    before = torch.get_num_threads()
    seen: dict[int, set[int]] = {1: set(), 2: set()}

    def at(n):
        return [lambda x: seen[n].add(torch.get_num_threads())]

    out = time_models_by_threads({1: at(1), 2: at(2)}, torch.zeros(1), warmup=1, iters=3)
    assert set(out) == {1, 2} and all(len(v) == 1 and v[0] >= 0 for v in out.values())
    assert seen == {1: {1}, 2: {2}}  # each pass's models ran with torch at that count
    assert torch.get_num_threads() == before


def test_thop_misses_exactly_the_attention_matmuls():
    model = build_model(ModelSpec("deit_tiny_patch16_224"))
    x = torch.randn(1, 3, 224, 224)
    ours = count_flops(model, x).total
    matmuls = 12 * 2 * 197 * 197 * 192
    assert thop_macs(model, x) == pytest.approx(ours - matmuls, rel=1e-3)
    assert ours / 1e9 == pytest.approx(1.254, abs=0.001)


def _run(path, depth: int):
    from nascompress.runs.io import make_arch, save_model
    from nascompress.train.run import input_spec_for

    spec = custom_vit_spec(
        img_size=16, patch_size=4, embed_dim=32, depth=depth, num_heads=2, num_classes=10, in_chans=1
    )
    model = build_model(spec)
    save_model(path, model, make_arch(spec, input_spec=input_spec_for(model, "synthetic").to_dict()))
    return path


def test_profile_compare_names_both_models_in_the_one_ratio_convention(tmp_path):
    """``profile SMALL --compare BIG``: SMALL against the reference BIG, "x the FLOPs" (< 1: smaller)
    and "x faster" (> 1: faster), both named, with what the figures were measured on."""
    import json

    from nascompress.profiling.records import Profile

    from .conftest import invoke

    small, big = _run(tmp_path / "small", 1), _run(tmp_path / "big", 2)
    r = invoke("profile", small, "--compare", big, "--iters", 2, "--batch-size", 4, "--json")
    assert r.exit_code == 0, r.output
    written = json.loads(r.stdout)
    assert list(written["comparison"]) == [
        *("model", "reference", "flops_ratio", "params_ratio", "latency_speedup", "throughput_speedup"),
        *("flops_images", "latency_batch", "throughput_batch"),
    ]  # the --json keys, in their order
    c = Profile.from_dict(written, source="profile --json").comparison
    assert c.model == str(small) and c.reference == str(big)
    assert 0.4 < c.flops_ratio < 0.6 and c.params_ratio < 1  # one block of two (plus the stem)
    assert c.latency_speedup > 0 and c.throughput_speedup > 0
    assert c.flops_images == 4 and c.latency_batch == 1 and c.throughput_batch == 4
    r = invoke("profile", small, "--compare", big, "--iters", 2, "--batch-size", 4)
    assert r.exit_code == 0, r.output
    text = r.stdout
    assert f"{small} against the reference {big}:" in text and f"{big} (reference)" in text
    assert f"{c.flops_ratio:.3f}x the FLOPs (per image, mean of 4 random images)" in text
    assert "x faster" in text and "(batch 1)" in text and "(batch 4)" in text
    assert "reduction" not in text and "vs reference" not in text


def test_speed_and_size_texts():
    from nascompress.profiling.compare import compare_records, speed_text, times_text
    from nascompress.profiling.records import ModelProfile

    c = compare_records(
        ModelProfile.new(macs=1.0, params=2.0, latency_ms=1.0, throughput=300.0),
        ModelProfile.new(macs=2.0, params=4.0, latency_ms=2.0, throughput=100.0),
    )
    assert (c.flops_ratio, c.params_ratio, c.latency_speedup, c.throughput_speedup) == (0.5, 0.5, 2.0, 3.0)
    assert c.latency_speedup_compiled is None and c.throughput_speedup_compiled is None  # not timed compiled
    assert c.to_dict() == {"flops_ratio": 0.5, "params_ratio": 0.5, "latency_speedup": 2.0, "throughput_speedup": 3.0}
    untimed = compare_records(ModelProfile.new(macs=1.0, params=2), ModelProfile.new(macs=4.0, params=4))
    assert untimed.to_dict() == {"flops_ratio": 0.25, "params_ratio": 0.5}  # no speed-up keys when not timed
    assert times_text(0.5, "FLOPs") == "0.500x the FLOPs"
    assert speed_text(2.0) == "2.00x faster" and speed_text(0.5) == "0.50x faster (slower)"
