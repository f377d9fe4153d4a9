"""MG-ViT benchmark on Fashion-MNIST: accuracy and mean FLOPs per image against the dense base for
epsilon in {0.5, 0.7, 0.9, 1.0} (plus a few more points of the curve), throughput against dense
measured interleaved in one process, and the DeiT-S reference FLOPs.

The dense base (runs/base) is a 28 px, patch-4 ViT: its own grid is 7x7 (49 tokens), so MG-ViT's
default 7x7 SGIS costs exactly as much as the dense model. Two settings are measured:

* ``grid7``: the paper's default 7x7 coarse grid. Sub-patches are resampled to the 4 px embedding:
  the image is resampled to 84 px (head, 3x3 -> 4/3 original px each), 56 px (middle, 2x2) and
  28 px (tail). SGIS == the dense model, so mean FLOPs >= dense by construction.
* ``grid4``: the paper's cost regime (SGIS on 7x7 = 1/4 of DeiT-S's 14x14 tokens): a 4x4 coarse grid
  (7 px patches resampled to 4 px, 16 tokens, about 1/3 of the dense 49); MGIS then has
  9*2 + 4*8 + 6 = 56 patch tokens.

Each is fine-tuned from runs/base with ``nascompress.finetune`` (epsilon = 1, CE(MGIS) + KL) on a
train subset for one epoch (validation/test inside the fine-tune limited to 2000 images); the
epsilon sweep then runs on the full 10,000-image test set.

    python bench/mgvit.py [--configs grid4,grid7] [--train-limit 12800]   # -> bench/results/mgvit.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import torch

import nascompress  # noqa: F401
from nascompress.data import DataConfig, InputSpec, load_data, make_loader, preprocess
from nascompress.evaluate import evaluate
from nascompress.finetune import FinetuneJob, finetune
from nascompress.io import load, load_with_arch
from nascompress.methods import get_method
from nascompress.models import ModelSpec, build_model
from nascompress.methods.mgvit import sweep_model
from nascompress.profiling.flops import count_flops
from nascompress.profiling.latency import time_models
from nascompress.train import TrainConfig
from nascompress.utils import write_json

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "runs" / "base"
OUT = ROOT / "bench" / "results" / "mgvit.json"
EPSILONS = [0.5, 0.7, 0.9, 1.0]
EXTRA_EPS = [0.6, 0.8, 0.95, 0.99]


def wait_for_base(base: Path, timeout_s: float) -> None:
    t0 = time.time()
    while not (base / "metrics.json").is_file():
        if time.time() - t0 > timeout_s:
            raise SystemExit(f"{base}/metrics.json did not appear within {timeout_s:.0f}s")
        time.sleep(20)


def deit_reference() -> dict:
    """Per-image GFLOPs of DeiT-S (random weights: counts do not depend on them)."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 224, 224)
    d = build_model(ModelSpec("deit_small_patch16_224", {}))
    out = {"dense_gflops": count_flops(d, x).gflops}
    for name, cfg in (("mgvit", {}), ("mgvit_no_ppsm", {"r_pos": 1.0, "r_neg": 0.0})):
        m = get_method("mgvit")(copy.deepcopy(d), {"name": "mgvit", "config": cfg}).eval()
        f = m.stage_flops()
        out[name] = {"sgis_gflops": f["sgis_flops"] / 1e9, "mgis_gflops": f["mgis_flops"] / 1e9,
                     "ppsm_gflops": f["ppsm_flops"] / 1e9,
                     "epsilon1_gflops": (f["sgis_flops"] + f["mgis_flops"]) / 1e9, "config": m.mg}
    return out


def throughput(dense: torch.nn.Module, mg: torch.nn.Module, x: torch.Tensor, iters: int) -> dict:
    models, labels = [dense], ["dense"]
    for e in EPSILONS:
        m = copy.deepcopy(mg)
        m.mg = dict(mg.mg, epsilon=e)
        models.append(m)
        labels.append(f"eps={e}")
    with torch.no_grad():
        t = time_models(models, x, warmup=2, iters=iters)
    return {lab: {"s_per_batch": ti, "img_per_s": x.shape[0] / ti, "vs_dense": t[0] / ti}
            for lab, ti in zip(labels, t)}


def rethroughput(args: argparse.Namespace, base: Path, out: Path) -> None:
    torch.set_num_threads(args.threads)
    res = json.loads(out.read_text())
    dense, arch = load_with_arch(base)
    spec = InputSpec.from_dict(arch["input"])
    test = load_data(DataConfig(), img_size=spec.img_size).test
    imgs, _ = next(iter(make_loader(test, batch_size=args.batch, shuffle=False)))
    xb = preprocess(imgs, spec)
    for name, entry in res["configs"].items():
        mg = load(Path(args.runs) / f"bench_mgvit_{name}")
        entry[f"throughput_threads{args.threads}"] = throughput(dense, mg, xb, args.iters)
        write_json(out, res)
        print(name, json.dumps(entry[f"throughput_threads{args.threads}"]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="grid4,grid7")
    ap.add_argument("--train-limit", type=int, default=12800)
    ap.add_argument("--train-limit-grid7", type=int, default=None)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--batch", type=int, default=256, help="throughput batch (real test images)")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--wait", type=float, default=3600)
    ap.add_argument("--runs", default=str(ROOT / "runs"))
    ap.add_argument("--base", default=str(BASE))
    ap.add_argument("--test-limit", type=int, default=None, help="dry runs only")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--throughput-only", action="store_true",
                    help="re-time the saved fine-tuned runs into an existing JSON (key throughput_threads<N>)")
    args = ap.parse_args()
    base, out = Path(args.base), Path(args.out)
    if args.throughput_only:
        return rethroughput(args, base, out)
    torch.set_num_threads(min(args.threads, os.cpu_count() or 1))
    t_start = time.time()
    res: dict = {"device": "cpu", "threads": torch.get_num_threads(), "epsilons": EPSILONS,
                 "deit_small_224": deit_reference()}
    write_json(out, res)
    wait_for_base(base, args.wait)
    dense, arch = load_with_arch(base)
    spec = InputSpec.from_dict(arch["input"])
    data_full = load_data(DataConfig(), img_size=spec.img_size)
    test = data_full.test
    if args.test_limit:
        from nascompress.data import Subset
        test = Subset(test, torch.arange(args.test_limit))
    dev = torch.device("cpu")
    t0 = time.time()
    d_eval = evaluate(dense, test, input_spec=spec, device=dev)
    d_flops = count_flops(dense, torch.randn(1, spec.in_chans, *spec.img_size)).total
    res["base_metrics"] = json.loads((base / "metrics.json").read_text())
    res["dense"] = {"run": str(base), "test_top1": d_eval["top1"], "flops": d_flops, "mflops": d_flops / 1e6,
                    "test_n": d_eval["n"], "eval_s": time.time() - t0}
    imgs, _ = next(iter(make_loader(test, batch_size=args.batch, shuffle=False)))
    xb = preprocess(imgs, spec)
    res["configs"] = {}
    for name in args.configs.split(","):
        grid = {"grid4": 4, "grid7": 7}[name]
        limit = args.train_limit_grid7 if (name == "grid7" and args.train_limit_grid7 is not None) else args.train_limit
        out_dir = Path(args.runs) / f"bench_mgvit_{name}"
        cfg = {"grid": grid, "epsilon": 1.0}
        t0 = time.time()
        data_cfg = DataConfig(train_limit=limit, eval_limit=2000)
        tc = TrainConfig(epochs=1, batch_size=128, lr=args.lr, min_lr=1e-5, warmup_epochs=0.1, seed=0)
        entry: dict = {"grid": grid, "train_images": limit, "epochs": 1, "lr": args.lr,
                       "note": "fine-tuned from the dense base, epsilon=1, CE(MGIS)+KL(SGIS||MGIS); val/test inside the "
                               "fine-tune limited to 2000 images"}
        if limit > 0:
            m = finetune(FinetuneJob(run_dir=str(base), method="mgvit", method_config=cfg, data=data_cfg, train=tc,
                                     out=str(out_dir)), force=True)
            entry["finetune_metrics"] = m
        else:
            finetune(FinetuneJob(run_dir=str(base), method="mgvit", method_config=cfg, data=data_cfg, train=tc,
                                 out=str(out_dir), zero_shot=True), force=True)
            entry["note"] = "zero-shot (MGIS initialised from the dense run, no training)"
        entry["finetune_s"] = time.time() - t0
        mg = load(out_dir)
        t0 = time.time()
        sw = sweep_model(mg, test, input_spec=spec, epsilons=sorted(EPSILONS + EXTRA_EPS), device=dev)
        entry["sweep_s"] = time.time() - t0
        for r in sw["rows"]:
            r["delta_top1_vs_dense"] = r["top1"] - res["dense"]["test_top1"]
            r["flops_vs_dense"] = r["mean_flops"] / d_flops
        entry.update({k: v for k, v in sw.items()})
        entry["record"] = json.loads((out_dir / "arch.json").read_text())["methods"][-1]
        entry["throughput_batch"] = args.batch
        entry["throughput"] = throughput(dense, mg, xb, args.iters)
        res["configs"][name] = entry
        res["elapsed_s"] = time.time() - t_start
        write_json(out, res)
        print(json.dumps({name: [(r["epsilon"], round(r["top1"], 2), round(r["exit_share"], 3),
                                  round(r["mean_flops"] / 1e6, 2)) for r in sw["rows"]]}), flush=True)
    res["elapsed_s"] = time.time() - t_start
    write_json(out, res)


if __name__ == "__main__":
    main()
