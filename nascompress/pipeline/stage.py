"""The pipeline's stages as one registry: a stage is one object (:class:`PipelineStage`) that says
which section of the config turns it on, which steps it may plan (their names, files and lines are
the :class:`~nascompress.pipeline.steps.Step` objects its ``plan`` returns), which model it leaves
to the next stage, and what the report says of it: its entries in ``summary.json``'s ``decisions``
(``decide``) and its lines in the report's decisions (``report_lines``). The built-in stages are the
modules of :mod:`nascompress.pipeline.stages` (each registers itself with :func:`register_stage` when
imported; every module of that package is imported): a new stage is one new module there.
:func:`~nascompress.pipeline.plan.plan` plans the dense base, then every registered stage in
``order``, then the report."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from .schema import SchemaContext
from .sections import PipelineConfig
from .steps import Pipeline, Step
from .summary import Decisions


@dataclass(frozen=True)
class PlanState:
    """What a stage is planned from: the validated config, the pipeline's folder, how errors name the
    config, the dense base (its run and model) and the model the stages before it leave (``current``)."""

    cfg: PipelineConfig
    out: Path
    ctx: SchemaContext
    base_dir: Path
    dense: Any
    current: Path


@dataclass(frozen=True)
class StagePlan:
    """A stage's planned steps, the model they leave (None: the one before), and the study storage
    they write (the tokens stage's, for the pipeline)."""

    steps: list[Step]
    model: Path | None = None
    storage: str | None = None


@dataclass(frozen=True)
class ReportState:
    """What a stage's decisions are read from when the report is written: the planned pipeline, the
    final model's run (None: no compressed model could be made), its method records (``arch.json``'s,
    as dicts) and the dense base's model."""

    pipe: Pipeline
    final_dir: Path | None
    methods: tuple[Mapping[str, Any], ...]
    dense: Any


@dataclass(frozen=True)
class PipelineStage:
    """One stage of the pipeline.

    Args:
        name: its name (the config section's key, ``dcs``; ``export``).
        order: where it runs among the stages (lower first).
        steps: the names of every step it may plan, in order (``OUT/done/<step>.json``).
        section: its section of a config (None: the stage is off).
        plan: its steps, planned from the state and its section (every check made, nothing written).
        when_off: the checks made when it is off (e.g. a setting of another section that needs it).
        decide: its entries in the summary's ``decisions`` (key -> a record or its dict; none: ``{}``),
            read from its files when the report is written, whether or not its section is on.
        report_lines: its lines in the report's decisions, from the summary's decisions (a stage's
            own key not typed by :class:`~nascompress.pipeline.summary.Decisions` is in its ``extra``).
    """

    name: str
    order: int
    steps: tuple[str, ...]
    section: Callable[[PipelineConfig], Any]
    plan: Callable[[PlanState, Any], StagePlan]
    when_off: Callable[[PlanState], None] | None = None
    decide: Callable[[ReportState], Mapping[str, Any]] | None = None
    report_lines: Callable[[Decisions], list[str]] | None = None


_STAGES: dict[str, PipelineStage] = {}


def register_stage(stage: PipelineStage) -> PipelineStage:
    """Add ``stage`` to the registry (a name taken by another stage, or an order taken, is refused)."""
    other = _STAGES.get(stage.name)
    if other is not None and other != stage:
        raise ValueError(f"pipeline stage {stage.name!r} is already registered")
    clash = [s.name for s in _STAGES.values() if s.order == stage.order and s.name != stage.name]
    if clash:
        raise ValueError(f"pipeline stage {stage.name!r}: order {stage.order} is taken by {clash[0]!r}")
    _STAGES[stage.name] = stage
    return stage


def registered_stages() -> tuple[PipelineStage, ...]:
    """Every registered stage in its order (the built-in ones imported first)."""
    stages = importlib.import_module(f"{__package__}.stages")  # (its modules import this one)
    for mod in pkgutil.iter_modules(stages.__path__):
        importlib.import_module(f"{stages.__name__}.{mod.name}")  # each registers its stage
    return tuple(sorted(_STAGES.values(), key=lambda s: s.order))


def step_names() -> tuple[str, ...]:
    """Every step a pipeline may run, in order: the base, each stage's, the report."""
    return ("base", *(n for s in registered_stages() for n in s.steps), "report")


__all__ = [
    "PipelineStage",
    "PlanState",
    "ReportState",
    "StagePlan",
    "register_stage",
    "registered_stages",
    "step_names",
]
