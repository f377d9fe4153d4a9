"""Settings of a measurement against the dense model: ``nascompress profile``'s options and the
pipeline's ``report:`` section (one dataclass; both are generated from it)."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import Config, check_bool, check_choice, check_int, setting

DTYPES = ("fp32", "bf16", "fp16")


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
    iters: int = setting(10, help="Timed repetitions (median).", lo=1)
    batch_size: int = setting(64, help="Batch for throughput (latency is at batch 1).", lo=1)
    dtype: str = setting("fp32", help="Weights and inputs: fp32 (TF32 matmuls on CUDA), bf16 or fp16.",
                         choices=DTYPES)
    compile: bool = setting(False, help="Also time each model torch.compile'd (CUDA graphs on CUDA) next to eager.")

    def __post_init__(self) -> None:
        check_bool("latency", self.latency)
        check_int("--iters", self.iters, 1)
        check_int("--batch-size", self.batch_size, 1)
        check_choice("--dtype", self.dtype, DTYPES)
        check_bool("compile", self.compile)


__all__ = ["ProfileConfig", "DTYPES"]
