"""The pipeline file's sections: one frozen dataclass per YAML section (``data``, ``base``,
``goal``, ``stages``, ``report``, ``export``) and :class:`PipelineConfig`, the whole file."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..data import DATASET_KEYWORDS, DataConfig  # noqa: F401 (DATASET_KEYWORDS: read from here too)
from ..config import StageSettings, offered, setting, shared
from ..errors import NascompressError
from ..importer.run import ImportJob
from ..deploy.config import ExportConfig, build_config
from ..methods.dcs import SEARCH_DCS_SETTINGS
from ..models.build import ModelShape
from ..profiling.config import ProfileConfig
from ..retraining.run import RETRAIN_TRAIN_SETTINGS
from ..retraining.config import RetrainConfig
from ..dcs_search.search_config import SEARCH_TRAIN_SETTINGS, DCSSearchConfig
from ..studies.trials import STUDY_SETTINGS, SearchJob
from ..train.run import FINE_TUNE_TRAIN, RUNTIME_SETTINGS, TRAIN_SETTINGS, TrainJob
from ..train.config import TrainConfig
from .schema import KeyProblem, check_lr_pair, check_one_of, Section, library_keys, library_values, opt

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


# `export`'s keys: ExportConfig's settings but the check's seed (the pipeline's seed)
EXPORT_SETTINGS = StageSettings(
    ExportConfig, tuple(f.name for f in fields(ExportConfig) if "help" in f.metadata and f.name != "seed")
)


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
@library_keys(
    DCSSearchConfig,
    SEARCH_DCS_SETTINGS,
    SEARCH_TRAIN_SETTINGS,
    STAGE_DATA_SETTINGS,
    lead=("target_flops", *SEARCH_TRAIN_SETTINGS.names, *STAGE_DATA_SETTINGS.names),
)
class DCSStage(Section):
    """``stages.dcs``: DCS channel search (``nascompress search dcs``), then materialize. Keys are
    the search's settings (same names): every user-facing field of
    :class:`~nascompress.dcs_search.search_config.DCSSearchConfig` and :class:`~nascompress.methods.dcs.DCSConfig`,
    the search's training settings (:data:`~nascompress.dcs_search.search_config.SEARCH_TRAIN_SETTINGS`; null: the
    recipe's, ``batch_size`` null: from the training images), all declared in the library with their
    checks (:func:`~nascompress.pipeline.schema.library_keys`), and the keys below (the data's
    ``train_limit`` for this stage, and the pipeline's own ``on_collapse``). With ``on_collapse: retry``
    a search that collapses is retried once at a milder target, then skipped
    (:mod:`nascompress.pipeline.fallback`); ``stop`` fails the stage."""

    on_collapse: str = setting(
        "retry",
        choices=("retry", "stop"),
        help=(
            "retry: a search that collapses runs once more at a milder target, then the pipeline goes on "
            "without DCS; stop: the stage fails."
        ),
    )
    renamed = {"fallback": ("on_collapse", {True: "retry", False: "stop"})}
    elsewhere = data_pointers()

    def __post_init__(self) -> None:
        check_lr_pair(self)


@dataclass(frozen=True)
@library_keys(STUDY_SETTINGS, lead=("space",))
class TokensStage(Section):
    """``stages.tokens``: an Optuna search over a space file (``nascompress search tokens``) on the
    current model, then the best trial under the goal (``nascompress materialize --study --pick``).
    Keys are the study's settings (same names as the command's options, declared in the library:
    :data:`~nascompress.studies.trials.STUDY_SETTINGS`; ``study`` defaults to ``pipeline``);
    ``objective: goal`` (the default, as the command's) searches accuracy under the goal's constraint.
    ``also_dense`` (after a dcs stage): the same study runs a second time on the dense base (study
    ``<study>-dense``, token-only models), and the goal's pick takes the better of the two studies'
    picks, scored on the same images (:func:`~nascompress.pipeline.fallback.pick_across`): the pipeline
    chooses between cutting channels and tokens, both, or tokens alone."""

    also_dense: bool = setting(
        True,
        help=(
            "After a dcs stage, also search the token space on the dense base and keep the better pick "
            "(token-only against channels + tokens)."
        ),
    )
    study: str = shared(SearchJob, "study", default="pipeline")  # the pipeline's own study name

    elsewhere = {
        **data_pointers(()),
        "train_limit": "the study's training images are train_images (search tokens --train-images); "
        "the dataset's, for every stage, data.train_limit",
        "eval_limit": "the study's validation images are eval_images (search tokens --eval-images); "
        "the test images, for every stage, data.eval_limit",
    }


@dataclass(frozen=True)
@library_keys(
    RetrainConfig,
    RETRAIN_TRAIN_SETTINGS,
    STAGE_DATA_SETTINGS,
    lead=("epochs", "eta", "warmup_frac", "distil_from", *STAGE_DATA_SETTINGS.names),
)
class RetrainStage(Section):
    """``stages.retrain``: final training of the compressed model (``nascompress retrain``). Keys are
    retrain's settings (same names): every user-facing field of
    :class:`~nascompress.retraining.run.RetrainConfig` (``feat_kd`` null: 1 with the base as teacher) and its
    training settings (:data:`~nascompress.retraining.run.RETRAIN_TRAIN_SETTINGS`; null: the recipe's,
    ``batch_size`` null: from the training images), declared in the library with their checks, and
    the keys below: ``distil_from`` (the dense ``base`` or ``none``: the pipeline's choice of teacher
    among its own runs; the command's ``--teacher`` is a run directory), ``confirm_pick`` (the
    ``confirm`` step: :mod:`nascompress.pipeline.confirm`) and the data's ``train_limit`` for this
    stage."""

    distil_from: str = setting(
        "base", choices=("base", "none"), help=("base: distil from the dense base (the teacher); none: no teacher.")
    )
    confirm_pick: bool = setting(
        True,
        help=(
            "When the pick cuts tokens and the DCS stage's channel-only model meets the FLOPs goal by itself, "
            "retrain that one too with the same recipe and keep the better of the two on validation "
            "(the token study scores its trials on few images; this checks its pick at the full budget)."
        ),
    )
    renamed = {"teacher": ("distil_from", None)}
    elsewhere = data_pointers()

    def __post_init__(self) -> None:
        check_lr_pair(self)


@dataclass(frozen=True)
class StagesSection(Section):
    """``stages``: each optional; run in the order dcs, tokens, retrain."""

    dcs: DCSStage | None = None
    tokens: TokensStage | None = None
    retrain: RetrainStage | None = None

    def __post_init__(self) -> None:
        if self.dcs is None and self.tokens is None:
            raise NascompressError("give a dcs or a tokens stage (or both): nothing would be compressed")


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


@dataclass(frozen=True)
@library_keys(EXPORT_SETTINGS, lead=("file",))
class ExportSection(Section):
    """``export``: end with a deployable file of the final model, ``OUT/export/<file>`` and its sidecar
    (``nascompress export``: the other keys are its options, every user-facing field of
    :class:`~nascompress.deploy.ExportConfig`, declared there with its checks; the check's seed is the
    pipeline's)."""

    file: str | None = setting(
        None,
        help=("The file in OUT/export/ (default model.onnx; model.int8.onnx quantized; model.pt2 for torch-export)."),
    )

    def __post_init__(self) -> None:
        self.config(seed=0)
        if self.file is not None and Path(self.file).name != self.file:
            raise KeyProblem("file", f"must be a file name (it is written into OUT/export/), got {self.file!r}")

    def config(self, *, seed: int) -> Any:
        return build_config({**library_values(self, EXPORT_SETTINGS), "seed": seed})

    @property
    def filename(self) -> str:
        if self.file:
            return self.file
        return "model.pt2" if self.format != "onnx" else "model.onnx" if self.quantize == "none" else "model.int8.onnx"


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
    export: ExportSection | None = None

    def __post_init__(self) -> None:
        if self.format != FORMAT:
            raise KeyProblem("format", f"must be {FORMAT}, got {self.format!r}")
