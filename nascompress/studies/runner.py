"""Run an Optuna study to a number of complete trials: resumable, crash-safe, several workers.

:func:`run_study` is method-independent: the caller gives an ``objective_factory`` (a picklable
top-level callable returning ``objective(trial) -> value(s)``) and a ``sampler_factory(seed)``.

How it behaves, on every storage (SQLite, journal file, PostgreSQL):

- Resume gives the same result: before every trial a worker rebuilds its sampler with
  ``sampler_factory(sampler_seed(seed, told, worker, ahead))``, ``told`` being the number of
  trials already finished and ``ahead`` the unfinished trials numbered before its own (0 when one
  worker runs the study). The sampler's state is so a function of the seed and the trials told (TPE
  and NSGA-II read only finished and running trials, and their random streams start from that
  seed), never of when the process started; and a trial killed mid-run is run again in its own
  place (below). A one-worker study killed with kill -9 and rerun with the same command so
  proposes, trains and tells exactly the trials an uninterrupted run does. Several workers share
  the study without duplicates (each its own stream, also across separate runs whose workers share
  an index), in an order that depends on timing.
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
  this rule may hold FAIL trials with a re-enqueued copy (``nascompress_retry_of``). Optuna's own RDB
  heartbeat is not used: it works only inside
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

This module is the entry point; the rest lives beside it: :mod:`.loop` (the ask/tell loop and a
worker process's entry point), :mod:`.records` (trial and study records, the Pareto front),
:mod:`.seeding` (sampler seeding), :mod:`.liveness` (heartbeats, stale trials), :mod:`.display`
(progress) and :mod:`.workers` (spawning worker processes).
"""

from __future__ import annotations

import datetime as _dt
import os
import pickle
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import optuna
from optuna.samplers import BaseSampler
from optuna.trial import TrialState
import torch

from nascompress.limits import check_limited
from nascompress.errors import NascompressError, SettingError, literal, words, writing
from nascompress.progress import console

from .display import Display
from .liveness import fail_stale_trials, stale_trials
from .opening import open_study
from .records import StudyInfo, pareto_front
from .results import FrontTrial, StudyRun, WorkerError
from .seeding import Seeding, default_sampler
from .storage import resolve_run_storage
from .loop import CONTINUE, quiet_optuna, work, worker_main
from .workers import LoopConfig, WorkerArgs, WorkerMessage, run_workers

# Defined here before the split, still importable from here:
from .loop import storage_full  # noqa: F401
from .display import FLOPS_BUCKETS  # noqa: F401
from .records import FAIL_REASON_KEY, RECORD_FIELDS, RECORD_KEY, record_trial, study_info, trial_record  # noqa: F401
from .records import ERROR_KEY, RETRIES_KEY, RETRY_OF_KEY, SURPLUS_KEY, WORKER_KEY  # noqa: F401
from .seeding import ParamSeeded, sampler_seed  # noqa: F401


# ----------------------------------------------------------------------------------------------
# The entry point


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity; else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def cap_workers(workers: int, n_trials: int) -> tuple[int, str | None]:
    """``workers`` capped at the trials asked for and at the usable cores (each worker process loads
    the model and the data: more workers than trials only wait, more than cores only share them),
    with a one-line note saying so (None when nothing was capped)."""
    cores = usable_cores()
    n = min(workers, n_trials, cores)
    if n == workers:
        return workers, None
    why = (
        f"the study asks for {_count(n_trials, 'trial')}"
        if n == n_trials
        else f"this machine has {_count(cores, 'usable CPU core')}"
    )
    return n, words(f"running {_count(n, 'worker')}, not {{workers}} {workers}: {why}")


def _count(k: int, what: str) -> str:
    return f"{k} {what}" + ("" if k == 1 else "s")


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
) -> StudyRun:
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
        workers: worker processes on this machine (capped at ``n_trials`` and at the usable
            CPU cores, with a note: :func:`cap_workers`).
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
        A :class:`~nascompress.studies.results.StudyRun`: the study, its storage (masked),
        ``n_trials``, ``complete``, ``counts`` (by state), the objectives, the Pareto ``front``
        (:class:`~nascompress.studies.results.FrontTrial`: number, values, params), ``wall_s``,
        ``workers`` (run), ``workers_note`` (why fewer than asked, or None), ``created``,
        ``stale_failed`` (failed for good), ``stale_resumed`` (trials of a killed run, run again in
        place), ``finished`` and ``worker_errors``.
    """
    t0 = time.time()
    if not isinstance(n_trials, int) or n_trials < 1:
        raise NascompressError(f"n_trials must be an integer >= 1, got {n_trials!r}")
    check_limited("n_trials", n_trials, "max_trials")
    if not isinstance(workers, int) or workers < 1:
        raise NascompressError(f"workers must be an integer >= 1, got {workers!r}")
    workers, workers_note = cap_workers(workers, n_trials)
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
    info = StudyInfo.new(
        **{
            **dict(space_info),
            "objectives": list(metric_names),
            "seed": int(seed),
            "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
    )
    if "command" not in info:
        info = info.set(command=" ".join(sys.argv))
    loop = LoopConfig(
        n_trials=n_trials,
        deadline=t0 + timeout if timeout is not None else None,
        heartbeat_interval=float(heartbeat_interval),
        grace_period=grace,
        max_retries=max_retries,
        max_failures=max_failures,
    )
    if workers_note and (progress or json_progress):
        console.print(workers_note, highlight=False, soft_wrap=True)
    with quiet_optuna(), writing(spec.display, what=f"study storage {spec.display}", then=CONTINUE):
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
        worker_msgs: list[WorkerMessage] = []
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
                work(wstudy, objective, loop, seeding, on_update=display.update)
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
                worker_msgs = run_workers(args, study, display, target=worker_main)
        trials = study.get_trials(deepcopy=False)
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    complete = counts.get("COMPLETE", 0)
    errors = [m for m in worker_msgs if m.error]
    timed_out = loop.deadline is not None and time.time() >= loop.deadline
    if complete < n_trials and errors and not timed_out:
        first = errors[0]
        hint = " (rerun with {workers} 1 {debug} for the traceback)" if first.traceback else ""
        raise SettingError(
            f"worker {first.worker} failed: {literal(first.error)}{hint}; the study has "
            f"{complete} of {n_trials} complete trials: rerun the same command to continue it"
        )
    front = pareto_front(trials, directions)
    return StudyRun.new(
        study=study_name,
        storage=spec.display,
        n_trials=n_trials,
        complete=complete,
        counts=counts,
        metric_names=list(metric_names),
        directions=directions,
        front=[FrontTrial.new(number=t.number, values=list(t.values), params=dict(t.params)) for t in front],
        wall_s=round(time.time() - t0, 3),
        workers=workers,
        workers_note=workers_note,
        created=created,
        stale_failed=stale,
        stale_resumed=resumed,
        finished=complete >= n_trials,
        worker_errors=[WorkerError.new(worker=m.worker, error=m.error) for m in errors],
    )
