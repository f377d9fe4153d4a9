"""The measurements before a DCS search, on ``init_images`` training images of the dense model (the
KL probes on the first :data:`PROBE_IMAGES` of them):
the width multiple (``align="auto"``, timed: :mod:`~nascompress.dcs_search.align`), the batch size,
the gate family (``mlp_gates="auto"``), the order the gates start in, the hidden fill, the protected
gates and the block cost weights (:func:`prepare_search`).

They are deterministic (seeded images), so a resumed search repeats them exactly; the width
multiple is timed, and the job a search records carries it, so a resumed search never times it
again. A study runs one DCS search per trial on the same base run: the measurements that do not
depend on the trial (the images, the activation statistics, the dense model's outputs, and per
family the start order and the protection) are kept in memory for the process and reused
(:data:`_MEMO`, keyed by the base run's file, its modification time and the images drawn), which the
trials' searches ask for with ``init_seed`` (the study's seed, not the trial's); the width multiple
is timed once per process too (:mod:`~nascompress.dcs_search.align`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .. import runtime
from ..data import InputSpec, make_loader, preprocess
from ..methods.dcs_importance import BlockStats, ChannelImportance, activation_stats, channel_importance
from ..train.auto_batch import auto_batch_size
from ..methods.dcs import ALIGN_AUTO
from .align import search_align
from .family import choose_family, dense_targets, probe_kl
from .metrics import InitChoice
from .protect import protection
from .search_config import DCSSearchJob


@dataclass(frozen=True)
class PreSearch:
    """What :func:`prepare_search` measured: the gates' start order (``importance``), the hidden
    ``fill``, the protected gates (``protect``), the block cost ``weights`` (None: not measured) and ``info``,
    what was chosen and why (logged, and written into the search's metrics in its key order)."""

    importance: list[ChannelImportance] | None
    fill: list[torch.Tensor] | None
    protect: list[torch.Tensor] | None
    weights: list[float] | None
    info: dict[str, Any]


INIT_PROBE_DROPS = (0.2, 0.4)  # shares of each MLP's gates the auto choice drops to compare the orders
INIT_MARGIN = 0.9  # auto takes the activation order only where its KL is below 0.9x the weight order's
# The KL probes (gate family, start order, block sensitivity) run on the first 128 of the init images: the
# statistics take all of them. DINOv2 ViT-S/14 at 112 px, 2 threads, bf16: the probes 26.5 -> ~15 s; the same
# family, start order and protected gates, block weights within 7% (bench/results/dcs_search_time_folder.json).
PROBE_IMAGES = 128
ALIGN_PROBE = "align_probe"  # the info's (and metrics') key of align auto's choice (metrics.AlignChoice)
_MEMO: dict[tuple, dict[str, Any]] = {}  # measurements of one base run per process (see the module docstring)
_MEMO_SIZE = 2


@torch.no_grad()
def init_importance(
    dense: nn.Module,
    images: list[torch.Tensor],
    how: str,
    *,
    family: str = "residual",
    stats: list[BlockStats] | None = None,
    align: int = 1,
    hidden_fill: str = "zero",
    targets: list[torch.Tensor] | None = None,
) -> tuple[list[ChannelImportance] | None, InitChoice]:
    """The gate-initialisation importance of :attr:`DCSSearchConfig.init_importance` on the
    preprocessed calibration ``images`` (batches; ``stats`` from :func:`activation_stats` if already
    measured): ``(importance or None for weight magnitude, choice)``, the :class:`~.metrics.InitChoice`
    ``init`` (the order chosen) and ``init_kl`` (each order's KL, only with ``auto``; ``family``'s gates
    are dropped)."""
    if how == "weight" or family == "none":
        return None, InitChoice.new(init="weight")
    stats = stats or activation_stats(dense, images)
    act = [s.importance for s in stats]
    if how == "activation":
        return act, InitChoice.new(init="activation")
    shares = [1 - d for d in INIT_PROBE_DROPS]
    fill = [s.hidden_mean for s in stats]
    targets = targets or dense_targets(dense, images)
    kls = {
        name: probe_kl(
            dense, images, imp, family, shares, align=align, hidden_fill=hidden_fill, fill=fill, targets=targets
        )
        for name, imp in (("weight", [channel_importance(b) for b in dense.blocks]), ("activation", act))
    }
    chosen = "activation" if kls["activation"] < INIT_MARGIN * kls["weight"] else "weight"
    return (act if chosen == "activation" else None), InitChoice.new(init=chosen, init_kl=kls)


def _memo(job: DCSSearchJob, seed: int, amp: str) -> dict[str, Any]:
    """The process's memo of one base run's measurements (a fresh one for another run, images or precision)."""
    src = Path(job.source)
    weights = src / "model.safetensors" if src.is_dir() else Path(job.weights or src)
    try:
        stamp = os.stat(weights).st_mtime_ns
    except OSError:
        stamp = None
    key = (str(src), stamp, seed, job.search.init_images, repr(job.data), job.method.align, job.method.hidden_fill, amp)
    if key not in _MEMO:
        while len(_MEMO) >= _MEMO_SIZE:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[key] = {}
    return _MEMO[key]


class Ticking(list):
    """The probe images (batches): every pass over a batch advances ``tick`` (the preparation's progress)."""

    def __init__(self, items: list[torch.Tensor], tick: Callable[..., None]):
        super().__init__(items)
        self.tick = tick

    def __iter__(self) -> Iterator[torch.Tensor]:
        for x in super().__iter__():
            yield x
            self.tick()


def prepare_search(
    job: DCSSearchJob,
    dense: nn.Module,
    data: Any,
    spec: InputSpec,
    tick: Callable[..., None] | None = None,
    *,
    device: torch.device | None = None,
) -> tuple[DCSSearchJob, PreSearch]:
    """The measurements before the search, on ``init_images`` training images of the dense model:
    the width multiple (``align="auto"``, timed on the search's ``device``, default the dense
    model's: :mod:`~nascompress.dcs_search.align`), the batch size (``auto_batch``), the gate family
    (``mlp_gates="auto"``), the gates' start order, the hidden fill, the protected gates and the
    block cost weights. Deterministic (seeded images) but the width multiple, so the job records
    that choice and a resumed search repeats the rest exactly. Returns the job with its choices
    resolved and its :class:`PreSearch`.
    ``tick(n=1, info=None)``: called after every probe batch, with the phase's name as it starts."""
    tick = tick or (lambda n=1, info=None: None)
    info: dict[str, Any] = {}
    dev = next(dense.parameters()).device  # a study's shared base may already sit on the GPU
    if job.method.align == ALIGN_AUTO:  # first: the probes below prune at the aligned widths
        tick(0, info="align auto: timing the MLP")
        job, why = search_align(job, dense, device or dev)
        info[ALIGN_PROBE] = why.to_dict()
    s, m = job.search, job.method
    if s.auto_batch:
        bs = auto_batch_size(len(data.train))
        job = job.replace(train=job.train.replace(batch_size=bs), search=s.replace(auto_batch=False))
        info["batch_rule"] = f"auto: {bs} for {len(data.train)} training images"
    needs = (
        m.mlp_gates == "auto"
        or s.init_importance != "weight"
        or s.protect_ratio > 0
        or s.block_weights
        or (m.mlp_gates == "hidden" and m.hidden_fill == "mean")
    )
    # the probes' forwards in the search's precision (bf16 where --amp resolves to it: the DINOv2 ViT-S/14
    # probes 1.6x faster, the same choices; the statistics and KLs are accumulated in fp32)
    amp = runtime.resolve_amp(job.train.amp, dev)
    memo = _memo(job, s.init_seed if s.init_seed is not None else job.train.seed, amp) if needs else {}
    with runtime.autocast(dev, amp), runtime.cpu_attention(dense, dev, amp):
        return _measure(job, dense, data, spec, memo=memo, needs=needs, tick=tick, info=info, dev=dev)


def _measure(
    job: DCSSearchJob,
    dense: nn.Module,
    data: Any,
    spec: InputSpec,
    *,
    memo: dict[str, Any],
    needs: bool,
    tick: Callable[..., None],
    info: dict[str, Any],
    dev: torch.device,
) -> tuple[DCSSearchJob, PreSearch]:
    """:func:`prepare_search`'s measurements, under the search's precision."""
    s, m = job.search, job.method
    if needs and "images" not in memo:
        tick(0, info="activation statistics")
        memo["images"] = [
            x.to(dev)
            for x in calibration_images(
                data, spec, n=s.init_images, seed=job.train.seed if s.init_seed is None else s.init_seed
            )
        ]
        memo["stats"] = activation_stats(dense, Ticking(memo["images"], tick))
        memo["probe"] = first_images(memo["images"], PROBE_IMAGES)
        memo["targets"] = dense_targets(dense, Ticking(memo["probe"], tick))
    images, stats, targets = Ticking(memo.get("probe", []), tick), memo.get("stats"), memo.get("targets")
    if m.mlp_gates == "auto" and s.cost == "latency":  # the latency table prices the hidden widths
        m = m.replace(mlp_gates="hidden")
        job = job.replace(method=m)
        info["family_reason"] = "the latency cost prices the MLP hidden widths (the latency table's axis)"
    if m.mlp_gates == "auto":
        key = ("family", s.target_flops)
        if key not in memo:
            tick(0, info="gate family probes")
            memo[key] = choose_family(
                dense, images, stats, target=s.target_flops, align=m.align, hidden_fill=m.hidden_fill, targets=targets
            )
        family, why = memo[key]
        m = m.replace(mlp_gates=family)
        job = job.replace(method=m)
        info.update(why.to_dict())
    key = ("init", s.init_importance, m.mlp_gates)
    if key not in memo:
        tick(0, info="start order probes")
        memo[key] = init_importance(
            dense,
            images,
            s.init_importance,
            family=m.mlp_gates,
            stats=stats,
            align=m.align,
            hidden_fill=m.hidden_fill,
            targets=targets,
        )
    importance, init = memo[key]
    info.update(init.to_dict())
    protect, weights = None, None
    if stats is not None and m.mlp_gates != "none":
        key = ("protect", m.mlp_gates, s.protect_ratio, s.block_weights)
        if key not in memo:
            tick(0, info="block sensitivity")
            memo[key] = protection(
                dense,
                images,
                stats,
                m.mlp_gates,
                ratio=s.protect_ratio,
                block_weights=s.block_weights,
                align=m.align,
                targets=targets,
            )
        protect, weights, measured = memo[key]
        info.update(measured.to_dict())
    fill = [st.hidden_mean for st in stats] if stats is not None else None
    return job, PreSearch(importance=importance, fill=fill, protect=protect, weights=weights, info=info)


def first_images(batches: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The first ``n`` images of ``batches`` (batches, the last one cut)."""
    out, got = [], 0
    for x in batches:
        if got >= n:
            break
        out.append(x[: n - got])
        got += len(out[-1])
    return out


def calibration_images(data: Any, spec: InputSpec, *, n: int, seed: int, batch_size: int = 64) -> list[torch.Tensor]:
    """``n`` preprocessed training images (a seeded draw, the same on every rank), in batches."""
    out, got = [], 0
    with torch.random.fork_rng(devices=[]):  # seeded augmentation draws; the caller's RNG is untouched
        torch.manual_seed(seed)
        for imgs, _ in make_loader(data.train, batch_size=batch_size, shuffle=True, seed=seed, num_workers=0):
            x = preprocess(imgs, spec)[: n - got]
            out.append(x)
            got += len(x)
            if got >= n:
                break
    return out


__all__ = [
    "PreSearch",
    "prepare_search",
    "init_importance",
    "calibration_images",
    "first_images",
    "INIT_PROBE_DROPS",
    "INIT_MARGIN",
    "PROBE_IMAGES",
    "ALIGN_PROBE",
]
