"""The inference path without eager overheads (issue 65): the token methods' gathers and EViT's
pruning against straightforward references (exact where the order matters), no work where nothing is
pruned, ``nc.load(..., compile=True)`` against the eager model, and the AOTInductor export."""

from __future__ import annotations

import json

import pytest
import torch
from torch.overrides import TorchFunctionMode

import nascompress as nc
from nascompress.errors import NascompressError
from nascompress.methods import apply_methods
from nascompress.methods.evit import evit_prune
from nascompress.methods.tome import bipartite_soft_matching, merge_targets, merge_wavg
from nascompress.methods.tokens import gather_tokens, keep_prefix_and
from nascompress.models.build import build_model, custom_vit_spec
from nascompress.profiling.latency import compile_problem
from nascompress.runs.io import make_arch, save_model

from .conftest import invoke

NO_COMPILER = compile_problem(torch.device("cpu"))  # the check load(compile=True) and export --format aoti make
needs_compiler = pytest.mark.skipif(NO_COMPILER is not None, reason=f"no compiler for torch.compile: {NO_COMPILER}")
SPEC = custom_vit_spec(img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=1, num_classes=10, in_chans=1)
INPUT = {"img_size": [8, 8], "in_chans": 1, "mean": [0.5], "std": [0.5]}
EVIT = [{"name": "evit", "config": {"keep_rate": 0.5, "prune_layers": [1]}}]


def ref_gather(x, idx):
    """The straightforward gather: torch.gather with the index expanded over the channels."""
    return torch.gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def ref_evit(x, scores, keep, prefix):
    """EViT's pruning written out: a full descending sort, the prefix and the top ``keep`` tokens in
    score order, then the score-weighted sum of the others."""
    order = scores.argsort(dim=1, descending=True)
    idx = torch.cat([torch.arange(prefix).expand(x.shape[0], prefix), order[:, :keep] + prefix], 1)
    rest = order[:, keep:]
    fused = (torch.gather(scores, 1, rest).unsqueeze(-1) * ref_gather(x, rest + prefix)).sum(1, keepdim=True)
    return ref_gather(x, idx), fused


class Calls(TorchFunctionMode):
    """The names of the torch functions and tensor methods called inside the block."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("prefix", [0, 1, 3])
def test_gathers_equal_the_expanded_index_gather(batch, prefix):
    g = torch.Generator().manual_seed(batch * 10 + prefix)
    x = torch.randn(batch, 11 + prefix, 5, generator=g)
    idx = torch.stack([torch.randperm(11, generator=g)[:6] for _ in range(batch)])
    assert torch.equal(gather_tokens(x, idx), ref_gather(x, idx))
    head = torch.arange(prefix).expand(batch, prefix)
    assert torch.equal(keep_prefix_and(x, idx, prefix), ref_gather(x, torch.cat([head, idx + prefix], 1)))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("prefix", [1, 2])
def test_evit_prune_equals_the_sorted_reference(batch, prefix):
    g = torch.Generator().manual_seed(batch + 7 * prefix)
    n, keep = 13, 5
    x = torch.randn(batch, prefix + n, 8, generator=g)
    scores = torch.randn(batch, n, generator=g).softmax(-1)
    kept, fused = ref_evit(x, scores, keep, prefix)
    out = evit_prune(x, scores, keep, prefix=prefix)
    assert out.shape == (batch, prefix + keep + 1, 8)
    assert torch.equal(out[:, :-1], kept)  # the same tokens in the same (score) order, bit for bit
    torch.testing.assert_close(out[:, -1:], fused)  # one sum, another summation order
    assert torch.equal(evit_prune(x, scores, keep, prefix=prefix, fuse=False), kept)


def test_evit_prune_runs_no_full_sort_and_one_image_no_offsets():
    x, scores = torch.randn(1, 14, 8), torch.rand(1, 13)
    with Calls() as calls:
        evit_prune(x, scores, 5)
    assert "topk" in calls.names and not {"sort", "argsort"} & set(calls.names), calls.names
    assert "gather" not in calls.names, calls.names  # the fused token is a matmul, not a second gather
    with Calls() as calls:
        gather_tokens(x, torch.tensor([[3, 1]]))
    assert "arange" not in calls.names, calls.names  # one image: no per-image offsets


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("sized", [False, True])
def test_tome_merge_equals_the_one_hot_reference(batch, sized):
    g = torch.Generator().manual_seed(batch + 5 * sized)
    x, keys = torch.randn(batch, 15, 6, generator=g), torch.randn(batch, 15, 4, generator=g)
    size = torch.randint(1, 4, (batch, 15, 1), generator=g).float() if sized else None
    m = bipartite_soft_matching(keys, 4)
    target = merge_targets(m, 15)
    assert set(target.flatten().tolist()) == set(range(11))  # every output token receives a token
    w = (target.unsqueeze(1) == torch.arange(11).view(1, -1, 1)).float()  # (B, 11, 15) one-hot
    if size is not None:
        w = w * size.transpose(1, 2)
    want_size = w.sum(-1, keepdim=True)
    got, got_size = merge_wavg(x, size, m)
    assert torch.equal(got_size, want_size) and torch.equal(got, (w / want_size) @ x)


def test_keep_everything_returns_the_input_tokens():
    x, scores = torch.randn(3, 10, 4), torch.rand(3, 9)
    assert evit_prune(x, scores, 9) is x  # nothing to prune: no sort, no gather, the tokens as they were
    dense = build_model(SPEC).eval()
    off = apply_methods(dense, [{"name": "evit", "config": {"keep_rate": 1.0, "prune_layers": [1, 2]}}])
    xb = torch.randn(2, 1, 8, 8)
    with torch.no_grad(), Calls() as calls:
        torch.testing.assert_close(off(xb), dense(xb), rtol=0, atol=0)
    assert not {"topk", "index_select", "scatter"} & set(calls.names), calls.names


@pytest.fixture()
def evit_run(tmp_path):
    torch.manual_seed(0)
    model = apply_methods(build_model(SPEC), EVIT).eval()
    save_model(tmp_path / "evit", model, make_arch(SPEC, input_spec=INPUT, methods=EVIT))
    return tmp_path / "evit"


@needs_compiler
def test_load_compile_matches_the_eager_model(evit_run):
    eager = nc.load(evit_run)
    compiled = nc.load(evit_run, compile=True)
    assert compiled is not eager and isinstance(compiled, torch.nn.Module)
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), atol=1e-4, rtol=0)


def test_load_compile_refused_in_one_line_without_a_compiler(evit_run, monkeypatch):
    import nascompress.profiling.latency as latency

    monkeypatch.setattr(latency, "compile_problem", lambda device: "no C++ compiler (test)")
    with pytest.raises(NascompressError) as e:
        nc.load(evit_run, compile=True)
    assert "no C++ compiler (test)" in str(e.value) and "compile=False" in str(e.value)
    assert "\n" not in str(e.value)


@needs_compiler
def test_export_aoti_round_trip(evit_run, tmp_path):
    out = tmp_path / "model.pt2"
    r = invoke("export", evit_run, "--format", "aoti", "--out", out)
    assert r.exit_code == 0, r.output
    side = json.loads((tmp_path / "model.pt2.json").read_text())
    assert side["runtime"] == "aoti" and side["verification"]["passed"], side["verification"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evit", "model.pt2", "model.pt2.json"]  # no temp files
    fn = torch._inductor.aoti_load_package(str(out))
    model = nc.load(evit_run)
    for batch in (1, 4):  # exported with a dynamic batch
        x = torch.randn(batch, 1, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(fn(x), model(x), atol=1e-4, rtol=0)


def test_export_aoti_refused_without_a_compiler(evit_run, tmp_path, monkeypatch):
    import nascompress.deploy.run as export_run

    monkeypatch.setattr(export_run, "compile_problem", lambda device: "no C++ compiler (test)")
    r = invoke("export", evit_run, "--format", "aoti", "--out", tmp_path / "m.pt2")
    assert r.exit_code == 1 and "no C++ compiler (test)" in r.output and "--format aoti" in r.output, r.output
    assert not (tmp_path / "m.pt2").exists()
