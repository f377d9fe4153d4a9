"""Building one trial's model (:func:`build_trial`): the base run with the trial's method records
applied in order (a ``dcs`` entry searched or reused at the study's seed), then calibrated
(predictor-only stages) or fine-tuned with the last method's recipe, as the job says; and each
trial's seed (:func:`trial_seed`). Deterministic, so a study's trial can be rebuilt later."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..methods import get_method
from ..runtime import seed_everything
from .scoring import calibrate_stack
from .trial_context import TrialContext
from .trial_dcs import dcs_stage
from .. import runtime
from ..train.finetune import finetune_train_config, split_settings
from ..train.loop import fit


def trial_seed(seed: int, number: int) -> int:
    return seed * 100_003 + number


@dataclass(frozen=True)
class BuiltTrial:
    """One trial's model (:func:`build_trial`): the ``model`` (eval mode), the method records as
    applied (``applied``, arch.json's), what its stages did (``training``: by stage, a ``dcs`` entry's
    search, the calibration logs, a fine-tune; what the trial stores as its ``nascompress_training``
    user attr), the predictor-stage steps taken by method (``calib_steps``) and the seed of its DCS
    search (``dcs_seed``; None: no DCS search)."""

    model: nn.Module
    applied: list[dict[str, Any]]
    training: dict[str, Any]
    calib_steps: dict[str, int]
    dcs_seed: int | None = None


def build_trial(
    ctx: TrialContext,
    records: list[dict[str, Any]],
    *,
    seed: int,
    report: Any = None,
    budget: int | None | str = "job",
    dcs_seed: int | None = None,
) -> BuiltTrial:
    """The model of one trial: the base with ``records`` applied, calibrated or fine-tuned as the job says.

    Deterministic for the same (records, seed, dcs_seed) on the same machine, so a study's trial can be
    rebuilt later (``nascompress materialize --study``). ``dcs_seed``: the seed of a ``dcs`` entry's
    search (the study's seed; None: the trial's ``seed``, as studies made before it was recorded
    searched). ``report(epoch, val_top1)`` (optional) is
    called after each fine-tune epoch (a pruner's intermediate values). ``budget``: the steps of
    each predictor-only stage (:mod:`nascompress.studies.scoring`): ``"job"`` the study's
    ``calib_steps``, None each method's recipe count (trials of studies made before budgets were
    recorded).

    Returns:
        A :class:`BuiltTrial`: the model in eval mode, the method records as applied (arch.json),
        what the stages did, the predictor-stage steps taken by method and the DCS search's seed.
    """
    if budget == "job":
        budget = ctx.job.calib_steps
    seed_everything(seed)
    model = copy.deepcopy(ctx.base).requires_grad_(True)  # the shared base is frozen (it is the teacher)
    applied, info = [], {}
    searched_seed: int | None = None
    for rec in records:
        name, settings = rec["name"], dict(rec.get("config") or {})
        if name == "dcs" and (settings.get("target_flops") or 0.0) >= 1.0:  # 1.0: no channel cut, no search
            info["dcs"] = {"skipped": "target_flops 1.0: the channels stay (a token-only model)"}
            continue
        if name == "dcs":
            search_seed = seed if dcs_seed is None else dcs_seed
            model, record, reused = dcs_stage(ctx, settings, search_seed)
            applied.append(record)
            info["dcs"] = {"seed": search_seed, "reused": reused, "kept": getattr(model, "nc_dcs_kept", "dcs")}
            searched_seed = search_seed
            seed_everything(seed)  # the later stages start from the same state, searched or reused
            continue
        config, recipe = split_settings(name, settings)
        method = get_method(name)
        if ctx.job.finetune_epochs <= 0 and method.is_off(model, config):
            # compression off (EViT keeping every token): the trial is the model without it, so a picked
            # trial is labelled and built as what it is (the channel-only model of a stacked study). A
            # fine-tuned trial keeps it: the last method's recipe trains the stack
            info[name] = {"skipped": f"{name} at its off setting {method.off_config}: nothing to apply"}
            continue
        model, record = method.prepare_fresh(model, config, recipe or None)
        applied.append(record)
    model.to(ctx.device)
    if ctx.job.finetune_epochs > 0 and applied:
        info["finetune"], steps = _finetune_trial(ctx, model, applied, seed=seed, report=report, budget=budget)
    else:
        with (
            runtime.configured(ctx.device, deterministic=ctx.job.deterministic),
            runtime.autocast(ctx.device, ctx.job.amp),
        ):
            logs, steps = calibrate_stack(
                model,
                applied,
                teacher=ctx.base,
                batches=ctx.calibration_batches(),
                budget=budget,
                cycle_to=ctx.job.calib_steps,
            )
        info.update({f"calibration_{name}": out for name, out in logs.items()})
    return BuiltTrial(model.eval(), applied, info, steps, searched_seed)


def _finetune_trial(
    ctx: TrialContext, model: nn.Module, applied: list[dict[str, Any]], *, seed: int, report: Any, budget: int | None
) -> tuple[dict[str, Any], dict[str, int]]:
    """A short fine-tune with the recipe of the last method of the stack (every other method's
    predictor-only stage first, ``budget`` steps each): what it did (epochs, validation top-1,
    training time; kept in the trial's training info) and the predictor-stage steps by method."""
    _, steps = calibrate_stack(
        model,
        applied[:-1],
        teacher=ctx.base,
        batches=ctx.calibration_batches(),
        budget=budget,
        cycle_to=ctx.job.calib_steps,
    )
    steps[applied[-1]["name"]] = 0  # trained by the fine-tune itself
    last = applied[-1]["name"]
    epochs = max(1, round(ctx.job.finetune_epochs))
    cfg = finetune_train_config(
        last,
        epochs=epochs,
        batch_size=ctx.job.batch_size,
        seed=seed,
        device=ctx.job.device,
        amp=ctx.job.amp,
        deterministic=ctx.job.deterministic,
    ).replace(eval_start=False, keep="last")
    method = get_method(last)
    hooks = method.hooks(model, applied[-1], teacher=ctx.base, train_cfg=cfg)
    if report is not None:
        hooks = _Reporting(hooks, report)
    arch = ctx.arch.with_method(*applied)
    metrics = fit(model, data=ctx.data, input_spec=ctx.spec, cfg=cfg, arch=arch, hooks=hooks)  # in memory
    return {"epochs": epochs, "val_top1": metrics.best_val_top1, "train_time_s": metrics.train_time_s}, steps


class _Reporting:
    """Wraps a recipe's hooks: after each epoch, report validation top-1 (a pruner's input)."""

    def __init__(self, inner: Any, report: Any):
        self._inner, self._report = inner, report

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def check(self, record: dict[str, Any], start: dict[str, Any] | None) -> None:
        self._inner.check(record, start)
        self._report(record["epoch"], record["val_top1"])
