"""``nascompress retrain``: retrain a compressed model with CE + eta * IBB (DCS paper, Algorithm 1).

The model is loaded with :func:`nascompress.runs.io.load_with_arch` and keeps its architecture, so
any nascompress model can be retrained: a compressed one (a materialized DCS model, a token method's
fine-tuned model, or a stack of them) or a dense one, which gives the fair yardstick for a compressed
model: the dense model retrained with the same recipe and teacher (``report.dense_reference`` of a
pipeline). Training runs through the shared :func:`nascompress.train.loop.fit` loop
(checkpoint every epoch, ``--resume``); the IB machinery plugs in as :class:`IBHooks`:

* learned feature X~ (default ``pre_logits``): the input of ``model.head``, i.e. timm's
  ``forward_head(forward_features(x), pre_logits=True)``, captured by a forward pre-hook so that
  methods that patch ``forward`` are still tapped where the classifier reads its feature.
* input feature X (default ``image``): a fixed embedding of the input, the preprocessed image
  average-pooled to ``input_pool x input_pool`` per channel and flattened (7x7 = 49 values for
  Fashion-MNIST). ``patch_embed`` uses instead the token-mean of a frozen copy of the teacher's
  (or, without a teacher, the starting model's) patch embedding. Its K-means runs once.
* epochs ``< warm_epochs`` train on CE only, the rest on CE + eta * IBB (eq. 2); at the start of
  training and at the end of every epoch the whole training set is passed through the model, X~
  is re-clustered with a fresh K-means (on the training device) and Q(a|y) is recomputed (eq. 7).
* optional knowledge distillation from a teacher run (KL on logits at a temperature), off unless
  a teacher is given.

Under torchrun (:mod:`nascompress.train.distributed`) each process passes its contiguous part of the
cluster set through the model; the features are gathered in order, every process runs the same
seeded K-means on all of them, and rank 0's centroids and Q are broadcast so that every process
holds exactly the same clusters (GPU kernels need not be bitwise deterministic).

This module holds the job, its settings and its recipe; the hooks are :mod:`nascompress.dcs_search.ib_hooks`,
the distillation pieces :mod:`nascompress.train.distill` and the batch rule :mod:`nascompress.train.auto_batch`
(their names are importable from here too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..train import distributed
from .. import runtime
from ..runs.run_config import run_data_config
from ..train.auto_batch import AUTO_BATCH_NOTE, auto_batch_size
from ..config import Config, StageSettings, setting
from ..data import DataBundle, DataConfig, dataset_paths, InputSpec, load_data
from ..train.distill import FeatureTap, feature_width
from ..errors import NascompressError, SettingError
from ..dcs_search.ib_hooks import IB_KEYS, IBHooks, make_input_embed
from ..runs.io import load_typed, read_arch
from .config import RetrainConfig
from .metrics import BoundContribution, RetrainMetrics
from ..train.config import TrainConfig
from ..train.loop import fit
from ..train.run import recipe_config
from ..runs.run_dir import RunDir
from ..runs.files import Arch

# Retraining a compressed (pretrained) model: a fine-tune's defaults (base lr per 512 images).
RETRAIN_TRAIN = TrainConfig(epochs=10, batch_size=128, lr=None, base_lr=5e-4, min_lr=1e-6, warmup_epochs=0.2)


def retrain_train_config(**given: Any) -> TrainConfig:
    """Retrain's TrainConfig: :data:`RETRAIN_TRAIN` with the values ``given`` (None: the recipe's)."""
    return recipe_config(RETRAIN_TRAIN, **given)


# Retrain's training settings a user sets (`retrain` options, `stages.retrain` keys): the recipe's
# defaults, but batch_size (None: from the training images) and base_lr (None: the recipe's)
RETRAIN_TRAIN_SETTINGS = StageSettings(
    TrainConfig,
    ("epochs", "batch_size", "lr", "base_lr", "min_lr", "warmup_epochs", "layer_decay"),
    recipe=RETRAIN_TRAIN,
    no_default=("batch_size", "base_lr"),
    notes={
        "batch_size": AUTO_BATCH_NOTE,
        "base_lr": f"Default: {RETRAIN_TRAIN.base_lr:g} (safe on pretrained weights).",
    },
)


@dataclass(frozen=True)
class RetrainJob(Config):
    """Everything ``nascompress retrain`` needs; written to ``config.json`` of the output run.

    Args:
        model_dir: a nascompress model: compressed, or dense (the reference at the same budget).
        out: the run directory to create.
        data: dataset (default: the one recorded in ``model_dir/config.json``, else Fashion-MNIST).
        teacher: optional run directory of a (dense) teacher for knowledge distillation.
        auto_batch: choose ``train.batch_size`` from the training images (:func:`auto_batch_size`);
            the chosen size is recorded in config.json. The default, as ``retrain`` and
            ``stages.retrain`` without a batch size; False: ``train.batch_size`` as given.
    """

    model_dir: str
    out: str = "runs/retrained"
    data: DataConfig | None = None
    train: TrainConfig = field(default_factory=retrain_train_config)
    retrain: RetrainConfig = field(default_factory=RetrainConfig)
    teacher: str | None = setting(None, path=True, help="A (dense) run to distil from (KL on logits); off by default.")
    auto_batch: bool = True


def check_teacher(job: RetrainJob) -> None:
    """The rules between the recipe and the teacher (a :class:`~nascompress.errors.SettingError`
    naming fields): feature distillation needs a teacher. Checked by :func:`build_job` (a command's
    or a pipeline's job, before anything runs) and by :func:`retrain` (any job)."""
    if job.retrain.feat_kd and job.teacher is None:
        raise SettingError(
            "{feat_kd} distils from a teacher's features; give the dense run with {teacher}, or leave {feat_kd} at 0"
        )


def build_job(
    model_dir: str | Path,
    out: str | Path,
    *,
    retrain: RetrainConfig,
    train: Mapping[str, Any],
    data: DataConfig | None = None,
    teacher: str | Path | None = None,
) -> RetrainJob:
    """The retraining job of ``nascompress retrain`` and of a pipeline's ``stages.retrain`` (the one
    place it is built): ``retrain``: the recipe; ``train``: the values of
    :data:`RETRAIN_TRAIN_SETTINGS` and :data:`~nascompress.train.run.RUNTIME_SETTINGS` (None: the
    recipe's; ``batch_size`` None: chosen from the training images); ``data``: the dataset (None:
    the one recorded with the model); ``teacher``: a dense run to distil from. Checked
    (:func:`check_teacher`); errors name fields."""
    job = RetrainJob(
        model_dir=str(model_dir),
        out=str(out),
        data=data,
        train=retrain_train_config(**train),
        retrain=retrain,
        teacher=None if teacher is None else str(teacher),
        auto_batch=train.get("batch_size") is None,
    )
    check_teacher(job)
    return job


def recorded_data_config(run_dir: str | Path) -> DataConfig | None:
    """The DataConfig recorded in ``run_dir/config.json`` (None if absent or not in that format)."""
    try:
        return run_data_config(run_dir)
    except (TypeError, NascompressError):
        return None


def _check_head(model: nn.Module, data: DataBundle, *, what: str) -> None:
    n = getattr(model, "num_classes", None)
    if n != data.num_classes:
        raise NascompressError(
            f"the {what} has {n} classes but dataset {data.name} has {data.num_classes}; "
            "retrain on the dataset the model was trained for"
        )


def _resolve_defaults(
    job: RetrainJob,
    model: nn.Module,
    teacher: nn.Module | None,
    spec: InputSpec,
    device: torch.device,
    *,
    train_images: int,
) -> RetrainJob:
    """The job with ``auto_batch`` and ``feat_kd=None`` resolved (and an explicit ``feat_kd``
    checked against the feature widths)."""
    if job.auto_batch:
        job = job.replace(train=job.train.replace(batch_size=auto_batch_size(train_images)), auto_batch=False)
    rc = job.retrain
    if teacher is None:
        return job.replace(retrain=rc.replace(feat_kd=0.0)) if rc.feat_kd is None else job
    widths = [feature_width(m, rc.feature_tap, spec, device) for m in (model, teacher)]
    if rc.feat_kd is None:
        return job.replace(retrain=rc.replace(feat_kd=1.0 if widths[0] == widths[1] else 0.0))
    if rc.feat_kd > 0 and widths[0] != widths[1]:
        raise SettingError(
            f"{{feat_kd}}: the model's {rc.feature_tap} feature has {widths[0]} "
            f"values but the teacher's {widths[1]}; pick a {{feature_tap}} both share, or "
            "leave {feat_kd} at 0"
        )
    return job


@dataclass
class RetrainResult:
    """A finished retraining in memory: the model (holding its best validation epoch), the job with
    its defaults resolved, the epoch records (``log.jsonl``'s lines) and the metrics
    (:class:`~nascompress.retraining.metrics.RetrainMetrics`: ``metrics.json`` less its completion mark)."""

    model: nn.Module
    job: RetrainJob
    log: list[dict[str, Any]]
    metrics: RetrainMetrics


def run_retrain(
    job: RetrainJob,
    model: nn.Module,
    arch: Arch | dict[str, Any],
    data: DataBundle,
    *,
    teacher: nn.Module | None = None,
    out_dir: Path | None = None,
    resume: bool = False,
    before_fit: Callable[[RetrainJob, dict[str, Any]], None] | None = None,
) -> RetrainResult:
    """IB retraining on models and data in memory: ``model`` (compressed, with its ``arch``), ``data``
    loaded for its input spec, an optional frozen ``teacher``. Nothing is written without
    ``out_dir``; with it the run directory's files are written as training goes (:func:`retrain`),
    ``before_fit(job, features)`` called once the job's defaults are resolved."""
    device = distributed.init(job.train.device)
    arch = Arch.of(arch)
    spec = InputSpec.from_dict(dict(arch.input))
    _check_head(model, data, what=f"model in {job.model_dir}")
    if teacher is not None:
        _check_head(teacher, data, what=f"teacher {job.teacher}")
    FeatureTap(model, job.retrain.feature_tap).remove()  # fail early on a bad tap
    job = _resolve_defaults(job, model, teacher, spec, device, train_images=len(data.train))
    if job.retrain.input_tap == "patch_embed" and not hasattr(teacher or model, "patch_embed"):
        raise SettingError("{input_tap} patch_embed needs a model with a patch_embed module; use {input_tap} image")
    features = job.retrain.describe(teacher=teacher is not None)
    warm = job.retrain.warm_epochs(job.train.epochs)
    # the classes retrained on; provenance (the source model's path) is in metrics.json and config.json, not in
    # the arch: the model file's bytes (the arch is its metadata) are the same wherever the run was written
    out_arch = arch.with_labels(data.classes).set(
        retrain={
            "eta": job.retrain.eta,
            "warmup_frac": job.retrain.warmup_frac,
            "eta_schedule": job.retrain.eta_schedule,
            "warm_epochs": warm,
            "epochs": job.train.epochs,
            "kd": teacher is not None,
            **features,
        }
    )
    if before_fit is not None:
        before_fit(job, features)
    hooks = IBHooks(
        job.retrain,
        train_set=data.train,
        input_spec=spec,
        num_classes=data.num_classes,
        epochs=job.train.epochs,
        input_embed=make_input_embed(job.retrain, model=model, teacher=teacher),
        teacher=teacher,
        seed=job.train.seed,
        batch_size=job.train.eval_batch_size,
    )
    log: list[dict[str, Any]] = []
    trained = fit(
        model,
        data=data,
        input_spec=spec,
        cfg=job.train,
        out_dir=out_dir,
        arch=out_arch,
        hooks=hooks,
        resume=resume,
        finish=False,
        log=log,
    )
    last = log[-1] if log else {}
    mean = lambda key: sum(r.get(key, 0.0) for r in log) / max(len(log), 1)  # noqa: E731
    metrics = RetrainMetrics.new(
        **trained.to_dict(),
        source_model=str(job.model_dir),
        methods=list(arch.method_names),
        eta=job.retrain.eta,
        warmup_frac=job.retrain.warmup_frac,
        eta_schedule=job.retrain.eta_schedule,
        warm_epochs=warm,
        kd=teacher is not None,
        feat_kd=job.retrain.feat_kd,
        batch_size=job.train.batch_size,
        **features,
        final={
            k: last.get(k)
            for k in ("ib", "i_xt_x", "i_xt_y", "ibb_full", "train_ce", "train_ibb", "train_top1_eval", "val_top1")
            if k in last
        },
        initial={k: hooks.initial[k] for k in IB_KEYS if k in hooks.initial},
        epoch_time_s_mean=mean("epoch_time_s"),
        kmeans_s_mean=mean("kmeans_s"),
        feature_pass_s_mean=mean("feature_pass_s"),
    )
    metrics = metrics.set(
        kmeans_vs_epoch=metrics.kmeans_s_mean / metrics.epoch_time_s_mean if metrics.epoch_time_s_mean else None
    )
    if job.retrain.eta > 0:
        metrics = metrics.set(bound_contribution=bound_contribution(log))
    return RetrainResult(model=model, job=job, log=log, metrics=metrics)


def bound_contribution(log: list[dict[str, Any]]) -> BoundContribution:
    """What the IB bound contributed to a retraining: the best validation top-1 of the epochs on CE
    (+ KD) only (the start and the warm-up) against the best of the epochs the bound was in (each
    epoch's ``ib_active``, as :class:`~nascompress.dcs_search.ib_hooks.IBHooks` logged it), and the change (None
    where one side has no epoch): a :class:`~nascompress.retraining.metrics.BoundContribution`."""
    val = [(bool(r.get("ib_active")), r["val_top1"]) for r in log if r.get("val_top1") is not None]
    before = max((v for on, v in val if not on), default=None)
    after = max((v for on, v in val if on), default=None)
    return BoundContribution.new(
        best_val_without_bound=before,
        best_val_with_bound=after,
        change=None if before is None or after is None else after - before,
    )


def retrain(
    job: RetrainJob, *, force: bool = False, resume: bool = False, explicit: set[str] | None = None
) -> RetrainMetrics:
    """Run ``job`` into the run directory ``job.out`` (:func:`run_retrain` on the models and data it
    names): validate everything, then retrain and save; returns metrics
    (:class:`~nascompress.retraining.metrics.RetrainMetrics`: ``metrics.json`` less its completion mark).

    Writes into ``job.out``: ``model.safetensors`` (best validation epoch; arch in its
    metadata), ``arch.json`` (the input model's arch plus a ``retrain`` record), ``config.json``,
    ``log.jsonl`` (per epoch: CE, IBB, IB loss, train/val accuracy, K-means and epoch time),
    ``metrics.json``, ``last.safetensors`` and ``checkpoint.safetensors`` (for ``resume``).
    With ``resume`` the job stored in ``out/config.json`` is continued (``explicit``: the options given
    on the command line, each of which must agree with it).
    """
    out = Path(job.out)
    if resume:
        job = RunDir.recorded(out, RetrainJob, "nascompress retrain", given=job, explicit=explicit)
    else:  # recorded absolute: a resume or a reader from another directory finds them
        job = job.replace(
            model_dir=os.path.abspath(job.model_dir), teacher=os.path.abspath(job.teacher) if job.teacher else None
        )
    run = RunDir.prepare(out, force=force, resume=resume, inputs=(job.model_dir, job.teacher, *dataset_paths(job.data)))
    read_arch(job.model_dir)  # a nascompress model (compressed, or dense: the reference at the same budget)
    check_teacher(job)
    runtime.prepare_deterministic(job.train.deterministic)
    device = distributed.init(job.train.device)
    model, arch = load_typed(job.model_dir, map_location=device)
    data_cfg = job.data or recorded_data_config(job.model_dir) or DataConfig()
    spec = InputSpec.from_dict(dict(arch.input))
    data = load_data(data_cfg, spec=spec)
    _check_head(model, data, what=f"model in {job.model_dir}")
    teacher = None
    if job.teacher is not None:
        teacher, t_arch = load_typed(job.teacher, map_location=device)
        if InputSpec.from_dict(dict(t_arch.input)) != spec:
            raise NascompressError(
                f"teacher {job.teacher} expects input {dict(t_arch.input)} but the model {dict(arch.input)}"
            )
        teacher.eval().requires_grad_(False)

    def create(resolved: RetrainJob, features: dict[str, Any]) -> None:
        run.create(dict(resolved.replace(data=data_cfg).to_dict(), features=features))

    result = run_retrain(job, model, arch, data, teacher=teacher, out_dir=out, resume=resume, before_fit=create)
    return run.finish(result.metrics)  # the last write: marks the run complete


__all__ = [
    "RetrainJob",
    "build_job",
    "check_teacher",
    "recorded_data_config",
    "retrain",
    "run_retrain",
    "RetrainResult",
    "retrain_train_config",
    "RETRAIN_TRAIN",
]
