"""The model file format and the one loader that rebuilds any saved model.

A nascompress model is ``model.safetensors`` plus ``arch.json`` in one directory. ``arch.json``
(also embedded in the safetensors metadata under ``nascompress_arch``, so the weights file alone
is enough) holds::

    {"format": "nascompress-arch/2",
     "model": {"name": <timm name>, "kwargs": {...}},        # ModelSpec
     "input": {"in_chans", "img_size", "mean", "std",         # preprocessing (data.InputSpec)
               "interpolation", "crop_pct", "crop_mode"},
     "labels": ["cat", "dog", ...],                           # class names by output index (when known)
     "methods": [{"name": "dcs", "config": {...}, ...}, ...]} # every compression decision

:func:`load` gives the model timm's own metadata too: its ``pretrained_cfg`` (and ``default_cfg``)
hold the recorded input size, mean/std, interpolation, crop and ``label_names``, so
``timm.data.resolve_data_config(model=model)`` and ``timm.data.create_transform(**that)`` build the
model's evaluation transform (:func:`timm_pretrained_cfg`).

Training checkpoints (optimizer, schedules, RNG) are saved with
:func:`~nascompress.runs.checkpoint.save_state`, which stores tensors in safetensors and everything
else as JSON: nothing is pickled.

Complete runs. A run directory (what ``train``, ``import``, ``finetune``, ``search dcs``,
``materialize`` and ``retrain`` write, the pipeline's stages included) is complete only once its
last write has happened: ``metrics.json`` with ``"finished": true``, written atomically by
:func:`finish_run` after every other file. Every reader (:func:`load`, :func:`load_with_arch`,
:func:`load_arch`, so ``evaluate``, ``finetune``, ``search``, ``materialize``, ``retrain``,
``profile``, the pipeline and export) refuses a run without it in one line, saying whether
``--resume`` continues it (it has a ``checkpoint.safetensors``) or what to delete
(:func:`check_complete`). A directory without any run file (a nascompress ``config.json``, ``log.jsonl``,
``checkpoint.safetensors``, ``last.safetensors``, ``metrics.json``) is a plain model directory, e.g.
``model.safetensors`` + ``arch.json`` assembled by hand or with :func:`save_model`: it is loaded
as it is. Runs written before the mark existed (``metrics.json`` without ``finished``) count as
complete: ``metrics.json`` was already their last write. The mark is typed (only the JSON boolean
``true``) and tied to the files it vouches for: ``finished_files`` holds the size and sha256 of
``model.safetensors`` and ``arch.json``, and a run whose files changed since is refused (a
model replaced or damaged after the run). A model whose weights are not all finite (NaN or inf)
is refused by the loader, naming the tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence
import hashlib

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file
from torch import nn

from ..errors import NascompressError, SettingError, literal, words, writing
from ..methods import apply_methods
from ..models.layers import to_plain
from ..models.build import ModelSpec, build_model
from ..models.weights import load_state_strict
from .run_config import find_run_config
from .files import READ_FORMATS  # noqa: F401  (kept importable from io, the model format's module)
from .files import (
    ARCH_FILE,
    ARCH_FORMAT,
    METRICS_FILE,
    Arch,
    RunMetrics,
    plain,
    read_arch_json,
    read_metrics_json,
    validate_arch,
    write_arch_json,
    write_metrics_json,
)
from .json_io import atomic_path, check_regular_file, parse_json
from ..runtime import machine_device
from ..runtime import parse_dtype
from .loaded import check_finite, compile_loaded

_V1_RENAMES = (
    (".attn.sp_w_down", ".attn.kernel.w_down"),
    (".attn.sp_w_up", ".attn.kernel.w_up"),
    (".attn.dcs_theta", ".attn.qk_mask.theta"),
)
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# files only a run writes (a plain model directory has none of them; nor a config.json of a run)
RUN_FILES = (METRICS_FILE, "log.jsonl", "checkpoint.safetensors", "last.safetensors")
# the command that wrote a run, told apart by its config.json's keys; (command, can it --resume)
_COMMANDS = (
    (("import",), "nascompress import", False),
    (("materialize",), "nascompress materialize", False),
    (("source", "search"), "nascompress search dcs", True),
    (("model_dir", "retrain"), "nascompress retrain", True),
    (("run_dir", "method"), "nascompress finetune", True),
    (("model", "train"), "nascompress train", True),
)


def make_arch(
    spec: ModelSpec,
    *,
    input_spec: dict[str, Any],
    methods: list[dict[str, Any]] | None = None,
    labels: Sequence[str] | None = None,
) -> dict[str, Any]:
    """A new arch; ``labels``: the class names by output index (the dataset's classes)."""
    arch = {"format": ARCH_FORMAT, "model": spec.to_dict(), "input": dict(input_spec)}
    if labels is not None:
        arch["labels"] = [str(c) for c in labels]
    arch["methods"] = list(methods or [])
    return arch


def set_labels(arch: dict[str, Any], labels: Sequence[str] | None) -> dict[str, Any]:
    """Record ``labels`` (class names by output index) in ``arch``, in place; returns it."""
    if labels is not None:
        arch["labels"] = [str(c) for c in labels]
    return arch


def timm_pretrained_cfg(model: nn.Module, arch: dict[str, Any]) -> dict[str, Any]:
    """timm's ``pretrained_cfg`` for a loaded model: its timm config with the recorded preprocessing
    (``input_size`` (C, H, W), ``mean``, ``std``, ``interpolation``, ``crop_pct``, ``crop_mode``),
    ``num_classes`` and ``label_names`` (the recorded class names; else timm's own where the head
    still has its class count; else None). The test-time size and crop of the original config are
    dropped: they describe another model."""
    inp = arch["input"]
    orig = dict(getattr(model, "pretrained_cfg", None) or {})
    n = int(getattr(model, "num_classes", 0))
    labels = (
        list(arch["labels"])
        if arch.get("labels")
        else (orig.get("label_names") if orig.get("num_classes") == n else None)
    )
    cfg = {
        k: v
        for k, v in orig.items()
        if k not in ("test_input_size", "test_crop_pct", "fixed_input_size", "label_descriptions")
    }
    h, w = (int(v) for v in inp["img_size"])
    cfg.update(
        input_size=(int(inp["in_chans"]), h, w),
        mean=tuple(inp["mean"]),
        std=tuple(inp["std"]),
        interpolation=inp.get("interpolation", "bilinear"),
        crop_pct=float(inp.get("crop_pct", 1.0)),
        crop_mode=inp.get("crop_mode", "center"),
        num_classes=n,
        label_names=labels,
    )
    return cfg


def _upgrade_v1(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """State dicts of format /1 name the methods' new parameters differently: rename them."""
    out = {}
    for k, v in sd.items():
        for old, new in _V1_RENAMES:
            if old in k:
                k = k.replace(old, new)
        out[k] = v
    return out


def build_from_arch(arch: dict[str, Any]) -> nn.Module:
    """Build the (randomly initialised) model that ``arch`` describes, methods applied."""
    model = build_model(ModelSpec.from_dict(arch["model"]))
    return apply_methods(model, arch["methods"], inplace=True)  # built here: no copy needed


def _state_dict_for_save(model: nn.Module) -> dict[str, torch.Tensor]:
    # safetensors refuses shared and non-contiguous tensors (sliced weights).
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}


def save_model(
    run_dir: str | Path, model: nn.Module, arch: dict[str, Any] | Arch, *, filename: str = MODEL_FILE
) -> Path:
    """Write ``filename`` (weights, arch in metadata) and ``arch.json`` atomically into run_dir."""
    run_dir, arch = Path(run_dir), arch.to_dict() if isinstance(arch, Arch) else arch
    with writing(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / filename
    with atomic_path(path) as tmp:
        save_file(_state_dict_for_save(model), str(tmp), metadata={"nascompress_arch": json.dumps(arch)})
    write_arch_json(run_dir, arch)
    return path


# the files a run's completion mark vouches for (their size and sha256, in metrics.json)
VOUCHED_FILES = (MODEL_FILE, ARCH_FILE)
_SHA256: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> sha256: each file hashed once a process


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file (hashed once per process for a given size and modification time)."""
    st = os.stat(path)
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _SHA256:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _SHA256[key] = h.hexdigest()
    return _SHA256[key]


def finish_run(run_dir: str | Path, metrics: Mapping[str, Any] | RunMetrics) -> None:
    """Mark ``run_dir`` complete: write ``metrics.json`` (``metrics``, a stage's record or dict, with ``"finished":
    true`` and ``"finished_files"``: the size and sha256 of its model files) atomically. Call it after every
    other write of the run: it is the mark every reader checks (:func:`run_state`)."""
    d = Path(run_dir)
    files = {
        name: {"bytes": (d / name).stat().st_size, "sha256": file_sha256(d / name)}
        for name in VOUCHED_FILES
        if (d / name).is_file()
    }
    write_metrics_json(d, dict(plain(metrics), finished=True, finished_files=files))


def _mark(d: Path) -> tuple[str, str | None]:
    """(state, what differs) of the completion mark in ``d/metrics.json``: ``complete``,
    ``altered`` (a vouched file changed since), ``unmarked`` (no mark, or not the boolean true)
    or ``absent`` (no metrics.json)."""
    if not (d / METRICS_FILE).is_file():
        return "absent", None
    try:
        metrics = read_metrics_json(d)
    except NascompressError:
        return "unmarked", None
    if not isinstance(metrics, dict):
        return "unmarked", None
    if "finished" not in metrics:
        return "complete", None  # runs written before the mark: metrics.json was already their last write
    if metrics["finished"] is not True:  # typed: "yes", 1 or "true" do not mark a run finished
        return "unmarked", None
    files = metrics.get("finished_files", {})  # runs written before the files were vouched for: none
    if not isinstance(files, dict):
        return "unmarked", None
    for name, want in files.items():
        if name not in VOUCHED_FILES:  # e.g. "../../x": never read outside the run
            return "altered", (
                f"its completion mark names {str(name)!r}, not a file of the run ({', '.join(VOUCHED_FILES)})"
            )
        p = d / str(name)
        if not isinstance(want, dict) or not p.is_file():
            return "altered", f"{name} is missing"
        try:
            size = p.stat().st_size
            same = size == want.get("bytes") and file_sha256(p) == want.get("sha256")
        except OSError:
            same = False
        if not same:
            return "altered", f"{name} is not the file the run finished with: its size or sha256 differs"
    return "complete", None


def run_state(run_dir: str | Path) -> str:
    """``complete`` (finished run), ``unfinished`` (a run without its mark), ``altered`` (a finished
    run whose model files changed since) or ``plain`` (a model directory without run files, e.g.
    assembled by hand)."""
    d = Path(run_dir)
    state, _ = _mark(d)
    if state in ("complete", "altered"):
        return state
    return "unfinished" if any((d / f).exists() for f in RUN_FILES) or _writer(d) is not None else "plain"


def _writer(d: Path) -> tuple[str, bool] | None:
    """(command, can it --resume) of the nascompress run whose config.json is in ``d``, else None."""
    try:
        cfg = find_run_config(d)  # a damaged one (not a JSON object): none
    except NascompressError:
        return None
    if cfg is None:
        return None
    return next(((c, r) for keys, c, r in _COMMANDS if all(k in cfg for k in keys)), None)


def continue_advice(run_dir: str | Path) -> str:
    """What to do, once a full disk is freed, with a run that stopped writing ``run_dir``: continue
    it with --resume (its config.json says which command), or (nothing to continue) rerun it with
    --force, which replaces the unfinished directory (a plain rerun refuses an existing one); a
    pipeline's stage: rerun the pipeline."""
    d = Path(run_dir)
    pipe = _pipeline_of(d)
    if pipe is not None:
        return f"then rerun 'nascompress pipeline {pipe / 'config.yaml'} --out {pipe}' to finish it"  # a command line
    writer = _writer(d)
    if writer is not None and writer[1]:
        return f"then continue it with '{writer[0]} --resume --out {d}'"  # a whole command line
    if d.is_dir() and any(d.iterdir()):
        return words(f"then run the command again with {{force}} (it replaces the unfinished {literal(str(d))})")
    return "then rerun the command"


def _pipeline_of(d: Path) -> Path | None:
    """The pipeline directory holding run ``d`` (OUT/base, OUT/tokens/picked, ...), if any."""
    for up in (d.parent, d.parent.parent):
        if (up / "config.yaml").is_file() and (up / "done").is_dir():
            return up
    return None


def check_complete(run_dir: str | Path) -> None:
    """Refuse an unfinished run directory in one line: how to continue it, or what to delete."""
    d = Path(run_dir)
    state = run_state(d)
    if state == "altered":
        raise NascompressError(
            f"{d} is a finished run whose files changed since (replaced, edited or damaged): "
            f"{_mark(d)[1]}; run the command that wrote it again, or keep the new files as a plain "
            f"model directory ({MODEL_FILE} + {ARCH_FILE} only)"
        )
    if state != "unfinished":
        return
    pipe = _pipeline_of(d)
    if pipe is not None:
        raise NascompressError(
            f"{d} is an unfinished stage of the pipeline in {pipe} (no {METRICS_FILE} with "
            f"finished=true); rerun 'nascompress pipeline {pipe / 'config.yaml'} --out {pipe}' "
            "to finish it"
        )  # a whole command line for the shell
    command, resumable = _writer(d) or ("the command that wrote it", False)
    why = f"{d} is an unfinished run: it has no {METRICS_FILE} with finished=true ({command} stopped before its end)"
    if resumable and (d / "checkpoint.safetensors").is_file():
        raise NascompressError(f"{why}; continue it with '{command} --resume --out {d}'")  # a whole command line
    raise SettingError(
        f"{why} and no checkpoint to continue from; delete {d} and run {command} again (or rerun it with {{force}})"
    )


def _resolve(path: str | Path, *, complete: bool = True) -> tuple[Path, dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        raise NascompressError(f"{path} does not exist; give a run directory or a model.safetensors file")
    if not path.is_dir():  # a FIFO or a device would be read without end
        check_regular_file(path, what="model file", fix="give a run directory or a model.safetensors file")
    if complete:
        check_complete(path if path.is_dir() else path.parent if path.name == MODEL_FILE else path)
    if path.is_dir():
        weights = path / MODEL_FILE
        if not weights.is_file():
            raise NascompressError(f"{path} holds no {MODEL_FILE}; is it a finished nascompress run?")
        if (path / ARCH_FILE).is_file():
            return weights, read_arch_json(path / ARCH_FILE)
        path = weights
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise NascompressError(
            f"{path} is not a readable safetensors file ({e}); give a nascompress run directory "
            "or its model.safetensors"
        ) from e
    if "nascompress_arch" not in meta:
        raise NascompressError(f"{path} has no arch.json beside it and no nascompress_arch metadata")
    source = f"{path} metadata"
    return path, validate_arch(parse_json(meta["nascompress_arch"], source=source), source=source)


def recorded_input(path: str | Path) -> dict[str, Any] | None:
    """The ``input`` (preprocessing) recorded in a nascompress ``.safetensors`` file's metadata,
    or None for any other weights file (a foreign checkpoint, a ``.pth``)."""
    path = Path(path)
    if path.suffix != ".safetensors" or not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        arch = parse_json(meta["nascompress_arch"], source=f"{path} metadata") if "nascompress_arch" in meta else {}
        return arch.get("input")
    except (SafetensorError, OSError, ValueError, AttributeError, NascompressError):
        return None


def load_arch(path: str | Path) -> dict[str, Any]:
    """The arch of a saved model (a complete run, a plain model directory, or a weights file)."""
    return _resolve(path)[1]


def read_arch(path: str | Path) -> Arch:
    """The typed arch (:class:`~nascompress.runs.files.Arch`) of a saved model, read as :func:`load_arch`."""
    p = Path(path)
    source = str(p / ARCH_FILE) if p.is_dir() and (p / ARCH_FILE).is_file() else f"{p} metadata"
    return Arch.from_dict(load_arch(p), source=source)


def load_with_arch(
    path: str | Path,
    *,
    map_location: str | torch.device = "cpu",
    complete: bool = True,
    dtype: str | torch.dtype | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a saved model from its directory (or safetensors file) and load it strictly.

    Args:
        path: a run directory, a plain model directory or a ``.safetensors`` file.
        map_location: the device.
        complete: refuse an unfinished run (False: the run's own writer reading its output).
        dtype: ``fp32``, ``bf16``, ``fp16`` or a torch dtype (None: as saved, float32): the floating
            weights are converted for inference; feed the model inputs of that dtype.
    """
    dt = None if dtype is None else parse_dtype(dtype)
    map_location = machine_device(map_location, field="map_location")
    weights, arch = _resolve(path, complete=complete)
    model = build_from_arch(arch)
    try:
        sd = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise NascompressError(f"{weights} is corrupt ({e}); re-run the command that wrote it") from e
    if arch["format"] != ARCH_FORMAT:
        sd, arch["format"] = _upgrade_v1(sd), ARCH_FORMAT
    load_state_strict(model, sd, source=str(weights))
    model.pretrained_cfg = model.default_cfg = timm_pretrained_cfg(model, arch)
    check_finite(model, source=str(weights))
    model = model.to(map_location) if dt is None else model.to(map_location, dt)
    return model.eval(), arch


def load_typed(
    path: str | Path,
    *,
    map_location: str | torch.device = "cpu",
    complete: bool = True,
    dtype: str | torch.dtype | None = None,
) -> tuple[nn.Module, Arch]:
    """:func:`load_with_arch` with the typed :class:`~nascompress.runs.files.Arch`."""
    model, arch = load_with_arch(path, map_location=map_location, complete=complete, dtype=dtype)
    return model, Arch.from_dict(arch, source=str(path))


def load(
    path: str | Path,
    *,
    map_location: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    compile: bool = False,
) -> nn.Module:
    """Load any saved nascompress model: ``nascompress.load("runs/base")``, or for bfloat16 inference
    on a GPU ``nascompress.load("runs/base", map_location="cuda", dtype="bf16")``. Eval mode.
    ``compile=True``: the model wrapped by ``torch.compile`` for inference, as ``profile --compile``
    times it (CUDA graphs on CUDA, Inductor on the CPU; each new input shape compiles on its first
    call); refused in one line where it cannot compile (no C/C++ compiler, MG-ViT's early exit)."""
    model = load_with_arch(path, map_location=map_location, dtype=dtype)[0]
    to_plain(model)  # timm's own classes wherever the methods need none of nascompress's at inference
    return compile_loaded(model) if compile else model
