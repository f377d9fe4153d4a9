"""bench/_common.py's bisect_to_ratio (bench/mainjob_peers.py --match latency): a pruning amount bisected
until a measured ratio (a peer's latency over the final model's) is within a tolerance of its target, or
the most-pruned setting reported as not reaching it. Pure logic on an injected measure; nothing is timed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from _common import bisect_to_ratio  # noqa: E402


def _linear(slope: float, calls: list[float]):
    def measure(amount: float) -> dict[str, float]:  # the ratio falls as the pruning grows
        calls.append(amount)
        return {"ratio": 1.5 - slope * amount, "extra": amount * 2}

    return measure


def test_the_least_pruned_setting_within_the_bound_is_found_and_every_step_recorded():
    calls: list[float] = []
    got = bisect_to_ratio(_linear(1.0, calls), 0.0, 0.95, target=1.0, tol=0.03, steps=8)
    assert got["reached"] and got["reachable"]
    assert got["ratio"] <= 1.03 and got["amount"] == pytest.approx(0.47, abs=0.01)  # 1.5 - a <= 1.03
    assert calls[0] == 0.95  # the most-pruned setting first
    assert [s["amount"] for s in got["steps"]] == calls and len(calls) == 9
    assert all(s["extra"] == s["amount"] * 2 for s in got["steps"])  # the measure's fields kept


def test_an_unreachable_target_returns_the_most_pruned_setting_unbisected():
    calls: list[float] = []
    got = bisect_to_ratio(_linear(0.2, calls), 0.0, 0.95, target=1.0, tol=0.03)
    assert calls == [0.95, 0.95]  # measured twice before giving up
    assert not got["reached"] and not got["reachable"]
    assert got["amount"] == 0.95 and got["ratio"] == pytest.approx(1.5 - 0.2 * 0.95)


def test_a_noisy_first_look_at_the_most_pruned_setting_is_confirmed():
    ratios = iter([1.06, 0.98, 1.2, 1.2, 1.2])  # the second look brings the mean within the bound
    got = bisect_to_ratio(lambda a: {"ratio": next(ratios)}, 0.0, 0.95, tol=0.03, steps=3)
    assert got["reachable"] and got["reached"] and got["amount"] == 0.95
    assert got["ratio"] == pytest.approx(1.02) and len(got["steps"]) == 5


def test_the_least_pruned_end_may_be_the_larger_number():
    calls: list[float] = []

    def measure(flops_target: float) -> dict[str, float]:  # a FLOPs target: lower prunes more
        calls.append(flops_target)
        return {"ratio": 0.6 + 0.8 * flops_target}

    got = bisect_to_ratio(measure, 1.0, 0.0, target=1.0, tol=0.02)
    assert got["reached"] and got["amount"] == pytest.approx(0.525, abs=0.01)  # 0.6 + 0.8 t <= 1.02
    assert calls[0] == 0.0


def test_a_flat_latency_keeps_the_least_pruned_setting_not_the_most():
    """At batch 1 the latency barely moves with the MLP width: every amount is fast enough, and the
    peer is the one pruned least (the most-pruned one would lose accuracy for nothing)."""
    got = bisect_to_ratio(lambda a: {"ratio": 1.0}, 0.0, 0.95, tol=0.03, steps=6)
    assert got["reached"] and got["amount"] == pytest.approx(0.95 / 64)


def test_a_step_function_finds_the_step():
    # discrete widths: the ratio jumps from 1.1 to 0.9 at 0.4
    got = bisect_to_ratio(lambda a: {"ratio": 1.1 if a < 0.4 else 0.9}, 0.0, 1.0, tol=0.03, steps=6)
    assert got["reached"] and got["ratio"] == 0.9 and got["amount"] == pytest.approx(0.4, abs=1 / 64)
