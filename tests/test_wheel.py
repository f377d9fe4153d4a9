"""The built wheel, installed into a fresh venv beside a CPU torch, works from another directory with
what it ships: the search spaces by name (``search tokens --space evit``), the pipeline configs by
name (``pipeline demo``), and a whole pipeline (issue 49).

The venv gets this environment's installed packages (torch, timm, ... ; not nascompress) through a
folder of links on its path, so nothing is downloaded: pip installs only the wheel (``--no-deps
--no-index``), into the venv's own site-packages, and the commands run its ``bin/nascompress``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from .test_install import _pip_env, _source

# a tiny variant of the shipped demo config (configs/demo.yaml): every stage, a few seconds each
TINY_DEMO = """format: nascompress-pipeline/1
seed: 0
device: cpu
data: {dataset: digits, train_limit: 200, eval_limit: 60}
base:
  train: {img_size: 8, patch_size: 2, embed_dim: 16, depth: 4, num_heads: 2, in_chans: 1, epochs: 1, batch_size: 64}
goal: {max_flops: 0.9}
stages:
  dcs: {target_flops: 0.8, qk_mask: static, epochs: 1}
  tokens: {space: evit, trials: 2, train_images: 100, eval_images: 50, calib_steps: 2}
  retrain: {epochs: 1, eta: 0, distil_from: base}
export: {format: onnx}
report: {latency: false}
"""


def _venv_with_the_wheel(tmp_path: Path) -> Path:
    """A fresh venv holding the built wheel, and this environment's other packages on its path."""
    src, wheels = _source(tmp_path), tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(src),
        ],
        check=True,
        capture_output=True,
        env=_pip_env(),
        timeout=300,
    )
    (wheel,) = wheels.glob("nascompress-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    deps = tmp_path / "deps"  # this environment's packages but nascompress (and its editable hooks)
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        n = entry.name.lower()
        if not (n.startswith(("nascompress", "__editable__", "_torchvision_cpu_hook")) or n.endswith(".pth")):
            os.symlink(entry, deps / entry.name)
    (site / "zz-environment-packages.pth").write_text(f"{deps}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        env=_pip_env(),
        timeout=300,
    )
    return venv


def test_the_wheel_ships_spaces_and_configs_found_by_name_from_another_directory(tmp_path):
    venv = _venv_with_the_wheel(tmp_path)
    work = tmp_path / "elsewhere"  # no checkout here: only what the wheel installed
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": ""}

    def cli(*args, timeout=120):
        r = subprocess.run(
            [str(venv / "bin" / "nascompress"), *map(str, args)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-2000:])
        return r

    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import nascompress; print(nascompress.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert where.startswith(str(venv)), where  # the wheel's package, not a checkout
    # a whole pipeline (a tiny variant of the demo, with the shipped evit space by name) from here
    (work / "tiny.yaml").write_text(TINY_DEMO)
    cli("pipeline", "tiny.yaml", "--out", "pipe", timeout=240)
    assert (work / "pipe" / "summary.json").is_file() and (work / "pipe" / "export" / "model.onnx").is_file()
    # search tokens with the shipped evit space by name, sized to this 4-block model (its layers 2-3)
    r = cli(
        "search",
        "tokens",
        "pipe/base",
        "--study",
        "tok",
        "--space",
        "evit",
        "--storage",
        "sqlite:///s.db",
        "--trials",
        2,
        "--train-images",
        60,
        "--eval-images",
        40,
    )
    assert "study tok (sqlite:///s.db): 2/2 complete" in " ".join(r.stdout.split()), r.stdout
    # the shipped demo config validates by name here (the plan reads every file and builds every job)
    code = (
        "from nascompress.pipeline.plan import plan; p = plan('demo', out='d'); "
        "print(p.cfg.stages.tokens.space, ','.join(s.name for s in p.steps))"
    )
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    space, steps = r.stdout.split()
    assert space.startswith(str(venv)) and space.endswith("search_spaces/evit.yaml")
    from nascompress.pipeline import STEPS

    assert steps.split(",") == list(STEPS)  # every stage, the token study on the dense base included
    assert not (work / "d").exists()
    shutil.rmtree(venv)
