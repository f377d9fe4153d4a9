"""What every API function shares: the model it is given (an ``nn.Module``, a stage result or a
run directory) as a run directory (:func:`model_run`, under a
:class:`~nascompress.pyapi.workspace.Workspace`), the caller's data as a
:class:`~nascompress.data.DataConfig` (:func:`data_config`), and the results (:class:`StageResult`)."""

from __future__ import annotations

import os
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping

import torch
from torch import nn
from timm.models.vision_transformer import VisionTransformer
from torch.utils.data import DataLoader

from ..data import DataConfig
from ..data.choose import data_config_for
from ..data.memory import caller_input, is_memory, register_dataset
from ..errors import NascompressError, SettingError
from ..models.layers import to_plain
from ..runs.io import load_typed, make_arch, save_model
from ..models.build import CUSTOM_BASE, ModelSpec, build_model, input_size
from ..runs.owner import mark_kind
from ..runs.run_dir import RunDir
from .workspace import Workspace
from .user_model import cpu_fp32, frozen_names, restore_frozen, unwrap, with_frozen
from ..runs.out_dir import refuse_overwriting_inputs
from ..runs.run_config import RunConfig, find_run_config
from ..runs.files import METRICS_FILE, Arch, Record, RunMetrics, find_metrics
from ..config import offered
from ..data.input import InputSpec
from ..train.run import input_spec_for

ModelLike = Any  # an nn.Module, a StageResult (or Compressed), or a run directory
API_COPY = "api-copy"  # the marker kind of the API's own copy of a model it was given (model_run)
_ARCHS: "weakref.WeakKeyDictionary[nn.Module, Arch]" = weakref.WeakKeyDictionary()


def remember(model: nn.Module, arch: dict[str, Any] | Arch) -> nn.Module:
    """Record the arch of a model this API made, so that it can be given to another stage."""
    _ARCHS[model] = Arch.of(arch)
    return model


@dataclass(frozen=True)
class StageResult:
    """What a stage made: ``model`` (an ``nn.Module`` of timm's classes wherever the methods allow,
    see the reference's introduction; eval mode, on the CPU), its ``arch`` (what
    :func:`nascompress.load` rebuilds it from: its ``arch.json`` as the typed
    :class:`~nascompress.runs.files.Arch`, ``arch.input``, ``arch.methods``, ``arch.method_names``,
    ``arch.to_dict()`` the file's object), the stage's ``metrics`` (its ``metrics.json`` less the
    completion mark, as the record the stage returns, :attr:`METRICS`: typed fields as attributes,
    ``metrics.test_top1``; ``metrics.get(key)`` reads any key, ``metrics.to_dict()`` gives the object;
    an empty :class:`~nascompress.runs.files.RunMetrics` where no stage ran, e.g. a token method
    applied without data), its ``config`` (its ``config.json``, the job as the command records it: a
    :class:`~nascompress.runs.run_config.RunConfig`, ``config.data`` the dataset, a section of the job
    by ``config.get("train")``; None where the run recorded none) and ``out``, the run directory
    when one was kept (``out=``), else None."""

    METRICS: ClassVar[type[RunMetrics]] = RunMetrics  # the record of the stage's metrics.json

    model: nn.Module
    arch: Arch
    metrics: RunMetrics = field(default_factory=RunMetrics)
    config: RunConfig | None = None
    out: str | None = None

    def save(self, directory: str | Path, *, force: bool = False) -> Path:
        """Write the model as a complete run directory that :func:`nascompress.load` reads (and
        every command takes); returns the directory. One that holds this model already is returned
        as it is (a cell run again); another non-empty one is replaced only with ``force`` and only
        when nascompress wrote it; never the run this result was read from."""
        return write_run(
            directory,
            self.model,
            self.arch,
            config=self.config,
            metrics=self.metrics,
            force=force,
            source=self.out,
            inputs=recorded_inputs(self.config),
        )


# the keys of a job's config.json that name a run or file the job read
INPUT_KEYS = ("search_dir", "model_dir", "run_dir", "source", "teacher", "base", "run", "weights")


def recorded_inputs(config: Mapping[str, Any] | RunConfig | None) -> list[str]:
    """The runs and files a stage's recorded job (its ``config.json``) read, at any depth."""
    found, stack = [], [config.to_dict() if isinstance(config, Record) else dict(config or {})]
    while stack:
        d = stack.pop()
        for k, v in d.items():
            if isinstance(v, Mapping):
                stack.append(v)
            elif k in INPUT_KEYS and isinstance(v, str) and v:
                found.append(v)
    return found


def write_run(
    directory: str | Path,
    model: nn.Module,
    arch: dict[str, Any] | Arch,
    *,
    config: Mapping[str, Any] | RunConfig | None = None,
    metrics: Mapping[str, Any] | RunMetrics | None = None,
    force: bool = False,
    source: str | Path | None = None,
    inputs: Iterable[str] = (),
    kind: str = "run",
) -> Path:
    """``model`` as a complete run (the commands' run life cycle): ``config.json``, weights and arch,
    the completion mark last; an existing non-empty ``directory`` is replaced only with ``force``
    and only when it is a nascompress output holding nothing else. ``source``: the directory the
    model was read from, never replaced (nor a folder holding it, nor one inside it); ``inputs``:
    the runs it was made from (never replaced, nor a folder holding one). ``config`` and ``metrics``:
    records or their dicts (``metrics.json`` is written without their completion mark, a new one
    added)."""
    refuse_overwriting_inputs(directory, [*inputs, source], field="directory")
    if source is not None:
        if Path(source).is_dir() and Path(os.path.realpath(source)) in Path(os.path.realpath(directory)).parents:
            raise SettingError(
                f"{{directory}} {directory} is inside {source}, the run this model was read from: "
                "saving there would change that run; choose another {directory}"
            )
    if not force and kind != API_COPY and holds_model(directory, model, arch):
        return Path(directory)  # saved there already (a notebook cell run again): nothing to replace
    run = RunDir.prepare(directory, force=force)
    run.create(config.to_dict() if isinstance(config, RunConfig) else dict(config or {}), kind=kind)
    save_model(run.path, model, arch)
    if isinstance(metrics, RunMetrics):
        run.finish(metrics.results())
    else:
        run.finish({k: v for k, v in (metrics or {}).items() if k not in ("finished", "finished_files")})
    return run.path


def holds_model(directory: str | Path, model: nn.Module, arch: dict[str, Any] | Arch) -> bool:
    """Whether ``directory`` is a complete run of exactly ``model`` (its weights and arch)."""
    d = Path(directory)
    if not (d / "model.safetensors").is_file() or find_metrics(d) is None:
        return False
    try:
        saved, typed = load_typed(d)
    except NascompressError:
        return False
    if typed.to_dict() != Arch.of(arch).to_dict():
        return False
    a, b = saved.state_dict(), model.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k].detach().cpu()) for k in a)


def read_result(cls: type[StageResult], run: str | Path, *, keep: bool, **extra: Any) -> Any:
    """The stage result ``cls`` of the complete run ``run`` (``keep``: its directory is the caller's):
    its typed arch, its ``metrics.json`` less the completion mark as ``cls.METRICS`` (the record the
    stage returns) and its ``config.json`` (a RunConfig, None without one)."""
    model, arch = load_typed(run)
    to_plain(model)  # timm's own classes wherever the method needs none of nascompress's at inference
    restore_frozen(model, arch)  # the parameters the caller froze come back frozen
    recorded = find_metrics(run)
    metrics = (
        RunMetrics()
        if recorded is None
        else cls.METRICS.from_dict(recorded.results(), source=str(Path(run) / METRICS_FILE))
    )
    return cls(
        model=remember(model, arch),
        arch=arch,
        metrics=metrics,
        config=find_run_config(run),
        out=str(Path(run).resolve()) if keep else None,
        **extra,
    )


def _check_vit(model: nn.Module) -> None:
    if not isinstance(model, VisionTransformer):
        raise NascompressError(
            f"nascompress works on timm VisionTransformer models, got {type(model).__name__}; a "
            "Hugging Face ViT: nascompress.from_transformers(model) first"
        )


def _vit_kwargs(model: nn.Module) -> dict[str, Any]:
    """timm build kwargs that rebuild a plain timm VisionTransformer's shape."""
    _check_vit(model)
    pe, blk = model.patch_embed, model.blocks[0]
    kw: dict[str, Any] = {
        "img_size": list(pe.img_size),
        "patch_size": list(pe.patch_size),
        "embed_dim": model.embed_dim,
        "depth": len(model.blocks),
        "num_heads": blk.attn.num_heads,
        "num_classes": model.num_classes,
        "in_chans": pe.proj.in_channels,
        "mlp_ratio": blk.mlp.fc1.out_features / model.embed_dim,
        "global_pool": model.global_pool,
        "class_token": model.cls_token is not None,
        "qkv_bias": blk.attn.qkv.bias is not None,
        "qk_norm": not isinstance(blk.attn.q_norm, nn.Identity),
        "fc_norm": not isinstance(model.fc_norm, nn.Identity),
        "pre_norm": not isinstance(model.norm_pre, nn.Identity),
        "no_embed_class": bool(model.no_embed_class),
    }
    if getattr(model, "num_reg_tokens", 0):
        kw["reg_tokens"] = int(model.num_reg_tokens)
    if getattr(model, "dynamic_img_size", False):  # kept: the compressed model takes other sizes too
        kw["dynamic_img_size"] = True
    if not isinstance(blk.ls1, nn.Identity):
        kw["init_values"] = 1e-5  # the value is in the weights
    if kw["img_size"][0] == kw["img_size"][1]:
        kw["img_size"] = kw["img_size"][0]
    if kw["patch_size"][0] == kw["patch_size"][1]:
        kw["patch_size"] = kw["patch_size"][0]
    return kw


def dense_arch(model: nn.Module, input_spec: Mapping[str, Any]) -> dict[str, Any]:
    """The arch of a plain timm ViT given as an object: a :class:`ModelSpec` that rebuilds it (checked:
    the rebuilt model loads its weights strictly and gives its logits), with ``input_spec``."""
    name = (getattr(model, "pretrained_cfg", None) or {}).get("architecture") or CUSTOM_BASE
    kwargs = _vit_kwargs(model)
    try:
        spec = ModelSpec(name, kwargs)
        rebuilt = build_model(spec)
    except NascompressError:
        spec = ModelSpec(CUSTOM_BASE, kwargs)
        rebuilt = build_model(spec)
    try:
        rebuilt.load_state_dict(model.state_dict(), strict=True)
    except RuntimeError as e:
        raise NascompressError(
            f"cannot rebuild this {type(model).__name__} from its shape (timm {name} with "
            f"{kwargs}): {str(e).splitlines()[0]}; save it with nascompress.save_model or give "
            "a run directory"
        ) from None
    own_eps = [m.eps for m in model.modules() if isinstance(m, nn.LayerNorm)]
    for m, eps in zip((m for m in rebuilt.modules() if isinstance(m, nn.LayerNorm)), own_eps):
        m.eps = eps  # (a converted Hugging Face model keeps its epsilon; its saved copy has timm's)
    x = torch.randn(2, *input_size(model), generator=torch.Generator().manual_seed(0))
    was = model.training
    with torch.no_grad():
        same = torch.allclose(rebuilt.eval()(x), model.eval()(x), atol=1e-5)
    model.train(was)
    if not same:
        raise NascompressError(
            f"this {type(model).__name__} does not compute what timm {name} with {kwargs} does (a "
            "changed layer or forward); give a run directory instead"
        )
    return make_arch(spec, input_spec=dict(input_spec))


def input_spec(model: nn.Module, data: DataConfig | None) -> dict[str, Any]:
    """How images become the given model's input: the caller's own (identity) for a caller's
    Dataset, else what ``nascompress train`` decides for the dataset (:func:`input_spec_for`)."""
    c, h, w = input_size(model)
    if data is None or is_memory(data.dataset):
        ci = caller_input(c)
        return InputSpec(
            (h, w),
            c,
            ci["mean"],
            ci["std"],
            interpolation=ci["interpolation"],
            crop_pct=ci["crop_pct"],
            crop_mode=ci["crop_mode"],
        ).to_dict()
    return input_spec_for(model, data.dataset).to_dict()


def model_and_arch(model: ModelLike, data: DataConfig | None = None) -> tuple[nn.Module, Arch]:
    """The model object and its (typed) arch, for any :data:`ModelLike`."""
    if isinstance(model, (str, Path)):
        return load_typed(model)
    if isinstance(model, StageResult) or hasattr(model, "arch") and hasattr(model, "model"):
        return model.model, Arch.of(model.arch)
    model = unwrap(model)  # torch.compile's _orig_mod, DataParallel's / DDP's .module
    if not isinstance(model, nn.Module):
        raise NascompressError(
            f"give a model (a timm nn.Module), a result of nascompress or a run directory, got {type(model).__name__}"
        )
    known = _ARCHS.get(model)
    if known is not None and known.spec.kwargs.get("num_classes") in (None, getattr(model, "num_classes", None)):
        return model, known
    _check_vit(model)
    model = cpu_fp32(model)  # a half / bf16 / CUDA model: an fp32 copy on the CPU (never moved in place)
    if known is not None and not known.methods:  # e.g. a converted backbone given a new head since
        return model, Arch.of(dense_arch(model, dict(known.input)))
    return model, Arch.of(dense_arch(model, input_spec(model, data)))


def _own_run(model: ModelLike) -> Path | None:
    """The run directory ``model`` already is: a path, or a result kept with ``out=``; else None."""
    if isinstance(model, (str, Path)):
        return Path(model).resolve()
    out = getattr(model, "out", None)
    return Path(out) if out is not None and Path(out).is_dir() else None


def planned_run(model: ModelLike, ws: Workspace, name: str) -> Path:
    """Where :func:`model_run` finds or writes ``model``'s run, without writing anything (a job can
    be built, and its settings checked, before the copy is written)."""
    own = _own_run(model)
    if own is not None:
        return own
    return ws.path(name) if ws.keep else ws.scratch(name)  # kept with out=: a resumed run reads it again


def model_run(model: ModelLike, ws: Workspace, name: str, *, data: DataConfig | None = None) -> Path:
    """A complete run directory holding ``model`` (its data section: ``data``): the directory
    itself when a path or a kept result is given, else one written under ``ws``'s scratch space
    (with ``out=``: ``out/name``, refused when that holds anything but such a copy), its
    ``arch.json`` naming the parameters the caller froze (:func:`~.user_model.with_frozen`)."""
    where = planned_run(model, ws, name)
    if _own_run(model) is not None:
        return where  # a run of its own: read where it is
    m, arch = model_and_arch(model, data)
    arch = with_frozen(arch, frozen_names(model))  # what the caller froze: no stage trains it (arch.json)
    recorded = getattr(model, "config", None)  # a result's RunConfig (a model object's own attribute: as it is)
    config = recorded.to_dict() if isinstance(recorded, Record) else dict(recorded or {})
    if data is not None:
        config["data"] = asdict(data)
    if where.is_dir() and any(where.iterdir()) and mark_kind(where) != API_COPY:
        raise SettingError(
            f"{{out}} {ws.root} holds {where.name}/, which this call would replace with its copy of "
            f"the given model, and {where} is not such a copy (nascompress never deletes it): choose "
            "another {out}"
        )
    return write_run(
        where, cpu_fp32(m), arch, config=config, metrics=getattr(model, "metrics", None), force=True, kind=API_COPY
    )  # the workspace's own copy of the given model, written again on every call


def data_config(
    data: Any,
    *,
    val: Any = None,
    test: Any = None,
    classes: Iterable[str] | None = None,
    seed: int = 0,
    train_limit: int | None = None,
    eval_limit: int | None = None,
    arg: str = "data",
) -> DataConfig | None:
    """The caller's data as a DataConfig: a built-in dataset name, an ImageFolder path, a DataConfig,
    or a map-style Dataset / DataLoader of (image tensor, label) (``val``, ``test``: its other splits;
    registered in memory, :mod:`nascompress.data.memory`). Of a DataLoader its dataset, batch size and
    worker count are taken; batches are drawn in nascompress's seeded order. Labels are read once per
    dataset (from its ``targets`` attribute when it has one, else by a pass over its items, at most
    the ``max_label_scan`` limit) and must be integer class indices (one-hot or probability vectors
    are taken as their argmax, said in a warning). None stays None (the run's
    recorded data). ``arg``: the name the caller gave ``data`` as (``data``, or ``train``), for messages."""
    if data is None:
        if val is not None or test is not None:
            raise NascompressError(f"val= and test= need {arg}= too")
        return None
    limits = {"seed": seed, "train_limit": train_limit, "eval_limit": eval_limit}
    if isinstance(data, DataConfig):
        return data_config_for(data, **limits)
    if isinstance(data, (str, Path)):
        if val is not None or test is not None:
            raise NascompressError(f"{data} brings its own splits; val= and test= go with a Dataset")
        return data_config_for(dataset=str(data), **limits)
    name = register_dataset(data, val, test, classes=list(classes) if classes else None, what=arg)
    workers = getattr(data, "num_workers", 0) if loader_batch(data) is not None else 0
    # a DataLoader's worker processes fetch the images (the dataset itself goes to them)
    return data_config_for(dataset=name, settings={"num_workers": workers} if workers else None, **limits)


def loader_batch(data: Any) -> int | None:
    """The batch size of a DataLoader the caller gave (the stages then take it), else None."""
    return data.batch_size if isinstance(data, DataLoader) else None


def split_settings(settings: Mapping[str, Any], groups: Mapping[str, Iterable[str]], *, what: str) -> dict[str, dict]:
    """``settings`` (keyword arguments) shared out among ``groups`` by name; unknown names refused."""
    out: dict[str, dict] = {g: {} for g in groups}
    for k, v in settings.items():
        for g, names in groups.items():
            if k in set(names):
                out[g][k] = v
                break
        else:
            valid = sorted({n for names in groups.values() for n in names})
            raise NascompressError(f"{what} has no setting {k!r}; its settings: {', '.join(valid)}")
    return out


__all__ = [
    "StageResult",
    "ModelLike",
    "data_config",
    "model_run",
    "model_and_arch",
    "write_run",
    "read_result",
    "remember",
    "dense_arch",
    "input_spec",
    "split_settings",
    "loader_batch",
    "stage_values",
    "setting_names",
]


def stage_values(spec: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """The values a command's options of ``spec`` (a config class or a StageSettings) take when only
    ``given`` are passed: the options' defaults (:func:`~nascompress.config.offered`), then ``given``."""
    return {**{f.name: default for f, default, _ in offered(spec)}, **given}


def setting_names(*specs: Any) -> list[str]:
    """The names of the settings the ``specs`` offer (config classes or StageSettings)."""
    return [f.name for s in specs for f, _, _ in offered(s)]
