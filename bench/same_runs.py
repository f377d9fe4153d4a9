"""Whether two runs of a pipeline (the README main job, the demo) are the same bit for bit: every model
file of the pipeline's steps (each ``model.safetensors`` under the two folders: base, dcs_search, dcs_mat,
tokens/picked, final ...) tensor for tensor, and the pipeline's ``summary.json`` key for key except what a
second run cannot repeat (timings, its own paths). With ``--files`` RUN_A and RUN_B are two safetensors
files (e.g. the tensors a Python API example saved) compared tensor for tensor. Used to check that a
change of the code's form (issue 51's refactor, issue 66's) left the results unchanged.

Usage (from the repository root)::

    python bench/same_runs.py RUN_A RUN_B --label-a "..." --label-b "..." --out bench/results/same_runs.json

RUN_A and RUN_B are ``nascompress pipeline ... --out`` directories. The file safetensors' metadata is not
compared (it holds the arch record, whose form the refactor may change); the tensors are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _common import header, save  # (first: puts the repository on sys.path)
import torch
from safetensors.torch import load_file

# what a second run cannot repeat: its timings (latency and throughput are measured, not computed), the
# clock, and its own paths
VARIABLE = (
    "train_time_s",
    "search_time_s",
    "wall_s",
    "stage_seconds",
    "seconds",
    "finished",
    "written",
    "latency_ms",
    "throughput",
    "latency_speedup",
    "throughput_speedup",
    "run",
    "storage",
    "config",
    "out",
    "dir",
    "report",
    "source",
)


def tensors_equal(a: Path, b: Path) -> dict[str, Any]:
    missing = [str(p) for p in (a, b) if not p.is_file()]
    if missing:
        return {"tensors": 0, "same_names": False, "differ": [], "missing": missing, "identical": False}
    ta, tb = load_file(a), load_file(b)
    differ = sorted(k for k in ta.keys() & tb.keys() if not torch.equal(ta[k], tb[k]))
    return {
        "tensors": len(ta),
        "same_names": ta.keys() == tb.keys(),
        "differ": differ[:20],
        "identical": ta.keys() == tb.keys() and not differ,
    }


def differences(x: Any, y: Any, path: str = "") -> list[str]:
    """Paths where two JSON values differ, skipping keys a rerun cannot repeat (:data:`VARIABLE`)."""
    if isinstance(x, dict) and isinstance(y, dict):
        out = []
        for k in sorted(set(x) | set(y)):
            if k in VARIABLE:
                continue
            if k not in x or k not in y:
                out.append(f"{path}/{k} (one side only)")
            else:
                out += differences(x[k], y[k], f"{path}/{k}")
        return out
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        return [d for i, (u, v) in enumerate(zip(x, y)) for d in differences(u, v, f"{path}[{i}]")]
    return [] if x == y else [path]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--label-a", required=True, help="what RUN_A ran (commit, patch)")
    ap.add_argument("--label-b", required=True, help="what RUN_B ran")
    ap.add_argument("--out", default="bench/results/same_runs.json")
    ap.add_argument("--files", action="store_true", help="RUN_A and RUN_B are two safetensors files")
    a = ap.parse_args()
    if a.files:
        same = tensors_equal(a.run_a, a.run_b)
        save(a.out, {**header(), "a": a.label_a, "b": a.label_b, "tensors": same, "bit_for_bit": same["identical"]})
        print(f"bit for bit: {same['identical']} ({same['tensors']} tensors; differ: {same['differ'] or 'none'})")
        return
    steps = sorted(
        {str(p.parent.relative_to(r)) for r in (a.run_a, a.run_b) for p in r.rglob("model.safetensors")}
    )  # every step's model, in either run (one in one run only: a difference)
    models = {s: tensors_equal(a.run_a / s / "model.safetensors", a.run_b / s / "model.safetensors") for s in steps}
    sa, sb = (json.loads((r / "summary.json").read_text()) for r in (a.run_a, a.run_b))
    summary_diff = differences(sa, sb)
    result = {
        **header(),
        "a": a.label_a,
        "b": a.label_b,
        "models": models,
        "summary_differences": summary_diff,
        "test_top1": {
            "a": [sa["dense"]["test_top1"], sa["final"]["test_top1"]],
            "b": [sb["dense"]["test_top1"], sb["final"]["test_top1"]],
        },
        "test_loss": {
            "a": [sa["dense"]["test_loss"], sa["final"]["test_loss"]],
            "b": [sb["dense"]["test_loss"], sb["final"]["test_loss"]],
        },
        "flops_ratio": {"a": sa["goal"]["value"], "b": sb["goal"]["value"]},
        "bit_for_bit": all(m["identical"] for m in models.values()) and not summary_diff,
    }
    save(a.out, result)
    steps = ", ".join(f"{s} {m['identical']}" for s, m in models.items())
    print(f"bit for bit: {result['bit_for_bit']} ({steps}; summary differences: {summary_diff or 'none'})")


if __name__ == "__main__":
    main()
