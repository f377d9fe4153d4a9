"""``nascompress profile``: FLOPs breakdown, params, latency/throughput, and interleaved ratios."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .flops import count_flops, flop_counter_macs, thop_macs
from .latency import measure


def _input_shape(model: nn.Module) -> tuple[int, int, int]:
    from ..models import input_size
    return input_size(model)


def profile_models(models: dict[str, nn.Module], *, device: torch.device, latency: bool = True,
                   batch_sizes: tuple[int, int] = (1, 64), iters: int = 10, warmup: int = 3,
                   flops_batch: int = 4, seed: int = 0) -> dict[str, Any]:
    """Profile one or more models; with two or more, ratios are against the first.

    Args:
        models: label -> model (the first is the reference for ratios).
        latency: also time latency at ``batch_sizes[0]`` and throughput at ``batch_sizes[1]``,
            all models interleaved in this process.
        flops_batch: random images per FLOPs count (per-image mean for dynamic models).
    """
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {"device": str(device), "models": {}}
    for label, m in models.items():
        m.eval().to(device)
        x = torch.randn(flops_batch, *_input_shape(m), generator=g).to(device)
        rep = count_flops(m, x).to_dict()
        rep["flop_counter_macs"] = flop_counter_macs(m, x) if device.type == "cpu" else None
        rep["thop_macs_no_attention_matmuls"] = thop_macs(m, x)
        rep["input_size"] = list(_input_shape(m))
        out["models"][label] = rep
    if latency:
        labels = list(models)
        shapes = {tuple(_input_shape(models[k])) for k in labels}
        if len(shapes) == 1:
            timings = measure([models[k] for k in labels], shapes.pop(), device=device, batch_sizes=batch_sizes,
                              iters=iters, warmup=warmup, seed=seed)
        else:  # different input sizes (e.g. MG-ViT vs dense): still interleave per model pair
            timings = [measure([models[k]], _input_shape(models[k]), device=device, batch_sizes=batch_sizes,
                               iters=iters, warmup=warmup, seed=seed)[0] for k in labels]
        for k, t in zip(labels, timings):
            out["models"][k].update(t)
    labels = list(models)
    if len(labels) > 1:
        ref = out["models"][labels[0]]
        out["ratios"] = {}
        for k in labels[1:]:
            r = out["models"][k]
            # reductions and speed-ups: reference / model (> 1 when the model is cheaper or faster)
            ratios = {"flops_reduction": ref["macs"] / r["macs"], "params_reduction": ref["params"] / r["params"]}
            if latency:
                ratios["latency_speedup"] = ref["latency_ms"] / r["latency_ms"]
                ratios["throughput_speedup"] = r["throughput"] / ref["throughput"]
            out["ratios"][k] = ratios
    return out
