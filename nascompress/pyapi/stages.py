"""``nc.materialize``, ``nc.retrain`` and ``nc.quantize``: the jobs of ``nascompress materialize``,
``retrain`` and ``quantize`` on model objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.choose import data_config_for
from ..deploy.config import QuantizeConfig
from ..deploy.quantize import quantize_run
from ..retraining.run import RETRAIN_TRAIN_SETTINGS, build_job, recorded_data_config, retrain_train_config
from ..retraining.config import RetrainConfig
from ..retraining.run import retrain as retrain_job
from ..dcs_search.materialize import build_job as build_materialize_job, materialize_search
from ..dcs_search.metrics import MaterializeMetrics
from ..retraining.metrics import RetrainMetrics
from ..train.run import RUNTIME_SETTINGS
from .common import (
    ModelLike,
    StageResult,
    data_config,
    loader_batch,
    model_run,
    read_result,
    setting_names,
    split_settings,
    stage_values,
)
from .workspace import Workspace
from .data_notes import warn_conversions
from ..progress import silenced
from ..errors import python_api


@dataclass(frozen=True)
class Materialized(StageResult):
    """The physically smaller model gathered from a DCS search; ``metrics``: its
    :class:`~nascompress.dcs_search.metrics.MaterializeMetrics`, the FLOPs (``macs``), ``params``,
    ``flops_ratio_vs_dense`` and the check against the supernet (``max_abs_logit_diff``)."""

    METRICS = MaterializeMetrics


@dataclass(frozen=True)
class Retrained(StageResult):
    """A retrained compressed model; ``metrics``: its
    :class:`~nascompress.retraining.metrics.RetrainMetrics` (``test_top1``, ``best_val_top1``,
    ``best_epoch`` ...)."""

    METRICS = RetrainMetrics


@dataclass(frozen=True)
class Quantized:
    """An int8 ONNX file (``path``) and its sidecar (``sidecar``: preprocessing, the check on the
    validation split: ``verification['fp32_top1']``, ``['int8_top1']``, ``['top1_drop']``)."""

    path: str
    sidecar: dict[str, Any] = field(default_factory=dict)


@python_api("nc.materialize")
def materialize(
    search: ModelLike, *, out: str | Path | None = None, force: bool = False, progress: bool = True
) -> Materialized:
    """Gather a finished DCS search (:func:`nascompress.dcs.search`'s result, or its run directory)
    into the smaller model (``nascompress materialize``), checked against the supernet's logits.
    ``out``: keep the run directory there (None: nothing is written); ``progress``: the command's
    lines on stderr (False: nothing is printed)."""
    with Workspace(out) as ws, silenced(not progress):
        src = model_run(search, ws, "dcs_search")
        materialize_search(build_materialize_job(src, ws.path("dcs_mat")), force=force)
        return read_result(Materialized, ws.path("dcs_mat"), keep=ws.keep)


@python_api("nc.retrain")
def retrain(
    model: ModelLike,
    data: Any = None,
    *,
    val: Any = None,
    test: Any = None,
    teacher: ModelLike = None,
    epochs: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    device: str = "auto",
    train_limit: int | None = None,
    eval_limit: int | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    **settings: Any,
) -> Retrained:
    """Retrain a compressed model (``nascompress retrain``): CE, + distillation from ``teacher``,
    + ``eta`` x the IB bound; the best validation epoch is kept.

    Args:
        model: a compressed model (a result of this API, or a run directory).
        data: as :func:`nascompress.dcs.search`'s (None: the dataset the model's run recorded).
        teacher: a dense model (``nn.Module``, result or run directory) to distil from; None: none.
        epochs / batch_size / seed / device / train_limit / eval_limit / out / resume / force: as
            the command's options (None: its recipe).
        progress: the command's progress lines on stderr (False: nothing is printed).
        **settings: retrain's other options by Python name (``eta``, ``kd_alpha``, ``feat_kd``,
            ``lr``, ``base_lr``, ``warmup_epochs``, ``amp``, ``deterministic`` ...).
    """
    parts = split_settings(
        settings,
        {
            "retrain": setting_names(RetrainConfig),
            "recipe": setting_names(RETRAIN_TRAIN_SETTINGS),
            "runtime": ("amp", "deterministic"),
        },
        what="nc.retrain",
    )
    batch_size = batch_size if batch_size is not None else loader_batch(data)
    cfg_data = data_config(data, val=val, test=test, seed=seed, train_limit=train_limit, eval_limit=eval_limit)
    # every setting is checked before anything is written
    recipe = stage_values(RETRAIN_TRAIN_SETTINGS, {"epochs": epochs, "batch_size": batch_size, **parts["recipe"]})
    runtime = stage_values(RUNTIME_SETTINGS, {"seed": seed, "device": device, **parts["runtime"]})
    retrain_train_config(**recipe, **runtime)
    retrain_cfg = RetrainConfig(**parts["retrain"])
    with Workspace(out) as ws:
        src = model_run(model, ws, "model", data=cfg_data)
        if cfg_data is None:
            cfg_data = data_config_for(
                recorded_data_config(src), seed=seed, train_limit=train_limit, eval_limit=eval_limit
            )
        warn_conversions(src, cfg_data, what="nc.retrain")  # a built-in dataset's images made the model's
        t_dir = None if teacher is None else str(model_run(teacher, ws, "teacher", data=cfg_data))
        job = build_job(
            src,
            ws.path("retrain"),
            retrain=retrain_cfg,
            train={**recipe, **runtime},
            data=cfg_data,
            teacher=t_dir,
        )
        with silenced(not progress):
            retrain_job(job, force=force, resume=resume)
        return read_result(Retrained, ws.path("retrain"), keep=ws.keep)


@python_api("nc.quantize")
def quantize(
    model: ModelLike,
    path: str | Path,
    data: Any = None,
    *,
    val: Any = None,
    force: bool = False,
    progress: bool = True,
    **settings: Any,
) -> Quantized:
    """Quantize a model to an int8 ONNX file at ``path`` (``nascompress quantize``): calibrated on the
    training images, checked on the validation split against the fp32 file, kept only within
    ``max_drop`` points of top-1. ``data``: as :func:`nascompress.dcs.search`'s (None: the model's
    recorded dataset); ``**settings``: the command's options (``scheme``, ``calib_images``,
    ``max_drop``, ``eval_images``, ``fallback``); ``progress``: as :func:`retrain`'s."""
    parts = split_settings(settings, {"q": setting_names(QuantizeConfig)}, what="nc.quantize")
    cfg_data = data_config(data, val=val)
    with Workspace(None) as ws, silenced(not progress):
        src = model_run(model, ws, "model", data=cfg_data)
        side = quantize_run(src, out=Path(path), config=QuantizeConfig(**parts["q"]), data=cfg_data, force=force)
    return Quantized(path=str(Path(path)), sidecar=side.to_dict())


__all__ = ["Materialized", "Retrained", "Quantized", "materialize", "retrain", "quantize"]
