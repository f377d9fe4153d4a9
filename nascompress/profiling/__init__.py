"""One profiler for every method: FLOPs (attention matmuls included), params, latency."""

from __future__ import annotations

from .. import _compat  # noqa: F401  (before timm imports torchvision)

from .flops import FlopReport, count_flops, count_params, flop_counter_macs
from .latency import measure, time_models, time_models_by_threads

__all__ = [
    "FlopReport",
    "count_flops",
    "count_params",
    "flop_counter_macs",
    "measure",
    "time_models",
    "time_models_by_threads",
]

from .report import profile_models  # noqa: E402
from .latency_table import LatencyTable, ViTGeometry, geometry_of  # noqa: E402
from .latency_table_build import TableAnchor, latency_table, measured_ms, table_anchor  # noqa: E402
from .latency_table_predict import PRICED_METHODS, block_tokens, predict_arch, predict_latency  # noqa: E402

__all__ += [
    "profile_models",
    "LatencyTable",
    "ViTGeometry",
    "geometry_of",
    "latency_table",
    "measured_ms",
    "TableAnchor",
    "table_anchor",
    "predict_arch",
    "predict_latency",
    "block_tokens",
    "PRICED_METHODS",
]
