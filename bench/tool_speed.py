"""How fast is the tool itself (issue: the main job in minutes)? Per stage, against this machine's peak.

1. ``peak``: this machine's matmul peak in fp32 and bf16 (square GEMMs of ``--gemm`` sizes, ``--threads``
   threads, the median of ``--reps``), the yardstick for everything below.
2. ``steps``: the training step of each recipe's model (forward + backward + AdamW, the loop's own
   pieces: :func:`nascompress.train_loop.fit`'s loss and optimizer) at its batch size, fp32 and bf16
   autocast interleaved (medians): images/s, achieved GFLOP/s (3 x 2 x MACs per image: the forward and
   a backward of twice its cost) and its share of the peak of that precision. Recipes: ``main``
   (the README main job's base: 28 px, patch 4, width 96, depth 6, batch 128) and ``dinov2``
   (ViT-S/14 at 112 px, batch 16, the DINOv2 recipe's fine-tuning shape).
3. ``profile``: where a main-job step's time goes (torch.profiler, the top operators by self CPU time).
4. ``commands``: the user's commands on the main job's model as a fresh process each (start-up
   included): ``--version``-free ``nascompress --help`` (start-up alone), then ``train``, ``search dcs``
   and ``retrain`` on ``--train-limit`` images, ``--eval-limit`` evaluation images; each command's
   own ``train_time_s`` (the loop) beside its wall time says how much is start-up, probes and evaluation.

    python bench/tool_speed.py --out bench/results/tool_speed.json

Speed figures are only meaningful on a quiet machine: the 1-minute load average is recorded at the
start and after each part. ``--parts`` picks parts (``peak,steps,profile,commands``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, header, save  # noqa: E402  (puts the repository on sys.path)

RECIPES = {  # the model and batch of each recipe's training step
    "main": {"spec": dict(img_size=28, patch_size=4, embed_dim=96, depth=6, num_heads=3, in_chans=1, num_classes=10),
             "batch": 128},
    "dinov2": {"timm": "vit_small_patch14_dinov2", "kwargs": dict(img_size=112, num_classes=10), "batch": 16},
}


def load() -> float:
    return round(os.getloadavg()[0], 2)


def gemm_peak(dtype_name: str, sizes: list[int], reps: int) -> dict[str, Any]:
    """GFLOP/s of square GEMMs (2 n^3 FLOPs each), the median of ``reps`` after a warm-up; the best size."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        for _ in range(3):
            a @ b
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            ts.append(time.perf_counter() - t0)
        out[str(n)] = 2 * n ** 3 / statistics.median(ts) / 1e9
    return {"gflops": max(out.values()), "by_size": out}


def build(recipe: str) -> tuple[Any, Any]:
    import torch

    from nascompress.models import build_model, custom_vit_spec

    r = RECIPES[recipe]
    if "spec" in r:
        model = build_model(custom_vit_spec(**r["spec"]))
        x = torch.randn(r["batch"], r["spec"]["in_chans"], r["spec"]["img_size"], r["spec"]["img_size"])
    else:
        import timm

        model = timm.create_model(r["timm"], pretrained=False, **r["kwargs"])
        x = torch.randn(r["batch"], 3, r["kwargs"]["img_size"], r["kwargs"]["img_size"])
    return model, x


def step_speed(recipe: str, reps: int) -> dict[str, Any]:
    """One training step (CE, AdamW) of the recipe's model, fp32 and bf16 autocast interleaved."""
    import torch
    import torch.nn.functional as F

    from nascompress.profiling import count_flops
    from nascompress.runtime import autocast

    model, x = build(recipe)
    macs = count_flops(model.eval(), x[:2]).total  # per image
    y = torch.randint(0, 10, (x.shape[0],))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dev = torch.device("cpu")
    model.train()

    def step(amp: str) -> float:
        t0 = time.perf_counter()
        with autocast(dev, amp):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    for amp in ("off", "bf16"):
        for _ in range(2):
            step(amp)
    times: dict[str, list[float]] = {"off": [], "bf16": []}
    for _ in range(reps):
        for amp in ("off", "bf16"):
            times[amp].append(step(amp))
    res: dict[str, Any] = {"batch": x.shape[0], "macs_per_image": macs}
    for amp, ts in times.items():
        t = statistics.median(ts)
        res["fp32" if amp == "off" else "bf16"] = {"step_s": t, "images_per_s": x.shape[0] / t,
                                                   "gflops": 6 * macs * x.shape[0] / t / 1e9}
    return res


def profile_table(recipe: str, steps: int, top: int) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    model, x = build(recipe)
    y = torch.randint(0, 10, (x.shape[0],))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
             "share": e.self_cpu_time_total / total, "calls_per_step": e.count / steps} for e in events[:top]]


def commands(a: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="nc-speed-"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(a.threads), NASCOMPRESS_PROGRESS="off")
    limits = ["--train-limit", str(a.train_limit), "--eval-limit", str(a.eval_limit)]
    base, sup, mat, ret = (str(work / n) for n in ("base", "dcs", "mat", "final"))
    chain = [("start-up (nascompress --help)", ["--help"], None),
             ("train", ["train", "--out", base, "--epochs", "1", *limits], base),
             ("search dcs", ["search", "dcs", base, "--out", sup, "--target-flops", "0.7", "--epochs", "1", *limits], sup),
             ("materialize", ["materialize", sup, "--out", mat], None),
             ("retrain", ["retrain", mat, "--out", ret, "--epochs", "1", *limits], ret)]
    rows = []
    for name, cli, run in chain:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "nascompress.cli.main", *cli], capture_output=True, text=True,
                           env=env, cwd=str(work))
        wall = time.perf_counter() - t0
        row: dict[str, Any] = {"command": name, "wall_s": wall, "ok": r.returncode == 0, "load_after": load()}
        if r.returncode != 0:
            row["error"] = (r.stderr or r.stdout).strip().splitlines()[-1:]
        if run and (Path(run) / "metrics.json").is_file():
            m = json.loads((Path(run) / "metrics.json").read_text())
            row["loop_s"] = m.get("train_time_s")
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="peak,steps,profile,commands")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gemm", default="512,1024,2048")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--recipes", default="main,dinov2")
    ap.add_argument("--train-limit", type=int, default=2000)
    ap.add_argument("--eval-limit", type=int, default=500)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tool_speed.json")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    parts = a.parts.split(",")
    res: dict[str, Any] = dict(header(), threads=a.threads, load_at_start=load())
    if "peak" in parts:
        sizes = [int(s) for s in a.gemm.split(",")]
        res["peak"] = {d: gemm_peak(d, sizes, a.reps) for d in ("fp32", "bf16")}
        res["peak"]["load_after"] = load()
        save(a.out, res)
    if "steps" in parts:
        res["steps"] = {}
        for recipe in a.recipes.split(","):
            s = step_speed(recipe, a.reps)
            if "peak" in res:
                for prec in ("fp32", "bf16"):
                    s[prec]["share_of_peak"] = s[prec]["gflops"] / res["peak"][prec]["gflops"]
            s["bf16_speedup"] = s["fp32"]["step_s"] / s["bf16"]["step_s"]
            s["load_after"] = load()
            res["steps"][recipe] = s
            save(a.out, res)
    if "profile" in parts:
        res["profile"] = {"recipe": "main", "steps": 5, "top": profile_table("main", 5, 12)}
        save(a.out, res)
    if "commands" in parts:
        res["commands"] = {"train_limit": a.train_limit, "eval_limit": a.eval_limit, "rows": commands(a)}
        save(a.out, res)
    print(json.dumps({k: v for k, v in res.items() if k in ("peak", "steps")}, indent=1, default=str)[:4000])


if __name__ == "__main__":
    main()
