"""``nascompress finetune``: apply a method to a run and train it with the method's recipe.

The job is the same for every method (:class:`~nascompress.methods.Method`): load the run (dense,
imported, or DCS-materialized; it is also the distillation teacher), ``method.prepare_fresh``
validates the settings, checks stacking and patches a copy; methods with new predictors run
their short predictor-only stage (:meth:`Method.calibrate`); then either save at once
(``zero_shot``) or :func:`nascompress.train.loop.fit` with ``method.hooks``, whose epoch 0 is that zero-shot model. The
learning rate, warm-up and epochs default to the method's recipe (:data:`FINETUNE_TRAIN` with the
method's ``train_overrides``; base lr per 512 images, scaled by the batch size). Every fine-tune
evaluates its starting model first and keeps it if training only hurts.
Under torchrun the training is data-parallel (:mod:`nascompress.train.distributed`); a ``zero_shot`` job
runs whole in every process (the same result) and rank 0 writes it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from . import distributed
from .. import runtime
from ..runs.run_config import run_data_config
from ..config import Config, StageSettings, check_bool, setting
from ..data import DataConfig, dataset_paths, InputSpec, load_data, make_loader, preprocess, training_batches
from ..errors import NascompressError
from ..profiling.evaluate import evaluate
from ..runs.io import load_typed, load_with_arch, save_model
from ..methods import get_method
from ..models.build import build_model
from .config import TrainConfig
from .run import check_classes, recipe_config
from .loop import fit
from .metrics import FinetuneMetrics, FlopsOnTestImages
from ..runs.run_dir import RunDir
from ..runtime import seed_everything
from ..profiling import count_flops
from ..studies.trial_context import FLOPS_IMAGES

# Every fine-tune's recipe; a method's train_overrides change it (and the user overrides both).
FINETUNE_TRAIN = TrainConfig(
    epochs=2, batch_size=64, lr=None, base_lr=1e-4, min_lr=1e-6, warmup_epochs=0.2, weight_decay=0.05
)
# The training settings ``nascompress finetune`` offers: each defaults to the method's recipe
# (:func:`finetune_train_config`); the help gives the generic recipe's own values
_FINETUNE_NAMES = (
    "epochs",
    "batch_size",
    "lr",
    "base_lr",
    "min_lr",
    "warmup_epochs",
    "weight_decay",
    "layer_decay",
    "label_smoothing",
)
_GENERIC_NOTED = ("epochs", "batch_size", "base_lr", "min_lr", "warmup_epochs", "weight_decay")
FINETUNE_TRAIN_SETTINGS = StageSettings(
    TrainConfig,
    _FINETUNE_NAMES,
    recipe=FINETUNE_TRAIN,
    no_default=_FINETUNE_NAMES,
    notes={
        name: (
            f"Default: the method's recipe (generic {getattr(FINETUNE_TRAIN, name):g})."
            if name in _GENERIC_NOTED
            else "Default: the method's recipe."
        )
        for name in _FINETUNE_NAMES
    },
)


def method_train_config(method: str) -> TrainConfig:
    """The recipe of a fine-tune of ``method``: :data:`FINETUNE_TRAIN` with the method's
    ``train_overrides``."""
    return FINETUNE_TRAIN.replace(**get_method(method).train_overrides.changes())


def finetune_train_config(method: str, **overrides: Any) -> TrainConfig:
    """The TrainConfig of a fine-tune of ``method``: its recipe (:func:`method_train_config`), then
    ``overrides`` (None values are ignored; :func:`~nascompress.train.run.recipe_config`, so layer_decay 1 is off)."""
    return recipe_config(method_train_config(method), **overrides)


def split_settings(method: str, settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``key=value`` settings into the method's config and its recipe (unknown keys refused)."""
    m = get_method(method)
    cfg_keys = set(m.config_cls.__dataclass_fields__)
    rec_keys = set(m.recipe_cls.__dataclass_fields__) if m.recipe_cls is not None else set()
    unknown = sorted(set(settings) - cfg_keys - rec_keys)
    if unknown:
        raise NascompressError(
            f"unknown {method} option(s) {unknown}; valid options: "
            f"{', '.join(sorted(cfg_keys))}" + (f"; recipe: {', '.join(sorted(rec_keys))}" if rec_keys else "")
        )
    return ({k: v for k, v in settings.items() if k in cfg_keys}, {k: v for k, v in settings.items() if k in rec_keys})


@dataclass(frozen=True)
class FinetuneJob(Config):
    """Everything ``nascompress finetune`` needs; written to ``config.json`` of the output run.

    Args:
        run_dir: the nascompress run to start from (dense, imported or DCS-materialized); also the teacher.
        method: a registered method name (evit, dynamicvit, sparsifiner, mgvit, mgvit-h, tome).
        config / recipe: the method's settings and its recipe settings (validated by the method).
        data: the dataset (default: the run's).
        train: optimisation (default: :func:`finetune_train_config`).
        zero_shot: apply the method without training (after its predictor-only stage, if it has one).
    """

    run_dir: str
    method: str = setting(help="evit, dynamicvit, sparsifiner, mgvit, mgvit-h or tome.")
    config: dict = field(default_factory=dict)
    recipe: dict = field(default_factory=dict)
    data: DataConfig | None = None
    train: TrainConfig | None = None
    out: str = "runs/finetuned"
    zero_shot: bool = setting(
        False, help=("Apply without training (after the method's short predictor-only stage, if any).")
    )

    def __post_init__(self) -> None:
        check_bool("zero_shot", self.zero_shot)


def build_job(
    run_dir: str | Path,
    out: str | Path,
    *,
    method: str,
    config: Mapping[str, Any],
    recipe: Mapping[str, Any],
    train: Mapping[str, Any],
    data: DataConfig | None = None,
    zero_shot: bool = False,
) -> FinetuneJob:
    """The job of ``nascompress finetune`` and of ``nc.tokens.apply`` with data (the one place it is
    built): ``config`` / ``recipe``: the method's settings and its recipe's (:func:`split_settings`);
    ``train``: the values of :data:`FINETUNE_TRAIN_SETTINGS` and :data:`~nascompress.train.run.RUNTIME_SETTINGS`
    (None: the method's recipe's, :func:`finetune_train_config`); ``data``: the dataset (None: the
    run's)."""
    return FinetuneJob(
        run_dir=str(run_dir),
        method=method,
        config=dict(config),
        recipe=dict(recipe),
        data=data,
        train=finetune_train_config(method, **train),
        out=str(out),
        zero_shot=zero_shot,
    )


def finetune(
    job: FinetuneJob, *, force: bool = False, resume: bool = False, explicit: set[str] | None = None
) -> FinetuneMetrics:
    """Run ``job`` (``resume``: the job recorded in ``out/config.json``, from its last checkpoint);
    returns metrics (:class:`~nascompress.train.metrics.FinetuneMetrics`: ``metrics.json`` less its
    completion mark): the saved model's val/test top-1, the starting (zero-shot) val top-1 and the FLOPs.
    ``explicit``: the options given on the command line (on resume each must agree with the record)."""
    out = Path(job.out)
    if resume:
        job = RunDir.recorded(out, FinetuneJob, "nascompress finetune", given=job, explicit=explicit)
    elif Path(job.run_dir).exists():  # recorded absolute: a resume or a reader from another directory finds it
        job = job.replace(run_dir=str(Path(job.run_dir).absolute()))
    run = RunDir.prepare(out, force=force, resume=resume, inputs=(job.run_dir, *dataset_paths(job.data)))
    method = get_method(job.method)
    cfg = job.train or finetune_train_config(job.method)
    runtime.prepare_deterministic(cfg.deterministic)
    device = distributed.init(cfg.device)
    teacher, base_arch = load_typed(job.run_dir, map_location=device)
    seed_everything(cfg.seed)
    model, record = method.prepare_fresh(copy.deepcopy(teacher), dict(job.config), dict(job.recipe) or None)
    arch = base_arch.with_method(record).without("retrain")
    data_cfg = job.data or run_data_config(job.run_dir) or DataConfig()
    spec = InputSpec.from_dict(dict(arch.input))
    data = load_data(data_cfg, spec=spec)
    arch = arch.with_labels(data.classes)  # the classes trained on (--dataset may name another set of them)
    check_classes(
        model.num_classes,
        data,
        fix=f"give finetune {{dataset}} with the {model.num_classes} classes the model was trained for",
    )
    run.create(job.replace(data=data_cfg, train=cfg).to_dict())
    teacher.eval().requires_grad_(False)
    model.to(device)
    # methods with new predictors train them alone first (backbone frozen): the zero-shot model, and
    # the start of a fine-tune, so a fine-tune never ends below its zero-shot model
    with runtime.configured(device, deterministic=cfg.deterministic), runtime.autocast(device, cfg.amp):
        calib = (
            {}
            if resume
            else method.calibrate(
                model,
                record,
                teacher=teacher,
                batches=training_batches(data, spec, batch_size=cfg.batch_size, seed=cfg.seed, device=device),
            )
        )
    if job.zero_shot:
        if distributed.is_main():
            save_model(out, model, arch)
        val = evaluate(model, data.val, input_spec=spec, device=device, batch_size=cfg.eval_batch_size)
        test = evaluate(model, data.test, input_spec=spec, device=device, batch_size=cfg.eval_batch_size)
        metrics = FinetuneMetrics.new(
            val_top1=val.top1,
            test_top1=test.top1,
            test_loss=test.loss,
            test_n=test.n,
            zero_shot=True,
            calibration=calib,
        )
    else:
        hooks = method.hooks(model, record, teacher=teacher, train_cfg=cfg)
        trained = fit(
            model, data=data, input_spec=spec, cfg=cfg, out_dir=out, arch=arch, hooks=hooks, resume=resume, finish=False
        )
        metrics = FinetuneMetrics.new(**trained.to_dict(), zero_shot=False, calibration=calib)
    saved = model if job.zero_shot else load_with_arch(out, map_location=device, complete=False)[0]  # the best epoch
    dense = build_model(base_arch.spec).to(device)  # no method: DCS widths included
    metrics = metrics.set(method=job.method, **flops_on_test_images(saved, dense, data.test, spec, device).to_dict())
    return run.finish(metrics)  # the last write: marks the run complete


@torch.no_grad()
def flops_on_test_images(
    model: nn.Module, dense: nn.Module, test: Any, spec: InputSpec, device: Any, *, images: int | None = None
) -> FlopsOnTestImages:
    """FLOPs per image of the method's model and of the dense model (the architecture without any
    method), averaged over the first ``images`` test images (a token method's cost depends on the
    image; default: as many as a study's trial), and their ratio (the model's / the dense one's:
    below 1 is cheaper, :mod:`nascompress.profiling.compare`)."""
    imgs, _ = next(iter(make_loader(test, batch_size=images or FLOPS_IMAGES, shuffle=False)))  # as a trial's
    x = preprocess(imgs, spec).to(device)
    flops, dense_flops = count_flops(model.eval(), x).total, count_flops(dense.eval(), x).total
    return FlopsOnTestImages.new(
        flops=flops, dense_flops=dense_flops, flops_ratio=flops / dense_flops, flops_images=len(x)
    )


__all__ = [
    "FINETUNE_TRAIN_SETTINGS",
    "FinetuneJob",
    "build_job",
    "finetune",
    "finetune_train_config",
    "split_settings",
    "FINETUNE_TRAIN",
    "method_train_config",
]
