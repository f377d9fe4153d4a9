"""``nascompress pipeline CONFIG.yaml --out DIR``: from a model to a slim, faster model in one command.

A pipeline is a YAML file a user keeps (format ``nascompress-pipeline/1``, see ``configs/``)::

    format: nascompress-pipeline/1
    seed: 0                      # one seed drives every stage (init, data order, subsets, samplers)
    device: auto
    amp: off                     # bf16: every training stage under bfloat16 autocast (GPU)
    deterministic: false         # true: deterministic kernels in every training stage
    data: {dataset: fashion-mnist, train_limit: null, eval_limit: null}
    base:                        # exactly one of run / train / import
      train: {img_size: 28, patch_size: 4, embed_dim: 96, depth: 6, num_heads: 3, epochs: 8, lr: 1.0e-3}
    goal: {max_flops: 0.6}       # or {max_latency_ms: MS} (batch 1 on this device)
    stages:                      # each optional, run in this order
      dcs: {target_flops: 0.7, epochs: 4, train_limit: 24000, qk_mask: static}
      tokens: {space: ../search_spaces/evit.yaml, trials: 30}
      retrain: {epochs: 4, eta: 0, teacher: base}
    report: {latency: true, iters: 10, batch_size: 64, dtype: fp32, compile: false}
    export: {format: onnx}       # optional: OUT/export/model.onnx + .json, run and checked against PyTorch

The whole file is validated before anything runs or is written (:func:`load_config`, then the
plan: files, models, search space against the model's depth, every stage's job built): an error
names the file and the key path (``stages.dcs.target_flops: must be in (0, 1], got 1.5``).
Relative paths in the file are relative to the file's own directory; the normalized config
(defaults filled in, paths absolute) is written to ``OUT/config.yaml`` on the first run.

Stages and their directories under OUT (each step's job is the library function the matching
command runs): ``base/`` (``train``, ``import`` or a linear probe; none for ``base.run``),
``dcs_search/`` (:func:`~nascompress.search.dcs.search_dcs`), ``dcs_mat/``
(:func:`~nascompress.search.materialize.materialize_search`), ``tokens/`` (the study, in
``OUT/studies.db``, by :func:`~nascompress.search.trials.run_search` on the current model, and the
trial picked under the goal in ``tokens/picked/`` by
:func:`~nascompress.search.trial_model.materialize_trial`), ``final/``
(:func:`~nascompress.retrain.retrain`), ``export/`` (:func:`~nascompress.export.export_run`, when the
file has an ``export`` section), then ``summary.json`` and ``report.html``
(:mod:`nascompress.pipeline_report`).

Resume: a step is complete when its marker ``OUT/done/<step>.json`` (written atomically after its
outputs) exists and its outputs do; complete steps are skipped. An interrupted training step
(base, DCS search, retrain) continues from its last epoch checkpoint (``resume=True``: the same
result as an uninterrupted run), the study continues by name (a trial killed mid-run is run
again in its place and the sampler continues from the seed and the trials told, so the study
and the pick are those of an uninterrupted run, see :mod:`nascompress.studies.runner`), and the
quick steps (import, materialize, pick, export, report) are redone. A rerun with another config into
the same OUT is refused; ``force`` starts over.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import shutil
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from .config import Config, StrictYamlLoader as _Loader
from .errors import NascompressError, writing
from .utils import read_json, write_json

FORMAT = "nascompress-pipeline/1"
CONFIG_FILE = "config.yaml"
DONE_DIR = "done"
STUDY_DB = "studies.db"
STUDY_JOURNAL = "studies.journal"
LOCK_FILE = ".pipeline.lock"
_CONTINUE = "then rerun the same command to continue the pipeline there"
DATASET_KEYWORDS = ("fashion-mnist", "synthetic")
STEPS = ("base", "dcs_search", "dcs_mat", "tokens_search", "tokens_pick", "retrain", "export", "report")


# ---------------------------------------------------------------------------------------------
# The schema: frozen sections whose fields carry their own checks (metadata), built from YAML by
# :func:`_build`, which names the key path in every error.


class _At(NascompressError):
    """A problem with one key of a section (``key`` relative to the section)."""

    def __init__(self, key: str, msg: str):
        super().__init__(msg)
        self.key = key


def opt(default: Any = dataclasses.MISSING, *, lo: float | None = None, hi: float | None = None,
        lo_open: bool = False, hi_open: bool = False, choices: tuple[Any, ...] | None = None,
        path: bool = False, keywords: tuple[str, ...] = ()) -> Any:
    """A field with checks: a number range, choices, or a path (resolved against the config's
    directory unless it is one of ``keywords``)."""
    meta = {"lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open, "choices": choices, "path": path,
            "keywords": keywords}
    return field(default=default, metadata=meta)


class _Section(Config):
    """A section of the pipeline file; YAML key names may differ from field names (``import``)."""

    _yaml_names: typing.ClassVar[dict[str, str]] = {}  # field name -> YAML key

    @classmethod
    def keys(cls) -> dict[str, str]:
        """YAML key -> field name, in declaration order."""
        return {cls._yaml_names.get(f.name, f.name): f.name for f in dataclasses.fields(cls)}

    def to_dict(self) -> dict[str, Any]:
        """The normalized mapping (YAML names; absent optional sections left out)."""
        hints = typing.get_type_hints(type(self))
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and _section_type(hints[f.name]) is not None:
                continue
            out[self._yaml_names.get(f.name, f.name)] = v.to_dict() if isinstance(v, _Section) else v
        return out


def _section_type(tp: Any) -> type[_Section] | None:
    for a in (tp, *typing.get_args(tp)):
        if isinstance(a, type) and issubclass(a, _Section):
            return a
    return None


def _show(v: Any) -> str:
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    return repr(v)


@dataclass(frozen=True)
class _Ctx:
    source: str  # the config file, as named in messages
    base_dir: Path  # relative paths are resolved against it

    def err(self, path: str, msg: str) -> NascompressError:
        return NascompressError(f"{self.source}: {path}: {msg}" if path else f"{self.source}: {msg}")

    def resolve(self, p: str) -> str:
        q = Path(p).expanduser()
        return os.path.normpath(q if q.is_absolute() else self.base_dir / q)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _coerce(v: Any, tp: Any, meta: dict[str, Any], path: str, ctx: _Ctx) -> Any:
    args = typing.get_args(tp)
    optional = type(None) in args
    sub = _section_type(tp)
    if sub is not None:
        return _build(sub, {} if v is None else v, path, ctx)  # `train:` with nothing under it: defaults
    if v is None:
        if optional:
            return None
        raise ctx.err(path, "must not be empty")
    base = next((a for a in args if a is not type(None)), tp) if args else tp
    if base is bool:
        if not isinstance(v, bool):
            raise ctx.err(path, f"must be true or false, got {_show(v)}")
    elif base is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ctx.err(path, f"must be an integer, got {_show(v)}")
    elif base is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ctx.err(path, f"must be a number, got {_show(v)}")
        v = float(v)
    elif base is str:
        if not isinstance(v, str) or not v.strip():
            raise ctx.err(path, f"must be a non-empty string, got {_show(v)}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None or hi is not None:
        ok = (lo is None or (v > lo if meta["lo_open"] else v >= lo)) and \
             (hi is None or (v < hi if meta["hi_open"] else v <= hi))
        if not ok:
            if base is int and hi is None:
                raise ctx.err(path, f"must be an integer >= {lo}, got {v!r}")
            left, right = "(" if meta["lo_open"] else "[", ")" if meta["hi_open"] else "]"
            span = f"{left}{'-inf' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}{right}"
            raise ctx.err(path, f"must be in {span}, got {v!r}")
    if meta.get("choices") and v not in meta["choices"]:
        raise ctx.err(path, f"must be one of {', '.join(map(str, meta['choices']))}, got {v!r}")
    if meta.get("path") and v not in meta.get("keywords", ()):
        v = ctx.resolve(v)
    return v


def _build(cls: type[_Section], data: Any, path: str, ctx: _Ctx) -> Any:
    """Build section ``cls`` from a YAML mapping; every error names the key path."""
    if not isinstance(data, dict):
        raise ctx.err(path, f"must be a mapping of settings, got {_show(data)}")
    keys = cls.keys()
    for k in data:
        if k not in keys:
            raise NascompressError(f"{ctx.source}: unknown key {_join(path, str(k))}; valid: {', '.join(keys)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, name in keys.items():
        f = fields[name]
        if key not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
                raise ctx.err(_join(path, key), "required")
            continue
        values[name] = _coerce(data[key], hints[name], dict(f.metadata), _join(path, key), ctx)
    try:
        return cls(**values)
    except _At as e:
        raise ctx.err(_join(path, e.key), str(e)) from None
    except NascompressError as e:
        raise ctx.err(path, str(e)) from None


def _one_of(section: Any, names: dict[str, str], what: str) -> None:
    given = [key for name, key in names.items() if getattr(section, name) is not None]
    if len(given) != 1:
        raise NascompressError(f"give exactly one of {', '.join(names.values())}{what}; "
                               f"got {', '.join(given) if given else 'none'}")


def _lr_pair(section: Any) -> None:
    if section.lr is not None and section.base_lr is not None:
        raise _At("base_lr", "give lr (absolute peak) or base_lr (per 512 images), not both")


@dataclass(frozen=True)
class DataSection(_Section):
    """``data``: the dataset every stage uses (:class:`~nascompress.data.DataConfig`)."""

    dataset: str = opt("fashion-mnist", path=True, keywords=DATASET_KEYWORDS)
    data_dir: str = opt("/usr/share/datasets/fashion-mnist", path=True)
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
class DCSStage(_Section):
    """``stages.dcs``: DCS channel search (``nascompress search dcs``), then materialize. Keys are
    the search's settings (same names); ``batch_size`` null: from the training images. With
    ``fallback`` a search that collapses is retried once at a milder target, then skipped
    (:mod:`nascompress.pipeline_fallback`)."""

    target_flops: float | None = opt(None, lo=0, hi=1, lo_open=True)
    epochs: int = opt(4, lo=1)
    train_limit: int | None = opt(None, lo=1)
    batch_size: int | None = opt(None, lo=1)
    lr: float | None = opt(None, lo=0, lo_open=True)
    base_lr: float | None = opt(None, lo=0, lo_open=True)
    warmup_epochs: float = opt(0.2, lo=0)
    layer_decay: float | None = opt(0.75, lo=0, hi=1, lo_open=True)
    qk_mask: str = opt("static", choices=("static", "input", "none"))
    mlp_gates: str = opt("auto", choices=("auto", "residual", "hidden", "none"))
    align: int = opt(8, lo=1)
    hidden_fill: str = opt("mean", choices=("mean", "zero"))
    round_mlp: int = opt(0, lo=0)
    arch_lr: float | None = opt(None, lo=0, lo_open=True)  # None: sized from the budget (search dcs)
    lam: float = opt(0.2, lo=0)
    entropy_weight: float = opt(0.01, lo=0)
    distill: float = opt(0.5, lo=0)
    feat_distill: float = opt(1.0, lo=0)
    arch_loss: str = opt("kd", choices=("kd", "ce"))
    target_ramp: float = opt(0.5, lo=0, hi=1)
    protect_ratio: float = opt(5.0, lo=0)
    block_weights: bool = True
    alpha_init: float = 5.0
    tau0: float = opt(4.5, lo=0, lo_open=True)
    max_val_drop: float = opt(15.0, lo=0)
    calibrate: bool = True
    init_importance: str = opt("auto", choices=("auto", "weight", "activation"))
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
        from .export.config import ExportConfig

        return ExportConfig(format=self.format, batch=self.batch, dtype=self.dtype, opset=self.opset,
                            tolerance=self.tolerance, verify_batch=self.verify_batch, seed=seed)

    @property
    def filename(self) -> str:
        return self.file or ("model.onnx" if self.format == "onnx" else "model.pt2")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig(_Section):
    """A whole pipeline file (see the module docstring)."""

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


# ---------------------------------------------------------------------------------------------
# Reading a file


def read_yaml(path: str | Path) -> Any:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise NascompressError(f"config file {path} does not exist") from None
    except (IsADirectoryError, OSError) as e:
        raise NascompressError(f"cannot read config file {path}: {e.strerror or e}") from None
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise NascompressError(f"{path}: not valid YAML{at}: {problem}") from None


def load_config(path: str | Path, *, seed: int | None = None) -> PipelineConfig:
    """Read and validate a pipeline file (schema only: types, ranges, unknown keys); ``seed``
    overrides the file's. Errors name the file and the key path."""
    path = Path(path)
    data = read_yaml(path)
    ctx = _Ctx(str(path), path.resolve().parent)
    if not isinstance(data, dict):
        raise ctx.err("", f"the file must be a mapping of sections (format, data, base, goal, stages), "
                          f"got {_show(data)}")
    if seed is not None:
        data = dict(data, seed=seed)
    return _build(PipelineConfig, data, "", ctx)


def dump_config(cfg: PipelineConfig) -> str:
    head = ("# nascompress pipeline: the validated config of this run (defaults filled in, paths absolute).\n"
            "# Rerun (resumes where it stopped): nascompress pipeline THIS_FILE --out THIS_DIRECTORY\n")
    return head + yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            out += _diff(a.get(k, "<absent>"), b.get(k, "<absent>"), _join(path, str(k)))
        return out
    return [] if a == b else [f"{path or '(whole file)'} is {a!r} here but {b!r} there"]


# ---------------------------------------------------------------------------------------------
# The plan: every stage's job, built (and so validated) before anything runs


@dataclass
class Step:
    """One resumable unit of work.

    Args:
        name: its name in ``OUT/done/<name>.json``.
        dir: its output directory (None: nothing written by the step itself).
        mode: ``train`` (resumed from its checkpoint), ``redo`` (rebuilt from scratch when
            incomplete) or ``study`` (continued by name).
        outputs: files (relative to OUT) that must exist for the step to count as complete.
    """

    name: str
    dir: Path | None
    mode: str
    run: Callable[..., dict[str, Any]]
    outputs: tuple[str, ...] = ()
    describe: str = ""


@dataclass
class Pipeline:
    """A validated pipeline for one OUT: the config, the directories, and the steps."""

    cfg: PipelineConfig
    out: Path
    source: str
    steps: list[Step]
    base_dir: Path  # the dense base run
    final_dir: Path  # the model the pipeline ends with, as planned (see :meth:`result_dir`)
    storage: str | None = None
    data: Any = None

    def result_dir(self) -> Path | None:
        """The model the pipeline really ended with: :attr:`final_dir`, or the model before the
        skipped steps when the DCS stage fell back; None when no compressed model was made."""
        from .pipeline_fallback import current_model

        st = self.cfg.stages
        return current_model(self.out, base_dir=self.base_dir, dcs=st.dcs is not None, tokens=st.tokens is not None,
                             retrain=st.retrain is not None, upto="final")


def _data_config(cfg: PipelineConfig, *, train_limit: int | None = None) -> Any:
    from .data import DataConfig

    d = cfg.data
    return DataConfig(dataset=d.dataset, data_dir=d.data_dir, val_fraction=d.val_fraction, split_seed=0,
                      train_limit=train_limit if train_limit is not None else d.train_limit,
                      eval_limit=d.eval_limit, subset_seed=cfg.seed, num_workers=d.num_workers,
                      skip_bad_images=d.skip_bad_images)


def _check_data(cfg: PipelineConfig, ctx: _Ctx) -> int:
    """The dataset exists; returns its class count."""
    from .api import count_classes

    d = cfg.data
    if d.dataset == "fashion-mnist":
        need = Path(d.data_dir) / "train-images-idx3-ubyte.gz"
        if not need.is_file():
            raise ctx.err("data.data_dir", f"Fashion-MNIST is not in {d.data_dir} (no {need.name}); install the "
                                           "Debian package dataset-fashion-mnist or point data_dir at its IDX files")
    elif d.dataset != "synthetic" and not (Path(d.dataset) / "train").is_dir():
        raise ctx.err("data.dataset", f"{d.dataset} is not 'fashion-mnist', 'synthetic' or an ImageFolder root "
                                      "with a train/ folder")
    try:
        n = count_classes(_data_config(cfg))
        if d.dataset not in DATASET_KEYWORDS:  # an ImageFolder: its images and classes, before anything is written
            from .data import load_data

            load_data(_data_config(cfg))
        return n
    except NascompressError as e:
        raise ctx.err("data.dataset", str(e)) from None


def _built_model(spec: Any, ctx: _Ctx, where: str) -> Any:
    from .models import build_model

    try:
        return build_model(spec)
    except NascompressError as e:
        raise ctx.err(where, str(e)) from None


def _weights_shapes(path: str) -> dict[str, list[int]] | None:
    """Tensor shapes of a safetensors file, without reading the tensors (None for other formats
    and unreadable files: the stage's own reader checks and reports those)."""
    if not path.endswith(".safetensors"):
        return None
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception:  # noqa: BLE001 (a corrupt file: reported by the stage's reader)
        return None


def _grid_size(model: Any, weights: str) -> int | None:
    """The input size whose patch grid matches the weights' position embedding."""
    from .importer import _grid_img_size

    if weights.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(weights, "pt") as f:
                pe = f.get_tensor("pos_embed") if "pos_embed" in f.keys() else None
        except Exception as e:  # noqa: BLE001 (a corrupt or foreign file: every reader raises its own type)
            raise NascompressError(f"weights file {weights} is corrupt or not a weights file ({e})") from None
    else:
        from .models import read_weights_file

        pe = read_weights_file(weights).get("pos_embed")
    return None if pe is None else _grid_img_size(model, {"pos_embed": pe})


def _plan_base(cfg: PipelineConfig, out: Path, ctx: _Ctx, n_classes: int) -> tuple[Step | None, Path, Any]:
    """The base step, the base run directory, and the dense model (built, for its depth)."""
    from .io import load_arch
    from .models import ModelSpec, custom_vit_spec
    from .train import TrainConfig, TrainJob, train

    b, data, base_dir = cfg.base, _data_config(cfg), out / "base"
    if b.kind == "run":
        try:
            arch = load_arch(b.run)
        except NascompressError as e:
            raise ctx.err("base.run", str(e)) from None
        if arch["methods"]:
            raise ctx.err("base.run", f"{b.run} is not a dense run (it applies "
                                      f"{', '.join(m['name'] for m in arch['methods'])}); give the dense run it came "
                                      "from, so the result is compared with the uncompressed model")
        model = _built_model(ModelSpec.from_dict(arch["model"]), ctx, "base.run")
        if model.num_classes != n_classes:
            raise ctx.err("base.run", f"the run's model has {model.num_classes} classes but dataset "
                                      f"{cfg.data.dataset} has {n_classes}")
        step = Step("base", None, "redo", lambda **kw: {"run": b.run}, describe=f"the dense run {b.run}")
        return step, Path(b.run), model
    if b.kind == "train":
        t = b.train
        if t.weights is not None and not Path(t.weights).is_file():
            raise ctx.err("base.train.weights", f"file {t.weights} does not exist")
        try:
            if t.model is None:
                spec = custom_vit_spec(img_size=t.img_size or 28, patch_size=t.patch_size or 4,
                                       embed_dim=t.embed_dim or 96, depth=t.depth or 6, num_heads=t.num_heads or 3,
                                       num_classes=t.num_classes or n_classes, in_chans=t.in_chans or 1)
            else:
                kw = {k: getattr(t, k) for k in ("img_size", "patch_size", "embed_dim", "depth", "num_heads",
                                                 "in_chans") if getattr(t, k) is not None}
                spec = ModelSpec(t.model, dict(kw, num_classes=t.num_classes or n_classes))
            lr = t.lr if t.lr is not None else (None if t.base_lr is not None else 1e-3)
            tc = TrainConfig(epochs=t.epochs, batch_size=t.batch_size, lr=lr, min_lr=t.min_lr,
                             warmup_epochs=t.warmup_epochs, weight_decay=t.weight_decay,
                             label_smoothing=t.label_smoothing, ema_decay=t.ema_decay, seed=cfg.seed,
                             device=cfg.device, amp=cfg.amp, deterministic=cfg.deterministic,
                             **({"base_lr": t.base_lr} if t.base_lr is not None else {}))
            job = TrainJob(model=spec, data=data, train=tc, out=str(base_dir), weights=t.weights,
                           reset_head=t.reset_head)
        except NascompressError as e:
            raise ctx.err("base.train", str(e)) from None
        model = _built_model(spec, ctx, "base.train")
        return Step("base", base_dir, "train", lambda force, resume: train(job, force=force, resume=resume),
                    outputs=("base/model.safetensors", "base/metrics.json"),
                    describe=f"train the dense base ({t.epochs} epochs)"), base_dir, model
    imp = b.import_
    if not Path(imp.weights).is_file():
        raise ctx.err("base.import.weights", f"file {imp.weights} does not exist")
    shapes = _weights_shapes(imp.weights)
    if shapes is not None and not imp.linear_probe:
        head = shapes.get("head.weight")
        if head is None:
            raise ctx.err("base.import.linear_probe", f"the weights in {imp.weights} have no classifier head (a "
                                                      "backbone-only checkpoint); set linear_probe: true to fit one")
        if imp.num_classes is None and head[0] != n_classes:
            raise ctx.err("base.import.weights", f"the weights' head has {head[0]} classes but dataset "
                                                 f"{cfg.data.dataset} has {n_classes}; set linear_probe: true to fit "
                                                 "a new head")
    if imp.linear_probe:
        kwargs: dict[str, Any] = {"num_classes": imp.num_classes or n_classes}
        size = imp.img_size
        if size is None:
            try:
                size = _grid_size(_built_model(ModelSpec(imp.model, dict(kwargs)), ctx, "base.import.model"),
                                  imp.weights)
            except NascompressError as e:
                raise ctx.err("base.import.weights", str(e)) from None
        if size is not None:
            kwargs["img_size"] = size
        spec = ModelSpec(imp.model, kwargs)
        model = _built_model(spec, ctx, "base.import.model")
        try:
            tc = TrainConfig(epochs=1, seed=cfg.seed, device=cfg.device, eval_batch_size=imp.eval_batch_size)
            job = TrainJob(model=spec, data=data, train=tc, out=str(base_dir), weights=imp.weights, reset_head=True,
                           linear_probe=True)
        except NascompressError as e:
            raise ctx.err("base.import", str(e)) from None
        return Step("base", base_dir, "train", lambda force, resume: train(job, force=force, resume=resume),
                    outputs=("base/model.safetensors", "base/metrics.json"),
                    describe=f"import {imp.model} and fit a linear-probe head"), base_dir, model
    from .importer import ImportJob, import_model

    kwargs = {"num_classes": imp.num_classes or n_classes}
    if imp.img_size:
        kwargs["img_size"] = imp.img_size
    model = _built_model(ModelSpec(imp.model, kwargs), ctx, "base.import.model")
    job = ImportJob(model=imp.model, weights=imp.weights, out=str(base_dir), img_size=imp.img_size,
                    num_classes=imp.num_classes, data=data, eval_batch_size=imp.eval_batch_size, device=cfg.device)
    return Step("base", base_dir, "redo", lambda force, resume: import_model(job, force=force),
                outputs=("base/model.safetensors", "base/metrics.json"),
                describe=f"import {imp.model} from {imp.weights}"), base_dir, model


def _plan_dcs(cfg: PipelineConfig, out: Path, ctx: _Ctx, base_dir: Path) -> list[Step]:
    from .methods.dcs import DCSConfig
    from .pipeline_fallback import dcs_skipped, milder_target, run_dcs_with_fallback
    from .search.dcs import DCSSearchConfig, DCSSearchJob, search_train_config
    from .search.materialize import MaterializeJob, materialize_search

    s, goal = cfg.stages.dcs, cfg.goal
    target = s.target_flops if s.target_flops is not None else goal.max_flops
    if target is None:
        raise ctx.err("stages.dcs.target_flops", "required when the goal is a latency (the FLOPs ratio the "
                                                 "channel search should land at)")
    if cfg.stages.tokens is None and goal.max_flops is not None and target > goal.max_flops:
        raise ctx.err("stages.dcs.target_flops", f"{target:g} is above goal.max_flops {goal.max_flops:g} and no "
                                                 "tokens stage follows to close the gap")
    where = "stages.dcs"
    try:
        job = DCSSearchJob(
            source=str(base_dir), out=str(out / "dcs_search"),
            method=DCSConfig(qk_mask=s.qk_mask, mlp_gates=s.mlp_gates, align=s.align, hidden_fill=s.hidden_fill,
                             alpha_init=s.alpha_init, theta_init=s.alpha_init),
            search=DCSSearchConfig(arch_lr=s.arch_lr, lam=s.lam, entropy_weight=s.entropy_weight, tau0=s.tau0,
                                   target_flops=target, target_ramp=s.target_ramp, round_mlp=s.round_mlp,
                                   distill=s.distill, feat_distill=s.feat_distill, arch_loss=s.arch_loss,
                                   protect_ratio=s.protect_ratio, block_weights=s.block_weights,
                                   max_val_drop=s.max_val_drop, calibrate=s.calibrate,
                                   init_importance=s.init_importance, auto_batch=s.batch_size is None),
            train=search_train_config(epochs=s.epochs, batch_size=s.batch_size, lr=s.lr, base_lr=s.base_lr,
                                      warmup_epochs=s.warmup_epochs, seed=cfg.seed, device=cfg.device,
                                      amp=cfg.amp, deterministic=cfg.deterministic).replace(layer_decay=s.layer_decay),
            data=_data_config(cfg, train_limit=s.train_limit))
        mat = MaterializeJob(search_dir=str(out / "dcs_search"), out=str(out / "dcs_mat"), seed=cfg.seed)
    except NascompressError as e:
        raise ctx.err(where, str(e)) from None

    def materialize(force: bool, resume: bool) -> dict[str, Any]:
        if dcs_skipped(out):
            return {"skipped": True, "reason": "the DCS search collapsed twice; the pipeline goes on without DCS"}
        return materialize_search(mat, force=force)

    retry = f"; on a collapse once more at {milder_target(target):g}x, then without DCS" if s.fallback else ""
    return [Step("dcs_search", out / "dcs_search", "train",
                 lambda force, resume: run_dcs_with_fallback(job, force=force, resume=resume, fallback=s.fallback),
                 outputs=("dcs_search/model.safetensors", "dcs_search/metrics.json"),
                 describe=f"DCS channel search to {target:g}x the dense FLOPs ({s.epochs} epochs{retry})"),
            Step("dcs_mat", out / "dcs_mat", "redo", materialize,
                 outputs=("dcs_mat/model.safetensors", "dcs_mat/metrics.json"),
                 describe="materialize the searched channels")]


def _plan_tokens(cfg: PipelineConfig, out: Path, ctx: _Ctx, current: Path, depth: int,
                 base_dir: Path) -> tuple[list[Step], str]:
    from .methods import get_method
    from .pipeline_fallback import current_model, pick_or_closest
    from .search.trial_model import TrialMaterializeJob
    from .search.space import load_space
    from .search.trials import SearchJob, run_search, sampler_factory

    s, goal = cfg.stages.tokens, cfg.goal
    try:
        space = load_space(s.space)
        space.check_depth(depth)
    except NascompressError as e:
        raise ctx.err("stages.tokens.space", str(e)) from None
    try:
        sampler_factory(s.sampler, space, cfg.seed)  # qmc on a conditional space: refused before any stage runs
    except NascompressError as e:
        raise ctx.err("stages.tokens.sampler", str(e)) from None
    names = [m.name for m in space.methods]
    if cfg.stages.dcs is not None:
        if "dcs" in names:
            raise ctx.err("stages.tokens.space", f"space {s.space} searches dcs, but the dcs stage already ran: "
                                                 "drop one of them")
        cannot = [n for n in names if "dcs" not in get_method(n).stacks_on]
        if cannot:
            raise ctx.err("stages.tokens.space", f"{', '.join(cannot)} cannot follow the dcs stage (it stacks on "
                                                 f"{', '.join(sorted(get_method(cannot[0]).stacks_on)) or 'nothing'})")
    if goal.max_latency_ms is not None and s.objective == "flops":
        raise ctx.err("stages.tokens.objective", "flops trials record no latency, but the goal is max_latency_ms: "
                                                 "use goal, latency or throughput")
    storage = (f"sqlite:///{out.resolve() / STUDY_DB}" if s.workers == 1
               else f"journal:{out.resolve() / STUDY_JOURNAL}")
    try:
        constrained = s.objective == "goal"
        job = SearchJob(base=str(current), space=s.space, study=s.study, storage=storage, trials=s.trials,
                        workers=s.workers, objective="flops" if constrained else s.objective,
                        max_flops=goal.max_flops if constrained else None,
                        max_latency_ms=goal.max_latency_ms if constrained else None, sampler=s.sampler,
                        finetune_epochs=s.finetune_epochs, train_images=s.train_images, eval_images=s.eval_images,
                        calib_steps=s.calib_steps, batch_size=s.batch_size, dcs_epochs=s.dcs_epochs,
                        latency_iters=s.latency_iters, enqueue=s.enqueue, data=_data_config(cfg), seed=cfg.seed,
                        device=cfg.device, amp=cfg.amp, deterministic=cfg.deterministic)
        pick = TrialMaterializeJob(study=s.study, out=str(out / "tokens" / "picked"), pick=goal.pick, storage=storage)
    except NascompressError as e:
        raise ctx.err("stages.tokens", str(e)) from None

    def search(force: bool, resume: bool, progress: bool = True) -> dict[str, Any]:
        (out / "tokens").mkdir(parents=True, exist_ok=True)
        start = current_model(out, base_dir=base_dir, dcs=cfg.stages.dcs is not None, tokens=True, retrain=False,
                              upto="tokens")  # the dense base when the DCS stage was skipped
        res = run_search(job.replace(base=str(start)), progress=progress)
        if not res.get("finished"):
            raise NascompressError(f"the study {s.study!r} has {res['complete']} of {s.trials} complete trials; "
                                   "rerun the same command to continue it")
        return res

    return [Step("tokens_search", out / "tokens", "study", search, outputs=(),
                 describe=f"search {space.name} ({s.trials} trials, study {s.study!r} in {STUDY_DB})"),
            Step("tokens_pick", out / "tokens" / "picked", "redo",
                 lambda force, resume: pick_or_closest(pick, force=force),
                 outputs=("tokens/picked/model.safetensors", "tokens/picked/metrics.json"),
                 describe=f"rebuild the trial picked by {goal.pick}")], storage


def _plan_retrain(cfg: PipelineConfig, out: Path, ctx: _Ctx, current: Path, base_dir: Path) -> Step:
    from .pipeline_fallback import current_model
    from .retrain import RetrainConfig, RetrainJob, retrain, retrain_train_config

    s = cfg.stages.retrain
    try:
        tc = retrain_train_config(epochs=s.epochs, batch_size=s.batch_size, lr=s.lr, base_lr=s.base_lr,
                                  min_lr=s.min_lr, warmup_epochs=s.warmup_epochs, seed=cfg.seed, device=cfg.device,
                                  amp=cfg.amp, deterministic=cfg.deterministic)
        rc = RetrainConfig(eta=s.eta, warmup_frac=s.warmup_frac, cluster_samples=s.cluster_samples,
                           kd_alpha=s.kd_alpha, kd_temperature=s.kd_temperature, feat_kd=s.feat_kd)
        if s.feat_kd and s.teacher == "none":
            raise NascompressError("feat_kd distils from the base model's features; set teacher: base or feat_kd: 0")
        job = RetrainJob(model_dir=str(current), out=str(out / "final"),
                         data=_data_config(cfg, train_limit=s.train_limit), train=tc, retrain=rc,
                         teacher=str(base_dir) if s.teacher == "base" else None, auto_batch=s.batch_size is None)
    except NascompressError as e:
        raise ctx.err("stages.retrain", str(e)) from None
    def run(force: bool, resume: bool) -> dict[str, Any]:
        start = current_model(out, base_dir=base_dir, dcs=cfg.stages.dcs is not None,
                              tokens=cfg.stages.tokens is not None, retrain=True, upto="retrain")
        if start is None:
            return {"skipped": True, "reason": "no compressed model to retrain (the DCS stage was skipped)"}
        return retrain(job.replace(model_dir=str(start)), force=force, resume=resume)

    return Step("retrain", out / "final", "train", run,
                outputs=("final/model.safetensors", "final/metrics.json"),
                describe=f"retrain the compressed model ({s.epochs} epochs, eta {s.eta:g}"
                         f"{', teacher: the base' if s.teacher == 'base' else ''})")


def _plan_export(cfg: PipelineConfig, out: Path, base_dir: Path) -> Step:
    from .export import export_run
    from .pipeline_fallback import current_model

    s = cfg.export
    target, ec = out / "export" / s.filename, s.config(seed=cfg.seed)

    def run(force: bool, resume: bool) -> dict[str, Any]:
        st = cfg.stages
        final = current_model(out, base_dir=base_dir, dcs=st.dcs is not None, tokens=st.tokens is not None,
                              retrain=st.retrain is not None, upto="final")  # after a DCS fallback: what was made
        # no compressed model (the DCS stage was skipped and nothing else compresses): the base is exported
        return export_run(final or base_dir, out=target, config=ec, force=True)["verification"]

    return Step("export", out / "export", "redo",  # the step owns OUT/export: an earlier attempt is replaced
                run,
                outputs=(f"export/{s.filename}", f"export/{s.filename}.json"),
                describe=f"export the final model as {s.format} (export/{s.filename}), checked against PyTorch")


def plan(config: str | Path, *, out: str | Path, seed: int | None = None) -> Pipeline:
    """Validate ``config`` completely (schema, files, models, space, every stage's job) and return
    the pipeline for ``out``. Reads files, writes nothing."""
    from .utils import resolve_device

    config = Path(config)
    cfg = load_config(config, seed=seed)
    ctx = _Ctx(str(config), config.resolve().parent)
    try:
        resolve_device(cfg.device)
    except NascompressError as e:
        raise ctx.err("device", str(e)) from None
    out = Path(os.path.abspath(out))
    n_classes = _check_data(cfg, ctx)
    base_step, base_dir, dense = _plan_base(cfg, out, ctx, n_classes)
    steps = [base_step]
    current = base_dir
    if cfg.stages.dcs is not None:
        steps += _plan_dcs(cfg, out, ctx, base_dir)
        current = out / "dcs_mat"
    storage = None
    if cfg.stages.tokens is not None:
        tok, storage = _plan_tokens(cfg, out, ctx, current, len(dense.blocks), base_dir)
        steps += tok
        current = out / "tokens" / "picked"
    if cfg.stages.retrain is not None:
        steps.append(_plan_retrain(cfg, out, ctx, current, base_dir))
        current = out / "final"
    if cfg.export is not None:
        steps.append(_plan_export(cfg, out, base_dir))
    pipe = Pipeline(cfg=cfg, out=out, source=str(config), steps=steps, base_dir=base_dir, final_dir=current,
                    storage=storage, data=_data_config(cfg))

    def report(force: bool, resume: bool) -> dict[str, Any]:
        from .pipeline_report import write_summary

        return write_summary(pipe)

    steps.append(Step("report", None, "redo", report, outputs=("summary.json", "report.html"),
                      describe="compare with the dense base; write summary.json and report.html"))
    return pipe


# ---------------------------------------------------------------------------------------------
# Running


def _stray(p: Path) -> bool:
    """Files that do not make OUT a used directory: a temp file of a write killed mid-way, the lock."""
    return p.name == LOCK_FILE or (p.name.startswith(".") and p.name.endswith(".tmp"))


def _check_out(out: Path, *, force: bool) -> None:
    """Refuse an OUT that is a file, or a used directory that holds no pipeline run (without force)."""
    if out.exists() and not out.is_dir():
        raise NascompressError(f"output path {out} exists and is not a directory; choose another --out")
    used = out.is_dir() and any(not _stray(p) for p in out.iterdir())
    if used and not force and not (out / CONFIG_FILE).is_file():
        raise NascompressError(f"output directory {out} already exists and holds no pipeline run ({CONFIG_FILE}); "
                               "choose another --out or pass --force to replace it")


def _lock(out: Path) -> int:
    """Hold an exclusive lock on OUT for this process (released by the OS when it exits, even on
    kill -9), so two runs never write into one pipeline directory at once."""
    import fcntl

    try:
        with writing(out, what=f"pipeline directory {out}", then=_CONTINUE):
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # not a disk or permission problem (those are one line already)
        raise NascompressError(f"cannot create output directory {out}: {e.strerror}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise NascompressError(f"another 'nascompress pipeline' is running in {out}; wait for it to finish or stop "
                               "it first") from None
    return fd


def _claim_out(pipe: Pipeline, *, force: bool) -> bool:
    """Make the (locked) OUT ready: new, resumed (same config) or started over (``force``); write
    config.yaml. Returns True when an earlier run is continued."""
    out, stored = pipe.out, pipe.out / CONFIG_FILE
    used = any(not _stray(p) for p in out.iterdir())
    if used and not force:
        old = read_yaml(stored)
        new = yaml.load(yaml.safe_dump(pipe.cfg.to_dict(), sort_keys=False), Loader=_Loader)  # noqa: S506
        if old != new:
            diff = _diff(new, old if isinstance(old, dict) else {})
            more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
            raise NascompressError(f"{out} holds a pipeline run of another config ({'; '.join(diff[:3])}{more}); "
                                   f"rerun it with the same config ({stored}) to continue it, use another --out, or "
                                   "pass --force to start over")
        return True
    for p in out.iterdir():  # start over (force), or clear what a killed first run left
        if p.name != LOCK_FILE:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    from .utils import atomic_path

    with atomic_path(stored) as tmp:
        tmp.write_text(dump_config(pipe.cfg))
    return False


def _marker(out: Path, step: Step) -> Path:
    return out / DONE_DIR / f"{step.name}.json"


def step_done(out: Path, step: Step) -> bool:
    """A step is complete when its marker and every output exist (or its marker says it was
    skipped: a DCS stage that collapsed twice, and the steps that then had nothing to do)."""
    marker = _marker(out, step)
    if not marker.is_file():
        return False
    if all((out / p).exists() for p in step.outputs):
        return True
    return bool((read_json(marker).get("result") or {}).get("skipped"))


def _compact(res: Any) -> Any:
    """A step's result as kept in its marker (scalars only; the stage's own files hold the rest)."""
    if not isinstance(res, dict):
        return {}
    return {k: v for k, v in res.items() if isinstance(v, (int, float, str, bool)) or v is None}


def run_pipeline(config: str | Path, *, out: str | Path, force: bool = False, seed: int | None = None,
                 progress: bool = True, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Validate ``config``, then run (or continue) the pipeline in ``out``; return the summary.

    Args:
        config: the pipeline YAML file.
        out: the pipeline's directory (created; an earlier run of the same config is continued).
        force: start over in ``out`` (its contents are removed), even with another config.
        seed: override the file's seed.
        progress: live progress of the study (stderr).
        log: called with one line per step (skipped, running, done); default: silent.
    """
    log = log or (lambda msg: None)
    pipe = plan(config, out=out, seed=seed)  # everything is checked before anything is written
    _check_out(pipe.out, force=force)
    lock = _lock(pipe.out)
    try:
        with writing(pipe.out, what=f"pipeline directory {pipe.out}", then=_CONTINUE):
            return _run(pipe, force=force, progress=progress, log=log)
    finally:
        os.close(lock)


def _run(pipe: Pipeline, *, force: bool, progress: bool, log: Callable[[str], None]) -> dict[str, Any]:
    resumed = _claim_out(pipe, force=force)
    if resumed:
        log(f"continuing the pipeline in {pipe.out}")
    ran: dict[str, bool] = {}
    for step in pipe.steps:
        if step_done(pipe.out, step):
            log(f"{step.name}: complete, skipped")
            ran[step.name] = False
            continue
        d = step.dir
        resume = step.mode == "train" and d is not None and (d / "config.json").is_file()
        force_step = d is not None and d.exists() and not resume and step.mode != "study"
        how = ""
        if resume and (d / "checkpoint.safetensors").is_file():
            how = " (continuing from its last checkpoint)"
        elif step.mode == "study" and d is not None and d.exists():
            how = " (continuing the study)"
        log(f"{step.name}: {step.describe}{how}")
        t0 = time.perf_counter()
        if step.mode == "study":
            res = step.run(force=False, resume=False, progress=progress)
        else:
            res = step.run(force=force_step, resume=resume)
        if isinstance(res, dict) and res.get("dcs_outcome") in ("milder", "skipped"):
            log(f"{step.name}: the search collapsed ({res.get('dcs_reason')}); "
                + (f"retried at {res['dcs_target']:g}x the dense FLOPs" if res["dcs_outcome"] == "milder"
                   else "the pipeline goes on without DCS"))
        elif isinstance(res, dict) and res.get("skipped"):
            log(f"{step.name}: skipped ({res.get('reason')})")
        (pipe.out / DONE_DIR).mkdir(exist_ok=True)
        write_json(_marker(pipe.out, step), {"step": step.name, "seconds": round(time.perf_counter() - t0, 3),
                                             "finished": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                                             "dir": None if d is None else str(d), "result": _compact(res)})
        ran[step.name] = True
        log(f"{step.name}: done in {time.perf_counter() - t0:.1f} s")
    summary = read_json(pipe.out / "summary.json")
    summary["this_run"] = {"resumed": resumed, "ran": [k for k, v in ran.items() if v],
                           "skipped": [k for k, v in ran.items() if not v]}
    return summary


__all__ = ["FORMAT", "PipelineConfig", "DataSection", "BaseSection", "BaseTrainSection", "BaseImportSection",
           "GoalSection", "DCSStage", "TokensStage", "RetrainStage", "StagesSection", "ReportSection", "ExportSection",
           "Pipeline",
           "Step", "load_config", "dump_config", "plan", "run_pipeline", "step_done", "STEPS"]
