"""Running an exported file the way a serving stack does, and comparing it with the PyTorch model.

ONNX files run in ONNX Runtime (CPU provider); ``torch.export`` programs through
``torch.export.load(...).module()``; AOTInductor packages through
``torch._inductor.aoti_load_package``. None imports nascompress. The comparison is on logits: max
|difference|, the logit scale (max |PyTorch logit|) and top-1 agreement (:class:`Check`, the export
sidecar's ``verification``); an int8 file's against the fp32 file's on labelled images, top-1 of both
included, is an :class:`AccuracyCheck` (:func:`accuracy_check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch._inductor

from ..errors import NascompressError
from ..runs.files import Record, Sidecar, as_is, check_number, check_str, optional
from .graphs import quiet

Runner = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


@dataclass(frozen=True, kw_only=True)
class Check(Record):
    """An exported file's logits against the PyTorch model's (:func:`compare`, :func:`merge`,
    :func:`verify`; the export sidecar's ``verification``): over ``n`` images, max |difference|, the
    logit scale (max |PyTorch logit|), top-1 agreement (a share), ``passed`` (once judged), MG-ViT's
    ``stages`` (each stage file on every image) and the ``runtime`` that ran the file; the rest
    (``batches``, ``tolerance``, ``seed``, ``inputs``) in ``extra``."""

    n: int
    max_abs_diff: float
    logit_scale: float
    top1_agreement: float
    passed: bool | None = None
    stages: Check | None = None
    runtime: str | None = None

    CHECKS = {
        **{k: check_number for k in ("n", "max_abs_diff", "logit_scale", "top1_agreement")},
        "passed": as_is,
        "stages": optional(lambda v, where: Check.from_dict(v, source=where)),
        "runtime": optional(check_str),
    }


@dataclass(frozen=True, kw_only=True)
class AccuracyCheck(Record):
    """An int8 file's logits against the fp32 file's on ``n`` labelled images (:func:`accuracy_check`;
    the int8 sidecar's ``verification``): top-1 of both (%), the drop (points), top-1 agreement (%), max
    |logit difference|, the logit scale, the allowed drop, ``passed``, the ``split`` and ``dataset`` it
    was checked on; the rest (``reference``, ``runtime``) in ``extra``."""

    n: int
    fp32_top1: float
    int8_top1: float
    top1_drop: float
    top1_agreement: float
    max_abs_logit_diff: float
    logit_scale: float
    max_drop: float
    passed: bool
    split: str | None = None
    dataset: str | None = None

    CHECKS = {
        **{k: check_number for k in ("n", "fp32_top1", "int8_top1", "top1_drop", "top1_agreement")},
        **{k: check_number for k in ("max_abs_logit_diff", "logit_scale", "max_drop")},
        "passed": as_is,
        **{k: optional(check_str) for k in ("split", "dataset")},
    }


def sidecar_check(side: Sidecar) -> Check | AccuracyCheck:
    """The check an export's sidecar records (its ``verification``), typed: an int8 file's
    :class:`AccuracyCheck` (against the fp32 file on the validation split), another file's
    :class:`Check` (against the PyTorch model)."""
    kind = AccuracyCheck if side.quantization is not None else Check
    return kind.from_dict(side.verification, source=f"the sidecar of {side.file}: verification")


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


def compare(ref: torch.Tensor, got: torch.Tensor) -> Check:
    """max |got - ref|, the logit scale and top-1 agreement of two logit batches (B, classes)."""
    if tuple(got.shape) != tuple(ref.shape):
        raise NascompressError(
            f"the exported file returns logits of shape {tuple(got.shape)}, the model {tuple(ref.shape)}"
        )
    ref, got = ref.float(), got.float()
    return Check(
        n=int(ref.shape[0]),
        max_abs_diff=float((got - ref).abs().max()),
        logit_scale=float(ref.abs().max()),
        top1_agreement=float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
    )


def merge(results: list[Check]) -> Check:
    """Several batches' comparisons as one (worst difference, image-weighted agreement)."""
    n = sum(r.n for r in results)
    return Check(
        n=n,
        max_abs_diff=max(r.max_abs_diff for r in results),
        logit_scale=max(r.logit_scale for r in results),
        top1_agreement=sum(r.top1_agreement * r.n for r in results) / n,
    )


def verify(
    model: Callable[[torch.Tensor], torch.Tensor], run: Runner, batches: Sequence[torch.Tensor], *, tolerance: float
) -> Check:
    """Run the exported file and ``model`` (the PyTorch side) on each batch; the merged comparison,
    with ``batches``, ``tolerance`` and ``passed``.

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
    return res.set(
        batches=[int(x.shape[0]) for x in batches],
        tolerance=tolerance,
        passed=res.max_abs_diff <= tolerance * max(1.0, res.logit_scale),
    )


def accuracy_check(ref: torch.Tensor, got: torch.Tensor, labels: torch.Tensor, *, max_drop: float) -> AccuracyCheck:
    """The int8 logits ``got`` against the fp32 logits ``ref`` on labelled images: top-1 of both (%),
    the drop (points), top-1 agreement (%), max |logit difference|, and ``passed`` (drop <= max_drop)."""
    fp32 = 100 * float((ref.argmax(-1) == labels).float().mean())
    int8 = 100 * float((got.argmax(-1) == labels).float().mean())
    drop = fp32 - int8
    return AccuracyCheck(
        n=int(labels.numel()),
        fp32_top1=fp32,
        int8_top1=int8,
        top1_drop=drop,
        top1_agreement=100 * float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
        max_abs_logit_diff=float((got - ref).abs().max()),
        logit_scale=float(ref.abs().max()),
        max_drop=max_drop,
        passed=drop <= max_drop,
    )


__all__ = [
    "AccuracyCheck",
    "Check",
    "onnx_runner",
    "program_runner",
    "package_runner",
    "runner_for",
    "with_exit_rule",
    "compare",
    "merge",
    "verify",
    "accuracy_check",
    "sidecar_check",
]
