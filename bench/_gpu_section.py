"""The README's GPU figures, generated from ``bench/results/gpu_<device>.json`` (``bench/gpu.py``) and
``bench/results/tool_speed_<device>.json`` (``bench/tool_speed.py --device cuda``) by
``bench/make_results.py``; no torch here."""

from __future__ import annotations

from typing import Any

GPU_START, GPU_END = "<!-- gpu:start -->", "<!-- gpu:end -->"
GPU_FILE, GPU_SPEED_FILE = "gpu_nvidia-h200.json", "tool_speed_nvidia-h200.json"
MAIN_JOB_GPU_S = 180  # issue goal: the main job on one GPU in <= 3 minutes

ROWS = [  # label, model names (slash-joined in one cell)
    ("`evit` keep 0.7 / 0.5", ["evit_0.7", "evit_0.5"]),
    ("`dynamicvit` rho 0.7", ["dynamicvit_0.7"]),
    ("`uniform` 0.6x, widths multiples of 8 / any", ["uniform_0.6x_aligned", "uniform_0.6x_unaligned"]),
    (
        "`dcs` 0.6x (residual family, weight magnitude), multiples of 8 / any",
        ["dcs_0.6x_aligned", "dcs_0.6x_unaligned"],
    ),
    (
        "`sparsifiner` unstructured / block gather / block flex",
        ["sparsifiner", "sparsifiner_block_gather", "sparsifiner_block_flex"],
    ),
    ("`mgvit` epsilon 1 (random weights: both stages)", ["mgvit"]),
]


def _x(vals: list[Any]) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}x" for v in vals)


def gpu_table(data: dict[str, Any]) -> list[str]:
    """Lines between the README's gpu markers: every method against the dense DeiT-S, then the main job."""
    d = data.get(GPU_FILE)
    if not d or "models" not in d or "by_dtype" not in d["models"]:
        return ["(not measured yet: `python bench/gpu.py` on a GPU)"]
    m, gpu = d["models"], d["machine"].get("gpu", "GPU")
    dtype = "bf16" if "bf16" in m["by_dtype"] else next(iter(m["by_dtype"]))
    by, big = m["by_dtype"][dtype], f"batch_{m['big_batch']}"
    out = [
        f"On one {gpu} (`bench/results/{GPU_FILE}`: {m['model']['name']} with random weights, {dtype}, eager, "
        "every model interleaved with the dense one; FLOPs ratio in brackets):",
        "",
        f"| method | batch {m['big_batch']} | batch 1 |",
        "|---|---|---|",
    ]
    for label, names in ROWS:
        flops = " / ".join(f"{m['flops_ratio'][n]:.2f}x" for n in names if n in m["flops_ratio"])
        cells = [_x([by[b]["speedup_vs_dense"].get(n) for n in names]) for b in (big, "batch_1")]
        out.append(f"| {label} ({flops}) | {cells[0]} | {cells[1]} |")
    p = d.get("pipeline")
    if p and "wall_s" in p:
        r, c = p["report"], p["report"]["comparison"]
        steps = ", ".join(f"{k} {v:.0f} s" for k, v in p["steps_s"].items() if v and v >= 1)
        out += [
            "",
            f"The README main job on the same {gpu} (`bench/gpu.py --sections pipeline`, device auto, `--amp auto`: "
            f"{r.get('dtype')} with TF32): {p['wall_s']:.0f} s end to end ({steps}); test top-1 "
            f"{r['dense']['test_top1']:.2f}% dense -> {r['final']['test_top1']:.2f}% at {c['flops_ratio']:.3f}x the "
            f"FLOPs. Its model against the dense base at batch 64: {c['throughput_speedup']:.2f}x eager"
            + _compiled(p)
            + ". A 36 MFLOPs model is launch-bound on such a GPU: compress it for CPUs.",
        ]
    return out


def _compiled(p: dict[str, Any]) -> str:
    f = p.get("final_vs_dense_fp32", {}).get("ratios", {})
    v = f.get("throughput_speedup_compiled")
    return "" if v is None else f", {v:.2f}x compiled (CUDA graphs)"


def gpu_time_lines(data: dict[str, Any]) -> list[str]:
    """The Time section's GPU part: the training steps against the GPU's own peak, and why ``--amp auto``
    stays fp32 (TF32) there."""
    d = data.get(GPU_SPEED_FILE)
    if not d or "steps" not in d:
        return []
    gpu = d["machine"].get("gpu", "GPU")
    pk = d["peak"]
    out = [
        f"On one {gpu} (`bench/tool_speed.py --device cuda`, `bench/results/{GPU_SPEED_FILE}`): matmul peak "
        f"fp32 (TF32) {pk['fp32']['gflops'] / 1e3:.0f} TFLOP/s, bf16 {pk['bf16']['gflops'] / 1e3:.0f} TFLOP/s.",
        "",
        "| training step on the GPU | batch | fp32 (TF32) ms | bf16 autocast ms | bf16 vs fp32 | fp32 share of peak |",
        "|---|---|---|---|---|---|",
    ]
    for recipe, s in d["steps"].items():
        f, b = s["fp32"], s["bf16"]
        out.append(
            f"| {recipe} | {s['batch']} | {1e3 * f['step_s']:.1f} | {1e3 * b['step_s']:.1f} | "
            f"{f['step_s'] / b['step_s']:.2f}x | {100 * f.get('share_of_peak', 0):.1f}% |"
        )
    prof = d.get("profile", {}).get("fp32")
    busy = prof.get("device_busy_share") if prof else None
    acc = [r for r in d.get("accuracy", []) if r["amp"] in ("off", "bf16")]
    out.append("")
    if busy is not None:
        out.append(
            f"- The GPU computes for {100 * busy:.0f}% of a main-job fp32 step (torch.profiler, kernel time over the "
            "step): these models are bound by the host launching their kernels, so bf16 autocast adds cast kernels "
            "and saves nothing; `--amp auto` trains in fp32 (TF32) on a GPU."
        )
    if acc:
        cells = "; ".join(f"seed {r['seed']} {r['amp']}: {r['test_top1']:.2f}%" for r in acc)
        out.append(f"- The main job's base shortened on the GPU, test top-1 ({acc[0]['train_limit']} x 2): {cells}.")
    return out


def gpu_goal(goal: dict[str, Any], d: dict[str, Any] | None) -> dict[str, Any]:
    """The GPU main-job goal's status from ``gpu_<device>.json``'s pipeline section."""
    if not goal["goal"].startswith("the README main job on one GPU"):
        return goal
    p = (d or {}).get("pipeline")
    if not p or "wall_s" not in p:
        return dict(goal, status="not measured (needs a lent GPU: `python bench/gpu.py --sections pipeline`)")
    gpu = d["machine"].get("gpu", "GPU")
    met = p["wall_s"] <= MAIN_JOB_GPU_S
    return dict(
        goal,
        status=f"{'met' if met else 'not met'} on an {gpu.replace('NVIDIA ', '')}: {p['wall_s']:.0f} s",
        figures=f"(`bench/results/{GPU_FILE}`; an H100 was not lent, the H200 has the same chip and matrix rates)",
    )
