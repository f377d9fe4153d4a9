"""The end of a pipeline: the result against the dense base, every decision, one offline HTML file.

:func:`write_summary` evaluates the dense base and the final model on the same test split, counts
their FLOPs (:func:`nascompress.profiling.count_flops`), times them interleaved in one process
(:func:`nascompress.api.profile` with ``compare=``: latency at batch 1, throughput at batch 64),
collects the decisions of every stage (the DCS channels kept per block from the ``arch.json``
records, the token/attention methods' settings, the picked trial, the retraining recipe) and
writes ``OUT/summary.json`` and ``OUT/report.html``. With a tokens stage the study's own report
(:func:`nascompress.studies.report.build_report`: front, history, importances, with plotly's
JavaScript inlined once) is written to ``OUT/tokens/report.html`` and embedded in the pipeline's.

:func:`comparison_rows` and :func:`dcs_rows` format the summary for the terminal and the HTML alike.
"""
from __future__ import annotations

import datetime as _dt
import html
from pathlib import Path
from typing import Any, Protocol, Sequence

from ..utils import atomic_path, read_json, write_json
from .sections import PipelineConfig


class PlannedStep(Protocol):
    """What the report reads of one step of a plan (:class:`nascompress.pipeline.plan.Step`)."""

    name: str
    describe: str
    dir: Path | None


class PlannedPipeline(Protocol):
    """What the report reads of a plan (:class:`nascompress.pipeline.plan.Pipeline`); declared here
    so that the report does not import the planner that calls it."""

    cfg: PipelineConfig
    out: Path
    source: str
    base_dir: Path
    storage: str | None
    data: Any

    @property
    def steps(self) -> Sequence[PlannedStep]: ...

    def result_dir(self) -> Path | None: ...


SUMMARY_FORMAT = "nascompress-pipeline-summary/1"


def _model_record(run: Path, ev: dict[str, Any], prof: dict[str, Any]) -> dict[str, Any]:
    from ..io import MODEL_FILE

    rec = {"run": str(run), "test_top1": ev["top1"], "test_loss": ev["loss"], "test_n": ev["n"],
           "params": prof["params"], "file_bytes": (run / MODEL_FILE).stat().st_size, "macs": prof["macs"],
           "methods": ev.get("methods", [])}
    for k in ("latency_ms", "latency_batch", "throughput", "throughput_batch"):
        rec[k] = prof.get(k)
    rec.update({k: prof[k] for k in ("latency_ms_compiled", "throughput_compiled", "compile_note", "qk_layout")
                if k in prof})
    return rec


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


def _dcs_decisions(out: Path, dcs_rec: dict[str, Any] | None, dense: Any) -> dict[str, Any]:
    """The DCS stage's decisions: its gate family (and why), widths kept per block, how it landed
    and whether it fell back (a milder target, or skipped)."""
    from .fallback import dcs_outcome

    res: dict[str, Any] = {}
    if dcs_rec is not None:
        family = (dcs_rec.get("config") or {}).get("mlp_gates", "residual")
        family = {True: "residual", False: "none"}.get(family, family)
        blocks = []
        for j, (blk, b) in enumerate(zip(dense.blocks, dcs_rec.get("blocks") or [])):
            hidden = family == "hidden"
            c = blk.mlp.fc1.out_features if hidden else blk.mlp.fc1.in_features
            keep = b.get("hidden_keep") if hidden else b.get("mlp_keep")
            blocks.append({"block": j + 1, "mlp_kept": c if keep is None else len(keep), "mlp_total": c,
                           "qk_kept": None if b.get("qk_keep") is None else [len(h) for h in b["qk_keep"]],
                           "heads": blk.attn.num_heads, "head_dim": blk.attn.head_dim})
        res.update({"config": dcs_rec.get("config"), "mlp_gates": family, "blocks": blocks,
                    "mlp_kept_total": sum(b["mlp_kept"] for b in blocks),
                    "mlp_total": sum(b["mlp_total"] for b in blocks)})
    m = out / "dcs_search" / "metrics.json"
    if m.is_file() and dcs_rec is not None:
        sm = read_json(m)
        res.update({k: sm.get(k) for k in ("target_flops", "flops_ratio", "calibrated", "calibration", "calibration_move",
                                           "budget", "at_target_share", "val_top1",
                                           "dense_val_top1", "lam", "search_time_s", "train_images", "batch_size",
                                           "family_reason", "family_kl", "protected", "block_weights")})
    outcome = dcs_outcome(out) or {}
    res.update({k: outcome.get(k) for k in ("dcs_outcome", "dcs_target", "planned_target", "dcs_reason")
                if outcome.get(k) is not None})
    return res


def _tokens_decisions(pipe: PlannedPipeline, methods: list[dict[str, Any]]) -> dict[str, Any]:
    out = pipe.out
    res: dict[str, Any] = {"study": pipe.cfg.stages.tokens.study, "storage": pipe.storage,
                           "pick_rule": pipe.cfg.goal.pick,
                           "methods": [{"name": m["name"], "config": m.get("config"), "summary": _method_summary(m)}
                                       for m in methods]}
    marker = out / "done" / "tokens_search.json"
    if marker.is_file():
        r = read_json(marker).get("result") or {}
        res["trials_complete"] = r.get("complete")
        res["trials_requested"] = r.get("n_trials")
    pm, pc = out / "tokens" / "picked" / "metrics.json", out / "tokens" / "picked" / "config.json"
    if pm.is_file():
        m = read_json(pm)
        res.update(picked_trial=m.get("trial"), trial_accuracy=m.get("trial_accuracy"),
                   trial_flops_ratio=m.get("flops_ratio"), trial_params=m.get("params"))
    if pc.is_file():
        prov = read_json(pc).get("from_study") or {}
        res["params"] = prov.get("params")
        res["trial_seed"] = prov.get("seed")
    return res


def _stage_log(pipe: PlannedPipeline) -> list[dict[str, Any]]:
    rows = []
    for step in pipe.steps:
        marker = pipe.out / "done" / f"{step.name}.json"
        m = read_json(marker) if marker.is_file() else {}
        rows.append({"step": step.name, "what": step.describe, "dir": None if step.dir is None else str(step.dir),
                     "seconds": m.get("seconds"), "finished": m.get("finished")})
    return rows


def write_summary(pipe: PlannedPipeline) -> dict[str, Any]:
    """Measure the final model against the dense base; write ``summary.json`` and ``report.html``.
    When no compressed model could be made (the DCS stage was skipped and no other stage
    compresses), the summary says so: ``final`` is None and the goal is not met, with the reason."""
    from ..api import evaluate_run, profile
    from ..io import load_arch, load_with_arch

    cfg, out = pipe.cfg, pipe.out
    rep = cfg.report
    final_dir = pipe.result_dir()
    dense_ev = evaluate_run(pipe.base_dir, data=pipe.data, split="test", device=cfg.device, dtype=rep.dtype)
    dense_model, _ = load_with_arch(pipe.base_dir)
    decisions: dict[str, Any] = {"base": _base_decisions(pipe)}
    if final_dir is None:
        prof = profile(pipe.base_dir, device=cfg.device, latency=rep.latency, batch_size=rep.batch_size,
                       iters=rep.iters, dtype=rep.dtype, compile=rep.compile)
        dense = _model_record(pipe.base_dir, dense_ev, next(iter(prof["models"].values())))
        decisions["dcs"] = _dcs_decisions(out, None, dense_model)
        reason = decisions["dcs"].get("dcs_reason") or "no stage compressed the model"
        final, cmp = None, None
        goal = {"max_flops": cfg.goal.max_flops, "max_latency_ms": cfg.goal.max_latency_ms, "value": None,
                "met": False, "statement": f"no compressed model could be made: {reason}"}
        arch = {"methods": []}
    else:
        final_ev = evaluate_run(final_dir, data=pipe.data, split="test", device=cfg.device, dtype=rep.dtype)
        prof = profile(pipe.base_dir, compare=final_dir, device=cfg.device, latency=rep.latency,
                       batch_size=rep.batch_size, iters=rep.iters, dtype=rep.dtype, compile=rep.compile)
        (dense_label, final_label) = list(prof["models"])
        dense = _model_record(pipe.base_dir, dense_ev, prof["models"][dense_label])
        final = _model_record(final_dir, final_ev, prof["models"][final_label])
        cmp = {"top1_change": final["test_top1"] - dense["test_top1"],
               "flops_ratio": final["macs"] / dense["macs"],
               "params_ratio": final["params"] / dense["params"],
               "file_ratio": final["file_bytes"] / dense["file_bytes"],
               "latency_speedup": None, "throughput_speedup": None}
        if cfg.report.latency:
            cmp["latency_speedup"] = dense["latency_ms"] / final["latency_ms"]
            cmp["throughput_speedup"] = final["throughput"] / dense["throughput"]
            if dense.get("latency_ms_compiled") and final.get("latency_ms_compiled"):
                cmp["latency_speedup_compiled"] = dense["latency_ms_compiled"] / final["latency_ms_compiled"]
                cmp["throughput_speedup_compiled"] = final["throughput_compiled"] / dense["throughput_compiled"]
        goal = _goal(cfg, cmp, final)
        arch = load_arch(final_dir)
        dcs_rec = next((m for m in arch["methods"] if m.get("name") == "dcs"), None)
        if cfg.stages.dcs is not None:
            decisions["dcs"] = _dcs_decisions(out, dcs_rec, dense_model)
    if cfg.stages.tokens is not None and final_dir is not None:
        decisions["tokens"] = _tokens_decisions(pipe, [m for m in arch["methods"] if m.get("name") != "dcs"])
    rm = out / "final" / "metrics.json"
    if cfg.stages.retrain is not None and rm.is_file() and final_dir == out / "final":
        r = read_json(rm)
        decisions["retrain"] = {k: r.get(k) for k in ("epochs", "eta", "warm_epochs", "kd", "feat_kd", "batch_size",
                                                      "peak_lr", "start_val_top1", "best_val_top1", "best_epoch",
                                                      "test_top1", "train_time_s")}
        decisions["retrain"]["teacher"] = cfg.stages.retrain.teacher
    decisions["methods"] = [{"name": m.get("name"), "summary": _method_summary(m) if m.get("name") != "dcs" else
                             "dcs: channels per block (see dcs)"} for m in arch["methods"]]
    int8 = None
    if cfg.export is not None and cfg.export.quantize != "none" and final_dir is not None:
        int8 = _int8(pipe, final_dir)
    summary = {"format": SUMMARY_FORMAT, "config": str((out / "config.yaml").resolve()),
               "source": str(Path(pipe.source).resolve()),
               "out": str(out.resolve()), "seed": cfg.seed, "device": prof.get("device"), "dtype": prof.get("dtype"),
               "dataset": dense_ev.get("dataset"),
               "goal": goal, "dense": dense, "final": final, "comparison": cmp, "int8": int8, "decisions": decisions,
               "stages": _stage_log(pipe),
               "written": _dt.datetime.now().astimezone().isoformat(timespec="seconds")}
    study_html = None
    if cfg.stages.tokens is not None:
        study_html = _study_report(pipe)
    summary["report"] = str((out / "report.html").resolve())
    write_json(out / "summary.json", summary)
    with atomic_path(out / "report.html") as tmp:
        tmp.write_text(build_html(summary, config_text=(out / "config.yaml").read_text(), study_html=study_html),
                       encoding="utf-8")
    return summary


def _int8(pipe: PlannedPipeline, final_dir: Path) -> dict[str, Any]:
    """The int8 rows (dense and compressed, fp32 and int8; :func:`~nascompress.export.quantize.int8_rows`):
    the compressed int8 file is the export step's, the dense one is made with the same settings."""
    from ..export.quantize import config_for, int8_rows

    cfg = pipe.cfg
    made = pipe.out / "export" / cfg.export.filename
    return int8_rows(pipe.base_dir, final_dir, compressed_int8=made if made.is_file() else None, data=pipe.data,
                     config=config_for(cfg.export.quantize), export=cfg.export.config(seed=cfg.seed),
                     batch=cfg.report.batch_size, iters=cfg.report.iters)


def int8_table_rows(s: dict[str, Any]) -> list[tuple[str, ...]]:
    """(model, runtime, test top-1, file size, latency, throughput) rows of the summary's int8 section."""
    rows = []
    for r in (s.get("int8") or {}).get("rows", []):
        if "failed" in r:
            rows.append((r["model"], r["runtime"], "not kept: " + r["failed"], "-", "-", "-"))
            continue
        rows.append((r["model"], r["runtime"], f"{r['test_top1']:.2f}%", _mb(r["file_bytes"]),
                     f"{r['latency_ms']:.2f} ms", f"{r['throughput']:.1f} img/s"))
    return rows


def _goal(cfg: Any, cmp: dict[str, Any], final: dict[str, Any]) -> dict[str, Any]:
    if cfg.goal.max_flops is not None:
        met = cmp["flops_ratio"] <= cfg.goal.max_flops + 1e-9
        goal = {"max_flops": cfg.goal.max_flops, "value": cmp["flops_ratio"], "met": met}
        if not met:
            goal["statement"] = (f"the final model has {cmp['flops_ratio']:.3f}x the dense FLOPs, above the goal "
                                 f"{cfg.goal.max_flops:g}x: no model the stages could make meets it")
        return goal
    lat = final.get("latency_ms")
    goal = {"max_latency_ms": cfg.goal.max_latency_ms, "value": lat,
            "met": None if lat is None else lat <= cfg.goal.max_latency_ms}
    if goal["met"] is False:
        goal["statement"] = (f"the final model takes {lat:.2f} ms at batch 1, above the goal "
                             f"{cfg.goal.max_latency_ms:g} ms: no model the stages could make meets it")
    return goal


def _base_decisions(pipe: PlannedPipeline) -> dict[str, Any]:
    b = pipe.cfg.base
    res: dict[str, Any] = {"kind": b.kind if not (b.kind == "import" and b.import_.linear_probe) else "import+probe",
                           "run": str(pipe.base_dir)}
    m = pipe.base_dir / "metrics.json"
    if m.is_file():
        bm = read_json(m)
        res.update({k: bm[k] for k in ("best_val_top1", "test_top1", "epochs", "l2", "train_time_s") if k in bm})
    return res


def _study_report(pipe: PlannedPipeline) -> str | None:
    """The study's own report (written to tokens/report.html); returns its HTML."""
    from ..studies.inspect import load
    from ..studies.report import build_report

    spec, study = load(pipe.cfg.stages.tokens.study, pipe.storage)
    text = build_report(study, storage_display=spec.display)
    with atomic_path(pipe.out / "tokens" / "report.html") as tmp:
        tmp.write_text(text, encoding="utf-8")
    return text


# ---------------------------------------------------------------------------------------------
# Formatting (terminal and HTML)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _speed(x: float) -> str:
    return f"{x:.2f}x faster" if x >= 1 else f"{1 / x:.2f}x slower"


def comparison_rows(s: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(metric, dense, final, change) rows of the comparison, as text."""
    d, f, c = s["dense"], s["final"], s["comparison"]
    if f is None:  # no compressed model could be made
        return [("test top-1", f"{d['test_top1']:.2f}%", "-", "-"), ("FLOPs / image", f"{d['macs'] / 1e6:.2f} M", "-", "-")]
    rows = [("test top-1", f"{d['test_top1']:.2f}%", f"{f['test_top1']:.2f}%", f"{c['top1_change']:+.2f} points"),
            ("test loss", f"{d['test_loss']:.4f}", f"{f['test_loss']:.4f}", f"{f['test_loss'] - d['test_loss']:+.4f}"),
            ("FLOPs / image", f"{d['macs'] / 1e6:.2f} M", f"{f['macs'] / 1e6:.2f} M", f"{c['flops_ratio']:.3f}x"),
            ("parameters", f"{d['params']:,}", f"{f['params']:,}", f"{c['params_ratio']:.3f}x"),
            ("file size", _mb(d["file_bytes"]), _mb(f["file_bytes"]), f"{c['file_ratio']:.3f}x")]
    if c.get("latency_speedup") is not None:
        rows.append((f"latency, batch {d['latency_batch']}", f"{d['latency_ms']:.2f} ms", f"{f['latency_ms']:.2f} ms",
                     _speed(c["latency_speedup"])))
        rows.append((f"throughput, batch {d['throughput_batch']}", f"{d['throughput']:.1f} img/s",
                     f"{f['throughput']:.1f} img/s", _speed(c["throughput_speedup"])))
    if c.get("latency_speedup_compiled") is not None:
        rows.append((f"latency, batch {d['latency_batch']}, compiled", f"{d['latency_ms_compiled']:.2f} ms",
                     f"{f['latency_ms_compiled']:.2f} ms", _speed(c["latency_speedup_compiled"])))
        rows.append((f"throughput, batch {d['throughput_batch']}, compiled", f"{d['throughput_compiled']:.1f} img/s",
                     f"{f['throughput_compiled']:.1f} img/s", _speed(c["throughput_speedup_compiled"])))
    return rows


def goal_text(s: dict[str, Any]) -> str:
    g = s["goal"]
    if g.get("value") is None and g.get("statement"):
        return f"NOT met: {g['statement']}"
    if g.get("max_flops") is not None:
        return f"FLOPs <= {g['max_flops']:g}x the dense base: {g['value']:.3f}x, {'met' if g['met'] else 'NOT met'}"
    if g["value"] is None:
        return f"latency <= {g['max_latency_ms']:g} ms at batch 1: not measured (report.latency is off)"
    return (f"latency <= {g['max_latency_ms']:g} ms at batch 1: {g['value']:.2f} ms, "
            f"{'met' if g['met'] else 'NOT met'}")


def dcs_rows(s: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(block, MLP channels kept, Q/K channels kept per head) rows of the DCS decision."""
    dcs = s["decisions"].get("dcs")
    if not dcs or not dcs.get("blocks"):
        return []
    rows = []
    for b in dcs["blocks"]:
        qk = "all" if b["qk_kept"] is None else f"{' '.join(map(str, b['qk_kept']))} of {b['head_dim']}"
        rows.append((str(b["block"]), f"{b['mlp_kept']} of {b['mlp_total']}", qk))
    return rows


def dcs_column(s: dict[str, Any]) -> str:
    """The heading of the DCS table's MLP column: what the family gates."""
    hidden = (s["decisions"].get("dcs") or {}).get("mlp_gates") == "hidden"
    return "MLP hidden neurons" if hidden else "MLP residual channels"


def decision_lines(s: dict[str, Any]) -> list[str]:
    """The decisions other than the per-block DCS table, one line each."""
    dec, lines = s["decisions"], []
    base = dec.get("base", {})
    if base:
        acc = f", test top-1 {base['test_top1']:.2f}%" if base.get("test_top1") is not None else ""
        lines.append(f"base: {base['kind']} {base['run']}{acc}")
    dcs = dec.get("dcs")
    if dcs and dcs.get("dcs_outcome") == "skipped":
        lines.append(f"dcs: the search collapsed at the planned target {dcs.get('planned_target')}x and at the milder "
                     f"one; the pipeline went on without DCS ({dcs.get('dcs_reason')})")
    elif dcs and dcs.get("blocks") is not None:
        move = dcs.get("calibration_move")
        cal = ((" (threshold calibrated)" if move is None else f" (threshold calibrated by {move:.3f})")
               if dcs.get("calibrated") else "")
        if dcs.get("at_target_share") is not None:
            cal += f", at the target for {dcs['at_target_share']:.0%} of the search"
        ratio = f", landed at {dcs['flops_ratio']:.3f}x{cal}" if dcs.get("flops_ratio") is not None else ""
        what = "hidden neurons" if dcs.get("mlp_gates") == "hidden" else "residual channels"
        lines.append(f"dcs: target {dcs.get('target_flops')}x dense FLOPs{ratio}; MLP {what} kept "
                     f"{dcs['mlp_kept_total']} of {dcs['mlp_total']}; Q/K mask {dcs['config'].get('qk_mask')}")
        if dcs.get("family_reason"):
            lines.append(f"  MLP gates {dcs['family_reason']}")
        if dcs.get("dcs_outcome") == "milder":
            lines.append(f"  the search at the planned target {dcs.get('planned_target')}x collapsed; retried at "
                         f"{dcs.get('dcs_target')}x ({dcs.get('dcs_reason')})")
    tok = dec.get("tokens")
    if tok:
        acc, ratio = tok.get("trial_accuracy"), tok.get("trial_flops_ratio")
        lines.append(f"tokens: study {tok['study']!r}, {tok.get('trials_complete')} trials; picked trial "
                     f"{tok.get('picked_trial')} by {tok['pick_rule']} ("
                     + ("" if acc is None else f"accuracy {acc:.2f}% on the search's images, ")
                     + ("" if ratio is None else f"FLOPs {ratio:.3f}x") + ")")
        if tok.get("params"):
            lines.append("  params: " + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                                  for k, v in tok["params"].items()))
        for m in tok["methods"]:
            lines.append(f"  {m['summary']}")
    rt = dec.get("retrain")
    if rt:
        extra = "" if rt.get("batch_size") is None else f", batch {rt['batch_size']}, feature KD {rt.get('feat_kd')}"
        lines.append(f"retrain: {rt['epochs']} epochs, eta {rt['eta']:g} ({rt['warm_epochs']} CE-only), teacher "
                     f"{rt['teacher']}{extra}, best epoch {rt['best_epoch']}, test top-1 {rt['test_top1']:.2f}%")
    return lines


def _table(head: list[str], rows: list[tuple[Any, ...]], table_id: str) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f'<table id="{table_id}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _study_fragment(text: str) -> str:
    """The body of the study's report, its title demoted to a section heading."""
    body = text.split("<body>", 1)[-1].rsplit("</body>", 1)[0]
    if body.startswith("<h1>"):
        end = body.index("</h1>")
        body = f"<h2>{body[4:end]}</h2>" + body[end + 5:]
    return f'<section id="study">{body}</section>'


def build_html(s: dict[str, Any], *, config_text: str, study_html: str | None = None) -> str:
    """The pipeline's report: one self-contained HTML file (no external resources)."""
    from ..studies.report import REPORT_CSS

    meta = [("config", s["source"]), ("output", s["out"]), ("dataset", s.get("dataset")), ("seed", s["seed"]),
            ("device", s.get("device")), ("goal", goal_text(s)), ("written", s["written"])]
    dl = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd>" for k, v in meta if v is not None)
    parts = [f"<h1>nascompress pipeline: {html.escape(Path(s['source']).name)}</h1><dl>{dl}</dl>",
             "<h2>Result against the dense base</h2>",
             _table(["", "dense base", "compressed", "change"], comparison_rows(s), "comparison"),
             '<p class="note">Same test images for both; FLOPs counted as the papers count them (one multiply-add '
             "= one FLOP, attention matmuls included); latency and throughput measured interleaved in one process "
             "(medians).</p>",
             *(["<h2>int8 (ONNX Runtime, CPU) against fp32 (PyTorch)</h2>",
                _table(["model", "runtime", "test top-1",  "file size",
                        f"latency, batch {s['int8']['latency_batch']}",
                        f"throughput, batch {s['int8']['throughput_batch']}"], int8_table_rows(s), "int8"),
                '<p class="note">The four models timed interleaved in one process (medians); the dense int8 file is '
                "made with the export's quantize settings for this comparison.</p>"] if s.get("int8") else []),
             "<h2>Decisions</h2>",
             "<ul>" + "".join(f"<li>{html.escape(line.strip())}</li>" for line in decision_lines(s)) + "</ul>"]
    rows = dcs_rows(s)
    if rows:
        parts += ["<h3>DCS: channels kept per block</h3>",
                  _table(["block", dcs_column(s), "Q/K channels per head"], rows, "dcs-blocks")]
    methods = s["decisions"].get("tokens", {}).get("methods") or []
    if methods:
        rows2 = [(m["name"], m["summary"].split(": ", 1)[-1]) for m in methods]
        parts += ["<h3>Token / attention methods of the final model</h3>",
                  _table(["method", "settings"], rows2, "token-methods")]
    stage_rows = [(r["step"], r["what"], "" if r["seconds"] is None else f"{r['seconds']:.1f}", r["dir"] or "")
                  for r in s["stages"]]
    parts += ["<h2>Stages</h2>", _table(["step", "what", "seconds", "directory"], stage_rows, "stages"),
              "<h2>Config</h2>", f"<pre>{html.escape(config_text)}</pre>"]
    if study_html:
        parts.append(_study_fragment(study_html))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>nascompress pipeline</title>'
            f'<link rel="icon" href="data:,"><style>{REPORT_CSS}pre{{background:#f7f7f7;padding:6px;overflow-x:auto}}'
            f'td:first-child,#stages td,#token-methods td{{text-align:left}}</style></head>'
            f'<body>{"".join(parts)}</body></html>\n')


__all__ = ["build_html", "comparison_rows", "int8_table_rows", "dcs_rows", "dcs_column", "decision_lines", "goal_text",
           "write_summary"]
