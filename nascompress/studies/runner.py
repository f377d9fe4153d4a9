"""Run an Optuna study to a number of complete trials: resumable, crash-safe, several workers.

:func:`run_study` is method-independent: the caller gives an ``objective_factory`` (a picklable
top-level callable returning ``objective(trial) -> value(s)``) and a ``sampler_factory(seed)``.

How it behaves, on every storage (SQLite, journal file, PostgreSQL):

- Resume gives the same result: before every trial a worker rebuilds its sampler with
  ``sampler_factory(sampler_seed(seed, told, worker))``, ``told`` being the number of trials
  already finished. The sampler's state is so a function of the seed and the trials told (TPE
  and NSGA-II read only finished and running trials, and their random streams start from that
  seed), never of when the process started; and a trial killed mid-run is run again in its own
  place (below). A one-worker study killed with kill -9 and rerun with the same command so
  proposes, trains and tells exactly the trials an uninterrupted run does. Several workers share
  the study without duplicates (each its own stream), in an order that depends on timing.
- The search space is fixed per study: ``space_info["space_hash"]`` is stored in the study and
  a run with a different one is refused, naming both spaces and where they differ. So is the
  sampler where ``space_info`` names it (``sampler``): the study records which one proposed its trials,
  and the settings every trial is scored with where it names them (``scoring``, a dict of option
  values such as the calibration budget and the validation subset: a run with another value is refused).
- Termination: the study ends with ``n_trials`` COMPLETE trials in total, across workers and
  restarts. Each worker starts a trial only while COMPLETE + RUNNING < ``n_trials`` (otherwise
  it waits for the running ones); a trial that, once in the storage, sees ``n_trials`` other
  trials complete or running raced past the limit and is released unrun (state PRUNED, system
  attr ``nascompress:surplus``, its enqueued params re-enqueued; see :func:`_surplus`), so no
  more than ``n_trials`` ever complete. Optuna's ``MaxTrialsCallback(states=(COMPLETE,))`` stops
  the same way, but only after the trial that overshoots.
- Fixed configurations (``enqueue``) are enqueued once, by the process that created the study,
  before any worker starts.
- Crash safety: every RUNNING trial carries ``system_attrs["nascompress:worker"] = {host, pid,
  pid_start, beat}``, refreshed every ``heartbeat_interval`` s by a background thread. At every
  (re)start and before every trial, a RUNNING trial whose worker is gone (same host and the
  process is dead or a zombie: at once; otherwise when the last beat is older than
  ``grace_period``; a trial interrupted by Ctrl-C: at once) is taken over in place: the worker
  claims it (writes itself as its owner, reads it back), and runs the objective on that same
  trial (same number, so the same training seed, and the params it had already drawn; a param
  not drawn yet is drawn with the sampler rebuilt as at its first start). User attr
  ``nascompress_retries`` counts the take-overs of a trial whose worker died; after
  ``max_retries`` of them (a configuration that kills its process) the trial is marked FAIL.
  Two workers that claim the same trial at the same moment both run it; the first tell wins
  (the objective is deterministic). Finished trials are never touched. Studies written before
  this rule may hold FAIL trials with a re-enqueued copy (``nascompress_retry_of``). Optuna's own RDB heartbeat is not used: it works only inside
  ``study.optimize`` and on RDB storages (the journal has none), while this loop asks and tells
  itself; one mechanism keeps the behaviour identical on all three storages.
- Objective errors: the trial is FAIL with its reason in ``user_attrs["nascompress_error"]`` (shown
  in the progress) and is not retried; the study goes on with the next trial (a DCS search that
  collapses in one trial costs that trial only). ``max_failures`` failed trials in a row (per
  worker) stop the run with one error listing each one's reason.
- ``workers > 1``: that many processes (multiprocessing 'spawn') share the study; each builds
  its objective once. Several machines share a PostgreSQL study by running the same command
  (``workers=1`` each). Storage choice: see :mod:`nascompress.studies.storage`.
- Progress: a rich live view on stderr (complete / requested, running, failed, Pareto front
  size, best accuracy per FLOPs-ratio bucket, mean time per trial), or with ``json_progress``
  one JSON line per finished trial on stdout and nothing else.

Trial record (:func:`record_trial`): ``trial.user_attrs["nascompress"]`` holds ``arch``,
``params_changed``, ``flops``, ``flops_ratio``, ``params``, ``accuracy``, ``latency_ms``,
``throughput``, ``wall_s``, ``seed``. Study record (:func:`study_info`):
``study.user_attrs["nascompress"]`` holds ``space``, ``space_hash``, ``base_run``,
``objectives``, ``dataset``, ``created``, ``command``, ``seed``.

This module is the ask/tell loop and the entry points; the rest lives beside it:
:mod:`.records` (trial and study records, the Pareto front), :mod:`.seeding` (sampler seeding),
:mod:`.liveness` (heartbeats, stale trials), :mod:`.display` (progress) and :mod:`.workers`
(spawning worker processes).
"""

from __future__ import annotations

import datetime as _dt
import pickle
import random
import signal
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState
import torch

from nascompress.limits import check_limited
from nascompress.errors import (
    NascompressError,
    SettingError,
    WriteError,
    literal,
    storage_problem,
    write_error,
    writing,
)

from .display import Display
from .liveness import ACTIVE, Heartbeat, Me, fail_stale_trials, let_go, stale_trials, take_over
from .opening import open_study
from .records import ERROR_KEY, RETRIES_KEY, RETRY_OF_KEY, SURPLUS_KEY, WORKER_KEY, pareto_front
from .seeding import Seeding, default_sampler
from .storage import StorageSpec, open_storage, resolve_run_storage
from .workers import LoopConfig, WorkerArgs, run_workers

# Defined here before the split, still importable from here:
from .display import FLOPS_BUCKETS  # noqa: F401
from .records import FAIL_REASON_KEY, RECORD_FIELDS, RECORD_KEY, record_trial, study_info, trial_record  # noqa: F401
from .seeding import ParamSeeded, sampler_seed  # noqa: F401


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


_CONTINUE = "then rerun the same command to continue the study"
_JITTER = random.Random()  # pauses after a released start only: never the samplers' streams


def storage_full(e: BaseException, spec: StorageSpec) -> WriteError | None:
    """One line for a study stopped by a full disk or an unwritable storage (None: another failure)."""
    return write_error(e, what=f"study storage {spec.display}", then=_CONTINUE)


def _failure_stop(reasons: list[str]) -> NascompressError:
    """The error that ends a run after ``max_failures`` failed trials in a row, each with its reason."""
    listed = "; ".join(r if len(r) <= 300 else r[:297] + "..." for r in reasons)
    return NascompressError(
        f"{len(reasons)} trials in a row failed ({listed}). Fix the cause and rerun the same "
        "command to continue the study"
    )


def _work(
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
def _quiet_optuna() -> Iterator[None]:
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


def _worker_main(args: WorkerArgs, results: Any) -> None:
    """Entry point of a spawned worker process."""
    signal.signal(signal.SIGTERM, _interrupt)
    msg: dict[str, Any] = {"worker": args.index}
    code = 0
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        with _quiet_optuna():
            storage = open_storage(args.spec, create=False)
            seeding = Seeding(args.sampler_factory, args.seed, args.index)
            study = optuna.load_study(
                study_name=args.study_name, storage=storage, sampler=args.sampler_factory(args.seed)
            )
            objective = args.objective_factory()
            msg["ran"] = _work(study, objective, args.loop, seeding)
    except KeyboardInterrupt:
        msg["interrupted"] = True
        code = 130
    except NascompressError as e:
        msg["error"] = str(e)
        code = 1
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which prints one line)
        full = storage_full(e, args.spec) if isinstance(e, Exception) else None
        msg["error"] = str(full) if full is not None else f"{type(e).__name__}: {e}"
        if full is None:
            msg["traceback"] = traceback.format_exc()
        code = 1
    results.put(msg)
    results.close()
    results.join_thread()
    sys.exit(code)


# ----------------------------------------------------------------------------------------------
# The entry point


def run_study(
    *,
    study_name: str,
    storage: str | None,
    objective_factory: Callable[[], Callable[[optuna.Trial], Any]],
    n_trials: int,
    directions: Sequence[str],
    metric_names: Sequence[str],
    space_info: Mapping[str, Any],
    sampler_factory: Callable[[int], BaseSampler] | None = None,
    seed: int = 0,
    workers: int = 1,
    enqueue: Sequence[Mapping[str, Any]] = (),
    timeout: float | None = None,
    heartbeat_interval: float = 30.0,
    grace_period: float | None = None,
    progress: bool = True,
    json_progress: bool = False,
    max_retries: int = 2,
    max_failures: int = 3,
) -> dict[str, Any]:
    """Create or continue a study and run it until it has ``n_trials`` COMPLETE trials.

    Args:
        study_name: the study; an existing one is continued.
        storage: a ``--storage`` value, or None for the project's default files
            (see :mod:`nascompress.studies.storage`).
        objective_factory: picklable top-level callable; ``objective_factory()`` returns
            ``objective(trial) -> float | list[float]`` (called once per worker process).
        n_trials: COMPLETE trials the study should have in total.
        directions: ``"maximize"`` / ``"minimize"`` per objective.
        metric_names: a name per objective (``study.set_metric_names``).
        space_info: stored as ``study.user_attrs["nascompress"]``; must hold ``space_hash``
            (and should hold ``space``, ``base_run``, ``dataset``, ``command``).
        sampler_factory: picklable ``seed -> sampler`` (default :func:`default_sampler`).
        seed: the study's seed (see :func:`sampler_seed`).
        workers: worker processes on this machine.
        enqueue: Optuna params of fixed configurations to run first (new studies only).
        timeout: start no new trial after this many seconds.
        heartbeat_interval: seconds between a running trial's heartbeats.
        grace_period: seconds without a beat before another host's trial counts as dead
            (default 3 x heartbeat_interval).
        progress: show live progress on stderr.
        json_progress: print one JSON line per finished trial on stdout instead.
        max_retries: how often a trial whose worker died mid-run is taken over and run again.
        max_failures: objective failures in a row (per worker) that stop the run.

    Returns:
        ``{"study", "storage" (masked), "n_trials", "complete", "counts" (by state), "front"
        ([{"number", "values", "params"}]), "wall_s", "workers", "created", "stale_failed"
        (failed for good), "stale_resumed" (trials of a killed run, run again in place), "finished"}``.
    """
    t0 = time.time()
    if not isinstance(n_trials, int) or n_trials < 1:
        raise NascompressError(f"n_trials must be an integer >= 1, got {n_trials!r}")
    check_limited("n_trials", n_trials, "max_trials")
    if not isinstance(workers, int) or workers < 1:
        raise NascompressError(f"workers must be an integer >= 1, got {workers!r}")
    directions = [str(d).lower() for d in directions]
    if not directions or any(d not in ("maximize", "minimize") for d in directions):
        raise NascompressError(f"directions must be 'maximize' or 'minimize' each, got {directions}")
    if len(metric_names) != len(directions):
        raise NascompressError(f"{len(metric_names)} metric names for {len(directions)} directions")
    if not isinstance(space_info.get("space_hash"), str):
        raise NascompressError("space_info needs space_hash (Space.hash()) so a resumed study can check its space")
    if heartbeat_interval <= 0:
        raise NascompressError(f"heartbeat_interval must be > 0, got {heartbeat_interval}")
    grace = float(grace_period) if grace_period is not None else 3.0 * heartbeat_interval
    sampler_factory = sampler_factory or default_sampler
    if workers > 1:
        for what, obj in (("objective_factory", objective_factory), ("sampler_factory", sampler_factory)):
            try:
                pickle.dumps(obj)
            except Exception as e:
                raise NascompressError(
                    f"{what} must be picklable (a top-level function or functools.partial of "
                    f"one) to run {workers} worker processes: {e}"
                ) from None
    spec = resolve_run_storage(storage, study_name=study_name, workers=workers)
    info = {
        **dict(space_info),
        "objectives": list(metric_names),
        "seed": int(seed),
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    info.setdefault("command", " ".join(sys.argv))
    loop = LoopConfig(
        n_trials=n_trials,
        deadline=t0 + timeout if timeout is not None else None,
        heartbeat_interval=float(heartbeat_interval),
        grace_period=grace,
        max_retries=max_retries,
        max_failures=max_failures,
    )
    with _quiet_optuna(), writing(spec.display, what=f"study storage {spec.display}", then=_CONTINUE):
        study, created = open_study(
            spec, study_name=study_name, directions=directions, metric_names=metric_names, info=info, enqueue=enqueue
        )
        stale = fail_stale_trials(study, grace_period=grace, max_retries=max_retries)
        resumed = [t.number for t in stale_trials(study, grace_period=grace)]
        trials = study.get_trials(deepcopy=False)
        finished_before = {t.number for t in trials if t.state.is_finished()}
        display = Display(
            study_name=study_name,
            n_trials=n_trials,
            directions=directions,
            metric_names=metric_names,
            rich=progress,
            json_lines=json_progress,
            finished_before=finished_before,
        )
        worker_msgs: list[dict[str, Any]] = []
        with display:
            display.update(trials)
            done = sum(t.state == TrialState.COMPLETE for t in trials) >= n_trials
            if done:
                pass
            elif workers == 1:
                seeding = Seeding(sampler_factory, int(seed))
                wstudy = optuna.load_study(
                    study_name=study_name, storage=study._storage, sampler=sampler_factory(int(seed))
                )
                objective = objective_factory()
                _work(wstudy, objective, loop, seeding, on_update=display.update)
                display.update(study.get_trials(deepcopy=False))
            else:
                # the workers share this machine's cores: N workers with torch's default thread count
                # each oversubscribe them (measured: 2 workers on 2 cores ran half as many trials a
                # minute as one)
                threads = max(1, torch.get_num_threads() // workers)
                args = [
                    WorkerArgs(k, spec, study_name, objective_factory, sampler_factory, int(seed), loop, threads)
                    for k in range(workers)
                ]
                worker_msgs = run_workers(args, study, display, target=_worker_main)
        trials = study.get_trials(deepcopy=False)
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    complete = counts.get("COMPLETE", 0)
    errors = [m for m in worker_msgs if m.get("error")]
    timed_out = loop.deadline is not None and time.time() >= loop.deadline
    if complete < n_trials and errors and not timed_out:
        first = errors[0]
        hint = " (rerun with {workers} 1 {debug} for the traceback)" if first.get("traceback") else ""
        raise SettingError(
            f"worker {first['worker']} failed: {literal(first['error'])}{hint}; the study has "
            f"{complete} of {n_trials} complete trials: rerun the same command to continue it"
        )
    front = pareto_front(trials, directions)
    return {
        "study": study_name,
        "storage": spec.display,
        "n_trials": n_trials,
        "complete": complete,
        "counts": counts,
        "metric_names": list(metric_names),
        "directions": directions,
        "front": [{"number": t.number, "values": list(t.values), "params": dict(t.params)} for t in front],
        "wall_s": round(time.time() - t0, 3),
        "workers": workers,
        "created": created,
        "stale_failed": stale,
        "stale_resumed": resumed,
        "finished": complete >= n_trials,
        "worker_errors": [{"worker": m["worker"], "error": m["error"]} for m in errors],
    }
