"""``nascompress materialize``: a finished DCS search -> a physically smaller model (thin)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import out, print_json, run


def register(app: typer.Typer) -> None:
    @app.command()
    def materialize(
        search_dir: Annotated[Path, typer.Argument(help="The --out directory of a finished 'nascompress search dcs'.")],
        out_dir: Annotated[Path, typer.Option("--out", help="Run directory for the compact model.")] = Path(
            "runs/dcs_mat"),
        force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --out.")] = False,
        json_out: Annotated[bool, typer.Option("--json", help="Print metrics as JSON.")] = False,
    ) -> None:
        """Gather the selected channels into a smaller model (model.safetensors + arch.json)."""
        from nascompress.search.materialize import MaterializeJob, materialize_search

        metrics = run(materialize_search, MaterializeJob(search_dir=str(search_dir), out=str(out_dir)), force=force)
        if json_out:
            print_json(metrics)
        else:
            ratio = metrics["flops_ratio_vs_dense"]
            out.print(f"materialized: {metrics['macs'] / 1e6:.2f} MFLOPs"
                      + (f" ({ratio:.3f}x dense)" if ratio else "")
                      + f", {metrics['params'] / 1e6:.3f} M params, max logit diff vs supernet "
                      f"{metrics['max_abs_logit_diff']:.1e}  -> {out_dir}")
