"""Settings of a measurement against the dense model: ``nascompress profile``'s options and the
pipeline's ``report:`` section (one dataclass; both are generated from it)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..config import Config, StageSettings, check_settings, setting
from ..limits import MAX_BATCH, MAX_ITERS
from ..models.build import ModelShape

DTYPES = ("fp32", "bf16", "fp16")
PROFILE_CLASSES = 1000  # the head of a --model measured without a dataset


@dataclass(frozen=True)
class ProfileConfig(Config):
    """How models are measured (interleaved in one process, medians).

    Args:
        latency: time latency (batch 1) and throughput (``batch_size``); off: FLOPs and params only.
        iters: timed repetitions; the median is reported.
        batch_size: the throughput batch.
        dtype: weights and inputs (``fp32`` uses TF32 matmuls on CUDA).
        compile: also time each model ``torch.compile``'d (CUDA graphs on CUDA) next to eager.
    """

    latency: bool = setting(True, help="FLOPs and params only (no latency, no throughput).", flag="--no-latency")
    iters: int = setting(10, help="Timed repetitions (median).", lo=1, hi=MAX_ITERS)
    batch_size: int = setting(64, help="Batch for throughput (latency is at batch 1).", lo=1, hi=MAX_BATCH)
    dtype: str = setting("fp32", help="Weights and inputs: fp32 (TF32 matmuls on CUDA), bf16 or fp16.", choices=DTYPES)
    compile: bool = setting(False, help="Also time each model torch.compile'd (CUDA graphs on CUDA) next to eager.")

    def __post_init__(self) -> None:
        check_settings(self)  # every setting() against its declaration


# The model ``nascompress profile --model`` builds: ModelShape's settings, the head's classes
# ImageNet's (no dataset says them)
PROFILE_MODEL_SETTINGS = StageSettings(
    ModelShape,
    tuple(f.name for f in fields(ModelShape)),
    recipe=ModelShape(num_classes=PROFILE_CLASSES),
    notes={"num_classes": f"Without a dataset (profile --model): {PROFILE_CLASSES}."},
)

__all__ = ["ProfileConfig", "DTYPES", "PROFILE_CLASSES", "PROFILE_MODEL_SETTINGS"]
