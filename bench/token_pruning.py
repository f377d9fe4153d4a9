"""EViT and DynamicViT, measured.

1. CPU throughput against dense, interleaved in one process (``time_models``), on a DeiT-S-shaped
   model at 224 (deit_small_patch16_224, random weights, eval): EViT keep_rate 0.7 at layers
   4/7/10 and DynamicViT rho 0.7 (untrained predictors: the token counts, hence the cost, do
   not depend on the weights), batch 1 and batch 64, with the FLOPs of each.
2. Fashion-MNIST from the dense base run: test top-1 and FLOPs of the dense base on the same test
   images, then of each method at two settings zero-shot and after a short fine-tune
   (``nascompress.train.finetune``: 1 epoch on a seeded class-stratified subset of ``--train-limit``
   training images). DynamicViT zero-shot is recorded twice: with untrained predictors
   (``predictor_steps=0``: a random token choice) and after the library's predictor-only stage
   (the default of ``finetune --zero-shot``: recipe ``predictor_steps``, backbone frozen).

    python bench/token_pruning.py --base runs/base --skip-throughput --train-limit 6000 --eval-limit 5000
    python bench/token_pruning.py --skip-fmnist --iters 6

Both write into (and merge with) bench/results/token_pruning.json (``--out``).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from _common import data_sizes, header, save  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402

import nascompress  # noqa: E402
from nascompress.profiling.jobs import evaluate_run
from nascompress.runs.run_config import run_data_config  # noqa: E402
from nascompress.data import DataConfig, InputSpec, load_data  # noqa: E402
from nascompress.train.finetune import FinetuneJob, finetune, finetune_train_config  # noqa: E402
from nascompress.methods import get_method  # noqa: E402
from nascompress.methods.dynamicvit import DynamicViTRecipe  # noqa: E402
from nascompress.models.build import ModelSpec, build_model  # noqa: E402
from nascompress.profiling import count_flops, time_models  # noqa: E402
from nascompress.runs.json_io import read_json  # noqa: E402

# (method, config, absolute peak lr of the 1-epoch fine-tune at batch 128)
SETTINGS = [
    ("evit", {"keep_rate": 0.7}, 1e-4),
    ("evit", {"keep_rate": 0.5}, 1e-4),
    ("dynamicvit", {"rho": 0.7}, 1e-3),
    ("dynamicvit", {"rho": 0.5}, 1e-3),
]


def throughput(res: dict, *, model: str, img_size: int, batch: int, iters: int) -> None:
    kwargs = {} if img_size == 224 else {"img_size": img_size}
    dense = build_model(ModelSpec(model, kwargs)).eval()
    evit, _ = get_method("evit").prepare_fresh(copy.deepcopy(dense), {"keep_rate": 0.7})
    dvit, _ = get_method("dynamicvit").prepare_fresh(copy.deepcopy(dense), {"rho": 0.7})
    names, models = ["dense", "evit_0.7", "dynamicvit_0.7"], [dense, evit.eval(), dvit.eval()]
    x1 = torch.randn(1, 3, img_size, img_size)
    out: dict = {
        "model": f"{model} (random weights, eval, {img_size}x{img_size})",
        "threads": torch.get_num_threads(),
        "gflops": {n: count_flops(m, x1).gflops for n, m in zip(names, models)},
    }
    out["gflops_predictors_dynamicvit"] = sum(b.get("other", 0.0) for b in count_flops(dvit, x1).blocks) / 1e9
    for bs, it in ((1, iters * 3), (batch, iters)):
        x = torch.randn(bs, 3, img_size, img_size)
        t = time_models(models, x, warmup=1 if bs > 1 else 3, iters=it)
        out[f"batch{bs}"] = {
            "iters": it,
            "median_s": dict(zip(names, t)),
            "images_per_s": {n: bs / s for n, s in zip(names, t)},
            "speedup_vs_dense": {n: t[0] / s for n, s in zip(names[1:], t[1:])},
        }
        print(json.dumps(out[f"batch{bs}"]), flush=True)
    res["throughput"] = out


def fashion_mnist(
    res: dict, *, base: Path, train_limit: int, eval_limit: int | None, seed: int, batch_size: int, runs: Path | None
) -> None:
    data = replace(
        run_data_config(base) or DataConfig(), train_limit=train_limit, eval_limit=eval_limit, subset_seed=seed
    )
    arch = read_json(base / "arch.json")
    spec = InputSpec.from_dict(arch["input"])
    x = torch.randn(64, spec.in_chans, *spec.img_size)
    dense = nascompress.load(base)
    dense_test = evaluate_run(base, data=data, device="cpu")  # the same test images as every row below
    out: dict = {
        "base": str(base),
        "base_metrics": read_json(base / "metrics.json"),
        "dense_test_top1": dense_test.top1,
        "dense_test_n": dense_test.n,
        "dense_mflops": count_flops(dense, x).total / 1e6,
        "train_limit": train_limit,
        "eval_limit": eval_limit,
        "seed": seed,
        "data": data_sizes(load_data(data, spec=spec), data),
        "predictor_steps_default": DynamicViTRecipe().predictor_steps,
        "runs": [],
    }
    print("dense", json.dumps({k: out[k] for k in ("dense_test_top1", "dense_test_n", "dense_mflops")}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = runs or Path(tmp)
        for method, cfg, lr in SETTINGS:
            row = {"method": method, "config": cfg}
            variants = [("zero_shot", True, {})]
            if method == "dynamicvit":  # untrained predictors, and the library's predictor-only stage (default)
                variants = [("zero_shot_untrained_predictors", True, {"predictor_steps": 0}), ("zero_shot", True, {})]
            variants.append(("finetuned", False, {}))
            for tag, zero_shot, recipe in variants:
                tc = finetune_train_config(
                    method,
                    epochs=1,
                    batch_size=batch_size,
                    lr=lr,
                    warmup_epochs=0.0,
                    min_lr=lr / 100,
                    seed=seed,
                    device="cpu",
                )
                job = FinetuneJob(
                    run_dir=str(base),
                    method=method,
                    config=dict(cfg),
                    recipe=dict(recipe),
                    data=data,
                    train=tc,
                    out=str(root / f"{method}_{list(cfg.values())[0]}_{tag}"),
                    zero_shot=zero_shot,
                )
                t0 = time.perf_counter()
                m = finetune(job, force=True)
                model = nascompress.load(job.out)
                row[tag] = {
                    "test_top1": m.test_top1,
                    "test_n": m.test_n,
                    "seconds": time.perf_counter() - t0,
                    "mflops": count_flops(model, x).total / 1e6,
                    "top1_minus_dense": m.test_top1 - dense_test.top1,
                }
                if zero_shot:
                    row[tag]["calibration"] = m.calibration
                    if method == "dynamicvit":
                        row[tag]["predictor_steps"] = recipe.get("predictor_steps", DynamicViTRecipe().predictor_steps)
                        row[tag]["predictor_stage_batch_size"] = batch_size
                else:
                    row[tag].update(
                        lr=lr,
                        batch_size=batch_size,
                        epochs=1,
                        train_images=out["data"]["train_images"],
                        best_epoch=m.best_epoch,
                        start_val_top1=m.start_val_top1,
                        best_val_top1=m.best_val_top1,
                        kept_start=m.best_epoch == 0,
                    )
                print(method, cfg, tag, json.dumps(row[tag]), flush=True)
            out["runs"].append(row)
    out["note"] = (
        "zero_shot: the method applied to the dense weights without training the backbone (EViT: "
        "nothing to train; DynamicViT: after the predictor-only stage, predictor_steps steps with the "
        "backbone frozen, distilled to the dense run, as `nascompress finetune --zero-shot` does). "
        "zero_shot_untrained_predictors: DynamicViT with randomly initialised predictors, i.e. a random "
        "token choice. finetuned: 1 epoch of nascompress.train.finetune on a seeded class-stratified subset of "
        "train_limit training images (EViT: CE at its target keep rate from the first "
        "step; DynamicViT: CE + 0.5 KL + 0.5 token MSE + 2 ratio loss against the dense run, predictors "
        "at lr, backbone at 0.01 lr); fit evaluates the start first and keeps it if training only hurt "
        "(kept_start). Test top-1 on the same seeded class-stratified test subset as dense_test_top1. "
        "FLOPs per image (MACs)."
    )
    res["fashion_mnist"] = out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="runs/base")
    ap.add_argument("--out", default="bench/results/token_pruning.json")
    ap.add_argument("--iters", type=int, default=6, help="timed rounds at batch 64 (x3 at batch 1)")
    ap.add_argument("--throughput-model", default="deit_small_patch16_224")
    ap.add_argument("--throughput-img-size", type=int, default=224)
    ap.add_argument("--throughput-batch", type=int, default=64)
    ap.add_argument("--train-limit", type=int, default=12000)
    ap.add_argument("--eval-limit", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0, help="fine-tune seed and the seed of the data subsets")
    ap.add_argument("--batch-size", type=int, default=128, help="fine-tune (and predictor stage) batch")
    ap.add_argument("--runs", default=None, help="keep the fine-tuned runs here (default: a temporary folder)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-throughput", action="store_true", help="keep the throughput part of --out as it is")
    ap.add_argument("--skip-fmnist", action="store_true", help="keep the Fashion-MNIST part of --out as it is")
    ap.add_argument("--wait-base", type=float, default=0, help="seconds to wait for base/metrics.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    res: dict = json.loads(out.read_text()) if out.is_file() else {}
    h = header()
    res["machine"] = h["machine"]
    res.setdefault("commands", {})
    if not args.skip_throughput:
        res["commands"]["throughput"] = h["command"]
        throughput(
            res,
            model=args.throughput_model,
            img_size=args.throughput_img_size,
            batch=args.throughput_batch,
            iters=args.iters,
        )
        res["throughput"]["machine"] = h["machine"]
        save(out, res)
    if args.skip_fmnist:
        save(out, res)
        return
    base = Path(args.base)
    deadline = time.time() + args.wait_base
    while not (base / "metrics.json").is_file() and time.time() < deadline:
        time.sleep(20)
    if (base / "metrics.json").is_file():
        res["commands"]["fashion_mnist"] = h["command"]
        fashion_mnist(
            res,
            base=base,
            train_limit=args.train_limit,
            eval_limit=args.eval_limit,
            seed=args.seed,
            batch_size=args.batch_size,
            runs=Path(args.runs) if args.runs else None,
        )
        res["fashion_mnist"]["machine"] = h["machine"]
    else:
        print(f"{base}/metrics.json not found: Fashion-MNIST part skipped")
    save(out, res)
    print(json.dumps({k: v for k, v in res.items() if k != "fashion_mnist"}, indent=2)[:4000])


if __name__ == "__main__":
    main()
