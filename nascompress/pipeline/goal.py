"""The pipeline's goal check: a FLOPs or latency goal compared at the precision the report prints it.

The report prints a FLOPs ratio with 3 decimals (``0.600x``) and a latency with 2 (``1.23 ms``). A
model the report shows at the goal meets it: the channel-only model at 0.6004x meets a 0.6x goal
(the report prints 0.600x), one at 0.6006x (printed 0.601x) does not. A model that misses says by
how much (``missed_by``, in the goal's unit, exact). The comparison is :func:`meets`; the confirm step
(:func:`~nascompress.pipeline.confirm.why_not`) and the summary's ``goal`` (:func:`flops_goal`,
:func:`latency_goal`) use it alike.
"""

from __future__ import annotations

from .summary import Goal

FLOPS_DECIMALS = 3  # the report's "0.600x"
LATENCY_DECIMALS = 2  # the report's "1.23 ms"


def meets(value: float, limit: float, *, decimals: int = FLOPS_DECIMALS) -> bool:
    """Is ``value`` at or under ``limit`` when both are shown with ``decimals`` decimals (as printed)?"""
    return round(float(value), decimals) <= round(float(limit), decimals)


def flops_goal(value: float, max_flops: float) -> Goal:
    """The summary's ``goal`` of a FLOPs ratio ``value`` against ``max_flops``: ``met`` (at the printed
    precision, :func:`meets`: a tolerance of half the last printed digit) and, where it is not met,
    ``missed_by`` (``value - max_flops``, exact) and a one-line ``statement`` saying it."""
    met = meets(value, max_flops)
    goal = Goal.new(max_flops=max_flops, value=value, met=met)
    if met:
        return goal
    return goal.set(
        missed_by=value - max_flops,
        statement=(
            f"the final model has {value:.{FLOPS_DECIMALS}f}x the dense FLOPs, above the goal {max_flops:g}x by "
            f"{value - max_flops:.4f}x: no model the stages could make meets it"
        ),
    )


def latency_goal(value: float | None, max_latency_ms: float) -> Goal:
    """The summary's ``goal`` of a batch-1 latency ``value`` (ms; None: not measured) against
    ``max_latency_ms``, as :func:`flops_goal` (compared at 2 decimals)."""
    met = None if value is None else meets(value, max_latency_ms, decimals=LATENCY_DECIMALS)
    goal = Goal.new(max_latency_ms=max_latency_ms, value=value, met=met)
    if met is not False:
        return goal
    return goal.set(
        missed_by=value - max_latency_ms,
        statement=(
            f"the final model takes {value:.{LATENCY_DECIMALS}f} ms at batch 1, above the goal {max_latency_ms:g} ms "
            f"by {value - max_latency_ms:.2f} ms: no model the stages could make meets it"
        ),
    )


__all__ = ["FLOPS_DECIMALS", "LATENCY_DECIMALS", "meets", "flops_goal", "latency_goal"]
