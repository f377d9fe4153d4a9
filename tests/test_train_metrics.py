"""The training stages' results are frozen typed records (:mod:`nascompress.train.metrics`,
:mod:`nascompress.retraining.metrics`, :mod:`nascompress.importer.metrics`): each stage returns the
record it wrote, so ``to_dict()`` is its ``metrics.json`` less the completion mark, key for key and
in the file's order, and the file read back is the same record."""

from __future__ import annotations

import json
from dataclasses import FrozenInstanceError

import pytest

from nascompress.data import DataConfig
from nascompress.errors import NascompressError
from nascompress.importer.metrics import ImportMetrics
from nascompress.importer.run import ImportJob, import_model
from nascompress.models.build import ModelSpec
from nascompress.retraining.config import RetrainConfig
from nascompress.retraining.metrics import BoundContribution, RetrainMetrics
from nascompress.retraining.run import RetrainJob, retrain, retrain_train_config
from nascompress.runs.files import read_metrics
from nascompress.train.config import TrainConfig
from nascompress.train.finetune import FinetuneJob, finetune
from nascompress.train.metrics import FinetuneMetrics, ProbeFit, TrainMetrics
from nascompress.train.run import TrainJob, train

DATA = DataConfig(dataset="synthetic", train_limit=64, eval_limit=32)
MARK = ("finished", "finished_files")


def written(out) -> list:
    """``out/metrics.json`` less its completion mark, as (key, value) pairs in the file's order."""
    return [(k, v) for k, v in json.loads((out / "metrics.json").read_text()).items() if k not in MARK]


def check_returned(m, cls, out) -> None:
    """``m`` is the frozen record of ``cls`` the stage wrote to ``out/metrics.json``."""
    assert type(m) is cls
    assert list(m.to_dict().items()) == written(out)  # every key, value and null, in the file's order
    assert cls.from_dict(json.loads((out / "metrics.json").read_text()), source="metrics.json").results() == m.to_dict()
    assert read_metrics(out).results() == m.to_dict()
    with pytest.raises(FrozenInstanceError):
        m.test_top1 = 0.0


def test_each_training_stage_returns_the_record_it_wrote(tiny_run, tmp_path):
    arch = json.loads((tiny_run / "arch.json").read_text())
    spec = ModelSpec.from_dict(arch["model"])
    dense = train(
        TrainJob(
            model=spec, data=DATA, train=TrainConfig(epochs=1, batch_size=32, device="cpu"), out=str(tmp_path / "t")
        )
    )
    check_returned(dense, TrainMetrics, tmp_path / "t")
    assert dense.epochs == 1 and dense.test_n == 32 and dense.linear_probe is None and dense.probe is None

    probe = train(
        TrainJob(
            model=spec,
            data=DATA,
            train=TrainConfig(epochs=1, lr=None, device="cpu"),
            out=str(tmp_path / "p"),
            weights=str(tiny_run / "model.safetensors"),
            reset_head=True,
            linear_probe=True,
        )
    )
    check_returned(probe, TrainMetrics, tmp_path / "p")
    assert probe.linear_probe is True and probe.best_epoch is None and "best_epoch" in probe.to_dict()  # a null kept
    assert probe.l2 in [row["l2"] for row in probe.l2_grid] and probe.n_train == 64

    zero_shot = finetune(
        FinetuneJob(run_dir=str(tiny_run), method="tome", data=DATA, out=str(tmp_path / "z"), zero_shot=True)
    )
    check_returned(zero_shot, FinetuneMetrics, tmp_path / "z")
    assert zero_shot.zero_shot is True and zero_shot.method == "tome" and zero_shot.flops_ratio < 1

    retrained = retrain(
        RetrainJob(
            model_dir=str(tiny_run),
            out=str(tmp_path / "r"),
            data=DATA,
            train=retrain_train_config(epochs=1, batch_size=32, device="cpu"),
            retrain=RetrainConfig(eta=1.0, kmeans_iters=2),
            auto_batch=False,
        )
    )
    check_returned(retrained, RetrainMetrics, tmp_path / "r")
    assert (
        retrained.methods == [] and retrained.eta == 1.0 and isinstance(retrained.bound_contribution, BoundContribution)
    )

    imported = import_model(
        ImportJob(
            model=spec.name,
            weights=str(tiny_run / "model.safetensors"),
            out=str(tmp_path / "i"),
            num_heads=spec.kwargs["num_heads"],
            data=DATA,
            device="cpu",
        )
    )
    check_returned(imported, ImportMetrics, tmp_path / "i")
    assert imported.imported is True and imported.best_val_top1 == imported.val_top1 and imported.val_n == 32


def test_a_damaged_figure_is_one_line_and_a_nested_record_is_typed():
    with pytest.raises(NascompressError, match="metrics.json: best_epoch must be a number"):
        TrainMetrics.from_dict({"best_epoch": "3"}, source="metrics.json")
    m = TrainMetrics.from_dict({"kept_probe": False, "probe": {"val_top1": 50.0, "l2": 0.1, "l2_grid": []}}, source="m")
    assert isinstance(m.probe, ProbeFit) and m.probe.l2 == 0.1 and m.kept_probe is False
    assert m.to_dict() == {"kept_probe": False, "probe": {"val_top1": 50.0, "l2": 0.1, "l2_grid": []}}


def test_finish_writes_a_record_and_returns_what_it_wrote_less_the_mark(tmp_path):
    from nascompress.runs.run_dir import RunDir

    m = TrainMetrics.new(best_val_top1=50.0, best_epoch=None, epochs=1)
    run = RunDir.prepare(tmp_path / "a")
    run.create({})
    assert run.finish(m) is m and written(tmp_path / "a") == list(m.to_dict().items())
    run = RunDir.prepare(tmp_path / "b")
    run.create({})  # a dict holding a record (a rebuilt study trial's fine-tune): both as JSON values
    assert run.finish({"trial": 3, "finetune": m}) == {"trial": 3, "finetune": m.to_dict()}
    assert written(tmp_path / "b") == [("trial", 3), ("finetune", m.to_dict())]
