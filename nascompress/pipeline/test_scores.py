"""The report's test scores of a model (:func:`test_scores`): the scores its own training recorded
where evaluating it again is provably the same computation, else a fresh evaluation.

A training step of the pipeline ends by testing its best model on the test split; the report then
tests the same model file on the same split. With bf16 autocast (``amp``) the two differ (the
training's is under autocast, the report's in its own dtype), so the report evaluates again; in
fp32 at the report's batch, in one process, the training's record is what the report would compute,
bit for bit, and the second pass over the test images is skipped.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from ..profiling.jobs import evaluate_run
from ..profiling.records import Evaluation
from ..runs.files import find_metrics
from ..runs.io import CONFIG_FILE, MODEL_FILE, load_with_arch, read_arch
from ..errors import NascompressError
from ..runtime import resolve_device
from ..runs.run_config import find_run_config
from .steps import Pipeline

REPORT_EVAL_BATCH = 256  # evaluate_run's batch, the one the report evaluates at
_TRAIN_ONLY = ("train_limit", "num_workers")  # data keys that leave the test split as it is


def _inside(path: Path, root: Path) -> bool:
    try:
        Path(os.path.abspath(path)).relative_to(root)
    except ValueError:
        return False
    return True


def _on_cpu(device: Any) -> bool:
    try:
        return isinstance(device, str) and resolve_device(device).type == "cpu"
    except NascompressError:
        return False


def recorded_scores(pipe: Pipeline, run_dir: Path) -> Evaluation | None:
    """``run_dir``'s recorded test scores as :func:`~nascompress.profiling.jobs.evaluate_run`'s
    :class:`~nascompress.profiling.records.Evaluation`, or None unless evaluating it again would give
    them bit for bit: a run this pipeline trained (inside OUT)
    that finished, tested on the CPU in fp32 (``amp`` off) at the report's batch in one process, on the
    report's data (its ``config.json``'s data equal to the pipeline's but for train-only keys), its
    weights not written since, a model without early exits (their counts are the report's), and the
    report's dtype fp32."""
    run_dir = Path(run_dir)
    if pipe.cfg.report.dtype != "fp32" or not _inside(run_dir, pipe.out) or not (run_dir / CONFIG_FILE).is_file():
        return None
    m = find_metrics(run_dir)
    m = None if m is None else m.to_dict()
    if not m or not m.get("finished") or m.get("amp") != "off" or m.get("processes", 1) != 1:
        return None
    if not all(isinstance(m.get(k), (int, float)) for k in ("test_top1", "test_loss", "test_n")):
        return None
    cfg = find_run_config(run_dir)
    train, data = cfg.get("train") or {}, cfg.get("data") or {}
    ours = {k: v for k, v in dataclasses.asdict(pipe.data).items() if k not in _TRAIN_ONLY}
    if train.get("eval_batch_size") != REPORT_EVAL_BATCH or {k: data.get(k) for k in ours} != ours:
        return None
    if not _on_cpu(train.get("device")) or not _on_cpu(pipe.cfg.device):  # (CUDA's fp32 may use TF32)
        return None
    weights, metrics_file = run_dir / MODEL_FILE, run_dir / "metrics.json"
    if not weights.is_file() or weights.stat().st_mtime_ns > metrics_file.stat().st_mtime_ns:
        return None
    model, _ = load_with_arch(run_dir)
    if hasattr(model, "inference_stats"):
        return None
    return Evaluation.new(
        top1=m["test_top1"],
        loss=m["test_loss"],
        n=m["test_n"],
        split="test",
        dataset=m.get("dataset"),
        methods=list(read_arch(run_dir).method_names),
        dtype="fp32",
    )


def test_scores(pipe: Pipeline, run_dir: Path) -> Evaluation:
    """The test top-1, loss and count of the model in ``run_dir`` on the pipeline's test split:
    :func:`recorded_scores` where they are provably the same, else :func:`~nascompress.profiling.jobs.evaluate_run`."""
    rec = recorded_scores(pipe, run_dir)
    if rec is not None:
        return rec
    cfg = pipe.cfg
    return evaluate_run(run_dir, data=pipe.data, split="test", device=cfg.device, dtype=cfg.report.dtype)


__all__ = ["recorded_scores", "test_scores", "REPORT_EVAL_BATCH"]
