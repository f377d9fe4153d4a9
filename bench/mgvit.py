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

* ``up56``: the paper's geometry. Fashion-MNIST upsampled to 56 px and a dense 56 px, patch-4 ViT
  (``runs/base56``: 14x14 = 196 tokens, like DeiT-S's 14x14 at 224) is the dense base. MG-ViT's 7x7
  SGIS then sees 8 px coarse patches resampled to 4 px, i.e. the image at 28 px: its SGIS starts from
  the 28 px run (``--opt sgis_run=runs/base``), its MGIS from the 56 px run; head sub-patches are
  8/3 px (resampled), middle 4 px (whole pixels), tail 8 px. The upsampled images hold no detail
  beyond 28 px, so here the coarse stage loses little; on ImageNet it loses more (paper: 1.10 GFLOPs
  SGIS at 73.2% against 79.8% dense, Table 1).

Each is fine-tuned with ``nascompress.train.finetune`` (epsilon = 1, CE(MGIS) + KL) from its dense base;
the epsilon sweep (``nascompress.profiling.jobs.epsilon_sweep``) then runs on the full 10,000-image test set
against that base. Configs are merged into the existing JSON (one entry per config, each with its
own dense base).

    nascompress train --out runs/base56 --img-size 56 --weights runs/base/model.safetensors --epochs 2 \
        --lr 5e-4 --warmup-epochs 0.2
    python bench/mgvit.py --configs up56 --epochs 2 --train-limit 0 --label-smoothing 0 --threads 2 --iters 5

writes bench/results/mgvit.json (``--out``); ``--base`` / ``--base56`` name the dense runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from dataclasses import replace
from pathlib import Path

from _common import ROOT, data_sizes, header, save, wait_for_base  # noqa: E402  (puts the repository on sys.path)

import torch  # noqa: E402

import nascompress  # noqa: E402,F401
from nascompress.profiling.jobs import epsilon_sweep
from nascompress.runs.run_config import run_data_config  # noqa: E402
from nascompress.data import DataConfig, InputSpec, load_data, make_loader, preprocess  # noqa: E402
from nascompress.profiling.evaluate import evaluate  # noqa: E402
from nascompress.train.finetune import FinetuneJob, finetune, finetune_train_config  # noqa: E402
from nascompress.runs.io import load, load_with_arch  # noqa: E402
from nascompress.methods import get_method  # noqa: E402
from nascompress.models.build import ModelSpec, build_model  # noqa: E402
from nascompress.profiling import count_flops, time_models  # noqa: E402
from nascompress.runs.json_io import read_json  # noqa: E402

OUT = ROOT / "bench" / "results" / "mgvit.json"
EPSILONS = [0.5, 0.7, 0.9, 1.0]
EXTRA_EPS = [0.6, 0.8, 0.95, 0.99]


def deit_reference() -> dict:
    """Per-image GFLOPs of DeiT-S (random weights: counts do not depend on them)."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 224, 224)
    d = build_model(ModelSpec("deit_small_patch16_224", {}))
    out = {"dense_gflops": count_flops(d, x).gflops}
    for name, cfg in (("mgvit", {}), ("mgvit_no_ppsm", {"r_pos": 1.0, "r_neg": 0.0})):
        m, _ = get_method("mgvit").prepare_fresh(copy.deepcopy(d), cfg)
        f = m.eval().stage_flops()
        out[name] = {
            "sgis_gflops": f["sgis_flops"] / 1e9,
            "mgis_gflops": f["mgis_flops"] / 1e9,
            "ppsm_gflops": f["ppsm_flops"] / 1e9,
            "epsilon1_gflops": (f["sgis_flops"] + f["mgis_flops"]) / 1e9,
            "config": m.mg,
        }
    return out


def throughput(dense: torch.nn.Module, mg: torch.nn.Module, x: torch.Tensor, iters: int) -> dict:
    """Dense and MG-ViT at each epsilon, interleaved in one process on the same real test images."""
    models, labels = [dense], ["dense"]
    for e in EPSILONS:
        m = copy.deepcopy(mg)
        m.mg = dict(mg.mg, epsilon=e)
        models.append(m)
        labels.append(f"eps={e}")
    with torch.no_grad():
        t = time_models(models, x, warmup=2, iters=iters)
    return {lab: {"s_per_batch": ti, "img_per_s": x.shape[0] / ti, "vs_dense": t[0] / ti} for lab, ti in zip(labels, t)}


def configs(args: argparse.Namespace) -> dict[str, tuple[Path, dict, dict]]:
    """name -> (dense base run, MG-ViT config, recipe)."""
    base, base56 = Path(args.base), Path(args.base56)
    return {
        "grid4": (base, {"grid": 4}, {}),
        "grid7": (base, {"grid": 7}, {}),
        "up56": (base56, {"grid": 7}, {"sgis_run": str(base.resolve())}),
    }


def base_data(base: Path) -> DataConfig:
    return run_data_config(base) or DataConfig()


def batch_of(base: Path, n: int) -> tuple[torch.nn.Module, torch.Tensor]:
    dense, arch = load_with_arch(base)
    spec = InputSpec.from_dict(arch["input"])
    test = load_data(replace(base_data(base), train_limit=None, eval_limit=None), spec=spec).test
    imgs, _ = next(iter(make_loader(test, batch_size=n, shuffle=False)))
    return dense, preprocess(imgs, spec)


def rethroughput(args: argparse.Namespace, out: Path) -> None:
    torch.set_num_threads(args.threads)
    res = json.loads(out.read_text())
    cfgs = configs(args)
    for name, entry in res["configs"].items():
        if name not in args.configs.split(","):
            continue
        dense, xb = batch_of(cfgs[name][0], args.batch)
        mg = load(Path(args.runs) / f"bench_mgvit_{name}")
        entry[f"throughput_threads{args.threads}"] = dict(
            throughput(dense, mg, xb, args.iters), command=header()["command"]
        )
        save(out, res)
        print(name, json.dumps(entry[f"throughput_threads{args.threads}"]), flush=True)


def dense_entry(base: Path, test, spec: InputSpec) -> dict:
    dense, _ = load_with_arch(base)
    t0 = time.time()
    d_eval = evaluate(dense, test, input_spec=spec, device=torch.device("cpu"))
    d_flops = count_flops(dense, torch.randn(1, spec.in_chans, *spec.img_size)).total
    return {
        "run": str(base.relative_to(ROOT)) if base.is_relative_to(ROOT) else str(base),
        "img_size": list(spec.img_size),
        "test_top1": d_eval.top1,
        "flops": d_flops,
        "mflops": d_flops / 1e6,
        "test_n": d_eval.n,
        "eval_s": time.time() - t0,
        "metrics": read_json(base / "metrics.json"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="grid4,grid7", help="comma list of grid4, grid7, up56")
    ap.add_argument("--base", default=str(ROOT / "runs/base"), help="the 28 px dense run (grid4, grid7; up56's SGIS)")
    ap.add_argument("--base56", default=str(ROOT / "runs/base56"), help="the 56 px dense run (up56)")
    ap.add_argument("--train-limit", type=int, default=12800, help="0: the whole training split")
    ap.add_argument("--val-limit", type=int, default=2000, help="val/test images inside the fine-tune")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0, help="fine-tune seed and the seed of the data subsets")
    ap.add_argument("--batch", type=int, default=256, help="throughput batch (real test images)")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--wait", type=float, default=3600)
    ap.add_argument("--runs", default=str(ROOT / "runs"))
    ap.add_argument("--test-limit", type=int, default=None, help="dry runs only (a seeded class-stratified subset)")
    ap.add_argument("--skip-deit", action="store_true", help="keep the DeiT-S reference of --out as it is")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--throughput-only",
        action="store_true",
        help="re-time the saved fine-tuned runs into an existing JSON (key throughput_threads<N>)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    if args.throughput_only:
        return rethroughput(args, out)
    torch.set_num_threads(min(args.threads, os.cpu_count() or 1))
    t_start = time.time()
    h = header()
    res: dict = json.loads(out.read_text()) if out.is_file() else {}
    res.update({"device": "cpu", "epsilons": EPSILONS, "machine": h["machine"]})
    if not args.skip_deit or "deit_small_224" not in res:
        res["deit_small_224"] = deit_reference()
    old_dense, old_metrics = res.pop("dense", None), res.pop("base_metrics", None)  # older layout: one shared base
    for e in res.setdefault("configs", {}).values():
        if "dense" not in e and old_dense:
            e["dense"] = dict(old_dense, metrics=old_metrics)
    save(out, res)
    cfgs = configs(args)
    for name in args.configs.split(","):
        base, cfg, recipe = cfgs[name]
        wait_for_base(base, args.wait)
        spec = InputSpec.from_dict(read_json(base / "arch.json")["input"])
        # the sweep's test set: the base's dataset, every test image (or a seeded subset for dry runs)
        test_cfg = replace(base_data(base), train_limit=None, eval_limit=args.test_limit, subset_seed=args.seed)
        test_bundle = load_data(test_cfg, spec=spec)
        dense = dense_entry(base, test_bundle.test, spec)
        cfg = dict(cfg, epsilon=1.0)
        out_dir = Path(args.runs) / f"bench_mgvit_{name}"
        limit = args.train_limit or None
        t0 = time.time()
        data_cfg = replace(base_data(base), train_limit=limit, eval_limit=args.val_limit, subset_seed=args.seed)
        tc = finetune_train_config(
            "mgvit",
            epochs=args.epochs,
            batch_size=128,
            lr=args.lr,
            min_lr=1e-5,
            warmup_epochs=0.1,
            seed=args.seed,
            label_smoothing=args.label_smoothing,
            device="cpu",
        )
        entry: dict = {
            "command": h["command"],
            "dense": dense,
            "method_config": cfg,
            "recipe": recipe,
            "train_images": limit or "all",
            "epochs": args.epochs,
            "lr": args.lr,
            "label_smoothing": args.label_smoothing,
            "threads": torch.get_num_threads(),
            "finetune_data": data_sizes(load_data(data_cfg, spec=spec), data_cfg),
            "test_data": data_sizes(test_bundle, test_cfg),
            "note": f"fine-tuned from the dense base, epsilon=1, CE(MGIS)+KL(SGIS||MGIS); val/test inside the "
            f"fine-tune limited to {args.val_limit} images; the sweep uses test_data",
        }
        m = finetune(
            FinetuneJob(
                run_dir=str(base), method="mgvit", config=cfg, recipe=recipe, data=data_cfg, train=tc, out=str(out_dir)
            ),
            force=True,
        )
        entry["finetune_metrics"] = m.to_dict()
        entry["finetune_s"] = time.time() - t0
        mg = load(out_dir)
        t0 = time.time()
        sw = epsilon_sweep(out_dir, sorted(EPSILONS + EXTRA_EPS), data=test_cfg, split="test", device="cpu").to_dict()
        entry["sweep_s"] = time.time() - t0
        for r in sw["rows"]:
            r["delta_top1_vs_dense"] = r["top1"] - dense["test_top1"]
            r["flops_vs_dense"] = r["mean_flops"] / dense["flops"]
        entry.update(sw)
        entry["record"] = read_json(out_dir / "arch.json")["methods"][-1]
        entry["throughput_batch"] = args.batch
        dmodel, xb = batch_of(base, args.batch)
        entry["throughput"] = throughput(dmodel, mg, xb, args.iters)
        res["configs"][name] = entry
        res["elapsed_s"] = time.time() - t_start
        save(out, res)
        print(
            json.dumps(
                {
                    name: [
                        (r["epsilon"], round(r["top1"], 2), round(r["exit_share"], 3), round(r["mean_flops"] / 1e6, 2))
                        for r in sw["rows"]
                    ]
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
