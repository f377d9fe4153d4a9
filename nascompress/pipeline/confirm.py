"""The pipeline's check of its pick at the full budget (``stages.retrain.confirm_pick``).

The token studies score each trial after a short calibration on a few images (``train_images``); on
some datasets they rank a model with tokens cut above the channel-only model that, after the same
retraining, is the better one. So when the pick cuts tokens (a stacked model, or a token-only model of
the dense base) and the DCS stage's channel-only model meets the FLOPs goal by itself, the ``confirm``
step retrains that model with the pick's own recipe (``OUT/final_channel``) and keeps the better of the
two on the validation split (:func:`better_on_validation`). Its decision is the step's marker
(``OUT/done/confirm.json``): the model the pipeline ends with follows it
(:func:`~nascompress.pipeline.fallback.current_model`), resumed or not.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .files import find_pick
from ..runs.files import find_metrics
from ..runs.io import read_arch
from ..runs.store import LOG_FILE
from .goal import meets
from .summary import ConfirmDecision

CHANNEL_DIR = "final_channel"
_TIE = 1e-9


def pick_kind(out: Path) -> str:
    """What the token stage's pick (``OUT/tokens/picked``) cuts: ``token-only`` (the study on the dense
    base), ``stacked`` (a token method on the DCS model) or ``channel-only`` (its trial turned every token
    method off)."""
    pj = find_pick(out / "tokens")
    if pj is not None and pj.dense_study is not None and pj.picked_study == pj.dense_study:
        return "token-only"
    tokens = [m.name for m in read_arch(out / "tokens" / "picked").methods if m.name != "dcs"]
    return "stacked" if tokens else "channel-only"


def channel_only_flops(out: Path) -> float | None:
    """The FLOPs ratio of the materialized channel-only model (``OUT/dcs_mat``) to the dense base."""
    m = find_metrics(out / "dcs_mat")
    return None if m is None else m.get("flops_ratio_vs_dense")


def why_not(kind: str, ratio: float | None, max_flops: float | None) -> str | None:
    """Why a pick of ``kind`` (:func:`pick_kind`) needs no check against the channel-only model at FLOPs
    ratio ``ratio`` (:func:`channel_only_flops`) under the goal ``max_flops`` (None: a latency goal): a
    one-line reason, or None when the channel-only model is retrained beside it."""
    if kind == "channel-only":
        return "the pick is the channel-only model itself"
    if max_flops is None:
        return "the goal is a latency: the channel-only model is not measured against it"
    if ratio is None or not meets(ratio, max_flops):  # at the precision the report prints (.goal)
        at, by = ("", "") if ratio is None else (f" ({ratio:.4f}x)", f" (above it by {ratio - max_flops:.4f}x)")
        return f"the channel-only model{at} does not meet the goal ({max_flops:g}x) by itself{by}"
    return None


@dataclass(frozen=True)
class ValidationRecord:
    """A retrained run's best epoch on the validation split (``val_top1``, the ``val_loss`` of that
    epoch: None where its log has none) and its test top-1."""

    val_top1: float | None
    val_loss: float | None = None
    test_top1: float | None = None


def validation_record(run: Path) -> ValidationRecord:
    """A retrained run's best epoch on the validation split: ``val_top1`` and the ``val_loss`` of that
    epoch (from its ``log.jsonl``; None where the log has none)."""
    m = find_metrics(run) or {}
    best, loss = m.get("best_epoch"), None
    log = run / LOG_FILE
    if best is not None and log.is_file():
        for line in log.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if rec.get("epoch") == best and rec.get("val_loss") is not None:
                loss = rec["val_loss"]
                break
    return ValidationRecord(m.get("best_val_top1"), loss, m.get("test_top1"))


def better_on_validation(pick: ValidationRecord, channel: ValidationRecord) -> str:
    """``pick`` or ``channel-only``: the higher validation top-1; on a tie the lower validation loss;
    on a tie of both (or a loss missing), the pick."""
    if channel.val_top1 > pick.val_top1 + _TIE:
        return "channel-only"
    if abs(channel.val_top1 - pick.val_top1) <= _TIE:
        a, b = channel.val_loss, pick.val_loss
        if a is not None and b is not None and a < b - _TIE:
            return "channel-only"
    return "pick"


def decide(out: Path, kind: str, *, pick_flops: float | None, channel_flops: float | None) -> ConfirmDecision:
    """The step's result: both models' validation records, which one is kept and a one-line reason."""
    pick, channel = validation_record(out / "final"), validation_record(out / CHANNEL_DIR)
    kept = better_on_validation(pick, channel)
    won, lost = (channel, pick) if kept == "channel-only" else (pick, channel)
    tie = abs(won.val_top1 - lost.val_top1) <= _TIE
    how = (
        f"{won.val_top1:.2f}% validation top-1 against {lost.val_top1:.2f}%"
        if not tie
        else f"both {won.val_top1:.2f}% validation top-1"
        + (
            f", validation loss {won.val_loss:.4f} against {lost.val_loss:.4f}"
            if won.val_loss is not None and lost.val_loss is not None
            else ""
        )
    )
    name = "the channel-only model" if kept == "channel-only" else f"the pick ({kind})"
    return ConfirmDecision.new(
        kept=kept,
        pick_kind=kind,
        pick_flops_ratio=pick_flops,
        channel_flops_ratio=channel_flops,
        **{f"pick_{k}": v for k, v in asdict(pick).items()},
        **{f"channel_{k}": v for k, v in asdict(channel).items()},
        reason=f"kept {name} after the same retraining: {how}",
    )


__all__ = [
    "CHANNEL_DIR",
    "pick_kind",
    "channel_only_flops",
    "why_not",
    "ValidationRecord",
    "validation_record",
    "better_on_validation",
    "decide",
]
