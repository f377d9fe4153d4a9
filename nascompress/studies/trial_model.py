"""``nascompress materialize --study``: a study's trial (picked by number or by a rule) -> a model run.

Rebuilds the trial's model from its base run and its recorded parameters (the search's own trial
builder, :mod:`nascompress.studies.trials`), fine-tunes it as the trial did, and writes the run.
DCS materialization of a finished channel search is :mod:`nascompress.dcs_search.materialize`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn
from optuna.trial import TrialState

from ..config import Config, check_settings, setting
from ..limits import MAX_EPOCHS
from ..errors import NascompressError, SettingError
from ..runs.io import save_model
from ..runs.run_dir import RunDir
from ..runs.files import Arch, RunMetrics
from ..runs.records import TypedRecord
from ..runs.out_dir import refuse_overwriting_inputs
from .trial_build import build_trial
from .trials import FINETUNE_EPOCHS_HELP, STORAGE_HELP, SearchJob
from .trial_context import TrialContext
from ..runs.run_config import run_data_config
from ..data import load_data
from ..train.finetune import finetune_train_config
from ..methods import get_method
from .inspect import load as load_study
from .records import TrialScoring, pareto_front, study_info, trial_record
from ..train.loop import fit
from ..train.metrics import TrainMetrics
from .trial_context import base_fingerprint

PICK_RULES = ("best-under-flops", "best-under-latency", "knee")


@dataclass(frozen=True)
class TrialMaterializeJob(Config):
    """``nascompress materialize --study NAME (--trial N | --pick RULE) --out DIR``.

    Args:
        study: the study (``nascompress search tokens|joint``).
        out: the run directory to create.
        trial: a COMPLETE trial's number, or
        pick: ``best-under-flops=R`` (the most accurate feasible trial with FLOPs ratio <= R),
            ``best-under-latency=MS`` (with recorded latency <= MS) or ``knee`` (the front's knee).
        storage: where the study lives (default: the project's files).
        finetune_epochs: then fine-tune the rebuilt model with its last method's recipe (0: none).
    """

    study: str = setting(help="A study of 'search tokens|joint': rebuild one of its trials.")
    out: str
    trial: int | None = setting(None, lo=0, help="With --study: the trial number.")
    pick: str | None = setting(None, help="With --study: best-under-flops=R, best-under-latency=MS or knee.")
    storage: str | None = setting(None, help=STORAGE_HELP)
    finetune_epochs: int = setting(0, lo=0, hi=MAX_EPOCHS, help=f"With --study: {FINETUNE_EPOCHS_HELP}")

    def __post_init__(self) -> None:
        check_settings(self)
        if (self.trial is None) == (self.pick is None):
            raise SettingError(
                "give either {trial} N or {pick} RULE (best-under-flops=0.6, best-under-latency=MS or knee)"
            )
        if self.pick is not None:
            parse_pick(self.pick)


@dataclass(frozen=True, kw_only=True)
class TrialMetrics(TypedRecord, RunMetrics):
    """A rebuilt trial's metrics (:func:`materialize_trial`, the run's ``metrics.json``): the trial, the
    accuracy the study recorded and the rebuilt model's (the same), its FLOPs ratio (``flops_ratio``)
    and parameter count, and with ``finetune_epochs`` the fine-tune's metrics (``finetune``)."""

    NEW_SOURCE = "the rebuilt trial's {name}"

    trial: int
    trial_accuracy: float | None = None
    rebuilt_accuracy: float | None = None
    params: int | None = None
    finetune: TrainMetrics | None = None


def build_job(
    study: str,
    out: str | Path,
    *,
    trial: int | None = None,
    pick: str | None = None,
    storage: str | None = None,
    finetune_epochs: int = 0,
) -> TrialMaterializeJob:
    """The job that rebuilds a study's trial: of ``nascompress materialize --study``, of a pipeline's
    ``stages.tokens`` (its pick) and of ``nc.study`` (the one place it is built); the arguments are
    :class:`TrialMaterializeJob`'s (checked there: a ``trial`` or a ``pick`` rule)."""
    return TrialMaterializeJob(
        study=study, out=str(out), trial=trial, pick=pick, storage=storage, finetune_epochs=finetune_epochs
    )


def parse_pick(text: str) -> tuple[str, float | None]:
    rule, _, value = text.partition("=")
    if rule not in PICK_RULES:
        raise SettingError(
            f"{{pick}} {text!r}: the rule must be one of best-under-flops=R, best-under-latency=MS, knee"
        )
    if rule == "knee":
        if value:
            raise SettingError("{pick} knee takes no value")
        return rule, None
    try:
        v = float(value)
    except ValueError:
        raise SettingError(f"{{pick}} {text!r}: {rule} needs a number, e.g. {rule}=0.6") from None
    if v <= 0:
        raise SettingError(f"{{pick}} {text!r}: the bound must be positive")
    return rule, v


def knee(points: list[tuple[Any, float, float]]) -> Any:
    """The knee of a 2-D front of (item, accuracy (higher is better), cost (lower is better)): the
    point farthest from the line through the front's two extremes, in normalized coordinates."""
    if len(points) <= 2:
        return max(points, key=lambda p: p[1])[0]
    accs, costs = [p[1] for p in points], [p[2] for p in points]
    a_lo, a_hi, c_lo, c_hi = min(accs), max(accs), min(costs), max(costs)
    norm = [(p[0], (p[1] - a_lo) / ((a_hi - a_lo) or 1), (p[2] - c_lo) / ((c_hi - c_lo) or 1)) for p in points]
    norm.sort(key=lambda p: p[2])
    (_, a0, c0), (_, a1, c1) = norm[0], norm[-1]
    den = ((a1 - a0) ** 2 + (c1 - c0) ** 2) ** 0.5 or 1.0
    return max(norm, key=lambda p: abs((a1 - a0) * (c0 - p[2]) - (a0 - p[1]) * (c1 - c0)) / den)[0]


def pick_trial(study: Any, rule: str, value: float | None) -> Any:
    """The COMPLETE trial a pick rule selects; a rule no trial satisfies names the closest one."""
    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    if not done:
        raise NascompressError(f"study {study.study_name!r} has no complete trial yet; run the search first")
    recs = {t.number: trial_record(t) for t in done}
    if rule == "knee":
        if len(study.directions) < 2:
            raise SettingError(
                "{pick} knee needs a two-objective study; this one is single-objective: use {pick} best-under-flops=R"
            )
        front = pareto_front(done, study.directions)
        sign = 1 if study.directions[1].name.lower() == "minimize" else -1
        return knee([(t, t.values[0], sign * t.values[1]) for t in front])
    key = "flops_ratio" if rule == "best-under-flops" else "latency_ms"
    cost = {n: getattr(r, key) for n, r in recs.items()}  # the FLOPs ratio or the latency the rule bounds
    have = [t for t in done if cost[t.number] is not None]
    if not have:
        raise SettingError(
            f"no trial of study {study.study_name!r} recorded {key.replace('_', ' ')}; "
            "search with {objective} latency (or {max_latency}) to pick by latency"
        )
    ok = [t for t in have if cost[t.number] <= value]
    if not ok:
        closest = min(have, key=lambda t: cost[t.number])
        unit = "x" if key == "flops_ratio" else " ms"
        acc = recs[closest.number].accuracy
        raise NascompressError(
            f"no complete trial has {key.replace('_', ' ')} <= {value:g}; the closest is trial "
            f"{closest.number} at {cost[closest.number]:.3f}{unit} "
            f"({float('nan') if acc is None else acc:.2f}%)"
        )
    return max(ok, key=lambda t: (_or(recs[t.number].accuracy, -1.0), -t.number))


def _or(v: Any, default: Any) -> Any:
    return default if v is None else v


def materialize_trial(job: TrialMaterializeJob, *, force: bool = False) -> TrialMetrics:
    """Rebuild a study trial's model on the study's base run (as the trial built it: same
    configuration, seed, predictor stage or fine-tune), check that it reproduces the trial's
    recorded accuracy, optionally fine-tune it, and save a run directory; returns its metrics
    (:class:`TrialMetrics`). Nothing is written before everything has been checked and built."""
    out = Path(job.out)
    run = RunDir.prepare(out, force=force)
    spec, study = load_study(job.study, job.storage)
    info = study_info(study)
    if info is None or info.job is None:
        raise NascompressError(
            f"study {job.study!r} was not made by `nascompress search tokens|joint` (it holds no "
            "search job to rebuild trials from)"
        )
    if job.trial is not None:
        trials = [t for t in study.get_trials(deepcopy=False) if t.number == job.trial]
        if not trials:
            raise NascompressError(f"study {job.study!r} has no trial {job.trial} (trials 0..{len(study.trials) - 1})")
        trial = trials[0]
        if trial.state != TrialState.COMPLETE:
            raise NascompressError(
                f"trial {job.trial} of study {job.study!r} is {trial.state.name}, not COMPLETE; "
                "pick a complete trial (`nascompress study show` lists them)"
            )
    else:
        trial = pick_trial(study, *parse_pick(job.pick))
    rec = trial_record(trial)
    search = SearchJob.from_record(info.job)
    recorded = info.base_fingerprint
    if recorded is not None and Path(search.base).exists() and base_fingerprint(search.base) != recorded:
        raise NascompressError(
            f"the base run {search.base} of study {job.study!r} is not the model the study was "
            f"made on (its weights' sha256 {base_fingerprint(search.base)[:12]}, recorded "
            f"{recorded[:12]}): it was replaced since; put the original model back there, or run "
            "a new study on this one"
        )
    refuse_overwriting_inputs(out, (search.base, spec.path))  # the study's base run and its file
    ctx = TrialContext(search)
    records = ctx.space.records(trial.params)
    # as the trial was scored: its recorded calibration budget (none recorded: the methods' recipe
    # counts, how studies scored trials before budgets were recorded)
    scoring = rec.scoring or TrialScoring()
    built = build_trial(ctx, records, seed=int(rec.seed), budget=scoring.calib_budget, dcs_seed=scoring.dcs_seed)
    model, applied = built.model, built.applied
    acc = ctx.accuracy(model)
    if abs(acc - rec.accuracy) > 1e-6:
        raise NascompressError(
            f"the rebuilt trial {trial.number} scores {acc:.3f}% but the study recorded "
            f"{rec.accuracy:.3f}%: it was made on another machine or torch build, where "
            "training is not bit-identical; rerun the search here or fine-tune the result"
        )
    arch = ctx.arch.with_method(*applied).without("retrain")

    data = run_data_config(search.base) or ctx.data_cfg
    provenance = {
        "study": job.study,
        "storage": spec.display,
        "trial": trial.number,
        "params": dict(trial.params),
        "seed": rec.seed,
        "search": dict(info.job),
    }
    run.create(
        {
            "materialize": job.to_dict(),
            "from_study": provenance,
            "data": data.__dict__ if hasattr(data, "__dict__") else data,
        }
    )
    fine: dict[str, TrainMetrics] = {}
    if job.finetune_epochs > 0:
        fine["finetune"] = _finetune_rebuilt(ctx, model, applied, arch, out, job.finetune_epochs, int(rec.seed), data)
    else:
        save_model(out, model, arch)
    metrics = TrialMetrics.new(
        trial=trial.number,
        trial_accuracy=rec.accuracy,
        rebuilt_accuracy=acc,
        flops_ratio=rec.flops_ratio,
        params=rec.params,
        **fine,
    )
    return run.finish(metrics)  # the last write: marks the run complete


def _finetune_rebuilt(
    ctx: Any,
    model: nn.Module,
    applied: list[dict[str, Any]],
    arch: Arch,
    out: Path,
    epochs: int,
    seed: int,
    data_cfg: Any,
) -> TrainMetrics:
    """Fine-tune the rebuilt model with its last method's recipe into ``out`` (the start kept if best)."""
    last = applied[-1]["name"]
    cfg = finetune_train_config(last, epochs=epochs, seed=seed, device=ctx.job.device)
    hooks = get_method(last).hooks(model, applied[-1], teacher=ctx.base, train_cfg=cfg)
    data = load_data(data_cfg, spec=ctx.spec)
    return fit(model, data=data, input_spec=ctx.spec, cfg=cfg, out_dir=out, arch=arch, hooks=hooks, finish=False)


__all__ = ["TrialMaterializeJob", "TrialMetrics", "build_job", "materialize_trial", "pick_trial", "parse_pick", "knee"]
