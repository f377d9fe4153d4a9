"""The baseline inside the DCS search: what a user gets for free, built at the same FLOPs, given the
same short recovery as the searched model and scored on the same validation images; the search keeps
the better of the two (``DCSSearchConfig.baseline``).

The baseline is Torch-Pruning's rule for a ViT's MLPs, global magnitude pruning of the hidden neurons
(``MetaPruner`` with ``GroupMagnitudeImportance(p=2)``, ``global_pruning=True``, ``round_to`` = the
alignment): hidden neuron j of a block scores ``||fc1.weight[j]||^2 + fc1.bias[j]^2 + ||fc2.weight[:, j]||^2``,
divided by the block's mean score (Torch-Pruning's ``normalizer="mean"``, which makes blocks comparable),
and one threshold over every block, bisected on the exact FLOPs of the aligned model, sets how many
neurons each block keeps (at least ``align``). It is expressed as a DCS supernet of the ``hidden``
family with its gates fixed (+-:data:`~nascompress.methods.dcs.PROTECT_LOGIT`) and every Q/K channel
kept, so the kept model, searched or baseline, is one supernet: ``materialize`` gathers either, and a
closed neuron contributes its mean activation where the search measured it (the bias correction of
structured pruning) or nothing. Where the search gates heads or blocks, the baseline keeps as many as
the searched model, the largest by magnitude (:mod:`.magnitude`).

The recovery (:func:`recover`) is the search's weight step without the gates: ``steps`` AdamW steps
(linear warm-up over the first tenth to the search's peak lr, then a cosine to 0) of CE + ``distill`` x KL +
``feat_distill`` x the pre-logits feature error to the dense model, on the same seeded training batches
for both candidates, architecture fixed (the hard masks, as materialized).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .. import runtime
from ..data import InputSpec, training_batches
from ..train.distill import FeatureTap, feature_kd_loss
from ..errors import NascompressError, SettingError
from ..profiling.evaluate import evaluate
from ..profiling.records import Evaluation
from ..train.hooks import kl_to_teacher, short_stage
from ..methods.dcs import DCSConfig, make_supernet
from ..methods.dcs_supernet import arch_parameters, check_family
from ..progress import step as shown
from .magnitude import Structure, fix_structure, magnitude_scores, set_hidden_gates
from .cost import CostModel
from .metrics import CandidateRecord, Comparison, MagnitudeBaseline, RecoveryLog, RecoverySettings
from .teacher import TeacherCache, teacher_outputs

KINDS = ("dcs", "magnitude")
NAMES = {"dcs": "the searched model", "magnitude": "the magnitude-pruned model"}  # as the messages call them


def magnitude_supernet(
    dense: nn.Module,
    *,
    target: float,
    align: int,
    fill: list[torch.Tensor] | None,
    x1: torch.Tensor,
    structure: Structure = Structure(),
    make_cost: Callable[[nn.Module, nn.Module], Any] | None = None,
    at_most: bool = False,
) -> tuple[nn.Module, DCSConfig, CostModel, MagnitudeBaseline]:
    """The magnitude baseline at ``target`` x the dense FLOPs as a fixed DCS supernet (module
    docstring): (supernet, its DCSConfig, its cost model, its :class:`~.metrics.MagnitudeBaseline`:
    ``flops_ratio``, ``hidden_kept``, ``threshold`` ...). ``fill``: the dense model's mean hidden
    activation per block (None: closed neurons give 0); ``structure``: the searched model's head and
    block counts (:mod:`.baseline_structure`); ``make_cost(dense, supernet)``: the cost whose ratio
    ``target`` is (default: the FLOPs :class:`CostModel`; the search's latency cost builds a
    :class:`~.latency_cost.LatencyCost`); ``at_most``: the closest ratio at or under ``target`` (the
    search's ``at_most``), not either side."""
    cfg = DCSConfig(mlp_gates="hidden", qk_mask="none", align=align, hidden_fill="mean" if fill else "zero")
    cfg = cfg.replace(head_gates=structure.heads is not None, depth_gates=structure.skipped is not None)
    check_family(dense, "hidden")
    supernet = make_supernet(copy.deepcopy(dense), cfg, fill=fill)
    for p in arch_parameters(supernet):
        p.requires_grad_(False)  # fixed gates: only the weights recover
    supernet.eval()
    fixed = fix_structure(supernet, dense, structure)
    cost = CostModel.build(dense, supernet, x1) if make_cost is None else make_cost(dense, supernet)
    scores = magnitude_scores(dense)

    def ratio(t: float) -> float:
        set_hidden_gates(supernet, scores, t, align)
        return cost.hard_macs(supernet) / cost.dense

    lo, hi = 0.0, float(max(float(s.max()) for s in scores))  # ratio(lo) = the dense-most, ratio(hi) the least

    def err(r: float) -> float:  # over a limit (at_most): worse than any ratio under it
        return abs(r - target) + (1.0 if at_most and r > target else 0.0)

    best = (err(ratio(lo)), lo)
    for _ in range(40):  # the FLOPs ratio falls as the threshold rises
        mid = (lo + hi) / 2
        r = ratio(mid)
        best = min(best, (err(r), mid))
        lo, hi = (mid, hi) if r > target else (lo, mid)
    counts = set_hidden_gates(supernet, scores, best[1], align)
    info = MagnitudeBaseline.new(
        flops_ratio=cost.hard_macs(supernet) / cost.dense,
        hidden_kept=counts,
        threshold=best[1],
        rule="global group-L2 magnitude of the MLP hidden neurons, mean-normalized per block "
        "(Torch-Pruning's GroupMagnitudeImportance(p=2), global_pruning)",
        **fixed,
    )
    return supernet, cfg, cost, info


@dataclass(frozen=True)
class Recovery:
    """The same short recovery for every candidate: ``steps`` steps of ``batch_size`` training
    images drawn with ``seed``, peak lr ``lr``, the distillation weights of the search, in the
    search's precision ``amp`` (its forwards under bf16 autocast where the search's are)."""

    steps: int
    batch_size: int
    lr: float
    seed: int
    distill: float
    feat_distill: float
    amp: str = "off"
    frozen: frozenset[str] = frozenset()  # the parameters the caller froze (arch.json's frozen): not trained


def recover(
    model: nn.Module,
    dense: nn.Module,
    data: Any,
    spec: InputSpec,
    rec: Recovery,
    device: torch.device,
    teacher: TeacherCache | None = None,
) -> RecoveryLog:
    """Train ``model``'s weights (its gates fixed, their hard masks) for ``rec.steps`` steps; returns
    the mean losses of the last steps and the steps taken (:func:`~nascompress.train.hooks.short_stage`,
    as a :class:`~.metrics.RecoveryLog`). ``teacher``: the search's cache of the dense model's outputs
    per training image, read instead of a teacher forward."""
    arch = {id(p) for p in arch_parameters(model)}
    params = [p for n, p in model.named_parameters() if id(p) not in arch and n not in rec.frozen]
    state = getattr(model, "dcs_state", None)
    sample = None if state is None else state.sample
    if state is not None:
        state.sample = False  # the weights train under the architecture that is materialized
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(id(p) not in arch)
    cached = teacher is not None and (rec.feat_distill == 0 or teacher.feat is not None)
    taps = (FeatureTap(model, "pre_logits"), FeatureTap(dense, "pre_logits")) if rec.feat_distill > 0 else None
    dense.eval()

    def loss_fn(
        x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with runtime.autocast(device, rec.amp):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            logs = {"ce": loss.detach()}
            if rec.distill > 0 or taps is not None:
                tap = None if taps is None else taps[1]
                t_logits, t_feat = teacher_outputs(dense, x, cache=teacher if cached else None, idx=idx, tap=tap)
                if rec.distill > 0:
                    kl = kl_to_teacher(logits, t_logits)
                    loss, logs["kl"] = loss + rec.distill * kl, kl.detach()
                if taps is not None:
                    fkd = feature_kd_loss(taps[0].pop().float(), t_feat.float())
                    loss, logs["feat"] = loss + rec.feat_distill * fkd, fkd.detach()
        return loss, logs

    try:
        with runtime.cpu_attention(model, device, rec.amp), runtime.cpu_attention(dense, device, rec.amp):
            batches = training_batches(
                data, spec, batch_size=rec.batch_size, seed=rec.seed, device=device, indexed=cached
            )
            logs = short_stage(model, params, batches, loss_fn, steps=rec.steps, lr=rec.lr, decay=True)
            return RecoveryLog.new(**logs)
    finally:
        if taps is not None:
            for t in taps:
                t.remove()
        for p, flag in flags:
            p.requires_grad_(flag)
        if state is not None:
            state.sample = sample


@dataclass
class Candidate:
    """One model the search may keep: ``kind`` (dcs or magnitude), the supernet, its DCSConfig, its
    ratio of the search's cost (FLOPs or predicted latency: ``cost.unit``), whether it stands at the
    target (``eligible``; why not in ``note``)."""

    kind: str
    supernet: nn.Module
    cfg: DCSConfig
    flops_ratio: float
    cost: Any  # CostModel or LatencyCost
    eligible: bool = True
    note: str | None = None
    pre_eval: Evaluation | None = None  # evaluate()'s record before the recovery (the search's last validation)
    recovered_eval: Evaluation | None = None  # evaluate()'s record after the recovery
    val_eval: Evaluation | None = None  # the record of the model's kept state: one of the two above
    state: str | None = None
    recovery: RecoveryLog | None = None

    @property
    def pre_val(self) -> float | None:
        """The validation top-1 before the recovery, if known."""
        return None if self.pre_eval is None else self.pre_eval.top1

    @property
    def recovered_val(self) -> float | None:
        """The validation top-1 after the recovery, once recovered."""
        return None if self.recovered_eval is None else self.recovered_eval.top1

    @property
    def val_top1(self) -> float | None:
        """The validation top-1 of the kept state, once scored."""
        return None if self.val_eval is None else self.val_eval.top1

    @property
    def val_n(self) -> int | None:
        """The validation images it was scored on."""
        return None if self.val_eval is None else self.val_eval.n

    def record(self) -> CandidateRecord:
        return CandidateRecord.new(
            flops_ratio=self.flops_ratio,
            eligible=self.eligible,
            note=self.note,
            val_top1=self.val_top1,
            val_before_recovery=self.pre_val,
            val_recovered=self.recovered_val,
            state=self.state,
            val_n=self.val_n,
            recovery=self.recovery,
        )


def choose(
    candidates: list[Candidate],
    dense: nn.Module,
    data: Any,
    spec: InputSpec,
    rec: Recovery,
    device: torch.device,
    *,
    eval_batch_size: int,
    teacher: TeacherCache | None = None,
) -> tuple[Candidate, Comparison]:
    """Recover every eligible candidate the same way (same seed, same batches), score each on the
    validation split, and keep the best (ties: the first, the searched model). A candidate scored
    before the recovery (``pre_eval``: the searched model's last epoch) whose recovery lowered its
    validation top-1 goes back to its state before: each competes with its best state, and the
    kept model is never worse than what the search ended with. Returns the kept candidate and the
    ``comparison`` record (metrics.json)."""
    eligible = [c for c in candidates if c.eligible]
    if not eligible:
        raise NascompressError("no candidate model stands at the FLOPs target; this is a bug, please report it")
    for c in eligible:
        before = None if c.pre_val is None else {k: v.detach().clone() for k, v in c.supernet.state_dict().items()}
        torch.manual_seed(rec.seed)
        with shown(
            f"DCS: {NAMES[c.kind]}: {rec.steps} recovery steps of {rec.batch_size} images, then its validation top-1"
        ):
            c.recovery = recover(c.supernet, dense, data, spec, rec, device, teacher)
            c.supernet.eval()
            val = evaluate(
                c.supernet, data.val, input_spec=spec, device=device, batch_size=eval_batch_size, amp=rec.amp
            )
        c.recovered_eval, c.val_eval, c.state = val, val, "recovered"
        if before is not None and c.pre_val > c.recovered_val:  # the recovery cost it: its state before is its best
            c.supernet.load_state_dict(before)
            c.val_eval, c.state = c.pre_eval, "before recovery"
    kept = max(eligible, key=lambda c: (c.val_top1, -candidates.index(c)))
    others = [c for c in eligible if c is not kept]
    margin = kept.val_top1 - max(c.val_top1 for c in others) if others else None
    settings = RecoverySettings.new(
        steps=rec.steps,
        batch_size=rec.batch_size,
        images=rec.steps * rec.batch_size,
        lr=rec.lr,
        seed=rec.seed,
        distill=rec.distill,
        feat_distill=rec.feat_distill,
        amp=rec.amp,
    )
    record = Comparison.new(
        kept=kept.kind, margin_pt=margin, recovery=settings, **{c.kind: c.record() for c in candidates}
    )
    return kept, record


def last_validation(log: list[dict[str, Any]], n: int) -> Evaluation | None:
    """The search's last epoch's validation record (``log.jsonl``'s last line) as :func:`evaluate`
    gives it (``n``: the validation split's size), None before the first epoch."""
    if len(log) < 2 or "val_top1" not in log[-1]:
        return None
    return Evaluation.new(top1=log[-1]["val_top1"], loss=log[-1]["val_loss"], n=n)


def recovery_steps(images: int, train_size: int, batch_size: int) -> int:
    """Steps of the recovery: ``images`` training images (at most the training split), at least one."""
    return max(1, math.ceil(min(images, train_size) / batch_size))


def keep_better(
    job: Any,
    supernet: nn.Module,
    *,
    cost: CostModel,
    ratio: float,
    dense: nn.Module,
    fill: list[torch.Tensor] | None,
    data: Any,
    spec: InputSpec,
    device: torch.device,
    stopped: Exception | None,
    last_eval: Evaluation | None = None,
    teacher: TeacherCache | None = None,
    frozen: Iterable[str] = (),
) -> tuple[Candidate, Comparison]:
    """The search's end (``job``: a DCSSearchJob): the searched ``supernet`` (at FLOPs ``ratio``, validation
    top-1 ``last_eval.top1`` at its last epoch, :func:`last_validation`;
    ``stopped``: the guard's reason if the gates stopped early) against the magnitude baseline at the
    target (the searched ratio without one), both recovered alike; returns the kept candidate and the
    comparison record. Without ``job.search.baseline`` the searched model is kept as it is. ``teacher``:
    the search's cache of the dense model's outputs, which the recoveries read; ``frozen``: the
    parameters the caller froze, which they do not train."""
    s = job.search
    target = s.target if s.target is not None else ratio
    at_target = abs(ratio / target - 1) <= s.tolerance
    dcs = Candidate(
        "dcs",
        supernet,
        job.method,
        ratio,
        cost,
        eligible=at_target,
        pre_eval=last_eval,
        note=None if at_target else f"ended at {ratio:.3f}x, outside {target:g} +-{s.tolerance:.0%}",
    )
    if not s.baseline:
        return dcs, Comparison.new(kept="dcs", baseline=None)
    spec_x = torch.zeros(1, spec.in_chans, *spec.img_size)
    cpu_fill = None if fill is None else [f.detach().cpu() for f in fill]
    try:
        on_cpu = dense if next(dense.parameters()).device.type == "cpu" else copy.deepcopy(dense).cpu()
        base, cfg, base_cost, info = magnitude_supernet(
            on_cpu,
            target=target,  # (it patches a copy of its own)
            align=job.method.align,
            fill=cpu_fill,
            x1=spec_x,
            structure=Structure.of(supernet),
            make_cost=lambda d, sn: cost.like(d, sn, spec_x),  # the search's own kind of cost
            at_most=s.at_most,
        )
    except NascompressError as e:  # a model whose MLP the rule cannot prune (not timm's plain Mlp)
        if not dcs.eligible:
            raise (stopped or e)
        return dcs, Comparison.new(kept="dcs", baseline=None, baseline_note=str(e))
    r = info.flops_ratio
    reach = abs(r / target - 1) <= s.tolerance
    magnitude = Candidate(
        "magnitude",
        base.to(device),
        cfg,
        r,
        base_cost,
        eligible=reach,
        note=None
        if reach
        else (f"the MLP hidden neurons alone reach {r:.3f}x at the nearest, outside {target:g} +-{s.tolerance:.0%}"),
    )
    if not (dcs.eligible or magnitude.eligible):
        if stopped is not None:
            raise stopped
        target_key = "target_latency" if s.cost == "latency" else "target_flops"
        raise SettingError(
            f"neither the searched model ({dcs.note}) nor the magnitude baseline ({magnitude.note}) "
            f"stands at the target; rerun the same command with {{force}} {{{target_key}}} {r:.2f}"
        )
    rec = Recovery(
        steps=recovery_steps(s.recovery_images, len(data.train), job.train.batch_size),
        batch_size=job.train.batch_size,
        lr=job.train.peak_lr_for(world_size=1),
        seed=job.train.seed,
        distill=s.distill,
        feat_distill=s.feat_distill,
        amp=runtime.resolve_amp(job.train.amp, device),
        frozen=frozenset(frozen),
    )
    kept, record = choose(
        [dcs, magnitude], dense, data, spec, rec, device, eval_batch_size=job.train.eval_batch_size, teacher=teacher
    )
    if not magnitude.eligible:
        record = record.set(magnitude_note=magnitude.note)
    names = ("rule", "hidden_kept", "heads_kept", "skipped_blocks")  # (heads and blocks: where the search gates them)
    widths = {k: getattr(info, k) for k in names if getattr(info, k) is not None}
    record = record.set(magnitude=record.magnitude.set(**widths))
    return kept, record.set(reason=reason(kept, dcs, magnitude, stopped))


def reason(kept: Candidate, dcs: Candidate, magnitude: Candidate, stopped: Exception | None) -> str:
    """One line: which model the search kept, and why."""
    if kept is dcs and not magnitude.eligible:
        return (
            f"kept the searched model ({dcs.val_top1:.2f}% validation top-1 at "
            f"{dcs.flops_ratio:.3f}x {dcs.cost.unit}): "
            f"no magnitude baseline at the target ({magnitude.note})"
        )
    if not dcs.eligible:
        why = f"the searched model {dcs.note}" + (f" ({getattr(stopped, 'reason', stopped)})" if stopped else "")
        return (
            f"kept the magnitude-pruned model ({magnitude.val_top1:.2f}% validation top-1 at "
            f"{magnitude.flops_ratio:.3f}x {magnitude.cost.unit}): {why}"
        )
    a, b = (dcs, magnitude) if kept is dcs else (magnitude, dcs)
    line = (
        f"kept {NAMES[a.kind]}: {a.val_top1:.2f}% validation top-1 at {a.flops_ratio:.3f}x {a.cost.unit} against "
        f"{NAMES[b.kind]}'s {b.val_top1:.2f}% at {b.flops_ratio:.3f}x, after the same recovery"
    )
    return line + (f"; {getattr(stopped, 'reason', stopped)}" if stopped else "")


__all__ = [
    "KINDS",
    "Candidate",
    "Recovery",
    "choose",
    "keep_better",
    "last_validation",
    "magnitude_supernet",
    "reason",
    "recover",
    "recovery_steps",
]
