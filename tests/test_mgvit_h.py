"""Hierarchical MG-ViT (mgvit-h) on PVT v2: equivalence with the dense pyramid (splitting off, and -A
at init), the ranking score, the sub-token embedding and the proxy-only MG layer against their
references, dense feature shapes, honest FLOPs, batched early exit, -A/-R from a trained run
(fine-tune, save, reload), the search space and the one-line refusals."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import nascompress
from nascompress.errors import NascompressError
from nascompress.runs.io import make_arch, save_model
from nascompress.methods import get_method
from nascompress.methods.mgvit_h_modules import MGLayer, MGPVT, RankingAttention
from nascompress.methods.mgvit_ops import resample_image
from nascompress.models.build import ModelSpec, build_model
from nascompress.profiling.flops import count_flops, flop_counter_macs

from .conftest import TINY_EVIT_SPACE, invoke

SPEC = ModelSpec("pvt_v2_b0", dict(img_size=64, num_classes=10, in_chans=1))
INPUT = {"img_size": [64, 64], "in_chans": 1, "mean": [0.5], "std": [0.5]}


def dense(**kw):
    torch.manual_seed(0)
    return build_model(ModelSpec(SPEC.name, dict(SPEC.kwargs, **kw))).eval()


def mgvit_h(model=None, **config):
    m, _ = get_method("mgvit-h").prepare_fresh(copy.deepcopy(model if model is not None else dense()), config)
    return m.eval()


def perturb(m):
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.startswith("mg_"):
                p.add_(0.05 * torch.randn_like(p))
    return m


def test_no_splitting_equals_the_dense_pyramid():
    d, x = dense(), torch.randn(3, 1, 64, 64)
    m = perturb(mgvit_h(d, r_h=0.0, r_t=1.0))  # the MG layer's weights do not matter: no cell is split
    with torch.no_grad():
        torch.testing.assert_close(m(x), d(x))
        torch.testing.assert_close(m.forward_features(x), d.forward_features(x))
        for a, b in zip(m.forward_intermediates(x)[1], d.forward_intermediates(x)[1]):
            torch.testing.assert_close(a, b)
    r = mgvit_h(d, variant="r", r_h=0.0, r_t=1.0)  # -R without splitting: the dense model less stage 1's last layer
    short = copy.deepcopy(d)
    del short.stages[0].blocks[len(short.stages[0].blocks) - 1]
    with torch.no_grad():
        torch.testing.assert_close(r(x), short(x))


def test_variant_a_starts_as_the_dense_model():
    """The MG layer's output projections start at zero: the proxies return the tokens (Eq. 17 with T'_pro = T_ori)."""
    d, x = dense(), torch.randn(2, 1, 64, 64)
    m = mgvit_h(d, r_h=0.25, r_t=0.25)
    assert m.mg["grid"] == 2 and m.mg["cell_tokens"] == 8
    with torch.no_grad():
        torch.testing.assert_close(m(x), d(x))
        assert (perturb(m)(x) - d(x)).abs().max() > 1e-4  # ... and the split cells do change it once trained


def test_dense_feature_shapes_and_timm_conventions():
    d, x = dense(), torch.randn(2, 1, 64, 64)
    for v in ("a", "r"):
        m = mgvit_h(d, variant=v, r_h=0.25, r_t=0.25)
        with torch.no_grad():
            want = [f.shape for f in d.forward_intermediates(x, intermediates_only=True)]
            assert [f.shape for f in m.forward_intermediates(x, intermediates_only=True)] == want
            assert [f.shape for f in m.forward_intermediates(x, indices=[0, 2], intermediates_only=True)] == [
                want[0],
                want[2],
            ]
            last, inter = m.forward_intermediates(x, indices=2)
            assert last.shape == want[-1] and [f.shape for f in inter] == want[2:]
            assert m.forward_features(x).shape == d.forward_features(x).shape == (2, 256, 2, 2)


def test_ranking_is_the_mean_attention_received():
    d = dense()
    attn = copy.deepcopy(d.stages[0].blocks[0].attn)
    x = torch.randn(2, 256, 32)
    with torch.no_grad():
        ref = attn(x, (16, 16))  # timm's fused attention
        attn.__class__ = RankingAttention
        torch.testing.assert_close(attn(x, (16, 16)), ref)
        q = attn.q(x).reshape(2, 256, 1, 32).permute(0, 2, 1, 3)
        r = attn.norm(attn.sr(x.transpose(1, 2).reshape(2, 32, 16, 16)).flatten(2).transpose(1, 2))
        k = attn.kv(r)[..., :32].reshape(2, 4, 1, 32).permute(0, 2, 1, 3)
        a = (q @ k.transpose(-2, -1) / math.sqrt(32)).softmax(-1)
        torch.testing.assert_close(attn.received, a.mean((1, 2)))  # key cell j: mean_i A_ij, 2x2 cells of 32 px
    assert attn.received.shape == (2, 4)


def test_sub_tokens_are_the_stem_on_the_resampled_image():
    m, x = mgvit_h(), torch.randn(2, 1, 64, 64)
    idx = torch.tensor([[3, 0], [1, 2]])
    for s in (2, 3):
        with torch.no_grad():
            got = m._sub_tokens(x, idx, s, 2, 8).reshape(2, 2, 8, 8, s, s, 32)
            full = m.patch_embed(resample_image(x, 64 * s))  # (B, 16 s, 16 s, C)
        for b in range(2):
            for j in range(2):
                r, c = divmod(idx[b, j].item(), 2)
                cell = full[b, r * 8 * s : (r + 1) * 8 * s, c * 8 * s : (c + 1) * 8 * s]
                want = cell.reshape(8, s, 8, s, 32).permute(0, 2, 1, 3, 4)
                torch.testing.assert_close(got[b, j], want, atol=1e-5, rtol=1e-5)


def test_proxy_only_layer_equals_the_full_group_layer():
    """Eq. 16 over [fine tokens, proxy] with every query, then the proxy's row: what MGLayer computes."""
    torch.manual_seed(0)
    layer = MGLayer(32, 8, 8.0, qkv_bias=True, eps=1e-6).eval()
    proxy, fine = torch.randn(5, 1, 32), torch.randn(5, 9, 32)
    with torch.no_grad():
        t = torch.cat([fine, proxy], 1)
        h = layer.norm1(t)
        q = layer.q(h).reshape(5, 10, 8, 4).transpose(1, 2)
        k, v = layer.kv(h).reshape(5, 10, 2, 8, 4).permute(2, 0, 3, 1, 4)
        a = ((q @ k.transpose(-2, -1)) / 2.0).softmax(-1) @ v
        t = t + layer.proj(a.transpose(1, 2).reshape(5, 10, 32))
        t = t + layer.mlp(layer.norm2(t))
        torch.testing.assert_close(layer(proxy, fine), t[:, -1:], atol=1e-5, rtol=1e-5)


def test_flops_are_counted_honestly():
    d, x = dense(), torch.randn(1, 1, 64, 64)
    dense_f = count_flops(d, x).total
    assert dense_f == pytest.approx(flop_counter_macs(d, x))  # PVT's reduced-key attention counted
    for v in ("a", "r"):
        m = mgvit_h(d, variant=v, r_h=0.25, r_t=0.25)
        st = m.stage_flops()
        for mode in ("sgis", "mgis"):  # the sub-token convs, the MG layer's one-query attention, the ranking
            m._mg_force = mode
            assert st[f"{mode}_flops"] == pytest.approx(flop_counter_macs(m, x))
            m._mg_force = None
        assert st["sgis_flops"] < dense_f / 3  # the half-size image
        assert m.mean_flops(0.0, 1.0) == st["mgis_flops"]  # epsilon 1: no SGIS pass
        assert m.mean_flops(0.5, 0.9) == pytest.approx(st["sgis_flops"] + 0.5 * st["mgis_flops"])
    a, r = (mgvit_h(d, variant=v, r_h=0.25, r_t=0.25).stage_flops()["mgis_flops"] for v in "ar")
    assert r < a and a > dense_f  # -R replaces a layer, -A adds one
    off = mgvit_h(d, r_h=0.0, r_t=1.0).stage_flops()["mgis_flops"]
    assert off == pytest.approx(dense_f)


def test_early_exit_batched_equals_per_image():
    m = perturb(mgvit_h(r_h=0.25, r_t=0.25))
    x = torch.randn(6, 1, 64, 64)
    with torch.no_grad():
        s = m._sgis(x)
        conf = s.softmax(-1).amax(-1)
        m.mg = dict(m.mg, epsilon=float(conf.median()))
        m.reset_inference_stats()
        got = m(x)
        for i in range(6):
            ref = s[i : i + 1] if conf[i] > m.mg["epsilon"] else m.forward_head(m.forward_features(x[i : i + 1]))
            torch.testing.assert_close(got[i : i + 1], ref, atol=1e-5, rtol=1e-5)
    st = m.inference_stats()
    assert st["exit_share"] == pytest.approx((conf > m.mg["epsilon"]).float().mean().item())


@pytest.fixture(scope="module")
def pvt_run(tmp_path_factory):
    """A tiny dense pvt_v2_b0 run (64 px, synthetic data, one short epoch)."""
    from nascompress.data import DataConfig
    from nascompress.train.config import TrainConfig
    from nascompress.train.run import TrainJob, train

    out = tmp_path_factory.mktemp("runs") / "pvt"
    train(
        TrainJob(
            model=SPEC,
            data=DataConfig(dataset="synthetic", train_limit=64, eval_limit=32),
            train=TrainConfig(epochs=1, batch_size=32, lr=1e-3, seed=0),
            out=str(out),
        )
    )
    return out


@pytest.mark.parametrize("variant", ["a", "r"])
def test_builds_from_a_trained_run_trains_saves_and_reloads(pvt_run, tmp_path, variant):
    from nascompress.data import DataConfig
    from nascompress.train.finetune import FinetuneJob, finetune, finetune_train_config

    out = tmp_path / variant
    m = finetune(
        FinetuneJob(
            run_dir=str(pvt_run),
            method="mgvit-h",
            out=str(out),
            config={"variant": variant, "r_h": 0.25, "r_t": 0.25},
            data=DataConfig(dataset="synthetic", train_limit=32, eval_limit=32),
            train=finetune_train_config("mgvit-h", epochs=1, batch_size=16, seed=0, keep="last"),
        )
    )
    assert m.method == "mgvit-h"
    loaded = nascompress.load(out)
    base = nascompress.load(pvt_run)
    assert isinstance(loaded, MGPVT) and loaded.mg["variant"] == variant
    assert len(loaded.stages[0].blocks) == len(base.stages[0].blocks) - (variant == "r")
    x = torch.randn(2, 1, 64, 64)
    with torch.no_grad():
        got = loaded.forward_intermediates(x, intermediates_only=True)
        assert [f.shape for f in got] == [f.shape for f in base.forward_intermediates(x, intermediates_only=True)]
        again = nascompress.load(out)
        torch.testing.assert_close(again(x), loaded(x))
    trained = any((loaded.state_dict()[k] != v).any() for k, v in base.state_dict().items() if k in loaded.state_dict())
    assert trained  # the fine-tune moved the weights (keep="last": the trained epoch, not the start)


def test_save_load_keeps_early_exit_config(tmp_path):
    m = perturb(mgvit_h(variant="r", epsilon=0.6, r_h=0.25, r_t=0.25))
    save_model(
        tmp_path / "m",
        m,
        make_arch(
            SPEC,
            input_spec=INPUT,
            methods=[
                {
                    "name": "mgvit-h",
                    "config": {
                        k: m.mg[k]
                        for k in (
                            "variant",
                            "r_h",
                            "r_t",
                            "epsilon",
                            "mg_heads",
                            "mg_mlp_ratio",
                            "sgis_scale",
                            "lam",
                            "casr_start",
                        )
                    },
                }
            ],
        ),
    )
    loaded = nascompress.load(tmp_path / "m")
    x = torch.randn(4, 1, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), m(x))
    assert loaded.mg == m.mg


def test_search_space_loads_with_the_registry():
    from pathlib import Path

    from nascompress.studies.space_model import load_space
    from nascompress.studies.space_reference import reference_configs

    space = load_space(Path(__file__).resolve().parents[1] / "nascompress" / "search_spaces" / "mgvit-h.yaml")
    configs = [space.records(p)[0]["config"] for p in space.grid(8)]
    assert {c["r_pos"] for c in configs} > {1.0} and any("r_neg" in c for c in configs)
    for c in configs:  # every configuration it proposes builds (r_pos + r_neg <= 1: r_neg only below r_pos 1)
        get_method("mgvit-h").prepare_fresh(dense(), c)
    d = dense()
    paper = [p for label, p in reference_configs(space, d) if label == "paper"]
    assert paper and paper[0]["mgvit-h.r_pos"] == 1.0  # the paper's Hierarchical MG-ViT (no PPSM) runs first
    assert load_space("mgvit-h", model=d).name == "mgvit-h"  # by name, for the pyramid model
    with pytest.raises(NascompressError, match="counts from the model's last block: the base model is a pyramid ViT"):
        load_space("evit", model=d)  # the default space's layer range has no depth to count from here


def test_a_study_over_the_space_on_a_pyramid_run(pvt_run, tmp_path, monkeypatch):
    """search tokens over search_spaces/mgvit-h.yaml from a pyramid base (it asked the base for a plain
    ViT's block list before: AttributeError); a space with layer numbers is refused on a pyramid in one line."""
    import optuna
    from pathlib import Path

    from nascompress.studies.inspect import load

    monkeypatch.chdir(tmp_path)
    space = Path(__file__).resolve().parents[1] / "nascompress" / "search_spaces" / "mgvit-h.yaml"
    small = ["--eval-images", 16, "--train-images", 16, "--batch-size", 16]
    r = invoke("search", "tokens", pvt_run, "--study", "h", "--space", space, "--trials", 3, *small)
    assert r.exit_code == 0, r.output
    done = [t for t in load("h")[1].trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 3
    for t in done:
        rec = t.user_attrs["nascompress"]
        assert rec["arch"][0]["name"] == "mgvit-h" and rec["flops_ratio"] > 0
        assert {"mgvit-h.variant", "mgvit-h.r_h", "mgvit-h.r_t", "mgvit-h.r_pos", "mgvit-h.epsilon"} <= set(t.params)
    assert done[0].params["mgvit-h.r_pos"] == 1.0  # the paper's configuration first
    (tmp_path / "evit.yaml").write_text(TINY_EVIT_SPACE)
    r = invoke("search", "tokens", pvt_run, "--study", "e", "--space", "evit.yaml", "--trials", 1, *small)
    assert r.exit_code == 1 and "layer numbers address a plain ViT's blocks" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


# 64 px: a 2 x 2 grid of cells; r_h 0.25, r_t 0: 1 head and 3 middle cells, all split. r_pos 0.25,
# r_neg 0.25 of the 4 split cells (PPSM's Eq. 21): 1 positive (the head), 1 boundary, 2 negative.
SLIM = {"r_h": 0.25, "r_t": 0.0, "r_pos": 0.25, "r_neg": 0.25}


def match_merge_reference(f):
    """PPSM's boundary rule on one group per row, written out: row-major tokens alternate into A and
    B; each A token joins its most cosine-similar B token; each B token becomes their mean."""
    out = []
    for g in f:
        a, b = g[0::2], g[1::2]
        members = [[bj] for bj in b]
        for ai in a:
            j = int(torch.stack([F.cosine_similarity(ai, bj, dim=0) for bj in b]).argmax())
            members[j].append(ai)
        out.append(torch.stack([torch.stack(m).mean(0) for m in members]))
    return torch.stack(out)


def test_ppsm_in_the_proxy_groups_domains_and_rules():
    from nascompress.methods.mgvit_h_modules import group_domains, slimmed_tokens

    mg = dict(r_pos=0.25, r_neg=0.25)
    assert group_domains(0, 1, 4, mg) == [(0, 1, "positive")]  # the head cell
    assert group_domains(1, 3, 4, mg) == [(0, 1, "boundary"), (1, 3, "negative")]  # the middle cells
    assert group_domains(0, 3, 4, {}) == [(0, 3, "positive")]  # r_pos 1 (the default): off
    assert [slimmed_tokens(k, d) for k in (9, 4) for d in ("positive", "boundary", "negative")] == [9, 4, 1, 4, 2, 1]
    m = mgvit_h(**SLIM)
    torch.manual_seed(1)
    f9, f4 = torch.randn(5, 9, 32), torch.randn(5, 4, 32)
    with torch.no_grad():
        for f in (f9, f4):
            torch.testing.assert_close(m._slim(f, "positive"), f)
            torch.testing.assert_close(m._slim(f, "negative"), f.mean(1, keepdim=True))
            torch.testing.assert_close(m._slim(f, "boundary"), match_merge_reference(f))


def test_ppsm_in_the_proxy_groups_keeps_the_grid_and_counts_its_flops():
    d, x = dense(), torch.randn(2, 1, 64, 64)
    plain = perturb(mgvit_h(d, r_h=0.25, r_t=0.0))
    slim = mgvit_h(d, **SLIM)
    slim.load_state_dict(plain.state_dict())  # the same weights: only the groups' finer tokens differ
    with torch.no_grad():
        want = [f.shape for f in d.forward_intermediates(x, intermediates_only=True)]
        assert [f.shape for f in slim.forward_intermediates(x, intermediates_only=True)] == want
        assert (slim(x) - plain(x)).abs().max() > 1e-5
    # honest FLOPs: the MG layer over fewer keys/values, the boundary groups' similarity matmul (torch's
    # counter sees it) and the merges' weighted sums (it does not): 4 tokens x 32 channels per merged group
    r2 = 64  # stage-1 tokens per 32 px cell (8 x 8): one proxy group each
    merges = 3 * r2 * 4 * 32  # one boundary and two negative middle cells
    st, st_plain = slim.stage_flops(), plain.stage_flops()
    slim._mg_force = "mgis"
    assert st["mgis_flops"] == pytest.approx(flop_counter_macs(slim, x[:1]) + merges)
    slim._mg_force = None
    assert st["mgis_flops"] < st_plain["mgis_flops"] and st["sgis_flops"] == st_plain["sgis_flops"]
    # arch.json records the domains and the tokens the MG layer sees: (9 + 1) + (2 + 1) + 2 x (1 + 1) per proxy
    _, rec = get_method("mgvit-h").prepare_fresh(copy.deepcopy(d), SLIM)
    assert rec["config"]["r_pos"] == 0.25 and rec["ppsm_cells"] == [1, 1, 2]
    assert rec["mg_group_tokens"] == r2 * (10 + 3 + 2 * 2)
    _, rec_off = get_method("mgvit-h").prepare_fresh(copy.deepcopy(d), {"r_h": 0.25, "r_t": 0.0})
    assert rec_off["ppsm_cells"] == [4, 0, 0] and rec_off["mg_group_tokens"] == r2 * (10 + 3 * 5)
    # with no cell split there is nothing to slim: still the dense pyramid
    off = perturb(mgvit_h(d, r_h=0.0, r_t=1.0, r_pos=0.5, r_neg=0.5))
    with torch.no_grad():
        torch.testing.assert_close(off(x), d(x))


def test_ppsm_settings_survive_save_and_load(tmp_path):
    m = perturb(mgvit_h(**SLIM))
    cfg = {
        k: m.mg[k]
        for k in (
            "variant",
            "r_h",
            "r_t",
            "r_pos",
            "r_neg",
            "epsilon",
            "mg_heads",
            "mg_mlp_ratio",
            "sgis_scale",
            "lam",
            "casr_start",
        )
    }
    save_model(tmp_path / "m", m, make_arch(SPEC, input_spec=INPUT, methods=[{"name": "mgvit-h", "config": cfg}]))
    loaded = nascompress.load(tmp_path / "m")
    x = torch.randn(2, 1, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), m(x))
    assert loaded.mg["r_pos"] == 0.25 and loaded.mg["r_neg"] == 0.25


@pytest.mark.parametrize(
    "config, match",
    [
        ({"variant": "x"}, "variant"),
        ({"r_h": 0.6, "r_t": 0.5}, "r_h \\+ r_t .*1.1"),
        ({"epsilon": 0.0}, "epsilon must be in \\(0, 1\\]"),
        ({"mg_heads": 3}, "mg_heads 3 does not divide stage 1's width 32"),
        ({"r_pos": 0.7, "r_neg": 0.4}, "r_pos \\+ r_neg .*1.1"),
        ({"r_neg": -0.1}, "r_neg"),
    ],
)
def test_bad_settings(config, match):
    from nascompress.train.finetune import split_settings

    with pytest.raises(NascompressError, match=match):
        cfg, _ = split_settings("mgvit-h", config)
        get_method("mgvit-h").prepare_fresh(dense(), cfg)


def test_refusals_in_one_line():
    vit = build_model(
        ModelSpec(
            "vit_tiny_patch16_224",
            dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10, in_chans=1),
        )
    )
    with pytest.raises(NascompressError, match="mgvit-h needs a pyramid ViT .*VisionTransformer; use method mgvit"):
        get_method("mgvit-h").prepare_fresh(vit, {})
    with pytest.raises(NascompressError, match="mgvit needs a plain timm ViT.*pyramid.*use method mgvit-h"):
        get_method("mgvit").prepare_fresh(dense(), {})
    with pytest.raises(NascompressError, match="image size 48x48 cannot be split into mgvit-h's coarse grid of 32 px"):
        get_method("mgvit-h").prepare_fresh(dense(img_size=48), {})
    with pytest.raises(NascompressError, match="pvt_v2_b2_li is not supported"):
        build_model(ModelSpec("pvt_v2_b2_li", {}))
    with pytest.raises(NascompressError, match="a pyramid ViT takes only img_size, num_classes and in_chans"):
        build_model(ModelSpec("pvt_v2_b0", {"embed_dim": 32}))


def test_cli_refuses_a_pyramid_run_for_mgvit_in_one_line(pvt_run, tmp_path):
    r = invoke("finetune", pvt_run, "--method", "mgvit", "--out", tmp_path / "x", "--epochs", "1")
    assert r.exit_code == 1
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "use --method mgvit-h" in lines[0], r.output
    assert not (tmp_path / "x").exists()


def test_evaluate_and_profile_cli(tmp_path):
    m = perturb(mgvit_h(epsilon=0.5, r_h=0.25, r_t=0.25))
    rec = {"name": "mgvit-h", "config": {k: m.mg[k] for k in ("variant", "r_h", "r_t", "epsilon")}}
    save_model(tmp_path / "m", m, make_arch(SPEC, input_spec=INPUT, methods=[rec]))
    r = invoke("evaluate", tmp_path / "m", "--dataset", "synthetic", "--eval-limit", "32")
    assert r.exit_code == 0 and "SGIS exit" in r.output, r.output
    r = invoke("evaluate", tmp_path / "m", "--dataset", "synthetic", "--eval-limit", "32", "--epsilon", "0.5,1")
    assert r.exit_code == 0 and "epsilon 0.5" in r.output and "epsilon 1 " in r.output, r.output
    st = m.stage_flops()
    assert f"{st['mgis_flops'] / 1e6:.2f} MFLOPs" in r.output.splitlines()[-1]  # epsilon 1: the MG pass alone
    r = invoke("profile", tmp_path / "m", "--no-latency")
    assert r.exit_code == 0 and "MG-ViT stages per image: SGIS" in r.output and "PPSM" not in r.output, r.output


def test_export_two_graphs_and_exit_rule(tmp_path):
    """Like mgvit: the SGIS and the MG pass as two graphs, the exit rule in the sidecar; each file checked
    against PyTorch, and the rule applied to the two files gives the model's logits (torch.export here:
    the ONNX path is the same two graphs through the other writer, and costs twice the time)."""
    from nascompress.deploy import ExportConfig, export_run, stage_path
    from nascompress.deploy.verify import program_runner, with_exit_rule

    # with PPSM in the proxy groups (3 split cells: one positive, one boundary, one negative)
    m = perturb(mgvit_h(variant="r", r_h=0.25, r_t=0.25, r_pos=0.5, r_neg=0.25))
    x = torch.randn(8, 1, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        conf = m._sgis(x).softmax(-1).amax(-1)
    eps = float(conf.median())
    rec = {
        "name": "mgvit-h",
        "config": {"variant": "r", "r_h": 0.25, "r_t": 0.25, "r_pos": 0.5, "r_neg": 0.25, "epsilon": eps},
    }
    save_model(tmp_path / "m", m, make_arch(SPEC, input_spec=INPUT, methods=[rec]))
    with pytest.raises(NascompressError, match="export it with batch dynamic"):
        export_run(tmp_path / "m", out=tmp_path / "fixed.pt2", config=ExportConfig(format="torch-export", batch=4))
    side = export_run(tmp_path / "m", out=tmp_path / "mg.pt2", config=ExportConfig(format="torch-export"))
    assert side.verification["passed"] and side.verification["stages"]["passed"]
    assert [f["stage"] for f in side.files] == ["sgis", "mgis"] and side.get("exit_rule")["epsilon"] == eps
    assert side.get("flops")["stages"] == nascompress.load(tmp_path / "m").stage_flops()
    both = with_exit_rule(
        program_runner(tmp_path / "mg.pt2")[0], program_runner(stage_path(tmp_path / "mg.pt2", "mgis"))[0], eps
    )
    with torch.no_grad():
        want = nascompress.load(tmp_path / "m")(x)
    assert 0 < int((conf > eps).sum()) < len(x)  # both branches of the rule run
    torch.testing.assert_close(both([x])[0], want, rtol=0, atol=1e-4)


def test_resample_image_in_reduced_precision():
    """The SGIS's antialiased shrink has no fp16 / bf16 CPU kernel in PyTorch (an fp16 export's check
    failed on it): a reduced-precision image is shrunk in fp32 and cast back."""
    x = torch.randn(2, 1, 64, 64, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float16, torch.bfloat16):
        got = resample_image(x.to(dtype), 32)
        assert got.dtype == dtype and got.shape == (2, 1, 32, 32)
        torch.testing.assert_close(got, resample_image(x.to(dtype).float(), 32).to(dtype), rtol=0, atol=0)
        assert resample_image(x.to(dtype), 96).dtype == dtype  # enlarging: PyTorch's own kernel


def test_export_onnx_fp16_with_ppsm_in_the_proxy_groups(tmp_path):
    """ONNX in fp16 with PPSM in the proxy groups: the boundary merge's scatter_add (no fp16 kernel in ONNX
    Runtime's CPU provider) is exported as a one-hot matmul, the SGIS's shrink runs in fp32; both graphs
    match PyTorch in fp16. Stage 1's queries are scaled so that the cells' ranking scores are apart (a
    random model's are tied to fp16's resolution, and two runtimes may order tied cells differently)."""
    import onnx

    from nascompress.deploy import ExportConfig, export_run, stage_path

    d = dense()
    with torch.no_grad():
        for blk in d.stages[0].blocks:
            blk.attn.q.weight.mul_(16)
    config = {"variant": "r", "r_h": 0.25, "r_t": 0.25, "r_pos": 0.5, "r_neg": 0.25}
    m = perturb(mgvit_h(d, **config))
    save_model(
        tmp_path / "m",
        m,
        make_arch(SPEC, input_spec=INPUT, methods=[{"name": "mgvit-h", "config": {**config, "epsilon": 0.15}}]),
    )
    side = export_run(tmp_path / "m", out=tmp_path / "h.onnx", config=ExportConfig(dtype="fp16"))
    v = side.verification
    assert v["passed"] and v["stages"]["passed"] and v["top1_agreement"] == 1.0, v
    assert [f["stage"] for f in side.files] == ["sgis", "mgis"] and side.dtype == "fp16"
    nodes = onnx.load(str(stage_path(tmp_path / "h.onnx", "mgis"))).graph.node
    assert not [
        n
        for n in nodes
        if n.op_type.startswith("Scatter") and any(a.name == "reduction" and a.s != b"none" for a in n.attribute)
    ]
    assert {"TopK", "ArgMax"} <= {n.op_type for n in nodes}  # the ranking and the match are in the graph


def test_deepcopy_after_a_training_forward():
    """The ranking score must not stay on the attention modules with its graph (deepcopy, EMA, teachers)."""
    m = mgvit_h(r_h=0.25, r_t=0.25).train()
    m(torch.randn(2, 1, 64, 64)).sum().backward()
    copy.deepcopy(m)
    assert not any("received" in mod.__dict__ for mod in m.modules())


def test_cli_finetune_variant_r(pvt_run, tmp_path):
    r = invoke(
        "finetune",
        pvt_run,
        "--method",
        "mgvit-h",
        "--variant",
        "r",
        "--r-h",
        "0.25",
        "--r-t",
        "0.25",
        "--r-pos",
        "0.5",
        "--r-neg",
        "0.25",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--train-limit",
        "32",
        "--eval-limit",
        "32",
        "--out",
        tmp_path / "r",
    )
    assert r.exit_code == 0, r.output
    m = nascompress.load(tmp_path / "r")
    assert isinstance(m, MGPVT) and m.mg["variant"] == "r" and m.mg["r_h"] == 0.25 and m.mg["r_pos"] == 0.5
    r = invoke("finetune", pvt_run, "--method", "mgvit-h", "--r-pos", "0.7", "--r-neg", "0.4", "--out", tmp_path / "x")
    assert r.exit_code == 1 and "r_pos + r_neg must be at most 1" in r.output and not (tmp_path / "x").exists()
    r = invoke("finetune", pvt_run, "--method", "mgvit-h", "--ppsm-layers", "3", "--out", tmp_path / "x")
    assert r.exit_code == 1 and "--ppsm-layers is not a mgvit-h option" in r.output


def test_import_and_train_from_pyramid_weights(tmp_path):
    """A user's pvt_v2 weights (timm layout, and the original PVT layout that timm's pvt filter renames)
    import as a run and start a dense training run; mgvit-h then converts the imported run."""
    from safetensors.torch import save_file

    from nascompress.data import DataConfig
    from nascompress.importer.run import ImportJob, import_model
    from nascompress.train.config import TrainConfig
    from nascompress.train.run import TrainJob, train

    d = dense(in_chans=3)
    sd = {k: v.contiguous() for k, v in d.state_dict().items()}
    save_file(sd, str(tmp_path / "pvt.safetensors"))
    original = {
        k.replace("patch_embed.", "patch_embed1.")
        .replace("stages.0.blocks.", "block1.")
        .replace("stages.0.norm", "norm1"): v
        for k, v in sd.items()
    }
    torch.save(original, tmp_path / "orig.pth")
    x = torch.randn(2, 3, 64, 64)
    for name in ("pvt.safetensors", "orig.pth"):
        import_model(
            ImportJob(model="pvt_v2_b0", weights=str(tmp_path / name), out=str(tmp_path / f"run_{name}"), img_size=64)
        )
        with torch.no_grad():
            torch.testing.assert_close(nascompress.load(tmp_path / f"run_{name}")(x), d(x))
    spec = ModelSpec("pvt_v2_b0", {"img_size": 64, "num_classes": 10})
    train(
        TrainJob(
            model=spec,
            weights=str(tmp_path / "orig.pth"),
            data=DataConfig(dataset="synthetic", train_limit=16, eval_limit=16),
            out=str(tmp_path / "t"),
            train=TrainConfig(epochs=1, batch_size=16, lr=1e-5, seed=0),
        )
    )
    m = mgvit_h(nascompress.load(tmp_path / "run_pvt.safetensors"), variant="r")
    assert m.mg["grid"] == 2


def test_cli_refuses_a_plain_vit_run_for_mgvit_h_in_one_line(tiny_run, tmp_path):
    r = invoke("finetune", tiny_run, "--method", "mgvit-h", "--out", tmp_path / "x", "--epochs", "1")
    assert r.exit_code == 1
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "mgvit-h needs a pyramid ViT" in lines[0] and "use --method mgvit" in lines[0], r.output
    assert not (tmp_path / "x").exists()


def test_training_loss_and_kl_weight():
    from nascompress.methods.mgvit_h import MGViTHHooks
    from nascompress.train.config import TrainConfig

    x, y = torch.randn(4, 1, 64, 64), torch.randint(0, 10, (4,))
    m = mgvit_h(variant="r", r_h=0.25, r_t=0.25).train()
    loss, logs = MGViTHHooks(1.0).loss(m, x, y, epoch=0, cfg=TrainConfig(epochs=5, lr=None))
    loss.backward()
    assert set(logs) == {"ce_mgis", "kl_sgis"}
    assert loss.item() == pytest.approx((logs["ce_mgis"] + logs["kl_sgis"]).item())
    assert m.mg_layer.mlp.fc2.weight.grad.abs().sum() > 0 and m.mg_pos_head.grad.abs().sum() > 0
    m.zero_grad()
    calls = []
    h = m.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[-1]))
    loss, logs = MGViTHHooks(0.0).loss(m, x, y, epoch=0, cfg=TrainConfig(epochs=5, lr=None))
    h.remove()
    assert set(logs) == {"ce_mgis"} and calls == [64]  # the MG pass alone: no half-size SGIS
    _, rec = get_method("mgvit-h").prepare_fresh(dense(), {}, {"kl_weight": 0.5})
    assert rec["recipe"] == {"kl_weight": 0.5}
    assert get_method("mgvit-h").hooks(None, rec, teacher=None, train_cfg=None).kl_weight == 0.5


def test_a_pipeline_from_a_pyramid_run(pvt_run, tmp_path):
    """The pipeline on a pyramid base: tokens over mgvit-h's space, retrain (feature KD from the dense
    pyramid), ONNX export (two graphs); a DCS stage or a space with layer numbers is refused in one
    line before anything runs."""
    import json
    from pathlib import Path

    import yaml

    space = Path(__file__).resolve().parents[1] / "nascompress" / "search_spaces" / "mgvit-h.yaml"
    cfg = {
        "format": "nascompress-pipeline/1",
        "seed": 0,
        "device": "cpu",
        "data": {"dataset": "synthetic"},
        "base": {"run": str(pvt_run)},
        "goal": {"max_flops": 1.0},
        "stages": {
            "tokens": {
                "space": str(space),
                "trials": 3,
                "eval_images": 16,
                "train_images": 16,
                "batch_size": 16,
                "objective": "flops",
            },
            "retrain": {"epochs": 1, "batch_size": 16, "train_limit": 32},
        },
        "report": {"iters": 2, "batch_size": 8},
        "export": {"format": "onnx"},
    }
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    r = invoke("pipeline", tmp_path / "p.yaml", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [m["name"] for m in summary["decisions"]["methods"]] == ["mgvit-h"]
    assert (tmp_path / "out" / "export" / "model.onnx").is_file()
    assert (tmp_path / "out" / "export" / "model.mgis.onnx").is_file()  # the two graphs of MG-ViT
    assert isinstance(nascompress.load(tmp_path / "out" / "final"), MGPVT)

    bad = dict(cfg, stages={"dcs": {"target_flops": 0.8, "epochs": 1}})
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(bad))
    r = invoke("pipeline", tmp_path / "d.yaml", "--out", tmp_path / "d")
    assert r.exit_code == 1 and "stages.dcs: DCS needs a timm VisionTransformer" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "d").exists()
    (tmp_path / "evit.yaml").write_text(TINY_EVIT_SPACE)
    bad = dict(cfg, stages={"tokens": dict(cfg["stages"]["tokens"], space=str(tmp_path / "evit.yaml"))})
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(bad))
    r = invoke("pipeline", tmp_path / "e.yaml", "--out", tmp_path / "e")
    assert r.exit_code == 1 and "layer numbers address a plain ViT's blocks" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "e").exists()


def test_quantize_refuses_it_in_one_line(tmp_path):
    """Two graphs and an exit rule, as mgvit: int8 is refused (it wrote one file under two stage names)."""
    m = mgvit_h(variant="r", epsilon=0.6, r_h=0.25, r_t=0.25)
    save_model(
        tmp_path / "m",
        m,
        make_arch(
            SPEC,
            input_spec=INPUT,
            methods=[{"name": "mgvit-h", "config": {k: m.mg[k] for k in ("variant", "r_h", "r_t", "epsilon")}}],
        ),
    )
    r = invoke("quantize", tmp_path / "m", "--out", tmp_path / "q", "--dataset", "synthetic")
    assert r.exit_code == 1 and "MG-ViT is not quantized (mgvit-h: two graphs and an exit rule)" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "q").exists()
