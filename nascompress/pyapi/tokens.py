"""``nc.tokens.apply``: a token method (EViT, DynamicViT, ToMe, Sparsifiner, MG-ViT) on a model
object: applied as the method registry applies it (training-free), or with data as
``nascompress finetune`` does (zero-shot after the method's predictor-only stage, or fine-tuned)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import NascompressError, python_api
from ..train.finetune import FINETUNE_TRAIN_SETTINGS, build_job, finetune, finetune_train_config, split_settings
from ..methods import get_method
from ..train.metrics import FinetuneMetrics
from ..train.run import RUNTIME_SETTINGS
from .common import (
    ModelLike,
    StageResult,
    data_config,
    loader_batch,
    model_and_arch,
    model_run,
    read_result,
    remember,
    stage_values,
)
from .workspace import Workspace
from ..progress import silenced

_TRAIN_NAMES = tuple(FINETUNE_TRAIN_SETTINGS.names)


@dataclass(frozen=True)
class TokenModel(StageResult):
    """A model with a token method applied; ``metrics`` (with data): its
    :class:`~nascompress.train.metrics.FinetuneMetrics`, ``test_top1``, ``val_top1``, ``flops_ratio``
    (mean over test images: a token method's cost depends on the image), ``zero_shot``; without data an
    empty record."""

    METRICS = FinetuneMetrics


@python_api("nc.tokens.apply")
def apply(
    model: ModelLike,
    method: str,
    data: Any = None,
    *,
    epochs: int = 0,
    val: Any = None,
    test: Any = None,
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
) -> TokenModel:
    """Apply token method ``method`` (``evit``, ``tome``, ``dynamicvit``, ``sparsifiner``, ``mgvit``)
    to ``model``: ``nc.tokens.apply(model, "evit", keep_rate=0.7)``.

    Args:
        model: a timm ViT (``nn.Module``), a result of this API, or a run directory.
        method: the registered method's name.
        data: None: the method is applied as it is (training-free methods: EViT, ToMe; one with a
            predictor to train needs data). Else the data (as :func:`nascompress.dcs.search`'s) of
            ``nascompress finetune``: zero-shot (``epochs=0``, after the predictor-only stage) or
            fine-tuned for ``epochs`` with the method's recipe, and evaluated.
        progress: the command's progress lines on stderr (False: nothing is printed).
        **settings: the method's settings (``keep_rate``, ``prune_layers``, ``r`` ...) and its
            recipe's, and the fine-tune's training options (``lr``, ``base_lr``, ``amp`` ...).
    """
    m = get_method(method)
    train = {k: v for k, v in settings.items() if k in _TRAIN_NAMES or k in ("amp", "deterministic")}
    config, recipe = split_settings(method, {k: v for k, v in settings.items() if k not in train})
    if data is None:
        if epochs:
            raise NascompressError(f"nc.tokens.apply(..., epochs={epochs}) fine-tunes: give it data")
        if m.calibrates:
            raise NascompressError(f"{method} trains its predictor before use: give nc.tokens.apply data")
        base, arch = model_and_arch(model)
        patched, record = m.prepare_fresh(copy.deepcopy(base).cpu().eval(), dict(config), dict(recipe) or None)
        arch = arch.with_method(record).without("retrain")
        return TokenModel(model=remember(patched.eval(), arch), arch=arch)
    batch_size = batch_size if batch_size is not None else loader_batch(data)
    cfg_data = data_config(data, val=val, test=test, seed=seed, train_limit=train_limit, eval_limit=eval_limit)
    # every setting is checked before anything is written
    rec = stage_values(FINETUNE_TRAIN_SETTINGS, {"epochs": epochs or None, "batch_size": batch_size, **train})
    runtime = stage_values(
        RUNTIME_SETTINGS,
        {"seed": seed, "device": device, **{k: v for k, v in train.items() if k in ("amp", "deterministic")}},
    )
    rec = {k: v for k, v in rec.items() if k not in runtime}
    finetune_train_config(method, **rec, **runtime)
    with Workspace(out) as ws:
        src = model_run(model, ws, "source", data=cfg_data)
        job = build_job(
            src,
            ws.path(method),
            method=method,
            config=config,
            recipe=recipe,
            train={**rec, **runtime},
            data=cfg_data,
            zero_shot=not epochs,
        )
        with silenced(not progress):
            finetune(job, force=force, resume=resume)
        return read_result(TokenModel, ws.path(method), keep=ws.keep)


__all__ = ["TokenModel", "apply"]
