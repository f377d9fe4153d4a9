"""Spawning a study's worker processes (multiprocessing 'spawn') and collecting what each reports."""

from __future__ import annotations

import os
import queue as _queue
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable
import multiprocessing as mp

import optuna
from optuna.samplers import BaseSampler

from .display import Display
from .storage_url import StorageSpec


@dataclass(frozen=True)
class LoopConfig:
    """The limits of one process's ask/tell loop (:func:`nascompress.studies.runner.run_study` sets them)."""

    n_trials: int
    deadline: float | None
    heartbeat_interval: float
    grace_period: float
    max_retries: int
    max_failures: int


@dataclass(frozen=True)
class WorkerArgs:
    index: int
    spec: StorageSpec
    study_name: str
    objective_factory: Callable[[], Callable[[optuna.Trial], Any]]
    sampler_factory: Callable[[int], BaseSampler]
    seed: int  # the study's seed (the worker's sampler is rebuilt from it before each trial)
    loop: LoopConfig
    threads: int = 0  # torch intra-op threads of this worker (0: torch's default)


@dataclass(frozen=True)
class WorkerMessage:
    """What a worker process reports as it ends: the trials it ran to an end, or the error it
    stopped with (and the traceback of one that is no NascompressError), or that it was interrupted."""

    worker: int
    ran: int | None = None
    error: str | None = None
    traceback: str | None = None
    interrupted: bool = False


def run_workers(
    args: list[WorkerArgs], study: optuna.Study, display: Display, *, target: Callable[[WorkerArgs, Any], None]
) -> list[WorkerMessage]:
    """Run a spawned process ``target(args[k], results)`` per worker, refreshing ``display`` until all
    have ended; returns each worker's :class:`WorkerMessage` (put on ``results``), by worker."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(a, results), name=f"nascompress-worker-{a.index}") for a in args]
    msgs: list[WorkerMessage] = []

    def drain() -> None:
        while True:
            try:
                msgs.append(results.get_nowait())
            except _queue.Empty:
                return

    for p in procs:
        p.start()
    try:
        while any(p.is_alive() for p in procs):
            time.sleep(0.5)
            drain()
            display.update(study.get_trials(deepcopy=False))
    except KeyboardInterrupt:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGINT)
        deadline = time.time() + 15
        for p in procs:
            p.join(max(0.1, deadline - time.time()))
            if p.is_alive():
                p.terminate()
                p.join(5)
        raise
    for p in procs:
        p.join()
    deadline = time.time() + 2
    while len(msgs) < len(procs) and time.time() < deadline:
        drain()
        time.sleep(0.05)
    for p in procs:
        idx = int(p.name.rsplit("-", 1)[1])
        if not any(m.worker == idx for m in msgs):
            msgs.append(WorkerMessage(idx, error=f"worker {idx} exited with code {p.exitcode}"))
    display.update(study.get_trials(deepcopy=False))
    return sorted(msgs, key=lambda m: m.worker)
