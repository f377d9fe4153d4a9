"""``nascompress latency-table``'s library side: the table of a saved run's (or a timm model's)
geometry, from the cache or measured, and the model's predicted latency from it."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config, check_settings, setting
from ..errors import NascompressError
from ..limits import MAX_BATCH, MAX_ITERS
from ..models.build import ModelSpec, build_model
from ..runs.io import load_with_arch
from ..runtime import DTYPES
from ..runs.json_io import atomic_path, write_json
from ..runtime import resolve_device
from .latency_table import LatencyTable, geometry_of
from .latency_table_build import cached_table
from .latency_table_predict import predict_latency


@dataclass(frozen=True)
class LatencyTableConfig(Config):
    """How ``nascompress latency-table`` measures (or finds cached) a device's table.

    Args:
        batch: the batch size the table is for (a table holds one).
        dtype: weights and inputs.
        iters: timed repetitions per entry (the median is kept).
        rebuild: measure again even where the cache holds the table.
    """

    batch: int = setting(
        1, help="The batch size the table is measured at (one table per batch size).", lo=1, hi=MAX_BATCH
    )
    dtype: str = setting(
        "fp32", help="Weights and inputs: fp32 (TF32 matmuls on CUDA), bf16 or fp16.", choices=tuple(DTYPES)
    )
    iters: int = setting(7, help="Timed repetitions per table entry (median).", lo=1, hi=MAX_ITERS)
    rebuild: bool = setting(False, help="Measure the table again even if it is cached.")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class LatencyTableResult:
    """What :func:`latency_table_for` found: the ``table``, its ``cache`` file (None: not cached),
    whether it was ``measured`` now, the copy written to ``out`` (None: none asked for) and the
    model's own latency predicted from it (``predicted_ms``)."""

    table: LatencyTable
    cache: Path | None
    measured: bool
    out: Path | None
    predicted_ms: float

    def to_dict(self) -> dict[str, Any]:
        """The command's ``--json``: the table's JSON, then its cache file, ``measured`` and ``predicted_ms``."""
        return {
            **self.table.to_dict(),
            "cache": str(self.cache),
            "measured": self.measured,
            "predicted_ms": self.predicted_ms,
        }


def latency_table_for(
    target: str | Path,
    *,
    config: LatencyTableConfig | None = None,
    device: str = "auto",
    out: str | Path | None = None,
) -> LatencyTableResult:
    """The latency table of ``target``'s geometry (a run directory, a ``model.safetensors`` or a timm
    model name, built with random weights) on ``device``: read from the cache or measured and cached
    (:func:`~.latency_table.latency_table`), copied to ``out`` if given; with ``target``'s own latency
    predicted from it (:class:`LatencyTableResult`)."""
    cfg = LatencyTableConfig() if config is None else config
    dev = resolve_device(device)
    p = Path(target)
    if p.exists():
        model = load_with_arch(p, map_location="cpu")[0]
    elif "/" in str(target) or str(target).endswith((".safetensors", ".json")):
        raise NascompressError(
            f"{target} does not exist: give a run directory, a model.safetensors or a timm model name"
        )
    else:
        model = build_model(ModelSpec(str(target)))
    table, path, measured = cached_table(
        geometry_of(model),
        device=dev,
        dtype=cfg.dtype,
        batch=cfg.batch,
        cache=True,
        rebuild=cfg.rebuild,
        align=8,
        iters=cfg.iters,
        warmup=2,
    )
    if out is not None:
        out = Path(out)
        if path is not None:
            with atomic_path(out) as tmp:
                shutil.copyfile(path, tmp)
        else:
            write_json(out, table.to_dict())
    return LatencyTableResult(
        table=table, cache=path, measured=measured, out=out, predicted_ms=predict_latency(table, model)
    )


__all__ = ["LatencyTableConfig", "LatencyTableResult", "latency_table_for"]
