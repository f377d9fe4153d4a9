"""The README's "Time" section, generated from the per-CPU ``bench/results/tool_speed_<CPU class>.json``
files (``bench/tool_speed.py``) by ``bench/make_results.py``: a table with a column per CPU class, then
the detailed figures of :data:`DETAIL_FILE`'s machine; no torch here."""

from __future__ import annotations

import re
from typing import Any

from _gpu_section import GPU_FILE, gpu_goal, gpu_time_lines

TIME_START, TIME_END = "<!-- tool-speed:start -->", "<!-- tool-speed:end -->"
LABELS = {"fp32": "fp32", "bf16": "bf16 (`--amp auto` here)", "bf16_flash_attention": "bf16, SDPA flash attention"}


OVERHEADS_FILE = "tool_speed_overheads.json"
CPU_FILE = re.compile(r"^tool_speed_((?:amd|intel)-[a-z0-9-]+)\.json$")  # one per CPU class (bench/_cpu.py)
DETAIL_FILE = "tool_speed_amd-epyc.json"  # the machine of the profile, accuracy, changes and goals below
CPU_NAMES = {"amd-epyc": "AMD EPYC", "intel-xeon-amx": "Intel Xeon (AMX)"}
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")  # the profiler's matmul kernels


def _load_note(d: dict[str, Any]) -> str:
    if d.get("measured_under_load", True):
        return (
            f"**measured under load**: other jobs shared the cores (1-minute load average {d['load_at_start']:g} "
            "at the start), so the times are upper bounds and only the interleaved ratios are comparable"
        )
    return f"a quiet machine (1-minute load average {d['load_at_start']:g} at the start)"


def cpu_files(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The per-CPU tool-speed results (file name, its value) that measured the steps."""
    return [(n, d) for n, d in data.items() if CPU_FILE.match(n) and isinstance(d, dict) and "steps" in d]


def _step_cell(d: dict[str, Any], recipe: str, prec: str) -> str:
    r = (d["steps"].get(recipe) or {}).get(prec)
    if not r:
        return "-"
    share = f", {100 * r['share_of_peak']:.0f}%" if "share_of_peak" in r else ""
    return f"{r['step_s']:.3f} s{share}"


def cpu_table(data: dict[str, Any]) -> list[str]:
    """One column per CPU class: how it was measured, the matmul peaks, and the main and DINOv2 steps
    (seconds, share of that precision's peak); what a file did not measure is ``-``."""
    files = cpu_files(data)
    if not files:
        return []
    names = [CPU_NAMES.get(CPU_FILE.match(n).group(1), CPU_FILE.match(n).group(1)) for n, _ in files]

    def row(label: str, cells: list[str]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    def peak(d: dict[str, Any]) -> str:
        p = d.get("peak")
        return f"{p['fp32']['gflops']:.0f} / {p['bf16']['gflops']:.0f}" if p else "-"

    def measured(d: dict[str, Any]) -> str:
        load = "under load" if d.get("measured_under_load", True) else "quiet"
        cores = (d.get("machine") or {}).get("cpu_count")
        return (
            f"{cores} cores, {d['threads']} thread{'s' if d['threads'] != 1 else ''}, {load} ({d['load_at_start']:g})"
        )

    out = [
        "The same bench on each CPU class the project runs on (a column per `bench/results/tool_speed_<CPU>.json`; "
        "a step: seconds, and its share of the matmul peak of its precision; the load is the 1-minute load "
        "average at the start):",
        "",
        row("", names),
        "|---|" + "---|" * len(names),
        row("measured", [measured(d) for _, d in files]),
        row("`--amp auto` trains in", [str(d.get("amp_auto", "-")) for _, d in files]),
        row("matmul peak fp32 / bf16 (GFLOP/s)", [peak(d) for _, d in files]),
    ]
    for recipe, label in (("main", "main job step"), ("dinov2", "DINOv2 step")):
        for prec in ("fp32", "bf16"):
            out.append(row(f"{label}, {prec}", [_step_cell(d, recipe, prec) for _, d in files]))
    out.append(row("file", [f"`{n}`" for n, _ in files]))
    return out + [""]


def time_section(data: dict[str, Any]) -> list[str]:
    """Lines between the README's tool-speed markers."""
    d = data.get(DETAIL_FILE)
    if not d or "steps" not in d:
        return ["(not measured yet: `python bench/tool_speed.py`)"]
    m = d.get("machine") or {}
    out = cpu_table(data) + [
        f"In detail, on the {CPU_NAMES['amd-epyc']}: measured by `bench/tool_speed.py` "
        f"({m.get('cpu_count')} CPU cores, "
        f"{d['threads']} torch thread{'s' if d['threads'] != 1 else ''}; "
        f"{_load_note(d)}; `bench/results/{DETAIL_FILE}`). `--amp auto` (the default) trains in "
        f"{d.get('amp_auto', '?')} on this CPU (bf16 only where the CPU has native bfloat16: AVX512-BF16 or AMX).",
        "",
    ]
    peak = d.get("peak")
    if peak:
        out += [
            f"Matmul peak of this machine (square GEMMs, best size): fp32 {peak['fp32']['gflops']:.0f} GFLOP/s, "
            f"bf16 {peak['bf16']['gflops']:.0f} GFLOP/s.",
            "",
        ]
    out += [
        "| training step | batch | precision | images/s | GFLOP/s | share of its peak | vs fp32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for recipe, s in d["steps"].items():
        for prec, label in LABELS.items():
            if prec not in s:
                continue
            r = s[prec]
            share = f"{100 * r['share_of_peak']:.0f}%" if "share_of_peak" in r else "-"
            out.append(
                f"| {recipe} | {s['batch']} | {label} | {r['images_per_s']:.0f} | {r['gflops']:.0f} | {share} | "
                f"{s['fp32']['step_s'] / r['step_s']:.2f}x |"
            )
    out.append("")
    prof = d.get("profile")
    if prof:
        for prec in ("fp32", "bf16"):
            p = prof.get(prec)
            if not p:
                continue
            phases = ", ".join(f"{k} {v:.0f} ms" for k, v in p["phase_ms_per_step"].items())
            ops = ", ".join(f"{o['op'].replace('aten::', '')} {100 * o['share']:.0f}%" for o in p["top"][:4])
            mm = sum(o["self_ms_per_step"] for o in p["top"] if o["op"] in MATMULS)
            rest = p["step_ms_profiled"] - mm
            out.append(
                f"- Where a main-job {prec} step goes (torch.profiler): {phases}; top operators {ops}; the "
                f"matmuls (mm, addmm, bmm) {mm:.0f} ms of the profiled {p['step_ms_profiled']:.0f} ms, everything "
                f"else {rest:.0f} ms ("
                + ", ".join(
                    f"{o['op'].replace('aten::', '')} {o['self_ms_per_step']:.0f} ms"
                    for o in [o for o in p["top"] if o["op"] not in MATMULS][:4]
                )
                + ")."
            )
        out.append("")
    acc = d.get("accuracy")
    if acc:
        out += [
            "The main job's base shortened (training images x epochs), fp32 against bf16, per seed:",
            "",
            "| seed | images x epochs | fp32 val / test top-1 | bf16 val / test top-1 |",
            "|---|---|---|---|",
        ]
        by = {(r["seed"], r["amp"]): r for r in acc}
        for seed in sorted({r["seed"] for r in acc}):
            f, b = by.get((seed, "off")), by.get((seed, "bf16"))
            if f and b:
                out.append(
                    f"| {seed} | {f['train_limit']} x {f['epochs']} | "
                    f"{f['best_val_top1']:.2f} / {f['test_top1']:.2f} | "
                    f"{b['best_val_top1']:.2f} / {b['test_top1']:.2f} |"
                )
        out.append("")
    kept = [compile_change(c, data.get("compile_step.json")) for c in d.get("changes") or []]
    if kept:
        out += ["Changes to the tool's hot path, each measured alone (interleaved, medians):", ""]
        out += [
            f"- {c['change']}: {c['ratio']} ({'kept' if c['kept'] else 'not kept'}). {c.get('note', '')}".rstrip()
            for c in kept
        ]
        out.append("")
    out += overhead_lines(data.get(OVERHEADS_FILE))
    out += search_step_lines(data.get("search_step.json"))
    gpu = gpu_time_lines(data)
    out += gpu + ([""] if gpu else [])
    goals = [
        gpu_goal(
            search_goal(
                mainjob_goal(g, data.get("pipeline_fashion_mnist.json")), data.get("dcs_search_time_folder.json")
            ),
            data.get(GPU_FILE),
        )
        for g in d.get("goals") or []
    ]
    if goals:
        out += [f"- Goal: {g['goal']}: {g['status']}. {g.get('figures', '')}".rstrip() for g in goals]
    while out and out[-1] == "":
        out.pop()
    return out


def overhead_lines(d: dict[str, Any] | None) -> list[str]:
    """The candidates of the loop besides its step (``bench/tool_speed.py --parts overheads``): data
    loading, the per-epoch validation pass, the batch size."""
    o = (d or {}).get("overheads")
    if not o:
        return []
    rates = o["batch_images_per_s"]
    ref = rates.get(str(o["batch"]))
    by_batch = ", ".join(
        f"{b}: {r:.0f}" + (f" ({r / ref:.2f}x)" if ref and b != str(o["batch"]) else "") for b, r in rates.items()
    )
    threads = d.get("threads")
    return [
        f"What the main job's loop spends besides its steps ({o['amp']}, batch {o['batch']}, {threads} thread"
        f"{'s' if threads != 1 else ''}, {_load_note(d)}; `bench/tool_speed.py --parts overheads`, "
        f"`bench/results/{OVERHEADS_FILE}`):",
        "",
        f"- Data: a training batch from the real Fashion-MNIST split (the loop's loader and preprocessing) takes "
        f"{1e3 * o['data_s']:.2f} ms against {1e3 * o['step_s']:.0f} ms for its step: {100 * o['data_share']:.2f}% "
        "of the loop, all that loading on another thread could save (not done).",
        f"- Evaluation: the validation pass ({o['eval_images']:,} images) takes {o['eval_s']:.1f} s against "
        f"{o['epoch_steps_s']:.0f} s for an epoch of steps ({o['train_images']:,} images): "
        f"{100 * o['eval_share']:.1f}% of an epoch; it picks the best epoch, so it stays.",
        f"- Batch size, the step's images/s (batch: images/s, against batch {o['batch']}): {by_batch}. "
        + (
            f"The main job's batch {o['batch']} is the fastest per image of these."
            if ref is not None and ref >= max(rates.values())
            else "A different batch is a different recipe (its learning rate and accuracy): not changed."
        ),
        "",
    ]


def search_step_lines(d: dict[str, Any] | None) -> list[str]:
    """The DCS search's steps against the dense model's, before and after a change of the search's hot
    path (``bench/search_step.py``, one run per checkout), and AdamW's default against its fused kernel."""
    if not d or len(d.get("runs") or {}) < 2:
        return []
    (before, b), (after, a) = list(d["runs"].items())[:2]
    out = [
        f"The DCS search's steps, as a share of the dense model's step (`bench/search_step.py`, "
        f"{a['threads']} threads, {a['models']['dinov2']['precision']}; `bench/results/search_step.json`), "
        f"{before} -> {after}:",
        "",
        "| model | batch | weight step / dense | architecture step / dense | AdamW step, default -> fused |",
        "|---|---|---|---|---|",
    ]
    for name, m in a["models"].items():
        o = b["models"][name]
        ms = m["median_ms"]
        out.append(
            f"| {name} | {m['batch']} | {o['weight_step_over_dense']:.3f} -> {m['weight_step_over_dense']:.3f} | "
            f"{o['arch_step_over_dense']:.3f} -> {m['arch_step_over_dense']:.3f} | "
            f"{ms['adamw_default']:.1f} -> {ms['adamw_fused']:.1f} ms ({m['adamw_fused_speedup']:.1f}x) |"
        )
    return out + [""]


MAINJOB_GOAL_S = 12 * 60


def mainjob_goal(goal: dict[str, Any], run: dict[str, Any] | None) -> dict[str, Any]:
    """The main-job time goal judged on the README command's own run (``pipeline_fashion_mnist.json``,
    written from a fresh clone) where it has one; other goals as the bench wrote them."""
    if not goal["goal"].startswith("the README main job in ") or not run or "wall_s" not in run:  # not the GPU one
        return goal
    met = run["wall_s"] <= MAINJOB_GOAL_S
    return dict(
        goal,
        status=f"{'met' if met else 'not met'}: {run['wall_s']:,.0f} s (setup excluded) at commit "
        f"{run.get('commit', '?')}, training in {run.get('amp', 'fp32')}",
        figures=f"{run.get('machine_note', '')}; test top-1 {run['dense']['test_top1']:.2f}% dense -> "
        f"{run['final']['test_top1']:.2f}% at {run['comparison']['flops_ratio']:.3f}x "
        f"(bench/results/pipeline_fashion_mnist.json). Where the CPU has no native bfloat16 the "
        f"run trains in fp32: {goal.get('figures', '')}",
    )


def compile_change(change: dict[str, Any], run: dict[str, Any] | None) -> dict[str, Any]:
    """The torch.compile line from ``bench/compile_step.py``'s run where it has one."""
    if not change["change"].startswith("torch.compile") or not run:
        return change
    up, comp = run["compiled_speedup"], run["compile_s"]
    load = f"1-minute load average {run['load_at_start']:g} at the start" if run["load_at_start"] >= 0.5 else "quiet"
    return dict(
        change,
        change="torch.compile of the model's forward (inductor), the main job's base step",
        ratio=f"fp32 {up['fp32']:.2f}x, bf16 {up['bf16']:.2f}x per step ({run['threads']} thread, {load}); "
        f"compiling takes {comp['fp32']:.0f} s (fp32) / {comp['bf16']:.0f} s (bf16)",
        kept=False,
        note="the gain is about the compile's own cost on the main job's base (bf16 1.1x of a "
        "5-minute bf16 base saves about 30 s; the compile, plus recompiles for the last partial "
        "batch and evaluation, takes about as long); bench/results/compile_step.json",
    )


def search_goal(goal: dict[str, Any], run: dict[str, Any] | None) -> dict[str, Any]:
    """The DINOv2 search-time goal judged on ``bench/dcs_search_time.py --folder``'s runs where there are some."""
    if not goal["goal"].startswith("search dcs of the DINOv2") or not run or not run.get("runs"):
        return goal
    rows = run["runs"]
    best = min(rows, key=lambda r: r["wall_s"])
    met = best["wall_s"] <= best["goal_s"]
    parts = "; ".join(
        f"{_amp(r['amp'])} ({r.get('precision') or '?'}): {r['wall_s']:.0f} s, probes "
        f"{_probe_s(r):.0f} s, epochs {', '.join(f'{t:.0f}' for t in r['epoch_time_s'])} s, landed "
        f"{r['flops_ratio']:.3f}x, validation {r['val_top1']:.1f}% (dense {r['dense_val_top1']:.1f}%), "
        f"kept {r.get('kept')}"
        for r in rows
    )
    load = run["machine"].get("load_average_at_start", 0)
    return dict(
        goal,
        status=f"{'met' if met else 'not met'} with {_amp(best['amp'])}: {best['wall_s']:.0f} s against "
        f"{best['goal_s']:.0f} s",
        figures=f"4 epochs on 2,000 ImageFolder PNGs (bench/results/dcs_search_time_folder.json, "
        f"{run['machine'].get('cpu_threads')} threads, 1-minute load average {load:.1f} at the start): "
        f"{parts}",
    )


def _amp(amp: str) -> str:
    """A timed run's precision option as the goal line names it (``default``: no --amp given)."""
    return "the default --amp (auto)" if amp in ("default", "auto") else f"--amp {amp}"


def _probe_s(r: dict[str, Any]) -> float:
    return next((v for k, v in r["phases_s"].items() if k.startswith("DCS: measuring")), float("nan"))
