"""``nc.dcs.search``: the DCS channel search on a model object (``nascompress search dcs``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import user_settings
from ..data import DataConfig
from ..methods.dcs import DCSConfig
from ..dcs_search.search_config import SEARCH_TRAIN_SETTINGS, DCSSearchConfig, search_train_config
from ..dcs_search.run import build_job, search_dcs
from ..train import RUNTIME_SETTINGS
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
from ..api import run_data_config

SEARCH_NAMES = tuple(f.name for f in user_settings(DCSSearchConfig) if f.name != "target_flops")


@dataclass(frozen=True)
class DCSSearch(StageResult):
    """A finished DCS search: ``model`` is the supernet (the dense model with its learnt gates),
    ``metrics`` the search's (``flops_ratio``, ``val_top1``, ``mlp_kept``, ``qk_kept`` ...). Give it
    to :func:`nascompress.materialize` for the smaller model."""


def search(
    model: ModelLike,
    data: Any = None,
    *,
    val: Any = None,
    test: Any = None,
    target_flops: float = 0.6,
    epochs: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    device: str = "auto",
    train_limit: int | None = None,
    eval_limit: int | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    force: bool = False,
    **settings: Any,
) -> DCSSearch:
    """Search which Q/K and MLP channels of a dense ViT to keep for ``target_flops`` x its FLOPs.

    The job of ``nascompress search dcs`` (:func:`~nascompress.dcs_search.run.search_dcs`) with the
    same defaults.

    Args:
        model: a dense timm ViT (an ``nn.Module``), a result of this API, or a run directory.
        data: the training data: a built-in dataset name (``"fashion-mnist"``, ``"digits"``), an
            ImageFolder root, a map-style ``Dataset`` of (image tensor, label), or a ``DataLoader``
            over one (its batch size is then the search's); None: the run's recorded dataset.
        val / test: the caller's other splits (with a Dataset; None: carved from ``data``).
        target_flops: the FLOPs to reach, as a share of the dense model's.
        epochs / batch_size: the search's training (None: the command's recipe; batch size from the
            number of training images).
        seed / device: as the command's ``--seed`` / ``--device`` (``auto``, ``cpu``, ``cuda``).
        train_limit / eval_limit: use a class-stratified subset of the images.
        out: keep the search's run directory here (None: nothing is written).
        resume / force: continue the search in ``out`` / replace it.
        **settings: any other option of the command, by its Python name (``arch_lr=0.05``,
            ``qk_mask="static"``, ``mlp_gates="residual"``, ``lr``, ``amp``, ``deterministic`` ...).
    """
    parts = split_settings(
        settings,
        {
            "search": SEARCH_NAMES,
            "method": setting_names(DCSConfig),
            "recipe": setting_names(SEARCH_TRAIN_SETTINGS),
            "runtime": ("amp", "deterministic"),
        },
        what="nc.dcs.search",
    )
    batch_size = batch_size if batch_size is not None else loader_batch(data)
    cfg_data = data_config(data, val=val, test=test, seed=seed, train_limit=train_limit, eval_limit=eval_limit)
    # every setting is checked before anything is written
    search_cfg = stage_values(DCSSearchConfig, {"target_flops": target_flops, **parts["search"]})
    recipe = stage_values(SEARCH_TRAIN_SETTINGS, {"epochs": epochs, "batch_size": batch_size, **parts["recipe"]})
    runtime = stage_values(RUNTIME_SETTINGS, {"seed": seed, "device": device, **parts["runtime"]})
    if epochs is None:
        recipe.pop("epochs")
    DCSSearchConfig(**search_cfg, auto_batch=batch_size is None)
    search_train_config(**recipe, **runtime)
    with Workspace(out) as ws:
        source = model_run(model, ws, "source", data=cfg_data)
        if cfg_data is None:
            cfg_data = run_data_config(source) or DataConfig()
            cfg_data = data_config(cfg_data, seed=seed, train_limit=train_limit, eval_limit=eval_limit)
        job = build_job(
            source,
            ws.path("dcs_search"),
            search=search_cfg,
            method=parts["method"],
            train={**recipe, **runtime},
            data=cfg_data,
        )
        search_dcs(job, force=force, resume=resume)
        return read_result(DCSSearch, ws.path("dcs_search"), keep=ws.keep)


__all__ = ["DCSSearch", "search"]
