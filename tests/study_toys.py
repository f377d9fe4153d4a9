"""Toy objectives for the study tests: top-level (picklable for spawned workers), fast, deterministic.

The space: ``x`` in [0, 1] (continuous, so two sampled trials never share params by chance) and
``mode`` in {a, b}. accuracy and flops_ratio both rise with x: a real trade-off.

``python -m tests.study_toys JSON`` runs :func:`run_study` with the toy objective (for the
SIGKILL tests); JSON holds run_study's keyword arguments plus the toy's (``toy``) and optionally
``sampler`` (``nsga2`` or ``tpe``: the search's own samplers, :func:`toy_sampler`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from functools import partial
from typing import Any, Callable

from nascompress.studies import record_trial
from nascompress.studies.results import StudyRun

SPACE_INFO = {
    "space": {
        "format": "nascompress-space/1",
        "name": "toy",
        "methods": [{"name": "toy", "params": {"x": {"kind": "float", "low": 0.0, "high": 1.0}}}],
    },
    "space_hash": "toyhash000000000",
    "base_run": "runs/toy",
    "dataset": "synthetic",
    "command": "test",
}
TWO = {"directions": ["maximize", "minimize"], "metric_names": ["accuracy", "flops_ratio"]}


def toy_values(x: float, mode: str) -> tuple[float, float]:
    acc = 70.0 + 20.0 * x - (1.5 if mode == "b" else 0.0)
    ratio = 0.3 + 0.65 * x + (0.0 if mode == "b" else 0.05)
    return acc, ratio


def _wait_for_workers(ready_dir: str, n: int) -> None:
    """Every worker announces itself; the first trial waits until all are up (max 60 s)."""
    open(os.path.join(ready_dir, f"ready-{os.getpid()}"), "w").close()
    end = time.time() + 60
    while len([f for f in os.listdir(ready_dir) if f.startswith("ready-")]) < n and time.time() < end:
        time.sleep(0.05)


def _objective(
    trial: Any,
    *,
    sleep: float = 0.0,
    marker_dir: str | None = None,
    hang_at: int | None = None,
    single: bool = False,
    fail: str | None = None,
    ready: tuple[str, int] | None = None,
) -> Any:
    if ready is not None:
        _wait_for_workers(*ready)
    x = trial.suggest_float("x", 0.0, 1.0)
    mode = trial.suggest_categorical("mode", ["a", "b"])
    if marker_dir is not None:
        n_started = len(os.listdir(marker_dir))
        with open(os.path.join(marker_dir, f"start-{trial.number}"), "w") as f:
            f.write(json.dumps({"x": x, "mode": mode, "pid": os.getpid()}))
        if hang_at is not None and n_started >= hang_at:
            time.sleep(120)  # the test kills the process here
    if fail == "always":
        raise RuntimeError("toy failure")
    if fail == "collapse" or (fail == "collapse_odd" and trial.number % 2):
        from nascompress.errors import NascompressError

        raise NascompressError(f"the search collapsed in trial {trial.number}")
    if fail == "interrupt" and trial.number == 2:
        raise KeyboardInterrupt
    if sleep:
        time.sleep(sleep)
    acc, ratio = toy_values(x, mode)
    import torch

    trial.set_user_attr("torch_threads", torch.get_num_threads())
    record_trial(
        trial,
        arch=[{"name": "toy", "config": {"x": x, "mode": mode}}],
        flops=1e6 * ratio,
        flops_ratio=ratio,
        params=1000 + trial.number,
        accuracy=acc,
        latency_ms=1.0 + ratio if mode == "a" else None,
        throughput=None,
        wall_s=sleep,
        seed=0,
    )
    return acc if single else (acc, ratio)


def toy_factory(**kw: Any) -> Callable[[Any], Any]:
    """The objective factory; bind options with ``functools.partial(toy_factory, sleep=0.1)``."""
    if kw.get("ready") is not None:
        kw["ready"] = tuple(kw["ready"])
    return partial(_objective, **kw)


def toy_sampler(kind: str) -> Callable[[int], Any]:
    """The sampler factory of ``nascompress search`` (``nsga2`` with a population of 20, or ``tpe``)."""
    from nascompress.studies.samplers import make_sampler

    return partial(make_sampler, kind)


def fake_run(study: str = "s", **values: Any) -> StudyRun:
    """The summary of a run that ran nothing (a stand-in for ``run_search`` in tests): ``values``
    override its fields."""
    return StudyRun.new(
        **{
            "study": study,
            "storage": "x",
            "n_trials": 0,
            "complete": 0,
            "counts": {},
            "metric_names": ["accuracy", "flops_ratio"],
            "directions": ["maximize", "minimize"],
            "front": [],
            "wall_s": 0.0,
            "workers": 1,
            "workers_note": None,
            "created": True,
            "stale_failed": [],
            "stale_resumed": [],
            "finished": True,
            "worker_errors": [],
            **values,
        }
    )


def run_toy_study(name: str, storage: str | None, n: int, **kw: Any) -> StudyRun:
    """:func:`run_study` of ``n`` toy trials into study ``name`` (``storage`` None: the default file),
    quietly, with beats a loaded test machine keeps up with; ``kw``: run_study's other arguments."""
    from nascompress.studies import run_study

    kw.setdefault("objective_factory", toy_factory)
    kw.setdefault("progress", False)
    kw.setdefault("heartbeat_interval", 1.0)
    kw.setdefault("grace_period", 30.0)  # a loaded test machine may delay a beat by seconds
    return run_study(study_name=name, storage=storage, n_trials=n, space_info=SPACE_INFO, **{**TWO, **kw})


def main(argv: list[str]) -> None:
    from nascompress.studies import run_study

    kw = json.loads(argv[0])
    toy = kw.pop("toy", {})
    if "sampler" in kw:
        kw["sampler_factory"] = toy_sampler(kw.pop("sampler"))
    summary = run_study(objective_factory=partial(toy_factory, **toy), progress=False, **kw)
    print(json.dumps(summary.to_dict()))


if __name__ == "__main__":
    main(sys.argv[1:])
