"""The DCS search's metrics typed: :class:`DCSMetrics`, what
:func:`~nascompress.dcs_search.search.run_dcs_search` returns as ``DCSSearchResult.metrics`` and
:func:`~nascompress.dcs_search.run.search_dcs` writes as the run's ``metrics.json`` (its completion mark
added: :func:`~nascompress.runs.io.finish_run`).

The fields its readers use are typed (the landing against the target, the model kept and why, the
end-of-search calibration, the guard's stop: :class:`Comparison`, with its :class:`CandidateRecord`,
:class:`RecoverySettings` and :class:`RecoveryLog`; :class:`Calibration`; :class:`Stopped`); the rest
stays in ``extra``, in the order the search wrote it, so that
``DCSMetrics.from_dict(d).to_dict() == d`` and the file is the same bytes (the style of
:mod:`nascompress.runs.files`, whose :class:`~nascompress.runs.files.RunMetrics` it extends).

:class:`MaterializeMetrics`: what :func:`~nascompress.dcs_search.materialize.materialize_search`
returns and writes as the materialized run's ``metrics.json`` (the compact model's FLOPs and
parameters, the supernet's, and the check of its logits against the supernet's).

The search's other results are typed here too: the magnitude baseline it builds
(:class:`MagnitudeBaseline`) and what the measurements before it chose (:class:`AlignChoice`, under
``align_probe``; :class:`FamilyChoice`, :class:`InitChoice`, :class:`Protection`: their keys go into
the metrics in that order).
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


class _SearchRecord(TypedRecord):
    """A record of the DCS search (its fields checked as annotated; None: not recorded)."""

    NEW_SOURCE = "the DCS search's {name}"


def _search_record(cls: type) -> type:
    return dataclass(frozen=True, kw_only=True)(cls)


@_search_record
class RecoveryLog(_SearchRecord):
    """What one candidate's recovery did (:func:`~nascompress.dcs_search.baseline.recover`): the mean
    losses of its last steps (cross-entropy, KL to the dense model, the pre-logits feature error; None:
    not in its loss) and the optimizer ``steps`` taken (all None: nothing to train)."""

    ce: float | None = None
    kl: float | None = None
    feat: float | None = None
    steps: int | None = None


@_search_record
class RecoverySettings(_SearchRecord):
    """``comparison.recovery``: the recovery every candidate got (steps of ``batch_size`` images, the
    images in all, the peak lr, the seed, the distillation weights and the precision)."""

    steps: int | None = None
    batch_size: int | None = None
    images: int | None = None
    lr: float | None = None
    seed: int | None = None
    distill: float | None = None
    feat_distill: float | None = None
    amp: str | None = None


@_search_record
class CandidateRecord(_SearchRecord):
    """``comparison.dcs`` / ``comparison.magnitude``: one candidate
    (:meth:`~nascompress.dcs_search.baseline.Candidate.record`): its cost ratio, whether it stands at
    the target (why not: ``note``), its validation top-1 (kept state, before and after the recovery),
    the ``state`` kept, the validation images and its recovery; the magnitude baseline's rule and
    widths kept (:class:`MagnitudeBaseline`) after them."""

    flops_ratio: float | None = None
    eligible: bool | None = None
    note: str | None = None
    val_top1: float | None = None
    val_before_recovery: float | None = None
    val_recovered: float | None = None
    state: str | None = None  # "recovered" or "before recovery"
    val_n: int | None = None
    recovery: RecoveryLog | None = None
    rule: str | None = None
    hidden_kept: list[int] | None = None
    heads_kept: list[int] | None = None
    skipped_blocks: list[int] | None = None


@_search_record
class Comparison(_SearchRecord):
    """``comparison``: the searched model against the magnitude baseline after the same recovery
    (:func:`~nascompress.dcs_search.baseline.keep_better`): the model kept, its lead, the recovery, each
    candidate, why the baseline was not at the target (``magnitude_note``) or not built
    (``baseline_note``; ``baseline`` null without one, in ``extra``), and the reason in one line."""

    kept: str | None = None  # "dcs" or "magnitude"
    margin_pt: float | None = None  # the kept model's lead in validation top-1 points
    recovery: RecoverySettings | None = None
    dcs: CandidateRecord | None = None
    magnitude: CandidateRecord | None = None
    magnitude_note: str | None = None
    baseline_note: str | None = None
    reason: str | None = None  # one line: which model was kept, and why


@_search_record
class MagnitudeBaseline(_SearchRecord):
    """The magnitude baseline built at the target (:func:`~nascompress.dcs_search.baseline.magnitude_supernet`):
    its cost ratio, the hidden neurons kept per block, the threshold, the rule in words, and where the
    search gates heads or blocks, the heads kept per block and the blocks dropped."""

    flops_ratio: float
    hidden_kept: list[int]
    threshold: float
    rule: str
    heads_kept: list[int] | None = None
    skipped_blocks: list[int] | None = None


@_search_record
class FamilyChoice(_SearchRecord):
    """Why ``mlp_gates auto`` chose its family (:func:`~nascompress.dcs_search.family.choose_family`):
    each family's probe KL to the dense model, the MLP shares probed and the reason in one line."""

    family_kl: Mapping[str, float]
    family_shares: list[float]
    family_reason: str


@_search_record
class AlignChoice(_SearchRecord):
    """Why ``align auto`` chose its width multiple (:func:`~nascompress.dcs_search.align.choose_align`):
    where the MLP pair (fc1, GELU, fc2) was timed (the device, its name, the torch threads, the dtype,
    the batch, the model's embed dim, token count and hidden width), the ``window`` of consecutive
    hidden widths timed (first, last), each width's median milliseconds (``ms``, in the window's order),
    the ``tolerance`` and ``share`` of the rule, the share of the window's widths each multiple
    rounds up within the tolerance (``within``, by multiple), the multiple ``chosen`` and the reason."""

    chosen: int
    device: str
    device_name: str
    threads: int
    dtype: str
    batch: int
    embed_dim: int
    tokens: int
    hidden: int
    window: list[int]
    ms: list[float]
    tolerance: float
    share: float
    within: Mapping[str, float]
    reason: str


@_search_record
class InitChoice(_SearchRecord):
    """The gates' start order (:func:`~nascompress.dcs_search.prepare.init_importance`): ``init``
    (weight or activation) and, chosen by ``auto``, each order's probe KL (``init_kl``)."""

    init: str
    init_kl: Mapping[str, float] | None = None


@_search_record
class Protection(_SearchRecord):
    """The protected gates and block cost weights (:func:`~nascompress.dcs_search.protect.protection`):
    the gates fixed open per block, each block's sensitivity and its cost weight (None: not measured)."""

    protected: list[int] | None = None
    block_sensitivity: list[float] | None = None
    block_weights: list[float] | None = None


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
    align: int | None = None  # the width multiple searched (align auto: the one chosen)
    align_probe: AlignChoice | None = None  # why align auto chose it (None: align given)
    mlp_kept: list[Any] | None = None  # MLP hidden channels kept per block
    qk_kept: list[Any] | None = None  # Q/K channels kept per block and head (static Q/K masks)
    calibrated: bool | None = None
    calibration: Calibration | None = None

    CHECKS = {
        **RunMetrics.CHECKS,
        **{k: optional(check_number) for k in ("target_flops", "target_latency", "latency_ratio", "dense_val_top1")},
        **{k: optional(check_str) for k in ("cost", "kept", "mlp_gates", "family_reason")},
        "align": optional(check_number),
        "align_probe": _of(AlignChoice),
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


__all__ = [
    "AlignChoice",
    "Calibration",
    "CandidateRecord",
    "Comparison",
    "DCSMetrics",
    "FamilyChoice",
    "InitChoice",
    "MagnitudeBaseline",
    "MaterializeMetrics",
    "Protection",
    "RecoveryLog",
    "RecoverySettings",
    "Stopped",
]
