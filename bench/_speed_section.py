"""The speed tables (README block and docs/results.md summary), generated from ``bench/results/speed_*.json``
(``bench/speed.py``) by ``bench/make_results.py``; no torch here."""

from __future__ import annotations

from typing import Any

SPEED_START, SPEED_END = "<!-- speed-table:start -->", "<!-- speed-table:end -->"
ORDER = (  # the rows' order: channel-pruned models, token methods, the pipeline's model
    "dcs_0.6x",
    "dcs_0.6x_unaligned",
    "uniform_0.6x",
    "torch_pruning_0.6x",
    "evit_0.7",
    "tome",
    "dynamicvit_0.7",
    "sparsifiner",
    "sparsifiner_block",
    "mgvit",
    "pipeline_final",
)


def speed_files(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``speed_*.json`` results written by ``bench/speed.py`` (their ``runs``)."""
    return {
        k: v
        for k, v in data.items()
        if k.startswith("speed_") and k.endswith(".json") and isinstance(v, dict) and "runs" in v
    }


def _cell(row: dict[str, Any] | None) -> str:
    if not row:
        return "-"
    return f"{row['speedup']:.2f}x ({row['realized_share']:.2f})"


def run_tables(name: str, key: str, run: dict[str, Any]) -> list[str]:
    """One geometry of one file: a table per dtype, a column per (mode, batch), a row per model."""
    out: list[str] = []
    rows = run.get("rows", [])
    for dtype in run.get("dtypes", []):
        mine = [r for r in rows if r["dtype"] == dtype]
        if not mine:
            continue
        cols = sorted({(r["mode"], r["batch"]) for r in mine}, key=lambda c: (c[0] != "eager", c[1]))
        by = {(r["model"], r["mode"], r["batch"]): r for r in mine}
        models = [m for m in ORDER if any(r["model"] == m for r in mine)]
        models += sorted({r["model"] for r in mine} - set(models))
        quick = ", quick mode (a code-path check, not a measurement)" if run.get("quick") else ""
        out += [
            f"`{name}`, {key} ({run.get('device_name', run.get('device'))}, {run.get('threads')} threads, "
            f"{dtype}, {run.get('weights')} weights{quick}): speed-up against dense, realized share of the FLOPs "
            "cut in brackets (speed-up x FLOPs ratio; 1.00: speed follows FLOPs)",
            "",
            "| model | settings | FLOPs | " + " | ".join(f"{m} batch {b}" for m, b in cols) + " |",
            "|---|---|---|" + "---|" * len(cols),
        ]
        for m in models:
            first = next(r for r in mine if r["model"] == m)
            cells = [_cell(by.get((m, mode, b))) for mode, b in cols]
            settings = first["settings"].replace("|", "/")
            out.append(f"| {m} | {settings} | {first['flops_ratio']:.2f}x | " + " | ".join(cells) + " |")
        out.append("")
    skipped = run.get("skipped") or []
    if skipped:
        out += [f"Skipped by the time guard: {len(skipped)} cells or compiles (listed in the JSON).", ""]
    return out


def speed_table(data: dict[str, Any]) -> list[str]:
    """The lines between the README's speed markers (and the docs/results.md summary)."""
    files = speed_files(data)
    if not files:
        return [
            "(not measured yet: `python bench/speed.py --model mainjob` on a quiet CPU, "
            "`python bench/speed.py --gpu` on a GPU)"
        ]
    out: list[str] = []
    for name, d in sorted(files.items()):
        for key, run in d["runs"].items():
            out += run_tables(name, key, run)
    while out and out[-1] == "":
        out.pop()
    return out


def speed_summary(data: dict[str, Any]) -> list[str]:
    return speed_table(data) + [""]
