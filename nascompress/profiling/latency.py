"""Latency and throughput, measured as the papers' users care about: medians after warm-up,
and comparisons as ratios measured interleaved in one process (the machines are shared and
absolute times drift; ratios of interleaved medians do not)."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn
import torch._dynamo

from ..progress import say


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_models(
    models: Sequence[nn.Module] | Sequence[Callable], x: torch.Tensor, *, warmup: int = 3, iters: int = 10
) -> list[float]:
    """Median seconds per forward of each model on ``x``, the models run interleaved.

    Each round runs every model once, in a rotating order, so slow drifts of the machine hit
    all models alike.
    """
    device = x.device
    for m in models:
        if isinstance(m, nn.Module):
            m.eval()
        for _ in range(warmup):
            m(x)
    _sync(device)
    times: list[list[float]] = [[] for _ in models]
    n = len(models)
    for it in range(iters):
        for j in range(n):
            k = (it + j) % n
            t0 = time.perf_counter()
            models[k](x)
            _sync(device)
            times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def time_models_lower(
    models: Sequence[nn.Module] | Sequence[Callable], x: torch.Tensor, *, passes: int, warmup: int, iters: int
) -> list[float]:
    """:func:`time_models` ``passes`` times, each pass interleaved anew, and each model's lower median
    (seconds per forward): other work on a shared machine only ever adds time, so a burst of it
    during one pass does not stand for the model's latency."""
    runs = [time_models(models, x, warmup=warmup, iters=iters) for _ in range(passes)]
    return [min(ts) for ts in zip(*runs)]


def time_models_by_threads(
    calls: dict[int, Sequence[nn.Module] | Sequence[Callable]], x: torch.Tensor, *, warmup: int = 3, iters: int = 10
) -> dict[int, list[float]]:
    """:func:`time_models` once per intra-op thread count: ``calls[n]`` (the models as run at ``n``
    threads, e.g. ONNX Runtime sessions made with ``n`` threads) timed interleaved with torch set to
    ``n`` threads, torch's count restored after. Returns each count's medians (seconds per forward),
    in the order of its models."""
    before = torch.get_num_threads()
    out: dict[int, list[float]] = {}
    try:
        for n, models in calls.items():
            torch.set_num_threads(n)
            out[n] = time_models(models, x, warmup=warmup, iters=iters)
    finally:
        torch.set_num_threads(before)
    return out


def measure(
    models: Sequence[nn.Module] | Sequence[Callable],
    input_shape: tuple[int, int, int],
    *,
    device: torch.device,
    batch_sizes: tuple[int, int] = (1, 64),
    warmup: int = 3,
    iters: int = 10,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> list[dict[str, float]]:
    """Latency at ``batch_sizes[0]`` and throughput at ``batch_sizes[1]`` for each model (inputs in ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    out: list[dict[str, float]] = [{} for _ in models]
    lat_bs, thr_bs = batch_sizes
    x1 = torch.randn(lat_bs, *input_shape, generator=g).to(device, dtype)
    for r, t in zip(out, time_models(models, x1, warmup=warmup, iters=iters)):
        r["latency_ms"] = t * 1e3
        r["latency_batch"] = lat_bs
    xb = torch.randn(thr_bs, *input_shape, generator=g).to(device, dtype)
    for r, t in zip(out, time_models(models, xb, warmup=max(1, warmup // 2), iters=iters)):
        r["throughput"] = thr_bs / t
        r["throughput_batch"] = thr_bs
    return out


def compile_problem(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot build kernels for ``device`` on this machine (None: it can):
    Inductor compiles C++ on the CPU (a C++ compiler, ``CXX`` or g++), and Triton builds its kernel
    launcher with a C compiler (``CC``, cc, gcc or clang) on CUDA."""
    if device.type == "cuda":
        if not (os.environ.get("CC") or any(shutil.which(c) for c in ("cc", "gcc", "clang"))):
            return "torch.compile on CUDA needs a C compiler (Triton builds its launcher): install gcc or set CC"
        return None
    from torch._inductor import exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return "torch.compile on the CPU needs a C++ compiler (Inductor compiles C++): install g++ or set CXX"
    return None


def compile_for_speed(
    model: nn.Module, device: torch.device, *, who: str = "profile"
) -> tuple[Callable | None, str | None]:
    """``torch.compile`` for deployment timing: CUDA graphs (``mode="reduce-overhead"``) on CUDA,
    plain Inductor on the CPU; static shapes (``dynamic=False``: one graph per batch size).

    Returns (the compiled callable, None), or (None, why) for a model whose shapes depend on its
    input (its class's ``compile_note``, e.g. MG-ViT's early exit) or a machine where it cannot
    compile (:func:`compile_problem`). ``who`` names the caller in the progress line."""
    note = getattr(model, "compile_note", None) or compile_problem(device)
    if note:
        return None, note
    # every model shares VisionTransformer.forward: each (model, batch size) is its own graph, past
    # dynamo's default limit of 8 per code object it would silently run eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    mode = "reduce-overhead" if device.type == "cuda" else None
    say(f"{who}: torch.compile (the first calls of each input shape compile the model: this can take a minute) ...")
    return torch.compile(model, mode=mode, dynamic=False), None
