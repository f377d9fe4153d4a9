"""The end of a pipeline: the result against the dense base, every decision, one offline HTML file.

:func:`write_summary` evaluates the dense base and the final model on the same test split, counts
their FLOPs (:func:`nascompress.profiling.count_flops`), times them interleaved in one process
(:func:`nascompress.profiling.jobs.profile` with ``compare=``: latency at batch 1, throughput at batch 64),
collects the decisions of every stage (the DCS channels kept per block from the ``arch.json``
records, the token/attention methods' settings, the picked trial, the retraining recipe) and
writes ``OUT/summary.json`` and ``OUT/report.html``. With a tokens stage the study's own report
(:func:`nascompress.studies.report.build_report`: front, history, importances, with plotly's
JavaScript inlined once) is written to ``OUT/tokens/report.html`` and embedded in the pipeline's.

:mod:`nascompress.pipeline.report_format` formats the summary for the terminal and the HTML alike
(:func:`comparison_rows`, :func:`dcs_rows`, :func:`build_html`; importable from here too).
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

from ..profiling.compare import compare_records
from ..runs.files import find_metrics
from .files import find_step_marker, write_summary_json
from ..runs.json_io import atomic_path
from .report_format import build_html, method_summary
from ..profiling.jobs import profile
from ..profiling.records import Evaluation, ModelProfile
from ..deploy.config import config_for
from ..deploy.int8_rows import Int8Section, int8_rows
from ..runs.io import MODEL_FILE, load_with_arch, read_arch
from ..studies.front_plot import FrontMarks, Mark
from .goal import flops_goal, latency_goal
from ..studies.inspect import load
from ..studies.report import build_report
from .dense_reference import DENSE_REFERENCE_DIR, dense_reference_record, splits_summary
from .stage import ReportState, registered_stages
from .steps import Pipeline
from .summary import (
    SUMMARY_FORMAT,
    BaseDecision,
    Comparison,
    Decisions,
    Goal,
    MethodLine,
    ModelResult,
    StageRow,
    Summary,
)
from .test_scores import test_scores


def _model_record(run: Path, ev: Evaluation, prof: ModelProfile) -> ModelResult:
    rec = {
        "run": str(run),
        "test_top1": ev.top1,
        "test_loss": ev.loss,
        "test_n": ev.n,
        "params": prof.params,
        "file_bytes": (run / MODEL_FILE).stat().st_size,
        "macs": prof.macs,
        "methods": [] if ev.methods is None else ev.methods,
        "latency_ms": prof.latency_ms,
        "latency_batch": prof.latency_batch,
        "throughput": prof.throughput,
        "throughput_batch": prof.throughput_batch,
    }
    compiled = {
        "latency_ms_compiled": prof.latency_ms_compiled,
        "throughput_compiled": prof.throughput_compiled,
        "compile_note": prof.compile_note,
        "qk_layout": prof.qk_layout,
    }
    rec.update({k: v for k, v in compiled.items() if v is not None})  # where measured
    return ModelResult.new(**rec)


def _stage_decisions(
    pipe: Pipeline, final_dir: Path | None, methods: tuple[dict[str, Any], ...], dense: Any
) -> dict[str, Any]:
    """Every registered stage's entries in the summary's ``decisions``, in the stages' order."""
    state = ReportState(pipe=pipe, final_dir=final_dir, methods=methods, dense=dense)
    found: dict[str, Any] = {}
    for stage in registered_stages():
        if stage.decide is not None:
            found.update(stage.decide(state))
    return found


def _stage_log(pipe: Pipeline) -> tuple[StageRow, ...]:
    rows = []
    for step in pipe.steps:
        m = find_step_marker(pipe.out, step.name)
        rows.append(
            StageRow.new(
                step=step.name,
                what=step.describe,
                dir=None if step.dir is None else str(step.dir),
                seconds=None if m is None else m.seconds,
                finished=None if m is None else m.finished,
            )
        )
    return tuple(rows)


def write_summary(pipe: Pipeline) -> Summary:
    """Measure the final model against the dense base; write ``summary.json`` and ``report.html``.
    When no compressed model could be made (the DCS stage was skipped and no other stage
    compresses), the summary says so: ``final`` is None and the goal is not met, with the reason."""
    cfg, out = pipe.cfg, pipe.out
    rep = cfg.report
    final_dir = pipe.result_dir()
    dense_ev = test_scores(pipe, pipe.base_dir)  # its training's record where provably the same
    dense_model, _ = load_with_arch(pipe.base_dir)
    decisions: dict[str, Any] = {"base": _base_decisions(pipe, dense_ev)}
    if final_dir is None:
        prof = profile(
            pipe.base_dir,
            device=cfg.device,
            latency=rep.latency,
            batch_size=rep.batch_size,
            iters=rep.iters,
            dtype=rep.dtype,
            compile=rep.compile,
        )
        dense = _model_record(pipe.base_dir, dense_ev, next(iter(prof.models.values())))
        decisions.update(_stage_decisions(pipe, final_dir, (), dense_model))
        reason = decisions["dcs"].dcs_reason or "no stage compressed the model"
        final, cmp = None, None
        goal = Goal.new(
            max_flops=cfg.goal.max_flops,
            max_latency_ms=cfg.goal.max_latency_ms,
            value=None,
            met=False,
            statement=f"no compressed model could be made: {reason}",
        )
        methods: list[dict[str, Any]] = []
    else:
        final_ev = test_scores(pipe, final_dir)
        assert final_ev.n == dense_ev.n, f"dense tested on {dense_ev.n} images, final on {final_ev.n}"
        prof = profile(
            final_dir,
            compare=pipe.base_dir,
            device=cfg.device,
            latency=rep.latency,
            batch_size=rep.batch_size,
            iters=rep.iters,
            dtype=rep.dtype,
            compile=rep.compile,
        )
        c = prof.comparison
        dense = _model_record(pipe.base_dir, dense_ev, prof.models[c.reference])
        final = _model_record(final_dir, final_ev, prof.models[c.model])
        # the one ratio convention (nascompress.profiling.compare): final against dense
        cmp = Comparison.new(
            **{
                "top1_change": final.test_top1 - dense.test_top1,
                "test_n": dense.test_n,
                "file_ratio": final.file_bytes / dense.file_bytes,
                "latency_speedup": None,  # (its place in the file; None when not timed)
                "throughput_speedup": None,
                **compare_records(prof.models[c.model], prof.models[c.reference]).to_dict(),
            }
        )
        goal = _goal(cfg, cmp, final)
        methods = [m.to_dict() for m in read_arch(final_dir).methods]
        decisions.update(_stage_decisions(pipe, final_dir, tuple(methods), dense_model))
    decisions["methods"] = tuple(
        MethodLine.new(
            name=m.get("name"),
            summary=method_summary(m) if m.get("name") != "dcs" else "dcs: channels per block (see dcs)",
        )
        for m in methods
    )
    int8 = None
    if cfg.export is not None and cfg.export.quantize != "none" and final_dir is not None:
        int8 = _int8(pipe, final_dir)
    fields: dict[str, Any] = {
        "format": SUMMARY_FORMAT,
        "config": str((out / "config.yaml").resolve()),
        "source": str(Path(pipe.source).resolve()) if Path(pipe.source).is_file() else pipe.source,  # (nc.compress)
        "out": str(out.resolve()),
        "seed": cfg.seed,
        "device": prof.device,
        "dtype": prof.dtype,
        "dataset": dense_ev.dataset,
        "goal": goal,
        "dense": dense,
        "final": final,
        "comparison": cmp,
        "int8": int8,
        "decisions": Decisions.new(**decisions),
        "stages": _stage_log(pipe),
        "written": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "splits": splits_summary(pipe),  # which images decided, which measured (data.carve)
    }
    if cfg.report.dense_reference and find_metrics(out / DENSE_REFERENCE_DIR) is not None:
        fields["dense_reference"] = dense_reference_record(pipe, dense_ev, final)
    summary = Summary.new(**fields)
    study_html = None
    if cfg.stages.tokens is not None:
        study_html = _study_report(pipe, front_marks(summary))
    summary = summary.set(report=str((out / "report.html").resolve()))  # (its last key)
    write_summary_json(out, summary)
    with atomic_path(out / "report.html") as tmp:
        tmp.write_text(
            build_html(summary, config_text=(out / "config.yaml").read_text(), study_html=study_html), encoding="utf-8"
        )
    return summary


def _int8(pipe: Pipeline, final_dir: Path) -> Int8Section:
    """The int8 rows (dense and compressed, fp32 and int8; :func:`~nascompress.deploy.int8_rows.int8_rows`):
    the compressed int8 file is the export step's, the dense one is made with the same settings."""
    cfg = pipe.cfg
    made = pipe.out / "export" / cfg.export.filename
    return int8_rows(
        pipe.base_dir,
        final_dir,
        compressed_int8=made if made.is_file() else None,
        data=pipe.data,
        config=config_for(cfg.export.quantize),
        export=cfg.export.config(seed=cfg.seed),
        batch=cfg.report.batch_size,
        iters=cfg.report.iters,
    )


def _goal(cfg: Any, cmp: Comparison, final: ModelResult) -> Goal:
    if cfg.goal.max_flops is not None:  # compared at the precision the report prints (.goal)
        return flops_goal(cmp.flops_ratio, cfg.goal.max_flops)
    return latency_goal(final.latency_ms, cfg.goal.max_latency_ms)


def _base_decisions(pipe: Pipeline, dense_ev: Evaluation) -> BaseDecision:
    """The base's decisions; its test top-1 is the report's own (``dense_ev``: the images the
    comparison uses), the one its training measured (possibly on other images: ``data.eval_limit``
    draws a subset) is kept as ``trained_test_top1`` with its count."""
    b = pipe.cfg.base
    res: dict[str, Any] = {
        "kind": b.kind if not (b.kind == "import" and b.import_.linear_probe) else "import+probe",
        "run": str(pipe.base_dir),
        "test_top1": dense_ev.top1,
        "test_n": dense_ev.n,
    }
    bm = find_metrics(pipe.base_dir)
    if bm is not None:
        res.update({k: bm.get(k) for k in ("best_val_top1", "epochs", "l2", "train_time_s") if k in bm})
        res.update({f"trained_{k}": bm.get(k) for k in ("test_top1", "test_n") if k in bm})
    return BaseDecision.new(**res)


def front_marks(s: Summary) -> Any:
    """What the study's fronts mark for this pipeline: the picked trial, the dense base and the final
    model (their test top-1, on the report's test images) and the goal."""
    d, f, g = s.dense, s.final, s.goal
    n = d.test_n
    dense = {
        "flops_ratio": Mark(
            f"dense base: 1x the FLOPs, test top-1 {d.test_top1:.2f}% ({n} test images)", 1.0, d.test_top1
        )
    }
    final = {}
    if f is not None:
        ratio = s.comparison.flops_ratio
        final["flops_ratio"] = Mark(
            f"final model: {ratio:.3f}x the FLOPs, test top-1 {f.test_top1:.2f}% ({n} test images)",
            ratio,
            f.test_top1,
        )
    for kind, rec, into in (("dense base", d, dense), ("final model", f, final)):
        if rec is not None and rec.latency_ms is not None:
            into["latency_ms"] = Mark(
                f"{kind}: {rec.latency_ms:.2f} ms, test top-1 {rec.test_top1:.2f}% ({n} test images)",
                rec.latency_ms,
                rec.test_top1,
            )
    goal = (
        {"flops_ratio": (g.max_flops, f"goal: <= {g.max_flops:g}x the dense FLOPs")}
        if g.max_flops is not None
        else {"latency_ms": (g.max_latency_ms, f"goal: <= {g.max_latency_ms:g} ms at batch 1")}
        if g.max_latency_ms is not None
        else {}
    )
    tokens = s.decisions.tokens
    return FrontMarks(picked=None if tokens is None else tokens.picked_trial, dense=dense, final=final, goal=goal)


def _study_report(pipe: Pipeline, marks: Any) -> str | None:
    """The study's own report (written to tokens/report.html), its fronts marking ``marks``; returns
    its HTML."""
    spec, study = load(pipe.cfg.stages.tokens.study, pipe.storage)
    text = build_report(study, storage_display=spec.display, marks=marks)
    with atomic_path(pipe.out / "tokens" / "report.html") as tmp:
        tmp.write_text(text, encoding="utf-8")
    return text


__all__ = ["write_summary"]
