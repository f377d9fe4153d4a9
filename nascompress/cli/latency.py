"""``nascompress latency-table RUN_OR_MODEL --batch 1 --dtype fp32``: the device's latency table for a
model's geometry, from the cache or measured (thin)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from nascompress.cli.common import out, print_json, run, setting_option, settings_command
from nascompress.cli.options import JsonOut, out_option
from nascompress.profiling.latency_table_run import LatencyTableConfig, latency_table_for
from nascompress.train.config import TrainConfig


@settings_command(settings=LatencyTableConfig)
def latency_table(
    target: Annotated[
        str, typer.Argument(help="A run directory, a model.safetensors, or a timm model name (random weights).")
    ],
    *,
    settings: LatencyTableConfig,  # --batch --dtype --iters --rebuild
    device: setting_option(TrainConfig, "device") = TrainConfig.device,
    out_file: out_option("Also write the table's JSON to this file.") = None,
    json_out: JsonOut = False,
) -> None:
    """Measure (or show the cached) table of block latencies for the model's geometry on this device
    (attention by kept heads and Q/K width, MLP by hidden width, at a few token counts; the fixed part;
    the per-block overhead), and the model's latency predicted from it."""
    res = run(latency_table_for, target, config=settings, device=device, out=out_file)
    t = res.table
    if json_out:
        print_json(res.to_dict())
        return
    g = t.geometry
    out.print(
        f"latency table ({'measured now' if res.measured else 'cached'}): {res.cache}",
        highlight=False,
        soft_wrap=True,
    )
    if res.out is not None:
        out.print(f"wrote {res.out}", highlight=False, soft_wrap=True)
    fp = t.fingerprint
    out.print(
        f"{fp.gpu or fp.cpu} ({fp.device_type}, {fp.threads} threads), {t.dtype}, batch {t.batch}; "
        f"N={g.tokens} C={g.embed_dim} heads={g.num_heads} head_dim={g.head_dim} hidden={g.mlp_hidden} depth={g.depth}",
        highlight=False,
        soft_wrap=True,
    )
    full = t.tokens.index(g.tokens)
    tab = Table(title=f"ms at N={g.tokens}")
    for col in ("part", "width", "ms"):
        tab.add_column(col, justify="right")
    tab.add_row("fixed (embed, norm, head)", "", f"{t.fixed_ms:.3f}")
    tab.add_row("block overhead", "", f"{t.block_overhead_ms:.3f}")
    for j, h in enumerate(t.heads):
        tab.add_row("attention", f"{h} heads x {t.qk[-1]} Q/K", f"{t.attn_ms[full][j][-1]:.3f}")
    for k, q in enumerate(t.qk[:-1]):
        tab.add_row("attention", f"{t.heads[-1]} heads x {q} Q/K", f"{t.attn_ms[full][-1][k]:.3f}")
    for j, w in enumerate(t.hidden):
        tab.add_row("mlp", f"{w} hidden", f"{t.mlp_ms[full][j]:.3f}")
    out.print(tab)
    out.print(
        f"dense model measured {t.dense_ms:.2f} ms; this model predicted {res.predicted_ms:.2f} ms", highlight=False
    )


def register(app: typer.Typer) -> None:
    app.command("latency-table")(latency_table)
