"""Where nascompress meets the tools around it (issue 36): output that shows up when piped, class names
and preprocessing in every output, paths that survive a change of directory, a resume that does not
ignore changed settings, finetune on any dataset, typed method options, missing extras named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import invoke

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "--dataset",
    "synthetic",
    "--img-size",
    "16",
    "--patch-size",
    "4",
    "--embed-dim",
    "32",
    "--depth",
    "2",
    "--num-heads",
    "2",
    "--batch-size",
    "32",
    "--train-limit",
    "96",
    "--eval-limit",
    "40",
]


def _cli(*args, cwd=None, env=None):
    """The CLI in a subprocess, stdout and stderr piped (not a terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "nascompress.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})),
        timeout=300,
    )


def test_a_piped_run_prints_plain_progress_lines(tmp_path):
    env = {"NASCOMPRESS_PROGRESS": "auto", "NASCOMPRESS_PROGRESS_SECONDS": "0"}
    r = _cli("train", *TINY, "--epochs", "2", "--out", tmp_path / "run", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    steps = [ln for ln in lines if ln.startswith("epoch 1:")]
    assert len(steps) == 3 and steps[0].startswith("epoch 1:  1/3 (33%)") and "ETA" in steps[0], lines
    epochs = [ln for ln in lines if ln.startswith("epochs:")]
    assert len(epochs) == 2 and "1/2 (50%)" in epochs[0] and "val " in epochs[0] and "ETA" in epochs[0], lines
    assert not any("\x1b" in ln for ln in lines)  # no terminal control codes


def test_finetune_method_options_are_typed(tmp_path, tiny_run):
    from nascompress.cli.finetune import method_option_form

    # each form the help shows
    assert method_option_form("evit", "prune_layers")[0] == "INT[,...]"
    assert method_option_form("evit", "prune_layers")[1]("2") == (2,)
    assert method_option_form("evit", "prune_layers")[1]("4, 7,10") == (4, 7, 10)
    assert method_option_form("evit", "keep_rate")[1]("0.5") == 0.5
    assert method_option_form("evit", "keep_rate")[1]("0.9,0.7") == (0.9, 0.7)
    assert method_option_form("sparsifiner", "attn_keep_ratio")[1]("1") == 1.0
    r = invoke("finetune", tiny_run, "--method", "evit", "--prune-layers", "x,2", "--out", tmp_path / "bad")
    assert (
        r.exit_code == 1
        and "--prune-layers takes comma-separated integers" in r.output
        and not (tmp_path / "bad").exists()
    )
    r = invoke(
        "finetune", tiny_run, "--method", "sparsifiner", "--attn-keep-ratio", "0.2,0.3", "--out", tmp_path / "bad"
    )
    assert r.exit_code == 1 and "--attn-keep-ratio takes one number" in r.output and not (tmp_path / "bad").exists()


def test_finetune_dataset_on_an_imported_run_and_prune_layers_2(tmp_path):
    # the path: 'import MODEL --weights W' without a dataset, then finetune on the user's folder
    import timm
    from safetensors.torch import save_file

    imp = tmp_path / "imported"
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=3)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "w.safetensors"))
    assert (
        invoke("import", "vit_tiny_patch16_224", "--weights", tmp_path / "w.safetensors", "--out", imp).exit_code == 0
    )
    r = invoke("finetune", imp, "--method", "evit", "--out", tmp_path / "ft0")
    assert r.exit_code == 1 and "records no dataset" in r.output and "--dataset" in r.output, r.output
    data = _image_folder(tmp_path / "imf")
    r = invoke(
        "finetune",
        imp,
        "--method",
        "evit",
        "--dataset",
        data,
        "--prune-layers",
        "2",
        "--keep-rate",
        "0.5",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--out",
        tmp_path / "ft",
        "--json",
    )
    assert r.exit_code == 0, r.output
    out_arch = json.loads((tmp_path / "ft" / "arch.json").read_text())
    assert out_arch["methods"][-1]["config"]["prune_layers"] == [2] and out_arch["labels"] == ["cat", "dog", "eel"]
    assert json.loads((tmp_path / "ft" / "config.json").read_text())["data"]["dataset"] == str(data)


def test_resume_with_changed_settings_is_refused_naming_them(tmp_path):
    from nascompress.train.hooks import TrainHooks

    from .conftest import interrupted_at_epoch

    out = tmp_path / "run"
    args = ["train", *TINY, "--epochs", "3", "--out", out]
    with interrupted_at_epoch(TrainHooks):
        assert invoke(*args).exit_code == 130
    r = invoke("train", *TINY, "--epochs", "2", "--lr", "0.01", "--out", out, "--resume")
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert "train.epochs 2 (recorded 3); train.lr 0.01 (recorded" in r.output and "leave them out" in r.output
    assert not (out / "metrics.json").exists()
    r = invoke(*args, "--resume", "--json")  # the same options: continued
    assert r.exit_code == 0 and json.loads(r.stdout)["epochs"] == 3, r.output


def _image_folder(root: Path, classes=("cat", "dog", "eel"), n=6) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val", "test"):
        for i, c in enumerate(classes):
            (root / split / c).mkdir(parents=True)
            for k in range(n):
                img = rng.integers(0, 60, (20, 24, 3), dtype=np.uint8) + np.uint8(90 * i)
                Image.fromarray(img).save(root / split / c / f"{k}.png")
    return root


def test_a_run_is_evaluated_from_another_directory_and_moved_data_is_named(tmp_path, monkeypatch):
    _image_folder(tmp_path / "work" / "imf")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    r = invoke(
        "train",
        "--dataset",
        "imf",
        "--num-workers",
        "0",
        "--img-size",
        "16",
        "--patch-size",
        "8",
        "--embed-dim",
        "16",
        "--depth",
        "1",
        "--num-heads",
        "2",
        "--in-chans",
        "3",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--out",
        "run",
    )
    assert r.exit_code == 0, r.output
    recorded = json.loads((tmp_path / "work" / "run" / "config.json").read_text())["data"]["dataset"]
    assert recorded == str(tmp_path / "work" / "imf")
    monkeypatch.chdir(tmp_path / "elsewhere")
    r = invoke("evaluate", tmp_path / "work" / "run", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["n"] == 18, r.output
    (tmp_path / "work" / "imf").rename(tmp_path / "work" / "moved")
    r = invoke("evaluate", tmp_path / "work" / "run")
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert f"dataset {tmp_path / 'work' / 'imf'} does not exist" in r.output and "--dataset" in r.output
    r = invoke("evaluate", tmp_path / "work" / "run", "--dataset", tmp_path / "work" / "moved", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["n"] == 18, r.output


def test_export_without_the_export_extra_names_it(tmp_path, tiny_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as if not installed
    r = invoke("export", tiny_run, "--out", tmp_path / "m.onnx")
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert "needs onnxscript" in r.output and "pip install 'nascompress[export]'" in r.output
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """A tiny run trained on a 3-class ImageFolder (cat, dog, eel), bicubic, crop 0.875, 3 channels."""
    root = tmp_path_factory.mktemp("folder")
    _image_folder(root / "imf")
    r = invoke(
        "train",
        "--dataset",
        root / "imf",
        "--num-workers",
        "0",
        "--img-size",
        "16",
        "--patch-size",
        "8",
        "--embed-dim",
        "16",
        "--depth",
        "1",
        "--num-heads",
        "2",
        "--in-chans",
        "3",
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--interpolation",
        "bicubic",
        "--crop-pct",
        "0.875",
        "--mean",
        "0.4,0.5,0.6",
        "--std",
        "0.2,0.25,0.3",
        "--out",
        root / "run",
    )
    assert r.exit_code == 0, r.output
    return root / "run"


def test_class_names_in_arch_loaded_model_and_export_sidecar(folder_run, tmp_path):
    import nascompress

    names = ["cat", "dog", "eel"]
    assert json.loads((folder_run / "arch.json").read_text())["labels"] == names
    assert nascompress.load(folder_run).pretrained_cfg["label_names"] == names
    r = invoke("finetune", folder_run, "--method", "evit", "--zero-shot", "--out", tmp_path / "evit", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "evit" / "arch.json").read_text())["labels"] == names
    r = invoke("export", tmp_path / "evit", "--out", tmp_path / "m.onnx", "--json")
    assert r.exit_code == 0, r.output
    side = json.loads((tmp_path / "m.onnx.json").read_text())
    assert side["id2label"] == {"0": "cat", "1": "dog", "2": "eel"}


def test_timm_resolve_data_config_on_a_loaded_model_gives_the_recorded_transform(folder_run):
    import timm.data
    import torch

    import nascompress
    from nascompress.data import InputSpec, folder_transform, preprocess

    model = nascompress.load(folder_run)
    rec = json.loads((folder_run / "arch.json").read_text())["input"]
    cfg = timm.data.resolve_data_config(model=model)
    assert cfg == {
        "input_size": (3, 16, 16),
        "interpolation": "bicubic",
        "mean": (0.4, 0.5, 0.6),
        "std": (0.2, 0.25, 0.3),
        "crop_pct": 0.875,
        "crop_mode": "center",
    }
    assert [cfg["input_size"][0], *cfg["input_size"][1:]] == [rec["in_chans"], *rec["img_size"]]
    from PIL import Image

    img = Image.fromarray((torch.rand(23, 37, 3) * 255).to(torch.uint8).numpy())
    spec = InputSpec.from_dict(rec)
    ours = preprocess(folder_transform(spec, train=False)(img)[None], spec)
    timms = timm.data.create_transform(**cfg)(img)[None]  # the way timm users build their transform
    torch.testing.assert_close(timms, ours, atol=1e-5, rtol=0)


def test_sidecar_steps_reproduce_the_eval_transform_in_plain_pil_and_numpy(folder_run, tmp_path):
    """A user with only PIL and numpy follows the sidecar's steps and gets the model's input."""
    import numpy as np
    import torch
    from PIL import Image

    from nascompress.data import InputSpec, eval_steps, folder_transform, preprocess

    rec = json.loads((folder_run / "arch.json").read_text())["input"]
    spec = InputSpec.from_dict(rec)
    steps = eval_steps(spec)
    filters = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "nearest": Image.NEAREST}
    for shape in ((23, 37, 3), (41, 19, 3)):
        img = Image.fromarray((np.random.default_rng(1).random(shape) * 255).astype(np.uint8))
        x: object = img
        for s in steps:  # the sidecar's steps, written out as a user would
            if s["op"] == "decode":
                x = x.convert(s["mode"])
            elif s["op"] == "resize":
                w, h = x.size
                short = s["shorter_side"]
                size = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
                x = x.resize(size, filters[s["interpolation"]])
            elif s["op"] == "center_crop":
                ch, cw = s["size"]
                w, h = x.size
                top, left = int(round((h - ch) / 2)), int(round((w - cw) / 2))
                x = x.crop((left, top, left + cw, top + ch))
            elif s["op"] == "scale":
                x = np.asarray(x, dtype=np.float32) * np.float32(s["factor"])
            elif s["op"] == "normalize":
                x = (x - np.float32(s["mean"])) / np.float32(s["std"])
            elif s["op"] == "layout":
                x = x.transpose(2, 0, 1)[None]
            else:
                raise AssertionError(f"unexpected step {s}")
        ours = preprocess(folder_transform(spec, train=False)(img)[None], spec)
        torch.testing.assert_close(torch.from_numpy(np.ascontiguousarray(x)), ours, atol=1e-5, rtol=0)
    r = invoke("export", folder_run, "--out", tmp_path / "d.onnx", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "d.onnx.json").read_text())["input"]["steps"] == json.loads(json.dumps(steps))


def test_search_dcs_shows_its_preparation_when_piped(tmp_path, tiny_run, monkeypatch):
    monkeypatch.setenv("NASCOMPRESS_PROGRESS", "plain")
    r = invoke(
        "search",
        "dcs",
        tiny_run,
        "--out",
        tmp_path / "s",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--train-limit",
        "64",
        "--eval-limit",
        "40",
        "--device",
        "cpu",
        "--align",
        "1",
    )
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    first = [i for i, ln in enumerate(lines) if ln.startswith("DCS: measuring the dense model")]
    assert len(first) == 2 and lines[first[0]].endswith("...") and " done in " in lines[first[1]], lines
    assert any(ln.startswith("epochs:  1/1 (100%)") for ln in lines), lines


def test_search_dcs_on_an_image_folder_reads_it_unaugmented_and_caches_the_teacher(folder_run, tmp_path):
    """The search reads an ImageFolder's training images without their training transform (as the in-memory
    datasets), so the dense teacher's outputs are computed once per image and read back every step; the
    candidates' recovery runs in the search's precision."""
    r = invoke(
        "search",
        "dcs",
        folder_run,
        "--target-flops",
        "0.8",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--max-val-drop",
        "100",
        "--amp",
        "bf16",
        "--out",
        tmp_path / "s",
        "--json",
    )
    assert r.exit_code == 0, r.output
    metrics = json.loads((tmp_path / "s" / "metrics.json").read_text())
    assert metrics["teacher_cached"] is True
    assert metrics["comparison"]["recovery"]["amp"] == "bf16"  # the baseline's recovery in the search's precision
