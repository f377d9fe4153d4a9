"""The pipeline file's own sections: one frozen dataclass per YAML section (``data``, ``base``,
``goal``, ``report``), the base of ``stages`` (:class:`StagesSection`) and :class:`PipelineConfig`,
the whole file but for the stages' sections. A stage's section (``stages.dcs``, ``export``) is
declared in the stage's module (:mod:`nascompress.pipeline.stages`) with the helpers here
(:data:`STAGE_DATA_SETTINGS`, :func:`data_pointers`); the file is read with the class the registered
stages compose (:func:`~nascompress.pipeline.stage.config_class`)."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from typing import Any

from ..data import DATASET_KEYWORDS, DataConfig  # noqa: F401 (DATASET_KEYWORDS: read from here too)
from ..config import StageSettings, offered, setting
from ..errors import NascompressError
from ..importer.run import ImportJob
from ..models.build import ModelShape
from ..profiling.config import ProfileConfig
from ..studies.trials import SearchJob
from ..train.run import FINE_TUNE_TRAIN, RUNTIME_SETTINGS, TRAIN_SETTINGS, TrainJob
from ..train.config import TrainConfig
from .schema import KeyProblem, check_lr_pair, check_one_of, Section, library_keys, opt

FORMAT = "nascompress-pipeline/1"
# the data's setting a training stage may narrow for itself (DataConfig's train_limit, same help)
STAGE_DATA_SETTINGS = StageSettings(DataConfig, ("train_limit",))


def data_pointers(taken: tuple[str, ...] = STAGE_DATA_SETTINGS.names) -> dict[str, str]:
    """Where the data settings a stage does not take go (a command's ``--eval-limit`` is the
    pipeline's ``data.eval_limit``: every stage evaluates on the same images)."""
    return {
        f.name: f"{f.name} is set once for every stage, under data: (data.{f.name})"
        for f, _, _ in offered(DataConfig)
        if f.name not in taken
    }


@dataclass(frozen=True)
@library_keys(DataConfig)
class DataSection(Section):
    """``data``: the dataset every stage uses: every user-facing field of
    :class:`~nascompress.data.DataConfig` (declared there, with its checks; ``dataset`` and
    ``data_dir`` are paths resolved against the file's directory, but for 'fashion-mnist' and
    'synthetic')."""


@dataclass(frozen=True)
@library_keys(
    ModelShape,
    StageSettings(TrainJob, ("weights", "reset_head")),
    TRAIN_SETTINGS,
    lead=(*(f.name for f in fields(ModelShape)), "weights", "reset_head"),
)
class BaseTrainSection(Section):
    """``base.train``: train the dense base (``nascompress train``): a custom ViT or a timm ``model``
    (the model's keys are :class:`~nascompress.models.build.ModelShape`'s, ``nascompress train``'s options).
    The training keys are :data:`~nascompress.train.run.TRAIN_SETTINGS` (``nascompress train``'s options);
    null: the recipe's (:func:`~nascompress.train.run.train_recipe`: from scratch, or fine-tuning with
    ``weights``). ``warmup_epochs`` and ``layer_decay`` null are filled in with the recipe's here, so
    the normalized config (``OUT/config.yaml``) says what runs, and a run written when they were fixed
    keys (warm-up 1, no layer decay) is still the same config."""

    def __post_init__(self) -> None:
        check_lr_pair(self)
        if self.reset_head and self.weights is None:
            raise KeyProblem("reset_head", "needs weights (a new head on a pretrained backbone)")
        recipe = FINE_TUNE_TRAIN if self.fine_tune else TrainConfig()
        for name in ("warmup_epochs", "layer_decay"):  # the defaults that depend on the weights
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(recipe, name))

    @property
    def fine_tune(self) -> bool:
        """A pretrained start: ``nascompress train``'s fine-tuning recipe."""
        return self.weights is not None


@dataclass(frozen=True)
@library_keys(
    ImportJob,
    StageSettings(TrainJob, ("linear_probe",)),
    lead=("model", "weights", "img_size", "num_classes", "linear_probe"),
)
class BaseImportSection(Section):
    """``base.import``: a user's timm model from local weights (``nascompress import``: its settings,
    :class:`~nascompress.importer.run.ImportJob`'s, same names), or with ``linear_probe`` a new head
    fitted on the frozen backbone (``nascompress train --linear-probe``)."""


@dataclass(frozen=True)
class BaseSection(Section):
    """``base``: exactly one of ``run`` (an existing dense run directory), ``train``, ``import``."""

    _yaml_names: typing.ClassVar[dict[str, str]] = {"import_": "import"}

    run: str | None = opt(None, path=True)
    train: BaseTrainSection | None = None
    import_: BaseImportSection | None = None

    def __post_init__(self) -> None:
        check_one_of(self, {"run": "run", "train": "train", "import_": "import"}, "")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super().to_dict().items() if v is not None}  # only the kind given

    @property
    def kind(self) -> str:
        return "run" if self.run is not None else "train" if self.train is not None else "import"


@dataclass(frozen=True)
@library_keys(StageSettings(SearchJob, ("max_flops", "max_latency_ms")))
class GoalSection(Section):
    """``goal``: the FLOPs ratio to the dense base, or the batch-1 latency on this device (the
    constraint of a study, :class:`~nascompress.studies.trials.SearchJob`'s, same names)."""

    def __post_init__(self) -> None:
        check_one_of(self, {"max_flops": "max_flops", "max_latency_ms": "max_latency_ms"}, "")

    @property
    def pick(self) -> str:
        if self.max_flops is not None:
            return f"best-under-flops={self.max_flops:g}"
        return f"best-under-latency={self.max_latency_ms:g}"


@dataclass(frozen=True)
class StagesSection(Section):
    """``stages``: a key for each registered stage with a section of its own (``dcs``, ``tokens``,
    ``retrain``: the class its module declares, :class:`~nascompress.pipeline.stage.PipelineStage`'s
    ``config``), each optional, in the stages' order. This class is their base: the mapping a file is
    read with is composed from the registry (:func:`~nascompress.pipeline.stage.config_class`), so a
    stage with keys of its own is one module."""

    # the stages that compress (``PipelineStage.compresses``): a pipeline gives at least one
    compressing: typing.ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if self.compressing and all(getattr(self, n) is None for n in self.compressing):
            either = " or a ".join(self.compressing)
            both = " (or both)" if len(self.compressing) == 2 else ""
            raise NascompressError(f"give a {either} stage{both}: nothing would be compressed")


@dataclass(frozen=True)
@library_keys(ProfileConfig)
class ReportSection(Section):
    """``report``: how the result is measured against the dense base (interleaved, one process): the
    settings of ``nascompress profile`` (:class:`~nascompress.profiling.config.ProfileConfig`, same
    names; ``latency: false`` is its ``--no-latency``), and ``dense_reference``: the dense base retrained
    with the retrain stage's recipe and teacher (the ``retrain_dense`` step, ``OUT/dense_reference``),
    shown beside the compressed model."""

    dense_reference: bool = setting(
        False,
        help=(
            "Also retrain the dense base with stages.retrain's recipe and teacher (OUT/dense_reference) and show "
            "it beside the compressed model: the yardstick at the same budget."
        ),
    )


@dataclass(frozen=True, kw_only=True)
@library_keys(RUNTIME_SETTINGS, lead=("format", *RUNTIME_SETTINGS.names))
class PipelineConfig(Section):
    """A whole pipeline file (see the :mod:`nascompress.pipeline` docstring). ``seed``, ``device``,
    ``amp`` (bf16 autocast or not) and ``deterministic`` (deterministic kernels, reproducible on a GPU)
    apply to every stage: :data:`~nascompress.train.run.RUNTIME_SETTINGS`, declared in TrainConfig."""

    format: str = opt()
    data: DataSection = field(default_factory=DataSection)
    base: BaseSection = opt()
    goal: GoalSection = opt()
    stages: StagesSection = opt()
    report: ReportSection = field(default_factory=ReportSection)

    def __post_init__(self) -> None:
        if self.format != FORMAT:
            raise KeyProblem("format", f"must be {FORMAT}, got {self.format!r}")
