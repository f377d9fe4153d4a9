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
from ..profiling import LatencyTable, geometry_of, latency_table, predict_arch, table_anchor
from ..runs.records import TypedRecord
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


@dataclass(frozen=True, kw_only=True)
class LatencyGoal(TypedRecord):
    """What a latency goal in milliseconds (the pipeline's ``goal.max_latency_ms``) is as the search's
    ``target_latency`` ratio: ``ratio`` = ``max_latency_ms`` over ``dense_ms``, the dense model's
    latency measured on the device when the goal was set (at most 1, to 4 decimals).
    ``table_dense_ms`` is what the device's (cached) table predicts for it, ``anchor`` their ratio:
    the table's speed against this moment's (the search steers by the table's ratios, which drift
    far less than its milliseconds)."""

    NEW_SOURCE = "the latency goal's {name}"

    max_latency_ms: float
    dense_ms: float
    table_dense_ms: float
    anchor: float
    ratio: float
    dtype: str
    batch: int


def latency_target(dense: nn.Module, max_ms: float, *, device: Any, dtype: str, batch: int, align: int) -> LatencyGoal:
    """The :class:`LatencyGoal` of ``max_ms`` ms for ``dense``: the dense model timed now on the
    device as its table's entries were (:func:`~nascompress.profiling.table_anchor`), so a table
    cached hours ago on a machine that has since slowed down or sped up does not move the goal."""
    table = latency_table(geometry_of(dense), device=device, dtype=dtype, batch=batch, align=max(1, align))
    now = table_anchor(dense, table, device=device)
    return LatencyGoal.new(
        max_latency_ms=float(max_ms),
        **now.to_dict(),
        ratio=round(min(1.0, max_ms / now.dense_ms), 4),
        dtype=table.dtype,
        batch=batch,
    )


__all__ = ["LatencyCost", "LatencyGoal", "latency_cost", "latency_target"]
