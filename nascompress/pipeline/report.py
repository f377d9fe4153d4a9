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
from .files import find_pick, find_step_marker, write_summary_json
from ..runs.run_config import find_run_config
from ..runs.json_io import atomic_path
from .report_format import (
    build_html,
)
from ..profiling.jobs import profile
from ..profiling.records import Evaluation, ModelProfile
from ..deploy.config import config_for
from ..deploy.int8_rows import int8_rows
from ..runs.io import MODEL_FILE, load_with_arch, read_arch
from ..studies.front_plot import FrontMarks, Mark
from .goal import flops_goal, latency_goal
from ..studies.inspect import load
from ..studies.report import build_report
from .confirm import CHANNEL_DIR
from .dense_reference import DENSE_REFERENCE_DIR, dense_reference_record, splits_summary
from .fallback import dcs_outcome
from .steps import Pipeline
from .summary import (
    SUMMARY_FORMAT,
    BaseDecision,
    Comparison,
    ConfirmDecision,
    DcsBlock,
    DcsDecision,
    Decisions,
    Goal,
    Int8Section,
    MethodLine,
    ModelResult,
    RetrainDecision,
    StageRow,
    Summary,
    TokenMethod,
    TokensDecision,
)
from .test_scores import test_scores


# the retraining's record in summary.json (from the kept run's metrics.json)
_RETRAIN_KEYS = (
    "epochs eta warm_epochs kd feat_kd batch_size peak_lr start_val_top1 best_val_top1 best_epoch test_top1 test_n "
    "train_time_s"
).split()


DCS_METRICS = (  # what the report reads of the DCS search's metrics.json
    "target_flops",
    "flops_ratio",
    "cost",
    "target_latency",
    "latency_ratio",
    "latency_ms",
    "dense_latency_ms",
    "heads_kept",
    "skipped_blocks",
    "calibrated",
    "calibration",
    "calibration_move",
    "budget",
    "at_target_share",
    "val_top1",
    "dense_val_top1",
    "lam",
    "search_time_s",
    "train_images",
    "batch_size",
    "family_reason",
    "family_kl",
    "protected",
    "block_weights",
    "kept",
    "stopped",
)


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


def _method_summary(rec: dict[str, Any]) -> str:
    """One line for a token/attention method record: its settings that are set."""
    cfg = rec.get("config") or {}
    parts = []
    for k, v in cfg.items():
        if v is None:
            continue
        if isinstance(v, float):
            v = f"{v:g}"
        elif isinstance(v, list):
            v = "[" + ", ".join(f"{x:g}" if isinstance(x, float) else str(x) for x in v) + "]"
        parts.append(f"{k}={v}")
    return f"{rec.get('name')}: " + " ".join(parts)


def _dcs_decisions(out: Path, dcs_rec: dict[str, Any] | None, dense: Any) -> DcsDecision:
    """The DCS stage's decisions: its gate family (and why), widths kept per block, how it landed
    and whether it fell back (a milder target, or skipped); ``in_final_model``: False where the final model
    is a token-only pick on the dense base (the search's landing is still recorded)."""
    res: dict[str, Any] = {"in_final_model": dcs_rec is not None}
    if dcs_rec is not None:
        family = (dcs_rec.get("config") or {}).get("mlp_gates", "residual")
        family = {True: "residual", False: "none"}.get(family, family)
        blocks = []
        for j, (blk, b) in enumerate(zip(dense.blocks, dcs_rec.get("blocks") or [])):
            hidden = family == "hidden"
            c = blk.mlp.fc1.out_features if hidden else blk.mlp.fc1.in_features
            keep = b.get("hidden_keep") if hidden else b.get("mlp_keep")
            blocks.append(
                DcsBlock.new(
                    block=j + 1,
                    mlp_kept=c if keep is None else len(keep),
                    mlp_total=c,
                    qk_kept=None if b.get("qk_keep") is None else [len(h) for h in b["qk_keep"]],
                    heads=blk.attn.num_heads,
                    head_dim=blk.attn.head_dim,
                )
            )
        res.update(
            config=dcs_rec.get("config"),
            mlp_gates=family,
            blocks=tuple(blocks),
            mlp_kept_total=sum(b.mlp_kept for b in blocks),
            mlp_total=sum(b.mlp_total for b in blocks),
        )
    sm = find_metrics(out / "dcs_search")
    if sm is not None:
        res.update({k: sm.get(k) for k in DCS_METRICS})
        res["kept_reason"] = (sm.get("comparison") or {}).get("reason")
    outcome = dcs_outcome(out) or {}
    res.update(
        {
            k: outcome.get(k)
            for k in ("dcs_outcome", "dcs_target", "planned_target", "dcs_reason")
            if outcome.get(k) is not None
        }
    )
    return DcsDecision.new(**res)


def _tokens_decisions(pipe: Pipeline, methods: list[dict[str, Any]]) -> TokensDecision:
    out = pipe.out
    res: dict[str, Any] = {
        "study": pipe.cfg.stages.tokens.study,
        "storage": pipe.storage,
        "pick_rule": pipe.cfg.goal.pick,
        "eval_images": pipe.cfg.stages.tokens.eval_images,
        "methods": tuple(
            TokenMethod.new(name=m["name"], config=m.get("config"), summary=_method_summary(m)) for m in methods
        ),
    }
    marker = find_step_marker(out, "tokens_search")
    if marker is not None:
        res["trials_complete"] = marker.result.get("complete")
        res["trials_requested"] = marker.result.get("n_trials")
    pc = find_run_config(out / "tokens" / "picked")
    m = find_metrics(out / "tokens" / "picked")
    if m is not None:
        res.update(
            picked_trial=m.get("trial"),
            trial_accuracy=m.get("trial_accuracy"),
            trial_flops_ratio=m.get("flops_ratio"),
            trial_params=m.get("params"),
        )
    if pc is not None:
        prov = pc.get("from_study") or {}
        res["params"] = prov.get("params")
        res["trial_seed"] = prov.get("seed")
    pj = find_pick(out / "tokens")
    if pj is not None:  # after a dcs stage: the pick on the DCS model against the one on the dense base
        res.update(
            picked_study=pj.picked_study,
            candidates=pj.candidates,
            dense_study=pj.dense_study,
            dense_skipped=pj.dense_skipped,
        )
        res["study"] = pj.picked_study or res["study"]
    return TokensDecision.new(**res)


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
        decisions["dcs"] = _dcs_decisions(out, None, dense_model)
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
                **compare_records(prof.models[c.model], prof.models[c.reference]),
            }
        )
        goal = _goal(cfg, cmp, final)
        methods = [m.to_dict() for m in read_arch(final_dir).methods]
        dcs_rec = next((m for m in methods if m.get("name") == "dcs"), None)
        if cfg.stages.dcs is not None:
            decisions["dcs"] = _dcs_decisions(out, dcs_rec, dense_model)
    if cfg.stages.tokens is not None and final_dir is not None:
        decisions["tokens"] = _tokens_decisions(pipe, [m for m in methods if m.get("name") != "dcs"])
    kept_runs = (out / "final", out / CHANNEL_DIR)
    r = find_metrics(final_dir) if cfg.stages.retrain is not None and final_dir in kept_runs else None
    check = find_step_marker(out, "confirm")
    if check is not None:  # the pick checked against the channel-only model at the full budget
        decisions["confirm"] = ConfirmDecision.new(**check.result)
    if r is not None:
        decisions["retrain"] = RetrainDecision.new(
            **{k: r.get(k) for k in _RETRAIN_KEYS}, teacher=cfg.stages.retrain.distil_from
        )
    decisions["methods"] = tuple(
        MethodLine.new(
            name=m.get("name"),
            summary=_method_summary(m) if m.get("name") != "dcs" else "dcs: channels per block (see dcs)",
        )
        for m in methods
    )
    int8 = None
    if cfg.export is not None and cfg.export.quantize != "none" and final_dir is not None:
        int8 = Int8Section.new(**_int8(pipe, final_dir))
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
    study_html = None
    if cfg.stages.tokens is not None:
        study_html = _study_report(pipe, front_marks(Summary.new(**fields)))
    summary = Summary.new(**fields, report=str((out / "report.html").resolve()))
    write_summary_json(out, summary)
    with atomic_path(out / "report.html") as tmp:
        tmp.write_text(
            build_html(summary, config_text=(out / "config.yaml").read_text(), study_html=study_html), encoding="utf-8"
        )
    return summary


def _int8(pipe: Pipeline, final_dir: Path) -> dict[str, Any]:
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
