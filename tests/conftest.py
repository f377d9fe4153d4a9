from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

import nascompress  # noqa: F401  (torchvision CPU fix before timm)
from nascompress.data import FMNIST_DIR

torch.set_num_threads(1)  # tiny models: one thread is as fast, and robust on a loaded machine
# no progress lines on stderr (not a terminal here) between a command's output and its one-line error
# checks; tests of the progress display set NASCOMPRESS_PROGRESS themselves
os.environ["NASCOMPRESS_PROGRESS"] = "off"
TORCH_DEVICE = os.environ.get("TORCH_DEVICE", "cpu")
FMNIST = (FMNIST_DIR / "train-images-idx3-ubyte.gz").is_file()
needs_fmnist = pytest.mark.skipif(not FMNIST, reason="Debian package dataset-fashion-mnist not installed")


def invoke(*args):
    """Run the nascompress CLI in-process (Typer's CliRunner); arguments may be paths or numbers."""
    from typer.testing import CliRunner

    from nascompress.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A tiny dense run trained for one epoch on the synthetic dataset (shared by tests)."""
    from nascompress.data import DataConfig
    from nascompress.models import custom_vit_spec
    from nascompress.train import TrainConfig, TrainJob, train

    out = tmp_path_factory.mktemp("runs") / "tiny"
    job = TrainJob(model=custom_vit_spec(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                         num_classes=10, in_chans=1),
                   data=DataConfig(dataset="synthetic"), train=TrainConfig(epochs=2, batch_size=32, lr=2e-3, seed=0),
                   out=str(out))
    train(job)
    return out


# A two-layer EViT search space for the tiny test models (search and pipeline tests).
TINY_EVIT_SPACE = """
format: nascompress-space/1
name: tiny-evit
methods:
  - name: evit
    params:
      prune_layers: {kind: layers, range: [1, 2], size: [1, 2]}
      keep_rate: {kind: per_layer, layers: prune_layers, value: {kind: float, low: 0.3, high: 1.0, step: 0.1}}
"""


@contextmanager
def interrupted_at_epoch(hooks_cls, at: int = 1):
    """Inside the block, ``hooks_cls.on_epoch_start`` raises KeyboardInterrupt (a Ctrl-C) when epoch
    ``at`` starts; the hooks are restored on leaving it."""
    real = hooks_cls.on_epoch_start

    def crash(self, model, *, epoch):
        if epoch == at:
            raise KeyboardInterrupt
        return real(self, model, epoch=epoch)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(hooks_cls, "on_epoch_start", crash)
        yield
