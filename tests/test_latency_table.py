"""The device's latency table (issue 65): its structure, its cache, the predictor of a model's latency
from it (arithmetic on hand-made tables, never a speed) and ``nascompress latency-table``."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from nascompress.errors import NascompressError
from nascompress.models.layers import to_core
from nascompress.methods.dcs_materialize import ConstantMLP
from nascompress.models.build import build_model, custom_vit_spec
from nascompress.profiling import LatencyTable, ViTGeometry, geometry_of, latency_table, predict_arch, predict_latency
from nascompress.profiling import latency_table_build
from nascompress.profiling.latency_table import TABLE_FORMAT, DeviceFingerprint, cache_dir, read_table, table_key
from nascompress.profiling.latency_table_build import build_table, make_block, make_vit
from nascompress.models.slicing import slice_hidden

from .conftest import hand_latency_table, invoke

# N = 17 tokens (16 patches + CLS), C = 16, H = 2, d = 8, hidden 32
GEOM = ViTGeometry(
    img_size=(16, 16),
    patch_size=(4, 4),
    in_chans=1,
    embed_dim=16,
    depth=2,
    num_heads=2,
    head_dim=8,
    mlp_hidden=32,
    num_classes=10,
)


def hand_table(geometry=GEOM, *, align: int = 4) -> LatencyTable:
    return hand_latency_table(geometry, align=align)


@pytest.fixture(scope="module")
def measured():
    return build_table(GEOM, device=torch.device("cpu"), align=4, iters=1, warmup=1)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """An empty cache folder and a counting stand-in for the measuring function."""
    monkeypatch.setenv("NASCOMPRESS_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_build(geometry, **kw):
        calls.append(kw)
        return hand_table(geometry, align=kw["align"])

    monkeypatch.setattr(latency_table_build, "build_table", fake_build)
    return calls


def tiny_model(**widths) -> nn.Module:
    """A ViT of GEOM whose every block has ``widths`` (heads, qk, hidden; full by default)."""
    w = {"heads": GEOM.num_heads, "qk": GEOM.head_dim, "hidden": GEOM.mlp_hidden, **widths}
    return make_vit(GEOM, [make_block(GEOM, **w) for _ in range(GEOM.depth)]).eval()


# ------------------------------------------------------------------------------------------------
# the table as measured


def test_a_measured_table_has_its_grid_and_finite_positive_medians(measured):
    t = measured
    d = json.loads(json.dumps(t.to_dict()))
    assert d["format"] == TABLE_FORMAT
    fp = d["fingerprint"]
    assert {"device_type", "cpu", "cpu_flags", "logical_cores", "threads", "torch"} <= set(fp)
    assert fp["device_type"] == "cpu" and fp["threads"] == torch.get_num_threads()
    assert isinstance(t.fingerprint, DeviceFingerprint) and t.fingerprint.to_dict() == fp  # typed, the same JSON
    assert t.tokens[-1] == GEOM.tokens == 17 and len(t.tokens) == 3  # N, 0.7 N, 0.5 N
    assert t.heads == (0, 1, 2) and t.qk == (4, 8)
    assert t.hidden[0] == 0 and t.hidden[-1] == 32 and all(w % 4 == 0 for w in t.hidden)
    assert torch.tensor(t.attn_ms).shape == (3, 3, 2) and torch.tensor(t.mlp_ms).shape == (3, len(t.hidden))
    for v in [*torch.tensor(t.attn_ms).flatten().tolist(), *torch.tensor(t.mlp_ms).flatten().tolist()]:
        assert math.isfinite(v) and v > 0
    assert t.fixed_ms > 0 and t.dense_ms > 0 and t.block_overhead_ms >= 0
    assert LatencyTable.from_dict(d) == t  # the JSON round trip


# ------------------------------------------------------------------------------------------------
# the cache


def test_a_cached_table_is_read_not_measured_again(cache):
    first = latency_table(GEOM, device="cpu", dtype="fp32", batch=1, align=4)
    files = list(cache_dir().glob("*.json"))
    assert len(cache) == 1 and len(files) == 1
    assert files[0].parent == cache_dir() and str(cache_dir()).endswith("nascompress/latency")
    again = latency_table(GEOM, device="cpu", dtype="fp32", batch=1, align=4)
    assert len(cache) == 1 and again == first
    latency_table(GEOM, device="cpu", dtype="fp32", batch=1, align=4, rebuild=True)
    assert len(cache) == 2
    latency_table(GEOM, device="cpu", dtype="fp32", batch=1, align=4, cache=False)
    assert len(cache) == 3 and len(list(cache_dir().glob("*.json"))) == 1


def test_the_key_changes_with_batch_dtype_geometry_and_device():
    fp = DeviceFingerprint.new(device_type="cpu", cpu="x")
    base = table_key(GEOM, fingerprint=fp, dtype="fp32", batch=1, align=8)
    same = DeviceFingerprint.new(cpu="x", device_type="cpu")  # the same fields in another order: the same key
    assert base == table_key(GEOM, fingerprint=same, dtype="fp32", batch=1, align=8)
    wider = ViTGeometry(**{**GEOM.__dict__, "mlp_hidden": 64})
    others = {
        table_key(GEOM, fingerprint=fp, dtype="fp32", batch=16, align=8),
        table_key(GEOM, fingerprint=fp, dtype="bf16", batch=1, align=8),
        table_key(wider, fingerprint=fp, dtype="fp32", batch=1, align=8),
        table_key(GEOM, fingerprint=fp.set(cpu="y"), dtype="fp32", batch=1, align=8),
    }
    assert len(others) == 4 and base not in others


def test_batch_and_dtype_reach_the_cache_key(cache):
    latency_table(GEOM, device="cpu", dtype="fp32", batch=1, align=4)
    latency_table(GEOM, device="cpu", dtype="fp32", batch=2, align=4)
    latency_table(GEOM, device="cpu", dtype="bf16", batch=1, align=4)
    assert len(cache) == 3 and len(list(cache_dir().glob("*.json"))) == 3


def test_a_damaged_cached_table_is_measured_again(cache):
    latency_table(GEOM, device="cpu", dtype="fp32", batch=1, align=4)
    (path,) = cache_dir().glob("*.json")
    for damage in ("{not json", json.dumps({"format": TABLE_FORMAT, "tokens": [1]}), json.dumps({"format": "x"})):
        path.write_text(damage)
        table = latency_table(GEOM, device="cpu", dtype="fp32", batch=1, align=4)
        assert table == hand_table(GEOM) and read_table(path) == table
    other = ViTGeometry(**{**GEOM.__dict__, "mlp_hidden": 64})
    path.write_text(json.dumps(hand_table(other).to_dict()))  # a valid table, of another geometry
    assert latency_table(GEOM, device="cpu", dtype="fp32", batch=1, align=4).geometry == GEOM
    assert len(cache) == 5


def test_a_damaged_table_file_is_one_line_error(tmp_path):
    p = tmp_path / "t.json"
    d = hand_table().to_dict()
    d["mlp_ms"][0][0] = -1.0
    p.write_text(json.dumps(d))
    with pytest.raises(NascompressError, match="mlp_ms") as e:
        read_table(p)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------
# the predictor (deterministic arithmetic on hand-made tables)


def test_the_dense_model_predicts_the_tables_full_width_entries():
    t = hand_table()
    full = t.fixed_ms + GEOM.depth * (t.block_overhead_ms + t.attn_ms[-1][-1][-1] + t.mlp_ms[-1][-1])
    assert predict_latency(t, tiny_model()) == pytest.approx(full, rel=1e-12)
    timm_vit = build_model(
        custom_vit_spec(
            img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2, num_classes=10, mlp_ratio=2.0, in_chans=1
        )
    )
    assert geometry_of(timm_vit) == GEOM
    assert predict_latency(t, timm_vit) == pytest.approx(full, rel=1e-12)  # a plain timm ViT reads the same


def test_the_prediction_falls_with_every_pruned_dimension():
    t = hand_table()
    dense = predict_latency(t, tiny_model())
    fewer_hidden = build_model(
        custom_vit_spec(
            img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2, num_classes=10, mlp_ratio=2.0, in_chans=1
        )
    )
    to_core(fewer_hidden, method="test")
    slice_hidden(fewer_hidden.blocks[0], range(10))  # 10 of 32: between grid points
    one_block = tiny_model()
    del one_block.blocks[1]
    dcs_constant = tiny_model()
    dcs_constant.blocks[1].mlp = ConstantMLP(torch.zeros(GEOM.embed_dim))  # DCS: no hidden neuron left
    preds = {
        "hidden sliced": predict_latency(t, fewer_hidden),
        "hidden 16": predict_latency(t, tiny_model(hidden=16)),
        "mlp constant": predict_latency(t, tiny_model(hidden=0)),
        "one head": predict_latency(t, tiny_model(heads=1)),
        "attention gone": predict_latency(t, tiny_model(heads=0)),
        "qk 4": predict_latency(t, tiny_model(qk=4)),
        "one block": predict_latency(t, one_block),
        "dcs constant mlp": predict_latency(t, dcs_constant),
    }
    assert all(p < dense for p in preds.values()), preds
    assert preds["mlp constant"] < preds["hidden 16"]
    assert preds["attention gone"] < preds["one head"] < preds["qk 4"]
    assert predict_latency(t, tiny_model(), tokens=9) < dense  # fewer tokens (a token method)


def test_predict_arch_reads_a_model_like_predict_latency():
    t = hand_table()
    arch = [{"present": 1.0, "heads": 1, "qk": 4, "hidden": 12}, {"present": 0.0}]
    model = make_vit(GEOM, [make_block(GEOM, heads=1, qk=4, hidden=12)])
    assert float(predict_arch(t, arch)) == pytest.approx(predict_latency(t, model), rel=1e-12)


def test_predict_arch_gradient_is_the_local_slope():
    t = hand_table()
    vals = {"present": 0.7, "heads": 1.3, "qk": 5.5, "hidden": 13.0}
    x = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in vals.items()}
    n = torch.tensor(14.2, dtype=torch.float64, requires_grad=True)
    y = predict_arch(t, [x, {"hidden": 20.0}], tokens=[n, 17])
    y.backward()
    eps = 1e-4
    for k in vals:
        hi = predict_arch(t, [{**vals, k: vals[k] + eps}, {"hidden": 20.0}], tokens=[14.2, 17])
        lo = predict_arch(t, [{**vals, k: vals[k] - eps}, {"hidden": 20.0}], tokens=[14.2, 17])
        fd = float(hi - lo) / (2 * eps)
        assert x[k].grad is not None and abs(float(x[k].grad)) > 1e-6, k
        assert float(x[k].grad) == pytest.approx(fd, rel=1e-6), k
    fd_n = float(
        predict_arch(t, [vals, {"hidden": 20.0}], tokens=[14.2 + eps, 17])
        - predict_arch(t, [vals, {"hidden": 20.0}], tokens=[14.2 - eps, 17])
    ) / (2 * eps)
    assert float(n.grad) == pytest.approx(fd_n, rel=1e-6) and float(n.grad) > 0


def test_predict_arch_interpolates_on_the_grid_and_extrapolates_linearly():
    t = hand_table()
    m = t.mlp_ms[-1]
    w = t.hidden

    def mlp_part(hidden):
        return float(predict_arch(t, [{"heads": 0, "hidden": hidden}])) - float(
            predict_arch(t, [{"heads": 0, "hidden": 0}])
        )

    assert mlp_part(w[2]) == pytest.approx(m[2] - m[0], rel=1e-12)  # a grid point: its entry
    mid = (w[2] + w[3]) / 2
    assert mlp_part(mid) == pytest.approx((m[2] + m[3]) / 2 - m[0], rel=1e-12)  # linear between
    slope = (m[-1] - m[-2]) / (w[-1] - w[-2])
    assert mlp_part(w[-1] + 8) == pytest.approx(m[-1] + 8 * slope - m[0], rel=1e-12)  # past the edge


def test_a_model_of_another_width_is_refused_in_one_line():
    wide = build_model(
        custom_vit_spec(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10, in_chans=1)
    )
    with pytest.raises(NascompressError, match="embedding width 32") as e:
        predict_latency(hand_table(), wide)
    assert "\n" not in str(e.value)
    with pytest.raises(NascompressError, match="unknown keys"):
        predict_arch(hand_table(), [{"width": 3}])


# ------------------------------------------------------------------------------------------------
# the command


def test_latency_table_command_measures_caches_and_prints(tiny_run, tmp_path, monkeypatch):
    monkeypatch.setenv("NASCOMPRESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "table.json"
    r = invoke("latency-table", tiny_run, "--iters", 1, "--out", out)
    assert r.exit_code == 0, r.output
    assert "measured now" in r.output and "attention" in r.output and "predicted" in r.output
    table = read_table(out)
    assert table.geometry.embed_dim == 32 and table.geometry.tokens == 17 and table.batch == 1
    (cached,) = (tmp_path / "cache" / "nascompress" / "latency").glob("*.json")
    assert str(cached) in r.output.replace("\n", "") and read_table(cached) == table
    again = invoke("latency-table", tiny_run, "--iters", 1, "--json")
    assert again.exit_code == 0, again.output
    d = json.loads(again.output)
    assert d["measured"] is False and d["format"] == TABLE_FORMAT and d["predicted_ms"] > 0


def test_latency_table_command_bad_input_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("NASCOMPRESS_CACHE", str(tmp_path / "cache"))
    r = invoke("latency-table", tmp_path / "no" / "such-run")
    assert r.exit_code == 1
    assert r.output.strip().startswith("error:") and len(r.output.strip().splitlines()) == 1, r.output
    r = invoke("latency-table", tmp_path / "no" / "such-run", "--dtype", "fp64")
    assert r.exit_code != 0 and "fp64" in r.output


def test_the_table_is_made_monotone_where_width_never_runs_faster():
    from nascompress.profiling.latency_table_build import monotone

    noisy = torch.tensor([[1.0, 0.8, 1.2, 1.1, 2.0], [0.5, 0.7, 0.6, 0.9, 1.0]])
    m = monotone(noisy, 1)
    assert (m[:, 1:] >= m[:, :-1]).all()
    assert torch.equal(monotone(m, 1), m)  # a monotone table stays as it is
    assert torch.equal(monotone(torch.tensor([[0.1, 0.2, 0.4]]), 1), torch.tensor([[0.1, 0.2, 0.4]]))
    assert m.min() >= noisy.min() and m.max() <= noisy.max()


def test_the_dense_model_predicts_as_measured_whatever_the_halves_cost_alone(monkeypatch):
    """The per-block overhead, or where the halves timed alone cost more than the dense model, their
    scale, makes the table's dense prediction its measured dense time (fake timings, no speed)."""
    for per_half in (0.01, 5.0):  # halves cheaper than the model (an overhead), then dearer (a scale)

        def fake(makers, x, *, per, dtype, warmup, iters, per_half=per_half):
            return [2.0 if per == 1 and i else 0.5 if per == 1 else per_half for i in range(len(makers))]

        monkeypatch.setattr(latency_table_build, "_median_ms", fake)
        t = build_table(GEOM, device=torch.device("cpu"), align=4, iters=1, warmup=1)
        dense = make_vit(GEOM, [make_block(GEOM, heads=2, qk=8, hidden=32) for _ in range(GEOM.depth)])
        assert predict_latency(t, dense) == pytest.approx(t.dense_ms, rel=1e-6)
        assert (t.block_overhead_ms > 0) == (per_half == 0.01)


def test_measured_ms_times_a_copy_at_the_tables_batch_and_dtype(monkeypatch):
    """``measured_ms`` (the anchor of a cached table) times the model at the table's batch, dtype and
    image size, as the table's entries were timed, and leaves the caller's model as it was."""
    model = build_model(
        custom_vit_spec(img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2, in_chans=1, num_classes=10)
    ).train()
    table = hand_table(geometry_of(model))
    table = LatencyTable(**{**{f: getattr(table, f) for f in table.__dataclass_fields__}, "batch": 3})
    seen = []

    def fake_median_ms(makers, x, *, per, dtype, warmup, iters):
        m = makers[0]()
        seen.append((tuple(x.shape), x.dtype, dtype, per, m is not model))
        return [4.5]

    monkeypatch.setattr(latency_table_build, "_median_ms", fake_median_ms)
    before = [p.clone() for p in model.parameters()]
    assert latency_table_build.measured_ms(model, table) == 4.5
    assert seen == [((3, 1, 16, 16), torch.float32, torch.float32, 1, True)]
    assert model.training and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
