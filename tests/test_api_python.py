"""The Python API (``import nascompress as nc``): the same weights as the commands for the same data
and seed, model objects and a caller's Dataset/DataLoader at every stage, nothing written without
``out=``, Hugging Face ViTs in and out, one-line errors, the README's example and docs/api.md."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

import nascompress as nc
from nascompress.errors import NascompressError
from tests.conftest import invoke

REPO = Path(__file__).resolve().parents[1]
DCS = ("--epochs", 1, "--batch-size", 32, "--arch-lr", 0.05, "--mlp-gates", "residual", "--device", "cpu")


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.fixture
def no_tmp_left(tmp_path, monkeypatch):
    """The API's temporary directories go to tmp_path/tmp; the test checks it is empty afterwards."""
    t = tmp_path / "tmp"
    t.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(t))
    return t


def tensor_data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """Learnable float images, preprocessed by the caller (the synthetic dataset's, normalised here)."""
    from nascompress.data import synthetic_dataset

    ds = synthetic_dataset(n, seed=seed)
    return torch.utils.data.TensorDataset((ds.images.float() / 255 - 0.5) / 0.5, ds.labels)


def test_stages_give_the_command_chains_weights(tiny_run, tmp_path, no_tmp_left):
    """search dcs -> materialize -> retrain --teacher: the commands and the functions on model objects."""
    assert (
        invoke(
            "search", "dcs", tiny_run, "--out", tmp_path / "s", "--target-flops", 0.7, "--dataset", "synthetic", *DCS
        ).exit_code
        == 0
    )
    assert invoke("materialize", tmp_path / "s", "--out", tmp_path / "m").exit_code == 0
    r = invoke(
        "retrain",
        tmp_path / "m",
        "--out",
        tmp_path / "r",
        "--dataset",
        "synthetic",
        "--epochs",
        1,
        "--batch-size",
        32,
        "--teacher",
        tiny_run,
        "--device",
        "cpu",
    )
    assert r.exit_code == 0, r.output
    dense = nc.load(tiny_run)
    search = nc.dcs.search(
        dense, "synthetic", target_flops=0.7, epochs=1, batch_size=32, arch_lr=0.05, mlp_gates="residual", device="cpu"
    )
    same_weights(search.model, nc.load(tmp_path / "s"))
    mat = nc.materialize(search)
    same_weights(mat.model, nc.load(tmp_path / "m"))
    assert mat.metrics.macs < search.metrics.dense_macs and mat.out is None
    ret = nc.retrain(mat, "synthetic", teacher=dense, epochs=1, batch_size=32, device="cpu")
    same_weights(ret.model, nc.load(tmp_path / "r"))
    assert ret.metrics.test_top1 > 0 and type(ret).__name__ == "Retrained"
    assert inspect.isfunction(nc.retrain)  # the API function, not a module
    assert not any(no_tmp_left.iterdir())  # nothing left behind


def test_compress_gives_the_pipeline_commands_weights(tiny_run, tmp_path, no_tmp_left):
    stages = {"dcs": {"epochs": 1, "batch_size": 32, "arch_lr": 0.05}, "retrain": {"batch_size": 32}}
    small = nc.compress(
        nc.load(tiny_run),
        "synthetic",
        target_flops=0.7,
        methods=("dcs",),
        epochs=1,
        device="cpu",
        latency=False,
        progress=False,
        dcs=stages["dcs"],
        retrain=stages["retrain"],
    )
    assert not any(no_tmp_left.iterdir()) and small.out is None
    cfg = {
        "format": "nascompress-pipeline/1",
        "seed": 0,
        "device": "cpu",
        "data": {"dataset": "synthetic"},
        "base": {"run": str(tiny_run)},
        "goal": {"max_flops": 0.7},
        "stages": {
            "dcs": {"target_flops": 0.7, "at_most": True, **stages["dcs"]},  # nc.compress: the target is a bound
            "retrain": {"epochs": 1, **stages["retrain"]},
        },
        "report": {"latency": False, "iters": 5},
    }
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    res = invoke("pipeline", tmp_path / "p.yaml", "--out", tmp_path / "p")
    assert res.exit_code == 0, res.output
    same_weights(small.model, nc.load(tmp_path / "p" / "final"))
    rep = small.report
    assert rep.flops_ratio <= 0.7 + 1e-3 and rep.goal_met and rep.params < rep.dense_params
    assert rep.accuracy is not None and rep.dense_accuracy is not None and rep.flops < rep.dense_flops
    assert rep.summary.comparison.flops_ratio == rep.flops_ratio and rep.summary.final.test_top1 == rep.accuracy
    small.save(tmp_path / "saved")
    same_weights(nc.load(tmp_path / "saved"), small.model)


def test_compress_on_a_tensor_dataset_records_the_callers_preprocessing(tiny_run, tmp_path):
    model = nc.load(tiny_run)
    kept = tmp_path / "kept"
    small = nc.compress(
        model,
        tensor_data(600, 0),
        val=tensor_data(200, 1),
        target_flops=0.7,
        methods=("dcs",),
        epochs=1,
        device="cpu",
        latency=False,
        progress=False,
        out=kept,
        dcs={"epochs": 1, "batch_size": 32},
        retrain={"batch_size": 32},
    )
    assert small.arch.input["mean"] == [0.0] and small.arch.input["std"] == [1.0]
    assert small.report.test_images == 100 and small.report.accuracy > 10  # half of val: the test
    assert (kept / "pipeline" / "summary.json").is_file() and small.out == str(kept / "pipeline")
    again = nc.compress(
        model,
        tensor_data(600, 0),
        val=tensor_data(200, 1),
        target_flops=0.7,
        methods=("dcs",),
        epochs=1,
        device="cpu",
        latency=False,
        progress=False,
        out=kept,
        dcs={"epochs": 1, "batch_size": 32},
        retrain={"batch_size": 32},
    )  # continued: all done
    same_weights(again.model, small.model)


def test_every_stage_takes_a_model_object_and_a_dataloader(tmp_path, no_tmp_left):
    from nascompress.models.build import build_model, custom_vit_spec

    torch.manual_seed(0)
    model = build_model(
        custom_vit_spec(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10, in_chans=1)
    )
    loader = torch.utils.data.DataLoader(tensor_data(600, 0), batch_size=32, shuffle=True)
    search = nc.dcs.search(model, loader, target_flops=0.7, epochs=1, device="cpu", mlp_gates="residual")
    assert search.config.get("train")["batch_size"] == 32  # the loader's
    mat = nc.materialize(search)
    ret = nc.retrain(mat.model, loader, epochs=1, device="cpu")
    tok = nc.tokens.apply(model, "evit", loader, keep_rate=0.7, device="cpu")
    assert tok.metrics.zero_shot and tok.metrics.flops_ratio < 1
    free = nc.tokens.apply(ret.model, "evit", keep_rate=0.7)  # training-free: no data
    assert free.arch.method_names == ("dcs", "evit") and free.metrics.to_dict() == {} and free.config is None
    x = torch.randn(2, 1, 16, 16)
    exported = nc.export.onnx(free.model, tmp_path / "m.onnx")
    assert exported.sidecar["verification"]["max_abs_diff"] < 1e-3 and (tmp_path / "m.onnx").is_file()
    q = nc.quantize(ret, tmp_path / "q.onnx", loader, max_drop=100)
    assert Path(q.path).is_file() and "int8_top1" in q.sidecar["verification"]
    assert free.model(x).shape == (2, 10)
    assert not any(no_tmp_left.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.json", "q.onnx", "q.onnx.json", "tmp"]


def test_study_and_its_pick(tiny_run, tmp_path, no_tmp_left):
    model = nc.load(tiny_run)
    loader = torch.utils.data.DataLoader(tensor_data(600, 0), batch_size=32)
    res = nc.study(
        model,
        loader,
        space="tome",
        trials=2,
        max_flops=0.8,
        device="cpu",
        progress=False,
        eval_images=100,
        train_images=100,
    )
    assert res.summary.complete == 2 and res.out is None
    assert res.picked.metrics.flops_ratio <= 0.8 and res.picked.arch.method_names[-1] == "tome"
    assert res.picked.metrics.rebuilt_accuracy == res.picked.metrics.trial_accuracy
    assert not any(no_tmp_left.iterdir())


def test_errors_are_the_commands_one_line_errors(tiny_run):
    model = nc.load(tiny_run)
    with pytest.raises(NascompressError, match="has no setting 'bogus'"):
        nc.dcs.search(model, "synthetic", bogus=1)
    with pytest.raises(NascompressError, match="methods must be"):
        nc.compress(model, "synthetic", methods=("magic",))
    with pytest.raises(NascompressError, match="must be in"):
        nc.tokens.apply(model, "evit", keep_rate=1.5)
    with pytest.raises(NascompressError, match="map-style torch Dataset"):
        nc.dcs.search(model, object())
    with pytest.raises(NascompressError, match="timm VisionTransformer"):
        nc.dcs.search(torch.nn.Linear(2, 2), "synthetic")


def test_save_never_overwrites_without_force(tiny_run, tmp_path):
    evit = nc.tokens.apply(nc.load(tiny_run), "evit", keep_rate=0.7)
    evit.save(tmp_path / "m")
    assert evit.save(tmp_path / "m") == tmp_path / "m"  # the same model again: returned as it is
    with pytest.raises(NascompressError, match="already exists"):
        nc.tokens.apply(nc.load(tiny_run), "evit", keep_rate=0.5).save(tmp_path / "m")  # another model
    assert nc.load(evit.save(tmp_path / "m", force=True)) is not None and (tmp_path / "m" / "metrics.json").is_file()


def test_hugging_face_vit_round_trip(tmp_path, tiny_run):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    hf = ViTForImageClassification(
        ViTConfig(
            image_size=16,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=5,
        )
    ).eval()
    x = torch.rand(4, 3, 16, 16) * 2 - 1
    model = nc.from_transformers(hf)
    with torch.no_grad():
        assert (model(x) - hf(pixel_values=x).logits).abs().max() < 1e-5
    nc.to_transformers(model, tmp_path / "hf")
    back = ViTForImageClassification.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    with torch.no_grad():
        assert (back(pixel_values=x).logits - hf(pixel_values=x).logits).abs().max() < 1e-5
        assert (nc.from_transformers(tmp_path / "hf")(x) - model(x)).abs().max() < 1e-5
    mat = nc.materialize(
        nc.dcs.search(
            nc.load(tiny_run),
            "synthetic",
            target_flops=0.7,
            epochs=1,
            batch_size=32,
            mlp_gates="residual",
            device="cpu",
        )
    )
    with pytest.raises(NascompressError, match="cannot write this model as a transformers ViT: .*ViTConfig"):
        nc.to_transformers(mat.model, tmp_path / "no")


def test_a_dinov2_backbone_comes_in_with_its_pooled_output(tmp_path):
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    hf = Dinov2Model(
        Dinov2Config(
            image_size=16,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            mlp_ratio=2,
            layerscale_value=0.5,
        )
    ).eval()
    x = torch.randn(4, 3, 16, 16)
    model = nc.from_transformers(hf)
    with torch.no_grad():
        assert (model(x) - hf(pixel_values=x).pooler_output).abs().max() < 1e-5
    hf.save_pretrained(str(tmp_path / "d"))
    with torch.no_grad():
        assert (nc.from_transformers(tmp_path / "d")(x) - model(x)).abs().max() < 1e-5
    model.reset_classifier(10)  # a head for the data: the API takes the model with its new head
    from nascompress.pyapi.common import model_and_arch

    assert model_and_arch(model)[1].spec.kwargs["num_classes"] == 10


def test_the_readmes_python_example_runs(tmp_path):
    text = (REPO / "README.md").read_text()
    section = text.split("## From Python", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "example.py").write_text(code)
    env = {
        "PYTHONPATH": str(REPO),
        "NASCOMPRESS_PROGRESS": "off",
        "OMP_NUM_THREADS": "1",
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
    }
    r = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "x the FLOPs" in r.stdout and (tmp_path / "runs" / "small" / "model.safetensors").is_file()
    small, dense = map(float, re.search(r"top-1 ([\d.]+)% \(dense ([\d.]+)%\)", r.stdout).groups())
    assert dense > 70 and small > dense - 10  # a trained model, compressed without falling apart


def test_the_api_reference_is_up_to_date():
    r = subprocess.run(
        [sys.executable, str(REPO / "tools" / "api_reference.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
