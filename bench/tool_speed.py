"""How fast is the tool itself (issue: the main job in minutes)? Per stage, against this machine's peak.

1. ``peak``: this machine's matmul peak in fp32 and bf16 (square GEMMs of ``--gemm`` sizes, ``--threads``
   threads, the median of ``--reps``), the yardstick for everything below.
2. ``steps``: the training step of each recipe's model (forward + backward + AdamW, the loop's own
   pieces: :func:`nascompress.train.loop.fit`'s loss and optimizer) at its batch size, fp32 and bf16
   autocast interleaved (medians): images/s, achieved GFLOP/s (3 x 2 x MACs per image: the forward and
   a backward of twice its cost) and its share of the peak of that precision: ``fp32``, ``bf16`` (what
   ``--amp auto`` runs on a CPU with native bf16: autocast, attention as explicit matmuls) and
   ``bf16_flash_attention`` (autocast with SDPA's fused CPU kernel, for comparison). Recipes: ``main``
   (the README main job's base: 28 px, patch 4, width 96, depth 6, batch 128) and ``dinov2``
   (ViT-S/14 at 112 px, batch 16, the DINOv2 recipe's fine-tuning shape).
3. ``profile``: where a main-job step's time goes (torch.profiler: forward, backward and optimizer, and the
   top operators by self CPU time), fp32 and bf16.
4. ``commands``: the user's commands on the main job's model as a fresh process each (start-up
   included): ``--version``-free ``nascompress --help`` (start-up alone), then ``train``, ``search dcs``
   and ``retrain`` on ``--train-limit`` images, ``--eval-limit`` evaluation images; each command's
   own ``train_time_s`` (the loop) beside its wall time says how much is start-up, probes and evaluation.

    python bench/tool_speed.py   # writes bench/results/tool_speed_<CPU class>.json, e.g. tool_speed_amd-epyc.json

One file per CPU class (``bench/_cpu.py``: vendor and family from the model name, ``AMX`` where it has
AMX tiles; the model name and the flags of note recorded under ``machine``), so that each machine's
figures stand beside the others' and the README's Time section (``bench/make_results.py``) shows them
all; on a GPU ``tool_speed_<GPU name>.json``.

``--device cuda``: the same parts on a GPU (the peak from CUDA GEMMs, fp32 as the runs compute it, with
TF32; every timing synchronized; the commands on the CLI's default device, which is the GPU).

``overheads`` (not in the default parts): what the main job's loop spends besides its steps (a batch
from the real Fashion-MNIST split against its bf16 step, a validation pass against an epoch of steps) and
the bf16 step's images/s at ``--batches``; write it to its own ``--out``
(``bench/results/tool_speed_overheads.json``).

Speed figures are only meaningful on a quiet machine: the 1-minute load average is recorded at the
start and after each part. ``--parts`` picks parts (``peak,steps,profile,accuracy,commands``); ``accuracy``:
the main job's base on ``--accuracy-limit`` images for 2 epochs, fp32 against bf16, seeds 0 and 1.
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

from _common import PRECISIONS, RECIPES, ROOT, build, header, load, save, slug, train_step  # noqa: E402  (puts the repository on sys.path)
from _cpu import cpu_info  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from nascompress import runtime  # noqa: E402
from nascompress.data import DataConfig, load_data, training_batches  # noqa: E402
from nascompress.profiling.evaluate import evaluate  # noqa: E402
from nascompress.models.build import build_model, custom_vit_spec  # noqa: E402
from nascompress.profiling import count_flops  # noqa: E402
from nascompress.train.loop import fit
from nascompress.train.run import input_spec_for, train_recipe  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(dev: torch.device, fn: Any) -> tuple[float, Any]:
    """(seconds, result) of ``fn()``, synchronized on ``dev`` before and after."""
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - t0, out


def gemm_peak(dtype_name: str, sizes: list[int], reps: int, dev: torch.device) -> dict[str, Any]:
    """GFLOP/s of square GEMMs (2 n^3 FLOPs each, random data), the median of ``reps`` after a warm-up;
    the best size."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n, device=dev).to(dtype), torch.randn(n, n, device=dev).to(dtype)
        for _ in range(3):
            a @ b
        ts = [timed(dev, lambda: a @ b)[0] for _ in range(reps)]
        out[str(n)] = 2 * n**3 / statistics.median(ts) / 1e9
    return {"gflops": max(out.values()), "by_size": out}


def step_speed(recipe: str, reps: int, dev: torch.device) -> dict[str, Any]:
    """One training step (CE, AdamW) of the recipe's model per precision, interleaved (medians)."""
    built = {}
    for name in PRECISIONS:
        torch.manual_seed(0)
        model, x = build(recipe)
        model = model.to(dev)
        built[name] = (model.train(), runtime.adamw(model.parameters(), dev, lr=1e-4))
    macs = count_flops(build(recipe)[0].eval(), x[:2]).total  # per image
    x = x.to(dev)
    y = torch.randint(0, 10, (x.shape[0],), device=dev)

    def step(name: str) -> float:
        return timed(dev, lambda: train_step(built[name][0], x, y, built[name][1], PRECISIONS[name], dev))[0]

    for name in PRECISIONS:
        for _ in range(2):
            step(name)
    times: dict[str, list[float]] = {name: [] for name in PRECISIONS}
    for _ in range(reps):
        for name in PRECISIONS:
            times[name].append(step(name))
    res: dict[str, Any] = {"batch": x.shape[0], "macs_per_image": macs}
    for name, ts in times.items():
        t = statistics.median(ts)
        res[name] = {"step_s": t, "images_per_s": x.shape[0] / t, "gflops": 6 * macs * x.shape[0] / t / 1e9}
    return res


def profile_table(recipe: str, steps: int, top: int, amp: str, dev: torch.device) -> dict[str, Any]:
    """Where a step's time goes: the phases (forward, backward, optimizer) and the top operators by self
    time on the device (CPU time on a CPU, kernel time on CUDA)."""
    torch.manual_seed(0)
    model, x = build(recipe)
    model, x = model.to(dev).train(), x.to(dev)
    y = torch.randint(0, 10, (x.shape[0],), device=dev)
    opt = runtime.adamw(model.parameters(), dev, lr=1e-4)
    train_step(model, x, y, opt, amp, dev)
    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync(dev)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            train_step(model, x, y, opt, amp, dev)
        sync(dev)
    wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()

    def self_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total)

    phases = {e.key: e.cpu_time_total / 1e3 / steps for e in events if e.key in ("forward", "backward", "optimizer")}
    ops = sorted((e for e in events if e.key not in phases), key=self_us, reverse=True)
    total = sum(self_us(e) for e in ops) or 1.0
    return {
        "amp": amp,
        "step_ms_profiled": wall * 1e3,
        "phase_ms_per_step": phases,  # host time of each phase (on CUDA: launching its kernels)
        "top_by": "self CUDA kernel time" if cuda else "self CPU time",
        "device_busy_share": total / 1e3 / steps / (wall * 1e3) if cuda else None,
        "top": [
            {
                "op": e.key,
                "self_ms_per_step": self_us(e) / 1e3 / steps,
                "share": self_us(e) / total,
                "calls_per_step": e.count / steps,
            }
            for e in ops[:top]
        ],
    }


def accuracy(seeds: list[int], train_limit: int, epochs: int, dev: torch.device) -> list[dict[str, Any]]:
    """The main job's base shortened (``train_limit`` images, ``epochs``), fp32 against ``--amp bf16``
    (the auto path here) per seed: best validation and test top-1, and the loop's time."""
    spec = custom_vit_spec(**RECIPES["main"]["spec"])
    ispec = input_spec_for(build_model(spec), "fashion-mnist")
    data = load_data(DataConfig(dataset="fashion-mnist", train_limit=train_limit), spec=ispec)
    rows = []
    for seed in seeds:
        for amp in ("off", "bf16"):
            cfg = train_recipe(fine_tune=False, epochs=epochs, seed=seed, amp=amp).replace(
                eval_start=False, device=str(dev)
            )
            torch.manual_seed(seed)
            m = fit(build_model(spec), data=data, input_spec=ispec, cfg=cfg)
            rows.append(
                {
                    "seed": seed,
                    "amp": amp,
                    "train_limit": train_limit,
                    "epochs": epochs,
                    "best_val_top1": m.best_val_top1,
                    "test_top1": m.test_top1,
                    "train_time_s": m.train_time_s,
                    "load_after": load(),
                }
            )
    return rows


def overheads(reps: int, batches: list[int], dev: torch.device) -> dict[str, Any]:
    """What the main job's fit loop spends besides its steps, on the real data: a training batch from the
    Fashion-MNIST split through the loop's own loader and preprocessing, against the step of that batch in
    the loop's precision (``--amp auto``; interleaved, medians: the share the data would save if it came
    from another thread); one epoch's validation pass (the 6,000 validation images at the loop's
    evaluation batch) against the epoch's training steps (54,000 images at the measured step); and the
    step's images/s at ``batches`` (do larger batches fill the cores better?)."""
    spec = custom_vit_spec(**RECIPES["main"]["spec"])
    torch.manual_seed(0)
    model = build_model(spec).to(dev).train()
    ispec = input_spec_for(model, "fashion-mnist")
    data = load_data(DataConfig(dataset="fashion-mnist"), spec=ispec)
    opt = runtime.adamw(model.parameters(), dev, lr=1e-4)
    batch = RECIPES["main"]["batch"]
    amp = runtime.resolve_amp("auto", dev)  # the loop's precision here
    stream = training_batches(data, ispec, batch_size=batch, seed=0, device=dev)
    next(stream)
    data_s, step_s = [], []
    for i in range(reps + 2):
        td, (x, y) = timed(dev, lambda: next(stream))
        ts, _ = timed(dev, lambda: train_step(model, x, y, opt, amp, dev))
        if i >= 2:
            data_s.append(td)
            step_s.append(ts)
    d, st = statistics.median(data_s), statistics.median(step_s)
    model.eval()
    ev, rec = timed(
        dev,
        lambda: evaluate(
            model,
            data.val,
            input_spec=ispec,
            device=dev,
            batch_size=train_recipe(fine_tune=False).eval_batch_size,
            amp=amp,
        ),
    )
    epoch_steps = -(-len(data.train) // batch)
    out: dict[str, Any] = {
        "amp": amp,
        "batch": batch,
        "data_s": d,
        "step_s": st,
        "data_share": d / (d + st),
        "eval_s": ev,
        "eval_images": rec["n"],
        "train_images": len(data.train),
        "epoch_steps_s": epoch_steps * (d + st),
        "eval_share": ev / (ev + epoch_steps * (d + st)),
    }
    built = {}
    for b in batches:
        torch.manual_seed(0)
        m = build_model(spec).to(dev).train()
        built[b] = (
            m,
            runtime.adamw(m.parameters(), dev, lr=1e-4),
            *next(training_batches(data, ispec, batch_size=b, seed=0, device=dev)),  # already on dev
        )
    times: dict[int, list[float]] = {b: [] for b in batches}
    for i in range(reps + 2):
        for b, (m, o, x, y) in built.items():
            t, _ = timed(dev, lambda: train_step(m, x, y, o, amp, dev))
            if i >= 2:
                times[b].append(t)
    out["batch_images_per_s"] = {str(b): b / statistics.median(ts) for b, ts in times.items()}
    return out


def commands(a: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="nc-speed-"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(a.threads), NASCOMPRESS_PROGRESS="off")
    limits = ["--train-limit", str(a.train_limit), "--eval-limit", str(a.eval_limit)]
    base, sup, mat, ret = (str(work / n) for n in ("base", "dcs", "mat", "final"))
    chain = [
        ("start-up (nascompress --help)", ["--help"], None),
        ("train", ["train", "--out", base, "--epochs", "1", *limits], base),
        ("search dcs", ["search", "dcs", base, "--out", sup, "--target-flops", "0.7", "--epochs", "1", *limits], sup),
        ("materialize", ["materialize", sup, "--out", mat], None),
        ("retrain", ["retrain", mat, "--out", ret, "--epochs", "1", *limits], ret),
    ]
    rows = []
    for name, cli, run in chain:
        t0 = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-m", "nascompress.cli.main", *cli], capture_output=True, text=True, env=env, cwd=str(work)
        )
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
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the same parts on the GPU")
    ap.add_argument("--gemm", default=None, help="GEMM sizes of the peak (default 512,1024,2048; CUDA 4096,8192)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--recipes", default="main,dinov2")
    ap.add_argument("--train-limit", type=int, default=2000)
    ap.add_argument("--eval-limit", type=int, default=500)
    ap.add_argument("--batches", default="64,128,256,512", help="batch sizes of the overheads part")
    ap.add_argument("--accuracy-limit", type=int, default=24000, help="training images of the accuracy part")
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/tool_speed_<CPU class or GPU>.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    parts = a.parts.split(",")
    res: dict[str, Any] = dict(
        header(),
        threads=a.threads,
        load_at_start=load(),
        host_allocator_keeps_freed_memory=runtime.keep_freed_memory(),
        device=str(dev),
        amp_auto=runtime.resolve_amp("auto", dev),
    )
    if dev.type == "cuda":
        res["machine"]["gpu"] = torch.cuda.get_device_name(dev)
    res["machine"].update(cpu_info())  # the CPU's model name, flags of note and class (its file's name)
    if a.out is None:
        which = res["machine"]["gpu"] if dev.type == "cuda" else res["machine"].get("cpu_class", "cpu")
        a.out = ROOT / "bench" / "results" / f"tool_speed_{slug(which)}.json"
    # a figure is "quiet" only when the machine had no other work: the 1-minute load average under 0.5
    res["measured_under_load"] = res["load_at_start"] >= 0.5
    with runtime.configured(dev):  # the runs' settings: fp32 on CUDA as TF32
        if "peak" in parts:
            gemm = a.gemm or ("4096,8192" if dev.type == "cuda" else "512,1024,2048")
            sizes = [int(s) for s in gemm.split(",")]
            res["peak"] = {d: gemm_peak(d, sizes, a.reps, dev) for d in ("fp32", "bf16")}
            res["peak"]["load_after"] = load()
            save(a.out, res)
        if "steps" in parts:
            res["steps"] = {}
            for recipe in a.recipes.split(","):
                s = step_speed(recipe, a.reps, dev)
                if "peak" in res:
                    for prec in PRECISIONS:
                        s[prec]["share_of_peak"] = s[prec]["gflops"] / res["peak"][prec[:4]]["gflops"]
                s["bf16_speedup"] = s["fp32"]["step_s"] / s["bf16"]["step_s"]  # the path --amp auto runs here
                s["bf16_flash_attention_speedup"] = s["fp32"]["step_s"] / s["bf16_flash_attention"]["step_s"]
                s["load_after"] = load()
                res["steps"][recipe] = s
                save(a.out, res)
        if "profile" in parts:
            res["profile"] = {
                "recipe": "main",
                "steps": 5,
                "fp32": profile_table("main", 5, 12, "off", dev),
                "bf16": profile_table("main", 5, 12, "bf16", dev),
            }
            res["profile"]["load_after"] = load()
            save(a.out, res)
        if "overheads" in parts:
            res["overheads"] = overheads(a.reps, [int(b) for b in a.batches.split(",")], dev)
            res["overheads"]["load_after"] = load()
            save(a.out, res)
        if "accuracy" in parts:
            res["accuracy"] = accuracy([0, 1], a.accuracy_limit, 2, dev)
            save(a.out, res)
        if "commands" in parts:
            res["commands"] = {"train_limit": a.train_limit, "eval_limit": a.eval_limit, "rows": commands(a)}
            save(a.out, res)
    print(json.dumps({k: v for k, v in res.items() if k in ("peak", "steps")}, indent=1, default=str)[:4000])


if __name__ == "__main__":
    main()
