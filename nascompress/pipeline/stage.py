"""The pipeline's stages as one registry: a stage is one object (:class:`PipelineStage`) that says
which section of the config turns it on (the class of its keys, ``stages.<name>`` or the file's
``<name>``: the pipeline file is read with the class the registered stages compose,
:func:`config_class`), which steps it may plan (their names, files and lines are
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
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from .schema import SchemaContext, Section
from .sections import PipelineConfig, StagesSection
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
        plan: its steps, planned from the state and its section (every check made, nothing written).
        config: the class of its section (a :class:`~nascompress.pipeline.schema.Section` its module
            declares): its keys, under ``stages.<name>`` (or the file's ``<name>``, ``top_level``),
            validated as the file is read; the stage is on when the section is given.
        top_level: its section is a key of the file itself (after ``report``: ``export``), not of
            ``stages``.
        compresses: it compresses the model: a pipeline needs one such stage under ``stages``.
        section: what turns it on when that is not its own section (its section of a config, None: the
            stage is off); by default its ``config``'s section (:meth:`section_of`).
        when_off: the checks made when it is off (e.g. a setting of another section that needs it).
        decide: its entries in the summary's ``decisions`` (key -> a record or its dict; none: ``{}``),
            read from its files when the report is written, whether or not its section is on.
        report_lines: its lines in the report's decisions, from the summary's decisions (a stage's
            own key not typed by :class:`~nascompress.pipeline.summary.Decisions` is in its ``extra``).
    """

    name: str
    order: int
    steps: tuple[str, ...]
    plan: Callable[[PlanState, Any], StagePlan]
    config: type[Section] | None = None
    top_level: bool = False
    compresses: bool = False
    section: Callable[[PipelineConfig], Any] | None = None
    when_off: Callable[[PlanState], None] | None = None
    decide: Callable[[ReportState], Mapping[str, Any]] | None = None
    report_lines: Callable[[Decisions], list[str]] | None = None

    def __post_init__(self) -> None:
        if self.config is None and self.section is None:
            raise ValueError(f"pipeline stage {self.name!r}: give the class of its section (config) or its section")

    @property
    def path(self) -> str | None:
        """Its section's key path in the file (``stages.dcs``, ``export``; None: no section of its own)."""
        if self.config is None:
            return None
        return self.name if self.top_level else f"stages.{self.name}"

    def section_of(self, cfg: PipelineConfig) -> Any:
        """Its section of ``cfg`` (None: the stage is off)."""
        if self.section is not None:
            return self.section(cfg)
        return getattr(cfg if self.top_level else cfg.stages, self.name)


_STAGES: dict[str, PipelineStage] = {}


def register_stage(stage: PipelineStage) -> PipelineStage:
    """Add ``stage`` to the registry (a name taken by another stage, or an order taken, is refused)."""
    other = _STAGES.get(stage.name)
    if other is not None and other != stage:
        raise ValueError(f"pipeline stage {stage.name!r} is already registered")
    clash = [s.name for s in _STAGES.values() if s.order == stage.order and s.name != stage.name]
    if clash:
        raise ValueError(f"pipeline stage {stage.name!r}: order {stage.order} is taken by {clash[0]!r}")
    if stage.config is not None and stage.top_level and stage.name in PipelineConfig.keys():
        raise ValueError(f"pipeline stage {stage.name!r}: the file's key {stage.name} is taken")
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


_CONFIGS: dict[tuple[Any, ...], type[PipelineConfig]] = {}  # made once per set of stages


def config_class() -> type[PipelineConfig]:
    """The class a pipeline file is read with: :class:`~nascompress.pipeline.sections.PipelineConfig`
    whose ``stages`` is a :class:`~nascompress.pipeline.sections.StagesSection` with a key for each
    registered stage's section (its ``config``, optional, in the stages' order), and a key of the
    file after ``report`` for each ``top_level`` one (``export``)."""
    own = [s for s in registered_stages() if s.config is not None]
    key = tuple((s.name, s.config, s.top_level, s.compresses) for s in own)
    made = _CONFIGS.get(key)
    if made is None:
        under = [s for s in own if not s.top_level]
        stages = make_dataclass(
            "StagesSection",
            [(s.name, s.config | None, field(default=None)) for s in under],  # type: ignore[operator]
            bases=(StagesSection,),
            frozen=True,
            namespace={"__module__": __name__, "compressing": tuple(s.name for s in under if s.compresses)},
        )
        stages.__doc__ = StagesSection.__doc__
        keys = next(f for f in fields(PipelineConfig) if f.name == "stages")
        top = [(s.name, s.config | None, field(default=None)) for s in own if s.top_level]  # type: ignore[operator]
        made = make_dataclass(
            "PipelineConfig",
            [("stages", stages, field(metadata=keys.metadata)), *top],
            bases=(PipelineConfig,),
            frozen=True,
            kw_only=True,
            namespace={"__module__": __name__},
        )
        made.__doc__ = PipelineConfig.__doc__
        _CONFIGS[key] = made
    return made


__all__ = [
    "PipelineStage",
    "PlanState",
    "ReportState",
    "StagePlan",
    "config_class",
    "register_stage",
    "registered_stages",
    "step_names",
]
