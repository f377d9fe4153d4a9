"""The method contract and its one registry.

A compression method is one module that defines one :class:`Method` subclass and registers it
with :func:`register_method` (its parts may live in sibling modules named after it, e.g.
``dcs_gates``, which it imports; only the modules of ``_METHOD_MODULES`` register methods). The
subclass says, in one place:

* ``config_cls``: its settings, a frozen :class:`~nascompress.config.Config` dataclass (validated;
  fields with ``metadata={"help": ...}`` become ``nascompress finetune`` options);
* ``recipe_cls``: its training recipe settings (None: the method is not fine-tuned by
  ``finetune``), and ``train_overrides``: what its fine-tune changes in the generic fine-tuning
  recipe (:data:`nascompress.train.finetune.FINETUNE_TRAIN`): base learning rate (per 512 images),
  warm-up and epochs (:class:`TrainOverrides`);
* ``stacks_on``: the methods that may already be applied to a model before this one, which also
  fixes the order (e.g. ``dcs`` -> ``sparsifiner`` -> ``evit``); any other combination is refused;
* ``off_config`` / ``paper_config``: compression off (the plain timm model) and the paper's
  setting, which the Optuna searches run first;
* ``resolve``: the config checked against a model (depth, tokens, prefix tokens);
* ``patch``: how it changes the model (in place; timm state-dict keys kept, new parameters get
  new names), rebuilt from its ``arch.json`` record alone;
* ``prepare``: a fresh patch for fine-tuning or zero-shot use (initialisation from the dense
  weights where the method needs it); ``hooks``: its recipe for :func:`nascompress.train.run.fit`.

:func:`apply_methods` (used by :func:`nascompress.load`) applies records in order through
:meth:`Method.apply`, which checks stacking first. Method modules import
:mod:`nascompress.train.hooks` only, never the training engine.
"""

from __future__ import annotations

from .. import _compat  # noqa: F401  (before timm imports torchvision)

import copy
import dataclasses
import importlib
from typing import Any, ClassVar

from torch import nn

from ..config import Config
from ..errors import NascompressError

# Modules that register methods; imported lazily so that importing nascompress stays cheap.
_METHOD_MODULES = ("dcs", "uniform", "sparsifiner", "evit", "dynamicvit", "mgvit", "mgvit_h", "tome")
_METHODS: dict[str, "Method"] = {}


@dataclasses.dataclass(frozen=True)
class TrainOverrides:
    """The training values a method's fine-tune changes in the generic fine-tuning recipe
    (:data:`nascompress.train.finetune.FINETUNE_TRAIN`, a TrainConfig; None: the recipe's): typed here
    because methods never import the training engine."""

    epochs: int | None = None
    base_lr: float | None = None
    warmup_epochs: float | None = None

    def changes(self) -> dict[str, Any]:
        """The TrainConfig fields this sets (for ``TrainConfig.replace``)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


class Method:
    """One compression method (see the module docstring for the contract)."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    config_cls: ClassVar[type[Config]]
    recipe_cls: ClassVar[type[Config] | None] = None
    train_overrides: ClassVar[TrainOverrides] = TrainOverrides()
    stacks_on: ClassVar[frozenset[str]] = frozenset()
    # the models it patches: "vit" (timm's plain VisionTransformer) or "pyramid" (PVT v2)
    model_kind: ClassVar[str] = "vit"
    # configurations a search enqueues first: compression off (the plain model) and the paper's
    off_config: ClassVar[dict[str, Any] | None] = None
    paper_config: ClassVar[dict[str, Any] | None] = None
    # a predictor-only stage to run before a zero-shot model is scored (:meth:`calibrate`); a
    # search gives every such method the same step budget, training-free methods use none of it
    calibrates: ClassVar[bool] = False
    # whether ``nascompress export`` has a path for it (a traceable inference path, or one swapped in)
    exportable: ClassVar[bool] = True
    # whether the pipeline's ``tokens`` stage runs it (an Optuna study of its settings; ``nc.compress``'s
    # ``methods=``): the methods that act on a model's tokens or attention at inference
    token_stage: ClassVar[bool] = False

    # ---- what a subclass implements -----------------------------------------------------------
    def resolve(self, model: nn.Module, cfg: Config) -> Config:
        """``cfg`` checked against ``model`` with model-dependent defaults filled in."""
        return cfg

    def patch(self, model: nn.Module, cfg: Config, record: dict[str, Any]) -> nn.Module:
        """Change ``model`` in place as ``record`` describes (its ``config`` already resolved)."""
        raise NotImplementedError

    def prepare(self, model: nn.Module, cfg: Config, recipe: Config | None) -> tuple[nn.Module, dict[str, Any]]:
        """Patch a dense (or already compressed) model for fine-tuning / zero-shot use; return it
        and its record. The default patches from a fresh record."""
        record = self.make_record(cfg, recipe)
        return self.patch(model, cfg, record), record

    def hooks(self, model: nn.Module, record: dict[str, Any], *, teacher: nn.Module, train_cfg: Any):
        """The recipe's :class:`~nascompress.train.hooks.TrainHooks` (losses against ``teacher``, schedules)."""
        raise NascompressError(f"{self.name} has no fine-tuning recipe")

    def calibrate(
        self, model: nn.Module, record: dict[str, Any], *, teacher: nn.Module, batches: Any, steps: int | None = None
    ) -> dict[str, float]:
        """A short stage that trains only the method's new parameters (backbone frozen) so that a
        zero-shot model is meaningful; ``batches`` yields preprocessed (x, y). ``steps``: that many
        optimizer steps (None: the recipe's own count, ``finetune --zero-shot``). Returns its logs
        with ``steps``, the optimizer steps taken. Methods with such a stage set ``calibrates``.
        Default: nothing (training-free)."""
        return {}

    # ---- shared machinery --------------------------------------------------------------------
    def make_record(self, cfg: Config, recipe: Config | None = None) -> dict[str, Any]:
        rec: dict[str, Any] = {"name": self.name, "config": cfg.to_dict()}
        if recipe is not None:
            rec["recipe"] = recipe.to_dict()
        return rec

    def config(self, model: nn.Module, config: dict[str, Any] | Config) -> Config:
        cfg = config if isinstance(config, Config) else self.config_cls.from_dict(config, what=self.name)
        return self.resolve(model, cfg)

    def recipe(self, recipe: dict[str, Any] | Config | None) -> Config | None:
        if self.recipe_cls is None:
            if recipe:
                raise NascompressError(f"{self.name} has no training recipe; got recipe settings {sorted(recipe)}")
            return None
        if isinstance(recipe, Config):
            return recipe
        return self.recipe_cls.from_dict(recipe, what=f"{self.name} recipe")

    def check_stack(self, model: nn.Module) -> None:
        """Refuse to apply this method on top of methods it cannot follow (or twice)."""
        applied = list(getattr(model, "nc_methods", []))
        bad = [m for m in applied if m not in self.stacks_on]
        if bad:
            allowed = ", ".join(sorted(self.stacks_on)) or "no other method"
            raise NascompressError(
                f"{self.name} cannot be applied after {', '.join(bad)} (it stacks on {allowed}, in "
                f"that order); applied so far: {', '.join(applied)}"
            )

    def _mark(self, model: nn.Module) -> None:
        model.nc_methods = [*getattr(model, "nc_methods", []), self.name]

    def check_record(self, record: dict[str, Any]) -> None:
        """Check a record read from a file before any model is built: its ``config`` read by
        :attr:`config_cls` (types, ranges); a method whose record holds more (DCS's and uniform's
        kept channels) checks that too. Counts and indices against the model's layers are checked
        when it is built (:meth:`apply`)."""
        config = record.get("config")
        if config is not None and not isinstance(config, dict):
            raise NascompressError(f"config must be an object of settings, got {type(config).__name__}")
        self.config_cls.from_dict(config, what=self.name)

    def apply(self, model: nn.Module, record: dict[str, Any]) -> nn.Module:
        """Rebuild this method on ``model`` from its arch.json record (stacking checked first)."""
        self.check_stack(model)
        cfg = self.config(model, record.get("config", {}))
        model = self.patch(model, cfg, dict(record, config=cfg.to_dict()))
        self._mark(model)
        return model

    def prepare_fresh(
        self, model: nn.Module, config: dict[str, Any] | Config, recipe: dict[str, Any] | Config | None = None
    ) -> tuple[nn.Module, dict[str, Any]]:
        """Validate, check stacking and :meth:`prepare` (the entry point of finetune and the searches)."""
        self.check_stack(model)
        cfg = self.config(model, config)
        model, record = self.prepare(model, cfg, self.recipe(recipe))
        self._mark(model)
        return model, record

    def is_off(self, model: nn.Module, config: dict[str, Any] | Config) -> bool:
        """Whether ``config`` turns this method off on ``model``: every setting of :attr:`off_config` at
        its off value (a per-layer list: every entry), so that applying it changes no output (its
        identity test) and the model without it is the same model, cheaper to run."""
        if not self.off_config:
            return False
        cfg = self.config(model, config).to_dict()

        def off(value: Any, at: Any) -> bool:
            return all(v == at for v in value) if isinstance(value, (list, tuple)) else value == at

        return all(off(cfg.get(k), at) for k, at in self.off_config.items())

    def cli_fields(self) -> list[dataclasses.Field]:
        """The config and recipe fields exposed as CLI options (those with a ``help`` metadata)."""
        out = [f for f in dataclasses.fields(self.config_cls) if f.metadata.get("help")]
        if self.recipe_cls is not None:
            out += [f for f in dataclasses.fields(self.recipe_cls) if f.metadata.get("help")]
        return out


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator: register one instance of ``cls`` under ``cls.name`` (duplicates refused)."""
    name = cls.name
    if name in _METHODS and type(_METHODS[name]) is not cls:
        raise ValueError(f"method {name!r} is already registered by {type(_METHODS[name]).__module__}")
    _METHODS[name] = cls()
    return cls


def _import_all() -> None:
    for mod in _METHOD_MODULES:
        importlib.import_module(f"{__name__}.{mod}")


def get_method(name: str) -> Method:
    if name not in _METHODS:
        _import_all()
    if name not in _METHODS:
        raise NascompressError(f"unknown method {name!r}; available: {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def available_methods() -> list[str]:
    _import_all()
    return sorted(_METHODS)


def method_names(*, exportable: bool | None = None, token_stage: bool | None = None) -> tuple[str, ...]:
    """The registered methods (in the order they register) whose class says so: ``exportable``,
    ``token_stage`` (None: either)."""
    _import_all()
    return tuple(
        name
        for name, m in _METHODS.items()
        if (exportable is None or m.exportable == exportable) and (token_stage is None or m.token_stage == token_stage)
    )


def check_records(records: Any, *, source: str) -> None:
    """Check the method records of an arch read from ``source`` (a file: each record's
    :meth:`Method.check_record`), refusing a damaged one in one line naming the file and the record."""
    damaged = "the file was not written by nascompress or was edited: replace it"
    if not isinstance(records, list):
        raise NascompressError(f"{source}: methods must be a list of method records; {damaged}")
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or not isinstance(rec.get("name"), str):
            raise NascompressError(f"{source}: methods[{i}] must be an object with a method name; {damaged}")
        try:
            get_method(rec["name"]).check_record(rec)
        except NascompressError as e:  # a SettingError's fields as the record's keys (its bare names)
            raise NascompressError(f"{source}: methods[{i}] ({rec['name'][:40]}): {e}; {damaged}") from None


def check_index_list(v: Any, what: str, *, nested: bool = False) -> None:
    """Refuse a recorded list of channel indices (``nested``: one such list per head) that is not
    a list of integers (no strings, floats or bools: they would be read as other channels)."""
    rows = v if nested and isinstance(v, list) else [v]
    for row in rows:
        if not isinstance(row, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in row):
            kind = "a list of lists (one per head) of channel indices" if nested else "a list of channel indices"
            raise NascompressError(f"{what} must be {kind} (integers)")


def apply_methods(model: nn.Module, records: list[dict[str, Any]], *, inplace: bool = False) -> nn.Module:
    """Apply every recorded method in order (stacking checked) to a copy of ``model``, which is left
    as it was (so the same model can take several stacks); ``inplace``: patch ``model`` itself (a
    model built only for this, e.g. by :func:`nascompress.runs.io.load_with_arch`, saves the copy)."""
    if not inplace:
        model = copy.deepcopy(model)
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or "name" not in rec:
            raise NascompressError(f"arch.json method record {i} has no name")
        model = get_method(rec["name"]).apply(model, rec)
    return model


__all__ = [
    "Method",
    "TrainOverrides",
    "register_method",
    "get_method",
    "available_methods",
    "apply_methods",
    "check_records",
    "check_index_list",
]
