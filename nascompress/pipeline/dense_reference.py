"""The references a pipeline's report holds beside its result: which images decided and which
measured (:func:`splits_summary`, the data's :class:`~nascompress.data.carve.Splits`), and, with
``report.dense_reference: true``, the dense base retrained with the retrain stage's own recipe and
teacher (the ``retrain_dense`` step, ``OUT/dense_reference``: :func:`dense_reference_step`), the fair
yardstick for the compressed model at the same budget (:func:`dense_reference_record`, shown by
:func:`reference_html`)."""

from __future__ import annotations

import html
from pathlib import Path

from ..profiling.jobs import evaluate_run
from ..profiling.records import Evaluation
from ..data import load_data
from ..data.carve import Splits, splits_text
from ..retraining.metrics import RetrainMetrics
from ..retraining.run import RetrainJob, retrain
from ..runs.files import find_metrics
from .steps import Pipeline, Step
from .summary import DenseReference, ModelResult, Summary

DENSE_REFERENCE_DIR = "dense_reference"
NEEDS_RETRAIN = "retrains the dense base with stages.retrain's recipe and teacher: add a retrain stage, or set it false"


def dense_reference_step(job: RetrainJob, out: Path, base_dir: Path) -> Step:
    """The step that retrains the dense base with ``job``'s recipe and teacher (the retrain stage's
    job) into ``OUT/dense_reference``: resumed from its checkpoint like the other training steps."""
    ref = out / DENSE_REFERENCE_DIR

    def run(force: bool, resume: bool) -> RetrainMetrics:
        return retrain(job.replace(model_dir=str(base_dir), out=str(ref)), force=force, resume=resume)

    return Step(
        "retrain_dense",
        ref,
        "train",
        run,
        outputs=(f"{DENSE_REFERENCE_DIR}/model.safetensors", f"{DENSE_REFERENCE_DIR}/metrics.json"),
        describe="retrain the dense base with the same recipe and teacher (report.dense_reference)",
    )


def splits_summary(pipe: Pipeline) -> Splits | None:
    """The pipeline's data split record: which images decided (validation) and which measured (test),
    whether the test split was carved and, then, its files (:class:`~nascompress.data.carve.Splits`)."""
    return load_data(pipe.data, augment=False).splits


def dense_reference_record(pipe: Pipeline, dense_ev: Evaluation, final: ModelResult | None) -> DenseReference:
    """The dense reference on the report's test images (``dense_ev``'s, checked), its own validation
    record, and the compressed model's test top-1 against it (``final``: the summary's record)."""
    ref = pipe.out / DENSE_REFERENCE_DIR
    ev = evaluate_run(ref, data=pipe.data, split="test", device=pipe.cfg.device, dtype=pipe.cfg.report.dtype)
    assert ev.n == dense_ev.n, f"dense tested on {dense_ev.n} images, the reference on {ev.n}"
    m = find_metrics(ref) or {}
    return DenseReference.new(
        run=str(ref),
        test_top1=ev.top1,
        test_loss=ev.loss,
        test_n=ev.n,
        best_val_top1=m.get("best_val_top1"),
        best_epoch=m.get("best_epoch"),
        epochs=m.get("epochs"),
        teacher=pipe.cfg.stages.retrain.distil_from,
        final_top1_change=None if final is None else final.test_top1 - ev.top1,
    )


def reference_html(s: Summary) -> list[str]:
    """The report's parts for the splits line and the dense reference (none without them)."""
    parts = []
    if s.splits is not None:
        parts.append(f'<p class="note">Images: {html.escape(splits_text(s.splits))}.</p>')
    ref = s.dense_reference
    if ref:
        f = s.final
        rows = [
            ("dense base", f"{s.dense.test_top1:.2f}%", "-"),
            ("dense reference (retrained)", f"{ref.test_top1:.2f}%", _pct(ref.best_val_top1)),
        ]
        if f is not None:
            rows.append(("compressed", f"{f.test_top1:.2f}%", "-"))
        head = ["model", f"test top-1 ({ref.test_n} images)", "validation top-1"]
        cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
        change = ref.final_top1_change
        note = "" if change is None else f" The compressed model: {change:+.2f} points against it."
        parts += [
            "<h3>Dense reference: the dense base retrained with the same recipe and teacher</h3>",
            f'<table id="dense-reference"><tr>{cells}</tr>{body}</table>',
            f'<p class="note">{html.escape(ref.run)}; teacher: {html.escape(str(ref.teacher))}.{note}</p>',
        ]
    return parts


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}%"


__all__ = [
    "DENSE_REFERENCE_DIR",
    "NEEDS_RETRAIN",
    "dense_reference_record",
    "dense_reference_step",
    "reference_html",
    "splits_summary",
]
