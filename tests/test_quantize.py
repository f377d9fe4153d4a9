"""``nascompress quantize`` / ``export --quantize`` / the pipeline's ``export.quantize``: a tiny model
quantizes to int8 ONNX and is checked on its validation split; an accuracy collapse is caught and
leaves nothing (or a milder scheme is kept and said so); the file runs without nascompress."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from nascompress.errors import NascompressError
from nascompress.deploy import ExportConfig, export_run
from nascompress.deploy import quantize as q
from nascompress.deploy.config import QuantizeConfig
from nascompress.deploy.quantize import quantize_run
from nascompress.deploy.verify import AccuracyCheck
from nascompress.runs.files import read_sidecar

from .conftest import invoke

FILE = "model.int8.onnx"


def _op_types(path) -> set[str]:
    import onnx

    return {n.op_type for n in onnx.load(str(path)).graph.node}


@pytest.fixture(scope="module")
def quantized(tiny_run, tmp_path_factory):
    """The tiny run quantized by the CLI with its defaults: (run, out dir, sidecar, CLI output)."""
    out = tmp_path_factory.mktemp("quantized") / "int8"
    r = invoke("quantize", tiny_run, "--out", out)
    assert r.exit_code == 0, r.output
    return tiny_run, out, json.loads((out / f"{FILE}.json").read_text()), r.output


def test_a_tiny_model_quantizes_and_is_checked_on_its_validation_split(quantized):
    run, out, side, text = quantized
    assert sorted(p.name for p in out.iterdir()) == [FILE, f"{FILE}.json"]
    assert {"QuantizeLinear", "DequantizeLinear"} <= _op_types(out / FILE)  # static int8 (QDQ) ops
    qz, v = side["quantization"], side["verification"]
    assert qz["scheme"] == "int8-static" and qz["fallback"] is None and side["dtype"] == "int8"
    assert qz["calibration"]["split"] == "train" and qz["calibration"]["images"] == 256
    kept = qz["kept_fp32_summary"]
    assert kept["classifier head"] == 1 and kept["patch embedding (Conv)"] == 1
    assert kept["attention matmul between activations (QK^T / AV)"] == 4  # 2 blocks x (QK^T, AV)
    assert qz["quantized_nodes"] == 8  # 2 blocks x (qkv, proj, fc1, fc2)
    assert {k["module"] for k in qz["kept_fp32"] if k["why"] == "classifier head"} == {"head"}
    assert v["split"] == "val" and v["dataset"] == "synthetic" and v["n"] == 60 and v["passed"]
    assert v["top1_drop"] <= 1.0 and 0 <= v["top1_agreement"] <= 100 and v["max_abs_logit_diff"] > 0
    assert side["fp32_verification"]["passed"] and side["file"] == FILE
    assert "int8-static" in text and "drop" in text


def test_rerun_is_refused_without_force(quantized):
    run, out, _, _ = quantized
    r = invoke("quantize", run, "--out", out)
    assert r.exit_code == 1 and "already exists; pass --force" in r.stderr


def test_the_file_runs_in_a_process_without_nascompress_or_torch(quantized, tmp_path):
    run, out, side, _ = quantized
    x = np.random.default_rng(0).standard_normal((3, 1, 16, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    code = (
        "import sys\n"
        "for m in ('nascompress', 'torch', 'timm'): sys.modules[m] = None  # importing them fails\n"
        "import json, numpy as np, onnxruntime as ort\n"
        "side = json.load(open(sys.argv[1] + '.json'))\n"
        "s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
        "y = s.run(None, {side['files'][0]['inputs'][0]['name']: np.load(sys.argv[2])})[0]\n"
        "np.save(sys.argv[3], y); print(side['quantization']['scheme'], y.shape)\n"
    )
    r = subprocess.run(
        [sys.executable, "-I", "-c", code, str(out / FILE), str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "int8-static"
    import nascompress

    with torch.no_grad():
        want = nascompress.load(run)(torch.from_numpy(x))
    got = torch.from_numpy(np.load(tmp_path / "y.npy"))
    assert got.shape == want.shape and (got - want).abs().max() < 0.1 * max(1.0, float(want.abs().max()))


def test_export_quantize_and_the_pipeline_key_write_the_same_file(quantized, tmp_path):
    run, out, side, _ = quantized
    r = invoke("export", run, "--quantize", "int8", "--out", tmp_path / "e.onnx")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "e.onnx").read_bytes() == (out / FILE).read_bytes()
    e_side = json.loads((tmp_path / "e.onnx.json").read_text())
    assert e_side["quantization"]["scheme"] == "int8-static" and e_side["verification"] == side["verification"]

    from nascompress.pipeline import plan

    cfg = {
        "format": "nascompress-pipeline/1",
        "seed": 0,
        "data": {"dataset": "synthetic"},
        "base": {"run": str(run)},
        "goal": {"max_flops": 0.9},
        "stages": {"dcs": {"target_flops": 0.9, "epochs": 1}},
        "export": {"format": "onnx", "quantize": "int8"},
    }
    (tmp_path / "p.yaml").write_text(json.dumps(cfg))
    pipe = plan(tmp_path / "p.yaml", out=tmp_path / "pipe")
    step = next(s for s in pipe.steps if s.name == "export")
    assert step.outputs == ("export/model.int8.onnx", "export/model.int8.onnx.json")
    shutil.copytree(run, tmp_path / "pipe" / "dcs_mat")  # as if the DCS stage had made it
    check = step.run(force=True, resume=False)  # the typed check, as the sidecar has it
    assert isinstance(check, AccuracyCheck) and check.passed and check.split == "val"
    assert check.to_dict() == json.loads((tmp_path / "pipe" / "export" / f"{FILE}.json").read_text())["verification"]
    assert (tmp_path / "pipe" / "export" / FILE).read_bytes() == (out / FILE).read_bytes()
    # the report's int8 rows: the export step's file for the compressed model, the dense one made alike
    from nascompress.pipeline.report import _int8
    from nascompress.pipeline.report_format import build_html
    from nascompress.pipeline.summary import Summary

    rows = _int8(pipe, tmp_path / "pipe" / "dcs_mat")
    assert [r.model for r in rows.rows] == ["dense fp32", "dense int8", "compressed fp32", "compressed int8"]
    assert rows.throughput_batch == pipe.cfg.report.batch_size and rows.get("split") == "test"
    s = Summary.new(
        source="p.yaml",
        out="o",
        seed=0,
        written="now",
        goal={"value": None, "statement": "x"},
        dense={"test_top1": 1.0, "macs": 1.0},
        final=None,
        comparison=None,
        int8=rows,
        decisions={},
        stages=[],
    )
    page = build_html(s, config_text="")
    assert 'id="int8"' in page and "compressed int8" in page


def _zero_head(real):
    """quantize_file that writes the int8 file with the classifier head's weights zeroed (a collapse)."""

    def collapse(src, dst, **kw):
        import onnx
        from onnx import numpy_helper

        real(src, dst, **kw)
        m = onnx.load(str(dst))
        for init in m.graph.initializer:
            if init.name.startswith("head."):
                init.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(init)), init.name))
        onnx.save(m, str(dst))

    return collapse


def test_a_planted_accuracy_collapse_fails_with_the_figures_and_leaves_nothing(tiny_run, tmp_path, monkeypatch):
    monkeypatch.setattr(q, "quantize_file", _zero_head(q.quantize_file))
    r = invoke("quantize", tiny_run, "--out", tmp_path / "new" / "int8")
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "more than --max-drop 1 top-1 points" in lines[0] and "nothing was written" in lines[0]
    # the scheme and the milder one tried (level 1 keeps both blocks of this 2-block model: nothing to try), figures
    assert "int8-static (level 0)" in lines[0] and "int8-dynamic (level 0)" in lines[0] and "agreement" in lines[0]
    assert list(tmp_path.iterdir()) == []  # not even the folder


def test_no_fallback_fails_at_once(tiny_run, tmp_path, monkeypatch):
    monkeypatch.setattr(q, "quantize_file", _zero_head(q.quantize_file))
    with pytest.raises(NascompressError, match=r"more than max_drop 0.5 .*int8-static \(level 0\)[^;]*; nothing"):
        quantize_run(tiny_run, out=tmp_path / "m.onnx", config=QuantizeConfig(max_drop=0.5, fallback=False))
    assert list(tmp_path.iterdir()) == []


def test_a_collapse_of_the_static_scheme_falls_back_to_dynamic_and_says_so(tiny_run, tmp_path, monkeypatch):
    real, broken = q.quantize_file, _zero_head(q.quantize_file)
    monkeypatch.setattr(
        q, "quantize_file", lambda src, dst, **kw: (broken if kw["scheme"] == "int8-static" else real)(src, dst, **kw)
    )
    side = quantize_run(tiny_run, out=tmp_path / "m.onnx", config=QuantizeConfig(calib_images=32))
    # the record returned is the file written: read back equal, its dict the file's JSON in its order
    on_disk = json.loads((tmp_path / "m.onnx.json").read_text())
    assert read_sidecar(tmp_path / "m.onnx") == side and side.to_dict() == on_disk
    assert list(side.to_dict()) == list(on_disk) and list(on_disk)[-3:] == [
        "fp32_verification",
        "verification",
        "quantization",
    ]
    qz = side.quantization
    assert qz.scheme == "int8-dynamic" and qz.get("level") == 0 and qz.get("requested") == "int8-static"
    assert "kept the milder int8-dynamic" in qz.fallback and qz.calibration is None
    assert AccuracyCheck.from_dict(side.verification, source="verification").to_dict() == side.verification
    assert [(a["scheme"], a["level"], a["check"]["passed"]) for a in qz.get("attempts")] == [
        ("int8-static", 0, False),
        ("int8-dynamic", 0, True),
    ]  # (level 1 would keep both blocks: skipped)
    assert "MatMulInteger" in _op_types(tmp_path / "m.onnx")


def test_precision_plan_keeps_the_first_and_last_blocks_at_the_milder_level(tiny_run, tmp_path):
    import onnx

    export_run(tiny_run, out=tmp_path / "f.onnx")
    m = onnx.load(str(tmp_path / "f.onnx"))
    q0, kept0 = q.plan_precision(m, 0)
    q1, kept1 = q.plan_precision(m, 1)  # 2 blocks: both are the first or the last
    assert len(q0) == 8 and q1 == []
    assert (
        sorted(k["why"] for k in kept1 if "block" in k["why"])
        == ["first block (milder level)"] * 4 + ["last block (milder level)"] * 4
    )
    assert {k["module"] for k in kept1 if "block" in k["why"]} >= {"blocks.0.attn.qkv", "blocks.1.mlp.fc2"}


def test_bad_settings_are_refused():
    with pytest.raises(NascompressError, match="quantize int8 starts from the fp32 ONNX file"):
        ExportConfig(format="torch-export", quantize="int8")
    with pytest.raises(NascompressError, match="quantize must be one of none, int8"):
        ExportConfig(quantize="int4")
    with pytest.raises(NascompressError, match="scheme must be one of int8-static, int8-dynamic"):
        QuantizeConfig(scheme="fp8")
    r = invoke("quantize", "nowhere", "--out", "x", "--max-drop", "-1")
    assert r.exit_code == 1 and "max_drop must be in [0, inf]" in r.stderr


def test_an_onnxruntime_whose_int8_kernels_refuse_the_graph_is_named(tiny_run, tmp_path, monkeypatch):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "__version__", "1.30.0")  # the GPU image's: QLinearMatMul refuses the graph
    with pytest.raises(
        NascompressError, match=r"onnxruntime 1.30.0 is older than 1.32.*pip install 'onnxruntime>=1.32'"
    ):
        quantize_run(tiny_run, out=tmp_path / "q.onnx")
    assert not (tmp_path / "q.onnx").exists()


def test_mgvit_is_refused(tmp_path):
    from .test_export import make_run

    run = make_run(tmp_path, ("mgvit",))
    with pytest.raises(NascompressError, match="MG-ViT is not quantized"):
        quantize_run(run, out=tmp_path / "m.onnx")


def test_the_pipeline_report_gets_int8_rows(tiny_run, quantized):
    from nascompress.data import DataConfig
    from nascompress.deploy.int8_rows import Int8Row, Int8Section, int8_rows
    from nascompress.pipeline.report_format import int8_table_rows
    from nascompress.pipeline.summary import Summary

    import torch

    _, out, side, _ = quantized
    threads = torch.get_num_threads()
    res = int8_rows(
        tiny_run, tiny_run, compressed_int8=out / FILE, data=DataConfig(dataset="synthetic"), iters=2, batch=8
    )
    assert torch.get_num_threads() == threads  # the one-thread pass gives the count back
    assert isinstance(res, Int8Section) and all(isinstance(r, Int8Row) for r in res.rows)
    for r in res.rows:  # each figure from the faster of the default-threads and the one-thread pass
        assert r.latency_threads in ("default", 1) and r.throughput_threads in ("default", 1)
    assert [r.model for r in res.rows] == ["dense fp32", "dense int8", "compressed fp32", "compressed int8"]
    assert res.get("split") == "test" and res.get("images") == 200
    assert (res.latency_batch, res.throughput_batch, res.get("iters")) == (1, 8, 2)
    # the JSON the summary writes: its keys in the order they were made (the file's key order)
    assert list(res.to_dict()) == ["split", "images", "latency_batch", "throughput_batch", "iters", "rows"]
    assert list(res.to_dict()["rows"][0]) == [
        *("model", "runtime", "test_top1", "test_n", "file_bytes"),
        *("latency_ms", "latency_threads", "throughput", "throughput_threads"),
    ]
    for r in res.rows:
        assert 0 <= r.test_top1 <= 100 and r.latency_ms > 0 and r.throughput > 0 and r.file_bytes > 0
    dense_fp32, dense_int8, _, comp_int8 = res.rows
    assert dense_int8.file_bytes == comp_int8.file_bytes == (out / FILE).stat().st_size  # same run, same file
    assert dense_fp32.test_top1 - dense_int8.test_top1 <= 5  # 200 images: a 1-pt val drop may differ on test
    assert Summary.new(int8=res).int8 == res
    text = [" | ".join(r) for r in int8_table_rows(Summary.new(int8=res))]
    assert text[1].startswith("dense int8 | onnxruntime") and "img/s" in text[1]
    # a model whose int8 file fails its check gets a row saying so
    failed = {"model": "dense int8", "runtime": "onnxruntime", "failed": "MG-ViT is not quantized"}
    rows = int8_table_rows(Summary.new(int8={"rows": [failed]}))
    assert rows == [("dense int8", "onnxruntime", "not kept: MG-ViT is not quantized", "-", "-", "-")]


@pytest.mark.parametrize("stack", [("dcs", "evit"), ("uniform", "sparsifiner", "dynamicvit")], ids="-".join)
def test_compressed_models_quantize_and_run(stack, tmp_path):
    """The longest method stacks (every method's exported ops) quantize statically and run in ORT."""
    import onnx

    from nascompress.deploy.verify import onnx_runner

    from .test_export import make_run

    run = make_run(tmp_path, stack)
    export_run(run, out=tmp_path / "f.onnx")
    nodes, kept = q.plan_precision(onnx.load(str(tmp_path / "f.onnx")), 0)
    assert len(nodes) >= 8 and any(k["why"] == "classifier head" for k in kept)  # 2 blocks x 4 linear layers at least
    g = torch.Generator().manual_seed(0)
    calib = [torch.randn(8, 1, 28, 28, generator=g).numpy() for _ in range(2)]
    q.quantize_file(tmp_path / "f.onnx", tmp_path / "q.onnx", scheme="int8-static", nodes=nodes, calib=calib)
    assert "QuantizeLinear" in _op_types(tmp_path / "q.onnx")
    x = torch.randn(4, 1, 28, 28, generator=g)
    ref, got = onnx_runner(tmp_path / "f.onnx")[0]([x])[0], onnx_runner(tmp_path / "q.onnx")[0]([x])[0]
    assert got.shape == ref.shape and bool(torch.isfinite(got).all())
    assert float((got - ref).abs().max()) < 0.25 * max(1.0, float(ref.abs().max())), (got, ref)


@pytest.mark.parametrize("tokens", ["static", "unknown"])
def test_each_quantized_linear_layer_runs_as_one_int8_gemm_with_its_bias(quantized, tmp_path, monkeypatch, tokens):
    """The static scheme turns each block linear (exported as MatMul + bias Add) into one Gemm, which
    ONNX Runtime runs as one QGemm with an fp32 output (no requantize/dequantize pair, no fp32 bias
    add); the rewrite alone leaves the fp32 function unchanged, whether the token count is known to
    shape inference (one Reshape to a constant shape) or not (the shape is read at run time)."""
    import onnx
    import onnxruntime as ort

    from nascompress.deploy.verify import onnx_runner

    run, out, side, _ = quantized
    export_run(run, out=tmp_path / "f.onnx")
    m = onnx.load(str(tmp_path / "f.onnx"))
    nodes, _ = q.plan_precision(m, 0)
    shapes_before = sum(n.op_type == "Shape" for n in m.graph.node)
    if tokens == "unknown":
        monkeypatch.setattr(onnx.shape_inference, "infer_shapes", lambda model: onnx.ModelProto())
    assert q.linears_as_gemm(m, nodes) == len(nodes) == 8
    added = sum(n.op_type == "Shape" for n in m.graph.node) - shapes_before
    assert added == (0 if tokens == "static" else 8)
    # known shapes: each MLP's GELU runs on the flattened tokens between its two Gemms (2 blocks)
    assert sum(n.op_type == "Flatten" for n in m.graph.node) == (6 if tokens == "static" else 8)
    onnx.save(m, str(tmp_path / "g.onnx"))
    shape = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim[1:]]
    x = torch.randn(5, *shape, generator=torch.Generator().manual_seed(0))
    ref, got = onnx_runner(tmp_path / "f.onnx")[0]([x])[0], onnx_runner(tmp_path / "g.onnx")[0]([x])[0]
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / "ort.onnx")
    ort.InferenceSession(str(out / FILE), so, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "ort.onnx")).graph.node]
    assert ops.count("QGemm") == side["quantization"]["quantized_nodes"] == 8
    assert ops.count("DequantizeLinear") == 0 and "MatMulIntegerToFloat" not in ops
