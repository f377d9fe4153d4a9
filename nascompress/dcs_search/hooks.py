"""The DCS search as training hooks (:class:`DCSSearchHooks`, run by the one training loop
:func:`nascompress.train.run.fit`): the alternating weight and architecture steps, the budget (the
lambda controller and the projection onto the moving target), the end-of-search guard and the
accuracy stop (see :mod:`nascompress.dcs_search.search`)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..train import distributed
from ..data import Indexed, Subset, split_indices
from ..train.distill import FeatureTap, feature_kd_loss
from ..errors import SettingError
from ..train.hooks import TrainHooks, kl_to_teacher, own_group, param_groups
from ..methods.dcs_supernet import arch_parameters
from ..methods.dcs_gates import binary_entropy
from ..methods.dcs import make_record
from ..runs.files import Arch
from ..train.config import TrainConfig
from .cost import CostModel, LambdaSteer, calibrate, round_blocks, selection_record, shifted_logits
from .search_config import DCSSearchJob
from .teacher import StepTag, TeacherCache, interleave, teacher_outputs


class DCSSearchHooks(TrainHooks):
    """The DCS search plugged into :func:`~nascompress.train.run.fit` (see the module docstring)."""

    def __init__(
        self,
        supernet: nn.Module,
        *,
        dense: nn.Module | None,
        cost: CostModel,
        job: DCSSearchJob,
        base_arch: Arch,
        train_size: int,
        init_info: dict[str, Any] | None = None,
        teacher: TeacherCache | None = None,
    ):
        self.cost, self.cfg, self.job, self.base_arch, self.dense = cost, job.search, job, base_arch, dense
        self.init_info = init_info or {}  # what the pre-search measurements chose: logged with the first epoch
        self.epochs = job.train.epochs
        self.arch_params = arch_parameters(supernet)
        self.unused_parameters = job.method.depth_gates  # a closed block is skipped: its weights get no gradient
        ids = {id(p) for p in self.arch_params}
        self.w_params = [p for p in supernet.parameters() if id(p) not in ids]
        self.w_idx, self.a_idx = split_indices(
            train_size, (self.cfg.weight_fraction, 1 - self.cfg.weight_fraction), seed=job.train.seed
        )
        self.lam = self.cfg.lam
        # lambda is the controller's output with a target (integral from 0: no wind-up while the
        # gates are still far from the threshold); without one it is the paper's constant --lam
        self.steer = (
            None
            if self.cfg.target is None
            else LambdaSteer(self.cfg.target_at(0.0), 0.0, self.cfg.steer_gain, self.cfg.steer_rate)
        )
        self.tau = self.cfg.tau0
        self.lam_scale: float = 1.0
        self.measure_balance = False  # set at every epoch's start when the balance is measured
        # per epoch (logged, so a resumed search counts the same): arch steps, those ending within the
        # tolerance of the final target, the projections made and the FLOPs ratio they moved
        self.epoch_stats: dict[str, Any] = {"arch_steps": 0, "at_target": 0, "projections": 0, "projected_move": 0.0}
        self.balance: dict[str, float] | None = None
        # arch steps of the whole search (under torchrun each rank takes its shard: world x fewer steps)
        self.arch_per_epoch = math.ceil(len(self.a_idx) / (job.train.batch_size * distributed.world().size))
        arch_steps = self.epochs * self.arch_per_epoch
        self.arch_steps, self.arch_step = max(1, arch_steps), 0
        self.arch_lr = (
            self.cfg.arch_lr
            if self.cfg.arch_lr is not None
            else min(0.5, max(0.01, job.method.alpha_init / (0.4 * max(1, arch_steps))))
        )
        distils = dense is not None and (self.cfg.distill > 0 or self.cfg.feat_distill > 0)
        self.taps = None
        if distils and self.cfg.feat_distill > 0:
            self.taps = (FeatureTap(supernet, "pre_logits"), FeatureTap(dense, "pre_logits"))
        self.teacher = teacher if distils else None
        self.log: list[dict[str, Any]] = []  # the run's epoch records (the search's fit fills the same list)
        self.rechecked = False  # whether a resumed search's last recorded epoch was judged again

    def ratio(self, supernet: nn.Module) -> float:
        return self.cost.hard_macs(supernet, round_mlp=self.cfg.round_mlp) / self.cost.dense

    def param_groups(self, model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
        groups = param_groups(model, weight_decay=cfg.weight_decay, layer_decay=cfg.layer_decay)
        # the architecture logits follow their own schedule (cosine from arch_lr to arch_lr_end x arch_lr,
        # so the controller still moves them at the end, ever more finely) and a short momentum (less
        # lag between lambda and the FLOPs, so less overshoot around the target)
        return own_group(
            groups,
            self.arch_params,
            weight_decay=0.0,
            own_lr=self.arch_lr,
            own_lr_end=self.cfg.arch_lr_end,
            betas=(self.cfg.arch_beta1, 0.999),
        )

    def batches(self, data, *, epoch, loader):
        train = data.train if self.teacher is None else Indexed(data.train)  # the cache is read by image index
        w = loader(Subset(train, self.w_idx))
        a = loader(Subset(train, self.a_idx), stream=1)
        order = interleave(len(w), len(a))

        def gen():
            w_it, a_it = iter(w), iter(a)
            for kind in order:
                imgs, labels, *idx = next(w_it if kind == "w" else a_it)
                yield imgs, labels, StepTag(kind, idx[0] if idx else None)

        return gen(), len(order)

    def set_tau(self, model: nn.Module, epoch: int) -> None:
        """The Gumbel temperature of ``epoch`` (``tau0`` x ``tau_decay`` per epoch), here and in the model."""
        self.tau = model.dcs_state.tau = self.cfg.tau0 * self.cfg.tau_decay**epoch

    def on_epoch_start(self, model: nn.Module, *, epoch: int) -> None:
        if epoch > 0 and self.log and self.log[-1].get("epoch") == epoch and not self.rechecked:
            # a resumed search judges its last recorded epoch again (a kill after the guard stopped it, then a
            # plain --resume, ends as the uninterrupted run did; --resume --max-val-drop 100 goes on), with the
            # temperature that epoch ended with (recorded in the kept model's arch.json)
            self.set_tau(model, epoch - 1)
            self.check(self.log[-1], self.log[0] if self.log[0].get("start") else None)
        self.rechecked = True
        self.set_tau(model, epoch)
        self.arch_step = epoch * self.arch_per_epoch  # from the epoch: the same after a resume
        self.epoch_stats = {"arch_steps": 0, "at_target": 0, "projections": 0, "projected_move": 0.0}
        self.measure_balance = self.steer is not None and self.cfg.grad_balance

    def prepare_step(self, model: nn.Module, tag: Any) -> None:
        model.dcs_state.sample = tag == "a" or self.cfg.w_gates == "sampled"
        for p in self.w_params:  # first order: each step differentiates only what it updates
            p.requires_grad_(tag == "w")
        for p in self.arch_params:
            p.requires_grad_(tag == "a")

    def distillation(
        self, logits: torch.Tensor, x: torch.Tensor, idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """``distill`` x KL + ``feat_distill`` x the pre-logits feature error to the dense model
        (its outputs read from the cache at the batch's image indices ``idx`` where there is one)."""
        if self.dense is None or (self.cfg.distill == 0 and self.taps is None):
            if self.taps is not None:
                self.taps[0].pop()
            return None, {}
        tap = None if self.taps is None else self.taps[1]
        t_logits, t_feat = teacher_outputs(self.dense, x, cache=self.teacher, idx=idx, tap=tap)
        kl = kl_to_teacher(logits, t_logits)
        loss, logs = self.cfg.distill * kl, {"kl": kl.detach()}
        if self.taps is not None:
            fkd = feature_kd_loss(self.taps[0].pop().float(), t_feat.float())
            loss = loss + self.cfg.feat_distill * fkd
            logs["feat"] = fkd.detach()
        return loss, logs

    def loss(self, model, x, y, *, epoch, cfg, tag=None):
        logits = model(x)
        ce = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
        if tag == "w" or self.cfg.arch_loss == "kd":
            kd, kd_logs = self.distillation(logits, x, getattr(tag, "idx", None))
        else:  # CE architecture steps: no teacher forward
            kd, kd_logs = None, {}
            if self.taps is not None:
                self.taps[0].pop()
        if tag == "w":
            logs = {"ce_w": ce.detach(), **{f"{k}_w": v for k, v in kd_logs.items()}}
            return (ce if kd is None else ce + kd), logs
        task = kd if (self.cfg.arch_loss == "kd" and kd is not None) else ce
        st = model.dcs_state
        log_cost = torch.log(self.cost.soft_macs(model, weighted=True) / self.cost.dense_weighted)
        soft = [d[j] for d in (st.soft_gates, st.soft_qk, st.soft_heads, st.soft_depth) for j in sorted(d)]
        ent = binary_entropy(torch.cat(soft)) if soft else torch.zeros((), device=x.device)
        if self.measure_balance:  # the first arch-step of each epoch: measure the balance on its own graph
            # against the task the step minimises; at the very start against CE (the supernet is still the
            # dense model, so the distillation loss and its gradient are 0)
            self.lam_scale = self.grad_balance(ce if epoch == 0 or kd is None else task, log_cost)
            self.measure_balance = False
        loss = task + self.lam_scale * self.lam * log_cost + self.cfg.entropy_weight * ent
        return loss, {
            "ce_a": ce.detach(),
            **{f"{k}_a": v for k, v in kd_logs.items()},
            "log_cost": log_cost.detach(),
            "entropy": ent.detach(),
        }

    def grad_balance(self, task: torch.Tensor, log_cost: torch.Tensor) -> float:
        """``max(1, r)``, r = median |d task / d logit| / median |d log cost / d logit| over every
        gate (medians averaged over the processes, so every one uses the same scale); see
        :attr:`DCSSearchConfig.grad_balance`. The task is CE even with ``arch_loss="kd"``: at the
        first step the supernet is the dense model, so the distillation loss and its gradient are 0.
        Reads gradients only: no extra forward, no RNG draw."""
        params = [p for p in self.arch_params if p.requires_grad]
        med = []
        for out in (task, log_cost):
            grads = torch.autograd.grad(out, params, retain_graph=True, allow_unused=True)
            g = [t.detach().abs().flatten() for t in grads if t is not None]
            med.append(float(torch.cat(g).median()) if g else 0.0)
        world = distributed.world().size
        task_med, cost_med = (v / world for v in distributed.all_sum(med))
        self.balance = {"task_grad_median": task_med, "cost_grad_median": cost_med}
        return max(1.0, task_med / cost_med) if cost_med > 0 else 1.0

    def after_step(self, model: nn.Module, tag: Any) -> None:
        if tag == "a" and self.steer is not None:
            self.arch_step += 1
            target = self.cfg.target_at(self.arch_step / self.arch_steps)
            self.steer.target = target
            ratio = self.ratio(model)
            # lambda answers where the gates themselves stand (their lag behind the target keeps the
            # cost's push on), the projection then puts the architecture on the target
            self.lam = self.steer.update(ratio)
            if self.cfg.budget == "project" and abs(ratio / target - 1) > self.cfg.project_band:
                calibrate(model, self.cost, target, round_mlp=self.cfg.round_mlp, apply_round=False)
                self.epoch_stats["projections"] += 1
                self.epoch_stats["projected_move"] += abs(ratio - self.ratio(model))
                ratio = self.ratio(model)
            self.epoch_stats["arch_steps"] += 1
            self.epoch_stats["at_target"] += int(abs(ratio / self.cfg.target - 1) <= self.cfg.tolerance)

    def on_epoch_end(self, model: nn.Module, *, epoch: int) -> dict[str, Any]:
        for p in self.w_params + self.arch_params:
            p.requires_grad_(True)
        model.dcs_state.sample = True
        rec: dict[str, Any] = {"tau": self.tau, "lam": self.lam, "lam_scale": self.lam_scale, "arch_lr": self.arch_lr}
        if self.steer is not None:
            rec["target_now"] = self.steer.target
            rec["budget"] = dict(self.epoch_stats)
        if self.balance is not None:
            rec["grad_balance"], self.balance = self.balance, None
        if epoch == 0:
            rec.update(self.init_info)
        if epoch == self.epochs - 1:  # the end: apply the rounding the controller steered for
            if self.cfg.round_mlp:
                rec["rounded"] = round_blocks(model, self.cfg.round_mlp)
            ratio = self.ratio(model)
            target = self.cfg.target
            off = target is not None and abs(ratio / target - 1) > self.cfg.tolerance
            # at_most: inside the band but above a target that is a limit (the pipeline's goal), the few
            # channels between are cut too, an untrained shift bounded like the landing of a search off target
            above = target is not None and self.cfg.at_most and ratio > target
            if off or above:
                advice = (
                    "hold the target while the search trains: rerun the same command with {force} {budget} project"
                    if self.cfg.budget != "project"
                    else "give the search more architecture steps: rerun the "
                    f"same command with {{force}} {{epochs}} {2 * self.epochs}"
                )
                if off and not self.cfg.calibrate:
                    raise SettingError(
                        f"the search ended at a FLOPs ratio of {ratio:.3f}, outside {target} "
                        f"+-{self.cfg.tolerance:.0%}; {advice}"
                    )
                saved = [p.detach().clone() for p, _ in shifted_logits(model)]
                shift = calibrate(model, self.cost, target, round_mlp=self.cfg.round_mlp, at_most=self.cfg.at_most)
                move = abs(ratio - self.ratio(model))
                if move > self.cfg.max_calibration:
                    with torch.no_grad():  # leave the supernet as the search trained it
                        for (a, _), s in zip(shifted_logits(model), saved):
                            a.copy_(s)
                    raise SearchOffTarget(
                        f"the search ended at a FLOPs ratio of {ratio:.3f} for the target {target}: landing "
                        f"{'under' if above and not off else 'there'} would take an untrained cut of {move:.3f} "
                        f"(more than {{max_calibration}} {self.cfg.max_calibration:g}), which is not applied",
                        advice,
                    )
                rec["calibration"] = {
                    "ratio_before": ratio,
                    "ratio_after": self.ratio(model),
                    "move": move,
                    "alpha_shift": shift,
                    "reason": "off target" if off else "at_most",
                }
        rec.update(selection_record(model, self.cost))
        return rec

    def arch(self, model: nn.Module, arch: Arch | dict[str, Any]) -> Arch:
        return self.base_arch.with_method(make_record(model, self.job.method, stage="supernet"))

    def check(self, record: dict[str, Any], start: dict[str, Any] | None) -> None:
        """The accuracy guard (:attr:`DCSSearchConfig.max_val_drop`): judged on the epoch's record and
        the previous one (``self.log``, the run's records: on resume the recorded ones too)."""
        if start is None:
            return
        drop = start["val_top1"] - record["val_top1"]
        target, now = self.cfg.target, record.get("target_now")
        prev = self.log[-2] if len(self.log) >= 2 and self.log[-1] is record else None
        if prev is not None and prev.get("start"):
            prev_at = target is not None and target >= 1.0  # the start: the dense model stands at the target 1 only
        else:
            prev_at = (
                prev is not None
                and prev.get("target_now") is not None
                and target is not None
                and prev["target_now"] <= target * (1 + 1e-6)
            )
        # while the target still moves, and in the epoch where it arrives, the weights chase a shrinking
        # architecture and dip, then recover at the final one (DINOv2 ViT-S/14 probes at 0.6x: 92.0 -> 64.6 /
        # 63.2 / 77.3 / 89.1% over 4 epochs; bench/results/dcs_dip.json): those epochs are not judged. A
        # search stopped there stands off its target, so the user would get the magnitude baseline, which
        # on a pretrained model scores far below a finished search (digits: 98.5 -> 59.3% after epoch 1,
        # stopped; the baseline kept at 14.1%; bench/results/dcs_generalise_baseline_digits_guard2x.json).
        settling = target is not None and now is not None and (now > target * (1 + 1e-6) or not prev_at)
        rising = prev is not None and record["val_top1"] > prev["val_top1"]
        if settling or drop <= self.cfg.max_val_drop or rising:
            return
        head = (
            f"the gate search stopped after epoch {record['epoch']}: validation top-1 fell from "
            f"{start['val_top1']:.2f}% (the dense model) to {record['val_top1']:.2f}%, more than "
            f"{{max_val_drop}} {self.cfg.max_val_drop:g} points, and not rising"
        )
        go_on = "to let the gates go on instead, rerun the same command with {resume} {max_val_drop} 100"
        calib = record.get("calibration")
        if calib and abs(calib["ratio_before"] / self.cfg.target - 1) > 2 * self.cfg.tolerance:
            # the gates did not get near the target by themselves: the end-of-search threshold shift
            # did the pruning, blindly (one shift for every gate), which is what broke the model
            raise SearchCollapsed(
                f"{head}, after the end-of-search calibration had to move the {self.cfg.cost_name} ratio from "
                f"{calib['ratio_before']:.3f} to the target {self.cfg.target}",
                f"the search had too few architecture steps to get there itself: rerun the same command with "
                f"{{force}} {{epochs}} {2 * self.epochs}",
            )
        raise SearchCollapsed(head, go_on)

    def state_dict(self) -> dict[str, Any]:
        return {"lam": self.lam, "integral": None if self.steer is None else self.steer.integral}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lam = state.get("lam", self.lam)
        if self.steer is not None and state.get("integral") is not None:
            self.steer.integral = state["integral"]


class SearchCollapsed(SettingError):
    """A DCS search whose validation accuracy fell below ``max_val_drop``: ``head`` says what happened,
    ``advice`` what to run (the message is both; templates naming fields, a
    :class:`~nascompress.errors.SettingError`). With the baseline on (the default) the search ends
    with the better of the searched and the baseline model instead (:attr:`reason` is the reason it
    records); without it, the pipeline retries with a milder target and a study records the trial as
    failed, with this message."""

    def __init__(self, head: str, advice: str | None = None):
        super().__init__(head if advice is None else f"{head}; {advice}")
        self.head, self.advice = head, advice

    @property
    def reason(self) -> str:
        """What happened (``head``), its fields named as the config's (what a record keeps)."""
        return SettingError(self.head).worded()


class SearchOffTarget(SearchCollapsed):
    """A DCS search that ended so far from its FLOPs target that landing there would take an
    untrained cut larger than ``max_calibration`` (handled as a collapse: the pipeline retries
    milder, a study records the trial as failed)."""


__all__ = ["DCSSearchHooks", "SearchCollapsed", "SearchOffTarget"]
