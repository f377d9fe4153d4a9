from __future__ import annotations

import importlib
import os
import sys
from contextlib import contextmanager

import pytest
import torch

import nascompress  # noqa: F401  (torchvision CPU fix before timm)
from nascompress.data import FMNIST_DIR

torch.set_num_threads(1)  # tiny models: one thread is as fast, and robust on a loaded machine
# no progress lines on stderr (not a terminal here) between a command's output and its one-line error
# checks; tests of the progress display set NASCOMPRESS_PROGRESS themselves
os.environ["NASCOMPRESS_PROGRESS"] = "off"
# --amp auto (the default) resolves to fp32 on every machine, so a test's numbers do not depend on
# whether this CPU has AVX512-BF16/AMX; the tests of auto itself set NASCOMPRESS_NATIVE_BF16 themselves
os.environ["NASCOMPRESS_NATIVE_BF16"] = "0"
TORCH_DEVICE = os.environ.get("TORCH_DEVICE", "cpu")
FMNIST = (FMNIST_DIR / "train-images-idx3-ubyte.gz").is_file()
needs_fmnist = pytest.mark.skipif(not FMNIST, reason="Debian package dataset-fashion-mnist not installed")


# ---------------------------------------------------------------------------------------------
# Tiny models (each shape once; the name says how it differs from tiny_spec)


def tiny_spec(num_classes: int = 10, **kw):
    """The tiny plain ViT most tests build: 16x16 one-channel images, 4x4 patches, 2 blocks 32 wide
    with 2 heads (``custom_vit_spec``; ``kw``: its other arguments)."""
    from nascompress.models.build import custom_vit_spec

    return custom_vit_spec(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=num_classes, in_chans=1, **kw
    )


def tiny_spec_3_heads(**kw):
    """tiny_spec's ViT 48 wide with 3 heads (the DCS tests: masks per head), as a timm ``ModelSpec``
    (no ``mlp_ratio`` key; ``kw``: timm's model arguments)."""
    from nascompress.models.build import ModelSpec

    args = dict(img_size=16, patch_size=4, embed_dim=48, depth=2, num_heads=3, num_classes=10, in_chans=1)
    return ModelSpec("vit_tiny_patch16_224", dict(args, **kw))


def tiny_rgb_vit(**kw):
    """A tiny timm ViT on 32x32 RGB images with 4 blocks (32 wide, 2 heads), seeded 0, in eval mode
    (the token methods' tests; ``kw``: timm's model arguments, e.g. ``reg_tokens``)."""
    import timm

    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=10)
    args.update(kw)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **args).eval()


def tiny_gray_vit(img=16, depth=2, dim=32, heads=2, seed=0):
    """tiny_spec's ViT (one channel) built and in eval mode, with its image size, depth, width and
    heads as arguments, seeded ``seed``."""
    from nascompress.models.build import build_model, custom_vit_spec

    torch.manual_seed(seed)
    return build_model(
        custom_vit_spec(
            img_size=img, patch_size=4, embed_dim=dim, depth=depth, num_heads=heads, num_classes=10, in_chans=1
        )
    ).eval()


# ---------------------------------------------------------------------------------------------
# Project directories for the study tests


@pytest.fixture()
def project(tmp_path, monkeypatch, request):
    """A project directory, made the working directory (the study files land there), holding the
    test module's search spaces: its ``PROJECT_SPACES`` (file name -> YAML text)."""
    monkeypatch.chdir(tmp_path)
    for name, text in getattr(request.module, "PROJECT_SPACES", {}).items():
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.fixture(scope="module")
def project_with_studies(tmp_path_factory):
    """A project directory (shared by a module's tests) with a toy study in each default file
    (``multi``, ``single`` single-objective, ``tiny`` with one trial) and one in a journal
    (``journaled``)."""
    from functools import partial

    from tests.study_toys import run_toy_study, toy_factory

    d = tmp_path_factory.mktemp("project")
    cwd = os.getcwd()
    os.chdir(d)
    try:
        run_toy_study("multi", None, 6, seed=1)
        run_toy_study(
            "single",
            None,
            4,
            seed=2,
            directions=["maximize"],
            metric_names=["accuracy"],
            objective_factory=partial(toy_factory, single=True),
        )
        run_toy_study("tiny", None, 1, seed=3)
        run_toy_study("journaled", f"journal:{d}/nascompress-studies.journal", 3, seed=4)
    finally:
        os.chdir(cwd)
    return d


def invoke(*args):
    """Run the nascompress CLI in-process (Typer's CliRunner); arguments may be paths or numbers."""
    from typer.testing import CliRunner

    from nascompress.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A tiny dense run trained for one epoch on the synthetic dataset (shared by tests)."""
    from nascompress.data import DataConfig
    from nascompress.models.build import custom_vit_spec
    from nascompress.train.config import TrainConfig
    from nascompress.train.run import TrainJob, train

    out = tmp_path_factory.mktemp("runs") / "tiny"
    job = TrainJob(
        model=custom_vit_spec(
            img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10, in_chans=1
        ),
        data=DataConfig(dataset="synthetic"),
        train=TrainConfig(epochs=2, batch_size=32, lr=2e-3, seed=0),
        out=str(out),
    )
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


@contextmanager
def interrupted_at_selection(at: int):
    """Inside the block, the DCS search's hooks raise KeyboardInterrupt (a Ctrl-C) at their ``at``-th
    selection record (the end of epoch ``at``, before its checkpoint); restored on leaving it."""
    import nascompress.dcs_search.hooks as hooks

    real, calls = hooks.selection_record, []

    def crash(*a, **kw):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return real(*a, **kw)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(hooks, "selection_record", crash)
        yield


# the modules that import the library's functions (loaded before any patch_everywhere: see its doc)
_FRONT_ENDS = (
    "nascompress.cli.main",
    "nascompress.pipeline.run",
    "nascompress.pyapi.compress",
    "nascompress.pyapi.dcs",
    "nascompress.pyapi.hf",
    "nascompress.pyapi.stages",
    "nascompress.pyapi.study",
    "nascompress.pyapi.tokens",
)


def patch_everywhere(monkeypatch, module, name: str, value) -> None:
    """``monkeypatch.setattr(module, name, value)``, and the same on every loaded nascompress module that
    imported that object (``from ..train import train``): the modules import what they use at their
    top, so a patch of the defining module alone would not reach them. The front ends are loaded first:
    a module first imported while the patch is on would keep the fake after the test (``from x import f``
    binds it), and the next test's patch, looking for the real object, would miss it."""
    for front_end in _FRONT_ENDS:
        importlib.import_module(front_end)
    real = getattr(module, name)
    monkeypatch.setattr(module, name, value)
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod is module or not mod_name.startswith("nascompress"):
            continue
        for attr, obj in list(vars(mod).items()):
            if obj is real:
                monkeypatch.setattr(mod, attr, value)


def hand_latency_table(geometry, *, align: int = 4):
    """A latency table written by hand for ``geometry`` (tests of the predictor and of what reads it:
    arithmetic, never a speed): every entry rises with tokens, heads, Q/K and hidden width, none
    linearly (so interpolation and slopes are checked, not a straight line)."""
    from nascompress.profiling.latency_table import DeviceFingerprint, LatencyTable
    from nascompress.profiling.latency_table_build import table_grids

    g = table_grids(geometry, align=align)
    attn = [
        [[0.05 + (0.01 * n * h * (q + 8) if h else 0) + 0.002 * h * h for q in g["qk"]] for h in g["heads"]]
        for n in g["tokens"]
    ]
    mlp = [[0.04 + 0.003 * n * w + 1e-4 * w * w for w in g["hidden"]] for n in g["tokens"]]
    return LatencyTable(
        fingerprint=DeviceFingerprint.new(device_type="cpu", cpu="hand"),
        dtype="fp32",
        batch=1,
        geometry=geometry,
        attn_ms=attn,
        mlp_ms=mlp,
        fixed_ms=0.3,
        block_overhead_ms=0.02,
        dense_ms=1.0,
        settings={"align": align},
        **g,
    )
