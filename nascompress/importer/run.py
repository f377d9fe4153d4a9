"""``nascompress import``: a user's own timm ViT weights as a nascompress run, without training.

:func:`import_model` checks the model and the weights, builds the model the weights describe
(class count from their head; patch size, depth, width, MLP width and heads where the weights show
them, and the input size from their position-embedding grid unless given: every shape read from the
tensors, :mod:`~nascompress.importer.shapes`, so nothing is resampled that was not asked for), takes
the preprocessing the weights were made with (:func:`~nascompress.train.run.input_spec_for`: the timm
model's pretrained config, or the ``input`` recorded in a nascompress file; explicit overrides
win), optionally evaluates it on a dataset's val and test splits, and writes a run directory in
the format ``nascompress train`` writes (``model.safetensors``, ``arch.json``, ``config.json``,
``metrics.json``), which ``finetune``, ``search dcs``, ``evaluate`` and :func:`nascompress.load`
accept. Provenance (source path, its sha256, timm name and version, time) goes into
``config.json`` and ``arch.json`` (``source``). Every check runs before anything is written.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

import torch
import timm
from safetensors import safe_open

from ..config import check_settings, setting, shared
from ..data import DataConfig, InputOverrides, load_data
from ..errors import NascompressError, SettingError
from ..profiling.evaluate import evaluate
from ..runs.io import file_sha256, make_arch, save_model
from .metrics import ImportMetrics
from .shapes import describe, read_shapes, shape_kwargs
from ..models.build import ModelSpec, build_model, is_pyramid
from ..models.weights import checkpoint_filter, mismatch_report, read_weights_file, state_mismatches
from ..runs.run_dir import RunDir
from ..runs.files import Arch
from ..runtime import resolve_device
from ..train.config import TrainConfig
from ..train.run import input_spec_for


@dataclass(frozen=True)
class ImportJob:
    """Everything ``nascompress import`` needs; written to the run's ``config.json`` (``import``).

    Args:
        model: a timm name, ``arch`` or ``arch.tag`` (the tag selects the pretrained config that
            preprocessing is taken from, e.g. ``vit_base_patch16_clip_224.openai``).
        weights: local ``.safetensors`` / ``.pth`` weights with a classifier head.
        out: the run directory to create.
        img_size: input size; None: the weights' position-embedding grid times the patch size.
        num_classes: None: the number of rows of the weights' ``head.weight``.
        num_heads: None: read from a ``q_norm`` if the weights have one, else the name's (refused
            when the weights' width differs from the name's: see :mod:`nascompress.importer.shapes`).
        data: a dataset to evaluate on (val and test top-1 into metrics.json); None: no evaluation.
        input: explicit preprocessing (mean, std, interpolation, crop_pct), winning over the weights'.
        eval_batch_size: images per evaluation batch.
        device: ``auto``, ``cpu`` or ``cuda[:N]``.
    """

    model: str = setting(
        help="timm model name, e.g. vit_small_patch16_224 (a .tag picks its pretrained config); "
        "the weights' own patch size, depth, width and grid are read from them."
    )
    weights: str = setting(path=True, help="Local .safetensors/.pth weights, with a classifier head.")
    out: str
    img_size: int | None = setting(None, lo=1, help="Input size (default: from the weights' position embedding).")
    num_classes: int | None = setting(None, lo=1, help="Classes (default: the weights' head).")
    num_heads: int | None = setting(
        None,
        lo=1,
        help=(
            "Attention heads (default: the model name's, or read from a q_norm; needed when the weights' width "
            "differs from the name's: a fused qkv does not show them)."
        ),
    )
    data: DataConfig | None = None
    input: InputOverrides = field(default_factory=InputOverrides)
    eval_batch_size: int = shared(TrainConfig, "eval_batch_size")
    device: str = "auto"

    def __post_init__(self) -> None:
        check_settings(self)  # every setting() against its declaration

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "weights": self.weights,
            "out": self.out,
            "img_size": self.img_size,
            "num_classes": self.num_classes,
            "num_heads": self.num_heads,
            "data": None if self.data is None else asdict(self.data),
            "input": self.input.to_dict(),
            "eval_batch_size": self.eval_batch_size,
            "device": self.device,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ImportJob":
        d = dict(d)
        d["data"] = DataConfig(**d["data"]) if d.get("data") else None
        d["input"] = InputOverrides.from_dict(d.get("input"))
        return cls(**d)


def build_job(
    settings: Mapping[str, Any],
    out: str | Path,
    *,
    data: DataConfig | None = None,
    input: InputOverrides | None = None,
    device: str = "auto",
) -> ImportJob:
    """The job of ``nascompress import`` and of a pipeline's ``base.import`` (the one place it is
    built): ``settings``: the values of :class:`ImportJob`'s settings (``model``, ``weights``,
    ``img_size``, ``num_classes``, ``num_heads``, ``eval_batch_size``); ``data``: a dataset to
    evaluate on (None: none); ``input``: explicit preprocessing."""
    return ImportJob(**settings, out=str(out), data=data, input=input or InputOverrides(), device=device)


def grid_img_size(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> int | None:
    """The square input size whose patch grid matches the file's ``pos_embed`` (None if unknown)."""
    pos = sd.get("pos_embed")
    if pos is None or pos.ndim != 3 or model.pos_embed is None:
        return None
    prefix = 0 if getattr(model, "no_embed_class", False) else getattr(model, "num_prefix_tokens", 1)
    side = math.isqrt(max(pos.shape[1] - prefix, 0))
    if side < 1 or side * side != pos.shape[1] - prefix:
        return None
    return side * model.patch_embed.patch_size[0]


def weights_kwargs(job: ImportJob, raw: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The build settings of ``job.model`` that hold the weights ``raw`` as they are (every shape read
    from them: :func:`~nascompress.importer.shapes.shape_kwargs`; ``num_classes`` 1 until the head is
    read), and the notes: each shape that differs from the name's."""
    named = build_model(ModelSpec(job.model, {"num_classes": 1}))  # unknown, non-ViT and hybrid models stop here
    if is_pyramid(named) or read_shapes(raw) is None:  # a pyramid ViT (its shape is its name's), another layout
        if job.num_heads is not None:
            raise SettingError(
                f"{{num_heads}} applies to a plain ViT's weights in timm's layout, not to {job.weights} for {job.model}"
            )
        kwargs: dict[str, Any] = {"num_classes": job.num_classes or 1}
        if job.img_size is not None:
            kwargs["img_size"] = job.img_size
        elif not is_pyramid(named):
            size = grid_img_size(named, raw)
            if size is not None and (size, size) != tuple(named.patch_embed.img_size):
                kwargs["img_size"] = size
        return kwargs, {}
    kwargs, notes = shape_kwargs(
        job.model, named, raw, img_size=job.img_size, num_heads=job.num_heads, source=job.weights
    )
    return {"num_classes": job.num_classes or 1, **kwargs}, notes


def _filtered(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors in this timm model's layout (original checkpoint formats converted,
    position embeddings resampled to the model's grid), as ``load_pretrained`` does."""
    return checkpoint_filter(dict(sd), model)


def import_model(job: ImportJob, *, force: bool = False) -> ImportMetrics:
    """Import ``job.weights`` as a run in ``job.out`` (see the module docstring); return the metrics
    (:class:`~nascompress.importer.metrics.ImportMetrics`: ``metrics.json`` less its completion mark)."""
    out = Path(job.out)
    run = RunDir.prepare(out, force=force, inputs=(job.weights,))
    raw = read_weights_file(job.weights)
    kwargs, notes = weights_kwargs(job, raw)
    head = raw.get("head.weight")
    if head is None:  # maybe an original checkpoint format whose head timm renames (OpenAI CLIP's proj)
        head = _filtered(build_model(ModelSpec(job.model, kwargs)), raw).get("head.weight")
    if head is None or head.ndim != 2:
        raise NascompressError(  # a whole command line for the shell
            f"weights file {job.weights} has no classifier head (no head.* tensors: a backbone-only checkpoint); "
            f"import needs a trained head: fit one with 'nascompress train --model {job.model} --weights "
            f"{job.weights} --reset-head --linear-probe'"
        )
    kwargs["num_classes"] = job.num_classes or int(head.shape[0])
    spec = ModelSpec(job.model, kwargs)
    model = build_model(spec)
    sd = _filtered(model, raw)
    bad = state_mismatches(model, sd)
    if bad:
        hint = ""
        if job.num_classes is not None and any(b.startswith("head.") for b in bad[:3]):
            hint = f"; {{num_classes}} must match the file's head ({int(head.shape[0])} classes)"
        shapes = read_shapes(raw)
        real = "" if shapes is None else f" (the file: {describe(shapes)})"
        raise SettingError(
            f"weights file {job.weights} does not fit {spec.name} {kwargs}: {mismatch_report(bad)}{hint}{real}"
        )
    model.load_state_dict(sd, strict=True)

    dataset = job.data.dataset if job.data is not None else "fashion-mnist"
    input_spec = input_spec_for(model, dataset, weights=job.weights, overrides=job.input)
    metrics = ImportMetrics.new(imported=True, dataset=None, shapes_from_weights=notes)
    if job.data is not None:
        bundle = load_data(job.data, spec=input_spec, augment=False)
        if kwargs["num_classes"] != bundle.num_classes:
            raise SettingError(
                f"the weights' head has {kwargs['num_classes']} classes but dataset {bundle.name} has "
                f"{bundle.num_classes}; leave out {{dataset}}, or fit a new head with 'nascompress train --model "
                f"{job.model} --weights {job.weights} --reset-head --linear-probe'"
            )  # a whole command line
        device = resolve_device(job.device)
        t0 = time.perf_counter()
        val = evaluate(model, bundle.val, input_spec=input_spec, device=device, batch_size=job.eval_batch_size)
        test = evaluate(model, bundle.test, input_spec=input_spec, device=device, batch_size=job.eval_batch_size)
        metrics = metrics.set(
            dataset=bundle.name,
            best_val_top1=val.top1,
            val_top1=val.top1,
            val_loss=val.loss,
            val_n=val.n,
            test_top1=test.top1,
            test_loss=test.loss,
            test_n=test.n,
            eval_time_s=time.perf_counter() - t0,
        )
        model.cpu()

    source = {
        "weights": str(Path(job.weights).resolve()),
        "sha256": file_sha256(job.weights),
        "timm_name": job.model,
        "timm_version": timm.__version__,
        "imported_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    arch = Arch.of(
        make_arch(spec, input_spec=input_spec.to_dict(), labels=bundle.classes if job.data is not None else None)
    ).set(source=source)
    run.create({"import": job.to_dict(), "data": None if job.data is None else asdict(job.data), "source": source})
    save_model(out, model, arch)
    return run.finish(metrics)  # the last write: marks the run complete


def weights_shapes(path: str) -> dict[str, list[int]] | None:
    """Tensor shapes of a safetensors file, without reading the tensors (None for other formats
    and unreadable files: the stage's own reader checks and reports those)."""
    if not path.endswith(".safetensors"):
        return None
    try:
        with safe_open(path, "pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception:  # noqa: BLE001 (a corrupt file: reported by the stage's reader)
        return None


def weights_grid_size(model: Any, weights: str) -> int | None:
    """The input size whose patch grid matches the weights' position embedding."""
    if weights.endswith(".safetensors"):
        try:
            with safe_open(weights, "pt") as f:
                pe = f.get_tensor("pos_embed") if "pos_embed" in f.keys() else None
        except Exception as e:  # noqa: BLE001 (a corrupt or foreign file: every reader raises its own type)
            raise NascompressError(f"weights file {weights} is corrupt or not a weights file ({e})") from None
    else:
        pe = read_weights_file(weights).get("pos_embed")
    return None if pe is None else grid_img_size(model, {"pos_embed": pe})


__all__ = ["ImportJob", "build_job", "import_model", "grid_img_size", "weights_grid_size", "weights_shapes"]
