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
