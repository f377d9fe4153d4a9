"""Write docs/results.md (and the README's results table) from bench/results/*.json[l] only.

    python bench/make_results.py           # scrub machine paths from the JSON files, rewrite the documents
    python bench/make_results.py --check   # exit 1 when a document is out of date or a JSON names a machine path

Every file under bench/results/ gets a section: the command recorded in it, the machine, and its figures
(a table per list of records, a key/value table for the rest). A few families have a summary table of
their own on top. Nothing here imports torch, so the check runs in a plain Python.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from _common import ROOT, relative_paths
from _gpu_section import GPU_END, GPU_START, gpu_table
from _speed_section import SPEED_END, SPEED_START, speed_summary, speed_table
from _time_section import TIME_END, TIME_START, time_section
from _where_section import WHERE_END, WHERE_START, where_table

RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
TABLE_START, TABLE_END = "<!-- results-table:start -->", "<!-- results-table:end -->"
INT8_START, INT8_END = "<!-- int8-table:start -->", "<!-- int8-table:end -->"
INT8_GOALS_START, INT8_GOALS_END = "<!-- int8-goals:start -->", "<!-- int8-goals:end -->"
SAMPLERS_START, SAMPLERS_END = "<!-- samplers-table:start -->", "<!-- samplers-table:end -->"
BASE_NAMES = {"mainjob": "main job's dense base", "dinov2": "DINOv2 ViT-S/14 probe"}
DCSGEN_START, DCSGEN_END = "<!-- dcs-generalise:start -->", "<!-- dcs-generalise:end -->"
KEPT_START, KEPT_END = "<!-- dcs-kept:start -->", "<!-- dcs-kept:end -->"
DIP_START, DIP_END = "<!-- dcs-dip:start -->", "<!-- dcs-dip:end -->"
DEMO_START, DEMO_END = "<!-- demo-time:start -->", "<!-- demo-time:end -->"
MAINJOB_START, MAINJOB_END = "<!-- mainjob-time:start -->", "<!-- mainjob-time:end -->"
MAX_ROWS, MAX_COLS, MAX_LIST = 40, 12, 16

FAMILIES = {  # file-name prefix -> (section title, one line on what it is)
    "pipeline": (
        "The main job: `nascompress pipeline`",
        "The newcomer command end to end (dense base, DCS, EViT study, retrain, report) on Fashion-MNIST.",
    ),
    "pretrained": (
        "A real pretrained ViT: DINOv2 ViT-S/14 on Fashion-MNIST at 112 px",
        "`bench/pretrained.py`: the "
        "DINOv2 backbone with a linear-probe head as the dense model, each method at a small budget; "
        "`*_config.json`, `*_metrics.json` and `*_log.jsonl` are the run directories' own files.",
    ),
    "dcs": (
        "DCS channel search",
        "`bench/dcs.py` (search, materialize, against uniform pruning), "
        "`bench/dcs_init_order.py` (which importance orders the gates), `bench/dcs_gather.py`.",
    ),
    "search": (
        "The Optuna outer search",
        "`bench/search.py`: Pareto front against a grid, workers, the pretrained ViT.",
    ),
    "samplers": (
        "Samplers",
        "`bench/samplers.py`: each `--sampler` per base, space and seed: hypervolume of the "
        "accuracy x FLOPs front and the best top-1 under 0.6x FLOPs after 10/20/30/50 trials.",
    ),
    "tome": ("ToMe", "`bench/tome.py`: ToMe zero-shot per r against EViT at the same FLOPs, and its CPU speed-up."),
    "token": ("EViT and DynamicViT", "`bench/token_pruning.py`: DeiT-S FLOPs and throughput, Fashion-MNIST accuracy."),
    "sparsifiner": (
        "Sparsifiner",
        "`bench/sparsifiner.py`: attention speed against dense SDPA, Fashion-MNIST accuracy.",
    ),
    "mgvit": ("MG-ViT", "`bench/mgvit.py`: DeiT-S FLOPs and the two-stage model on 56 px Fashion-MNIST."),
    "ib": (
        "Information-bottleneck retraining",
        "`bench/ib_retrain.py`: retraining the DCS model with and without the IB term.",
    ),
    "honest": (
        "Honest splits",
        "`bench/honest_splits.py`: the DINOv2 recipe on a train/ + val/ ImageFolder (its test split carved "
        "from val/) against a held-out folder; `--where`: the where-to-cut cells' splits and their overlaps.",
    ),
    "faults": ("Faults and refusals", "`bench/faults.py`: what each fault does to a run and what the user sees."),
    "gpu": ("GPU", "`bench/gpu.py`: every method against dense in fp32 and bf16, eager and compiled."),
    "speed": (
        "Speed against FLOPs",
        "`bench/speed.py`: every method's model and the pipeline's against the dense one, interleaved, per "
        "dtype, batch and eager/compiled: speed-up and the realized share of the FLOPs cut (speed-up x FLOPs ratio).",
    ),
    "qk": ("Narrowed Q/K layouts", "`bench/qk_layout.py`: how narrowed Q/K heads reach the attention kernel."),
    "ddp": (
        "Data parallelism",
        "`bench/ddp_cpu.py`: step time of 2-process gloo training, this code against another checkout.",
    ),
    "export": ("Export", "`bench/export.py`: exported files against PyTorch."),
    "quantize": (
        "int8 quantization",
        "`bench/quantize.py`: each model's fp32 and int8 ONNX files (nascompress "
        "quantize), their test top-1, sizes and CPU speed against the dense fp32 PyTorch model.",
    ),
    "foundation": ("Foundation", "`bench/foundation.py`: the dense base and the FLOPs counter."),
    "command": (
        "Time of each command on a CPU",
        "`bench/command_times.py`: the README's commands chained on "
        "Fashion-MNIST at reduced size, each in a fresh process (the README's 'Time').",
    ),
    "demo": (
        "The demo config",
        "`bench/demo_time.py`: one run of the shipped demo config as a user runs it (the "
        "installed command, another directory; the README's 'Two commands'): wall and CPU seconds, each "
        "stage's, the result.",
    ),
    "mainjob": (
        "The main job against the free alternatives",
        "`bench/mainjob_peers.py`: Torch-Pruning and the "
        "in-search magnitude baseline on the main job's base, at its final model's FLOPs, retrained with "
        "its retraining job.",
    ),
    "tool": (
        "The tool's own speed",
        "`bench/tool_speed.py` (one file per CPU class, `tool_speed_<CPU>.json`): each machine's matmul peak "
        "(fp32, bf16), each recipe's training step against it, where a step's time goes, the commands' wall "
        "and loop times.",
    ),
}


# ----------------------------------------------------------------------------------------------- formatting
def fmt(v: Any) -> str:
    """One cell: numbers rounded for reading (the JSON keeps every digit), text escaped for a table."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return str(v)
        if v.is_integer() and abs(v) < 1e15:
            return fmt(int(v))
        a = abs(v)
        return f"{v:,.1f}" if a >= 1000 else f"{v:.2f}" if a >= 10 else f"{v:.3f}" if a >= 0.1 else f"{v:.3g}"
    if isinstance(v, list):
        shown = ", ".join(fmt(x) if not isinstance(x, list) else "[" + fmt(x) + "]" for x in v[:MAX_LIST])
        return shown + (f", ... ({len(v)} items)" if len(v) > MAX_LIST else "")
    if isinstance(v, dict):
        return "; ".join(f"{k}: {fmt(x)}" for k, x in v.items())
    return str(v).replace("|", "\\|").replace("\n", " ")


def scalar(v: Any) -> bool:
    return not isinstance(v, (dict, list)) or (isinstance(v, list) and all(not isinstance(x, dict) for x in v))


def flat(d: dict, prefix: str = "", depth: int = 2) -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (``depth`` levels; deeper values stay whole)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and depth > 1:
            out.update(flat(v, f"{prefix}{k}.", depth - 1))
        else:
            out[f"{prefix}{k}"] = v
    return out


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in r) + " |" for r in rows]
    return lines + [""]


def records_table(records: list[dict], label: str | None = None, labels: list[str] | None = None) -> list[str]:
    """A list of records (dicts) as one table: a column per scalar field (nested dicts flattened)."""
    rows = [flat(r) for r in records]
    cols: list[str] = []
    for r in rows:
        cols += [k for k, v in r.items() if k not in cols and scalar(v) and k.split(".")[0] not in ("train", "machine")]
    if len(cols) > MAX_COLS and len(rows) <= 8:  # a few wide records: one column per record, every field shown
        names = labels or [str(i + 1) for i in range(len(rows))]
        return table(["field", *names], [[f"`{c}`", *(r.get(c) for r in rows)] for c in cols])
    more = len(cols) - MAX_COLS
    cols = cols[:MAX_COLS]
    header = ([label] if labels else []) + cols
    body = [([labels[i]] if labels else []) + [r.get(c) for c in cols] for i, r in enumerate(rows[:MAX_ROWS])]
    out = table(header, body)
    notes = []
    if len(rows) > MAX_ROWS:
        notes.append(f"{len(rows) - MAX_ROWS} more rows")
    if more > 0:
        notes.append(f"{more} more fields")
    if notes:
        out.insert(len(out) - 1, f"({' and '.join(notes)} in the JSON.)")
    return out


def like_records(v: Any) -> bool:
    """A dict of dicts that share most of their fields (runs, rows): one table reads better than several."""
    if not (isinstance(v, dict) and len(v) > 1 and all(isinstance(x, dict) for x in v.values())):
        return False
    keys = [{k for k, y in flat(x).items() if scalar(y)} for x in v.values()]
    common = set.intersection(*keys)
    return len(common) >= 2 and len(common) >= 0.6 * max(map(len, keys))


def body(obj: Any, where: str = "") -> list[str]:
    """Any JSON value as markdown: scalars as a key/value table, records as tables, the rest by key
    (each part labelled with its path in the JSON, e.g. ``decisions.dcs``)."""
    if isinstance(obj, list):
        if obj and all(isinstance(x, dict) for x in obj):
            return records_table(obj)
        return [fmt(obj), ""]
    if not isinstance(obj, dict):
        return [fmt(obj), ""]
    out: list[str] = []
    plain = {k: v for k, v in obj.items() if scalar(v)}
    if plain:
        out += table(["field", "value"], [[f"`{k}`", v] for k, v in plain.items()])
    for k, v in obj.items():
        if k in plain or k in ("machine", "train") or v in ({}, []):
            continue
        label = f"{where}.{k}" if where else str(k)
        out += [f"`{label}`:", ""]
        if label.count(".") >= 3:
            out += [f"`{json.dumps(v)[:300]}`", ""]
        elif like_records(v):
            out += records_table(list(v.values()), "", list(v))
        else:
            out += body(v, label)
    return out


# ------------------------------------------------------------------------------------------------ reading
def load(path: Path) -> Any:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def find(obj: Any, key: str) -> Any:
    """The first value stored under ``key`` anywhere in ``obj`` (depth-first), or None."""
    if isinstance(obj, dict):
        if key in obj and obj[key] not in (None, {}, ""):
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            hit = find(v, key)
            if hit is not None:
                return hit
    return None


def machine_line(m: dict | None) -> str:
    if not isinstance(m, dict):
        return "not recorded in the JSON"
    parts = []
    if m.get("device") not in (None, "cpu"):
        parts.append(str(m["device"]))
    if "cpu_threads" in m:
        parts.append(f"{m['cpu_threads']} torch threads" + (f" of {m['cpu_count']} CPUs" if m.get("cpu_count") else ""))
    parts += [str(m[k]) for k in ("cpu", "gpu") if m.get(k)]
    parts += [f"{k} {m[k]}" for k in ("torch", "timm", "platform") if m.get(k)]
    if "cuda" in m:
        parts.append("CUDA" if m["cuda"] else "no CUDA")
    if isinstance(m.get("load_average_at_start"), (int, float)):
        parts.append(f"load average {m['load_average_at_start']:.2f} at the start")
    return ", ".join(parts) or json.dumps(m)


def family(name: str) -> str:
    stem = name.split(".")[0]
    for prefix in FAMILIES:
        if stem == prefix or stem.startswith(prefix + "_") or stem.startswith(prefix):
            return prefix
    return stem.split("_")[0]


# ------------------------------------------------------------------------------------------- summary tables
def ratio(v: Any, digits: int = 2) -> str:
    return f"{v:.{digits}f}x" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def speed_cells(speed: dict | None) -> list[str]:
    speed = speed if isinstance(speed, dict) else {}
    return [ratio(speed.get("throughput_speedup_batch64")), ratio(speed.get("latency_speedup_batch1"))]


def pipeline_summary(data: dict[str, Any]) -> list[str]:
    rows = []
    for name, d in data.items():
        if not name.startswith("pipeline") or "comparison" not in d:
            continue
        c, dense, final = d["comparison"], d["dense"], d["final"]
        rows.append(
            [
                f"`{name}`",
                f"{c['flops_ratio']:.3f}x",
                f"{dense['test_top1']:.2f}%",
                f"{final['test_top1']:.2f}%",
                f"{c['top1_change']:+.2f}",
                f"{c['params_ratio']:.3f}x",
                f"{c['throughput_speedup']:.2f}x",
                f"{c['latency_speedup']:.2f}x",
                "yes" if d.get("goal", {}).get("met") else "no",
            ]
        )
    if not rows:
        return []
    return [
        "Summary (speed-ups are dense time / compressed time, measured interleaved in one process; below 1 is slower):",
        "",
    ] + table(
        [
            "JSON",
            "FLOPs vs dense",
            "dense test top-1",
            "final test top-1",
            "change (points)",
            "params",
            "throughput b64",
            "latency b1",
            "goal met",
        ],
        rows,
    )


def pretrained_rows(data: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, d in sorted(data.items()):
        if not (name.startswith("pretrained") and isinstance(d, dict) and "protocol" in d):
            continue
        for method in ("evit", "dynamicvit", "sparsifiner", "uniform", "dcs"):
            m = d.get(method)
            if not isinstance(m, dict):
                continue
            start = m.get("zero_shot") or m.get("pruned") or m.get("materialized") or {}
            final = m.get("finetuned") or m.get("retrained") or {}
            speed = m.get("speed")
            cfg = ", ".join(f"{k} {v}" for k, v in (m.get("config") or {}).items()) or (
                f"target {m['search'].get('target_flops')}" if isinstance(m.get("search"), dict) else ""
            )
            rows.append(
                [
                    f"{method} {cfg}".strip(),
                    ratio((speed or {}).get("flops_ratio"), 3),
                    f"{fmt(start.get('val_top1'))} / {fmt(start.get('test_top1'))}",
                    f"{fmt(final.get('val_top1'))} / {fmt(final.get('test_top1'))}",
                    *speed_cells(speed),
                    f"`{name}`",
                ]
            )
    return rows


def pretrained_summary(data: dict[str, Any]) -> list[str]:
    rows = pretrained_rows(data)
    dense = data.get("pretrained.json", {}).get("dense")
    if not rows:
        return []
    head = [
        f"Dense (linear probe): {fmt(dense['val_top1'])}% val / {fmt(dense['test_top1'])}% test (`pretrained.json`)."
        if dense
        else "",
        "",
    ]
    return (
        head
        + [
            "Summary of the bench's method runs (top-1 on 2,000-image class-balanced subsets; "
            "start = zero-shot or before retraining):",
            "",
        ]
        + table(
            [
                "method",
                "FLOPs vs dense",
                "start val / test",
                "final val / test",
                "throughput b64",
                "latency b1",
                "JSON",
            ],
            rows,
        )
    )


def samplers_summary(data: dict[str, Any]) -> list[str]:
    """One row per file, base, space and sampler: mean hypervolume and best top-1 under the goal per budget."""
    rows, budgets = [], []
    for name in sorted(n for n in data if family(n) == "samplers"):
        d = data[name]
        budgets = sorted(set(budgets) | set(d["settings"]["budgets"]))
        for base, spaces in d["results"].items():
            for space, res in spaces.items():
                summ = res["summary"]
                for sampler, per in summ["mean"].items():
                    if "refused" in per:
                        rows.append([f"`{name}`", base, space, sampler, "refused", "", ""])
                        continue
                    hv = " / ".join(fmt(per[str(b)]["hypervolume"]) if str(b) in per else "-" for b in budgets)
                    best = " / ".join(fmt(per[str(b)]["best_under_goal"]) if str(b) in per else "-" for b in budgets)
                    goal = summ["reaches_99pct_of_best_within_30_on_every_seed"].get(sampler)
                    best30 = summ.get("best_at_30") or []
                    rows.append(
                        [
                            f"`{name}`",
                            base,
                            space,
                            sampler + (" (best at 30)" if sampler in best30 else ""),
                            hv,
                            best,
                            "-" if goal is None else ("yes" if goal else "no"),
                        ]
                    )
    head = [
        "file",
        "base",
        "space",
        "sampler",
        f"hypervolume at {'/'.join(map(str, budgets))} trials (mean of seeds)",
        "best top-1 under the goal",
        ">= 99% of the best within 30, every seed",
    ]
    return table(head, rows) + [""]


def samplers_table(data: dict[str, Any]) -> list[str]:
    """The README's sampler table: per base and space of every ``samplers*.json`` run to 50 trials, the
    mean hypervolume at 30 trials of each sampler (the best in bold; GP and QMC refuse conditional
    spaces), the best found at 50, and whether the default (TPE) reached 99% of it within 30 on every seed."""
    names = ("tpe", "grid", "nsga2", "gp", "qmc")
    rows = []
    for name in sorted(n for n in data if family(n) == "samplers"):
        d = data[name]
        if 50 not in d["settings"]["budgets"]:
            continue
        for base, spaces in d["results"].items():
            for space, res in spaces.items():
                summ, mean = res["summary"], res["summary"]["mean"]
                best30 = summ.get("best_at_30") or []
                cells = []
                for sm in names:
                    per = mean.get(sm)
                    cells.append(
                        "-"
                        if per is None
                        else "refuses"
                        if "refused" in per
                        else (
                            f"**{per['30']['hypervolume']:.2f}**" if sm in best30 else f"{per['30']['hypervolume']:.2f}"
                        )
                    )
                reach = summ["reaches_99pct_of_best_within_30_on_every_seed"].get("tpe")
                partial = (
                    ""
                    if d.get("complete", True) or res.get("seeds_done") is None
                    else f", seeds {','.join(map(str, res['seeds_done']))} only"
                )
                rows.append(
                    [
                        f"{BASE_NAMES.get(base, base)}, `{space}` (`{name}`, {d['settings']['eval_images']:,} val "
                        f"images{partial})",
                        *cells,
                        f"{summ['best_hypervolume_at_50']:.2f}",
                        "-" if reach is None else "yes" if reach else "no",
                    ]
                )
    if not rows:
        return []
    return table(
        [
            "base, space (file)",
            "TPE",
            "grid",
            "NSGA-II",
            "GP",
            "QMC",
            "best found at 50",
            "TPE >= 99% of it within 30, every seed",
        ],
        rows,
    )[:-1]


SUMMARIES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "pipeline": pipeline_summary,
    "pretrained": pretrained_summary,
    "samplers": samplers_summary,
    "speed": speed_summary,
}


METHOD_NAMES = {
    "dcs": "DCS",
    "evit": "EViT",
    "dynamicvit": "DynamicViT",
    "sparsifiner": "Sparsifiner",
    "mgvit": "MG-ViT",
}


def small_data_rows(d: dict[str, Any] | None) -> list[list[str]]:
    """The small-data DINOv2 bench (2,000 training images, library defaults): DCS and uniform pruning
    at equal FLOPs with the same retraining, and the dense model fine-tuned with the same budget."""
    if not d or "summary" not in d:
        return []
    s, name = d["summary"], "`pretrained_small_data.json`"
    n = d.get("protocol", {}).get("train_images", "?")
    dense = s.get("dense_probe_test")
    if dense is None:
        return []
    rows = []
    for target in sorted((k for k in s if isinstance(s[k], dict)), reverse=True):
        for fam, label in (
            ("dcs-hidden", "DCS (hidden gates)"),
            ("dcs-residual", "DCS (residual gates)"),
            ("uniform", "uniform magnitude"),
        ):
            if s[target].get(fam) is not None:
                rows.append(
                    [
                        f"DINOv2 ViT-S/14, {n:,} images: {label} {target}x + retrain",
                        f"{s[target][fam + '_flops']:.3f}x",
                        f"{dense:.2f}% -> {s[target][fam]:.2f}%",
                        "-",
                        name,
                    ]
                )
    if s.get("dense_ft_test") is not None:
        rows.append(
            [
                f"DINOv2 ViT-S/14, {n:,} images: dense, same retrain budget",
                "1.000x",
                f"{dense:.2f}% -> {s['dense_ft_test']:.2f}%",
                "-",
                name,
            ]
        )
    return rows


def readme_table(data: dict[str, Any]) -> list[str]:
    """The README's one results table: the main job and the DINOv2 cases, every figure read from its JSON."""
    rows = []
    for name, case in (
        ("pipeline_fashion_mnist.json", "Fashion-MNIST main job"),
        ("pipeline_fashion_mnist_latency.json", "Fashion-MNIST main job, latency recipe"),
        ("pipeline_dinov2.json", "DINOv2 ViT-S/14 probe, 2,000 images: pipeline"),
    ):
        p = data.get(name)
        if p:
            c = p["comparison"]
            names = " + ".join(METHOD_NAMES.get(m, m) for m in p["final"]["methods"]) or "no method"
            rows.append(
                [
                    f"{case} ({names}, retrained{'; ' + p['recipe_note'] if p.get('recipe_note') else ''})",
                    f"{c['flops_ratio']:.3f}x",
                    f"{p['dense']['test_top1']:.2f}% -> {p['final']['test_top1']:.2f}%",
                    f"{c['throughput_speedup']:.2f}x / {c['latency_speedup']:.2f}x",
                    f"`{name}`",
                ]
            )
        if name == "pipeline_fashion_mnist.json":
            rows += mainjob_peer_rows(data.get("mainjob_peers.json"))
    dense = data.get("pretrained.json", {}).get("dense", {}).get("test_top1")
    for name, method, label in (
        ("pretrained_dcs_10k_fkd.json", "dcs", "DINOv2 ViT-S/14, DCS 0.65 + retrain"),
        ("pretrained_evit.json", "evit", "DINOv2 ViT-S/14, EViT keep 0.7, fine-tuned"),
    ):
        m = data.get(name, {}).get(method)
        if not m or dense is None:
            continue
        final = m.get("finetuned") or m.get("retrained")
        rows.append(
            [
                label,
                f"{m['speed']['flops_ratio']:.3f}x",
                f"{dense:.2f}% -> {final['test_top1']:.2f}%",
                " / ".join(speed_cells(m["speed"])),
                f"`{name}`",
            ]
        )
    ft = data.get("pretrained_dense_finetuned_metrics.json")
    if ft and dense is not None:
        rows.append(
            [
                "DINOv2 ViT-S/14 dense, fine-tuned as EViT (the fair reference)",
                "1.000x",
                f"{dense:.2f}% -> {ft['test_top1']:.2f}%",
                "-",
                "`pretrained_dense_finetuned_metrics.json`",
            ]
        )
    rows += small_data_rows(data.get("pretrained_small_data.json"))
    return table(
        ["case", "FLOPs vs dense", "test top-1 (dense -> compressed)", "CPU speed-up b64 / b1", "from bench/results/"],
        rows,
    )[:-1]


def mainjob_peer_rows(d: dict[str, Any] | None) -> list[list[str]]:
    """Under the main job's row: what a user gets for free on its base at its FLOPs with its retraining
    job (``mainjob_peers.json``), and its picked model fine-tuned with cross-entropy only."""
    if not d:
        return []
    labels = {
        "torch-pruning": "Fashion-MNIST main job's base: Torch-Pruning 1.6.1 (MLP neurons) + the same retraining",
        "magnitude": "Fashion-MNIST main job's base: magnitude (the in-search baseline) + the same retraining",
        "plain": "Fashion-MNIST main job's picked model, fine-tuned with cross-entropy only (same budget)",
    }
    rows = []
    for kind, label in labels.items():
        m = d.get(kind)
        if not m:
            continue
        ratio = (m.get("pruned") or {}).get("flops_ratio") or d["target_flops"]
        top1 = f"{d['main_job']['dense_test_top1']:.2f}% -> {m['test_top1']:.2f}%"
        rows.append([label, f"{ratio:.3f}x", top1, "-", "`mainjob_peers.json`"])
    return rows


def int8_table(data: dict[str, Any]) -> list[str]:
    """The README's int8 table (``quantize.json``): per model, fp32 PyTorch against the int8 ONNX file;
    speeds are the dense fp32 PyTorch model's time / this model's, measured interleaved."""
    q = data.get("quantize.json")
    gaps = " ".join((q or {}).get("not_measured", []))
    rows = []
    for fam, label in (
        ("main_job", "Fashion-MNIST main job" + (" (stand-in)" if "stand-in" in gaps else "")),
        ("dinov2", "DINOv2 ViT-S/14 112 px probe"),
    ):
        f = (q or {}).get(fam)
        if not f:
            continue
        big = next(b for b in f["speed"] if b != "batch_1")
        for k, m in f["models"].items():
            t, sz = m["test_top1"], m["file_mb"]
            sp = {b: f["speed"][b]["speedup_vs_dense_pytorch_fp32"] for b in ("batch_1", big)}
            scheme = m["quantization"]["scheme"] + (" (fallback)" if m["quantization"]["fallback"] else "")
            note = ""
            if fam == "dinov2" and k != "dense":  # a DINOv2 DCS model from --dinov2-runs is trained, the rest zero-shot
                retrained = k.startswith("dcs") and "retrained from it" in f.get("source", {}).get("kind", "")
                note = " (searched, retrained)" if retrained else " (not retrained)"
            rows.append(
                [
                    f"{label}: {k}{note}",
                    f"{m['flops_ratio']:.3f}x",
                    scheme,
                    f"{t['pytorch_fp32']:.2f}% -> {t['ort_int8']:.2f}%",
                    f"{sz['fp32']:.2f} -> {sz['int8']:.2f}",
                    f"{sp[big][k + '/ort_fp32']:.2f}x / {sp[big][k + '/ort_int8']:.2f}x",
                    f"{sp['batch_1'][k + '/ort_fp32']:.2f}x / {sp['batch_1'][k + '/ort_int8']:.2f}x",
                    big.replace("batch_", "b"),
                    (
                        f"{sp[big][k + '/pytorch_int8_dynamic']:.2f}x, {t['pytorch_int8_dynamic']:.2f}%"
                        if "pytorch_int8_dynamic" in t
                        else "does not run"
                        if str(m.get("pytorch_int8_dynamic", "")).startswith("does not")
                        else "-"
                    ),
                ]
            )
    if not rows:
        return []
    return table(
        [
            "model",
            "FLOPs vs dense",
            "int8 scheme",
            "test top-1 fp32 -> int8",
            "file MB fp32 -> int8",
            "ORT fp32 / int8 vs dense PyTorch fp32, large batch",
            "same, b1",
            "large batch",
            "PyTorch dynamic int8: large batch, test top-1",
        ],
        rows,
    )[:-1]


def int8_goals(data: dict[str, Any]) -> list[str]:
    """The README's int8 goal lines (``quantize.json``'s ``goals``), each figure read from the JSON."""
    q = data.get("quantize.json") or {}
    g = q.get("goals") or {}

    def met(ok: bool) -> str:
        return "met" if ok else "**not met**"

    def n_threads(n: int | str) -> str:
        return f"{n} thread{'s' if int(n) != 1 else ''}"

    def threads(fam: str, batch: str, label: str) -> str:
        return n_threads(q[fam]["speed"][batch].get("threads", {}).get(label, q["machine"]["cpu_threads"]))

    def same(fam: str, batch: str, label: str) -> str:  # the ratio with both runtimes at each thread count
        by = q[fam]["speed"][batch].get("ms_by_threads") or {}
        return ", ".join(
            f"{v['dense/pytorch_fp32'] / v[label]:.2f}x at {n_threads(th)}" for th, v in sorted(by.items())
        )

    out = []
    if "main_job" in g:
        mj, c = g["main_job"], q["main_job"]["models"]["compressed"]["test_top1"]
        out.append(
            f"- Main job, compressed + int8 vs dense fp32 PyTorch: throughput at b64 "
            f"{mj['throughput_b64_vs_dense_pytorch_fp32']:.2f}x (goal 2.5x {met(mj['throughput_goal_2.5x_met'])}), "
            f"latency at b1 {mj['latency_b1_vs_dense_pytorch_fp32']:.2f}x (goal 1.5x "
            f"{met(mj['latency_goal_1.5x_met'])}; the int8 file on "
            f"{threads('main_job', 'batch_1', 'compressed/ort_int8')} "
            f"against PyTorch on {threads('main_job', 'batch_1', 'dense/pytorch_fp32')}, each its fastest; "
            f"both runtimes at the same count: {same('main_job', 'batch_1', 'compressed/ort_int8')}), int8 test top-1 "
            f"{c['ort_int8']:.2f}% against the compressed fp32 model's {c['pytorch_fp32']:.2f}% (goal 0.5 pt "
            f"{met(mj['accuracy_goal_0.5pt_met'])}; {q['main_job']['test_images']:,} test images)."
        )
    if "dinov2_dcs" in g:
        d = g["dinov2_dcs"]
        big = next(k for k in d if k.startswith("throughput_"))
        t = q["dinov2"]["models"][d["model"]]["test_top1"]
        out.append(
            f"- DINOv2 ViT-S/14 {d['model']} + int8 ({d['note']}): {d[big]:.2f}x dense fp32 PyTorch at "
            f"{big.split('_')[1]} {big.split('_')[2]} (goal 2x {met(d['speed_goal_2x_met'])}), int8 test top-1 "
            f"{t['ort_int8']:.2f}% against its fp32 {t['pytorch_fp32']:.2f}% (goal 1 pt "
            f"{met(d['accuracy_goal_1pt_met'])}; {q['dinov2']['test_images']:,} test images)."
        )
    stacks = ([("main job compressed", g["main_job_stacking"])] if "main_job_stacking" in g else []) + [
        (f"DINOv2 {k}", v) for k, v in (g.get("dinov2_stacking") or {}).items()
    ]
    for name, st in stacks:
        sp = " / ".join(
            f"{v:.2f}x ({b.replace('batch_', 'b')})" for b, v in st["compressed_int8_vs_dense_int8_speedup"].items()
        )
        line = (
            f"- Stacking, {name}: its int8 file is {sp} the dense int8 file's speed (faster: {met(st['faster_met'])}), "
            f"test top-1 {st['compressed_int8_top1']:.2f}% against the bound {st['bound_top1']:.2f}% (dense int8 minus "
            f"the compression's own drop: {met(st['accuracy_met'])})"
        )
        v = st.get("val_split")
        if v:
            line += (
                f"; on the {v['n']:,} validation images {v['compressed_int8_top1']:.2f}% against "
                f"{v['bound_top1']:.2f}% ({met(v['accuracy_met'])})"
            )
        out.append(line + ".")
    return out


def _goals_text(goals: dict[str, bool]) -> str:
    """Goals met / measured, and the missed ones by name."""
    missed = [g for g, ok in goals.items() if not ok]
    return f"{len(goals) - len(missed)}/{len(goals)}" + (f" (missed: {'; '.join(missed)})" if missed else "")


def _goals_cell(c: dict[str, Any], goals: dict[str, bool]) -> str:
    """A DCS table row's goals column: met / measured, the missed ones, and what has not run yet."""
    if not goals:
        return "not measured yet (the cell's search has not run)"
    text = _goals_text(goals)
    if c.get("failed") or None not in (c.get("uniform"), c.get("torch_pruning")):
        return text
    return text + ("; peers not run yet" if c.get("dcs") is not None else "; retraining and peers not run yet")


def dcs_generalise_table(data: dict[str, Any]) -> list[str]:
    """The README's DCS table (``dcs_generalise.json``'s summary): one row per dataset, base, seed and
    target; test top-1, the searched model before retraining, the peers after the same retraining,
    the search's budget record and how many of the issue's goals the cell meets."""
    summ = (data.get("dcs_generalise.json") or {}).get("summary") or {}
    rows = []
    for cell, c in summ.items():
        where, _, target = cell.rpartition("@")
        rows.append(
            [
                where.replace("/", " / "),
                f"{float(target):.1f}x",
                fmt(c.get("dense")),
                fmt(c.get("dense_ft")),
                "collapsed" if c.get("failed") else fmt(c.get("searched")),
                fmt(c.get("dcs")),
                fmt(c.get("uniform")),
                fmt(c.get("torch_pruning")),
                fmt(c.get("search_flops_ratio")),
                fmt(c.get("at_target_share")),
                fmt(c.get("calibration_move")),
                _goals_cell(c, c.get("goals") or {}),
            ]
        )
    if not rows:
        return []
    return table(
        [
            "dataset / base / seed",
            "target",
            "dense",
            "dense retrained",
            "searched (before retraining)",
            "DCS retrained",
            "uniform retrained",
            "Torch-Pruning retrained",
            "search FLOPs",
            "at target share",
            "calibration move",
            "goals met",
        ],
        rows,
    ) + dcs_generalise_summary(summ)


def dcs_generalise_summary(summ: dict[str, Any]) -> list[str]:
    """Under the DCS table, per base: goals met of those measured, and DCS retrained against each peer
    (mean, lowest and highest difference in points over the cells where both were retrained)."""
    bases: dict[str, list[dict[str, Any]]] = {}
    for cell, c in summ.items():
        bases.setdefault(cell.split("/")[1], []).append(c)
    out = []
    for base, cells in bases.items():
        goals = [v for c in cells for v in (c.get("goals") or {}).values()]
        parts = [f"**{base}**: {sum(goals)} of {len(goals)} goals met over {len(cells)} cells"]
        for key, name in (("uniform", "uniform"), ("torch_pruning", "Torch-Pruning")):
            diff = [c["dcs"] - c[key] for c in cells if c.get("dcs") is not None and c.get(key) is not None]
            if diff:
                parts.append(
                    f"DCS minus {name} {sum(diff) / len(diff):+.2f} pt on average "
                    f"({min(diff):+.2f} to {max(diff):+.2f}, {len(diff)} cells)"
                )
        out.append("- " + "; ".join(parts) + ".")
    return out


KEPT_FILES = ("dcs_generalise_baseline.json", "dcs_generalise_baseline_scratch.json")


def dcs_kept_table(data: dict[str, Any]) -> list[str]:
    """The README's table of the search with its in-search baseline (``dcs_generalise.py`` runs into
    ``KEPT_FILES``): per cell, which model the search kept and both validation scores after the same
    recovery, then test top-1 of the kept model retrained against the dense model retrained with the
    same budget and Torch-Pruning with the same retraining."""
    rows: list[list[str]] = []
    per_base: dict[str, list[dict[str, Any]]] = {}
    for name in KEPT_FILES:
        for cell, c in ((data.get(name) or {}).get("summary") or {}).items():
            where, _, target = cell.rpartition("@")
            rows.append(
                [
                    where.replace("/", " / "),
                    f"{float(target):.1f}x",
                    fmt(c.get("dense")),
                    c.get("kept") or ("collapsed" if c.get("failed") else "-"),
                    f"{fmt(c.get('in_search_dcs_val'))} / {fmt(c.get('in_search_magnitude_val'))}",
                    fmt(c.get("dcs")),
                    fmt(c.get("dense_ft")),
                    fmt(c.get("torch_pruning")),
                    _goals_text(c.get("goals") or {}),
                ]
            )
            if c.get("kept"):
                per_base.setdefault(cell.split("/")[1], []).append(c)
    if not rows:
        return ["(not measured yet: `python bench/dcs_generalise.py --out bench/results/dcs_generalise_baseline.json`)"]
    out = table(
        [
            "dataset / base / seed",
            "target",
            "dense (probe)",
            "kept",
            "in-search validation: searched / magnitude",
            "kept, retrained",
            "dense retrained",
            "Torch-Pruning retrained",
            "goals met",
        ],
        rows,
    )
    for base, cells in per_base.items():
        n_dcs = sum(c["kept"] == "dcs" for c in cells)
        parts = [f"**{base}**: the searched model kept in {n_dcs} of {len(cells)} cells"]
        diff = [c["dcs"] - c["torch_pruning"] for c in cells if None not in (c.get("dcs"), c.get("torch_pruning"))]
        if diff:
            parts.append(
                f"kept and retrained minus Torch-Pruning {sum(diff) / len(diff):+.2f} pt on average "
                f"({min(diff):+.2f} to {max(diff):+.2f})"
            )
        near = [c["dense_ft"] - c["dcs"] <= 2.0 for c in cells if None not in (c.get("dcs"), c.get("dense_ft"))]
        if near:
            parts.append(f"within 2 pt of the dense model retrained with the same budget in {sum(near)} of {len(near)}")
        out.append("- " + "; ".join(parts) + ".")
    return out


def dcs_dip_table(data: dict[str, Any]) -> list[str]:
    """The README's table of ``dcs_dip.json``: per base and variant, validation top-1 after every
    epoch of the search, the dip (lowest epoch minus dense), the end and which model was kept."""
    d = data.get("dcs_dip.json")
    if not d:
        return ["(not measured yet: `python bench/dcs_dip.py`)"]
    rows = []
    for base, b in d["bases"].items():
        for r in b["rows"]:
            rows.append(
                [
                    base,
                    r["variant"],
                    " ".join(r["options"]) or "(none)",
                    fmt(r["dense_val_top1"]),
                    " / ".join(fmt(v) for v in r["val_per_epoch"]),
                    f"{r['dip_pt']:+.1f}",
                    fmt(r["val_top1"]),
                    r.get("kept") or "-",
                ]
            )
    return table(
        ["base", "variant", "options", "dense val", "val after epochs 1-4", "dip (pt)", "end val", "kept"], rows
    )


# --------------------------------------------------------------------------------------------- the document
def render(data: dict[str, Any]) -> str:
    fams: dict[str, list[str]] = {}
    for name in data:
        fams.setdefault(family(name), []).append(name)
    order = [f for f in FAMILIES if f in fams] + sorted(f for f in fams if f not in FAMILIES)
    out = [
        "# Measured results",
        "",
        "Generated by `python bench/make_results.py` from `bench/results/*.json` and `*.jsonl` only: do not edit "
        "by hand (`python bench/make_results.py --check` fails when this file is out of date). Speeds are ratios "
        "against the dense model measured interleaved in one process (medians); FLOPs count one multiply-add "
        "as one FLOP, attention matmuls included. The machine of each run is the one recorded in its JSON.",
        "",
    ]
    out += ["Contents: " + ", ".join(f"[{FAMILIES.get(f, (f,))[0].split(':')[0].strip('`')}](#{f})" for f in order), ""]
    for fam in order:
        title, what = FAMILIES.get(fam, (f"`{fam}*`", "Results without a description in bench/make_results.py."))
        out += [f'<a id="{fam}"></a>', "", f"## {title}", "", what, ""]
        if fam in SUMMARIES:
            try:
                out += SUMMARIES[fam](data)
            except (KeyError, TypeError, ValueError) as e:  # a new file of the family with another layout
                out += [f"(No summary table: a file of this family lacks the field {e}.)", ""]
        for name in sorted(fams[fam]):
            d = data[name]
            out += [f"### `{name}`", ""]
            cmd = find(d, "command") or find(d, "newcomer_command")
            out += [
                f"Run: `{cmd}`" if cmd else "Run: the command is not recorded in the JSON.",
                "",
                f"Machine: {machine_line(find(d, 'machine'))}.",
                "",
            ]
            if isinstance(d, dict):
                d = {k: v for k, v in d.items() if k != "command"}
            out += body(d)
    while out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


def _fill(readme: str, start_mark: str, end_mark: str, lines: list[str]) -> str:
    start, end = readme.find(start_mark), readme.find(end_mark)
    if start < 0 or end < start:
        return readme
    return readme[: start + len(start_mark)] + "\n" + "\n".join(lines) + "\n" + readme[end:]


def demo_time(data: dict[str, Any]) -> list[str]:
    """The README's measured demo time, from ``demo_time.json`` (bench/demo_time.py)."""
    d = data.get("demo_time.json")
    if not d or not isinstance(d.get("machine"), dict):  # absent, or not written by bench/demo_time.py
        return ["(not measured yet: `python bench/demo_time.py`)"]
    m, r = d["machine"], d["result"]
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in d["stage_seconds"].items() if v >= 1)
    final = (
        "no compressed model"
        if r["final_test_top1"] is None
        else (f"{r['dense_test_top1']:.2f}% dense -> {r['final_test_top1']:.2f}% at {r['flops_ratio']:.3f}x the FLOPs")
    )
    return [
        f"Measured by `bench/demo_time.py` ({m.get('cpu_count')} CPU cores, {m.get('cpu_threads')} torch threads, "
        f"1-minute load average {d['load_at_start']:g} at the start, {d['load_at_end']:g} at the end): "
        f"{d['wall_s']:.0f} s wall, {d['user_s']:.0f} s of CPU time; {stages}; test top-1 {final}."
    ]


def mainjob_time(data: dict[str, Any]) -> list[str]:
    """The README's measured main job, from ``pipeline_fashion_mnist.json`` (the newcomer command run
    from a fresh clone: its summary.json with the wall times added)."""
    d = data.get("pipeline_fashion_mnist.json")
    if not d or "wall_s" not in d:
        return ["(not measured yet)"]
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in d["stage_seconds"].items() if v >= 1)
    amp = d.get("amp")
    return [
        f"Measured at commit {d.get('commit', '?')} ({d.get('machine_note', '')}): "
        f"{d['wall_s']:,.0f} s end to end after {d['setup_s']:.0f} s of `scripts/setup.sh`"
        f"{'' if amp is None else f', training in {amp}'}; {stages}; test top-1 {d['dense']['test_top1']:.2f}% "
        f"dense -> {d['final']['test_top1']:.2f}% at {d['comparison']['flops_ratio']:.3f}x the FLOPs "
        "(`bench/results/pipeline_fashion_mnist.json`)."
    ]


def with_readme_table(readme: str, data: dict[str, Any]) -> str:
    readme = _fill(readme, TABLE_START, TABLE_END, readme_table(data))
    readme = _fill(readme, INT8_START, INT8_END, int8_table(data))
    readme = _fill(readme, INT8_GOALS_START, INT8_GOALS_END, int8_goals(data))
    readme = _fill(readme, SAMPLERS_START, SAMPLERS_END, samplers_table(data))
    readme = _fill(readme, DEMO_START, DEMO_END, demo_time(data))
    readme = _fill(readme, MAINJOB_START, MAINJOB_END, mainjob_time(data))
    readme = _fill(readme, TIME_START, TIME_END, time_section(data))
    readme = _fill(readme, GPU_START, GPU_END, gpu_table(data))
    readme = _fill(readme, SPEED_START, SPEED_END, speed_table(data))
    readme = _fill(readme, WHERE_START, WHERE_END, where_table(data))
    readme = _fill(readme, KEPT_START, KEPT_END, dcs_kept_table(data))
    readme = _fill(readme, DIP_START, DIP_END, dcs_dip_table(data))
    return _fill(readme, DCSGEN_START, DCSGEN_END, dcs_generalise_table(data))


def read_all() -> dict[str, Any]:
    """Every result file under bench/results/ (its name there -> its value)."""
    data = {}
    for path in sorted(RESULTS.rglob("*.json")) + sorted(RESULTS.rglob("*.jsonl")):
        name = str(path.relative_to(RESULTS))
        data[name] = load(path)
    return dict(sorted(data.items()))


def dump(name: str, value: Any, like: str) -> str:
    """``value`` as the text of result file ``name``, indented as its current text ``like`` is."""
    if name.endswith(".jsonl"):
        return "".join(json.dumps(v) + "\n" for v in value)
    lines = like.splitlines()
    indent = len(lines[1]) - len(lines[1].lstrip()) if len(lines) > 1 else 0
    return json.dumps(value, indent=indent or None) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a document is out of date")
    args = ap.parse_args(argv)
    data = read_all()
    problems = []
    for name, value in data.items():  # machine paths: scrubbed in place, or reported by --check
        clean = relative_paths(value)
        if clean != value:
            if args.check:
                problems.append(
                    f"bench/results/{name} holds a path of the machine it ran on: "
                    "run python bench/make_results.py to make it relative"
                )
            else:
                path = RESULTS / name
                path.write_text(dump(name, clean, path.read_text()))
                data[name] = clean
    doc = render(data)
    readme = README.read_text()
    new_readme = with_readme_table(readme, data)
    if args.check:
        if not DOC.is_file() or DOC.read_text() != doc:
            problems.append("docs/results.md is out of date: run python bench/make_results.py")
        if new_readme != readme:
            problems.append("the README's results table is out of date: run python bench/make_results.py")
        for p in problems:
            print(p, file=sys.stderr)
        return 1 if problems else 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(doc)
    README.write_text(new_readme)
    print(f"wrote {DOC.relative_to(ROOT)} ({len(data)} result files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
