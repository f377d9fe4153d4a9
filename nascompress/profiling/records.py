"""The results of the measuring jobs (:mod:`nascompress.profiling.jobs`) as frozen records, read by
field by the command's printout, the pipeline's report and the benchmarks.

- :class:`Evaluation`: :func:`~nascompress.profiling.jobs.evaluate_run` (a split's top-1, loss and
  image count, the teacher agreement, an early-exit model's SGIS exit share and mean FLOPs);
- :class:`Profile`: :func:`~nascompress.profiling.profile_models` and
  :func:`~nascompress.profiling.jobs.profile`: each model's :class:`ModelProfile` (FLOPs per
  :class:`BlockMacs`, parameters, latency and throughput, an MG-ViT's :class:`StageFlops`, narrowed
  Q/K heads' :class:`QkLayout`), each later model's :class:`ProfileRatios` against the first
  (:func:`~nascompress.profiling.compare.compare_records`) and, against a reference, the
  :class:`ProfileComparison`;
- :class:`EpsilonSweep`: :func:`~nascompress.profiling.jobs.epsilon_sweep` (one :class:`SweepRow`
  per early-exit threshold).

Each is a :class:`~nascompress.runs.records.TypedRecord`: its keys in the order the job made them
(an optional key absent where the job has no such figure), any key it does not type kept in
``extra``, so ``to_dict()`` is the job's JSON (``--json``) and ``R.from_dict(r.to_dict())`` the same
record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..data.carve import Splits
from ..runs.records import TypedRecord


class _Measured(TypedRecord):
    NEW_SOURCE = "the measured {name}"


def _record(cls: type) -> type:
    return dataclass(frozen=True, kw_only=True)(cls)


@_record
class Evaluation(_Measured):
    """A saved model on a split (:func:`~nascompress.profiling.jobs.evaluate_run`): top-1 (percent),
    mean loss, images, the ``split`` and ``dataset``, the model's ``methods``, the data's ``splits``
    record and the ``dtype``; ``agreement`` with a teacher (percent) where one was given; an
    early-exit model's (MG-ViT) ``epsilon``, SGIS ``exit_share`` and ``mean_flops`` per image (its
    stages' FLOPs in ``extra``). None: no such figure."""

    top1: float
    loss: float
    n: int
    agreement: float | None = None
    epsilon: float | None = None
    exit_share: float | None = None
    mean_flops: float | None = None
    mean_gflops: float | None = None
    split: str | None = None
    dataset: str | None = None
    methods: list[str] | None = None
    splits: Splits | None = None
    dtype: str | None = None


@_record
class BlockMacs(_Measured):
    """One block's per-image MACs: attention (its matmuls included), MLP, the rest."""

    attn: float
    mlp: float
    other: float


@_record
class StageFlops(_Measured):
    """An MG-ViT's per-image MACs of its stages (SGIS alone, MGIS; PPSM where it has one)."""

    sgis_flops: float
    mgis_flops: float
    ppsm_flops: float | None = None


@_record
class QkLayout(_Measured):
    """How many narrowed Q/K attentions reach the kernel zero-padded to V's head dim, how many packed."""

    pad: int
    packed: int


@_record
class ModelProfile(_Measured):
    """One model profiled (:func:`~nascompress.profiling.profile_models`): per-image MACs (1 MAC = 1
    FLOP, attention matmuls included; ``blocks`` and the ``other_macs`` outside them), parameters,
    the cross-checks of torch's and thop's counters, the input size; where timed, latency (ms at
    ``latency_batch``) and throughput (images/s at ``throughput_batch``), compiled too
    (``*_compiled``, or why not: ``compile_note``); narrowed Q/K heads' ``qk_layout``; an MG-ViT's
    ``stages``. None: no such figure."""

    macs: float
    gflops: float | None = None
    params: int
    other_macs: float | None = None
    blocks: tuple[BlockMacs, ...] = ()
    batch: int | None = None
    flop_counter_macs: float | None = None
    thop_macs_no_attention_matmuls: float | None = None
    input_size: list[int] | None = None
    qk_layout: QkLayout | None = None
    compile_note: str | None = None
    latency_ms: float | None = None
    latency_batch: int | None = None
    throughput: float | None = None
    throughput_batch: int | None = None
    latency_ms_compiled: float | None = None
    throughput_compiled: float | None = None
    stages: StageFlops | None = None


@_record
class ProfileRatios(_Measured):
    """One profiled model against another (:func:`~nascompress.profiling.compare.compare_records`):
    ``flops_ratio`` and ``params_ratio`` (model / reference: below 1 is smaller) and, where both were
    timed, ``latency_speedup`` and ``throughput_speedup`` (above 1 is faster; compiled too:
    ``*_compiled``). None: not timed."""

    flops_ratio: float
    params_ratio: float
    latency_speedup: float | None = None
    throughput_speedup: float | None = None
    latency_speedup_compiled: float | None = None
    throughput_speedup_compiled: float | None = None


@_record
class ProfileComparison(ProfileRatios):
    """A profile's target (``model``) against its ``reference``, timed interleaved: their
    :class:`ProfileRatios` (:mod:`nascompress.profiling.compare`: ratios below 1 are smaller,
    speed-ups above 1 faster), and what the figures were measured on (FLOPs: ``flops_images`` random
    images; the batches)."""

    model: str
    reference: str
    flops_images: int | None = None
    latency_batch: int | None = None
    throughput_batch: int | None = None


@_record
class Profile(_Measured):
    """Models profiled on one ``device`` in one ``dtype``: ``models`` (label -> :class:`ModelProfile`,
    in the order given), why the timings were grouped (``timing_note``); from
    :func:`~nascompress.profiling.profile_models` each later model's ``ratios`` against the first,
    from :func:`~nascompress.profiling.jobs.profile` the target against a reference (``comparison``)
    and the target's ``input_size``."""

    device: str
    dtype: str
    models: Mapping[str, ModelProfile]
    timing_note: str | None = None
    ratios: Mapping[str, ProfileRatios] | None = None
    comparison: ProfileComparison | None = None
    input_size: list[int] | None = None


@_record
class SweepRow(_Measured):
    """One early-exit threshold of an epsilon sweep: top-1, SGIS exit share, mean MACs per image."""

    epsilon: float
    top1: float
    exit_share: float
    mean_flops: float
    mean_gflops: float | None = None


@_record
class EpsilonSweep(_Measured):
    """An MG-ViT's accuracy / FLOPs curve on a split (:func:`~nascompress.profiling.jobs.epsilon_sweep`):
    a :class:`SweepRow` per threshold, the images, SGIS's and MGIS's own top-1, the stages' MACs."""

    rows: tuple[SweepRow, ...]
    n: int
    sgis_top1: float | None = None
    mgis_top1: float | None = None
    sgis_flops: float | None = None
    mgis_flops: float | None = None
    ppsm_flops: float | None = None
    split: str | None = None
    dataset: str | None = None


__all__ = [
    "BlockMacs",
    "EpsilonSweep",
    "Evaluation",
    "ModelProfile",
    "Profile",
    "ProfileComparison",
    "ProfileRatios",
    "QkLayout",
    "StageFlops",
    "SweepRow",
]
