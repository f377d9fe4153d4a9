"""``nascompress finetune``: apply a method to a dense run and train it with the method's recipe.

A method that can be fine-tuned registers a :class:`Recipe` with :func:`register_recipe`. The
job is always the same: load the dense run, ``recipe.prepare`` patches the model and returns the
method's ``arch.json`` record, then either save at once (``zero_shot``) or :func:`train.fit`
with ``recipe.hooks`` (the method's losses and schedules, against the dense run as teacher).
"""
from __future__ import annotations

import copy
import importlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from torch import nn

from .api import run_data_config
from .data import DataConfig, InputSpec, load_data
from .errors import NascompressError
from .evaluate import evaluate
from .io import load_with_arch, save_model
from .train import TrainConfig, TrainHooks, check_classes, fit
from .utils import create_out_dir, prepare_out_dir, resolve_device, seed_everything, write_json


class Recipe:
    """A method's fine-tuning recipe. Subclass and register with :func:`register_recipe`."""

    def prepare(self, model: nn.Module, config: dict[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
        """Validate ``config`` (reject unknown keys), patch ``model``; return it and its record."""
        raise NotImplementedError

    def hooks(self, model: nn.Module, record: dict[str, Any], *, teacher: nn.Module, train_cfg: TrainConfig) -> TrainHooks:
        """The training hooks (losses against ``teacher``, schedules) for this method."""
        return TrainHooks()


_RECIPES: dict[str, Callable[[], Recipe]] = {}
_RECIPE_MODULES = ("evit", "dynamicvit", "sparsifiner", "mgvit")


def register_recipe(name: str) -> Callable[[type[Recipe]], type[Recipe]]:
    def deco(cls: type[Recipe]) -> type[Recipe]:
        if name in _RECIPES and _RECIPES[name] is not cls:
            raise ValueError(f"recipe {name!r} is already registered")
        _RECIPES[name] = cls
        return cls
    return deco


def get_recipe(name: str) -> Recipe:
    if name not in _RECIPES:
        for mod in _RECIPE_MODULES:
            try:
                importlib.import_module(f"nascompress.methods.{mod}")
            except ModuleNotFoundError as e:
                if e.name != f"nascompress.methods.{mod}":
                    raise
    if name not in _RECIPES:
        raise NascompressError(f"unknown method {name!r}; available: {', '.join(sorted(_RECIPES)) or 'none'}")
    return _RECIPES[name]()


@dataclass(frozen=True)
class FinetuneJob:
    """Everything ``nascompress finetune`` needs; written to ``config.json`` of the output run.

    Args:
        run_dir: the dense (or DCS) nascompress run to start from; also the teacher.
        method: a registered recipe name (evit, dynamicvit, sparsifiner, mgvit).
        method_config: the method's settings (validated by the recipe).
        zero_shot: apply the method without training and save.
    """

    run_dir: str
    method: str
    method_config: dict[str, Any] = field(default_factory=dict)
    data: DataConfig | None = None
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=2, lr=1e-4, warmup_epochs=0.0))
    out: str = "runs/finetuned"
    zero_shot: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return d


def finetune(job: FinetuneJob, *, force: bool = False, resume: bool = False) -> dict[str, Any]:
    """Run ``job``; returns metrics (test top-1 of the saved model, and of the dense teacher)."""
    out = Path(job.out)
    prepare_out_dir(out, force=force, resume=resume)
    recipe = get_recipe(job.method)
    device = resolve_device(job.train.device)
    teacher, base_arch = load_with_arch(job.run_dir, map_location=device)
    seed_everything(job.train.seed)
    model, record = recipe.prepare(copy.deepcopy(teacher), dict(job.method_config))
    arch = copy.deepcopy(base_arch)
    arch["methods"] = list(arch["methods"]) + [record]
    data_cfg = job.data or run_data_config(job.run_dir) or DataConfig()
    spec = InputSpec.from_dict(arch["input"])
    data = load_data(data_cfg, img_size=spec.img_size)
    check_classes(model.num_classes, data)
    create_out_dir(out, force=force, resume=resume)
    write_json(out / "config.json", dict(job.to_dict(), data=asdict(data_cfg)))
    if job.zero_shot:
        save_model(out, model, arch)
        res = evaluate(model, data.test, input_spec=spec, device=device, batch_size=job.train.eval_batch_size)
        metrics = {"test_top1": res["top1"], "test_loss": res["loss"], "test_n": res["n"], "zero_shot": True}
    else:
        teacher.eval().requires_grad_(False)
        hooks = recipe.hooks(model, record, teacher=teacher, train_cfg=job.train)
        metrics = fit(model, data=data, input_spec=spec, cfg=job.train, out_dir=out, arch=arch, hooks=hooks,
                      resume=resume)
        metrics["zero_shot"] = False
    metrics["method"] = job.method
    write_json(out / "metrics.json", metrics)
    return metrics
