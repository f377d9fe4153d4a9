"""Bringing a user's own model: backbone-only checkpoints, hybrid ViTs, ``nascompress import``,
and ``train --linear-probe``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import nascompress
from nascompress.errors import NascompressError
from nascompress.models.build import ModelSpec, build_model, custom_vit_spec
from nascompress.models.weights import load_pretrained, load_state_strict

from .conftest import invoke, tiny_spec
from .test_data import make_folder

REPO_SPACES = Path(__file__).resolve().parents[1] / "nascompress" / "search_spaces"
TEST_VIT = ModelSpec("test_vit", {"img_size": 32, "num_classes": 10})  # timm's tiny registered ViT (patch 16)


def save_sd(path, sd):
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def one_line_error(r, pattern):
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    assert pattern in lines[0], lines[0]


@pytest.fixture(scope="module")
def vit_weights(tmp_path_factory):
    """A test_vit state dict (10 classes, 32 px) saved as a plain timm-format safetensors file."""
    torch.manual_seed(0)
    model = build_model(TEST_VIT)
    path = save_sd(tmp_path_factory.mktemp("w") / "test_vit.safetensors", model.state_dict())
    return path, model.eval()


# ---------------------------------------------------------------------------------------------
# backbone-only checkpoints, mismatch messages, hybrids, tags


def test_reset_head_loads_backbone_only_checkpoint(tmp_path):
    src = build_model(tiny_spec())
    backbone = {k: v for k, v in src.state_dict().items() if not k.startswith("head.")}
    f = save_sd(tmp_path / "backbone.safetensors", backbone)
    dst = build_model(tiny_spec(num_classes=3))
    head_before = dst.head.weight.clone()
    load_pretrained(dst, f, reset_head=True)
    torch.testing.assert_close(dst.blocks[1].attn.qkv.weight, src.blocks[1].attn.qkv.weight)
    assert torch.equal(dst.head.weight, head_before)
    with pytest.raises(NascompressError, match=r"tensor head\.weight \(3, 32\) is missing from the file.*reset_head"):
        load_pretrained(build_model(tiny_spec(num_classes=3)), f)
    # any other missing tensor is still an error that names it
    del backbone["blocks.0.norm1.weight"]
    save_sd(f, backbone)
    with pytest.raises(NascompressError, match=r"tensor blocks\.0\.norm1\.weight \(32,\) is missing"):
        load_pretrained(build_model(tiny_spec()), f, reset_head=True)


def test_mismatch_names_up_to_three_tensors():
    model = build_model(tiny_spec())
    other = build_model(
        custom_vit_spec(img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=2, num_classes=10, in_chans=1)
    )
    with pytest.raises(NascompressError) as e:
        load_state_strict(model, other.state_dict(), source="f")
    msg = str(e.value)
    assert msg.count("in the file but") == 3 and "cls_token has shape (1, 1, 64) in the file but (1, 1, 32)" in msg
    assert "more" in msg and "\n" not in msg


def test_hybrid_vits_are_refused(tmp_path):
    with pytest.raises(NascompressError, match="hybrid ViTs with a CNN stem are not supported: vit_base_r50_s16_224"):
        build_model(ModelSpec("vit_base_r50_s16_224", {"img_size": 32}))
    r = invoke("train", "--model", "vit_tiny_r_s16_p8_224", "--dataset", "synthetic", "--out", tmp_path / "x")
    one_line_error(r, "hybrid ViTs with a CNN stem are not supported")
    assert not (tmp_path / "x").exists()


def test_pretrained_tags():
    m = build_model(ModelSpec("vit_base_patch16_clip_224.openai", {"depth": 1, "img_size": 32, "num_classes": 2}))
    assert m.pretrained_cfg["tag"] == "openai"
    with pytest.raises(
        NascompressError, match="unknown pretrained tag 'nope' for vit_base_patch16_clip_224; known tags"
    ):
        build_model(ModelSpec("vit_base_patch16_clip_224.nope"))


# ---------------------------------------------------------------------------------------------
# nascompress import


def test_import_writes_a_run_that_loads_and_evaluates(tmp_path, vit_weights):
    path, src = vit_weights
    out = tmp_path / "imported"
    r = invoke(
        "import", "test_vit", "--weights", path, "--out", out, "--dataset", "synthetic", "--eval-limit", 40, "--json"
    )
    assert r.exit_code == 0, r.output
    metrics = json.loads(r.stdout)
    assert metrics["val_n"] == 40 and metrics["test_n"] == 40 and 0 <= metrics["test_top1"] <= 100
    assert metrics["best_val_top1"] == metrics["val_top1"]
    for f in ("model.safetensors", "arch.json", "config.json", "metrics.json"):
        assert (out / f).is_file(), f
    arch = json.loads((out / "arch.json").read_text())
    assert arch["model"] == {"name": "test_vit", "kwargs": {"num_classes": 10, "img_size": 32}}  # both from the file
    # preprocessing: test_vit's pretrained config (mean/std 0.5, bicubic, crop 0.95), size from the model
    assert arch["input"] == {
        "img_size": [32, 32],
        "in_chans": 3,
        "mean": [0.5] * 3,
        "std": [0.5] * 3,
        "interpolation": "bicubic",
        "crop_pct": 0.95,
        "crop_mode": "center",
    }
    src_info = arch["source"]
    assert src_info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert src_info["timm_name"] == "test_vit" and src_info["timm_version"] and src_info["imported_at"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["source"] == src_info and cfg["data"]["dataset"] == "synthetic" and cfg["import"]["weights"] == str(path)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(nascompress.load(out)(x), src(x), rtol=0, atol=0)
    r = invoke("evaluate", out, "--split", "val", "--json")  # the dataset comes from config.json
    assert r.exit_code == 0, r.output
    ev = json.loads(r.stdout)
    assert ev["dataset"] == "synthetic" and ev["top1"] == pytest.approx(metrics["val_top1"])


def test_import_img_size_and_overrides(tmp_path, vit_weights):
    path, _ = vit_weights
    out = tmp_path / "o"
    r = invoke(
        "import",
        "test_vit",
        "--weights",
        path,
        "--out",
        out,
        "--img-size",
        48,
        "--mean",
        "0.1,0.2,0.3",
        "--std",
        "0.4",
        "--interpolation",
        "bilinear",
        "--crop-pct",
        "0.875",
        "--json",
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {
        "imported": True,
        "dataset": None,
        "shapes_from_weights": {"img_size": [48, 32]},
    }  # asked for, and reported
    arch = json.loads((out / "arch.json").read_text())
    assert arch["model"]["kwargs"]["img_size"] == 48  # the position embedding is resampled to 3 x 3
    assert arch["input"]["mean"] == [0.1, 0.2, 0.3] and arch["input"]["std"] == [0.4] * 3
    assert (arch["input"]["interpolation"], arch["input"]["crop_pct"]) == ("bilinear", 0.875)
    assert nascompress.load(out)(torch.randn(1, 3, 48, 48)).shape == (1, 10)


def test_import_bad_inputs_write_nothing(tmp_path, vit_weights):
    path, src = vit_weights
    out = tmp_path / "out"

    def bad(pattern, *args, name="test_vit", weights=path):
        one_line_error(invoke("import", name, "--weights", weights, "--out", out, *args), pattern)
        assert not out.exists()

    bad("unknown model name 'vit_smal_patch16_224'; did you mean vit_small_patch16_224", name="vit_smal_patch16_224")
    bad("resnet18 is not a timm VisionTransformer", name="resnet18")
    bad("hybrid ViTs with a CNN stem are not supported", name="vit_small_r26_s32_224")
    bad("does not exist", weights=tmp_path / "missing.safetensors")
    # weights of another width: their real shapes, and what is missing to build them (the heads)
    r = invoke("import", "vit_tiny_patch16_224", "--weights", path, "--out", out)
    one_line_error(r, "is not vit_tiny_patch16_224's shape: patch kernel (64, 3, 16, 16)")
    assert "width 64, depth 6" in r.stderr and "give --num-heads (a divisor of 64)" in r.stderr
    assert not out.exists()
    # what the shapes read cannot match (another class-token layout): the first three mismatched tensors
    nocls = save_sd(tmp_path / "nocls.safetensors", {k: v for k, v in src.state_dict().items() if k != "cls_token"})
    r = invoke("import", "test_vit", "--weights", nocls, "--out", out)
    one_line_error(r, "does not fit test_vit")
    assert "tensor cls_token (1, 1, 64) is missing from the file" in r.stderr and "(the file: patch kernel" in r.stderr
    assert not out.exists()
    bad("--num-classes must match the file's head (10 classes)", "--num-classes", 4)
    headless = save_sd(
        tmp_path / "backbone.safetensors", {k: v for k, v in src.state_dict().items() if not k.startswith("head.")}
    )
    bad("train --model test_vit --weights", weights=headless)
    bad("--reset-head --linear-probe", "--num-classes", 10, weights=headless)
    make_folder(tmp_path / "folder", counts={"a": 2, "b": 2}, splits=("train", "val"))
    bad("the weights' head has 10 classes but dataset", "--dataset", tmp_path / "folder")
    out.mkdir()
    (out / "keep.txt").write_text("x")
    one_line_error(invoke("import", "test_vit", "--weights", path, "--out", out), "--force")
    assert (out / "keep.txt").read_text() == "x"
    # --force replaces only a nascompress output: a folder of the user's is refused and kept
    one_line_error(invoke("import", "test_vit", "--weights", path, "--out", out, "--force"), "not a nascompress output")
    assert (out / "keep.txt").read_text() == "x"
    (out / "keep.txt").unlink()
    assert invoke("import", "test_vit", "--weights", path, "--out", out).exit_code == 0
    r = invoke("import", "test_vit", "--weights", path, "--out", out, "--force")
    assert r.exit_code == 0, r.output
    assert (out / "model.safetensors").is_file()


def test_import_job_round_trips():
    from nascompress.data import DataConfig, InputOverrides
    from nascompress.importer.run import ImportJob

    job = ImportJob(
        model="test_vit",
        weights="w",
        out="o",
        img_size=32,
        data=DataConfig(dataset="synthetic"),
        input=InputOverrides(mean=(0.1, 0.2, 0.3)),
    )
    assert ImportJob.from_dict(json.loads(json.dumps(job.to_dict()))) == job
    with pytest.raises(NascompressError, match="img_size must be an integer in \\[1, inf\\]"):
        ImportJob(model="m", weights="w", out="o", img_size=0)


# ---------------------------------------------------------------------------------------------
# train --linear-probe


def test_fit_logistic_separates_and_l2_shrinks():
    from nascompress.train.probe import fit_logistic

    g = torch.Generator().manual_seed(0)
    centers = torch.randn(3, 8, generator=g) * 3
    y = torch.arange(300) % 3
    x = centers[y] + torch.randn(300, 8, generator=g)
    w, b = fit_logistic(x, y, num_classes=3, l2=1e-4)
    assert ((x @ w.T + b).argmax(-1) == y).float().mean() > 0.95
    w_strong, _ = fit_logistic(x, y, num_classes=3, l2=1.0)
    assert w_strong.norm() < w.norm()


def test_linear_probe_fits_only_the_head(tmp_path, vit_weights):
    _, src = vit_weights
    backbone = {k: v for k, v in src.state_dict().items() if not k.startswith("head.")}
    w = save_sd(tmp_path / "backbone.safetensors", backbone)  # as DINOv2/MAE/CLIP ship: no head
    out = tmp_path / "probe"
    r = invoke(
        "train",
        "--model",
        "test_vit",
        "--img-size",
        32,
        "--weights",
        w,
        "--reset-head",
        "--linear-probe",
        "--dataset",
        "synthetic",
        "--train-limit",
        300,
        "--out",
        out,
        "--json",
    )
    assert r.exit_code == 0, r.output
    m = json.loads(r.stdout)
    assert m["linear_probe"] and m["n_train"] == 300 and m["n_val"] == 60 and m["test_n"] == 200
    assert m["l2"] in [row["l2"] for row in m["l2_grid"]] and len(m["l2_grid"]) == 6
    assert max(row["val_top1"] for row in m["l2_grid"]) == pytest.approx(
        next(row["val_top1"] for row in m["l2_grid"] if row["l2"] == m["l2"])
    )
    assert m["feature_time_s"] > 0 and m["fit_time_s"] > 0 and m["feature_dim"] == 64
    assert m["test_top1"] > 50  # random features of the synthetic patterns are still linearly separable
    model = nascompress.load(out)
    for k, v in backbone.items():  # the backbone is untouched
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)
    assert not torch.equal(model.head.weight, src.head.weight)
    assert json.loads((out / "config.json").read_text())["linear_probe"] is True
    r = invoke("evaluate", out, "--split", "val", "--json")  # the saved head is what was measured
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["top1"] == pytest.approx(m["best_val_top1"], abs=2.0)
    one_line_error(
        invoke("train", "--model", "test_vit", "--linear-probe", "--dataset", "synthetic", "--out", tmp_path / "x"),
        "--linear-probe needs --weights",
    )


# ---------------------------------------------------------------------------------------------
# every shape read from the weights: patch size, grid, depth, width, heads


def _saved_vit(tmp_path, name, **kwargs):
    torch.manual_seed(0)
    model = build_model(ModelSpec("vit_tiny_patch16_224", {"num_classes": 10, **kwargs})).eval()
    return save_sd(tmp_path / f"{name}.safetensors", model.state_dict()), model


def test_import_matches_the_weights_patch_size_and_grid_instead_of_resampling(tmp_path):
    """Patch-4, 32 px weights named vit_tiny_patch16_224: the model built is theirs (patch 4, 32 px),
    said on stdout and in metrics.json, and gives the source model's outputs exactly (no resampled
    kernel, no 128 px input)."""
    path, src = _saved_vit(tmp_path, "p4", patch_size=4, img_size=32, depth=2)
    out = tmp_path / "run"
    r = invoke("import", "vit_tiny_patch16_224", "--weights", path, "--out", out)
    assert r.exit_code == 0, r.output
    assert "shapes read from the weights (not vit_tiny_patch16_224's): patch_size 4 (name: 16)" in r.stdout
    assert "img_size 32 (name: 224)" in r.stdout
    arch = json.loads((out / "arch.json").read_text())
    assert arch["model"]["kwargs"]["patch_size"] == 4 and arch["model"]["kwargs"]["img_size"] == 32
    assert arch["input"]["img_size"] == [32, 32]
    notes = json.loads((out / "metrics.json").read_text())["shapes_from_weights"]
    assert notes["patch_size"] == [4, 16] and notes["img_size"] == [32, 224] and notes["depth"] == [2, 12]
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(nascompress.load(out)(x), src(x), rtol=0, atol=0)


def test_import_reads_depth_and_width_and_needs_the_heads_of_a_fused_qkv(tmp_path):
    path, src = _saved_vit(
        tmp_path, "own", patch_size=8, img_size=32, embed_dim=96, depth=3, num_heads=4, mlp_ratio=2.0
    )
    out = tmp_path / "run"
    r = invoke("import", "vit_tiny_patch16_224", "--weights", path, "--out", out)
    one_line_error(r, "patch kernel (96, 3, 8, 8) (patch 8x8, 3 channels), width 96, depth 3, MLP 192")
    assert "the number of heads cannot be read from a fused qkv: give --num-heads" in r.stderr and not out.exists()
    one_line_error(
        invoke("import", "vit_tiny_patch16_224", "--weights", path, "--out", out, "--num-heads", 5),
        "--num-heads 5 does not divide the weights' width 96",
    )
    r = invoke("import", "vit_tiny_patch16_224", "--weights", path, "--out", out, "--num-heads", 4, "--json")
    assert r.exit_code == 0, r.output
    kw = json.loads((out / "arch.json").read_text())["model"]["kwargs"]
    assert (kw["embed_dim"], kw["depth"], kw["num_heads"], kw["mlp_ratio"], kw["patch_size"]) == (96, 3, 4, 2.0, 8)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(nascompress.load(out)(x), src(x), rtol=0, atol=0)


def test_import_reads_the_heads_from_a_q_norm(tmp_path):
    path, src = _saved_vit(tmp_path, "qn", patch_size=8, img_size=16, embed_dim=64, depth=1, num_heads=4, qk_norm=True)
    out = tmp_path / "run"
    r = invoke("import", "vit_tiny_patch16_224", "--weights", path, "--out", out, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["shapes_from_weights"]["num_heads"] == [4, 3]
    x = torch.randn(1, 3, 16, 16)
    torch.testing.assert_close(nascompress.load(out)(x), src(x), rtol=0, atol=0)


def test_the_pipelines_import_builds_the_weights_model_and_sizes_the_default_space_by_it(tmp_path):
    """``base.import`` plans the model the weights describe (depth 3 here, not the name's 12), so the
    default evit space is sized by those 3 blocks; a fused qkv of another width needs ``num_heads``."""
    import yaml

    from nascompress.pipeline import plan

    path, _ = _saved_vit(tmp_path, "own", patch_size=4, img_size=16, embed_dim=96, depth=3, num_heads=4, in_chans=1)
    cfg = {
        "format": "nascompress-pipeline/1",
        "device": "cpu",
        "data": {"dataset": "synthetic"},
        "base": {"import": {"model": "vit_tiny_patch16_224", "weights": str(path), "num_heads": 4}},
        "goal": {"max_flops": 0.8},
        "stages": {"tokens": {"space": "evit", "trials": 2}},
    }
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    p = plan(tmp_path / "p.yaml", out=tmp_path / "out")
    assert [s.name for s in p.steps][:3] == ["base", "tokens_search", "tokens_pick"]
    assert not (tmp_path / "out").exists()
    # the planned model has the weights' 3 blocks: a space written for 6 is checked against them
    (tmp_path / "six.yaml").write_text((REPO_SPACES / "evit.yaml").read_text().replace("[2, -2]", "[2, 5]"))
    cfg["stages"]["tokens"]["space"] = str(tmp_path / "six.yaml")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(NascompressError, match="layer 4 is beyond the model's depth 3"):
        plan(tmp_path / "p.yaml", out=tmp_path / "out")
    del cfg["base"]["import"]["num_heads"]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(
        NascompressError,
        match=r"base.import.weights: weights file .* is not vit_tiny_patch16_224's "
        r"shape: patch kernel \(96, 1, 4, 4\)",
    ):
        plan(tmp_path / "p.yaml", out=tmp_path / "out")


def test_train_weights_never_resample_the_patch_kernel_and_say_when_the_grid_is(tmp_path, capsys, monkeypatch):
    """``train --weights`` (load_pretrained): a patch kernel of another size is refused naming the file's
    (timm's filter would resample it into another function); a position grid of another size is
    resampled and said on stderr."""
    from safetensors.torch import save_file

    from nascompress.errors import NascompressError
    from nascompress.models.build import build_model, custom_vit_spec
    from nascompress.models.weights import load_pretrained

    spec = dict(embed_dim=32, depth=2, num_heads=2, num_classes=10, in_chans=1)
    src = build_model(custom_vit_spec(img_size=16, patch_size=4, **spec))
    w = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(w))
    with pytest.raises(NascompressError, match=r"has 4x4 patches .* but the model has 2x2; build it with patch_size 4"):
        load_pretrained(build_model(custom_vit_spec(img_size=16, patch_size=2, **spec)), w)
    load_pretrained(build_model(custom_vit_spec(img_size=16, patch_size=4, **spec)), w)
    assert "resampled" not in capsys.readouterr().err  # the same grid: nothing to say
    monkeypatch.setenv("NASCOMPRESS_PROGRESS", "plain")  # the tests turn the progress lines off
    load_pretrained(build_model(custom_vit_spec(img_size=32, patch_size=4, **spec)), w)
    assert "position embedding of" in capsys.readouterr().err
