"""The ask/tell loop of a study worker (:func:`work`: ask a trial, run the objective, tell the result,
give back surplus trials, stop after ``max_failures`` failures in a row) and the entry point of a
spawned worker process (:func:`worker_main`). :func:`nascompress.studies.runner.run_study` runs the
loop in its own process or spawns workers that do."""

from __future__ import annotations

import random
import signal
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial, TrialState
import torch

from nascompress.errors import NascompressError, WriteError, storage_problem, write_error

from .liveness import ACTIVE, Heartbeat, Me, fail_stale_trials, let_go, stale_trials, take_over
from .records import ERROR_KEY, RETRIES_KEY, RETRY_OF_KEY, SURPLUS_KEY, WORKER_KEY
from .seeding import Seeding
from .storage_url import StorageSpec
from .storage_open import open_storage
from .workers import LoopConfig, WorkerArgs, WorkerMessage


# ----------------------------------------------------------------------------------------------
# The ask/tell loop


def _as_values(out: Any, n: int) -> list[float]:
    vals = list(out) if isinstance(out, (list, tuple)) else [out]
    if len(vals) != n:
        raise ValueError(f"the objective returned {len(vals)} value(s) for {n} objective(s)")
    return [float(v) for v in vals]


def _finish(
    study: optuna.Study,
    trial: optuna.Trial,
    *,
    values: list[float] | None = None,
    state: TrialState | None = None,
    error: str | None = None,
) -> bool:
    """Tell a trial's end; False if it had been finished meanwhile (another worker took it over
    as stale and told it first)."""
    try:
        if error is not None:
            trial.set_user_attr(ERROR_KEY, error[:1000])
        ft = study.tell(trial, values, state=state, skip_if_finished=True)
    except UpdateFinishedTrialError:
        return False
    return ft.state == (state or TrialState.COMPLETE)


def _surplus(study: optuna.Study, trial: optuna.Trial, n_trials: int) -> bool:
    """Did this trial start when ``n_trials`` others were already complete or running (a start race)?

    Read after the trial is in the storage (RUNNING, with its first beat), so every trial that
    reached the storage before it is seen here. Every other COMPLETE or RUNNING trial counts,
    whatever its number or start time (those order trials differently from the storage: a
    journal client stamps its trial's start before it gets the file's lock, an enqueued trial
    keeps its early number): of any n_trials + 1 trials that would run at once, the last to reach
    the storage sees the n others and is released. Two trials racing for one place may both be
    released; both workers then ask again (after a random pause) and one of them gets it.
    """
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
    if not any(t._trial_id == trial._trial_id for t in trials):
        return False
    return sum(1 for t in trials if t._trial_id != trial._trial_id) >= n_trials


def _release(study: optuna.Study, trial: optuna.Trial) -> None:
    storage = study._storage
    ft = storage.get_trial(trial._trial_id)
    storage.set_trial_system_attr(trial._trial_id, SURPLUS_KEY, True)
    study.tell(trial, state=TrialState.PRUNED)
    fixed = ft.system_attrs.get("fixed_params")
    if fixed:
        keep = {k: v for k, v in ft.user_attrs.items() if k in (RETRIES_KEY, RETRY_OF_KEY)}
        study.enqueue_trial(dict(fixed), user_attrs=keep or None)


CONTINUE = "then rerun the same command to continue the study"
_JITTER = random.Random()  # pauses after a released start only: never the samplers' streams


def storage_full(e: BaseException, spec: StorageSpec) -> WriteError | None:
    """One line for a study stopped by a full disk or an unwritable storage (None: another failure)."""
    return write_error(e, what=f"study storage {spec.display}", then=CONTINUE)


def _failure_stop(reasons: list[str]) -> NascompressError:
    """The error that ends a run after ``max_failures`` failed trials in a row, each with its reason."""
    listed = "; ".join(r if len(r) <= 300 else r[:297] + "..." for r in reasons)
    return NascompressError(
        f"{len(reasons)} trials in a row failed ({listed}). Fix the cause and rerun the same "
        "command to continue the study"
    )


def work(
    study: optuna.Study,
    objective: Callable[[optuna.Trial], Any],
    cfg: LoopConfig,
    seeding: Seeding,
    on_update: Callable[[Sequence[FrozenTrial]], None] | None = None,
) -> int:
    """One worker's loop: take over a stale trial, or ask a new one; run it; tell it. Returns the
    number of trials it ran to an end."""
    me = Me.now()
    n_obj = len(study.directions)
    poll = min(1.0, cfg.heartbeat_interval)
    ran = 0
    reasons: list[str] = []  # the failures in a row, with their reasons
    while True:
        if cfg.deadline is not None and time.time() >= cfg.deadline:
            return ran
        trials = study.get_trials(deepcopy=False)
        if fail_stale_trials(study, grace_period=cfg.grace_period, max_retries=cfg.max_retries, trials=trials):
            trials = study.get_trials(deepcopy=False)
        complete = sum(t.state == TrialState.COMPLETE for t in trials)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        if on_update is not None:
            on_update(trials)
        if complete >= cfg.n_trials:
            return ran
        stale = stale_trials(study, grace_period=cfg.grace_period, trials=trials)
        stale_numbers = {t.number for t in stale}
        # A RUNNING trial without a first beat was asked a moment ago, or its worker died between
        # ask and that beat (a kill -9 there). Asking a new trial meanwhile would draw the killed
        # trial's parameters (the sampler's seed counts the trials told) under the next number, so
        # wait until it beats or, once stale (grace_period), is taken over in its own place.
        unbeaten = any(
            t.state == TrialState.RUNNING and WORKER_KEY not in t.system_attrs and t.number not in stale_numbers
            for t in trials
        )
        trial = None
        if stale and take_over(study, stale[0], me):  # a killed trial first, in its own place
            seeding.reseed(study, trials)
            study._thread_local.cached_all_trials = None  # as Study.ask does: read the trials afresh
            trial = optuna.Trial(study, stale[0]._trial_id)
        elif stale or unbeaten or complete + running >= cfg.n_trials:  # the rest run elsewhere (or were just claimed)
            time.sleep(poll)
            continue
        if trial is None:
            seeding.reseed(study, trials)
            trial = study.ask()
        key = (study.study_name, trial._trial_id)
        ACTIVE.add(key)
        try:
            heartbeat = Heartbeat(study, trial._trial_id, cfg.heartbeat_interval, me)
            heartbeat.beat()  # claim it at once, so no other worker ever sees it without an owner
            if trial.number not in stale_numbers and _surplus(study, trial, cfg.n_trials):
                _release(study, trial)
                time.sleep(poll * (0.5 + _JITTER.random()))  # workers that raced do not meet again in step
                continue
            try:
                with heartbeat:
                    values = _as_values(objective(trial), n_obj)
            except optuna.TrialPruned:
                _finish(study, trial, state=TrialState.PRUNED)
            except KeyboardInterrupt:  # released: the next run takes it over at once, in its place
                let_go(study, trial, me)
                raise
            except UpdateFinishedTrialError:
                pass  # failed as stale by another worker meanwhile: its retry runs the configuration again
            except Exception as e:  # the trial fails with its reason; the study goes on (see _failure_stop)
                if isinstance(e, WriteError) or storage_problem(e) is not None:
                    # a full disk or an unwritable storage is no fault of the trial: stop now; the rerun
                    # (once there is room) takes the trial over in its place
                    try:
                        let_go(study, trial, me)
                    except Exception:  # noqa: BLE001 (the storage may refuse this write too: the trial then
                        pass  # counts as dead by its pid, with the same effect)
                    raise
                reason = str(e) if isinstance(e, NascompressError) else f"{type(e).__name__}: {e}"
                _finish(study, trial, state=TrialState.FAIL, error=reason)
                reasons.append(f"trial {trial.number}: {reason}")
                if len(reasons) >= cfg.max_failures:
                    raise _failure_stop(reasons) from e
            else:
                if _finish(study, trial, values=values):
                    reasons = []
            ran += 1
        finally:
            ACTIVE.discard(key)


@contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna's per-trial INFO logs and experimental warnings off (our progress replaces them)."""
    old = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            warnings.filterwarnings("ignore", message=".*enqueue.*")
            yield
    finally:
        optuna.logging.set_verbosity(old)


# ----------------------------------------------------------------------------------------------
# A worker process (spawned by :func:`nascompress.studies.workers._run_workers`)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def worker_main(args: WorkerArgs, results: Any) -> None:
    """Entry point of a spawned worker process; puts its
    :class:`~nascompress.studies.workers.WorkerMessage` on ``results`` as it ends."""
    signal.signal(signal.SIGTERM, _interrupt)
    ran: int | None = None
    error: str | None = None
    trace: str | None = None
    interrupted = False
    code = 0
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with quiet_optuna():
            storage = open_storage(args.spec, create=False)
            seeding = Seeding(args.sampler_factory, args.seed, args.index)
            study = optuna.load_study(
                study_name=args.study_name, storage=storage, sampler=args.sampler_factory(args.seed)
            )
            objective = args.objective_factory()
            ran = work(study, objective, args.loop, seeding)
    except KeyboardInterrupt:
        interrupted = True
        code = 130
    except NascompressError as e:
        error = str(e)
        code = 1
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which prints one line)
        full = storage_full(e, args.spec) if isinstance(e, Exception) else None
        error = str(full) if full is not None else f"{type(e).__name__}: {e}"
        if full is None:
            trace = traceback.format_exc()
        code = 1
    results.put(WorkerMessage(args.index, ran=ran, error=error, traceback=trace, interrupted=interrupted))
    results.close()
    results.join_thread()
    sys.exit(code)
