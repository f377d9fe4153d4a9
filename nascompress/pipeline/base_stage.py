"""Planning a pipeline's base stage (:func:`plan_base`: a finished run, a model trained from scratch or
a classifier imported from a weights file) and the checks and settings every stage's plan shares:
the dataset exists (:func:`check_data`), the data config (:func:`data_config`) and the runtime
settings (:func:`runtime_values`) a stage runs with; :mod:`nascompress.pipeline.plan` plans the
rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import NascompressError
from .schema import SchemaContext, library_config, library_values, section_error
from ..data import BUILTIN_DATASETS, DataConfig, load_data
from .sections import DATASET_KEYWORDS, PipelineConfig
from ..importer.run import (
    ImportJob,
    build_job as build_import_job,
    import_model,
    weights_grid_size,
    weights_kwargs,
    weights_shapes,
)
from ..data import count_classes
from ..runs.io import read_arch
from ..models.build import ModelShape, ModelSpec, build_model
from ..models.weights import read_weights_file
from ..train.run import PROBE_TRAIN, RUNTIME_SETTINGS, TRAIN_SETTINGS, build_job as build_train_job, train
from .steps import Step


_FROM_PROBE = ", from a linear-probe head"  # base.train's description when it fine-tunes from a probe (LP-FT)


def data_config(cfg: PipelineConfig, *, train_limit: int | None = None) -> Any:
    stage = {"train_limit": train_limit} if train_limit is not None else {}  # a stage's own training images
    return library_config(cfg.data, DataConfig, split_seed=0, subset_seed=cfg.seed, **stage)


def runtime_values(cfg: PipelineConfig) -> dict[str, Any]:
    """The top-level settings every training stage runs with (seed, device, amp, deterministic)."""
    return library_values(cfg, RUNTIME_SETTINGS)


def check_data(cfg: PipelineConfig, ctx: SchemaContext) -> int:
    """The dataset exists; returns its class count."""
    d = cfg.data
    if d.dataset == "fashion-mnist":
        need = Path(d.data_dir) / "train-images-idx3-ubyte.gz"
        if not need.is_file():
            raise ctx.err(
                "data.data_dir",
                f"Fashion-MNIST is not in {d.data_dir} (no {need.name}); install the "
                "Debian package dataset-fashion-mnist or point data_dir at its IDX files",
            )
    elif d.dataset not in DATASET_KEYWORDS and not (Path(d.dataset) / "train").is_dir():
        raise ctx.err(
            "data.dataset",
            f"{d.dataset} is neither a built-in dataset ({BUILTIN_DATASETS}) nor an "
            "ImageFolder root with a train/ folder",
        )
    try:
        n = count_classes(data_config(cfg))
        if d.dataset not in DATASET_KEYWORDS:  # an ImageFolder: its images and classes, before anything is written
            load_data(data_config(cfg))
        return n
    except NascompressError as e:
        raise ctx.err("data.dataset", str(e)) from None


def built_model(spec: Any, ctx: SchemaContext, where: str) -> Any:
    try:
        return build_model(spec)
    except NascompressError as e:
        raise ctx.err(where, str(e)) from None


def plan_base(cfg: PipelineConfig, out: Path, ctx: SchemaContext, n_classes: int) -> tuple[Step | None, Path, Any]:
    """The base step, the base run directory, and the dense model (built, for its depth)."""
    b, data, base_dir = cfg.base, data_config(cfg), out / "base"
    if b.kind == "run":
        try:
            arch = read_arch(b.run)
        except NascompressError as e:
            raise ctx.err("base.run", str(e)) from None
        if arch.methods:
            raise ctx.err(
                "base.run",
                f"{b.run} is not a dense run (it applies "
                f"{', '.join(arch.method_names)}); give the dense run it came "
                "from, so the result is compared with the uncompressed model",
            )
        model = built_model(arch.spec, ctx, "base.run")
        if model.num_classes != n_classes:
            raise ctx.err(
                "base.run",
                f"the run's model has {model.num_classes} classes but dataset {cfg.data.dataset} has {n_classes}",
            )
        step = Step("base", None, "redo", lambda **kw: {"run": b.run}, describe=f"the dense run {b.run}")
        return step, Path(b.run), model
    if b.kind == "train":
        t = b.train
        if t.weights is not None and not Path(t.weights).is_file():
            raise ctx.err("base.train.weights", f"file {t.weights} does not exist")
        try:
            spec = library_config(t, ModelShape).spec(n_classes)
            job = build_train_job(
                spec,
                base_dir,
                data=data,
                train={**library_values(t, TRAIN_SETTINGS), **runtime_values(cfg)},
                weights=t.weights,
                reset_head=t.reset_head,
            )
        except NascompressError as e:
            raise section_error(ctx, "base.train", t, e) from None
        model = built_model(spec, ctx, "base.train")
        return (
            Step(
                "base",
                base_dir,
                "train",
                lambda force, resume: train(job, force=force, resume=resume),
                outputs=("base/model.safetensors", "base/metrics.json"),
                describe=f"train the dense base ({t.epochs} epochs{_FROM_PROBE if job.from_probe else ''})",
            ),
            base_dir,
            model,
        )
    imp = b.import_
    if not Path(imp.weights).is_file():
        raise ctx.err("base.import.weights", f"file {imp.weights} does not exist")
    shapes = weights_shapes(imp.weights)
    if shapes is not None and not imp.linear_probe:
        head = shapes.get("head.weight")
        if head is None:
            raise ctx.err(
                "base.import.linear_probe",
                f"the weights in {imp.weights} have no classifier head (a "
                "backbone-only checkpoint); set linear_probe: true to fit one",
            )
        if imp.num_classes is None and head[0] != n_classes:
            raise ctx.err(
                "base.import.weights",
                f"the weights' head has {head[0]} classes but dataset "
                f"{cfg.data.dataset} has {n_classes}; set linear_probe: true to fit "
                "a new head",
            )
    if imp.linear_probe:
        kwargs: dict[str, Any] = {"num_classes": imp.num_classes or n_classes}
        if imp.num_heads is not None:
            kwargs["num_heads"] = imp.num_heads
        size = imp.img_size
        if size is None:
            try:
                size = weights_grid_size(
                    built_model(ModelSpec(imp.model, dict(kwargs)), ctx, "base.import.model"), imp.weights
                )
            except NascompressError as e:
                raise ctx.err("base.import.weights", str(e)) from None
        if size is not None:
            kwargs["img_size"] = size
        spec = ModelSpec(imp.model, kwargs)
        model = built_model(spec, ctx, "base.import.model")
        try:
            job = build_train_job(
                spec,
                base_dir,
                data=data,
                recipe=PROBE_TRAIN,
                train={"seed": cfg.seed, "device": cfg.device, "eval_batch_size": imp.eval_batch_size},
                weights=imp.weights,
                reset_head=True,
                linear_probe=True,
            )
        except NascompressError as e:
            raise section_error(ctx, "base.import", imp, e) from None
        return (
            Step(
                "base",
                base_dir,
                "train",
                lambda force, resume: train(job, force=force, resume=resume),
                outputs=("base/model.safetensors", "base/metrics.json"),
                describe=f"import {imp.model} and fit a linear-probe head",
            ),
            base_dir,
            model,
        )

    job = build_import_job(library_values(imp, ImportJob), base_dir, data=data, device=cfg.device)
    try:  # the model the weights describe (every shape read from them), as the import builds it
        kwargs = weights_kwargs(job, read_weights_file(imp.weights))[0]
    except NascompressError as e:
        raise ctx.err("base.import.weights", str(e)) from None
    kwargs["num_classes"] = imp.num_classes or n_classes
    model = built_model(ModelSpec(imp.model, kwargs), ctx, "base.import.model")
    return (
        Step(
            "base",
            base_dir,
            "redo",
            lambda force, resume: import_model(job, force=force),
            outputs=("base/model.safetensors", "base/metrics.json"),
            describe=f"import {imp.model} from {imp.weights}",
        ),
        base_dir,
        model,
    )
