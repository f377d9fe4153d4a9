"""Top-1 accuracy, loss and teacher agreement on a split."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from .. import runtime
from ..config import check_field, check_int, check_settings, setting
from ..data import InputSpec, make_loader, preprocess
from ..errors import NascompressError
from ..limits import MAX_BATCH
from .records import Evaluation

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class EvaluateSettings:
    """What ``nascompress evaluate`` measures besides the data, the batch and the device: the
    ``split``, the agreement with a ``teacher`` run, an MG-ViT ``epsilon`` sweep."""

    split: str = setting("test", choices=SPLITS, help="train, val or test.")
    teacher: str | None = setting(None, path=True, help="A run whose top-1 predictions to compare with.")
    epsilon: tuple[float, ...] | None = setting(
        None, lo=0, hi=1, lo_open=True, help=("MG-ViT: sweep early-exit thresholds, e.g. 0.5,0.7,0.9,1.")
    )

    def __post_init__(self) -> None:
        check_settings(self)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s floating parameters (float32 for a model without any)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    ds: Dataset,
    *,
    input_spec: InputSpec,
    device: torch.device,
    batch_size: int = 256,
    teacher: nn.Module | None = None,
    teacher_spec: InputSpec | None = None,
    amp: str = "off",
) -> Evaluation:
    """The :class:`~nascompress.profiling.records.Evaluation` of ``model`` over ``ds``: ``top1``,
    ``loss`` and ``n`` (and ``agreement`` with a teacher), in that key order.

    Args:
        model: the model to evaluate (put in eval mode here); its inputs are cast to its own dtype
            (a model loaded with ``dtype="bf16"`` runs in bfloat16).
        ds: a dataset yielding raw images (uint8) and labels; each batch is moved to ``device``
            first (pinned, non-blocking on CUDA) and preprocessed there.
        input_spec: the model's preprocessing.
        teacher: optional model whose top-1 predictions the model's are compared to.
        amp: ``bf16``: the forwards under bfloat16 autocast (a training job's validation), the
            attention as explicit bf16 matmuls on a CPU (:func:`~nascompress.runtime.cpu_attention`,
            as the training steps run it).
    """
    check_field("batch_size", check_int, batch_size, 1, MAX_BATCH)
    model.eval().to(device)
    dtype = model_dtype(model)
    if teacher is not None:
        teacher.eval().to(device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    agree = torch.zeros((), dtype=torch.long, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    finite = torch.ones((), dtype=torch.bool, device=device)  # every preprocessed image finite
    n = 0
    loader = make_loader(ds, batch_size=batch_size, shuffle=False, pin_memory=device.type == "cuda")
    with runtime.cpu_attention(model, device, amp):  # once for the split, not per batch
        for imgs, labels in loader:
            raw, y = runtime.to_device(imgs, device), runtime.to_device(labels, device)
            x = preprocess(raw, input_spec)
            finite &= torch.isfinite(x).all()
            with runtime.autocast(device, amp):
                logits = model(x.to(dtype)).float()
                loss_sum += F.cross_entropy(logits, y, reduction="sum")
                pred = logits.argmax(-1)
                correct += (pred == y).sum()
                if teacher is not None:
                    tx = x if teacher_spec is None else preprocess(raw, teacher_spec)
                    agree += (teacher(tx.to(model_dtype(teacher))).argmax(-1) == pred).sum()
            n += len(y)
    # one read-back for the whole split
    correct_n, agree_n, loss_total, finite_n = torch.stack(
        [correct.double(), agree.double(), loss_sum, finite.double()]
    ).tolist()
    if not finite_n:
        raise NascompressError(
            "the images hold values that are not finite (NaN or inf) once normalised: check the data "
            "(a caller's tensors) and the normalisation's mean and std"
        )
    top1, loss = 100.0 * correct_n / max(n, 1), loss_total / max(n, 1)
    if teacher is None:
        return Evaluation.new(top1=top1, loss=loss, n=n)
    return Evaluation.new(top1=top1, loss=loss, n=n, agreement=100.0 * agree_n / max(n, 1))
