"""``nc.compress``: a model in, a smaller model out, in one call: the job of ``nascompress pipeline``
(:func:`~nascompress.pipeline.run_pipeline`) on the given model as the dense base."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence


from ..config import user_settings
from ..data import DataConfig
from ..data.carve import Splits
from ..errors import NascompressError, SettingError, literal, python_api, python_words
from ..models.layers import to_plain
from ..runs.files import Arch
from ..runs.io import load_typed
from ..pipeline import run_pipeline
from ..pipeline.config_io import load_config
from ..pipeline.schema import ConfigError
from ..pipeline.run import check_out
from ..pipeline.summary import Summary
from ..progress import say, silenced
from ..methods import method_names
from ..methods.dcs import DCSConfig
from .common import ModelLike, data_config, loader_batch, model_run, recorded_inputs, remember, write_run
from .user_model import as_user_dtype, check_qk_norm, device_name, restore_frozen, user_dtype
from .workspace import Workspace
from .data_notes import warn_conversions
from .hf import to_transformers

# the token spaces compress takes by method name (shipped search spaces: an Optuna study picks the setting)


@dataclass(frozen=True, kw_only=True)
class CompressReport:
    """What :func:`compress` measured: the test ``accuracy`` of the compressed model and of the dense
    one (``dense_accuracy``, on the same ``test_images``), ``flops`` / ``params`` / ``latency_ms`` of
    both and their ratios, ``goal_met``: whether ``flops_ratio`` is at or under ``target_flops`` (a
    bound, compared exactly), ``over_target``: by how much it stands above it (0.0 when met),
    ``methods``, ``splits``: which images decided (validation) and which measured ``accuracy``
    (test; a :class:`~nascompress.data.carve.Splits`), the pipeline ``config`` it ran and its
    ``summary`` (``summary.json``'s :class:`~nascompress.pipeline.summary.Summary`)."""

    accuracy: float | None
    dense_accuracy: float | None
    test_images: int | None
    flops: float | None
    dense_flops: float | None
    flops_ratio: float | None
    params: int | None
    dense_params: int | None
    latency_ms: float | None
    dense_latency_ms: float | None
    latency_speedup: float | None
    goal_met: bool | None
    over_target: float | None
    methods: list[str] | None
    splits: Splits | None
    config: Mapping[str, Any]
    summary: Summary

    def metrics(self) -> dict[str, Any]:
        """The report as the saved run's ``metrics.json`` holds it: every field but the summary."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "summary"}


@dataclass(frozen=True)
class Compressed:
    """The compressed model: ``model`` (an ``nn.Module`` of timm's classes wherever the methods allow,
    eval mode), ``arch`` (what :func:`nascompress.load` rebuilds it from: the final run's ``arch.json``
    as the typed :class:`~nascompress.runs.files.Arch`, ``arch.method_names``, ``arch.input`` ...;
    ``arch.to_dict()`` the file's object), ``report`` (what was
    measured: :class:`CompressReport`, ``report.accuracy``, ``report.flops_ratio``, ...; the
    pipeline's ``summary.json`` in ``report.summary``) and ``out`` (the pipeline directory when
    ``out=`` was given)."""

    model: Any
    arch: Arch
    report: CompressReport
    out: str | None = None

    def save(self, directory: str | Path, *, force: bool = False) -> Path:
        """Write the model as a run directory :func:`nascompress.load` (and every command) reads; one
        holding this model already is returned as it is, another non-empty one is replaced only with
        ``force``."""
        cfg = self.report.config
        return write_run(
            directory,
            self.model,
            self.arch,
            config={"data": cfg.get("data"), "compress": cfg},
            metrics=self.report.metrics(),
            force=force,
            source=self.out,
            inputs=recorded_inputs(cfg),
        )

    def to_transformers(self, directory: str | Path, *, force: bool = False) -> Path:
        """Write the model as a Hugging Face ``transformers`` ViT folder
        (:func:`nascompress.pyapi.hf.to_transformers`; ``force``: replace a folder it wrote)."""
        return to_transformers(self.model, directory, arch=self.arch, force=force)


def budget_report(
    summary: Summary, config: Mapping[str, Any], *, warn: bool = False
) -> tuple[bool | None, float | None]:
    """``(goal_met, over_target)`` of a pipeline ``summary`` against the FLOPs goal of its
    ``config`` (``target_flops``): a bound, compared exactly (the pipeline's own ``goal`` compares at
    the precision its report prints); ``warn``: ``warnings.warn`` when the model stands above it."""
    target = (config.get("goal") or {}).get("max_flops")
    ratio = None if summary.comparison is None else summary.comparison.flops_ratio
    if ratio is None or target is None:
        return None, None
    over = max(0.0, ratio - target)
    if warn and over > 1e-9:
        warnings.warn(
            f"nc.compress: the compressed model has {ratio:.4f}x the dense FLOPs, above target_flops={target:g} "
            f"by {over:.4f}x (no model the stages made lands under it; report.over_target)",
            stacklevel=4,  # the caller of the nc.* function (through its python_api wrapper)
        )
    return over <= 1e-9, over


def _report(summary: Summary, config: Mapping[str, Any]) -> CompressReport:
    dense, final, cmp = summary.dense, summary.final, summary.comparison
    goal_met, over_target = budget_report(summary, config)  # the bound, compared exactly
    return CompressReport(
        accuracy=final.test_top1,
        dense_accuracy=dense.test_top1,
        test_images=dense.test_n,
        flops=final.macs,
        dense_flops=dense.macs,
        flops_ratio=cmp.flops_ratio,
        params=final.params,
        dense_params=dense.params,
        latency_ms=final.latency_ms,
        dense_latency_ms=dense.latency_ms,
        latency_speedup=cmp.latency_speedup,
        goal_met=goal_met,
        over_target=over_target,
        methods=final.methods,
        splits=summary.splits,  # which images decided (validation), which measured accuracy (test)
        config=dict(config),
        summary=summary,
    )


def _check_target(target_flops: Any) -> None:
    if isinstance(target_flops, bool) or not isinstance(target_flops, (int, float)) or not 0 < target_flops <= 1:
        raise SettingError(
            f"{{target_flops}} must be a number in (0, 1] (a share of the dense FLOPs), got {target_flops!r}"
        )


def pipeline_config(
    data: DataConfig,
    base: Path,
    *,
    target_flops: float,
    methods: Sequence[str],
    teacher: Any,
    epochs: int | None,
    seed: int,
    device: str,
    trials: int,
    latency: bool,
    stages: Mapping[str, Mapping[str, Any] | None],
) -> dict[str, Any]:
    """The ``nascompress pipeline`` file ``compress`` runs, as plain data (what its report records);
    ``compress`` reads it with :func:`~nascompress.pipeline.config_io.load_config`, the pipeline
    file's own checks, into the typed config it runs."""
    _check_target(target_flops)
    methods, token_methods = list(methods), method_names(token_stage=True)  # (the pipeline's tokens stage runs)
    bad = [m for m in methods if m != "dcs" and m not in token_methods]
    tokens = [m for m in methods if m in token_methods]
    if bad or len(tokens) > 1 or not methods or len(set(methods)) != len(methods):
        raise NascompressError(
            f"methods must be 'dcs' and/or one token method of {', '.join(token_methods)}, got {tuple(methods)}"
        )
    if teacher not in (None, False):
        raise NascompressError(
            "nc.compress distils from the dense model it is given (teacher=None) or from none "
            "(teacher=False); for another teacher run the stages: nc.retrain(..., teacher=...)"
        )
    st: dict[str, Any] = {}
    if "dcs" in methods:  # with a token method the channels take the square root of the goal, the tokens the rest
        st["dcs"] = {
            "target_flops": round(target_flops**0.5, 3) if tokens else target_flops,
            "at_most": True,  # the target is a bound: the search lands at or under it
            **dict(stages.get("dcs") or {}),
        }
    if tokens:
        st["tokens"] = {"space": tokens[0], "trials": trials, **dict(stages.get("tokens") or {})}
    if epochs != 0:
        st["retrain"] = {
            **({"epochs": epochs} if epochs else {}),
            "distil_from": "none" if teacher is False else "base",
            **dict(stages.get("retrain") or {}),
        }
    d = {f.name: getattr(data, f.name) for f in user_settings(DataConfig)}
    return {
        "format": "nascompress-pipeline/1",
        "seed": seed,
        "device": str(device),  # a torch.device as its name
        "data": d,
        "base": {"run": str(base)},
        "goal": {"max_flops": target_flops},
        "stages": st,
        "report": {"latency": latency, "iters": 5, **dict(stages.get("report") or {})},
    }


STAGE_ARGUMENTS = ("dcs", "tokens", "retrain")  # the pipeline's stages whose keys a dict argument of compress sets
_KEY = re.compile(r"[a-z][a-z0-9_]*")  # a key such an argument's entry names
_LITERAL = re.compile(r"-?\d[\d.]*(?:e-?\d+)?|True|False|None|'[^']*'")  # a number, a constant or a quoted text
_VALUE = re.compile(_LITERAL.pattern + r"|[a-z]+[0-9_]\w*")  # a value, not a word


def stage_entry(path: str) -> tuple[str, str, str] | None:
    """The entry of :func:`compress`'s stage argument that sets the pipeline key ``path`` (a key path,
    data): ``(stage, key, rest)`` for a key of ``stages.dcs`` / ``stages.tokens`` / ``stages.retrain``
    (``rest``: the path below the key, ``.x``, or what follows a name that is no such key's), None for
    any other key (``goal.max_flops``, ``stages.dcs`` itself)."""
    top, _, below = path.partition(".")
    stage, _, key = below.partition(".")
    m = _KEY.match(key)
    if top != "stages" or stage not in STAGE_ARGUMENTS or m is None:
        return None
    return stage, m.group(0), key[m.end() :]


def argument_of(path: str) -> str:
    """The pipeline key ``path`` as the argument of :func:`compress` that sets it (``stages.dcs.epochs``:
    ``dcs['epochs']``); any other key as the file names it."""
    entry = stage_entry(path)
    return path if entry is None else f"{entry[0]}['{entry[1]}']{entry[2]}"


def compress_words(e: SettingError) -> str:
    """A :class:`SettingError` raised inside :func:`compress`'s pipeline, worded as :func:`compress`'s
    arguments: a field that is a key of a stage's section (its key path in ``e.keys``, a step's error:
    :func:`~nascompress.pipeline.run.step_error`) as the entry of that stage's dict, its value written
    in it (``dcs={'target_flops': 0.39}``); another key of the file by its key path (``data.dataset``);
    every other field as :func:`~nascompress.errors.python_words` names it (``force=True``). The
    message's text is never read: only the fields' key paths are."""
    entries = {f: stage_entry(path) for f, path in e.keys.items()}

    def field(f: str) -> str:
        if f not in entries:
            return "{%s}" % f  # an argument of the call
        entry = entries[f]
        return literal(e.keys[f]) if entry is None else "{%s}%s" % (f, literal(entry[2]))

    def words(f: str, value: str | None, closes: bool) -> str | None:
        if entries.get(f) is None:
            return None
        stage, key, _ = entries[f]
        if value is not None and not (_VALUE.fullmatch(value) or closes):  # a word after the key, not its value
            return f"{stage}={{'{key}': ...}} {value}"
        if value is not None and not _LITERAL.fullmatch(value):
            value = repr(value)  # a text value
        return f"{stage}={{'{key}': {value or '...'}}}"

    return python_words(e.renamed(field), call="nc.compress", entry=words)


@python_api("nc.compress")
def compress(
    model: ModelLike,
    train: Any = None,
    val: Any = None,
    *,
    test: Any = None,
    target_flops: float = 0.6,
    methods: Sequence[str] = ("dcs", "evit"),
    teacher: Any = None,
    epochs: int | None = None,
    out: str | Path | None = None,
    seed: int = 0,
    device: str = "auto",
    trials: int = 20,
    train_limit: int | None = None,
    eval_limit: int | None = None,
    latency: bool = True,
    dcs: Mapping[str, Any] | None = None,
    tokens: Mapping[str, Any] | None = None,
    retrain: Mapping[str, Any] | None = None,
    force: bool = False,
    progress: bool = True,
) -> Compressed:
    """Compress a dense timm ViT to ``target_flops`` x its FLOPs: ``nascompress pipeline`` on it.

    ``dcs`` in ``methods`` searches and gathers its channels (``nascompress search dcs``,
    ``materialize``); a token method (``evit``, ``tome``, ``dynamicvit`` ...) runs an Optuna study of
    its settings (``trials`` trials) and takes the most accurate one under the goal; then the model is
    retrained (``epochs``, distilling from the dense model unless ``teacher=False``) and measured
    against the dense one on the test split.

    Args:
        model: the dense model: a timm ``VisionTransformer`` (``nn.Module``; a Hugging Face one:
            :func:`nascompress.from_transformers` first), a result of this API, or a run directory. A
            ``torch.compile``d or ``DataParallel`` / DDP model is unwrapped; a half / bf16 or CUDA one
            is compressed as an fp32 copy on the CPU (never moved) and given back in its dtype; its
            frozen parameters (``requires_grad=False``) are trained by no stage and come back frozen,
            bit for bit where no method slices them (the kept rows where one does); with
            ``qk_norm`` the default static Q/K mask is refused before anything runs.
        train / val / test: the data (``train`` is required): a built-in dataset name
            (``"fashion-mnist"``, ``"digits"``), an ImageFolder root, a ``DataConfig``, or a map-style
            ``Dataset`` / ``DataLoader`` of (image tensor, label) with its own preprocessing (then
            ``val``/``test`` are its other splits; None: carved from ``train``; a DataLoader's batch
            size is every training stage's; one-hot or probability-vector labels are taken as their
            argmax, and uint8 images divided by 255, each said in a warning). A built-in dataset's
            images resized or given the model's channels are said in a warning per conversion.
        target_flops: the goal, a share of the dense model's FLOPs, and a bound: the channel search
            lands at or under it (``at_most``), and a model that still stands above it is returned
            with a warning (``warnings.warn``) and ``report.over_target``, by how much.
        methods: ``"dcs"`` and/or one token method.
        teacher: None: distil from the dense model; False: no distillation.
        epochs: retraining epochs (None: retrain's recipe; 0: no retraining).
        out: keep every stage's run directory there; a second call with the same arguments continues an
            interrupted run (finished stages are skipped). None: nothing is written. It may hold other
            files: the call writes only its own folders there (``source``, ``pipeline``) and refuses
            one of those names that holds anything nascompress did not write.
        seed / device: one seed for every stage; ``auto``, ``cpu`` or ``cuda`` (or a ``torch.device``;
            another kind, such as ``mps``, is refused).
        trials: trials of the token study.
        train_limit / eval_limit: use class-stratified subsets of the images (quick runs).
        latency: time the models for the report.
        dcs / tokens / retrain: any other key of the pipeline file's ``stages.dcs`` / ``stages.tokens``
            / ``stages.retrain`` sections (``dcs={"epochs": 2, "qk_mask": "static"}``).
        force: start over in ``out`` (replaces only what nascompress wrote there).
        progress: a line per stage and the study's progress on stderr, as the command shows them (rich
            bars in a terminal, tqdm's bars in a Jupyter notebook with ipywidgets, plain lines elsewhere;
            ``NASCOMPRESS_PROGRESS=off`` silences every stage).
    """
    _check_target(target_flops)  # before anything is written
    if train is None:  # never a dataset the caller did not name (Fashion-MNIST was the silent default)
        raise NascompressError(
            "nc.compress needs train=: your Dataset or DataLoader of (image tensor, label), an ImageFolder "
            "root, or a built-in dataset's name (train='fashion-mnist', 'digits')"
        )
    device = device_name(device)
    if "dcs" in methods:  # a search whose Q/K mask could not be materialized: refused before it runs
        check_qk_norm(model, dict(dcs or {}).get("qk_mask", DCSConfig().qk_mask), how="dcs={'qk_mask': 'none'}")
    dtype = user_dtype(model)  # compressed in fp32, given back in the caller's dtype
    batch = loader_batch(train)  # a DataLoader's batch size: every training stage's
    if batch is not None:
        dcs, retrain = ({"batch_size": batch, **dict(st or {})} for st in (dcs, retrain))
    cfg_data = data_config(
        train, val=val, test=test, seed=seed, train_limit=train_limit, eval_limit=eval_limit, arg="train"
    )
    with Workspace(out) as ws:
        check_out(ws.path("pipeline"), force=force)  # before the model's copy is written
        base = model_run(model, ws, "source", data=cfg_data)
        warn_conversions(base, cfg_data, what="nc.compress")  # a built-in dataset's images made the model's
        config = pipeline_config(
            cfg_data,
            base,
            target_flops=target_flops,
            methods=methods,
            teacher=teacher,
            epochs=epochs,
            seed=seed,
            device=device,
            trials=trials,
            latency=latency,
            stages={"dcs": dcs, "tokens": tokens, "retrain": retrain},
        )
        try:  # the config as data, validated as a pipeline file is (its errors named nc.compress): the typed config
            typed = load_config(config, source="nc.compress")
            with silenced(not progress):  # progress=False: a quiet library call
                summary = run_pipeline(
                    typed,
                    out=ws.path("pipeline"),
                    force=force,
                    progress=progress,
                    log=(lambda msg: say(f"compress: {msg}")) if progress else None,
                    source="nc.compress",
                )
        except SettingError as e:  # a stage's advice, its fields the config's keys (e.keys): as nc.compress's arguments
            raise SettingError(literal(compress_words(e))) from None
        except NascompressError as e:  # a config key (ConfigError.keys) as the argument that set it: dcs['epochs']
            raise NascompressError(e.worded(argument_of) if isinstance(e, ConfigError) else str(e)) from None
        if summary.final is None:
            raise NascompressError(f"no compressed model could be made: {summary.goal.statement}")
        final, arch = load_typed(summary.final.run)
        to_plain(final)  # timm's own classes wherever the methods need none of nascompress's
        report = _report(summary, config)
        budget_report(summary, config, warn=True)
        return Compressed(
            model=as_user_dtype(remember(restore_frozen(final, arch), arch), dtype),
            arch=arch,
            report=report,
            out=str(ws.path("pipeline")) if ws.keep else None,
        )


__all__ = [
    "CompressReport",
    "Compressed",
    "compress",
    "pipeline_config",
    "budget_report",
    "compress_words",
    "argument_of",
    "stage_entry",
]
