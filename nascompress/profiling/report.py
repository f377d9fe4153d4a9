"""``nascompress profile``: FLOPs breakdown, params, latency/throughput, and interleaved ratios."""

from __future__ import annotations

import torch
from torch import nn

from .compare import compare_records
from .flops import count_flops, flop_counter_macs, thop_macs
from .latency import compile_for_speed, measure
from .records import ModelProfile, Profile, QkLayout
from ..models.layers import qk_layout_summary
from ..models.build import input_size
from ..runtime import dtype_name


def _input_shape(model: nn.Module) -> tuple[int, int, int]:
    return input_size(model)


def profile_models(
    models: dict[str, nn.Module],
    *,
    device: torch.device,
    latency: bool = True,
    batch_sizes: tuple[int, int] = (1, 64),
    iters: int = 10,
    warmup: int = 3,
    flops_batch: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    compile: bool = False,
) -> Profile:
    """Profile one or more models; with two or more, each later one is compared with the first:
    a :class:`~.records.Profile` of a :class:`~.records.ModelProfile` per label.

    Args:
        models: label -> model (the first is the reference of the ratios: ``ratios[label]`` is
            :func:`~.compare.compare_records`, e.g. ``flops_ratio`` < 1 and ``latency_speedup`` > 1
            for a smaller, faster model); converted to ``dtype``.
        latency: also time latency at ``batch_sizes[0]`` and throughput at ``batch_sizes[1]``,
            all models interleaved in this process.
        flops_batch: random images per FLOPs count (per-image mean for dynamic models).
        dtype: the models' weights and inputs (float32, bfloat16 or float16; inference).
        compile: also time each model ``torch.compile``d (:func:`~.latency.compile_for_speed`: CUDA
            graphs on CUDA), interleaved with the eager ones: ``*_compiled`` fields and ratios
            against the compiled reference. A model that cannot be compiled says why (``compile_note``).
    """
    g = torch.Generator().manual_seed(seed)
    recs: dict[str, ModelProfile] = {}
    for label, m in models.items():
        m.eval().to(device, dtype)
        x = torch.randn(flops_batch, *_input_shape(m), generator=g).to(device, dtype)
        rec = ModelProfile.new(
            **count_flops(m, x).to_dict(),
            flop_counter_macs=flop_counter_macs(m, x),
            thop_macs_no_attention_matmuls=thop_macs(m, x),
            input_size=list(_input_shape(m)),
        )
        layout = qk_layout_summary(m, x)
        if layout is not None:  # narrowed Q/K heads: how they reach the attention kernel here
            rec = rec.set(qk_layout=QkLayout.new(**layout))
        recs[label] = rec
    timing_note = None
    labels = list(models)
    if latency:
        runs = [(k, models[k], "") for k in labels]
        if compile:
            for k in labels:
                fn, note = compile_for_speed(models[k], device)
                if fn is None:
                    recs[k] = recs[k].set(compile_note=note)
                else:
                    runs.append((k, fn, "_compiled"))
        groups: dict[tuple, list] = {}  # models of one input size are timed interleaved
        for run in runs:
            groups.setdefault(tuple(_input_shape(models[run[0]])), []).append(run)
        for shape, group in groups.items():
            timings = measure(
                [fn for _, fn, _ in group],
                shape,
                device=device,
                batch_sizes=batch_sizes,
                iters=iters,
                warmup=warmup,
                seed=seed,
                dtype=dtype,
            )
            for (k, _, suffix), t in zip(group, timings):
                recs[k] = recs[k].set(
                    **{f"{name}{suffix}" if name in ("latency_ms", "throughput") else name: v for name, v in t.items()}
                )
        if len(groups) > 1:
            timing_note = "the models take different input sizes: each size was timed interleaved on its own"
    out = Profile.new(device=str(device), dtype=dtype_name(dtype), models=recs)
    if timing_note is not None:
        out = out.set(timing_note=timing_note)
    if len(labels) > 1:  # the one ratio convention (.compare): each model against the first
        out = out.set(ratios={k: compare_records(recs[k], recs[labels[0]]) for k in labels[1:]})
    return out
