"""The pipeline file's sections: one frozen dataclass per YAML section (``data``, ``base``,
``goal``, ``stages``, ``report``, ``export``) and :class:`PipelineConfig`, the whole file."""
from __future__ import annotations

import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data import FMNIST_DIR
from ..errors import NascompressError
from ..methods.dcs import DCSConfig
from ..search.dcs import DCSSearchConfig
from .schema import _At, _lr_pair, _one_of, _Section, library_keys, opt

FORMAT = "nascompress-pipeline/1"
DATASET_KEYWORDS = ("fashion-mnist", "synthetic")


@dataclass(frozen=True)
class DataSection(_Section):
    """``data``: the dataset every stage uses (:class:`~nascompress.data.DataConfig`)."""

    dataset: str = opt("fashion-mnist", path=True, keywords=DATASET_KEYWORDS)
    data_dir: str = opt(str(FMNIST_DIR), path=True)
    val_fraction: float = opt(0.1, lo=0, hi=1, lo_open=True, hi_open=True)
    train_limit: int | None = opt(None, lo=1)
    eval_limit: int | None = opt(None, lo=1)
    num_workers: int | None = opt(None, lo=0)
    skip_bad_images: bool = False


@dataclass(frozen=True)
class BaseTrainSection(_Section):
    """``base.train``: train the dense base (``nascompress train``): a custom ViT or a timm ``model``."""

    model: str | None = None
    img_size: int | None = opt(None, lo=1)
    patch_size: int | None = opt(None, lo=1)
    embed_dim: int | None = opt(None, lo=1)
    depth: int | None = opt(None, lo=1)
    num_heads: int | None = opt(None, lo=1)
    in_chans: int | None = opt(None, lo=1)
    num_classes: int | None = opt(None, lo=1)
    weights: str | None = opt(None, path=True)
    reset_head: bool = False
    epochs: int = opt(8, lo=1)
    batch_size: int = opt(128, lo=1)
    lr: float | None = opt(None, lo=0, lo_open=True)
    base_lr: float | None = opt(None, lo=0, lo_open=True)
    min_lr: float = opt(1e-5, lo=0)
    warmup_epochs: float = opt(1.0, lo=0)
    weight_decay: float = opt(0.05, lo=0)
    label_smoothing: float = opt(0.1, lo=0, hi=1, hi_open=True)
    ema_decay: float | None = opt(None, lo=0, hi=1, lo_open=True, hi_open=True)

    def __post_init__(self) -> None:
        _lr_pair(self)
        if self.reset_head and self.weights is None:
            raise _At("reset_head", "needs weights (a new head on a pretrained backbone)")


@dataclass(frozen=True)
class BaseImportSection(_Section):
    """``base.import``: a user's timm model from local weights (``nascompress import``), or with
    ``linear_probe`` a new head fitted on the frozen backbone (``nascompress train --linear-probe``)."""

    model: str = opt()
    weights: str = opt(path=True)
    img_size: int | None = opt(None, lo=1)
    num_classes: int | None = opt(None, lo=1)
    linear_probe: bool = False
    eval_batch_size: int = opt(256, lo=1)


@dataclass(frozen=True)
class BaseSection(_Section):
    """``base``: exactly one of ``run`` (an existing dense run directory), ``train``, ``import``."""

    _yaml_names: typing.ClassVar[dict[str, str]] = {"import_": "import"}

    run: str | None = opt(None, path=True)
    train: BaseTrainSection | None = None
    import_: BaseImportSection | None = None

    def __post_init__(self) -> None:
        _one_of(self, {"run": "run", "train": "train", "import_": "import"}, "")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super().to_dict().items() if v is not None}  # only the kind given

    @property
    def kind(self) -> str:
        return "run" if self.run is not None else "train" if self.train is not None else "import"


@dataclass(frozen=True)
class GoalSection(_Section):
    """``goal``: the FLOPs ratio to the dense base, or the batch-1 latency on this device."""

    max_flops: float | None = opt(None, lo=0, hi=1, lo_open=True)
    max_latency_ms: float | None = opt(None, lo=0, lo_open=True)

    def __post_init__(self) -> None:
        _one_of(self, {"max_flops": "max_flops", "max_latency_ms": "max_latency_ms"}, "")

    @property
    def pick(self) -> str:
        if self.max_flops is not None:
            return f"best-under-flops={self.max_flops:g}"
        return f"best-under-latency={self.max_latency_ms:g}"


@dataclass(frozen=True)
@library_keys(DCSSearchConfig, DCSConfig, lead=("target_flops",))
class DCSStage(_Section):
    """``stages.dcs``: DCS channel search (``nascompress search dcs``), then materialize. Keys are
    the search's settings (same names): every user-facing field of
    :class:`~nascompress.search.dcs.DCSSearchConfig` and :class:`~nascompress.methods.dcs.DCSConfig`
    (declared there, with their checks: :func:`~nascompress.pipeline.schema.library_keys`), and the
    keys below (the search's training and data settings, and the pipeline's own ``fallback``);
    ``batch_size`` null: from the training images. With ``fallback`` a search that collapses is
    retried once at a milder target, then skipped (:mod:`nascompress.pipeline.fallback`)."""

    epochs: int = opt(4, lo=1)
    train_limit: int | None = opt(None, lo=1)
    batch_size: int | None = opt(None, lo=1)
    lr: float | None = opt(None, lo=0, lo_open=True)
    base_lr: float | None = opt(None, lo=0, lo_open=True)
    min_lr: float = opt(1e-6, lo=0)
    warmup_epochs: float = opt(0.2, lo=0)
    layer_decay: float | None = opt(0.75, lo=0, hi=1, lo_open=True)
    fallback: bool = True

    def __post_init__(self) -> None:
        _lr_pair(self)


@dataclass(frozen=True)
class TokensStage(_Section):
    """``stages.tokens``: an Optuna search over a space file (``nascompress search tokens``) on the
    current model, then the best trial under the goal (``nascompress materialize --study --pick``)."""

    space: str = opt(path=True)
    study: str = "pipeline"
    trials: int = opt(30, lo=1)
    workers: int = opt(1, lo=1)
    objective: str = opt("goal", choices=("goal", "flops", "latency", "throughput"))
    sampler: str = opt("nsga2", choices=("nsga2", "tpe", "qmc"))
    finetune_epochs: float = opt(0.0, lo=0)
    train_images: int = opt(2000, lo=1)
    eval_images: int = opt(2000, lo=1)
    calib_steps: int = opt(50, lo=0)
    batch_size: int = opt(64, lo=1)
    dcs_epochs: int = opt(1, lo=1)
    latency_iters: int = opt(10, lo=1)
    enqueue: bool = True


@dataclass(frozen=True)
class RetrainStage(_Section):
    """``stages.retrain``: final training of the compressed model (``nascompress retrain``)."""

    epochs: int = opt(10, lo=1)
    eta: float = opt(50.0, lo=0)
    warmup_frac: float = opt(0.3, lo=0, hi=1, hi_open=True)
    teacher: str = opt("base", choices=("base", "none"))
    kd_alpha: float = opt(0.5, lo=0, hi=1)
    kd_temperature: float = opt(1.0, lo=0, lo_open=True)
    feat_kd: float | None = opt(None, lo=0)  # null: 1 with the base as teacher (retrain's default)
    train_limit: int | None = opt(None, lo=1)
    cluster_samples: int | None = opt(None, lo=1)
    batch_size: int | None = opt(None, lo=1)  # null: from the training images (retrain's default)
    lr: float | None = opt(None, lo=0, lo_open=True)
    base_lr: float | None = opt(None, lo=0, lo_open=True)
    min_lr: float = opt(1e-6, lo=0)
    warmup_epochs: float = opt(0.2, lo=0)

    def __post_init__(self) -> None:
        _lr_pair(self)


@dataclass(frozen=True)
class StagesSection(_Section):
    """``stages``: each optional; run in the order dcs, tokens, retrain."""

    dcs: DCSStage | None = None
    tokens: TokensStage | None = None
    retrain: RetrainStage | None = None

    def __post_init__(self) -> None:
        if self.dcs is None and self.tokens is None:
            raise NascompressError("give a dcs or a tokens stage (or both): nothing would be compressed")


@dataclass(frozen=True)
class ReportSection(_Section):
    """``report``: how the result is measured against the dense base (interleaved, one process)."""

    latency: bool = True
    iters: int = opt(10, lo=1)
    batch_size: int = opt(64, lo=1)
    dtype: str = opt("fp32", choices=("fp32", "bf16", "fp16"))  # weights and inputs of the comparison
    compile: bool = False  # also time both models torch.compile'd (CUDA graphs on CUDA)


@dataclass(frozen=True)
class ExportSection(_Section):
    """``export``: end with a deployable file of the final model, ``OUT/export/<file>`` and its sidecar
    (``nascompress export``: the other keys are its options, :class:`~nascompress.export.ExportConfig`)."""

    file: str | None = None  # default model.onnx (format onnx) or model.pt2
    format: str = "onnx"
    batch: Any = "dynamic"
    dtype: str = "fp32"
    opset: int | None = opt(None, lo=7)
    tolerance: float | None = opt(None, lo=0, lo_open=True)
    verify_batch: int = opt(8, lo=1)

    def __post_init__(self) -> None:
        self.config(seed=0)
        if self.file is not None and Path(self.file).name != self.file:
            raise _At("file", f"must be a file name (it is written into OUT/export/), got {self.file!r}")

    def config(self, *, seed: int) -> Any:
        from ..export.config import ExportConfig

        return ExportConfig(format=self.format, batch=self.batch, dtype=self.dtype, opset=self.opset,
                            tolerance=self.tolerance, verify_batch=self.verify_batch, seed=seed)

    @property
    def filename(self) -> str:
        return self.file or ("model.onnx" if self.format == "onnx" else "model.pt2")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig(_Section):
    """A whole pipeline file (see the :mod:`nascompress.pipeline` docstring)."""

    format: str = opt()
    seed: int = opt(0, lo=0)
    device: str = "auto"
    amp: str = opt("off", choices=("off", "bf16"))  # every training stage: bf16 autocast or not
    deterministic: bool = False  # every training stage: deterministic kernels (reproducible on a GPU)
    data: DataSection = field(default_factory=DataSection)
    base: BaseSection = opt()
    goal: GoalSection = opt()
    stages: StagesSection = opt()
    report: ReportSection = field(default_factory=ReportSection)
    export: ExportSection | None = None

    def __post_init__(self) -> None:
        if self.format != FORMAT:
            raise _At("format", f"must be {FORMAT}, got {self.format!r}")
