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
TINY = ["--dataset", "synthetic", "--img-size", "16", "--patch-size", "4", "--embed-dim", "32", "--depth", "2",
        "--num-heads", "2", "--batch-size", "32", "--train-limit", "96", "--eval-limit", "40"]


def _cli(*args, cwd=None, env=None):
    """The CLI in a subprocess, stdout and stderr piped (not a terminal)."""
    return subprocess.run([sys.executable, "-m", "nascompress.cli.main", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})), timeout=300)


def test_a_piped_run_prints_plain_progress_lines(tmp_path):
    r = _cli("train", *TINY, "--epochs", "2", "--out", tmp_path / "run", env={"NASCOMPRESS_PROGRESS_SECONDS": "0"})
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    steps = [ln for ln in lines if ln.startswith("epoch 1:")]
    assert len(steps) == 3 and steps[0].startswith("epoch 1:  1/3 (33%)") and "ETA" in steps[0], lines
    epochs = [ln for ln in lines if ln.startswith("epochs:")]
    assert len(epochs) == 2 and "1/2 (50%)" in epochs[0] and "val " in epochs[0] and "ETA" in epochs[0], lines
    assert not any("\x1b" in ln for ln in lines)  # no terminal control codes


def test_finetune_takes_dataset_and_single_layer_prune_layers(tmp_path, tiny_run):
    from nascompress.cli.finetune import method_option_form

    # typed method options: each form the help shows
    assert method_option_form("evit", "prune_layers")[1]("2") == (2,)
    assert method_option_form("evit", "prune_layers")[1]("4, 7,10") == (4, 7, 10)
    assert method_option_form("evit", "keep_rate")[1]("0.5") == 0.5
    assert method_option_form("evit", "keep_rate")[1]("0.9,0.7") == (0.9, 0.7)
    r = invoke("finetune", tiny_run, "--method", "evit", "--prune-layers", "x,2", "--out", tmp_path / "bad")
    assert r.exit_code == 1 and "--prune-layers takes comma-separated integers" in r.output and not (tmp_path / "bad").exists()
    # an imported run without a dataset: finetune says to give one; with --dataset it trains on it
    imp = tmp_path / "imported"
    import nascompress
    from nascompress.io import load_with_arch

    model, arch = load_with_arch(tiny_run)
    nascompress.save_model(imp, model, arch)  # what 'import' writes without --dataset (the tiny ViT is no timm name)
    (imp / "config.json").write_text(json.dumps({"import": {"model": "x"}, "data": None}))
    (imp / "metrics.json").write_text(json.dumps({"imported": True, "finished": True}))
    r = invoke("finetune", imp, "--method", "evit", "--out", tmp_path / "ft0")
    assert r.exit_code == 1 and "records no dataset" in r.output and "--dataset" in r.output, r.output
    r = invoke("finetune", imp, "--method", "evit", "--dataset", "synthetic", "--prune-layers", "2", "--keep-rate", "0.5",
               "--epochs", "1", "--train-limit", "64", "--eval-limit", "40", "--out", tmp_path / "ft", "--json")
    assert r.exit_code == 0, r.output
    out_arch = json.loads((tmp_path / "ft" / "arch.json").read_text())
    assert out_arch["methods"][-1]["config"]["prune_layers"] == [2]
    assert json.loads((tmp_path / "ft" / "config.json").read_text())["data"]["dataset"] == "synthetic"


def test_resume_with_changed_settings_is_refused_naming_them(tmp_path):
    from nascompress.train import TrainHooks

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
    r = invoke("train", "--dataset", "imf", "--num-workers", "0", "--img-size", "16", "--patch-size", "8", "--embed-dim",
               "16", "--depth", "1", "--num-heads", "2", "--in-chans", "3", "--epochs", "1", "--batch-size", "16",
               "--out", "run")
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
