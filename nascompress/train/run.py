"""The ``nascompress train`` job (:func:`train`: build a timm ViT, train it densely, save it), its
settings (:class:`TrainJob`), and the settings of every training run (:class:`TrainConfig`) with the
stages' recipes (:func:`recipe_config`, :func:`train_recipe`).

The one training engine is :func:`nascompress.train.loop.fit` (AdamW, warm-up + cosine, EMA, exact
resume, never worse than the start, data-parallel under torchrun), which keeps its files through
:class:`nascompress.runs.store.RunStore`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from . import distributed
from .. import runtime
from ..config import StageSettings, setting
from ..data import DataBundle, DataConfig, dataset_paths, InputOverrides, InputSpec, default_norm, load_data
from ..errors import SettingError, words
from ..runs.io import ARCH_FILE, make_arch, recorded_input
from ..models.build import ModelSpec, build_model, input_size, pretrained_data_config
from ..models.weights import load_pretrained
from .config import TrainConfig
from .loop import fit
from .metrics import ProbeFit, TrainMetrics
from ..runs.run_dir import RunDir
from ..runs.files import write_arch_json
from ..runtime import seed_everything
from .probe import fit_linear_probe, fit_probe_head
from ..progress import say


def recipe_config(recipe: TrainConfig, **given: Any) -> TrainConfig:
    """A stage's TrainConfig: its ``recipe`` (the stage's defaults, a named TrainConfig) with every
    value ``given`` that is not None. A base_lr given without an lr replaces a recipe's absolute lr
    (the peak then scales with the batch); layer_decay 1 is no decay (None)."""
    changes = {k: v for k, v in given.items() if v is not None}
    if given.get("base_lr") is not None and given.get("lr") is None:
        changes["lr"] = None
    cfg = recipe.replace(**changes)
    return cfg.replace(layer_decay=None) if cfg.layer_decay == 1 else cfg


# `nascompress train`'s recipes (the command and the pipeline's base.train, through train_recipe):
# from scratch, TrainConfig's own defaults, and fine-tuning pretrained weights (the DeiT/EViT
# fine-tuning base lr, layer decay, a short warm-up)
FINE_TUNE_TRAIN = TrainConfig(lr=None, base_lr=5e-4, layer_decay=0.75, warmup_epochs=0.2)


def train_recipe(*, fine_tune: bool, **given: Any) -> TrainConfig:
    """``nascompress train``'s TrainConfig: the fine-tuning recipe for a pretrained start
    (``fine_tune``), else the one from scratch (``TrainConfig()``), with the values ``given`` (None:
    the recipe's)."""
    return recipe_config(FINE_TUNE_TRAIN if fine_tune else TrainConfig(), **given)


_SCRATCH = TrainConfig()
# The training settings `nascompress train` and base.train offer; the defaults are the recipe from
# scratch, but those the fine-tuning recipe changes (None: train_recipe's, chosen by the weights)
TRAIN_SETTINGS = StageSettings(
    TrainConfig,
    (
        "epochs",
        "batch_size",
        "lr",
        "base_lr",
        "layer_decay",
        "min_lr",
        "warmup_epochs",
        "weight_decay",
        "label_smoothing",
        "ema_decay",
    ),
    recipe=_SCRATCH,
    no_default=("lr", "base_lr", "layer_decay", "warmup_epochs"),
    notes={
        "lr": f"From scratch the default is {_SCRATCH.lr:g} (unless --base-lr is given).",
        "base_lr": f"Default with --weights: {FINE_TUNE_TRAIN.base_lr:g} (the DeiT/EViT fine-tuning base).",
        "layer_decay": f"Default with --weights: {FINE_TUNE_TRAIN.layer_decay:g}; from scratch: off.",
        "warmup_epochs": f"Default: {_SCRATCH.warmup_epochs:g} from scratch, "
        f"{FINE_TUNE_TRAIN.warmup_epochs:g} with --weights.",
    },
)
# Every training job's run settings (options of each training command; the pipeline's top-level keys)
RUNTIME_SETTINGS = StageSettings(TrainConfig, ("seed", "device", "amp", "deterministic"))


@dataclass(frozen=True)
class TrainJob:
    """Everything ``nascompress train`` needs. Written to ``config.json`` in the run directory.

    Args:
        weights: local weights to start from; preprocessing then follows them (:func:`input_spec_for`).
        reset_head: a new classifier head (the file's is missing or has another class count).
        input: explicit preprocessing (``--mean/--std/--interpolation/--crop-pct``), winning over all.
        linear_probe: keep the backbone frozen and fit only a new head on its cached features
            (:mod:`nascompress.train.probe`); needs ``weights`` and implies ``reset_head``.
        probe_start: with ``weights`` and ``reset_head`` (no ``linear_probe``), the new head starts
            as a fitted linear probe and everything is fine-tuned from it (LP-FT, Kumar et al. 2022);
            the probe is the fine-tune's epoch 0, so a fine-tune that ends below it on validation
            keeps the probe (:func:`fine_tune_from_probe`). False: the new head starts at random.
    """

    model: ModelSpec
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    out: str = "runs/base"
    weights: str | None = setting(None, path=True, help="Local .safetensors/.pth weights to start from.")
    reset_head: bool = setting(
        False,
        help=(
            "A new head: the weights' is missing (backbone only) or has another class count. It starts as "
            "a linear probe fitted on the frozen backbone, then everything is fine-tuned (the probe is kept "
            "if fine-tuning ends below it on validation)."
        ),
    )
    input: InputOverrides = field(default_factory=InputOverrides)
    linear_probe: bool = setting(
        False, help=("Freeze the --weights backbone; fit only a new head on its cached features (logistic regression).")
    )
    probe_start: bool = True

    @property
    def from_probe(self) -> bool:
        """Whether the fine-tune starts from a fitted linear-probe head (``probe_start`` applies)."""
        return bool(self.weights) and self.reset_head and self.probe_start and not self.linear_probe

    def __post_init__(self) -> None:
        if self.linear_probe and not self.weights:
            raise SettingError("{linear_probe} needs {weights}: a probe fits a head on a pretrained backbone")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "data": asdict(self.data),
            "train": self.train.to_dict(),
            "out": self.out,
            "weights": self.weights,
            "reset_head": self.reset_head,
            "input": self.input.to_dict(),
            "linear_probe": self.linear_probe,
            "probe_start": self.probe_start,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainJob":
        return cls(
            model=ModelSpec.from_dict(d["model"]),
            data=DataConfig(**d["data"]),
            train=TrainConfig.from_dict(d["train"]),
            out=d["out"],
            weights=d.get("weights"),
            reset_head=d.get("reset_head", False),
            input=InputOverrides.from_dict(d.get("input")),
            linear_probe=d.get("linear_probe", False),
            probe_start=d.get("probe_start", False),  # a run recorded before LP-FT: its random head
        )


# the pipeline's base.import with linear_probe: its recipe (a probe reads eval_batch_size, seed and device only)
PROBE_TRAIN = TrainConfig(epochs=1, lr=None)


def build_job(
    model: ModelSpec,
    out: str | Path,
    *,
    data: DataConfig,
    train: Mapping[str, Any],
    weights: str | None = None,
    reset_head: bool = False,
    input: InputOverrides | None = None,
    linear_probe: bool = False,
    recipe: TrainConfig | None = None,
) -> TrainJob:
    """The training job of ``nascompress train`` and of a pipeline's ``base.train`` (and its
    ``base.import`` with ``linear_probe``) (the one place it is built): ``model``: the model to
    build; ``data``: the dataset; ``train``: the values of :data:`TRAIN_SETTINGS` and
    :data:`RUNTIME_SETTINGS` (None: the recipe's); ``recipe``: the TrainConfig they change (None:
    :func:`train_recipe`'s, the fine-tuning recipe when ``weights`` are given without
    ``linear_probe``, else the one from scratch)."""
    cfg = (
        train_recipe(fine_tune=weights is not None and not linear_probe, **train)
        if recipe is None
        else recipe_config(recipe, **train)
    )
    return TrainJob(
        model=model,
        data=data,
        train=cfg,
        out=str(out),
        weights=weights,
        reset_head=reset_head,
        input=input or InputOverrides(),
        linear_probe=linear_probe,
    )


def input_spec_for(
    model: nn.Module, dataset: str, *, weights: str | Path | None = None, overrides: InputOverrides | None = None
) -> InputSpec:
    """The one place that decides how images become ``model``'s input (arch.json ``input``).

    Size and channels always come from the model's own patch embedding. Normalisation,
    interpolation and crop:

    * with ``weights``: what the weights were made with: the ``input`` recorded in a nascompress
      file, else the timm model's pretrained config (``timm.data.resolve_data_config``; e.g.
      mean/std 0.5 and bicubic for augreg ``vit_small_patch16_224``, CLIP's own values for CLIP
      models, ImageNet's for DeiT and DINOv2; a ``name.tag`` selects that tag's config);
    * without (training from scratch): the dataset's (Fashion-MNIST mean/std, bilinear, the whole
      image), so such runs are unchanged;
    * ``overrides`` (explicit ``--mean/--std/--interpolation/--crop-pct``) win over both.

    Mean/std of another channel count are adapted: one value is repeated, three are averaged
    for a 1-channel model.
    """
    c, h, w = input_size(model)
    if weights is not None:
        base = dict(recorded_input(weights) or pretrained_data_config(model))
    else:
        mean, std = default_norm(dataset, c)
        base = dict(mean=mean, std=std, interpolation="bilinear", crop_pct=1.0, crop_mode="center")
    ov = overrides or InputOverrides()
    base.update({k: v for k, v in ov.to_dict().items() if v is not None})

    def chans(name: str) -> tuple[float, ...]:
        v = tuple(float(x) for x in base[name])
        if len(v) == c:
            return v
        if len(v) == 1 or c == 1:
            return (sum(v) / len(v),) * c
        raise SettingError(f"{{{name}}} has {len(v)} values but the model takes {c} channels")

    return InputSpec(
        (h, w),
        c,
        chans("mean"),
        chans("std"),
        interpolation=base["interpolation"],
        crop_pct=float(base["crop_pct"]),
        crop_mode=base["crop_mode"],
    )


def check_classes(num_model_classes: int, data: DataBundle, *, fix: str | None = None) -> None:
    """Refuse a dataset whose class count is not the model's; ``fix``: the advice (default: --num-classes)."""
    if num_model_classes != data.num_classes:
        raise SettingError(
            f"the model has {num_model_classes} classes but dataset {data.name} has "
            f"{data.num_classes}; {fix or f'set {{num_classes}} {data.num_classes}'}"
        )


def train(
    job: TrainJob, *, force: bool = False, resume: bool = False, explicit: set[str] | None = None
) -> TrainMetrics:
    """The ``nascompress train`` job: validate everything, then create the run and fit it; returns
    its metrics (:class:`~nascompress.train.metrics.TrainMetrics`: ``metrics.json`` less its
    completion mark).

    With ``resume`` the job stored in ``OUT/config.json`` is continued from its last checkpoint.
    Under torchrun every process runs this; rank 0 alone writes the run directory. ``explicit``: the
    options given on the command line, each of which must agree with the recorded job on resume
    (:meth:`~nascompress.runs.run_dir.RunDir.recorded`).
    """
    out = Path(job.out)
    if resume:
        job = RunDir.recorded(out, TrainJob, "nascompress train", given=job, explicit=explicit)
    elif job.weights:  # recorded absolute: a resume from another directory finds them
        job = replace(job, weights=os.path.abspath(job.weights))
    runtime.prepare_deterministic(job.train.deterministic)
    distributed.init(job.train.device)
    if job.linear_probe and distributed.world().size > 1:
        raise SettingError(
            "{linear_probe} runs in one process (it fits a head on cached features); run it without torchrun"
        )
    run = RunDir.prepare(out, force=force, resume=resume, inputs=(job.weights, *dataset_paths(job.data)))
    seed_everything(job.train.seed)  # the seed drives the initialisation too
    model = build_model(job.model)
    if job.weights:
        load_pretrained(model, job.weights, reset_head=job.reset_head or job.linear_probe)
        if not job.linear_probe and not resume and distributed.is_main():  # not silently: the recipe changes
            t = job.train
            lr = f"lr {t.lr:g}" if t.lr is not None else f"base lr {t.base_lr:g} per 512 images"
            ld = "off" if t.layer_decay in (None, 1) else f"{t.layer_decay:g}"
            head = ", from a linear-probe head" if job.from_probe else ""
            say(
                words(
                    f"train: {{weights}} given, so the fine-tuning recipe{head}: {lr}, layer decay {ld}, "
                    f"{t.warmup_epochs:g} warm-up epochs (for weights that were never trained, leave out {{weights}})"
                )
            )
    spec = input_spec_for(model, job.data.dataset, weights=job.weights, overrides=job.input)
    data = load_data(job.data, spec=spec, augment=not job.linear_probe)  # a probe's features: no augmentation
    check_classes(model.num_classes, data)
    arch = make_arch(job.model, input_spec=spec.to_dict(), labels=data.classes)
    with run.removed_if_unwritable():  # a full disk before the first checkpoint leaves no half-written run
        run.create(job.to_dict())
        if job.linear_probe:  # not checkpointed: a resumed probe runs again (it is deterministic)
            return run.finish(
                fit_linear_probe(model, data=data, input_spec=spec, cfg=job.train, out_dir=out, arch=arch)
            )
        if distributed.is_main() and not (out / ARCH_FILE).exists():
            write_arch_json(out, arch)
        distributed.barrier()  # the run directory is ready
        if job.from_probe:
            probe_data = data if data.extra.get("fixed_train_images") else load_data(job.data, spec=spec, augment=False)
            metrics = fine_tune_from_probe(
                model,
                data=data,
                probe_data=probe_data,
                input_spec=spec,
                cfg=job.train,
                out_dir=out,
                arch=arch,
                resume=resume,
            )
            return run.finish(metrics)
        return fit(model, data=data, input_spec=spec, cfg=job.train, out_dir=out, arch=arch, resume=resume)


def fine_tune_from_probe(
    model: nn.Module,
    *,
    data: DataBundle,
    probe_data: DataBundle,
    input_spec: InputSpec,
    cfg: TrainConfig,
    out_dir: Path | None = None,
    arch: dict[str, Any] | None = None,
    resume: bool = False,
) -> TrainMetrics:
    """LP-FT (Kumar et al. 2022): fit ``model.head`` as a linear probe on the frozen backbone's
    features (:func:`~nascompress.train.probe.fit_probe_head`, on ``probe_data``: the same splits,
    unaugmented), then fine-tune everything from it (:func:`~nascompress.train.loop.fit` on ``data``).

    The probe is the fine-tune's epoch 0, a candidate for the best model: when no fine-tuned epoch
    beats it on validation the probe is kept (``kept_probe`` in the metrics, and one line said).
    Returns ``fit``'s metrics (the run is not marked complete) plus ``probe_val_top1`` (the probe as
    the fine-tune measures every epoch), ``fine_tuned_val_top1`` (the best fine-tuned epoch's),
    ``kept_probe`` and ``probe`` (the probe's L2 and grid, a :class:`~nascompress.train.metrics.ProbeFit`
    of :func:`~nascompress.train.probe.fit_probe_head`'s).
    A resumed run fits the probe again (it is deterministic) for its figures; the fine-tune then
    continues from its checkpoint.
    """
    probe = fit_probe_head(model, data=probe_data, input_spec=input_spec, cfg=cfg)
    log: list[dict[str, Any]] = []
    cfg = cfg.replace(eval_start=True, keep="best")  # the probe is the first candidate: the guard
    metrics = fit(
        model,
        data=data,
        input_spec=input_spec,
        cfg=cfg,
        out_dir=out_dir,
        arch=arch,
        resume=resume,
        finish=False,
        log=log,
    )
    tuned = [r["val_top1"] for r in log if not r.get("start") and r.get("val_top1") is not None]
    kept = metrics.best_epoch == 0
    metrics = metrics.set(
        probe_val_top1=metrics.start_val_top1,
        fine_tuned_val_top1=max(tuned) if tuned else None,
        kept_probe=kept,
        probe=ProbeFit.new(
            **{k: probe.get(k) for k in ("val_top1", "l2", "l2_grid", "n_train", "n_val", "fit_time_s")}
        ),
    )
    if kept and tuned and distributed.is_main():
        say(
            f"train: fine-tuning did not beat its linear probe on validation (best fine-tuned epoch "
            f"{metrics.fine_tuned_val_top1:.2f}%, the probe {metrics.probe_val_top1:.2f}%): kept the probe"
        )
    return metrics


__all__ = [
    "FINE_TUNE_TRAIN",
    "PROBE_TRAIN",
    "build_job",
    "TRAIN_SETTINGS",
    "RUNTIME_SETTINGS",
    "recipe_config",
    "train_recipe",
    "TrainJob",
    "train",
    "fine_tune_from_probe",
]
