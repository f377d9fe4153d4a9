"""The jobs behind the dense commands that measure a saved model: ``evaluate`` (accuracy on a split),
``profile`` (FLOPs, parameters and latency, against a dense model) and MG-ViT's epsilon sweep, each
returning its frozen record (:mod:`nascompress.profiling.records`: ``to_dict()`` is the ``--json``)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from .. import runtime
from ..data import (
    DataConfig,
    InputSpec,
    make_loader,
    preprocess,
)
from ..data.single import load_split
from ..errors import SettingError
from .evaluate import evaluate
from ..runs.io import load_typed, load_with_arch
from ..models.build import ModelSpec, build_model, input_size
from . import profile_models
from .records import EpsilonSweep, Evaluation, Profile, ProfileComparison, StageFlops
from ..train.run import check_classes
from ..runs.run_config import run_data_config
from ..methods.mgvit_modules import MGViT
from ..methods.mgvit import parse_epsilons, sweep_model
from ..methods.mgvit_h_modules import MGPVT


def evaluate_run(
    run_dir: str | Path,
    *,
    data: DataConfig | None = None,
    split: str = "test",
    teacher: str | Path | None = None,
    device: str = "auto",
    batch_size: int = 256,
    dtype: str = "fp32",
) -> Evaluation:
    """Evaluate a saved model on a split of its dataset (or ``data``), optionally vs a teacher;
    ``dtype`` (fp32, bf16, fp16): the weights and inputs (TF32 matmuls for fp32 on CUDA)."""
    dev = runtime.resolve_device(device)
    with runtime.configured(dev):
        res = _evaluate_run(
            run_dir,
            data=data,
            split=split,
            teacher=teacher,
            dev=dev,
            batch_size=batch_size,
            dtype=runtime.parse_dtype(dtype),
        )
    return res.set(dtype=runtime.dtype_name(runtime.parse_dtype(dtype)))


def _evaluate_run(run_dir, *, data, split, teacher, dev, batch_size, dtype) -> Evaluation:
    model, arch = load_typed(run_dir, map_location=dev, dtype=dtype)
    data = data or run_data_config(run_dir) or DataConfig()
    spec = InputSpec.from_dict(dict(arch.input))
    part = load_split(data, split, spec=spec, labels=arch.labels)  # a folder of just that split too (data.single)
    check_classes(model.num_classes, part)
    t_model = t_spec = None
    if teacher is not None:
        t_model, t_arch = load_typed(teacher, map_location=dev, dtype=dtype)
        t_spec = InputSpec.from_dict(dict(t_arch.input))
    dynamic = hasattr(model, "inference_stats")  # early-exit models (MG-ViT) count exits and FLOPs
    if dynamic:
        model.reset_inference_stats()
    res = evaluate(
        model,
        part.dataset,
        input_spec=spec,
        device=dev,
        batch_size=batch_size,
        teacher=t_model,
        teacher_spec=t_spec,
    )
    stats = model.inference_stats() if dynamic else {}
    return Evaluation.new(
        **{**res.to_dict(), **stats},
        split=split,
        dataset=part.name,
        methods=list(arch.method_names),
        splits=part.splits,
    )


def profile(
    target: str | Path | ModelSpec,
    *,
    compare: str | Path | None = None,
    device: str = "auto",
    latency: bool = True,
    batch_size: int = 64,
    iters: int = 10,
    dtype: str = "fp32",
    compile: bool = False,
) -> Profile:
    """Profile a saved run (or a timm model spec), optionally against a reference run ``compare``
    (e.g. the dense base), timed interleaved: ``comparison`` then holds the target against the
    reference (:mod:`nascompress.profiling.compare`: ``flops_ratio`` < 1 is smaller,
    ``latency_speedup`` > 1 is faster), both labels and what the figures were measured on; ``dtype``:
    weights and inputs; ``compile``: also time the ``torch.compile``d models (CUDA graphs on CUDA)
    next to the eager ones."""
    dev = runtime.resolve_device(device)
    with runtime.configured(dev):
        return _profile(
            target,
            compare=compare,
            dev=dev,
            latency=latency,
            batch_size=batch_size,
            iters=iters,
            dtype=runtime.parse_dtype(dtype),
            compile=compile,
        )


def _profile(target, *, compare, dev, latency, batch_size, iters, dtype, compile) -> Profile:
    def get(t: str | Path | ModelSpec) -> tuple[str, nn.Module]:
        if isinstance(t, ModelSpec):
            return t.name, build_model(t)
        return str(t), load_with_arch(t, map_location=dev)[0]

    models = dict([get(target)])  # printed in this order: the target, then the reference
    ref_label = None
    if compare is not None:
        ref_label, m = get(compare)
        ref_label = ref_label if ref_label not in models else f"{ref_label} (reference)"
        models[ref_label] = m
    flops_batch = 4  # random images per FLOPs count
    # profile_models compares the other models with its first: the reference goes first
    timed = models if ref_label is None else {ref_label: models[ref_label], **models}
    res = profile_models(
        timed,
        device=dev,
        latency=latency,
        batch_sizes=(1, batch_size),
        iters=iters,
        dtype=dtype,
        compile=compile,
        flops_batch=flops_batch,
    )
    recs = {k: res.models[k] for k in models}
    for label, m in models.items():  # early-exit models (MG-ViT): per-stage FLOPs, independent of the input
        if hasattr(m, "stage_flops"):
            recs[label] = recs[label].set(stages=StageFlops.new(**m.stage_flops()))
    prof = Profile.new(device=res.device, dtype=res.dtype, models=recs)
    if res.timing_note is not None:
        prof = prof.set(timing_note=res.timing_note)
    if ref_label is not None:
        ((model_label, ratios),) = res.ratios.items()  # compare_records(target, reference)
        rec = res.models[model_label]
        comparison = ProfileComparison.new(
            model=model_label,
            reference=ref_label,
            **ratios.to_dict(),
            flops_images=flops_batch,
            latency_batch=rec.latency_batch,
            throughput_batch=rec.throughput_batch,
        )
        prof = prof.set(comparison=comparison)
    return prof.set(input_size=list(input_size(next(iter(models.values())))))


def epsilon_sweep(
    run_dir: str | Path,
    epsilons: list[float],
    *,
    data: DataConfig | None = None,
    split: str = "test",
    device: str = "auto",
    batch_size: int = 256,
) -> EpsilonSweep:
    """``nascompress evaluate RUN --epsilon 0.5,0.7,...``: the accuracy / FLOPs curve of a saved MG-ViT."""
    if isinstance(epsilons, str):
        epsilons = parse_epsilons(epsilons)
    if not epsilons:
        raise SettingError("{epsilon} needs at least one value, e.g. {epsilon} 0.5,0.7,0.9,1")
    dev = runtime.resolve_device(device)
    model, arch = load_typed(run_dir, map_location=dev)
    if not isinstance(model, (MGViT, MGPVT)):
        raise SettingError(
            f"{run_dir} is not an MG-ViT run (methods: {list(arch.method_names) or 'none'}); {{epsilon}} needs one"
        )
    data = data or run_data_config(run_dir) or DataConfig()
    spec = InputSpec.from_dict(dict(arch.input))
    part = load_split(data, split, spec=spec, labels=arch.labels)  # a folder of just that split too (data.single)
    check_classes(model.num_classes, part)
    batches = (
        (preprocess(imgs, spec), y) for imgs, y in make_loader(part.dataset, batch_size=batch_size, shuffle=False)
    )
    return sweep_model(model, batches, epsilons=list(epsilons)).set(split=split, dataset=part.name)
