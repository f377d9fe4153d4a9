"""Liveness of the workers that run a study's trials: who runs a trial (heartbeats), which RUNNING
trials are stale (their worker is gone), and claiming, releasing or failing such trials."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial, TrialState

from ._procs import pid_alive as _pid_alive
from ._procs import pid_start as _pid_start
from .records import FAIL_REASON_KEY, RETRIES_KEY, WORKER_KEY


@dataclass(frozen=True)
class Me:
    host: str
    pid: int
    pid_start: str | None

    @staticmethod
    def now() -> Me:
        pid = os.getpid()
        return Me(socket.gethostname(), pid, _pid_start(pid))


ACTIVE: set[tuple[str, int]] = set()  # (study name, trial id) run by this process right now
_NO_BEAT_SINCE: dict[tuple[str, int], float] = {}  # RUNNING trials seen without any beat: first seen (monotonic)


def _is_stale(t: FrozenTrial, study_name: str, grace_period: float, me: Me) -> bool:
    w = t.system_attrs.get(WORKER_KEY)
    if isinstance(w, Mapping) and w.get("released"):  # interrupted (Ctrl-C): free to take over at once
        return (study_name, t._trial_id) not in ACTIVE
    if not isinstance(w, Mapping):
        # No beat yet: asked a moment ago, or its worker died between ask and the first beat. Its
        # datetime_start is the writer's naive local time (not comparable across machines), so
        # count from when this process first saw it without a beat.
        first = _NO_BEAT_SINCE.setdefault((study_name, t._trial_id), time.monotonic())
        return time.monotonic() - first > grace_period
    if w.get("host") == me.host:
        if w.get("pid") == me.pid:
            return (study_name, t._trial_id) not in ACTIVE
        if not _pid_alive(int(w.get("pid", -1)), w.get("pid_start")):
            return True
    return time.time() - float(w.get("beat", 0.0)) > grace_period


def _fail(study: optuna.Study, t: FrozenTrial, reason: str) -> bool:
    """Mark a RUNNING trial FAIL with a reason (False if somebody finished it first)."""
    storage = study._storage  # the Study's (cached) storage: writes stay coherent with its reads
    try:
        storage.set_trial_system_attr(t._trial_id, FAIL_REASON_KEY, reason)
        storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
    except (UpdateFinishedTrialError, RuntimeError):
        return False
    return True


def _died(t: FrozenTrial) -> bool:
    """Was the trial's worker killed (not interrupted cleanly, which releases it)?"""
    w = t.system_attrs.get(WORKER_KEY)
    return not (isinstance(w, Mapping) and w.get("released"))


def stale_trials(
    study: optuna.Study, *, grace_period: float, trials: Sequence[FrozenTrial] | None = None
) -> list[FrozenTrial]:
    """The RUNNING trials whose worker is gone (see :mod:`nascompress.studies.runner`), by number.

    Args:
        study: the study.
        grace_period: seconds without a heartbeat after which another host's trial is stale
            (a trial of a dead process on this host is stale at once).
        trials: the study's trials if already read.
    """
    me = Me.now()
    trials = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if trials is None else trials
    return sorted(
        (t for t in trials if t.state == TrialState.RUNNING and _is_stale(t, study.study_name, grace_period, me)),
        key=lambda t: t.number,
    )


def fail_stale_trials(
    study: optuna.Study, *, grace_period: float, max_retries: int = 2, trials: Sequence[FrozenTrial] | None = None
) -> list[int]:
    """Fail the stale trials that may not be taken over again: their worker died ``max_retries``
    times already (a configuration that kills its process). The others are left RUNNING for a
    worker to take over in place (:func:`nascompress.studies.runner.run_study`).

    Returns:
        The numbers of the trials failed here.
    """
    failed = []
    for t in stale_trials(study, grace_period=grace_period, trials=trials):
        retries = int(t.user_attrs.get(RETRIES_KEY, 0))
        if _died(t) and retries >= max_retries:
            w = t.system_attrs.get(WORKER_KEY) or {}
            reason = (
                f"stale: worker {w.get('host')}:{w.get('pid')} stopped beating"
                if w
                else "stale: its worker never reported"
            ) + f" (its worker died {retries + 1} times)"
            if _fail(study, t, reason):
                failed.append(t.number)
    return failed


def take_over(study: optuna.Study, t: FrozenTrial, me: Me) -> bool:
    """Claim a stale RUNNING trial for this worker: write this worker as its owner and read it
    back (another worker that claimed it at the same moment may run it too; the first tell wins)."""
    storage = study._storage
    tid = t._trial_id
    try:
        storage.set_trial_system_attr(
            tid, WORKER_KEY, {"host": me.host, "pid": me.pid, "pid_start": me.pid_start, "beat": time.time()}
        )
        now = storage.get_trial(tid)
        w = now.system_attrs.get(WORKER_KEY) or {}
        if now.state != TrialState.RUNNING or w.get("pid") != me.pid or w.get("host") != me.host:
            return False
        if _died(t):  # a worker killed mid-trial counts against max_retries; a Ctrl-C does not
            storage.set_trial_user_attr(tid, RETRIES_KEY, int(t.user_attrs.get(RETRIES_KEY, 0)) + 1)
    except (UpdateFinishedTrialError, RuntimeError):
        return False
    return True


class Heartbeat:
    """Writes the worker identity and a timestamp into a trial now and every ``interval`` s."""

    def __init__(self, study: optuna.Study, trial_id: int, interval: float, me: Me) -> None:
        self.storage = study._storage
        self.trial_id = trial_id
        self.interval = interval
        self.me = me
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.last = 0.0

    def beat(self) -> None:
        self.last = time.time()
        self.storage.set_trial_system_attr(
            self.trial_id,
            WORKER_KEY,
            {"host": self.me.host, "pid": self.me.pid, "pid_start": self.me.pid_start, "beat": self.last},
        )

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.beat()
            except Exception:  # a transient storage error: the next beat retries
                pass

    def __enter__(self) -> Heartbeat:
        if time.time() - self.last > self.interval / 2:
            self.beat()
        self.thread = threading.Thread(target=self._run, name="nascompress-heartbeat", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


def let_go(study: optuna.Study, trial: optuna.Trial, me: Me) -> None:
    """Mark the trial released by its worker: the next run takes it over at once, in its place."""
    study._storage.set_trial_system_attr(
        trial._trial_id,
        WORKER_KEY,
        {"host": me.host, "pid": me.pid, "pid_start": me.pid_start, "beat": time.time(), "released": True},
    )
