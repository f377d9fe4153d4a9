"""The DCS search's latency cost (``search dcs --cost latency --target-latency R``): the latency of
the architecture the gates give, predicted from a lookup table of block latencies measured on the
device (:mod:`nascompress.profiling.latency_table`), in place of its FLOPs.

:class:`LatencyCost` answers what the search asks of :class:`~.cost.CostModel` (the hard value of
the architecture the gates give, the differentiable soft one, the expected one and the dense
model's), so the controller, the budget projection, the end-of-search landing and the magnitude
baseline steer predicted milliseconds the way they steer MACs: the same log-cost regularizer,
``log(soft latency / dense latency)``. The per-block architecture comes from
:func:`~.cost.soft_arch` (present, kept heads, Q/K width, hidden width), the prediction from
:func:`~nascompress.profiling.predict_arch` (multilinear in the table's grid: the gradient of a gate
is the latency its width costs there). The FLOPs of the same architecture stay reported beside it
(:attr:`LatencyCost.flops`).

Why: at batch 1 and on small models the per-block and per-layer overheads, not the MACs, set the
latency (the README main job's model: 0.88x at batch 1 with 0.6x the FLOPs), so a cost that counts
MACs cuts what the hardware does not reward; the table prices a whole block, a head and a hidden
neuron at what they cost on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import SettingError
from ..profiling import LatencyTable, geometry_of, latency_table, predict_arch
from .cost import CostModel, expected_gates, soft_arch


@dataclass
class LatencyCost:
    """Predicted latency (ms) of a DCS supernet's architectures at ``table``'s device, dtype and batch.

    ``flops`` is the FLOPs cost model of the same supernet (reported beside the latency); ``dense``
    the dense model's predicted latency, ``align`` the supernet's width alignment. Per-block weights
    (the sensitivity weighting of the FLOPs cost) are not applied: a block's latency is what it is.
    """

    flops: CostModel
    table: LatencyTable
    dense: float
    align: int
    unit = "latency"

    @classmethod
    def build(cls, flops: CostModel, supernet: nn.Module, table: LatencyTable) -> "LatencyCost":
        if supernet.dcs_state.family == "residual":
            raise SettingError("{cost} latency prices MLP hidden widths: give {mlp_gates} hidden or auto")
        dense = float(predict_arch(table, [{} for _ in supernet.blocks]))
        return cls(flops=flops, table=table, dense=dense, align=flops.align)

    def like(self, dense_model: nn.Module, supernet: nn.Module, x: torch.Tensor) -> "LatencyCost":
        """The same table's cost for another supernet of ``dense_model`` (the magnitude baseline's)."""
        return LatencyCost.build(CostModel.build(dense_model, supernet, x), supernet, self.table)

    @property
    def dense_weighted(self) -> float:
        """The soft cost's unit (no block weights: the dense latency)."""
        return self.dense

    def hard_macs(self, supernet: nn.Module, *, round_mlp: int = 0) -> float:
        """Predicted latency (ms) of the materialized model the current gates give."""
        return float(predict_arch(self.table, soft_arch(supernet, soft=False, round_mlp=round_mlp)))

    def soft_macs(self, supernet: nn.Module, *, weighted: bool = False) -> torch.Tensor:
        """Differentiable predicted latency (ms) from the last forward's soft gates."""
        return predict_arch(self.table, soft_arch(supernet, soft=True)).float()

    @torch.no_grad()
    def expected_macs(self, supernet: nn.Module) -> float:
        """Predicted latency in expectation of the gates: P(gate on) = sigmoid(logit)."""
        with expected_gates(supernet):
            return float(predict_arch(self.table, soft_arch(supernet, soft=True)))


def latency_cost(
    flops: CostModel, dense: nn.Module, supernet: nn.Module, *, device: Any, dtype: str, batch: int
) -> LatencyCost:
    """The latency cost of ``supernet`` (a DCS supernet of ``dense``): the device's table for the
    dense model's geometry at ``batch`` in ``dtype`` (read from the cache, or measured once and
    cached: :func:`~nascompress.profiling.latency_table`), aligned as the supernet's widths are."""
    table = latency_table(
        geometry_of(dense), device=device, dtype=dtype, batch=batch, align=max(1, supernet.dcs_state.align)
    )
    return LatencyCost.build(flops, supernet, table)


def latency_target(dense: nn.Module, max_ms: float, *, device: Any, dtype: str, batch: int, align: int) -> float:
    """The ``target_latency`` ratio that a latency of ``max_ms`` ms is for ``dense`` (the pipeline's
    ``goal.max_latency_ms``): ``max_ms`` over the dense model's latency predicted from the device's
    table (the table the search then steers by, so the search lands at ``max_ms`` as predicted), at
    most 1 (a dense model already under the goal is searched at its own latency), to 4 decimals (the
    same ratio on a resume, the table being cached)."""
    table = latency_table(geometry_of(dense), device=device, dtype=dtype, batch=batch, align=max(1, align))
    dense_ms = float(predict_arch(table, [{} for _ in dense.blocks]))
    return round(min(1.0, max_ms / dense_ms), 4)


__all__ = ["LatencyCost", "latency_cost", "latency_target"]
