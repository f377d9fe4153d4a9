"""What :func:`nascompress.runs.io.load` does to a model once its weights are in: the finite-weights
check, and the ``torch.compile``d inference model of ``load(..., compile=True)``."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import NascompressError, SettingError


def check_finite(model: nn.Module, *, source: str) -> None:
    """Refuse a model whose parameters are not all finite (NaN or inf): it would evaluate to chance
    accuracy without a word."""
    bad = [n for n, p in model.named_parameters() if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if bad:
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise SettingError(
            f"{source} holds weights that are not finite (NaN or inf) in {bad[0]}{more}: the "
            "training that wrote it diverged or the file is damaged; train it again (e.g. with a "
            "lower {lr}) or use another checkpoint"
        )


def compile_loaded(model: nn.Module) -> nn.Module:
    """``model`` (eval mode) wrapped by ``torch.compile`` as ``profile --compile`` times it
    (:func:`~nascompress.profiling.latency.compile_for_speed`: CUDA graphs, mode ``reduce-overhead``,
    on CUDA; Inductor's default mode on the CPU; ``dynamic=False``). Compilation is lazy: the first
    call of each input shape compiles (up to a minute). Refused in one line where it cannot compile:
    no C/C++ compiler on this machine, or a model whose shapes depend on its input (MG-ViT)."""
    from ..profiling.latency import compile_for_speed  # lazy: nascompress.profiling is not loaded by nc.load otherwise

    param = next(model.parameters(), None)
    fn, why = compile_for_speed(model.eval(), param.device if param is not None else torch.device("cpu"), who="load")
    if fn is None:
        raise NascompressError(f"cannot compile this model: {why}; load it with compile=False")
    return fn


__all__ = ["check_finite", "compile_loaded"]
