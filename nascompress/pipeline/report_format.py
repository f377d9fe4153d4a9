"""A pipeline summary (``OUT/summary.json``, :func:`nascompress.pipeline.report.write_summary`) as the
terminal prints it and as one self-contained HTML file (:func:`build_html`): the comparison with the
dense base, the int8 rows, the DCS channels per block, every decision and the stages."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Mapping

from ..profiling.compare import speed_text, times_text
from ..studies.report import REPORT_CSS
from .dense_reference import reference_html
from .stage import registered_stages
from .summary import BaseDecision, Goal, Summary


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def comparison_rows(s: Summary) -> list[tuple[str, str, str, str]]:
    """(metric, dense, final, change) rows of the comparison, as text: the final model against the
    dense base in the one ratio convention (:mod:`nascompress.profiling.compare`)."""
    d, f, c = s.dense, s.final, s.comparison
    top1 = "test top-1" + ("" if d.test_n is None else f" ({d.test_n} images)")
    if f is None:  # no compressed model could be made
        return [(top1, f"{d.test_top1:.2f}%", "-", "-"), ("FLOPs / image", f"{d.macs / 1e6:.2f} M", "-", "-")]
    rows = [
        (top1, f"{d.test_top1:.2f}%", f"{f.test_top1:.2f}%", f"{c.top1_change:+.2f} points"),
        ("test loss", f"{d.test_loss:.4f}", f"{f.test_loss:.4f}", f"{f.test_loss - d.test_loss:+.4f}"),
        ("FLOPs / image", f"{d.macs / 1e6:.2f} M", f"{f.macs / 1e6:.2f} M", times_text(c.flops_ratio, "FLOPs")),
        ("parameters", f"{d.params:,}", f"{f.params:,}", times_text(c.params_ratio, "parameters")),
        ("file size", _mb(d.file_bytes), _mb(f.file_bytes), times_text(c.file_ratio, "size")),
    ]
    timed = [("", "", c.latency_speedup, c.throughput_speedup)]
    timed.append(("_compiled", ", compiled", c.latency_speedup_compiled, c.throughput_speedup_compiled))
    for suffix, how, lat, tp in timed:
        if lat is None:
            continue
        key = f"latency_ms{suffix}"
        rows.append(
            (
                f"latency, batch {d.latency_batch}{how}",
                f"{getattr(d, key):.2f} ms",
                f"{getattr(f, key):.2f} ms",
                speed_text(lat),
            )
        )
        key = f"throughput{suffix}"
        rows.append(
            (
                f"throughput, batch {d.throughput_batch}{how}",
                f"{getattr(d, key):.1f} img/s",
                f"{getattr(f, key):.1f} img/s",
                speed_text(tp),
            )
        )
    return rows


def models_note(s: Summary) -> str:
    """Which runs the comparison's columns are, and on what it was measured."""
    d, f = s.dense, s.final
    both = f"dense base {d.run or ''}" + ("" if f is None else f"; compressed {f.run or ''}")
    n = "" if d.test_n is None else f" {d.test_n}"  # a summary written before the count was kept
    return (
        f"{both}. The same{n} test images for both; 'change' is the compressed model against the "
        "dense base (x the FLOPs: below 1 is smaller; x faster: above 1 is faster)."
    )


def goal_text(s: Summary) -> str:
    g = s.goal
    if g.value is None and g.statement:
        return f"NOT met: {g.statement}"
    if g.max_flops is not None:
        return f"FLOPs <= {g.max_flops:g}x the dense base: {g.value:.3f}x, {_verdict(g, 'x', 4)}"
    if g.value is None:
        return f"latency <= {g.max_latency_ms:g} ms at batch 1: not measured (report.latency is off)"
    return f"latency <= {g.max_latency_ms:g} ms at batch 1: {g.value:.2f} ms, {_verdict(g, ' ms', 2)}"


def _verdict(g: Goal, unit: str, digits: int) -> str:
    """``met`` or ``NOT met``, with by how much a goal was missed (``missed_by``, :mod:`.goal`)."""
    if g.met:
        return "met"
    return "NOT met" if g.missed_by is None else f"NOT met (above it by {g.missed_by:.{digits}f}{unit})"


def dcs_rows(s: Summary) -> list[tuple[str, str, str]]:
    """(block, MLP channels kept, Q/K channels kept per head) rows of the DCS decision."""
    dcs = s.decisions.dcs
    if dcs is None or not dcs.blocks:
        return []
    rows = []
    for b in dcs.blocks:
        qk = "all" if b.qk_kept is None else f"{' '.join(map(str, b.qk_kept))} of {b.head_dim}"
        rows.append((str(b.block), f"{b.mlp_kept} of {b.mlp_total}", qk))
    return rows


def dcs_column(s: Summary) -> str:
    """The heading of the DCS table's MLP column: what the family gates."""
    hidden = s.decisions.dcs is not None and s.decisions.dcs.mlp_gates == "hidden"
    return "MLP hidden neurons" if hidden else "MLP residual channels"


def decision_lines(s: Summary) -> list[str]:
    """The decisions other than the per-block DCS table, one line each: the base's, then each
    registered stage's (:attr:`~nascompress.pipeline.stage.PipelineStage.report_lines`) in its order."""
    lines = _base_lines(s.decisions.base)
    for stage in registered_stages():
        if stage.report_lines is not None:
            lines += stage.report_lines(s.decisions)
    return lines


def _base_lines(base: BaseDecision | None) -> list[str]:
    if base is None:
        return []
    acc = "" if base.test_top1 is None else f", test top-1 {base.test_top1:.2f}%{on_images(base.test_n)}"
    if base.trained_test_top1 is not None and base.trained_test_n != base.test_n:
        acc += (
            f" (when trained: {base.trained_test_top1:.2f}%{on_images(base.trained_test_n)}, "
            "not the images of this comparison)"
        )
    return [f"base: {base.kind} {base.run}{acc}"]


def method_summary(rec: Mapping[str, Any]) -> str:
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


def on_images(n: int | None) -> str:
    """`` on N images`` where the count is known."""
    return "" if n is None else f" on {n} images"


def _on_threads(n: Any) -> str:
    """Which thread count gave a figure (int8_rows keeps each row's faster of default and one thread)."""
    return " (1 thread)" if n == 1 else ""


def int8_table_rows(s: Summary) -> list[tuple[str, ...]]:
    """(model, runtime, test top-1, file size, latency, throughput) rows of the summary's int8 section."""
    rows = []
    for r in () if s.int8 is None else s.int8.rows:
        if r.failed is not None:
            rows.append((r.model, r.runtime, "not kept: " + r.failed, "-", "-", "-"))
            continue
        rows.append(
            (
                r.model,
                r.runtime,
                f"{r.test_top1:.2f}%{on_images(r.test_n)}",
                _mb(r.file_bytes),
                f"{r.latency_ms:.2f} ms" + _on_threads(r.latency_threads),
                f"{r.throughput:.1f} img/s" + _on_threads(r.throughput_threads),
            )
        )
    return rows


def _table(head: list[str], rows: list[tuple[Any, ...]], table_id: str) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f'<table id="{table_id}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _study_fragment(text: str) -> str:
    """The body of the study's report, its title demoted to a section heading."""
    body = text.split("<body>", 1)[-1].rsplit("</body>", 1)[0]
    if body.startswith("<h1>"):
        end = body.index("</h1>")
        body = f"<h2>{body[4:end]}</h2>" + body[end + 5 :]
    return f'<section id="study">{body}</section>'


def build_html(s: Summary, *, config_text: str, study_html: str | None = None) -> str:
    """The pipeline's report: one self-contained HTML file (no external resources)."""
    meta = [
        ("config", s.source),
        ("output", s.out),
        ("dataset", s.dataset),
        ("seed", s.seed),
        ("device", s.device),
        ("goal", goal_text(s)),
        ("written", s.written),
    ]
    dl = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd>" for k, v in meta if v is not None)
    parts = [
        f"<h1>nascompress pipeline: {html.escape(Path(s.source).name)}</h1><dl>{dl}</dl>",
        "<h2>Result against the dense base</h2>",
        _table(["", "dense base", "compressed", "change"], comparison_rows(s), "comparison"),
        f'<p class="note">{html.escape(models_note(s))} FLOPs counted as the papers count them (one multiply-add '
        "= one FLOP, attention matmuls included); latency and throughput measured interleaved in one process "
        "(medians).</p>",
        *reference_html(s),  # the splits that decided and measured; the dense reference (report.dense_reference)
        *(
            [
                "<h2>int8 (ONNX Runtime, CPU) against fp32 (PyTorch)</h2>",
                _table(
                    [
                        "model",
                        "runtime",
                        "test top-1",
                        "file size",
                        f"latency, batch {s.int8.latency_batch}",
                        f"throughput, batch {s.int8.throughput_batch}",
                    ],
                    int8_table_rows(s),
                    "int8",
                ),
                '<p class="note">The four models timed interleaved in one process (medians); the dense int8 file is '
                "made with the export's quantize settings for this comparison.</p>",
            ]
            if s.int8 is not None
            else []
        ),
        "<h2>Decisions</h2>",
        "<ul>" + "".join(f"<li>{html.escape(line.strip())}</li>" for line in decision_lines(s)) + "</ul>",
    ]
    rows = dcs_rows(s)
    if rows:
        parts += [
            "<h3>DCS: channels kept per block</h3>",
            _table(["block", dcs_column(s), "Q/K channels per head"], rows, "dcs-blocks"),
        ]
    methods = () if s.decisions.tokens is None else s.decisions.tokens.methods
    if methods:
        rows2 = [(m.name, m.summary.split(": ", 1)[-1]) for m in methods]
        parts += [
            "<h3>Token / attention methods of the final model</h3>",
            _table(["method", "settings"], rows2, "token-methods"),
        ]
    stage_rows = [(r.step, r.what, "" if r.seconds is None else f"{r.seconds:.1f}", r.dir or "") for r in s.stages]
    parts += [
        "<h2>Stages</h2>",
        _table(["step", "what", "seconds", "directory"], stage_rows, "stages"),
        "<h2>Config</h2>",
        f"<pre>{html.escape(config_text)}</pre>",
    ]
    if study_html:
        parts.append(_study_fragment(study_html))
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>nascompress pipeline</title>'
        f'<link rel="icon" href="data:,"><style>{REPORT_CSS}pre{{background:#f7f7f7;padding:6px;overflow-x:auto}}'
        f"td:first-child,#stages td,#token-methods td{{text-align:left}}</style></head>"
        f"<body>{''.join(parts)}</body></html>\n"
    )
