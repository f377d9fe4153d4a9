"""The DCS search's metrics typed: :class:`DCSMetrics`, what
:func:`~nascompress.dcs_search.search.run_dcs_search` returns as ``DCSSearchResult.metrics`` and
:func:`~nascompress.dcs_search.run.search_dcs` writes as the run's ``metrics.json`` (its completion mark
added: :func:`~nascompress.runs.io.finish_run`).

The fields its readers use are typed (the landing against the target, the model kept and why, the
end-of-search calibration, the guard's stop: :class:`Comparison`, :class:`Calibration`,
:class:`Stopped`); the rest stays in ``extra``, in the order the search wrote it, so that
``DCSMetrics.from_dict(d).to_dict() == d`` and the file is the same bytes (the style of
:mod:`nascompress.runs.files`, whose :class:`~nascompress.runs.files.RunMetrics` it extends).

:class:`MaterializeMetrics`: what :func:`~nascompress.dcs_search.materialize.materialize_search`
returns and writes as the materialized run's ``metrics.json`` (the compact model's FLOPs and
parameters, the supernet's, and the check of its logits against the supernet's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import NascompressError
from ..runs.files import Record, RunMetrics, as_is, check_number, check_str, optional
from ..runs.records import TypedRecord


def _flag(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise NascompressError(
            f"{where} must be a boolean, got {type(v).__name__}; the file was damaged or edited: replace it"
        )
    return v


def _of(cls: type[Record]) -> Callable[[Any, str], Any]:
    """The check of a field holding a record of ``cls`` (null: None)."""
    return optional(lambda v, where: cls.from_dict(v, source=where))


@dataclass(frozen=True, kw_only=True)
class Calibration(Record):
    """``calibration``: the end-of-search threshold shift that landed the search (its ``alpha_shift``
    in ``extra``)."""

    ratio_before: float  # the cost ratio the gates ended at
    ratio_after: float | None = None  # the ratio after the shift
    move: float | None = None  # |ratio_after - ratio_before|
    reason: str | None = None  # "off target" or "at_most"

    CHECKS = {
        "ratio_before": check_number,
        "ratio_after": optional(check_number),
        "move": optional(check_number),
        "reason": optional(check_str),
    }


@dataclass(frozen=True, kw_only=True)
class Comparison(Record):
    """``comparison``: the searched model against the magnitude baseline after the same recovery (each
    candidate's record, the recovery, ``baseline_note`` ... in ``extra``)."""

    kept: str | None = None  # "dcs" or "magnitude"
    margin_pt: float | None = None  # the kept model's lead in validation top-1 points
    reason: str | None = None  # one line: which model was kept, and why

    CHECKS = {"kept": optional(check_str), "margin_pt": optional(check_number), "reason": optional(check_str)}


@dataclass(frozen=True, kw_only=True)
class Stopped(Record):
    """``stopped``: where and why the accuracy guard stopped the gates (how to let them go on, the
    run directory's ``continue``, in ``extra``)."""

    epoch: int | None = None
    reason: str | None = None

    CHECKS = {"epoch": optional(check_number), "reason": optional(check_str)}


@dataclass(frozen=True, kw_only=True)
class DCSMetrics(RunMetrics):
    """A DCS search's metrics (``metrics.json``): :class:`~nascompress.runs.files.RunMetrics`' fields,
    the target and the cost ratio it landed at, the kept model, and what the search did to get there."""

    target_flops: float | None = None
    cost: str | None = None  # "flops" or "latency" (the ratio steered to its target)
    target_latency: float | None = None
    latency_ratio: float | None = None  # predicted, with the latency cost
    kept: str | None = None  # "dcs" (the searched model) or "magnitude" (the baseline)
    comparison: Comparison | None = None
    stopped: Stopped | None = None  # None: the gates ran every epoch
    dense_val_top1: float | None = None
    mlp_gates: str | None = None  # the gate family searched
    family_reason: str | None = None  # why the pre-search probe chose it (mlp_gates auto)
    mlp_kept: list[Any] | None = None  # MLP hidden channels kept per block
    qk_kept: list[Any] | None = None  # Q/K channels kept per block and head (static Q/K masks)
    calibrated: bool | None = None
    calibration: Calibration | None = None

    CHECKS = {
        **RunMetrics.CHECKS,
        **{k: optional(check_number) for k in ("target_flops", "target_latency", "latency_ratio", "dense_val_top1")},
        **{k: optional(check_str) for k in ("cost", "kept", "mlp_gates", "family_reason")},
        "comparison": _of(Comparison),
        "stopped": _of(Stopped),
        "mlp_kept": as_is,
        "qk_kept": as_is,
        "calibrated": optional(_flag),
        "calibration": _of(Calibration),
    }

    @classmethod
    def of(cls, metrics: Mapping[str, Any] | DCSMetrics, *, source: str = "the DCS search's metrics") -> DCSMetrics:
        """``metrics`` typed (a :class:`DCSMetrics` as it is; a dict, as ``metrics.json`` or the Python
        API's result holds it, read with :meth:`from_dict`)."""
        return metrics if isinstance(metrics, DCSMetrics) else cls.from_dict(metrics, source=source)

    @property
    def target(self) -> float | None:
        """The target of the ratio the search steered (``target_latency`` with the latency cost)."""
        return self.target_latency if self.cost == "latency" else self.target_flops

    @property
    def ratio(self) -> float | None:
        """The searched model's ratio of that cost (``latency_ratio`` with the latency cost)."""
        return self.latency_ratio if self.cost == "latency" else self.flops_ratio


@dataclass(frozen=True, kw_only=True)
class MaterializeMetrics(TypedRecord, RunMetrics):
    """A materialized DCS search's metrics (``metrics.json``): the compact model's FLOPs (``macs``) and
    parameters, the supernet's, the ratio to the dense model's FLOPs (None: the search recorded no
    ``dense_macs``), the largest logit difference from the masked supernet, the Q/K mask and the widths
    kept per block; with head gates ``heads_kept``, with block gates ``skipped_blocks`` (absent without)."""

    NEW_SOURCE = "the materialized model's {name}"

    params: int | None = None
    supernet_macs: float | None = None
    supernet_params: int | None = None
    flops_ratio_vs_dense: float | None = None
    max_abs_logit_diff: float | None = None
    qk_mask: str | None = None
    mlp_kept: list[Any] | None = None  # MLP channels kept per block (None: all)
    qk_kept: list[Any] | None = None  # Q/K channels kept per block and head (None: all)
    heads_kept: list[Any] | None = None  # heads kept per block (head gates)
    skipped_blocks: list[int] | None = None  # the blocks dropped (block gates)


__all__ = ["Calibration", "Comparison", "DCSMetrics", "MaterializeMetrics", "Stopped"]
