"""EViT and DynamicViT, measured.

1. CPU throughput against dense, interleaved in one process (``time_models``), on a DeiT-S-shaped
   model at 224 (deit_small_patch16_224, random weights, eval): EViT keep_rate 0.7 at layers
   4/7/10 and DynamicViT rho 0.7 (untrained predictors: the token counts, hence the cost, do
   not depend on the weights), batch 1 and batch 64, with the FLOPs of each.
2. Fashion-MNIST from the dense base run: test top-1 and FLOPs zero-shot and after a short
   fine-tune (``nascompress.finetune``: 1 epoch on the first ``--train-limit`` training images),
   each method at two settings.

    python bench/token_pruning.py --base runs/base --out bench/results/token_pruning.json
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

import nascompress
from nascompress.api import run_data_config
from nascompress.finetune import FinetuneJob, finetune
from nascompress.methods import get_method
from nascompress.models import ModelSpec, build_model
from nascompress.profiling import count_flops
from nascompress.profiling.latency import time_models
from nascompress.train import TrainConfig
from nascompress.utils import write_json


def throughput(res: dict, *, iters: int) -> None:
    dense = build_model(ModelSpec("deit_small_patch16_224")).eval()
    evit = get_method("evit")(copy.deepcopy(dense), {"name": "evit", "config": {"keep_rate": 0.7}}).eval()
    dvit = get_method("dynamicvit")(copy.deepcopy(dense), {"name": "dynamicvit", "config": {"rho": 0.7}}).eval()
    names, models = ["dense", "evit_0.7", "dynamicvit_0.7"], [dense, evit, dvit]
    x1 = torch.randn(1, 3, 224, 224)
    out: dict = {"model": "deit_small_patch16_224 (random weights, eval, 224x224)", "threads": torch.get_num_threads(),
                 "gflops": {n: count_flops(m, x1).gflops for n, m in zip(names, models)}}
    for bs, it in ((1, iters * 3), (64, iters)):
        x = torch.randn(bs, 3, 224, 224)
        t = time_models(models, x, warmup=1 if bs > 1 else 3, iters=it)
        out[f"batch{bs}"] = {"iters": it, "median_s": dict(zip(names, t)),
                             "images_per_s": {n: bs / s for n, s in zip(names, t)},
                             "speedup_vs_dense": {n: t[0] / s for n, s in zip(names[1:], t[1:])}}
        print(json.dumps(out[f"batch{bs}"]), flush=True)
    res["throughput"] = out


def fashion_mnist(res: dict, *, base: Path, train_limit: int, eval_limit: int | None) -> None:
    data = run_data_config(base)
    data = replace(data, train_limit=train_limit, eval_limit=eval_limit)
    spec = json.loads((base / "arch.json").read_text())
    x = torch.randn(64, spec["input"]["in_chans"], *spec["input"]["img_size"])
    dense = nascompress.load(base)
    out: dict = {"base": str(base), "base_metrics": json.loads((base / "metrics.json").read_text()),
                 "dense_mflops": count_flops(dense, x).total / 1e6, "train_limit": train_limit,
                 "eval_limit": eval_limit, "runs": []}
    settings = [("evit", {"keep_rate": 0.7}, 1e-4), ("evit", {"keep_rate": 0.5}, 1e-4),
                ("dynamicvit", {"rho": 0.7}, 1e-3), ("dynamicvit", {"rho": 0.5}, 1e-3)]
    with tempfile.TemporaryDirectory() as tmp:
        for method, cfg, lr in settings:
            row = {"method": method, "config": cfg}
            for zero_shot in (True, False):
                tag = "zero_shot" if zero_shot else "finetuned"
                job = FinetuneJob(run_dir=str(base), method=method, method_config=dict(cfg), data=data,
                                  train=TrainConfig(epochs=1, lr=lr, warmup_epochs=0.0, min_lr=lr / 100, seed=0),
                                  out=f"{tmp}/{method}_{list(cfg.values())[0]}_{tag}", zero_shot=zero_shot)
                t0 = time.perf_counter()
                m = finetune(job)
                model = nascompress.load(job.out)
                row[tag] = {"test_top1": m["test_top1"], "test_n": m["test_n"], "seconds": time.perf_counter() - t0,
                            "mflops": count_flops(model, x).total / 1e6}
                if not zero_shot:
                    row[tag].update(lr=lr, epochs=1, train_images=train_limit)
                print(method, cfg, tag, json.dumps(row[tag]), flush=True)
            out["runs"].append(row)
    out["note"] = ("zero_shot: the method applied to the dense weights without training (DynamicViT: untrained, "
                   "randomly initialised predictors, i.e. a random token choice). finetuned: 1 epoch of "
                   "nascompress.finetune on the first train_limit training images (EViT: CE, keep rate cosine "
                   "from 1 to its target over the first half epoch; DynamicViT: CE + 0.5 KL + 0.5 token MSE + "
                   "2 ratio loss against the dense run, predictors at lr, backbone at 0.01 lr); test top-1 on "
                   "the test split. FLOPs per image (MACs), Fashion-MNIST 28x28 input.")
    res["fashion_mnist"] = out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--out", default="bench/results/token_pruning.json")
    ap.add_argument("--iters", type=int, default=6, help="timed rounds at batch 64 (x3 at batch 1)")
    ap.add_argument("--train-limit", type=int, default=12000)
    ap.add_argument("--eval-limit", type=int, default=None)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-fmnist", action="store_true", help="keep the Fashion-MNIST part of --out as it is")
    ap.add_argument("--wait-base", type=float, default=0, help="seconds to wait for base/metrics.json")
    args = ap.parse_args()
    out = Path(args.out)
    res: dict = json.loads(out.read_text()) if out.is_file() else {}
    res["machine"] = {"cpu_threads": torch.get_num_threads(), "platform": platform.platform(),
                      "torch": torch.__version__}
    if not args.skip_throughput:
        throughput(res, iters=args.iters)
        write_json(out, res)
    if args.skip_fmnist:
        write_json(out, res)
        return
    base = Path(args.base)
    deadline = time.time() + args.wait_base
    while not (base / "metrics.json").is_file() and time.time() < deadline:
        time.sleep(20)
    if (base / "metrics.json").is_file():
        fashion_mnist(res, base=base, train_limit=args.train_limit, eval_limit=args.eval_limit)
    else:
        print(f"{base}/metrics.json not found: Fashion-MNIST part skipped")
    write_json(out, res)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
