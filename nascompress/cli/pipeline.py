"""``nascompress pipeline CONFIG.yaml --out DIR``: every stage from one config file (thin)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from nascompress.cli.common import err, out, print_json, run, setting_option
from nascompress.cli.options import JsonOut, force_option, out_option
from nascompress.config import StageSettings
from nascompress.train.config import TrainConfig
from nascompress.pipeline import run_pipeline
from nascompress.pipeline.summary import Summary
from nascompress.pipeline.report_format import (
    comparison_rows,
    dcs_column,
    dcs_rows,
    decision_lines,
    goal_text,
    int8_table_rows,
    models_note,
)

# --seed: the file's seed (the pipeline's top-level seed key, TrainConfig's) replaced
FILE_SEED = StageSettings(
    TrainConfig, ("seed",), no_default=("seed",), notes={"seed": "Default: the file's (it drives every stage)."}
)

EPILOG = (
    "Example: nascompress pipeline configs/fashion-mnist.yaml --out runs/pipeline  "
    "(rerun the same command after a crash or Ctrl-C: it continues where it stopped)"
)


def register(app: typer.Typer) -> None:
    @app.command(epilog=EPILOG)
    def pipeline(
        config: Annotated[
            Path,
            typer.Argument(
                help=(
                    "Pipeline file (format nascompress-pipeline/1), or the name of a shipped one (demo, fashion-mnist; "
                    "nascompress/configs/)."
                )
            ),
        ],
        out_dir: out_option("Pipeline directory (an earlier run of the same config is continued)."),
        seed: setting_option(FILE_SEED, "seed") = None,
        force: force_option(
            "Start over in --out (a pipeline folder nascompress wrote: its files are replaced)."
        ) = False,
        json_out: JsonOut = False,
    ) -> None:
        """One command from a model to a slim, faster model: base, DCS channels, a token-method
        search picked under the goal, retraining, and a report against the dense base."""

        def log(msg: str) -> None:
            err.print(f"[bold]pipeline[/bold] {escape(msg)}", highlight=False, soft_wrap=True)  # text, not markup

        def go():
            try:
                return run_pipeline(config, out=out_dir, force=force, seed=seed, progress=not json_out, log=log)
            except KeyboardInterrupt:
                err.print("interrupted; rerun the same command to continue where it stopped")
                raise typer.Exit(code=130) from None

        summary = run(go)
        if json_out:
            print_json(summary.to_dict())
            return
        show(summary)


def show(s: Summary) -> None:
    """The summary as rich tables: the comparison, the DCS channels per block, the decisions."""
    t = Table(title=f"{Path(s.source).name}: compressed vs dense base ({s.dataset}, {s.device})")
    for col in ("", "dense base", "compressed", "change"):
        t.add_column(col, justify="left" if not col else "right")
    for row in comparison_rows(s):
        t.add_row(*row)
    out.print(t)
    out.print(models_note(s), highlight=False, soft_wrap=True)  # the runs' paths whole, not wrapped to the table
    out.print(f"goal: {goal_text(s)}", highlight=False)
    if s.int8 is not None:
        q = Table(title="int8 (ONNX Runtime, CPU) against fp32 (PyTorch), timed interleaved")
        for col in (
            "model",
            "runtime",
            "test top-1",
            "file size",
            f"latency b{s.int8.latency_batch}",
            f"throughput b{s.int8.throughput_batch}",
        ):
            q.add_column(col, justify="left" if col in ("model", "runtime") else "right")
        for row in int8_table_rows(s):
            q.add_row(*row)
        out.print(q)
    rows = dcs_rows(s)
    if rows:
        d = Table(title="DCS: channels kept per block")
        for col in ("block", dcs_column(s), "Q/K channels per head"):
            d.add_column(col, justify="right")
        for row in rows:
            d.add_row(*row)
        out.print(d)
    for line in decision_lines(s):
        out.print(line, highlight=False, soft_wrap=True)
    out.print(f"report: {s.report}   summary: {Path(s.out) / 'summary.json'}", highlight=False, soft_wrap=True)
