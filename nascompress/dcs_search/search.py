"""``nascompress search dcs``: the DCS differentiable channel search (seed 003 section 3.4, A.2).

It runs on the one training loop (:func:`nascompress.train.run.fit`) with
:class:`~nascompress.dcs_search.hooks.DCSSearchHooks`; this module holds the job
(its settings: :mod:`~nascompress.dcs_search.search_config`).
Each epoch the training split is cut once (:func:`~nascompress.data.split_indices`, fixed seed)
into 70% for the network weights W and 30% for the architecture parameters (every MLP gate
alpha and static Q/K theta, and the head and block gate logits with ``head_gates`` /
``depth_gates``); W-steps and arch-steps alternate, spread evenly over the epoch
(first order). W-steps minimise CE + ``distill`` x KL to the dense model's logits +
``feat_distill`` x the relative error to its pre-logits feature (what keeps a pretrained model
close to itself while its channels go); arch-steps minimise

    task + lambda * log(cost / dense_cost) + entropy_weight * H(g_hat, theta_hat)

where task is that distillation loss (``arch_loss="kd"``: a few thousand labels say less about
which channels matter than the dense model's outputs do) or CE (``"ce"``, the paper's), and cost
(:class:`~nascompress.dcs_search.cost.CostModel`) is the analytic MACs of the network with each
block's gated MLP width replaced by the soft count sum(g_hat) and each block's Q/K width by a
smooth maximum over heads of the soft per-head counts (heads and whole blocks, where gated, by
their soft gates), so the cost is differentiable in every alpha, theta and head or block logit.
The temperature starts at 4.5 and is multiplied by 0.95 every epoch. The weights
train at a fine-tuning lr (base 1e-3 per 512 images, warm-up, cosine, no layer decay), large enough
for them to recover, at the architecture the search ends with, the channels it closes (the
distillation keeps them near the dense model); the architecture parameters at their own larger lr
(``arch_lr``). Measured (``bench/dcs_search_lr.py``, DINOv2 ViT-S/14 probe, 2,000 Fashion-MNIST
images, 0.7x): the former pretrained-safe 1e-4 with layer decay 0.75 left the weights all but
frozen (peak 3.1e-6 at batch 16) and the searched model at 69.5% validation top-1 against the dense
model's 83.2%; 1e-3 without layer decay ends at 86.7%.

Before the search, on ``init_images`` training images (:mod:`~nascompress.methods.dcs_importance`):
the width multiple is timed on the device where ``align="auto"`` (:mod:`~nascompress.dcs_search.align`),
the MLP gate family is chosen where ``mlp_gates="auto"`` (:mod:`~nascompress.dcs_search.family`),
the gates' start is ordered by importance (``init_importance``), the outlier channels of a
pretrained model are fixed open and every block's cost is weighted by its measured sensitivity
(:mod:`~nascompress.dcs_search.protect`).

With ``target_flops`` lambda is steered after every arch-step by a PI controller
(:class:`~nascompress.dcs_search.cost.LambdaSteer`) on ``ratio / target_t - 1``, where ratio is the
exact FLOPs of the hard architecture as it will be materialized (aligned widths, ``round_mlp``
applied; with ``cost="latency"`` the latency of that architecture predicted from the device's
lookup table, :mod:`~nascompress.dcs_search.latency_cost`, and the target ``target_latency``) and
the target moves from 1.0 down to ``target_flops`` over the first ``target_ramp`` of
the architecture steps (the model gives up its channels progressively, not at once); lambda is the
Lagrange multiplier of the target and turns negative below it; where the task gradient per gate
outweighs the cost's (pretrained models), the cost term is scaled up by that ratio, measured once
at the first arch-step (``grad_balance``). The gate logits start open, spread by an importance
score, so channels reach the threshold one by one rather than all at once. A search that lands
outside the band is reported; with ``calibrate`` (default) the gate threshold is then shifted to
land inside it, and the log and metrics say by how much. A search whose validation accuracy falls
more than ``max_val_drop`` points below the dense model's stops with a message (while the target
still moves, the weights chase a shrinking architecture and dip before they recover: there only a
drop of twice that stops it).

Under torchrun (:mod:`nascompress.train.distributed`) each process takes its shard of both subsets every
epoch; the shards are equal, so every process interleaves its W- and arch-steps in the same order,
and the gradients averaged by DistributedDataParallel (one wrapper for the W-steps' weights, one for
the arch-steps' logits) keep the architecture (and so lambda) the same everywhere.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..train import distributed
from ..data import IN_MEMORY, InputSpec
from ..profiling.evaluate import evaluate
from ..runs.io import save_model
from ..methods.dcs import make_record, make_supernet
from ..progress import counted, step
from ..runs.files import Arch
from ..train.run import check_classes
from ..train.loop import fit
from ..train.metrics import TrainMetrics
from .baseline import keep_better, last_validation
from .cost import CostModel, selection_record
from .hooks import DCSSearchHooks, SearchCollapsed
from .latency_cost import latency_cost
from .metrics import DCSMetrics
from .prepare import prepare_search
from .search_config import DCSSearchJob
from .teacher import TeacherCache


# ---------------------------------------------------------------------------------------------
# The job


def _resumed_at_end(hooks: DCSSearchHooks, supernet: nn.Module, log: list[dict[str, Any]]) -> None:
    """A search resumed from the checkpoint of its last epoch (no epoch left to run) ends as the
    uninterrupted one did: the supernet at that epoch's temperature (what arch.json records) and the
    accuracy guard judging that epoch's record (:class:`SearchCollapsed` when it stopped the search)."""
    hooks.set_tau(supernet, hooks.epochs - 1)
    if len(log) > 1 and log[-1].get("epoch") == hooks.epochs:
        hooks.check(log[-1], log[0] if log[0].get("start") else None)


@dataclass
class DCSSearchResult:
    """A finished DCS search in memory: the trained supernet (gates and weights of the last epoch),
    the job with the pre-search choices resolved (width multiple, batch size, gate family), the epoch records
    (``log.jsonl``'s lines) and the search's metrics (:class:`~nascompress.dcs_search.metrics.DCSMetrics`:
    ``metrics.json`` less the completion mark's files)."""

    supernet: nn.Module
    job: DCSSearchJob
    log: list[dict[str, Any]]
    metrics: DCSMetrics


def run_dcs_search(
    job: DCSSearchJob,
    dense: nn.Module,
    base_arch: Arch | dict[str, Any],
    data: Any,
    *,
    out_dir: Path | None = None,
    resume: bool = False,
    before_fit: Callable[[DCSSearchJob, dict[str, Any]], None] | None = None,
    pre_search: dict[str, Any] | None = None,
) -> DCSSearchResult:
    """The DCS search on models and data in memory: ``dense`` (trainable; it becomes the frozen
    distillation teacher, the supernet is a copy) with its ``base_arch``, ``data`` loaded for its
    input spec. Nothing is written without ``out_dir`` (a study trial's search); with it the run
    directory's files are written as the search goes (:func:`~nascompress.dcs_search.run.search_dcs`),
    ``before_fit(job, info)`` called once the job's choices are resolved (``info``: what the
    pre-search measurements chose and why). ``pre_search``: that ``info`` as the first run of a
    resumed search recorded it (its job is already resolved, so the choices it no longer makes, the
    batch size and the gate family, are reported as that run reported them)."""
    if job.train.keep != "last":
        job = job.replace(train=job.train.replace(keep="last"))  # the result is the last architecture
    base_arch = Arch.of(base_arch)
    spec = InputSpec.from_dict(dict(base_arch.input))
    device = distributed.init(job.train.device)
    check_classes(dense.num_classes, data)
    base_arch = base_arch.with_labels(data.classes)  # the classes searched on
    with counted(
        "DCS: measuring the dense model before the search (activation statistics, gate probes)", unit="probe batches"
    ) as tick:
        job, pre = prepare_search(job, dense, data, spec, tick=tick, device=device)
    if pre_search:  # the recorded choices first, in their order; those measured again are the same
        pre = replace(pre, info={**pre_search, **pre.info})
    torch.manual_seed(job.train.seed)
    supernet = make_supernet(
        copy.deepcopy(dense),
        job.method,
        tau=job.search.tau0,
        importance=pre.importance,
        fill=pre.fill,
        protect=pre.protect,
    )
    cost = CostModel.build(dense, supernet, torch.zeros(1, spec.in_chans, *spec.img_size), weights=pre.weights)
    if job.search.cost == "latency":  # the device's latency table: read from the cache, or measured once
        s = job.search
        with step(f"DCS: the latency table of this model on {device} ({s.latency_dtype}, batch {s.latency_batch})"):
            cost = latency_cost(cost, dense, supernet, device=device, dtype=s.latency_dtype, batch=s.latency_batch)
    dense.eval().requires_grad_(False).to(device)  # the distillation teacher runs beside the supernet
    distils = job.search.distill > 0 or job.search.feat_distill > 0
    # the teacher's outputs once per image where the training images are not augmented (in-memory data, an
    # ImageFolder with augment none)
    teacher = None
    if distils and (data.name in IN_MEMORY or data.extra.get("fixed_train_images")):
        with step(f"DCS: the dense model's outputs for the {len(data.train)} training images (computed once)"):
            teacher = TeacherCache.build(
                dense, data.train, spec, device=device, feat=job.search.feat_distill > 0, amp=job.train.amp
            )
    hooks = DCSSearchHooks(
        supernet,
        dense=dense if distils else None,
        cost=cost,
        job=job,
        base_arch=base_arch,
        train_size=len(data.train),
        init_info=pre.info,
        teacher=teacher,
    )
    if before_fit is not None:
        before_fit(job, pre.info)
    log: list[dict[str, Any]] = hooks.log  # fit appends every epoch's record; the guard reads the previous one
    try:
        fit_metrics: TrainMetrics | None = fit(
            supernet,
            data=data,
            input_spec=spec,
            cfg=job.train,
            out_dir=out_dir,
            arch=hooks.arch(supernet, base_arch),
            hooks=hooks,
            resume=resume,
            finish=False,
            log=log,
            test=False,
        )  # the kept model: below
        if not hooks.rechecked:  # resumed after its last epoch: no epoch ran, the end of the last one is here
            _resumed_at_end(hooks, supernet, log)
        stopped = None
    except SearchCollapsed as e:  # the gates stop here; with the baseline on, the search still ends with a model
        if not job.search.baseline:
            raise
        fit_metrics, stopped = None, e
        supernet.eval()
    kept, comparison = keep_better(
        job,
        supernet,
        cost=hooks.cost,
        ratio=hooks.ratio(supernet),
        dense=dense,
        fill=pre.fill,
        data=data,
        spec=spec,
        device=device,
        stopped=stopped,
        last_eval=last_validation(log, len(data.val)),
        teacher=teacher,
        frozen=base_arch.frozen,  # the parameters the caller froze: the recovery leaves them
    )
    if kept.kind != "dcs":
        job = job.replace(method=kept.cfg)
    supernet = kept.supernet
    if out_dir is not None and distributed.is_main():  # the kept model is the run's model (materialize reads it)
        save_model(out_dir, supernet, base_arch.with_method(make_record(supernet, kept.cfg, stage="supernet")))
    last = log[-1]
    calib = [r["calibration"] for r in log if "calibration" in r]
    budget = [r["budget"] for r in log if "budget" in r]
    arch_steps = sum(b["arch_steps"] for b in budget)
    epoch_time = [r["epoch_time_s"] for r in log[1:]]
    if fit_metrics is None:  # stopped by the guard: the test split is scored below, for the kept model
        fit_metrics = TrainMetrics.new(epochs=job.train.epochs, train_time_s=sum(epoch_time), dataset=data.name)
    kept_sel = selection_record(supernet, kept.cost)
    if data.test is data.val and kept.val_eval is not None:  # no test split of its own: the kept model's validation
        test = kept.val_eval
    else:
        test = evaluate(
            supernet, data.test, input_spec=spec, device=device, batch_size=job.train.eval_batch_size, amp=job.train.amp
        )
    metrics = dict(
        fit_metrics.to_dict(),
        finished=True,
        dense_macs=getattr(cost, "flops", cost).dense,
        macs=kept_sel["macs"],
        flops_ratio=kept_sel["flops_ratio"],
        target_flops=job.search.target_flops,
        cost=job.search.cost,
        target_latency=job.search.target_latency,
        lam=last.get("lam"),
        val_top1=kept.val_top1 if kept.val_top1 is not None else last["val_top1"],
        search_val_top1=last["val_top1"],
        test_top1=test.top1,
        test_loss=test.loss,
        test_n=test.n,
        kept=kept.kind,
        comparison=comparison.to_dict(),
        stopped=None if stopped is None else {"epoch": last["epoch"], "reason": stopped.reason},
        dense_val_top1=log[0]["val_top1"] if log[0].get("start") else None,
        search_time_s=fit_metrics.train_time_s,
        epoch_time_s=epoch_time,
        mlp_kept=kept_sel["mlp_kept"],
        qk_kept=kept_sel.get("qk_kept"),
        calibrated=bool(calib),
        calibration=calib[-1] if calib else None,
        calibration_move=calib[-1]["move"] if calib else (0.0 if budget else None),
        budget=job.search.budget if budget else None,
        at_target_share=sum(b["at_target"] for b in budget) / arch_steps if arch_steps else None,
        projections=sum(b["projections"] for b in budget) if budget else None,
        train_images=len(data.train),
        dataset=data.name,
        mlp_gates=job.method.mlp_gates,
        align=job.method.align,
        batch_size=job.train.batch_size,
        teacher_cached=teacher is not None,
        **pre.info,
    )
    metrics.update({k: kept_sel[k] for k in ("heads_kept", "skipped_blocks") if k in kept_sel})  # head/block gates
    lat = ("latency_ms", "dense_latency_ms", "latency_ratio")
    metrics.update({k: kept_sel[k] for k in lat if k in kept_sel})  # predicted, with a latency cost
    typed = DCSMetrics.from_dict(metrics, source="the DCS search's metrics")  # the file's keys, in its order
    return DCSSearchResult(supernet=supernet, job=job, log=log, metrics=typed)


__all__ = ["DCSSearchResult", "run_dcs_search"]
