"""Running an exported file the way a serving stack does, and comparing it with the PyTorch model.

ONNX files run in ONNX Runtime (CPU provider); ``torch.export`` programs through
``torch.export.load(...).module()``; AOTInductor packages through
``torch._inductor.aoti_load_package``. None imports nascompress. The comparison is on logits: max
|difference|, the logit scale (max |PyTorch logit|) and top-1 agreement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch._inductor

from ..errors import NascompressError
from .graphs import quiet

Runner = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


def onnx_runner(path: str | Path, *, threads: int | None = None, spinning: bool = True) -> tuple[Runner, str]:
    """A callable running the ONNX file in ONNX Runtime on the CPU, and a description of it.

    ``spinning=False``: ORT's worker threads sleep as soon as a run ends instead of spinning for a
    while (its default, fastest alone): needed when it is timed interleaved with PyTorch, whose
    threads the spinning ones would otherwise starve."""
    try:
        import onnxruntime as ort  # optional (nascompress[export])
    except ModuleNotFoundError:
        raise NascompressError("onnxruntime is not installed; pip install 'nascompress[export]'") from None
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    try:
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 (ORT's errors carry the reason in the first line)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NascompressError(f"ONNX Runtime cannot load the exported file: {first[:300]}") from e
    names = [i.name for i in sess.get_inputs()]

    def run(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        feed = {n: t.detach().cpu().contiguous().numpy() for n, t in zip(names, inputs)}
        return [torch.from_numpy(np.asarray(o)) for o in sess.run(None, feed)]

    return run, f"onnxruntime {ort.__version__} (CPUExecutionProvider)"


def program_runner(path: str | Path) -> tuple[Runner, str]:
    """A callable running a saved ``torch.export`` program (``torch.export.load``)."""
    with open(path, "rb") as f, quiet():
        mod = torch.export.load(f).module()

    def run(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            out = mod(*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    return run, f"torch.export.load (torch {torch.__version__})"


def package_runner(path: str | Path) -> tuple[Runner, str]:
    """A callable running a saved AOTInductor package (``torch._inductor.aoti_load_package``)."""
    with open(path, "rb") as f, quiet():
        fn = torch._inductor.aoti_load_package(f)

    def run(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            out = fn(*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    return run, f"torch._inductor.aoti_load_package (torch {torch.__version__})"


def runner_for(path: str | Path, fmt: str) -> tuple[Runner, str]:
    if fmt == "aoti":
        return package_runner(path)
    return onnx_runner(path) if fmt == "onnx" else program_runner(path)


def with_exit_rule(stage1: Runner, stage2: Runner, epsilon: float) -> Runner:
    """MG-ViT's two stage files as one runner, applying the exit rule of the sidecar."""

    def run(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        (x,) = inputs
        logits, *carry = stage1([x])  # MG-ViT: (tokens, casr) for stage 2; Hierarchical MG-ViT: nothing
        stay = logits.float().softmax(-1).amax(-1) <= epsilon
        out = logits.clone()
        if bool(stay.any()):
            idx = stay.nonzero().squeeze(1)
            out[idx] = stage2([x[idx], *(c[idx] for c in carry)])[0].to(out.dtype)
        return [out]

    return run


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict[str, Any]:
    """max |got - ref|, the logit scale and top-1 agreement of two logit batches (B, classes)."""
    if tuple(got.shape) != tuple(ref.shape):
        raise NascompressError(
            f"the exported file returns logits of shape {tuple(got.shape)}, the model {tuple(ref.shape)}"
        )
    ref, got = ref.float(), got.float()
    return {
        "n": int(ref.shape[0]),
        "max_abs_diff": float((got - ref).abs().max()),
        "logit_scale": float(ref.abs().max()),
        "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
    }


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several batches' comparisons as one (worst difference, image-weighted agreement)."""
    n = sum(r["n"] for r in results)
    return {
        "n": n,
        "max_abs_diff": max(r["max_abs_diff"] for r in results),
        "logit_scale": max(r["logit_scale"] for r in results),
        "top1_agreement": sum(r["top1_agreement"] * r["n"] for r in results) / n,
    }


def verify(
    model: Callable[[torch.Tensor], torch.Tensor], run: Runner, batches: Sequence[torch.Tensor], *, tolerance: float
) -> dict[str, Any]:
    """Run the exported file and ``model`` (the PyTorch side) on each batch; the merged comparison,
    with ``passed``.

    Passed when max |difference| <= tolerance * max(1, logit scale)."""
    results = []
    for x in batches:
        with torch.no_grad():
            ref = model(x)
        try:
            got = run([x])[0]
        except Exception as e:  # noqa: BLE001 (a runtime that cannot run the file: one line)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise NascompressError(f"the exported file does not run on a batch of {x.shape[0]}: {first[:300]}") from e
        results.append(compare(ref, got))
    res = merge(results)
    res.update(
        batches=[int(x.shape[0]) for x in batches],
        tolerance=tolerance,
        passed=res["max_abs_diff"] <= tolerance * max(1.0, res["logit_scale"]),
    )
    return res


__all__ = [
    "onnx_runner",
    "program_runner",
    "package_runner",
    "runner_for",
    "with_exit_rule",
    "compare",
    "merge",
    "verify",
]
